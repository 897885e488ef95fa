# The two commands a newcomer runs: `make run` and `make test`. Both build .venv on first use.
# The interpreter the venv is built from. Everything here is CPU-bound Python, and the build of the interpreter shows:
# the distribution's (Debian's: PGO, LTO, libpython linked into the executable) ran the brokers and the bench ~9 %
# leaner per message than a pyenv build made without --enable-optimizations and with --enable-shared, the python3
# first on PATH on our machines (docs/benchmarks.md, twenty-second session). So /usr/bin/python3 comes first when it
# is >= 3.11 and can build a venv with pip; `make PYTHON=/path/to/python3 ...` picks another (a venv already built
# stays as it is: `rm -rf .venv` first).
PYTHON ?= $(shell for p in /usr/bin/python3 python3; do \
	"$$p" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo "$$p"; break; }; \
	done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install system-deps clean-dev

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "no Python >= 3.11 with venv and ensurepip; set PYTHON=/path/to/python3" >&2; \
		exit 1; }
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
