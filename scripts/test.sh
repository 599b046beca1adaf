#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_FORCE_TCP=1 MC_LOG_LEVEL=${MC_LOG_LEVEL:-WARNING}
# pytest-xdist workers, each test file on one worker (a module's cluster fixture is built once),
# files handed out in conftest.py's order (longest first): 2 for the whole suite on 2 cores
# (3 measured slower: 23.7 vs 22.0 min, seven engines contending), 3 for the quick tier
# (no vLLM engine, mostly waits).
workers=2
case " $* " in *" -m quick "*|*" -mquick "*) workers=3 ;; esac
workers=${DCP2D_TEST_WORKERS:-$workers}
set +e
.venv/bin/python -m pytest -q -rs --durations=25 -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi
exit $rc
