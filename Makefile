# The two commands a newcomer runs: `make run` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean-dev

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Starts the embedded default and keeps serving until Ctrl-C.
run: $(STAMP)
	$(BIN)/raftmq dev

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-dev:
	rm -rf .raftmq-dev
