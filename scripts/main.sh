#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vllm-dcp2d plan --num-layers 78 --cp 8 --dcp 4 --tokens 32768 --page-size 64 \
    --bytes-per-token-layer 576 "$@"
