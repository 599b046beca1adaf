"""Writes go only where the asking decode registered (issue 48, finding 1: the confused
deputy), ``transfer/consumers.py``.

On e1efa24 a ``TransferRequest`` named its own Mooncake session and memory: a stranger with
one valid key (its own request) named a victim decode's session and addresses, and the
prefill overwrote 2,048 of the victim's bytes; naming the prefill's own session, it
overwrote another request's source blocks. Here the attack runs from its own OS process
(``support/stranger.py``) on another loopback address (127.0.0.2, standing for another
host) against real Senders, Receivers and Mooncake engines: nothing is written, with and
without a secret, and each of two decodes gets exactly its own bytes."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import zmq

from tests.support.stranger import run as stranger
from tests.support.transfer import wait_fetch
from tests.support.pair import SRC_IDS, TOKENS
from tests.support.one_rank import DIGEST, SECRET, Decode, Prefill
from vllm_dcp2d.reshard.regions import Memory
from vllm_dcp2d.transfer import consumers, sockets
from vllm_dcp2d.transfer.auth import Auth
from vllm_dcp2d.transfer.consumers import Consumers
from vllm_dcp2d.transfer.messages import RegisterConsumer, TransferRequest, encode

pytestmark = [pytest.mark.mooncake, pytest.mark.multiproc, pytest.mark.timeout(180)]

MEMORY = Memory([4096], [1 << 20])


def reg(session: str, engine: str = "D", memory: Memory = MEMORY) -> RegisterConsumer:
    return RegisterConsumer.of(engine, session, memory)


# ---- the rules, on their own ----

def test_without_a_secret_a_session_must_be_on_the_connections_host():
    c = Consumers("cp rank 0", lambda: {"127.0.0.1:7000"}, sealed=False)
    assert c.register(b"a", reg("10.0.0.2:15001"), "10.0.0.2").refused == ""
    got = c.register(b"b", reg("10.0.0.3:15001"), "10.0.0.2").refused
    assert "must be on the host its side channel comes from (this connection comes from 10.0.0.2)" in got
    assert "refused the registration of Mooncake session '10.0.0.3:15001'" in got
    assert "without an auth secret" in c.register(b"c", reg("decode-3:15001"), "10.0.0.2").refused  # a name
    assert c.register(b"d", reg("[::1]:15001"), "::1").refused == ""  # IPv6, bracketed or not
    assert c.get(b"a").session == "10.0.0.2:15001" and c.get(b"b").refused and c.get(b"z") is None
    assert c.take_refused() == 2 and c.take_refused() == 0


def test_a_prefill_never_takes_its_own_session():
    for sealed in (False, True):
        c = Consumers("cp rank 0", lambda: {"127.0.0.1:7000", "127.0.0.1:7001"}, sealed=sealed)
        for own in ("127.0.0.1:7000", "127.0.0.1:7001"):  # its engine's, and a retired engine's
            assert "this prefill rank's own session" in c.register(b"a", reg(own), "127.0.0.1").refused


def test_with_a_secret_any_host_and_the_engine_is_the_source():
    c = Consumers("cp rank 0", lambda: set(), sealed=True)
    got = c.register(b"a", reg("10.0.0.9:15001", engine="E"), "10.0.0.2")
    assert got.refused == "" and got.source == "engine E"


def test_registrations_are_capped_per_source_and_a_flood_cannot_push_others_out(monkeypatch):
    monkeypatch.setattr(consumers, "PER_SOURCE", 4)
    c = Consumers("cp rank 0", lambda: set(), sealed=False)
    assert c.register(b"legit", reg("10.0.0.1:1"), "10.0.0.1").refused == ""
    for i in range(50):  # one source's connections: it replaces its own oldest
        assert c.register(b"f%d" % i, reg("10.0.0.2:1"), "10.0.0.2").refused == ""
    assert len(c) == 1 + 4 and c.get(b"f49") is not None and c.get(b"f0") is None
    assert c.get(b"legit").refused == ""


def test_refusals_are_remembered_in_a_bounded_table(monkeypatch):
    monkeypatch.setattr(consumers, "MAX_REFUSED", 8)
    c = Consumers("cp rank 0", lambda: set(), sealed=False)
    for i in range(100):
        c.register(b"x%d" % i, reg("10.0.0.3:1"), "10.0.0.2")
    assert len(c._refusals) == 8 and c.get(b"x99").refused and c.get(b"x0") is None


def test_an_idle_registration_is_dropped():
    c = Consumers("cp rank 0", lambda: set(), sealed=False)
    c.register(b"a", reg("10.0.0.2:1"), "10.0.0.2")
    c.expire(time.monotonic() + consumers.IDLE_S - 5)
    assert c.get(b"a") is not None
    c.expire(time.monotonic() + consumers.IDLE_S + 1)
    assert c.get(b"a") is None and len(c) == 0


# ---- the attack, through the real transport ----

@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def _memory(arr: np.ndarray) -> str:
    return f"{arr.ctypes.data}:{arr.nbytes}"


def test_a_strangers_own_request_cannot_be_written_into_another_decode(stack):
    """The review's attack with no secret: the stranger (on another host) holds a valid key
    and digest, its own request's, and registers a victim decode's session and memory.
    The prefill refuses the registration, naming why, and writes nothing: the victim's
    bytes stay what it fetched and verified. The victim then fetches again, exact."""
    p = Prefill(stack)
    victim = Decode(stack, verify_kv=True)
    p.add("victim-key")
    assert victim.fetch(p.boot.address, "victim-key").ok
    before = victim.dst.copy()
    assert np.array_equal(before, victim.expected(p.src))
    p.sender.add_request("strangers-own", SRC_IDS[::-1].copy(), TOKENS, DIGEST)  # other bytes than the victim's
    got = stranger("deputy", p.boot.address, key="strangers-own", tokens=TOKENS, digest=DIGEST,
                   session=victim.transport.session_id, memory=_memory(victim.dst),
                   source="127.0.0.2")["deputy"][p.sender.address]
    assert got.startswith("TransferOutcome: cp rank 0 refused the registration of Mooncake session "
                          f"'{victim.transport.session_id}': without an auth secret, a decode's session must be on the "
                          "host its side channel comes from (this connection comes from 127.0.0.2)"), got
    time.sleep(0.5)
    assert np.array_equal(victim.dst, before)
    assert p.sender.consumers.take_refused() == 1
    p.add("again")
    assert victim.fetch(p.boot.address, "again").ok and np.array_equal(victim.dst, before)


def test_a_stranger_cannot_make_the_prefill_write_into_its_own_memory(stack):
    """The review's second attack: naming the prefill's own session and source blocks, a
    stranger overwrote another request's KV there, and that request's fetch then ended ok
    with verify_kv (the checksum was taken over the corrupted source). Refused, from any
    host; the other request's fetch is exact."""
    p = Prefill(stack)
    src = p.src.copy()
    p.add("other-request")
    p.sender.add_request("strangers-own", SRC_IDS[::-1].copy(), TOKENS, DIGEST)
    got = stranger("deputy", p.boot.address, key="strangers-own", tokens=TOKENS, digest=DIGEST,
                   session=p.transport.session_id, memory=_memory(p.src))["deputy"][p.sender.address]
    assert "this prefill rank's own session (a prefill never writes into its own memory for a peer)" in got, got
    time.sleep(0.5)
    assert np.array_equal(p.src, src)
    d = Decode(stack, verify_kv=True)
    f = d.fetch(p.boot.address, "other-request")
    assert f.ok and np.array_equal(d.dst, d.expected(src))


