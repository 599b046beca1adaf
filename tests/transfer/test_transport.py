"""MooncakeTransport in one process (two engines over loopback TCP)."""

import os
import threading
import time

import numpy as np
import pytest

from vllm_dcp2d.reshard.plan import Descriptors
from vllm_dcp2d.connector.stats import DCP2DStats
from vllm_dcp2d.transfer.transport import HandshakeError, MooncakeTransport, TransferError, TransportError

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


class CountingEngine:
    """Forwards to the real engine, counting submitted transfers and the most in flight at once."""

    def __init__(self, engine):
        self.engine, self.submitted, self.in_flight, self.peak = engine, 0, 0, 0

    def transfer_submit_write(self, *args):
        self.submitted += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        return self.engine.transfer_submit_write(*args)

    def transfer_check_status(self, bid):
        st = self.engine.transfer_check_status(bid)
        self.in_flight -= st != 0
        return st

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture
def pair():
    a, b = MooncakeTransport(), MooncakeTransport()
    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    yield a, b, src, dst
    a.close()
    b.close()


def test_scattered_write_is_split_and_exact(pair):
    a, b, src, dst = pair
    a._engine = CountingEngine(a._engine)
    rng = np.random.default_rng(1)
    n, size = 3000, 64
    s_slots = rng.permutation(src.nbytes // size)[:n]
    d_slots = rng.permutation(dst.nbytes // size)[:n]
    desc = Descriptors(src.ctypes.data + s_slots * size, dst.ctypes.data + d_slots * size, np.full(n, size))
    assert a.write(b.session_id, desc) == n * size
    # every descriptor sent once; never more in flight than the per-peer queue takes
    assert (a._engine.submitted, a._engine.peak, a._engine.in_flight) == (n, 1024, 0)
    want = np.zeros_like(dst)
    want.reshape(-1, size)[d_slots] = src.reshape(-1, size)[s_slots]
    assert np.array_equal(dst, want)
    assert a.write(b.session_id, Descriptors.empty()) == 0


def test_concurrent_writes_to_one_peer(pair):
    a, b, src, dst = pair
    half = src.nbytes // 2
    errors = []

    def go(off):
        try:
            a.write(b.session_id, Descriptors(np.array([src.ctypes.data + off]), np.array([dst.ctypes.data + off]),
                                              np.array([half])))
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(off,)) for off in (0, half)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and np.array_equal(src, dst)


def test_dead_peer_raises_typed_error_fast(pair):
    """Nothing listens there: its handshake fails (test_handshake.py has every other way)."""
    a, _, src, dst = pair
    desc = Descriptors(np.array([src.ctypes.data]), np.array([dst.ctypes.data]), np.array([4096]))
    t0 = time.monotonic()
    with pytest.raises(HandshakeError) as e:
        a.write("127.0.0.1:1", desc)
    assert time.monotonic() - t0 < 5
    assert e.value.peer == "127.0.0.1:1" and "'127.0.0.1:1' did not answer its handshake" in str(e.value)
    assert "Connection refused" in str(e.value)


def test_unregistered_destination_fails_then_engine_still_works(pair):
    a, b, src, dst = pair
    bad = Descriptors(np.array([src.ctypes.data]), np.array([dst.ctypes.data + dst.nbytes]), np.array([4096]))
    with pytest.raises(TransferError, match="batch of 1 descriptors"):
        a.write(b.session_id, bad)
    assert not dst.any()
    good = Descriptors(np.array([src.ctypes.data]), np.array([dst.ctypes.data]), np.array([4096]))
    assert a.write(b.session_id, good) == 4096
    assert np.array_equal(dst[:4096], src[:4096])


def test_registration_bookkeeping():
    t = MooncakeTransport()
    buf = np.zeros(1 << 16, np.uint8)
    addr = buf.ctypes.data
    t.register(addr, 4096)
    t.register(addr, 4096)  # same range: no-op
    with pytest.raises(TransportError, match="overlaps"):
        t.register(addr + 1024, 4096)
    t.register(addr + 8192, 4096)
    assert t.registered() == {addr: 4096, addr + 8192: 4096}
    t.unregister(addr)
    t.unregister(addr)  # not registered: no-op
    assert t.registered() == {addr + 8192: 4096}
    t.close()
    t.close()
    assert t.registered() == {}
    with pytest.raises(TransportError, match="closed"):
        t.write("127.0.0.1:1", Descriptors.empty())
    with pytest.raises(TransportError, match="closed"):
        t.register(addr, 4096)


def test_bad_arguments():
    with pytest.raises(ValueError, match="protocol must be 'tcp' or 'rdma', got 'ib'"):
        MooncakeTransport(protocol="ib")
    with pytest.raises(ValueError, match="max_batch"):
        MooncakeTransport(max_batch=0)


class Wedged:
    """Wraps an engine: takes every write and never completes one (a wedged TCP session)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def transfer_submit_write(self, *args):
        self.calls += 1
        return 1 << 40  # an id that is never checked against the real engine

    def transfer_check_status(self, bid):
        return 0

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_renew_on_failure_retries_a_stalled_write_on_a_fresh_engine(pair, monkeypatch):
    """A write-only transport with renew_on_failure retries a stalled batch on a fresh
    engine (ranges registered again, same bytes land); a write that fails at once
    (here: an unregistered destination, like a dead peer) is not retried."""
    from vllm_dcp2d.transfer import transport as tr

    # A failure counts as a stall when it took STALL_S / 2 or more: large while a write fails at
    # once (even a loaded host answers in far less than 30 s), small for the forced stall.
    monkeypatch.setattr(tr, "STALL_S", 60.0)
    _, b, src, dst = pair
    a = MooncakeTransport(renew_on_failure=True)
    try:
        a.register(src.ctypes.data, src.nbytes)
        first = a.session_id
        bad = Descriptors(np.array([src.ctypes.data]), np.array([dst.ctypes.data + dst.nbytes]), np.array([4096]))
        with pytest.raises(TransferError, match="code -1"):
            a.write(b.session_id, bad)
        assert a.session_id == first  # failed at once: no new engine
        assert a.take_counts() == {"stalls": 0, "retries": 0, "handshake_failures": 0, "handshake_refusals": 0}
        monkeypatch.setattr(tr, "STALL_S", 2.0)
        stalled = a._engine = Wedged(a._engine)  # no progress for STALL_S: a stall
        good = Descriptors(np.array([src.ctypes.data + 8192]), np.array([dst.ctypes.data]), np.array([4096]))
        assert a.write(b.session_id, good) == 4096
        assert stalled.calls == 1 and a.session_id != first
        stats = DCP2DStats()  # what the worker does in get_kv_connector_stats
        for name, n in a.take_counts().items():
            stats.count(name, n)
        assert not stats.is_empty() and (stats.reduce()["stalls"], stats.reduce()["retries"]) == (1, 1)
        assert a.take_counts() == {"stalls": 0, "retries": 0, "handshake_failures": 0,
                                   "handshake_refusals": 0}  # taken: reset
        assert a.registered() == {src.ctypes.data: src.nbytes}
        assert np.array_equal(dst[:4096], src[8192:8192 + 4096])
    finally:
        a.close()


def _thread_cpus() -> dict[int, set[int]]:
    """Every thread of this process -> the CPUs it may run on. A thread that ends between
    the listing and the read is not counted (another test's threads come and go)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        except (FileNotFoundError, ProcessLookupError):
            continue
        cpus = set()
        for part in line.split()[1].split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out[int(tid)] = cpus
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell pinned from free")
def test_engine_threads_are_not_pinned_to_the_creating_threads_core():
    """vLLM's CPU worker pins its main thread to one core, and a thread inherits its
    creator's affinity: the engine's threads (among them the one asio thread that
    serves every TCP session) would share that core with the forward. Created from a
    thread pinned to one CPU, every thread the engine starts may run on all CPUs
    the process may use, and the creating thread keeps its pin."""
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    seen: dict = {}

    def create():
        try:
            os.sched_setaffinity(0, one)  # like VLLM_CPU_OMP_THREADS_BIND on this thread
            before = set(_thread_cpus())
            t = MooncakeTransport()
            seen["new"] = {tid: cpus for tid, cpus in _thread_cpus().items() if tid not in before}
            seen["self"] = os.sched_getaffinity(0)
            seen["transport"] = t
        except BaseException as e:  # surfaced below, not as a thread warning and a KeyError
            seen["error"] = e

    th = threading.Thread(target=create)
    th.start()
    th.join(30)
    assert "error" not in seen, f"creating the transport from a pinned thread failed: {seen['error']!r}"
    assert not th.is_alive(), "creating the transport took over 30 s"
    try:
        assert seen["self"] == one
        assert len(seen["new"]) >= 2  # at least the handshake and the TCP transport's threads
        assert all(cpus == allowed for cpus in seen["new"].values()), seen["new"]
    finally:
        seen["transport"].close()
