"""A quarantine ends (issue 48, finding 4): the fence.

On e1efa24 a prefill rank that accepted the side channel and never answered (dead,
frozen, or a fake prefill named in ``kv_transfer_params``) kept the fetch's blocks
quarantined for good: after 75 s still unsettled, and repeated, the decode's block pool
drained. Now every attempt carries its fetch's deadline on the wall clock
(``TransferRequest.not_after_ns``): a prefill rank starts no write of it after that, a
write started before has ended within ``WRITE_LIMIT_S``, so the decode lifts the
quarantine ``fence_s`` after the deadline whatever the rank says; one prefill instance
may keep at most ``max_quarantined_blocks`` quarantined, past which its fetches are
refused. Real Senders, Receivers and Mooncake engines; the silent rank is a real socket."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import zmq

from tests.support.fake_rank import FakeRank, outcome
from tests.support.transfer import PD, wait_fetch
from tests.support.pair import DST_IDS, FP, L, SRC_IDS, TOKENS, Side, regions, wait_until
from vllm_dcp2d.reshard.regions import Memory
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.messages import RegisterConsumer, TransferOutcome, TransferRequest, decode, encode
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.transport import MooncakeTransport

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def receiver(stack, **kw) -> tuple[Receiver, np.ndarray]:
    t = MooncakeTransport()
    stack.callback(t.close)
    dst = np.zeros((L, 8, 256), np.uint8)
    r = Receiver(t, regions(dst), FP, engine_id="D", buffers=[(dst.ctypes.data, dst.nbytes)], **kw)
    stack.callback(r.close)
    return r, dst


def test_a_silent_ranks_quarantine_lifts_at_its_fence(stack):
    """The rank takes the request and never answers, not even the cancel: the fetch fails
    at its deadline with the blocks quarantined, and they come back ``fence_s`` after the
    deadline, not before; the cancels stop then."""
    boot = stack.enter_context(BootstrapServer())
    rank = FakeRank(boot.address, FP, None)
    stack.callback(rank.close)
    r, _ = receiver(stack, transfer_timeout_s=1.0, cancel_grace_s=0.2, fence_s=2.0)
    r.start("q", boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(r, "q", 20)
    assert f.error.timed_out and list(f.quarantined) == [0]
    deadline = f.started + 1.0
    lifted = []
    wait_until(lambda: lifted.extend(r.poll_lifted()) or lifted, 20)
    at = time.monotonic()
    assert lifted == [f] and deadline + 2.0 <= at < deadline + 2.0 + 1.5, at - deadline
    assert r.ledger.quarantined_blocks(boot.address) == 0
    cancels = rank.cancels()
    time.sleep(2.5)  # its cancel would have gone out again by now (1, 2, 4 s backoff)
    assert rank.cancels() == cancels


def test_one_prefill_instance_may_keep_only_so_many_blocks_quarantined(stack):
    """Past ``max_quarantined_blocks`` (here one fetch's 4) a silent instance's next fetch
    is refused at once, naming why; another instance is served meanwhile; once the fence
    lifts it, the first instance is asked again."""
    silent_boot = stack.enter_context(BootstrapServer())
    silent = FakeRank(silent_boot.address, FP, None)
    stack.callback(silent.close)
    other_boot = stack.enter_context(BootstrapServer())
    other = FakeRank(other_boot.address, FP, lambda m: outcome(m, True, num_tokens=m.num_tokens, layers=L))
    stack.callback(other.close)
    r, _ = receiver(stack, transfer_timeout_s=1.0, cancel_grace_s=0.2, fence_s=1.5, max_quarantined_blocks=4)
    r.start("a", silent_boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert list(wait_fetch(r, "a", 20).quarantined) == [0]
    r.start("b", silent_boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(r, "b", 5)
    assert not f.ok and f.error.reason == (
        f"the prefill instance at {silent_boot.address} keeps 4 blocks of this decode rank quarantined (at most 4): "
        f"its fetches are refused until its ranks settle, at the latest 2s after each fetch's deadline")
    asked = len(silent.seen)
    r.start("c", other_boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert wait_fetch(r, "c", 10).ok
    wait_until(lambda: r.poll_lifted(), 20)
    silent.reply = lambda m: outcome(m, True, num_tokens=m.num_tokens, layers=L)
    r.start("d", silent_boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert wait_fetch(r, "d", 10).ok and len(silent.seen) > asked


def _link(stack, s: Side):
    """A decode's side-channel link to ``s``'s sender, its session registered."""
    sock = sockets.socket(zmq.DEALER)
    stack.callback(sock.close)
    sock.connect(s.sender.address)
    sock.send(encode(RegisterConsumer.of("D", s.recv.transport.session_id, Memory([s.dst.ctypes.data],
                                                                                    [s.dst.nbytes]))))
    return sock


def _request(s: Side, not_after_ns: int, attempt: int, wait_s: float) -> TransferRequest:
    return TransferRequest.build(
        regions=regions(s.dst), block_ids=DST_IDS, transfer_key="x", attempt_id=attempt, engine_id="D",
        consumer_rank=0, consumer_size=1, dcp_size=1, dcp_rank=0, num_tokens=TOKENS, first_page=0, num_blocks=8,
        fingerprint=FP, wait_s=wait_s, prompt_digest=PD, not_after_ns=not_after_ns)


def test_no_write_starts_after_the_attempts_deadline(stack):
    """The prefill rank's side of the fence, with no cancel to help (the decode here sends
    none, as a decode whose cancel is lost): an attempt waits for its request past its
    deadline; when the request then comes, and when its layers are computed, nothing is
    written and the answer says why. The same request, asked in time, is served."""
    s = Side(stack)
    s.gate.open()
    sock = _link(stack, s)
    sock.send(encode(_request(s, time.time_ns() + 300_000_000, 1, wait_s=10.0)))  # its deadline: in 0.3 s
    wait_until(lambda: s.sender.waiting("x") == 1)
    time.sleep(0.5)  # past the deadline, while it waits for the prefill
    s.sender.layer_ready("x", 0, SRC_IDS, TOKENS, prompt_digest=PD)  # a layer computed: not written now
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    assert sock.poll(10_000)
    out = decode(sock.recv(), TransferOutcome)
    assert not out.ok and out.settled and "the decode's deadline for this attempt passed" in out.reason, out.reason
    assert not s.gate.ended and not s.dst.any()  # not one write started
    sock.send(encode(_request(s, time.time_ns() + 10 ** 10, 2, wait_s=0.0)))
    assert sock.poll(10_000)
    assert decode(sock.recv(), TransferOutcome).ok and np.array_equal(s.dst, s.expected())


def test_a_write_already_past_its_fence_is_not_retried(stack):
    """The transport's side: a batch and each retry of it start only before the fence; a
    write asked for after it raises, naming the fence, and moves nothing."""
    s = Side(stack)
    from vllm_dcp2d.reshard.plan import Descriptors
    desc = Descriptors(np.array([s.src.ctypes.data]), np.array([s.dst.ctypes.data]), np.array([256]))
    with pytest.raises(Exception, match="deadline passed, so no write of it starts any more"):
        s.gate.transport.write(s.recv.transport.session_id, desc, [], time.time_ns() - 1)
    assert not s.dst.any()
    assert s.gate.transport.write(s.recv.transport.session_id, desc, [], time.time_ns() + 10 ** 10) == 256
    assert np.array_equal(s.dst.reshape(-1)[:256], s.src.reshape(-1)[:256])


def test_a_prefill_clock_behind_the_decodes_moves_the_fence_only_by_the_messages_delay(stack):
    """A review set the prefill's clock 200 s behind the decode's: an attempt whose fence had
    passed was still written. The request also carries the time it had left
    (``budget_ns``), and the rank stops at whichever comes first by its own clock."""
    s = Side(stack)
    s.gate.open()
    sock = _link(stack, s)
    req = _request(s, time.time_ns() + 200 * 10 ** 9, 1, wait_s=10.0)  # by this clock, 200 s away ...
    sock.send(encode(TransferRequest.build(**{**_args(req), "budget_ns": 300_000_000})))  # ... but 0.3 s left
    wait_until(lambda: s.sender.waiting("x") == 1)
    time.sleep(0.5)
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    assert sock.poll(10_000)
    out = decode(sock.recv(), TransferOutcome)
    assert not out.ok and "the decode's deadline for this attempt passed" in out.reason, out.reason
    assert not s.gate.ended and not s.dst.any()


def _args(req: TransferRequest) -> dict:
    keep = ("transfer_key", "attempt_id", "engine_id", "consumer_rank", "consumer_size", "dcp_size", "dcp_rank",
            "num_tokens", "first_page", "num_blocks", "fingerprint", "wait_s", "prompt_digest", "not_after_ns")
    return {k: getattr(req, k) for k in keep} | {"regions": req.regions(), "block_ids": req.tables()}


def test_all_prefill_instances_together_keep_at_most_twice_one_instances_share(stack):
    """A review spread quarantines over five fake instances (and one of them under a second
    address) past any one instance's cap: all together keep at most twice it."""
    ranks = []
    for _ in range(3):
        boot = stack.enter_context(BootstrapServer())
        rank = FakeRank(boot.address, FP, None)
        stack.callback(rank.close)
        ranks.append(boot.address)
    r, _ = receiver(stack, transfer_timeout_s=3.0, cancel_grace_s=0.2, fence_s=60.0, max_quarantined_blocks=4)
    for key, boot in zip("ab", ranks):
        r.start(key, boot, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
        assert list(wait_fetch(r, key, 20).quarantined) == [0]
    r.start("c", ranks[2], DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(r, "c", 5)
    assert f.error.reason.startswith("8 blocks of this decode rank are quarantined (at most 8 for all prefill "
                                     "instances together)"), f.error