def test_with_a_secret_the_strangers_frames_are_dropped_unread(stack):
    """With a secret the stranger cannot read the rank table, and frames it sends a rank
    straight (its registration naming the victim, its request) are dropped unread and
    counted: no answer, no byte written."""
    auth = Auth(SECRET)
    p = Prefill(stack, auth=auth)
    victim = Decode(stack, auth=Auth(SECRET))
    p.add("victim-key")
    assert victim.fetch(p.boot.address, "victim-key").ok
    before = victim.dst.copy()
    assert stranger("deputy", p.boot.address, key="victim-key", tokens=TOKENS, digest=DIGEST,
                    session=victim.transport.session_id, memory=_memory(victim.dst),
                    source="127.0.0.2")["deputy"] == {"table": None}
    sock = sockets.socket(zmq.DEALER)
    stack.callback(sock.close)
    sock.connect(p.sender.address.replace("tcp://", "tcp://127.0.0.2:0;"))
    req = TransferRequest.build(regions=victim.recv.regions, block_ids=[0, 1, 2, 3], transfer_key="victim-key",
                                attempt_id=1, engine_id="stranger", consumer_rank=0, consumer_size=1, dcp_size=1,
                                dcp_rank=0, num_tokens=TOKENS, first_page=0, num_blocks=8,
                                fingerprint=victim.recv.fingerprint, wait_s=0.0, prompt_digest=DIGEST)
    assert auth.take_refused() >= 1  # the stranger's table query, at the bootstrap
    sock.send(encode(reg(victim.transport.session_id, memory=victim.recv.memory)))
    sock.send(encode(req))
    assert not sock.poll(1500)
    assert np.array_equal(victim.dst, before) and len(p.sender.consumers) == 1  # only the victim's link
    assert auth.take_refused() == 2


