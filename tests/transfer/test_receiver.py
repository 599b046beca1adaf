"""Receiver failure paths against fake prefill ranks (one process, threads)."""

import time

import numpy as np
import pytest
from tests.support.fake_rank import FakeRank

from vllm_dcp2d.transfer.bootstrap import BootstrapServer, register_rank
from vllm_dcp2d.transfer.messages import CancelTransfer, Fingerprint, RegisterRank
from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.transport import MooncakeTransport
from tests.support.transfer import PD, wait_fetch

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]
FP = Fingerprint("m", 2, 16, "uint8", 256, "test", "cfg")


@pytest.fixture
def receiver():
    t = MooncakeTransport()
    kv = np.zeros((2, 8, 256), np.uint8)
    regions = KVRegions.uniform([0, 1], kv.ctypes.data + np.arange(2) * 8 * 256, 256)
    r = Receiver(t, regions, FP, engine_id="D", dcp_size=2, dcp_rank=1,
                 buffers=[(kv.ctypes.data, kv.nbytes)], transfer_timeout_s=1.0, cancel_grace_s=1.0)
    yield r
    r.close()
    assert t.registered() == {}
    t.close()


@pytest.fixture
def server():
    with BootstrapServer() as s:
        yield s


def _serve_one(server, reply):
    return FakeRank(server.address, FP, reply)


def test_malformed_outcome_fails_fetch_naming_rank(receiver, server):
    rank = _serve_one(server, lambda msg: b"\x93garbage")
    try:
        receiver.start("q", server.address, [3, 4], transfer_timeout_s=30, num_tokens=20, prompt_digest=PD)  # ends on the reply
        f = wait_fetch(receiver, "q", 40)
        assert not f.ok and f.error.cp_rank == 0 and "malformed reply" in f.error.reason
        assert not f.error.timed_out  # failed on the reply, not at the (1 s) deadline
        req = rank.seen[0]  # what the rank was asked: this rank's topology and block table
        assert (req.dcp_size, req.dcp_rank, req.block_ids.tolist()) == (2, 1, [3, 4])
        # registered first on the link: its session and memory, which the request cannot name (protocol 9)
        (me,) = rank.registered
        assert me.session == receiver.transport.session_id and me.engine_id == "D"
        assert (me.memory_addr.tolist(), me.memory_bytes.tolist()) == (receiver.memory.addr.tolist(), receiver.memory.nbytes.tolist())
        assert req.not_after_ns > 0
    finally:
        rank.close()


def test_silent_rank_times_out(receiver, server):
    rank = _serve_one(server, None)
    try:
        receiver.start("q", server.address, [0], transfer_timeout_s=3.0, num_tokens=20, prompt_digest=PD)
        f = wait_fetch(receiver, "q", 20)
        assert f.error.timed_out and f.error.cp_rank == 0 and "no outcome from cp ranks [0]" in f.error.reason
        # a silent rank never confirms the cancel: the fetch ends cancel_grace_s (1 s) later,
        # with the rank quarantined (it may still write), and is never released
        assert 3.9 < f.seconds < 12
        assert list(f.quarantined) == [0] and "no answer to the cancel" in f.quarantined[0]
        assert isinstance(rank.seen[-1], CancelTransfer) and rank.seen[-1].attempt_id == rank.seen[0].attempt_id
        time.sleep(3.5)  # cancels go out again 1 s and 3 s after it ended (1, 2, 4 s backoff), unanswered
        assert sum(isinstance(m, CancelTransfer) for m in rank.seen) >= 3 and receiver.poll_lifted() == []
    finally:
        rank.close()


def test_incomplete_or_missing_bootstrap(receiver, server):
    register_rank(server.address, RegisterRank("P", 0, 2, "tcp://127.0.0.1:9", FP), 5)
    receiver.start("a", server.address, [0], num_tokens=20, prompt_digest=PD)
    receiver.start("b", "tcp://127.0.0.1:9", [0], transfer_timeout_s=0.5, num_tokens=20, prompt_digest=PD)
    got = {f.transfer_key: f for f in (wait_fetch(receiver, "a", 10), wait_fetch(receiver, "b", 10))}
    assert "1 of 2 cp ranks registered, missing [1]" in got["a"].error.reason
    assert got["a"].error.timed_out and got["a"].error.cp_rank is None
    assert "no rank table from bootstrap tcp://127.0.0.1:9 (no answer)" in got["b"].error.reason


def test_duplicate_start_and_close_fail_cleanly(receiver, server):
    rank = _serve_one(server, None)
    try:
        receiver.start("dup", server.address, [0], transfer_timeout_s=30, num_tokens=20, prompt_digest=PD)
        receiver.start("dup", server.address, [0], transfer_timeout_s=30, num_tokens=20, prompt_digest=PD)
        f = wait_fetch(receiver, "dup", 10)
        assert "already running" in f.error.reason
        receiver.close()
        f = wait_fetch(receiver, "dup", 10)
        assert f.error.reason == "receiver closed"
        with pytest.raises(RuntimeError, match="closed"):
            receiver.start("x", server.address, [0], num_tokens=20, prompt_digest=PD)
    finally:
        rank.close()


def test_an_on_output_that_raises_is_only_logged():
    """``on_output`` only wakes the owner (the worker's step bell): if it raises, the
    fetch still ends and ``poll`` returns it."""
    rings = []

    def ring():
        rings.append(1)
        raise RuntimeError("bell broken")

    t = MooncakeTransport()
    kv = np.zeros((2, 8, 256), np.uint8)
    regions = KVRegions.uniform([0, 1], kv.ctypes.data + np.arange(2) * 8 * 256, 256)
    with Receiver(t, regions, FP, engine_id="D", buffers=[(kv.ctypes.data, kv.nbytes)], on_output=ring) as r:
        r.start("q", "not an address", [0], num_tokens=20, prompt_digest=PD)  # fails at once: the address is refused
        f = wait_fetch(r, "q", 20)
        assert not f.ok and rings and not r.failed
    t.close()
