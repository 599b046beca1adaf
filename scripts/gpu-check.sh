#!/usr/bin/env bash
# Every GPU path of vllm_dcp2d in one run on one GPU, printed as one PASS/FAIL table
# (rows: vllm_dcp2d/gpu_check.py; docs/connector.md, "GPU check"), after the table
# of vLLM patches and whether each fits the vLLM under test (vllm-dcp2d compat).
# Under 8 minutes in all (the rows share a 470 s budget); exits 0 iff no row failed,
# 2 at once on a machine without a GPU.
#
#   bash scripts/gpu-check.sh [--vllm 0.32.0|0.33.0|0.34.0] [--rows ...] [--budget S]
#
# --vllm VERSION installs that vLLM (CUDA build), Mooncake's CUDA wheel and this package
# into .venv-gpu-VERSION first (once), and runs there; without it, the current Python
# ($PYTHON or .venv) is used. Other arguments go to gpu_check (--rows, --budget).
set -euo pipefail
cd "$(dirname "$0")/.."
version=""
if [ "${1:-}" = "--vllm" ]; then
  version=${2:?--vllm needs a version, e.g. 0.34.0}
  shift 2
  case "$version" in 0.32.0|0.33.0|0.34.0) ;; *) echo "--vllm $version: vllm_dcp2d supports 0.32.0, 0.33.0 and 0.34.0" >&2; exit 2 ;; esac
fi
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! nvidia-smi -L >/dev/null 2>&1; then
  printf '%-14s %-6s %s\n' check result detail gpu FAIL "no NVIDIA GPU (nvidia-smi -L failed or is missing); this check needs one"
  exit 2
fi
if [ -n "$version" ]; then
  venv=.venv-gpu-$version
  if [ ! -f "$venv/.ok" ]; then
    echo "[gpu-check] installing vllm==$version (CUDA) into $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "vllm==$version" "mooncake-transfer-engine>=0.3.13" "pyzmq>=25" -e ".[test]"
    touch "$venv/.ok"
  fi
  PY=$venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MC_FORCE_TCP=1 MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
unset TRITON_INTERPRET  # vLLM compiles its own Triton kernels on the GPU
"$PY" -m vllm_dcp2d.vllm_compat.registry || echo "[gpu-check] some DCP2D instances are refused on this vLLM (above)"
exec timeout 480 "$PY" -m vllm_dcp2d.gpu_check "$@"
