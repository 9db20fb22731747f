# The two commands of the README: `make up` (install, build the demo models, run the
# demo) and `make test` (lint, types, tests). Everything lives in .venv and .lanes/.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3

# Prefect must never phone home, and keeps its database inside the project.
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(CURDIR)/.lanes/prefect

.PHONY: install models up test lint

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

models: install
	$(BIN)/lanes models build

up: models
	$(BIN)/lanes validate
	$(BIN)/lanes plan
	$(BIN)/lanes predict search-query --input '"how do I reverse a list in python"' | cut -c1-120
	$(BIN)/lanes predict flower-classify --input '{"features": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]}'
	$(BIN)/lanes predict code-complete --input '{"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}'
	$(BIN)/lanes predict embed-corpus --input '"nobody waits for this one"' | cut -c1-120

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q
