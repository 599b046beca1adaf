"""Block lifetime under races (docs/connector.md, "Block lifetime"), each forced
deterministically: a gate holds a real Mooncake write open while the race
happens, then lets it land.

The invariant: a block goes back to its owner (pop_finished on the prefill, the
end of a fetch or the release of its quarantine on the decode) only when no
write into it or read from it can still happen. Each test records when blocks
were released and checks that no write ran, and no byte landed, after that.
"""

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from vllm_dcp2d.transfer import send_ledger
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from tests.support.fake_rank import FakeRank, outcome

from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.transport import MooncakeTransport, TransferError
from tests.support.transfer import PD, wait_fetch, writes_in_flight
from tests.support.pair import (BLOCKS, DST_IDS, FP, L, PAGE_BYTES, SRC_IDS, TOKENS, Side, deadline_now,
                                released_then_unchanged, regions, wait_until)

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def test_expiry_waits_for_the_write_in_flight(stack):
    """Item 1: send_timeout_s passes while a write reads the request's blocks. The
    sender reports the request (the owner frees its blocks) only after that write."""
    s = Side(stack, sender_kw={"send_timeout_s": 60.0})
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    s.sender.ledger._held["x"].expires = time.monotonic()  # send_timeout_s passes now, not by luck
    time.sleep(0.5)  # several expiry polls, write still in flight
    assert s.sender.pop_finished() == {}, "blocks freed while a write reads them"
    assert writes_in_flight(s.sender.ledger) == 1
    s.gate.open()
    f = wait_fetch(s.recv, "x", 20)
    wait_until(lambda: writes_in_flight(s.sender.ledger) == 0)
    finished = {}
    wait_until(lambda: finished.update(s.sender.pop_finished()) or finished)
    released_at = time.monotonic()
    assert finished == {"x": "expired"} and s.gate.ended[-1] <= released_at
    assert f.ok and np.array_equal(s.dst, s.expected())  # written in full while the blocks were held


def test_cancel_overtakes_queued_work(stack):
    """Item 2: a cancel arrives while the fetch's answer waits behind another write.
    It is settled at once, and the queued answer writes nothing."""
    s = Side(stack, sender_kw={"num_workers": 1}, receiver_kw={"cancel_grace_s": 5.0})
    s.sender.add_request("a", SRC_IDS, TOKENS, prompt_digest=PD)
    s.sender.add_request("b", SRC_IDS[::-1], TOKENS, prompt_digest=PD)
    s.recv.start("a", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)  # the only worker is stuck in a's write
    other = np.array([0, 2, 5, 6])  # b's blocks (disjoint from a's)
    s.recv.start("b", s.boot.address, other, num_tokens=TOKENS, prompt_digest=PD)
    wait_until(lambda: any(a.req.transfer_key == "b" for a in list(s.sender.ledger._open.values())))
    deadline_now(s.recv, "b")
    f = wait_fetch(s.recv, "b", 20)  # failed at its deadline; the cancel settled while a still writes
    assert f.error.timed_out and not f.quarantined and f.seconds < 4, (f.error, f.quarantined, f.seconds)
    assert not s.gate.ended
    s.gate.open()
    assert wait_fetch(s.recv, "a", 20).ok
    released_then_unchanged(s)
    assert not s.dst[:, [2, 5, 6]].any(), "the cancelled fetch was written after its cancel"
    assert len(s.gate.ended) == 1


def test_stalled_write_past_the_deadline_is_quarantined_until_it_ends(stack):
    """Item 3: the fetch's deadline and cancel grace pass while a write is in flight.
    The fetch ends (vLLM can recompute elsewhere) with its blocks quarantined; they
    are released only after the write ended and the rank settled."""
    s = Side(stack)
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, transfer_timeout_s=60.0, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    (active,) = s.recv.ledger.active()
    active.deadline = time.monotonic()  # the deadline passes now, with the write in flight (not by luck)
    f = wait_fetch(s.recv, "x", 20)
    assert f.error.timed_out and list(f.quarantined) == [0] and "no answer to the cancel" in f.quarantined[0]
    assert not s.gate.ended and s.recv.poll_lifted() == []
    time.sleep(1.5)  # cancels go out again; the rank still writes, so it does not settle
    assert s.recv.poll_lifted() == []
    s.gate.open()
    got = []
    wait_until(lambda: got.extend(s.recv.poll_lifted()) or got)
    released_at = time.monotonic()
    assert got == [f] and s.gate.ended[-1] <= released_at
    assert np.array_equal(s.dst, s.expected())  # the late write landed while quarantined
    released_then_unchanged(s)


