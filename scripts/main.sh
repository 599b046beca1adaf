#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job: the end-to-end demo (tiny local
# model; prefill TP=2 as 2 layer-split ranks -> decode TP=2 DCP=2 through the PD proxy).
# Extra arguments go to `vllm-dcp2d demo` (e.g. --model PATH on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_FORCE_TCP="${MC_FORCE_TCP:-1}" MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
exec .venv/bin/vllm-dcp2d demo "$@"
