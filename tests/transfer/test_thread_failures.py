"""The per-thread failure rule (docs/connector.md, "Failures"): no connector thread
stops on one input or one peer, and one that dies anyway fails loudly.

Each test forces one input or one fault with real Senders, Receivers, bootstrap
servers and Mooncake, then checks that only the item's own fetch failed, with
a reason naming it, and that the thread still serves the next one.
"""

from __future__ import annotations

import contextlib
import logging
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.fake_rank import FakeRank, outcome
from tests.support.logs import logged
from tests.support.pair import DST_IDS, FP, SRC_IDS, TOKENS, Side, deadline_now, regions, wait_until

from vllm_dcp2d.transfer.auth import NO_AUTH, Auth, rank_name
from vllm_dcp2d.transfer import bootstrap as bs
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer import directory as directory_mod
from vllm_dcp2d.transfer import sender as sender_mod
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.codec import fields_to_wire
from vllm_dcp2d.transfer.messages import (PROTOCOL_VERSION, CancelTransfer, MessageError, QueryRanks, RankTable, RegisterConsumer,
                                           Reply, TransferOutcome, TransferRequest, decode, encode)
from vllm_dcp2d.reshard.regions import Memory
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.transport import MooncakeTransport
from tests.support.transfer import PD, wait_fetch, writes_in_flight

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def ok_rank(server) -> FakeRank:
    return FakeRank(server.address, FP, lambda m: outcome(m, True, num_tokens=m.num_tokens, layers=FP.num_layers))


def receiver(stack, **kw) -> Receiver:
    t = MooncakeTransport()
    stack.callback(t.close)
    dst = np.zeros((2, 8, 256), np.uint8)
    stack.callback(lambda: dst)  # keep the buffer alive until the receiver is closed
    r = Receiver(t, regions(dst), FP, engine_id="D", buffers=[(dst.ctypes.data, dst.nbytes)],
                 **({"transfer_timeout_s": 10.0, "cancel_grace_s": 0.2} | kw))
    stack.callback(r.close)
    return r