def test_two_decodes_each_get_exactly_their_own_bytes(stack):
    """Each link writes only where its own decode registered: two decodes fetching two
    requests at once from one prefill rank each hold exactly their request's pages."""
    p = Prefill(stack)
    a, b = Decode(stack), Decode(stack)
    p.add("a")
    p.sender.add_request("b", SRC_IDS[::-1].copy(), TOKENS, DIGEST)
    a.recv.start("a", p.boot.address, a_ids := np.array([7, 1, 4, 3]), num_tokens=TOKENS, prompt_digest=DIGEST)
    b.recv.start("b", p.boot.address, a_ids, num_tokens=TOKENS, prompt_digest=DIGEST)
    assert wait_fetch(a.recv, "a", 20).ok and wait_fetch(b.recv, "b", 20).ok
    want_b = np.zeros_like(b.dst)
    want_b[:, a_ids] = p.src[:, SRC_IDS[::-1]]
    assert np.array_equal(a.dst, a.expected(p.src)) and np.array_equal(b.dst, want_b)
    assert not np.array_equal(a.dst, b.dst)
    sessions = {r.session for r, _ in p.sender.consumers._by_link.values()}
    assert sessions == {a.transport.session_id, b.transport.session_id}


def test_only_the_processs_own_receiver_may_register_its_own_session():
    """A ``kv_both`` worker fetches from its own sender into the same engine's memory: its
    receiver's link is trusted with the own session (the worker names it), no other."""
    c = Consumers("cp rank 0", lambda: {"127.0.0.1:7000"}, sealed=False)
    c.trust(b"own-receiver")
    assert c.register(b"own-receiver", reg("127.0.0.1:7000"), "127.0.0.1").refused == ""
    assert "this prefill rank's own session" in c.register(b"another", reg("127.0.0.1:7000"), "127.0.0.1").refused


def test_a_full_table_makes_room_from_the_source_holding_most(monkeypatch):
    """An idle flood from many addresses (a review: 48 addresses held all 4,096 entries for
    300 s) cannot keep a new decode out: the source holding the most gives up its least
    recently used registration to one holding fewer."""
    monkeypatch.setattr(consumers, "TOTAL", 12)
    monkeypatch.setattr(consumers, "PER_SOURCE", 6)
    c = Consumers("cp rank 0", lambda: set(), sealed=False)
    for i in range(6):
        assert c.register(b"a%d" % i, reg("10.0.0.2:1"), "10.0.0.2").refused == ""
    for i in range(5):
        assert c.register(b"b%d" % i, reg("10.0.0.3:1"), "10.0.0.3").refused == ""
    for i in range(4):  # the table holds 12: room comes from the biggest source each time
        assert c.register(b"n%d" % i, reg("10.0.0.9:1"), "10.0.0.9").refused == "", i
    held = [sum(c.get(b"%s%d" % (x, i)) is not None for i in range(6)) for x in (b"a", b"b", b"n")]
    assert held == [4, 4, 4] and c.get(b"a0") is None and c.get(b"b0") is None  # the least recently used went
    assert c.register(b"n4", reg("10.0.0.9:1"), "10.0.0.9").refused  # no source holds more than it would


def test_a_session_has_one_spelling():
    """Leading zeros or another spelling of an address made one session many (its handshake
    back-off and the own-session check compare strings): refused at decode."""
    from vllm_dcp2d.transfer.messages import MessageError, decode
    for bad, why in (("127.0.0.1:0123", "without leading zeros"), ("0:0:0:0:0:0:0:1:5", "write its address as '::1'")):
        with pytest.raises(MessageError, match=why):
            decode(encode(reg(bad)))