@pytest.fixture
def silent(stack):
    boot = stack.enter_context(BootstrapServer())
    t = MooncakeTransport()
    stack.callback(t.close)
    dst = np.zeros((L, BLOCKS, PAGE_BYTES), np.uint8)
    recv = Receiver(t, regions(dst), FP, engine_id="D", buffers=[(dst.ctypes.data, dst.nbytes)],
                    transfer_timeout_s=30.0, cancel_grace_s=0.3)
    stack.callback(recv.close)
    rank = FakeRank(boot.address, FP)
    stack.callback(rank.close)
    return boot, recv, rank


def test_rank_that_never_answers_stays_quarantined_until_it_answers(silent):
    """Item 3: a rank that answers neither the fetch nor its cancel (frozen). Its
    blocks stay quarantined however long it is silent, are asked for again with
    backoff, and are released when it finally settles."""
    boot, recv, rank = silent
    recv.start("x", boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    wait_until(lambda: rank.seen)
    deadline_now(recv, "x")
    f = wait_fetch(recv, "x", 20)
    assert f.error.timed_out and list(f.quarantined) == [0]
    wait_until(lambda: rank.cancels() >= 3, 20)  # the cancel, then again 1 s and 3 s after the grace
    assert rank.cancels() <= 4, rank.cancels()  # backoff, not a flood
    assert recv.poll_lifted() == []
    rank.answer_cancels = True
    got = []
    wait_until(lambda: got.extend(recv.poll_lifted()) or got, 20)
    assert got == [f]


def test_unsettled_answer_keeps_the_quarantine(silent):
    """A rank whose write timed out answers ``settled=False`` (Mooncake may still send
    its queued bytes): quarantined until a later answer says settled."""
    boot, recv, rank = silent
    rank.answer_cancels, rank.settled = True, False
    rank.reply = lambda msg: outcome(msg, ok=False, settled=False, layers=L)
    recv.start("x", boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(recv, "x", 20)
    assert not f.ok and not f.error.timed_out and list(f.quarantined) == [0]
    assert "a write timed out" in f.quarantined[0]
    time.sleep(1.5)
    assert recv.poll_lifted() == []  # re-sent cancels answered, but unsettled
    rank.settled = True
    got = []
    wait_until(lambda: got.extend(recv.poll_lifted()) or got, 20)
    assert got == [f]
    # The decode rank renewed its Mooncake engine (its target may be wedged): the link
    # registers the new session before the next request.
    first = rank.registered[0].session
    assert recv.transport.session_id != first
    rank.reply = lambda msg: outcome(msg, ok=True, num_tokens=msg.num_tokens, layers=L)
    recv.start("y", boot.address, DST_IDS, num_tokens=TOKENS, transfer_timeout_s=10, prompt_digest=PD)
    assert wait_fetch(recv, "y", 20).ok
    assert [m.session for m in rank.registered] == [first, recv.transport.session_id]


def test_sender_reports_a_timed_out_write_unsettled(stack, monkeypatch):
    """The producer side of the above: a write that failed after a stall is answered
    ``settled=False``, and so are re-sent cancels until Mooncake has dropped that
    connection (``STALL_S`` without progress); then ``settled=True``."""
    monkeypatch.setattr(send_ledger, "STALL_S", 1.0)
    s = Side(stack)

    def stalled(peer, desc, stalls=None, not_after_ns=0):
        stalls.append(-1)
        raise TransferError(peer, len(desc), -1, 0, " (stalled)")

    s.gate.transport = type("T", (), {"write": staticmethod(stalled), "max_batch": 1024,
                                      "opened": staticmethod(lambda peer: True)})()
    s.gate.open()
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(s.recv, "x", 20)
    assert not f.ok and "a write timed out" in f.quarantined[0]
    got = []
    wait_until(lambda: got.extend(s.recv.poll_lifted()) or got, 20)
    assert got == [f]  # answered settled once STALL_S had passed


class Relay:
    """A TCP relay between the decode and a prefill rank's side channel whose
    connections can be cut (a dropped link; Mooncake does not use it)."""

    def __init__(self, target: str):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        self.lsock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                a, _ = self.lsock.accept()
            except OSError:
                continue
            b = socket.create_connection(self.target)
            self.conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self.pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def pipe(x, y):
        try:
            while data := x.recv(65536):
                y.sendall(data)
        except OSError:
            pass
        for s in (x, y):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self):
        conns, self.conns = self.conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self):
        self.stop.set()
        self.cut()
        self.lsock.close()


