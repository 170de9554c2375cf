# `make demo` and `make test` work on a fresh machine with only Python 3.11: they create a venv,
# install bigbatch with pinned versions (constraints.txt), then run. `make demo` installs only
# what the demo needs (.venv-demo); `make test` everything (.venv).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_VENV := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed-stamp
PATHS := src tests examples benchmarks docs/hooks conftest.py

.PHONY: venv test test-fast lint typecheck unit docs install-check demo bench gpu-evidence clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) .ci/check_disk.py --need-gib 14 --for "the test venv (torch, and TensorFlow and JAX for Keras' backends) and the tests' temporary runs"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq -c constraints.txt -e '.[train,seg,dicom,plot,dev,docs,nnunet,hf,tensorboard,wandb,mlflow]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(PATHS)
	$(BIN)/ruff format --check $(PATHS)

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

# The tests not marked slow (under 2 s each; about three and a half minutes here): while you work.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# The docs site into site/; strict: a broken link or reference fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The wheel and sdist as a user installs them, outside the checkout (.ci/install_check.sh; the
# tests run it too, in tests/cli/test_cli_demo.py, and check the demo it runs).
install-check: $(STAMP)
	DEV_PYTHON=$(BIN)/python bash .ci/install_check.sh

test: lint typecheck unit docs

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(DEMO_VENV)/bin/python || $(PYTHON) .ci/check_disk.py --need-gib 8 --for "the demo's venv (torch, timm, MONAI) and its runs"
	test -x $(DEMO_VENV)/bin/python || $(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -qq -c constraints.txt -e '.[train,seg,plot]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/python examples/demo_digits.py
	$(DEMO_VENV)/bin/bigbatch demo --out demo_output
	$(DEMO_VENV)/bin/bigbatch demo --task segmentation --out demo_output/segmentation
	$(DEMO_VENV)/bin/bigbatch demo --task regression --out demo_output/regression
	$(DEMO_VENV)/bin/bigbatch demo --task brats --out demo_output/brats
	$(DEMO_VENV)/bin/bigbatch demo --task clouds --out demo_output/clouds

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# Everything bigbatch measures on a GPU, in one time-boxed run (about 8 minutes on one GPU);
# results under benchmarks/results/<gpu>-cuda<version>-<date>/ (commit them). On a machine
# without a network, the wheels benchmarks/prepare_gpu_wheels.sh put in .whl/ are installed
# first; its own python3 (with torch) runs it where there is no .venv. DRY=1: tiny workloads
# on the CPU, every part (the tests run it too).
EVIDENCE_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-evidence:
	@if [ -z "$(DRY)" ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then \
		$(EVIDENCE_PY) -m pip install -q --no-index --no-deps --no-compile --target build/gpu-site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR)/src:$(CURDIR)/build/gpu-site$${PYTHONPATH:+:$$PYTHONPATH} \
		$(EVIDENCE_PY) benchmarks/gpu_evidence.py $(if $(DRY),--dry-run)

clean:
	rm -rf $(VENV) $(DEMO_VENV) site .pytest_cache .mypy_cache .ruff_cache
