#!/usr/bin/env bash
# Every GPU path of vllm_dcp2d in one run on one GPU, printed as one PASS/FAIL table
# (rows: vllm_dcp2d/testing/gpu_check.py; docs/connector.md, "GPU check").
# Under 8 minutes in all (the rows share a 470 s budget); exits 0 iff no row failed,
# 2 at once on a machine without a GPU. Arguments go to gpu_check (--rows, --budget).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! nvidia-smi -L >/dev/null 2>&1; then
  printf '%-14s %-6s %s\n' check result detail gpu FAIL "no NVIDIA GPU (nvidia-smi -L failed or is missing); this check needs one"
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MC_FORCE_TCP=1 MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
exec timeout 480 "$PY" -m vllm_dcp2d.testing.gpu_check "$@"
