#!/usr/bin/env bash
# Every GPU path of vllm_dcp2d that one GPU can run, as one PASS/FAIL table (rows and what each
# proves and cannot on one GPU: vllm_dcp2d/gpu_check.py; docs/gpu.md), after the table of vLLM
# patches and whether each fits the vLLM under test (vllm-dcp2d compat).
#
#   bash scripts/gpu-check.sh [--vllm 0.32.0|0.33.0|0.34.0 [--wheels DIR] [--install-timeout S] [--install-only]]
#                             [--rows ...] [--budget S]
#
# --vllm VERSION runs in .venv-gpu-VERSION, made once with that vLLM (CUDA build), Mooncake's CUDA wheel
# and this package; without it, in the current Python ($PYTHON or .venv). --wheels DIR installs from the
# wheels in DIR only (pip --no-index: no network needed; make DIR on a connected machine with the command
# this script prints when DIR lacks a wheel), else from the package index. The install is bounded by
# --install-timeout (default 1800 s) and is not part of the rows' budget (--budget, default 470 s; the rows
# stop within 480 s). --install-only prepares the venv and stops (no GPU needed). Other arguments go to
# gpu_check (--rows, --budget).
#
# Steps, in order: the arguments and DIR (offline) -> the GPU (nvidia-smi -L: the first GPU step) -> the
# install -> the patch table -> the rows. A step that fails prints one line naming it and exits 2; then
# the exit code is 0 iff no row failed.
set -euo pipefail
cd "$(dirname "$0")/.."
version="" wheels="" install_timeout=1800 install_only=0 rest=()
fail() { printf '%-14s %-6s %s\n' check result detail "$1" FAIL "$2"; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) version=${2:?--vllm needs a version, e.g. 0.34.0}; shift 2 ;;
    --wheels) wheels=${2:?--wheels needs a directory of wheels}; shift 2 ;;
    --install-timeout) install_timeout=${2:?--install-timeout needs seconds}; shift 2 ;;
    --install-only) install_only=1; shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
if [ -n "$version" ]; then
  case "$version" in 0.32.0|0.33.0|0.34.0) ;; *) fail args "--vllm $version: vllm_dcp2d supports 0.32.0, 0.33.0 and 0.34.0" ;; esac
  [[ "$install_timeout" =~ ^[1-9][0-9]*$ ]] || fail args "--install-timeout $install_timeout: expected whole seconds > 0"
fi
[ -z "$wheels" ] || [ -n "$version" ] \
  || fail args "--wheels $wheels: give --vllm VERSION too (the wheels are installed into .venv-gpu-VERSION)"
need=("vllm==$version" "mooncake-transfer-engine>=0.3.13" "pyzmq>=25")
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || fail wheels "--wheels $wheels: not a directory"
  wheels=$(cd "$wheels" && pwd)
  make_dir="pip download -d $wheels ${need[*]} 'setuptools>=68' numpy msgpack aiohttp prometheus_client"
  compgen -G "$wheels/vllm-$version-*.whl" >/dev/null \
    || fail wheels "--wheels $wheels has no vllm-$version wheel; make the directory with: $make_dir"
  compgen -G "$wheels/mooncake_transfer_engine-[0-9]*.whl" >/dev/null \
    || fail wheels "--wheels $wheels has no mooncake-transfer-engine (CUDA) wheel; make the directory with: $make_dir"
fi

# The first GPU step. Everything above ran without a GPU and without the network.
if [ "$install_only" = 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  fail gpu "no NVIDIA GPU (nvidia-smi -L failed or is missing); this check needs one"
fi

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -n "$version" ]; then
  venv=.venv-gpu-$version
  stamp="$version ${wheels:-index} $( [ -n "$wheels" ] && ls "$wheels" | sha256sum | cut -c1-16 )"
  if [ ! -f "$venv/.ok" ] || [ "$(cat "$venv/.ok")" != "$stamp" ]; then
    log=$(mktemp -t gpu-check-install.XXXXXX)
    echo "[gpu-check] installing vllm==$version (CUDA) into $venv from ${wheels:-the package index} (at most ${install_timeout} s; log $log)"
    src=() clean=()
    # From DIR alone: no index, and none of the machine's pip configuration (find-links, extra indexes).
    [ -z "$wheels" ] || { src=(--no-index --find-links "$wheels"); clean=(env -u PIP_FIND_LINKS -u PIP_INDEX_URL
      -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null); }
    t0=$SECONDS
    rc=0
    ${clean[@]+"${clean[@]}"} timeout "$install_timeout" bash -c 'python3 -m venv --clear "$1"; shift; exec "$@"' _ "$venv" \
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "${src[@]}" "${need[@]}" -e . >"$log" 2>&1 \
      || rc=$?
    if [ "$rc" = 124 ]; then
      fail install "installing vllm==$version ran past --install-timeout $install_timeout s (log $log)"
    elif [ "$rc" != 0 ]; then
      why=$(grep -m1 -E '^ERROR' "$log" || tail -1 "$log")
      fail install "pip exited $rc installing vllm==$version from ${wheels:-the package index}: $why (log $log)"
    fi
    echo "$stamp" > "$venv/.ok"
    echo "[gpu-check] installed in $((SECONDS - t0)) s"
  fi
  PY=$venv/bin/python
fi
[ "$install_only" = 0 ] || { echo "[gpu-check] $PY is ready (--install-only)"; exit 0; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MC_FORCE_TCP=1 MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
unset TRITON_INTERPRET  # vLLM compiles its own Triton kernels on the GPU
"$PY" -m vllm_dcp2d.vllm_compat.registry || echo "[gpu-check] some DCP2D instances are refused on this vLLM (above)"
exec timeout 480 "$PY" -m vllm_dcp2d.gpu_check ${rest[@]+"${rest[@]}"}
