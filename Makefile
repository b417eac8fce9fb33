# The two commands of the README: `make run` and `make test`. Both create .venv when missing and
# install the project into it (torch first and pinned, so pip never pulls a multi-GB CUDA build on
# a CPU machine), then do their job. Both are no-ops for set-up when nothing changed.

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
# The stamp names the torch spec, so changing TORCH_SPEC reinstalls; pyproject.toml changes too.
STAMP := $(VENV)/.installed-$(shell printf '%s' '$(TORCH_SPEC)' | md5sum | cut -c1-10)
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (tests/conftest.py groups the tests; 0 runs them in one process).
TEST_WORKERS ?= 2

.PHONY: run test lint setup bench gpu-smoke gpu-smoke-multi clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

run: $(STAMP)
	$(PY) run.py $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Side-by-side ratios against plain PyTorch, bare collectives and the tool itself; minutes.
bench: $(STAMP)
	$(PY) benchmarks/run.py

# What one GPU proves of the CUDA paths (scripts/gpu_smoke.py): a table, non-zero on any failure,
# at most ten minutes. Needs CUDA; uses .venv if present, else the python on PATH; installs nothing.
gpu-smoke:
	bash scripts/gpu_smoke.sh

# The checks that need two or more GPUs: nccl at world > 1, a GPU per rank under local, Ray, Slurm.
gpu-smoke-multi:
	bash scripts/gpu_smoke.sh --multi

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
