"""Explicit release (``ReleaseTransfer``): a decode rank that will not fetch a
request tells the prefill rank, which frees it at once instead of at
``send_timeout_s``, but never while a write reads its blocks, and never while
another decode engine still fetches it. Real Sender/Receiver, real Mooncake,
writes held open by a gate (``test_safety.Gate``) to force each race.
"""

import contextlib
import dataclasses
import time

import numpy as np
import pytest

from tests.support.pair import DST_IDS, FP, SRC_IDS, TOKENS, Side, deadline_now, regions, wait_until
from vllm_dcp2d.transfer import send_ledger
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.transport import MooncakeTransport
from tests.support.transfer import PD, wait_fetch, writes_in_flight

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def finished_within(sender, timeout_s: float = 10.0) -> dict:
    out: dict = {}
    wait_until(lambda: out.update(sender.pop_finished()) or out, timeout_s)
    return out


def receiver(stack, engine_id: str, dst: np.ndarray, fingerprint=FP, **kw) -> Receiver:
    t = MooncakeTransport()
    stack.callback(t.close)
    kw = {"transfer_timeout_s": 30.0, "cancel_grace_s": 0.5} | kw
    r = Receiver(t, regions(dst), fingerprint, engine_id=engine_id, buffers=[(dst.ctypes.data, dst.nbytes)], **kw)
    stack.callback(r.close)
    return r


def test_release_frees_at_once_and_later_fetches_fail(stack):
    s = Side(stack, sender_kw={"send_timeout_s": 120.0})
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    t0 = time.monotonic()
    s.recv.release("x", s.boot.address, TOKENS, prompt_digest=PD)
    assert finished_within(s.sender) == {"x": "released"}
    assert time.monotonic() - t0 < 10.0  # not send_timeout_s
    s.recv.release("x", s.boot.address, TOKENS, prompt_digest=PD)  # a duplicate: harmless, reported once
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(s.recv, "x", 20)
    assert not f.ok and "no request 'x' for this prompt" in str(f.error)
    time.sleep(0.3)
    assert s.sender.pop_finished() == {} and not s.gate.entered.is_set()
    assert not s.dst.any()


def test_release_during_a_write_takes_effect_when_it_settles(stack):
    """The decode gives up on a fetch (its deadline) while the prefill's write is
    held open, then releases the request: the prefill reports it finished only
    after that write returned."""
    s = Side(stack, sender_kw={"send_timeout_s": 120.0}, receiver_kw={"cancel_grace_s": 0.3})
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    deadline_now(s.recv, "x")
    f = wait_fetch(s.recv, "x", 20)
    assert not f.ok and f.quarantined  # the write never answered the cancel
    s.recv.release("x", s.boot.address, TOKENS, prompt_digest=PD)
    time.sleep(1.0)  # the release arrived; the write still reads the blocks
    assert s.sender.pop_finished() == {}, "blocks freed while a write reads them"
    assert writes_in_flight(s.sender.ledger) == 1
    s.gate.open()
    finished = finished_within(s.sender)
    released_at = time.monotonic()
    assert finished == {"x": "released"} and s.gate.ended[-1] <= released_at


def test_release_of_one_engine_keeps_what_another_engine_fetches(stack):
    """Two decode groups (DCP=1 engine "D" and engine "E") name the same transfer.
    E releases while D's write is in flight: the request stays until D is served."""
    s = Side(stack, sender_kw={"send_timeout_s": 120.0})
    other = receiver(stack, "E", np.zeros_like(s.dst))
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    other.release("x", s.boot.address, TOKENS, prompt_digest=PD)
    time.sleep(1.0)
    assert s.sender.pop_finished() == {}
    s.gate.open()
    f = wait_fetch(s.recv, "x", 20)
    assert f.ok and np.array_equal(s.dst, s.expected())
    assert finished_within(s.sender) == {"x": "done"}


