"""``transfer/writers.py``: a thread per peer, at most ``max_threads`` at once and at most
``max_per_source`` for one source's peers (issue 48: a review named 1,000 silent sessions
from one host, each holding a writer for its handshake's bound, and another decode's fetch
waited 28 s behind them)."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_dcp2d.transfer.writers import Writers

pytestmark = pytest.mark.timeout(60)


def test_one_source_holds_at_most_its_share_and_another_source_runs_at_once():
    gate = threading.Event()
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()
    done = threading.Event()

    def job(source: str, hold: bool):
        def run():
            with lock:
                running[source] = running.get(source, 0) + 1
                most[source] = max(most.get(source, 0), running[source])
            if hold:
                assert gate.wait(30)
            else:
                done.set()
            with lock:
                running[source] -= 1
        return run

    w = Writers("test", max_threads=8, max_per_source=3)
    try:
        for i in range(50):  # 50 peers of one source, each blocking (a silent session's probe)
            w.submit(f"flood-{i}", job("flood", True), "address 10.0.0.2")
        time.sleep(0.2)
        t0 = time.monotonic()
        w.submit("legit", job("legit", False), "address 10.0.0.3")
        assert done.wait(5) and time.monotonic() - t0 < 0.5  # it got a thread at once
        assert most["flood"] == 3
    finally:
        gate.set()
        w.close(10)
    assert most["flood"] == 3 and not w.failed


def test_a_peers_jobs_run_in_order_on_one_thread_and_waiting_peers_get_freed_threads():
    order: list[tuple[str, int]] = []
    w = Writers("test", max_threads=2, max_per_source=2)
    try:
        for i in range(5):
            for peer in ("a", "b", "c"):
                w.submit(peer, lambda p=peer, i=i: order.append((p, i)) or time.sleep(0.001), "s")
        deadline = time.monotonic() + 10
        while len(order) < 15 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.close(10)
    for peer in "abc":
        assert [i for p, i in order if p == peer] == list(range(5))


class Bell:
    """Stands for the owner's ``sockets.Waker``: counts the wakes."""

    def __init__(self):
        self.rung = 0

    def wake(self):
        self.rung += 1


def settled(w: Writers, timeout_s: float = 5.0) -> None:
    """Until no peer holds a thread (its last job returned and it gave the thread up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with w._lock:
            if not w._running and not any(w._queues.values()):
                return
        time.sleep(0.005)
    raise AssertionError("a peer still holds a writer thread")


def test_a_job_that_leaves_an_outcome_wakes_done_and_no_other_does():
    """Issue 52: the writer rings what it was given, no hook into its owner."""
    bell, ran = Bell(), threading.Event()
    w = Writers("test", done=bell)
    try:
        w.submit("a", lambda: None, "s")
        w.submit("a", lambda: False, "s")
        w.submit("a", lambda: True, "s")
        w.submit("a", ran.set, "s")
        assert ran.wait(5)
        settled(w)
    finally:
        w.close(5)
    assert bell.rung == 1 and not w.failed

