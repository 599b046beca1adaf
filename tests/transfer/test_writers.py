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


def starts(monkeypatch, name: str) -> list[str]:
    """The names of the threads started from now on whose name ends with ``name``."""
    started: list[str] = []
    real = threading.Thread.start

    def start(self):
        if self.name.endswith(name):
            started.append(self.name)
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    return started


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


def test_sequential_jobs_for_different_peers_of_one_source_reuse_one_thread(monkeypatch):
    """Issue 52 (the soak's creeping RSS): a thread per request was started and ended. Here
    one thread serves them all, and an idle thread holds no cap: with one thread and one
    per source, each next peer of the same source still runs at once."""
    started = starts(monkeypatch, "reuse")
    w = Writers("reuse", max_threads=1, max_per_source=1)
    order = []
    try:
        for i in range(10):
            done = threading.Event()
            w.submit(f"peer-{i}", lambda i=i, done=done: order.append(i) or done.set(), "address 10.0.0.2")
            assert done.wait(2), f"peer-{i}'s job waited (an idle thread held the cap?)"
            settled(w)
    finally:
        t0 = time.monotonic()
        w.close(10)
        closed_s = time.monotonic() - t0
    assert order == list(range(10)) and len(started) == 1, started
    assert closed_s < 0.5, closed_s  # the idle thread ends on close(), not after IDLE_S
    assert not w.alive() and not w.failed


def test_a_burst_after_an_idle_spell_reuses_the_idle_threads_and_stays_within_max_threads(monkeypatch):
    started = starts(monkeypatch, "burst")
    w = Writers("burst", max_threads=2, max_per_source=2)
    gate, ran = threading.Event(), []
    try:
        for burst in range(3):
            gate.clear()
            for p in range(3):  # the third waits for a freed thread
                w.submit(f"b{burst}-{p}", lambda b=burst, p=p: gate.wait(5) and ran.append((b, p)), "s")
            time.sleep(0.05)
            assert len(started) == 2
            gate.set()
            settled(w)
    finally:
        w.close(10)
    assert sorted(ran) == [(b, p) for b in range(3) for p in range(3)] and len(started) == 2, started


def test_an_idle_thread_ends_after_idle_s(monkeypatch):
    monkeypatch.setattr("vllm_dcp2d.transfer.writers.IDLE_S", 0.3)
    w = Writers("test")
    ran = threading.Event()
    try:
        w.submit("a", ran.set, "s")
        assert ran.wait(5)
        settled(w)
        assert w.alive()  # idle, waiting for another job
        deadline = time.monotonic() + 5
        while w.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w.alive()
        again = threading.Event()
        w.submit("b", again.set, "s")  # a new thread for the next job
        assert again.wait(5)
    finally:
        w.close(5)
    assert not w.failed