def test_a_decode_of_another_kv_format_still_releases_what_it_refused(stack):
    """A decode whose fingerprint differs (another fp8 encoding, other scales) fails the
    fetch naming both values, writing nothing; its release, which moves no KV, still
    reaches the prefill's ranks through the refused rank table: the blocks are freed at
    once, not at the prefill's claim_timeout_s (a misconfigured decode group would
    otherwise hold the shared prefill's memory for every request it refuses)."""
    s = Side(stack, sender_kw={"send_timeout_s": 120.0})
    dst = np.zeros_like(s.dst)
    other = receiver(stack, "E", dst, fingerprint=dataclasses.replace(FP, kv_dtype="fp8_e5m2"))
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    other.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(other, "x", 20)
    assert not f.ok and "kv_dtype: ours 'fp8_e5m2', peer 'uint8'" in str(f.error), f.error
    t0 = time.monotonic()
    other.release("x", s.boot.address, TOKENS, prompt_digest=PD)  # as the worker does for a failed fetch
    assert finished_within(s.sender) == {"x": "released"}
    assert time.monotonic() - t0 < 10.0 and not dst.any() and not s.gate.entered.is_set()


def test_a_release_for_another_prefill_engine_is_not_sent(stack):
    """The request named prefill engine "P-old", but its bootstrap address now serves
    "P" (restarted, or another instance on that address): the release is not sent there,
    where it could free a request of "P" that reuses the key before its own decode
    fetches it. The same release naming "P" frees it at once."""
    s = Side(stack, sender_kw={"send_timeout_s": 120.0})
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    s.recv.release("x", s.boot.address, TOKENS, remote_engine_id="P-old", prompt_digest=PD)
    wait_until(lambda: "x" not in str(s.recv._dir._unsent))  # the table came and the release was dropped
    time.sleep(0.5)
    assert s.sender.pop_finished() == {} and not s.sender.ledger._early
    s.recv.release("x", s.boot.address, TOKENS, remote_engine_id="P", prompt_digest=PD)
    assert finished_within(s.sender) == {"x": "released"}


def test_release_counts_per_consumer_rank(stack):
    """A decode engine of 2 ranks: rank 1 releases, rank 0 still fetches: the
    request is freed once rank 0 got its pages, not before."""
    s = Side(stack, sender_kw={"send_timeout_s": 120.0}, receiver_kw={"consumer_size": 2})
    rank1 = receiver(stack, "D", np.zeros_like(s.dst), consumer_rank=1, consumer_size=2)
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    rank1.release("x", s.boot.address, TOKENS, prompt_digest=PD)
    time.sleep(1.0)
    assert s.sender.pop_finished() == {}  # rank 0 has not fetched
    s.gate.open()
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert wait_fetch(s.recv, "x", 20).ok
    assert finished_within(s.sender) == {"x": "released"}  # one rank fetched, the other released


def test_release_before_the_request_is_added_is_remembered(stack, monkeypatch):
    s = Side(stack, sender_kw={"send_timeout_s": 120.0})
    s.recv.release("early", s.boot.address, TOKENS, prompt_digest=PD)
    s.recv.release("other-count", s.boot.address, TOKENS + 1, prompt_digest=PD)
    wait_until(lambda: len(s.sender.ledger._early) == 2)
    s.sender.add_request("early", SRC_IDS, TOKENS, prompt_digest=PD)
    s.sender.add_request("other-count", SRC_IDS, TOKENS, prompt_digest=PD)  # the key was reused: not this request's release
    assert finished_within(s.sender) == {"early": "released"}
    time.sleep(0.5)
    assert s.sender.pop_finished() == {}


def test_remembered_releases_expire(stack):
    s = Side(stack, sender_kw={"send_timeout_s": 120.0})
    s.recv.release("late", s.boot.address, TOKENS, prompt_digest=PD)
    wait_until(lambda: "late" in s.sender.ledger._early)
    # RELEASE_MEMORY_S passes now (the I/O thread's own polls would take 30 s)
    s.sender.ledger.expire(time.monotonic() + send_ledger.RELEASE_MEMORY_S + 1)
    assert "late" not in s.sender.ledger._early
    s.sender.add_request("late", SRC_IDS, TOKENS, prompt_digest=PD)
    time.sleep(0.5)
    assert s.sender.pop_finished() == {}


def test_release_without_a_prefill_gives_up(stack):
    """No bootstrap answers: the release waits for the rank table at most the
    receiver's timeout, then is dropped (the prefill's send_timeout_s is the backstop)."""
    r = receiver(stack, "D", np.zeros((2, 8, 256), np.uint8), transfer_timeout_s=0.3)
    r.release("x", "tcp://127.0.0.1:1", TOKENS, prompt_digest=PD)
    wait_until(lambda: r._dir._unsent)
    wait_until(lambda: not r._dir._unsent, 3.0)