def test_dropped_link_during_a_write_does_not_release_blocks(stack):
    """Item 3: the side channel drops while a Mooncake write is in flight. That does
    not prove the rank stopped writing: the fetch fails with its blocks quarantined,
    the link comes back with the same routing id, and the rank's settled answer after
    its write ends releases them."""
    relays = []

    def via_relay(address):
        relays.append(Relay(address))
        stack.callback(relays[-1].close)
        return relays[-1].address

    s = Side(stack, rank_address=via_relay)
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    relays[0].cut()
    f = wait_fetch(s.recv, "x", 20)
    assert "connection lost" in f.error.reason and list(f.quarantined) == [0], (f.error, f.quarantined)
    assert s.recv.poll_lifted() == [] and not s.gate.ended
    s.gate.open()
    got = []
    wait_until(lambda: got.extend(s.recv.poll_lifted()) or got)
    released_at = time.monotonic()
    assert got == [f] and s.gate.ended[-1] <= released_at
    released_then_unchanged(s)


def test_length_mismatch_is_a_fetch_error(stack):
    """Item 4: the decode claims more tokens than the prefill computed. The prefill
    rank refuses, without a secret in the words it uses for an unknown key (issue 48:
    no length oracle), and writes nothing."""
    s = Side(stack)
    s.gate.open()
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS + 9, transfer_timeout_s=10, prompt_digest=PD)
    f = wait_fetch(s.recv, "x", 20)
    assert not f.ok and not f.quarantined
    assert f.error.reason == "no request 'x' for this prompt on cp rank 0 (not added yet, finished, expired, or " \
                             "another prompt)"
    assert not s.dst.any() and not s.gate.ended
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)  # the right claim is served
    assert wait_fetch(s.recv, "x", 20).ok and np.array_equal(s.dst, s.expected())


def test_decode_checks_the_count_the_prefill_answers(silent):
    """Item 4, decode side: an ok answer for another token count is a fetch error."""
    boot, recv, rank = silent
    rank.reply = lambda msg: outcome(msg, ok=True, num_tokens=msg.num_tokens - 16, layers=L)
    recv.start("x", boot.address, DST_IDS, num_tokens=TOKENS, transfer_timeout_s=10, prompt_digest=PD)
    f = wait_fetch(recv, "x", 20)
    assert not f.ok and not f.quarantined and f.error.cp_rank == 0
    assert (f"this decode expects {TOKENS} tokens (4 pages), the prefill wrote {TOKENS - 16} tokens (3 pages)"
            in f.error.reason)


def test_abort_waits_for_layer_writes(stack):
    """A prefill aborted while a pipelined layer write reads its blocks: the held fetch
    fails, and the sender reports the request only after that write ended."""
    s = Side(stack, receiver_kw={"prefill_wait_s": 20.0})
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    wait_until(lambda: s.sender.waiting("x") == 1)
    s.sender.layer_ready("x", 0, SRC_IDS, TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    s.sender.abort("x")
    time.sleep(0.3)
    assert s.sender.pop_finished() == {}, "blocks freed while a layer write reads them"
    s.gate.open()
    finished = {}
    wait_until(lambda: finished.update(s.sender.pop_finished()) or finished)
    assert finished == {"x": "aborted"} and s.gate.ended[-1] <= time.monotonic()
    f = wait_fetch(s.recv, "x", 20)
    assert not f.ok and "aborted on the prefill" in f.error.reason and not f.quarantined
    s.sender.layer_ready("x", 1, SRC_IDS, TOKENS, prompt_digest=PD)  # nothing is held any more
    time.sleep(0.2)
    assert len(s.gate.ended) == 1


def test_a_reconnect_to_the_dead_ranks_port_is_not_a_live_rank(silent):
    """A quarantining rank's process died; its restarted instance registers elsewhere.
    Meanwhile ZMQ's reconnect reached *something* on the old port (on loopback a
    socket can even connect to itself there). That proves nothing: only an answer
    shows a rank process is alive, so the new rank table still lifts the quarantine."""
    import zmq

    from vllm_dcp2d.transfer import sockets

    boot, recv, rank = silent
    recv.start("x", boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    wait_until(lambda: rank.seen)
    deadline_now(recv, "x")
    f = wait_fetch(recv, "x", 20)
    assert list(f.quarantined) == [0]
    old = rank.address
    rank.close()  # its loop closes the socket: the port is free
    time.sleep(0.5)  # the receiver sees the link drop
    impostor = sockets.socket(zmq.ROUTER)
    impostor.bind(old)  # the old port answers connects again, but no rank is behind it
    try:
        time.sleep(1.0)  # ZMQ reconnects (every 100 ms)
        fresh = FakeRank(boot.address, FP, lambda m: outcome(m, True, num_tokens=m.num_tokens, layers=L))
        try:
            recv.start("y", boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)  # reads the new table
            assert wait_fetch(recv, "y", 20).ok
            got = []
            wait_until(lambda: got.extend(recv.poll_lifted()) or got, 10)
            assert got == [f]
        finally:
            fresh.close()
    finally:
        impostor.close()
