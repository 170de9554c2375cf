# `make demo` and `make test` work on a fresh machine with only Python 3.11: they create .venv,
# install bigbatch with pinned dev/CI versions (constraints.txt), then run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PATHS := src tests examples benchmarks

.PHONY: venv test test-fast lint typecheck unit demo bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq -c constraints.txt -e '.[train,seg,dicom,plot,dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(PATHS)
	$(BIN)/ruff format --check $(PATHS)

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

# The tests that take well under a second each (about a minute in all): while you work.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test: lint typecheck unit

demo: $(STAMP)
	$(BIN)/python examples/demo_digits.py
	$(BIN)/bigbatch demo --out demo_output
	$(BIN)/bigbatch demo --task segmentation --out demo_output/segmentation
	$(BIN)/bigbatch demo --task brats --out demo_output/brats

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
