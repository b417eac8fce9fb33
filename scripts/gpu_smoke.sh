#!/usr/bin/env bash
# make gpu-smoke: the checks one GPU can make of the CUDA paths, as one prepared run of at most ten
# minutes that prints a table and exits non-zero on any failure (scripts/gpu_smoke.py says what
# each check holds). `bash scripts/gpu_smoke.sh --multi` (make gpu-smoke-multi): the checks that need
# two or more GPUs. Uses .venv when there is one (make setup), else the python on PATH (a CUDA
# image's torch); installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" scripts/gpu_smoke.py "$@"
