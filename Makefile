# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Both call `make setup`, which is idempotent.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
CONFIG ?= train_configs/kimi_k2_7_code/debug.toml

.PHONY: setup train test

setup: $(VENV)/.installed

# A machine whose Python already has a CUDA torch (the H200 machine) reuses it
# through --system-site-packages; elsewhere torch 2.13.0 (a local CPU wheel) is
# installed first, so that no dependency pulls a CUDA build.
$(VENV)/.installed: pyproject.toml setup.py
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "setup: reusing this machine's CUDA torch"; \
		[ -x $(BIN)/python ] || $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV); \
		$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

train: setup
	$(BIN)/torchrun --nproc_per_node $(NPROC) -m titan_mok.train --config $(CONFIG)

# The suite in TEST_WORKERS pytest-xdist workers, a test file at a time each (a module's fixtures run once; a
# Triton-interpreter test keeps one core busy, a torchrun job's ranks wait on each other), then alone the tests
# marked serial (they time a run or race one: another worker's load would be in it) and two_gpus (as
# benchmarks/gpu_checks.sh runs them).
# TEST_WORKERS=0: the first part in one process, in order.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial and not two_gpus" tests; \
	parallel=$$?; $(BIN)/python -m pytest -q -m "serial or two_gpus" tests && exit $$parallel