def fetch_ok(r: Receiver, server, key: str, timeout_s: float = 10.0):
    r.start(key, server.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(r, key, timeout_s)
    assert f.ok, f.error
    return f


# ---- the decode's receiver thread ----

def test_dead_rank_with_a_full_queue_never_blocks_the_receiver(stack, monkeypatch):
    """Defect 2: quarantined fetches re-send their cancels to a rank that is gone.
    Once its queue is full (SNDHWM; 4 here instead of 1000), a blocking send would
    stop the receiver thread for good. Fetches to a live prefill must still work."""
    monkeypatch.setattr(directory_mod, "SEND_HWM", 4)  # each rank's DEALER takes it as its SNDHWM
    r = receiver(stack)
    dead_server = stack.enter_context(BootstrapServer())
    dead = FakeRank(dead_server.address, FP, None)  # silent: never answers, never confirms a cancel
    def seen(kind, key):  # by key: re-sent cancels of earlier fetches arrive in between
        return any(isinstance(m, kind) and m.transfer_key == key for m in dead.seen)

    for i in range(6):  # one at a time: each is read by the rank before the next goes out
        r.start(f"q{i}", dead_server.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
        wait_until(lambda: seen(TransferRequest, f"q{i}"))
        deadline_now(r, f"q{i}")
        wait_until(lambda: seen(CancelTransfer, f"q{i}"))
    got = []
    wait_until(lambda: got.extend(r.poll()) or len(got) == 6)
    assert all(f.quarantined for f in got)
    dead.close()  # its socket closes: the port refuses, ZMQ queues for a reconnect
    time.sleep(2.5)  # the first cancel re-send (1 s) finds 6 cancels for a queue of 4
    live_server = stack.enter_context(BootstrapServer())
    live = ok_rank(live_server)
    stack.callback(live.close)
    t0 = time.monotonic()
    fetch_ok(r, live_server, "after")
    assert time.monotonic() - t0 < 5 and not r.failed


def test_malformed_bootstrap_address_fails_only_its_fetch(stack):
    """Defect 3: ``zmq connect`` raises on "tcp://h:notaport"; the fetch fails naming
    it, and the next request is served."""
    r = receiver(stack)
    server = stack.enter_context(BootstrapServer())
    rank = ok_rank(server)
    stack.callback(rank.close)
    for bad in ("tcp://127.0.0.1:notaport", "x"):
        r.start("bad", bad, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
        f = wait_fetch(r, "bad", 10)
        assert not f.ok and bad in str(f.error), f.error
        r.release("bad", bad, TOKENS, prompt_digest=PD)  # a release to it is dropped, not fatal
    fetch_ok(r, server, "good")
    assert not r.failed


def test_a_key_the_wire_refuses_fails_only_its_fetch(stack):
    """A transfer key over 512 characters: refused on encode, here, for that fetch;
    a fetch waiting at the same rank is not touched (a peer's Reply used to fail
    every fetch in flight to it)."""
    s = Side(stack)
    s.recv.start("waiting", s.boot.address, DST_IDS, num_tokens=TOKENS, prefill_wait_s=30.0, prompt_digest=PD)
    wait_until(lambda: s.sender.waiting("waiting") == 1)
    s.recv.start("k" * 600, s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(s.recv, "k" * 600, 10)
    assert not f.ok and "cannot send the request" in str(f.error) and "512" in str(f.error), f.error
    s.gate.open()
    s.sender.add_request("waiting", SRC_IDS, TOKENS, prompt_digest=PD)
    assert wait_fetch(s.recv, "waiting", 20).ok
    assert np.array_equal(s.dst, s.expected())


def test_answer_naming_another_cp_rank_does_not_end_the_attempt(stack):
    """An answer is matched by (address, attempt): one that names another CP rank
    than the attempt went to proves nothing about that rank; it stays quarantined."""
    r = receiver(stack)
    server = stack.enter_context(BootstrapServer())

    def impostor(m):
        o = outcome(m, True, num_tokens=m.num_tokens, layers=FP.num_layers)
        return TransferOutcome(**{**o.__dict__, "cp_rank": 1, "cp_size": 2})

    rank = FakeRank(server.address, FP, impostor)
    stack.callback(rank.close)
    r.start("x", server.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(r, "x", 5)
    assert not f.ok and "names cp rank 1" in str(f.error), f.error
    assert list(f.quarantined) == [0]


def test_engine_id_of_the_rank_table_must_match(stack):
    r = receiver(stack)
    server = stack.enter_context(BootstrapServer())
    rank = ok_rank(server)
    stack.callback(rank.close)
    r.start("x", server.address, DST_IDS, num_tokens=TOKENS, remote_engine_id="prefill-before-restart", prompt_digest=PD)
    f = wait_fetch(r, "x", 10)
    assert not f.ok and "'prefill-before-restart'" in str(f.error) and "'P'" in str(f.error), f.error
    assert rank.seen == []  # nothing was asked of the wrong engine
    r.start("y", server.address, DST_IDS, num_tokens=TOKENS, remote_engine_id="P", prompt_digest=PD)
    assert wait_fetch(r, "y", 10).ok


def test_an_unreadable_answer_fails_only_by_its_deadline(stack, monkeypatch):
    """A bug while reading one answer (injected into the first answer's decoding): that
    fetch fails at its deadline; the thread goes on."""
    r = receiver(stack, transfer_timeout_s=1.0)
    server = stack.enter_context(BootstrapServer())
    rank = ok_rank(server)
    stack.callback(rank.close)
    calls = []

    class Once(Auth):
        def unpack(self, frame, expect, *, me):
            if TransferOutcome in (expect or ()) and not calls:
                calls.append(1)
                raise RuntimeError("injected")
            return super().unpack(frame, expect, me=me)

    monkeypatch.setattr(r, "auth", Once())
    r.start("x", server.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(r, "x", 10)
    assert not f.ok and f.error.timed_out
    fetch_ok(r, server, "y")


def test_receiver_thread_that_dies_fails_its_fetches_and_refuses_new_ones(stack):
    r = receiver(stack)
    server = stack.enter_context(BootstrapServer())
    rank = FakeRank(server.address, FP, None)
    stack.callback(rank.close)
    r.start("x", server.address, DST_IDS, num_tokens=TOKENS, transfer_timeout_s=60.0, prompt_digest=PD)
    wait_until(lambda: rank.seen)

    def broken(*a):
        raise RuntimeError("injected outside every guard")

    r._poller.poll = broken
    r._waker.wake()
    (f,) = [wait_fetch(r, "x", 10)]
    assert not f.ok and "injected outside every guard" in str(f.error)
    assert list(f.quarantined) == [0]  # nobody hears its answer any more
    assert "injected outside every guard" in r.failed
    with pytest.raises(RuntimeError, match="receiver of DCP rank 0 is dead"):
        r.start("y", server.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)


# ---- the prefill's sender threads ----

class Raising:
    """A transport whose writes raise ``exc`` (a TypeError is what the Mooncake
    binding raised for a negative address)."""

    def __init__(self, real, exc):
        self.real, self.exc = real, exc

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        raise self.exc

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_write_that_raises_anything_fails_only_its_fetch(stack):
    """Defect 4: an exception other than ValueError/TransportError in a write used to
    skip the write's end (the request could never be freed) and kill the writer.
    Three of them (more than the two writers), then a good fetch."""
    s = Side(stack, sender_kw={"send_timeout_s": 60.0})
    s.gate.open()
    real = s.gate.transport
    s.gate.transport = Raising(real, TypeError("incompatible function arguments"))
    for i in range(3):
        s.sender.add_request(f"bad{i}", SRC_IDS, TOKENS, prompt_digest=PD)
        s.recv.start(f"bad{i}", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
        f = wait_fetch(s.recv, f"bad{i}", 10)
        assert not f.ok and "unexpected TypeError: incompatible function arguments" in str(f.error), f.error
    assert writes_in_flight(s.sender.ledger) == 0
    s.gate.transport = real
    s.sender.add_request("good", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("good", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert wait_fetch(s.recv, "good", 10).ok and np.array_equal(s.dst, s.expected())
    s.sender.ledger.expire(now=time.monotonic() + 120)  # the failed requests can still be freed
    assert {k: v for k, v in s.sender.pop_finished().items() if k.startswith("bad")} == {
        f"bad{i}": "expired" for i in range(3)}
    assert not s.sender.failed


@pytest.mark.parametrize("stage", ["decode", "plan_path", "Sender._ok"])
def test_an_exception_at_any_stage_fails_only_its_attempt(stack, monkeypatch, stage):
    """Decoding the request, planning it, building its outcome (on the I/O thread, after
    the write): one exception fails that attempt by name and the sender serves on."""
    s = Side(stack)
    s.gate.open()
    owner, name = (sender_mod.Sender, "_ok") if stage == "Sender._ok" else (sender_mod, stage)
    real = getattr(owner, name)
    calls = []

    def once(*a, **kw):
        if not calls:
            calls.append(1)
            raise RuntimeError(f"injected into {stage}")
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, once)
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(s.recv, "x", 10)
    assert not f.ok and f"injected into {stage}" in str(f.error), f.error
    # the same request asked again; once its outcome was built, a request is served once
    key = "y" if stage == "Sender._ok" else "x"
    if key == "y":
        s.sender.add_request(key, SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start(key, s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert wait_fetch(s.recv, key, 10).ok and np.array_equal(s.dst, s.expected())
    assert not s.sender.failed


def test_sender_thread_that_dies_is_reported(stack):
    s = Side(stack)

    def broken(now):
        raise RuntimeError("injected into expiry")

    s.sender.ledger.expire = broken
    wait_until(lambda: s.sender.failed)
    assert "dcp2d-send-io-0 died: RuntimeError: injected into expiry" in s.sender.failed


def test_worker_fails_the_engine_when_a_connector_thread_died():
    from vllm_dcp2d.connector.producer import ProducerWorker
    from vllm_dcp2d.connector.worker import WorkerBase

    base = WorkerBase.__new__(WorkerBase)  # what check_alive reads only: no vLLM config
    base.tp_rank = 1
    p = ProducerWorker.__new__(ProducerWorker)
    p.base, p.bootstrap = base, None
    p.sender = type("Sender", (), {"failed": "dcp2d-send-io-1 died: boom"})()
    with pytest.raises(RuntimeError, match="Sender of TP rank 1 stopped: dcp2d-send-io-1 died: boom"):
        p.check_alive()


# ---- requests that would write outside the decode's memory ----

def _raw(req: TransferRequest, **fields) -> bytes:
    """``req`` on the wire with ``fields`` replaced, bypassing encode's checks."""
    wire = {"v": PROTOCOL_VERSION, "type": "TransferRequest", **fields_to_wire(req)}
    for k, v in fields.items():
        wire[k] = np.asarray(v, dtype="<i8").tobytes() if isinstance(v, (list, np.ndarray)) else v
    return msgpack.packb(wire, use_bin_type=True)


def _ask(address: str, payload: bytes, more_ms: int = 0, register: RegisterConsumer | None = None):
    """Send one raw message (after ``register``, the connection's registration) and
    return its answer; with ``more_ms``, check that no second answer follows within that time."""
    sock = sockets.socket(zmq.DEALER)
    try:
        sock.connect(address)
        if register is not None:
            sock.send(encode(register))
        sock.send(payload)
        assert sock.poll(10_000), "no answer"
        out = decode(sock.recv(), (TransferOutcome, Reply))
        assert not (more_ms and sock.poll(more_ms)), "a second answer to one attempt"
        return out
    finally:
        sock.close()


def _request(s: Side, attempt: int, key: str = "x") -> TransferRequest:
    return TransferRequest.build(
        regions=regions(s.dst), block_ids=DST_IDS,
        transfer_key=key, attempt_id=attempt, engine_id="D", consumer_rank=0, consumer_size=1,
        dcp_size=1, dcp_rank=0, num_tokens=TOKENS, first_page=0,
        num_blocks=8, fingerprint=FP, wait_s=0.0, prompt_digest=PD)


def _registration(session: str, dst: np.ndarray) -> RegisterConsumer:
    return RegisterConsumer.of("D", session, Memory([dst.ctypes.data], [dst.nbytes]))


@pytest.mark.parametrize("fields,match", [
    ({"base": [(1 << 63) - 1000, (1 << 63) - 500]}, "rejected message.*overflows int64"),
    ({"page_stride": [1 << 60]}, "overflows int64|not inside the memory this connection registered"),
    ({"num_blocks": 9}, "not inside the memory this connection registered"),
    ({"block_ids": [7, 1, 4, 8]}, "rejected message.*block_ids must be < num_blocks=8, got 8"),
    ({"base": [16, 272]}, "not inside the memory this connection registered"),
])
def test_request_outside_registered_memory_is_refused_by_name(stack, fields, match):
    s = Side(stack)
    s.gate.open()
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    me = _registration(s.recv.transport.session_id, s.dst)
    out = _ask(s.sender.address, _raw(_request(s, 41), **fields), register=me)
    assert isinstance(out, TransferOutcome) and out.attempt_id == 41 and not out.ok
    assert __import__("re").search(match, out.reason), out.reason
    assert not s.gate.entered.is_set() and not s.dst.any()  # nothing was planned, nothing written
    out = _ask(s.sender.address, encode(_request(s, 42)), register=me)  # the same request, well-formed
    assert out.ok and np.array_equal(s.dst, s.expected())


def test_encode_refuses_what_decode_would():
    with pytest.raises(MessageError, match="1..512 characters, got 513"):
        encode(CancelTransfer("k" * 513, 1))
    with pytest.raises(MessageError, match="attempt_id must be in"):
        encode(CancelTransfer("k", -1))
    assert isinstance(decode(encode(QueryRanks("d", "d"))), QueryRanks)


def test_bootstrap_server_answers_a_message_it_cannot_handle(stack, monkeypatch):
    server = stack.enter_context(BootstrapServer())

    def broken(msg):
        raise RuntimeError("injected into register")

    monkeypatch.setattr(server, "_register", broken)
    from vllm_dcp2d.transfer.messages import RegisterRank
    out = bs.request(server.address, RegisterRank("P", 0, 1, "tcp://127.0.0.1:1", FP), Reply, 5,
                     NO_AUTH.registration(""), me=rank_name("P", 0))
    assert not out.ok and "injected into register" in out.reason
    monkeypatch.undo()
    bs.register_rank(server.address, RegisterRank("P", 0, 1, "tcp://127.0.0.1:1", FP), 5)
    assert isinstance(bs.request(server.address, QueryRanks("D", "D"), (RankTable, Reply), 5), RankTable)
    assert not server.failed


# ---- the fuzz: drawn requests against a real Sender and real registered memory ----

class Recording:
    """The sender's transport, recording every descriptor it writes."""

    def __init__(self, real):
        self.real, self.writes = real, []

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        self.writes.append((desc.dst.copy(), desc.length.copy()))
        return self.real.write(peer, desc, stalls, not_after_ns)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def fuzz_side():
    """A real Sender holding request "x", and a decode transport that registered
    only the middle third of its buffer (the outer thirds must stay untouched)."""
    from vllm_dcp2d.transfer.sender import Sender

    with contextlib.ExitStack() as stack:
        # what the sender logs at ERROR: a bug hit in one of its threads (log.exception)
        errors = stack.enter_context(logged("vllm_dcp2d.transfer.sender", logging.ERROR))
        rng = np.random.default_rng(1)
        src = rng.integers(1, 255, (2, 8, 256), dtype=np.uint8)
        tp, td = MooncakeTransport(), MooncakeTransport()
        stack.callback(td.close)
        stack.callback(tp.close)
        tp.register(src.ctypes.data, src.nbytes)
        buf = np.zeros(3 * 2 * 8 * 256, np.uint8)
        dst = buf[2 * 8 * 256: 2 * 2 * 8 * 256].reshape(2, 8, 256)
        td.register(dst.ctypes.data, dst.nbytes)
        rec = Recording(tp)
        sender = Sender(rec, regions(src), FP, engine_id="P", cp_rank=0, cp_size=1)
        stack.callback(sender.close)
        sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
        yield sender, rec, td, buf, dst, errors


@pytest.mark.timeout(300)
@given(st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_sender_never_writes_outside_registered_memory(fuzz_side, data):
    """No exception escapes a thread, every write lands inside the range the decode
    registered, and every attempt gets exactly one answer."""
    sender, rec, td, buf, dst, errors = fuzz_side
    n = next(_attempts)
    honest = TransferRequest.build(
        regions=regions(dst), block_ids=DST_IDS,
        transfer_key="x", attempt_id=n, engine_id=f"D{n}", consumer_rank=0, consumer_size=2,
        dcp_size=1, dcp_rank=0, num_tokens=TOKENS, first_page=0, num_blocks=8,
        fingerprint=FP, wait_s=0.0, prompt_digest=PD)
    edits = {}
    if data.draw(st.booleans(), "edit block_ids"):
        edits["block_ids"] = data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=12), "block_ids")
        edits["group_sizes"] = [len(edits["block_ids"])]
    if data.draw(st.booleans(), "edit num_blocks"):
        edits["num_blocks"] = data.draw(st.integers(1, 64), "num_blocks")
    if data.draw(st.booleans(), "edit base"):
        shift = data.draw(st.sampled_from([-dst.nbytes, -256, 256, dst.nbytes, (1 << 62)]), "base shift")
        edits["base"] = np.clip(honest.base + shift, 1, (1 << 63) - 1)
    if data.draw(st.booleans(), "edit page_stride"):
        edits["page_stride"] = [data.draw(st.sampled_from([1, 128, 256, 512, 8 * 256, 1 << 40, 1 << 62]),
                                          "page_stride")]
    if data.draw(st.booleans(), "edit topology"):
        size = data.draw(st.integers(1, 4), "dcp_size")
        edits["dcp_size"], edits["dcp_rank"] = size, data.draw(st.integers(0, size - 1), "dcp_rank")
        edits["first_page"] = data.draw(st.integers(0, 6), "first_page")
    if data.draw(st.booleans(), "edit num_tokens"):
        edits["num_tokens"] = data.draw(st.integers(0, 8 * 16), "num_tokens")
    before = len(rec.writes)
    out = _ask(sender.address, _raw(honest, **edits), more_ms=30, register=_registration(td.session_id, dst))
    assert isinstance(out, TransferOutcome) and out.attempt_id == n, out
    assert not sender.failed
    lo, hi = dst.ctypes.data, dst.ctypes.data + dst.nbytes
    for d, length in rec.writes[before:]:
        assert ((d >= lo) & (d + length <= hi)).all(), (edits, out.reason)
    outside = np.concatenate([buf[: 2 * 8 * 256], buf[2 * 2 * 8 * 256:]])
    assert not outside.any(), f"bytes landed outside the registered range: {edits}"
    assert not any("unexpected" in e for e in errors), errors  # no bug hit in a thread
    if out.ok:
        _served.append(n)


_served: list[int] = []


def test_the_fuzz_served_some_requests(fuzz_side):
    """The fuzz above is not all refusals: honest draws were written."""
    assert _served


_attempts = iter(range(1000, 1 << 30))
