#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_FORCE_TCP=1 MC_LOG_LEVEL=${MC_LOG_LEVEL:-WARNING}
set +e
.venv/bin/python -m pytest -q -rs --durations=25 "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi
exit $rc
