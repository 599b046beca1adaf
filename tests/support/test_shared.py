"""``tests/support/shared.py``: a shared cluster is started once, checked before each test,
and started again when a test broke it; real server processes (``python -m http.server``
answering ``/health`` from a file)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import pytest

from vllm_dcp2d.local.servers import Process, free_port, wait_all
from tests.support.shared import SharedCluster, processes


def _server(name: str, root) -> Process:
    (root / "health").write_text("ok")
    port = free_port()
    return Process(name, [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                          "--directory", str(root)], port, root / f"{name}.log", host="127.0.0.1")


@contextlib.contextmanager
def _cluster(root, started: list):
    procs = [_server(f"a{len(started)}", root), _server(f"b{len(started)}", root)]
    started.append(procs)
    try:
        for p in procs:
            p.start()
        wait_all(procs, 60)
        yield {"a": procs[0], "more": [procs[1]]}
    finally:
        for p in procs:
            p.stop()


@pytest.mark.timeout(180)
def test_started_once_while_healthy_and_again_after_a_test_broke_it(tmp_path):
    started: list = []
    with SharedCluster(lambda: _cluster(tmp_path, started), check_s=5.0) as shared:
        first = shared.get()
        assert shared.get() is first and shared.starts == 1  # healthy: the same servers
        assert list(processes(first)) == started[0]
        os.killpg(first["more"][0].proc.pid, signal.SIGKILL)  # a test breaks the cluster
        first["more"][0].proc.wait(30)
        second = shared.get()
        assert second is not first and shared.starts == 2
        assert first["a"].proc.poll() is not None  # the old servers were stopped, all of them
        assert shared.broken() == ""
    assert all(p.proc.poll() is not None for p in started[1])  # closed with the module


@pytest.mark.timeout(120)
def test_a_cluster_that_cannot_start_fails_the_test_the_next_get_tries_again_then_stops_trying(tmp_path):
    attempts = []

    @contextlib.contextmanager
    def failing():
        attempts.append(1)
        raise RuntimeError("engine failed to start")
        yield  # pragma: no cover

    with SharedCluster(failing) as shared:
        for n in (1, 2):
            with pytest.raises(RuntimeError, match="engine failed to start"):
                shared.get()
            assert len(attempts) == n and shared.value is None
        with pytest.raises(RuntimeError, match=r"failed to start 2 times in a row .*engine failed to start"):
            shared.get()  # not tried a third time
        assert len(attempts) == 2


@pytest.mark.timeout(120)
def test_a_good_start_clears_the_failures(tmp_path):
    started, tries = [], []

    @contextlib.contextmanager
    def flaky():
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("port taken")
        with _cluster(tmp_path, started) as c:
            yield c

    with SharedCluster(flaky, check_s=5.0) as shared:
        with pytest.raises(RuntimeError, match="port taken"):
            shared.get()
        assert shared.get()["a"] is started[0][0] and shared.failed == [] and shared.starts == 1
