"""Receiver failure paths against fake prefill ranks (one process, threads)."""

import threading

import numpy as np
import pytest
import zmq

from vllm_dcp2d.connector import bootstrap as bs
from vllm_dcp2d.connector.bootstrap import BootstrapServer, register_rank
from vllm_dcp2d.connector.messages import CancelTransfer, Fingerprint, RegisterRank, TransferRequest, decode
from vllm_dcp2d.connector.plan import KVRegions
from vllm_dcp2d.connector.receiver import Receiver
from vllm_dcp2d.connector.transport import MooncakeTransport

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]
FP = Fingerprint("m", 2, 16, "uint8", 256, "test")


class FakeRank:
    """A ROUTER that answers every message with ``reply(payload)`` (None: stays silent)."""

    def __init__(self, reply):
        self.sock = bs.socket(zmq.ROUTER)
        self.address = bs.bind(self.sock, "127.0.0.1")
        self.reply, self.seen = reply, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        while not self.stop.is_set():
            if self.sock.poll(50):
                ident, payload = self.sock.recv_multipart()
                self.seen.append(decode(payload, (TransferRequest, CancelTransfer)))
                out = self.reply(payload)
                if out is not None:
                    self.sock.send_multipart([ident, out])
        self.sock.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def receiver():
    t = MooncakeTransport()
    kv = np.zeros((2, 8, 256), np.uint8)
    regions = KVRegions.uniform([0, 1], kv.ctypes.data + np.arange(2) * 8 * 256, 256)
    r = Receiver(t, regions, FP, engine_id="D", dcp_size=2, dcp_rank=1,
                 buffers=[(kv.ctypes.data, kv.nbytes)], timeout_s=1.0, cancel_grace_s=1.0)
    yield r
    r.close()
    assert t.registered() == {}
    t.close()


@pytest.fixture
def server():
    with BootstrapServer() as s:
        yield s


def _serve_one(server, reply):
    rank = FakeRank(reply)
    register_rank(server.address, RegisterRank("P", 0, 1, rank.address, FP), 5)
    return rank


def test_malformed_outcome_fails_fetch_naming_rank(receiver, server):
    rank = _serve_one(server, lambda payload: b"\x93garbage")
    try:
        receiver.start("q", server.address, [3, 4], timeout_s=30)  # ends on the reply, long before
        f = receiver.wait("q", 40)
        assert not f.ok and f.error.cp_rank == 0 and "malformed reply" in f.error.reason
        assert not f.error.timed_out  # failed on the reply, not at the (1 s) deadline
        req = rank.seen[0]  # what the rank was asked: this rank's topology and block table
        assert (req.dcp_size, req.dcp_rank, req.block_ids.tolist()) == (2, 1, [3, 4])
        assert req.session == receiver.transport.session_id
    finally:
        rank.close()


def test_silent_rank_times_out(receiver, server):
    rank = _serve_one(server, lambda payload: None)
    try:
        receiver.start("q", server.address, [0], timeout_s=3.0)
        f = receiver.wait("q", 20)
        assert f.error.timed_out and f.error.cp_rank == 0 and "no outcome from cp ranks [0]" in f.error.reason
        # a silent rank never confirms the cancel: the fetch ends cancel_grace_s (1 s) later
        assert 3.9 < f.seconds < 12
        assert isinstance(rank.seen[-1], CancelTransfer) and rank.seen[-1].transfer_id == rank.seen[0].transfer_id
    finally:
        rank.close()


def test_incomplete_or_missing_bootstrap(receiver, server):
    register_rank(server.address, RegisterRank("P", 0, 2, "tcp://127.0.0.1:9", FP), 5)
    receiver.start("a", server.address, [0])
    receiver.start("b", "tcp://127.0.0.1:9", [0], timeout_s=0.5)
    got = {f.request_id: f for f in (receiver.wait("a", 10), receiver.wait("b", 10))}
    assert "1 of 2 cp ranks registered, missing [1]" in got["a"].error.reason
    assert got["a"].error.timed_out and got["a"].error.cp_rank is None
    assert "no rank table from bootstrap tcp://127.0.0.1:9 (no answer)" in got["b"].error.reason


def test_duplicate_start_and_close_fail_cleanly(receiver, server):
    rank = _serve_one(server, lambda payload: None)
    try:
        receiver.start("dup", server.address, [0], timeout_s=30)
        receiver.start("dup", server.address, [0], timeout_s=30)
        f = receiver.wait("dup", 10)
        assert "already running" in f.error.reason
        receiver.close()
        f = receiver.wait("dup", 10)
        assert f.error.reason == "receiver closed"
        with pytest.raises(RuntimeError, match="closed"):
            receiver.start("x", server.address, [0])
    finally:
        rank.close()
