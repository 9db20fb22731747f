# The two commands of the README: `make up` (install, build the demo models, run the
# demo) and `make test` (lint, types, tests). Everything lives in .venv and .lanes/.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# Test files run side by side: most of their time is spent waiting on servers and workers.
# Whole files, in collection order: tests/conftest.py puts the longest first.
TEST_WORKERS ?= 3

# Prefect must never phone home, and keeps its database inside the project.
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(CURDIR)/.lanes/prefect

.PHONY: install models up test lint

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	mkdir -p $(PREFECT_HOME)
	touch $@

install: $(BIN)/.installed

models: install
	$(BIN)/lanes models build

up: models
	VENV=$(VENV) bash scripts/demo.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The demo models build while lint and types run (both need only the install): the tests
# then find them built, and the two cores are busy from the start.
test: install
	$(MAKE) --no-print-directory -j2 --output-sync=target lint models
	mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
