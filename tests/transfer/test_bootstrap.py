"""Bootstrap registry over ZMQ (threads in one process; no Mooncake)."""

import dataclasses
import threading
import time

import pytest
import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.auth import NO_AUTH, rank_name
from vllm_dcp2d.transfer.bootstrap import BootstrapError, BootstrapServer, register_rank
from vllm_dcp2d.transfer.messages import Fingerprint, RankTable, RegisterRank, Reply, decode
from tests.support.transfer import query_ranks

pytestmark = pytest.mark.timeout(30)
FP = Fingerprint("m", 5, 16, "bfloat16", 1024, "test", "cfg")


@pytest.fixture
def server():
    with BootstrapServer() as s:
        yield s


def test_register_then_query(server):
    register_rank(server.address, RegisterRank("P", 1, 2, "tcp://127.0.0.1:1001", FP), 5)
    with pytest.raises(BootstrapError, match=r"1 of 2 cp ranks registered, missing \[0\]"):
        query_ranks(server.address, "D", timeout_s=0.3)
    register_rank(server.address, RegisterRank("P", 0, 2, "tcp://127.0.0.1:1000", FP), 5)
    table = query_ranks(server.address, "D", 5)
    assert table == RankTable("P", 2, ("tcp://127.0.0.1:1000", "tcp://127.0.0.1:1001"), FP)
    # a restarted rank re-registers at a new address
    register_rank(server.address, RegisterRank("P", 1, 2, "tcp://127.0.0.1:2001", FP), 5)
    assert query_ranks(server.address, "D", 5).addresses[1] == "tcp://127.0.0.1:2001"
    assert server.ranks() == {0: "tcp://127.0.0.1:1000", 1: "tcp://127.0.0.1:2001"}


def test_inconsistent_ranks_rejected(server):
    register_rank(server.address, RegisterRank("P", 0, 2, "tcp://127.0.0.1:1000", FP), 5)
    other = dataclasses.replace(FP, page_size=32)
    with pytest.raises(BootstrapError, match="page_size: ours 16, peer 32"):
        register_rank(server.address, RegisterRank("P", 1, 2, "tcp://127.0.0.1:1001", other), 0.5)
    with pytest.raises(BootstrapError, match="cp_size 3, rank 0 has 'P' cp_size 2"):
        register_rank(server.address, RegisterRank("P", 1, 3, "tcp://127.0.0.1:1001", FP), 0.5)


def test_a_refusal_outlives_a_later_silence():
    """The server refuses once, then says nothing: the error names the refusal.
    (The retry before the deadline gets no reply; on a loaded host the last retry
    always gets too little time to be answered, and its 'no reply' used to replace
    the server's reason.)"""
    router = sockets.socket(zmq.ROUTER)
    address = sockets.bind(router, "127.0.0.1")

    def refuse_once():
        ident, _ = router.recv_multipart()
        answer = NO_AUTH.registration("").pack(Reply(False, "nope: page_size 16 vs 32"), to=rank_name("P", 0))
        router.send_multipart([ident, answer])

    t = threading.Thread(target=refuse_once, daemon=True)
    t.start()
    try:
        with pytest.raises(BootstrapError, match=r"nope: page_size 16 vs 32 \(then: no reply"):
            register_rank(address, RegisterRank("P", 0, 1, "tcp://127.0.0.1:1000", FP), 0.5)
    finally:
        t.join(5)
        router.close()


def test_malformed_message_gets_error_and_server_keeps_serving(server):
    for junk in (b"", b"\xff\x00garbage", b"\x81\xa1v\x02"):
        sock = sockets.socket(zmq.DEALER)
        sock.connect(server.address)
        sock.send(junk)
        assert sock.poll(5000)
        reply = decode(sock.recv(), Reply)
        sock.close()
        assert not reply.ok and reply.reason.startswith("rejected:")
    register_rank(server.address, RegisterRank("P", 0, 1, "tcp://127.0.0.1:1000", FP), 5)
    assert query_ranks(server.address, "D", 5).addresses == ("tcp://127.0.0.1:1000",)


def test_nobody_listening_times_out():
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="no reply from tcp://127.0.0.1:9 within"):
        query_ranks("tcp://127.0.0.1:9", "D", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.5


def test_server_gone_mid_session():
    s = BootstrapServer()
    register_rank(s.address, RegisterRank("P", 0, 1, "tcp://127.0.0.1:1000", FP), 5)
    s.close()
    with pytest.raises(BootstrapError, match="no reply"):
        query_ranks(s.address, "D", timeout_s=0.5)


def test_waker_interrupts_poll():
    w = sockets.Waker()
    assert not w.socket.poll(0)
    for _ in range(10):  # more wakes than the queue holds never block
        w.wake()
    assert w.socket.poll(1000)
    w.drain()
    assert not w.socket.poll(0)
    w.close()
