# The two commands a newcomer runs: `make run` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install system-deps clean-dev

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Starts the embedded default and keeps serving until Ctrl-C.
run: $(STAMP)
	$(BIN)/raftmq dev

# The partition tests build private networks in namespaces with iproute2's `ip` (tests/netns.py): installed
# here where it is missing and we may (root with apt-get); elsewhere those tests skip and say why.
system-deps:
	@if ! command -v ip >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; fi

# Two workers (pytest-xdist): the tests marked `load` run one after another in one of them (tests/conftest.py),
# the rest beside them in the other. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(STAMP) system-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

clean-dev:
	rm -rf .raftmq-dev
