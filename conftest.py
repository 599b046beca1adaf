"""Root pytest configuration: how tests and the processes they start import their helpers,
hypothesis' profile, the quick marker, and the order files are handed to xdist workers."""

import os

# Tests import their helpers as ``tests.support.<module>`` (tests/README.md): every folder
# under tests/ is a package, so pytest puts this directory on sys.path. The processes a test
# starts (helper scripts run by path, engines running a test file, vLLM's workers loading
# ``tests.support.spec_probe``, spawned ranks) import them the same way: PYTHONPATH.
ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

# The DCP2D instances tests start fork their engine core and TP workers (cpu_start_method,
# vllm_compat/startup.py): each spawned one imports vLLM anew, ~7 CPU-s, most of the suite's
# CPU on a 2-core machine. test_e2e.py's cluster keeps vLLM's spawn, the default users get.
os.environ.setdefault("DCP2D_CPU_START_METHOD", "fork")

# Hypothesis: the README's test command draws new cases on every run (property
# tests size every buffer from what they drew, so any draw must pass); under
# CI=true hypothesis' own "ci" profile derandomizes, and this keeps that. No
# per-example deadline and no too_slow health check: a loaded 2-core machine
# must not fail a correct test by luck. Replay a failure with --hypothesis-seed=N.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("dcp2d", parent=settings.default, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("dcp2d")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: starts no vLLM engine (every test not marked vllm); "
                                       "`bash scripts/test.sh -m quick` is the inner loop")


LONGEST = ("tests/e2e/test_dcp_vllm.py", "tests/e2e/test_load_faults.py", "tests/e2e/test_proxy_vllm.py",
           "tests/e2e/test_e2e_spec.py", "tests/e2e/test_spec_decode_vllm.py", "tests/e2e/test_e2e.py",
           "tests/e2e/test_e2e_mla.py", "tests/e2e/test_e2e_gqa.py", "tests/e2e/test_e2e_fp8.py")


def pytest_sessionstart(session):
    """Unlink the vLLM CPU-communicator files earlier engines left in /dev/shm (RAM):
    vLLM never unlinks them, and a machine that runs this suite again and again fills
    /dev/shm until engines fail to start. ``local/servers.py`` removes what this run's servers
    leave; this removes what older runs left (tests/support/shm.py). Only files no process
    holds."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller did it
        return
    from tests.support.shm import remove_stale_vllm_shm

    removed = remove_stale_vllm_shm()
    if removed:
        print(f"\nremoved {removed} stale vLLM /dev/shm files (no process held them)")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.get_closest_marker("vllm") is None:
            item.add_marker(pytest.mark.quick)
    # Longest files first, the quick files last: pytest-xdist (--dist loadfile
    # --no-loadscope-reorder) hands out files in this order, so short ones fill the end
    # of the run instead of one worker idling while another finishes a 5-minute file.
    # LONGEST only orders (seconds per file, BENCHMARKS.md "Test suite"); a file not in
    # it still runs, among the engine files.
    heavy = {item.path for item in items if item.get_closest_marker("quick") is None}

    def rank(item):
        name = item.path.relative_to(config.rootpath).as_posix()
        return (item.path not in heavy, LONGEST.index(name) if name in LONGEST else len(LONGEST))

    items.sort(key=rank)  # stable: each file's own order is kept


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Seconds per test file (setup + call + teardown), summed for the end of the run."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.section("seconds per test file (summed over its tests; workers run files in parallel)")
    for path, seconds in rows:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  all files")
