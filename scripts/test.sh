#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite.
#
#   bash scripts/test.sh                      the whole suite (what CI runs)
#   bash scripts/test.sh -m quick             the inner loop: every test that starts no vLLM engine
#   bash scripts/test.sh --hypothesis-seed=2  the whole suite, another draw
#   bash scripts/test.sh tests/reshard/test_plan.py   those files only
#   bash scripts/test.sh tests/transfer       one folder (tests/README.md: which folder tests what)
#
# The whole suite runs as two pytest sessions at once: the engine files (-m "not quick":
# CPU-bound, vLLM start-ups) on 2 pytest-xdist workers, the quick tier (no engine; mostly
# waits on timeouts, sockets and child processes) on 2 more. One session of 2 workers
# left the cores idle for the last two minutes, while only quick files ran; 3 workers
# in one session were slower (three engine files contending). With -m, -k or test paths
# it is one session. DCP2D_TEST_WORKERS sets the workers of a one-session run (1: serial);
# DCP2D_TEST_SPLIT=0 makes the whole suite one session too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_FORCE_TCP=1 MC_LOG_LEVEL=${MC_LOG_LEVEL:-WARNING}

# Each test file on one worker (a module's cluster fixture is built once), files handed out in
# conftest.py's order (longest first).
run() {  # run WORKERS PORT_SLICE [pytest args]
    local workers=$1 slice=$2 rc=0
    shift 2
    DCP2D_PORT_SLICE=$slice .venv/bin/python -m pytest -q -rs --durations=25 -n "$workers" \
        --dist loadfile --no-loadscope-reorder "$@" || rc=$?
    if [ $rc -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi
    return $rc
}

split=${DCP2D_TEST_SPLIT:-1}
for a in "$@"; do
    case "$a" in -m|-m*|-k|-k*|tests*|*.py|*.py::*) split=0 ;; esac
done
if [ -n "${DCP2D_TEST_WORKERS:-}" ]; then split=0; fi

if [ "$split" = 0 ]; then
    workers=2
    case " $* " in *" -m quick "*|*" -mquick "*) workers=3 ;; esac
    set +e
    run "${DCP2D_TEST_WORKERS:-$workers}" 0/1 "$@"
    exit $?
fi

quick_log=$(mktemp -t dcp2d-quick.XXXXXX)
trap 'rm -f "$quick_log"' EXIT
start=$(date +%s)
run 2 1/2 -m quick "$@" > "$quick_log" 2>&1 &
quick=$!
set +e
run 2 0/2 -m "not quick" "$@"
engines_rc=$?
wait $quick
quick_rc=$?
set -e
echo
echo "================ the quick tier (-m quick), run alongside ================"
cat "$quick_log"
echo
echo "engine files: exit $engines_rc; quick tier: exit $quick_rc; $(( $(date +%s) - start )) s for both"
[ $engines_rc -eq 0 ] && [ $quick_rc -eq 0 ]
