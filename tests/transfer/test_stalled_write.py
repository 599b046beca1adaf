"""A write that stalled and then succeeded on a retry (the freeze_prefill VIOLATION,
/tmp/faults_bench4: a 200 answer whose last tokens were garbage).

Under load a prefill rank's Mooncake write to a decode rank made no progress for
``STALL_S``; ``MooncakeTransport.write`` gave that attempt up (-1) and retried it on a
fresh engine, which succeeded. The given-up attempt is not gone: Mooncake frees the
batch while its work may still be queued ("-1 may come back while work is still
queued", notes/mooncake-transfer-engine.md), so its bytes can still land, seconds
later. The rank answered the fetch ``settled=True``, the decode used the blocks, the
request finished, vLLM gave the blocks to the next request, and the old attempt's
bytes overwrote that request's KV in the middle of its decode.

Forced deterministically: the transport under the real Sender reports the first
attempt as stalled and keeps its descriptors; ``land()`` later delivers them with a
real Mooncake write, at the moment the test chooses.
"""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.pair import (DST_IDS, SRC_IDS, TOKENS, Side, StalledThenRetried, deadline_now,
                                released_then_unchanged, wait_until)
from vllm_dcp2d.transfer import send_ledger
from tests.support.logs import logged
from tests.support.transfer import PD, wait_fetch

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def stalled_side(stack, monkeypatch, **receiver_kw) -> tuple[Side, StalledThenRetried]:
    monkeypatch.setattr(send_ledger, "STALL_S", 1.0)  # how long re-sent cancels are answered unsettled
    s = Side(stack, receiver_kw=receiver_kw)
    net = StalledThenRetried(s.gate.transport)
    s.gate.transport = net
    s.sender.add_request("x", SRC_IDS, TOKENS, prompt_digest=PD)
    return s, net


def hand_back_then_land(s: Side, net: StalledThenRetried, f) -> None:
    """What the decode does with ``f``'s blocks: hands them to the next request when
    the fetch ends unless it is quarantined, else when ``poll_lifted`` returns it.
    The given-up attempt's bytes land right after the fetch ended (before ``STALL_S``);
    the next request's KV in those blocks must survive them."""
    following = np.full((s.dst.shape[0], DST_IDS.size, s.dst.shape[2]), 0xAB, np.uint8)

    def reuse():
        s.dst[:, DST_IDS] = following

    if not f.quarantined:
        reuse()
    assert net.land() > 0
    if f.quarantined:
        assert s.recv.poll_lifted() == [], "released while the stalled attempt could still land"
        got = []
        wait_until(lambda: got.extend(s.recv.poll_lifted()) or got, 20)
        assert got == [f]
        reuse()
    released_then_unchanged(s)
    assert np.array_equal(s.dst[:, DST_IDS], following), (
        "a write attempt given up after a stall landed in blocks already handed to the next request")


def test_ok_answer_after_a_stalled_attempt_keeps_the_blocks_until_settled(stack, monkeypatch):
    """The retry wrote everything and the rank answers ok: the fetch still fails,
    its blocks quarantined until the rank settles (vLLM recomputes in fresh blocks)."""
    with logged("vllm_dcp2d.transfer.sender") as warned:  # from the sender's start: its first warning of each kind
        s, net = stalled_side(stack, monkeypatch)
        s.gate.open()
        s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
        f = wait_fetch(s.recv, "x", 20)
        assert np.array_equal(s.dst, s.expected())  # the retry wrote everything
        hand_back_then_land(s, net, f)
        assert not f.ok and "attempt stalled, then its retry succeeded" in f.quarantined[0], (f.error, f.quarantined)
        # the decode asked until the rank settled; its answers to those asks are no failure of the rank:
        # the rank logged no refusal, rejection or failure
        assert warned == [], warned


def test_cancel_answered_after_a_stalled_attempt_keeps_the_blocks(stack, monkeypatch):
    """The incident's decode rank 1: the fetch timed out while the rank's write was
    stalled, the retry then succeeded and the cancel was answered within the grace.
    That answer must not release the blocks (they were reported as plain load errors)."""
    s, net = stalled_side(stack, monkeypatch, cancel_grace_s=20.0)
    s.recv.start("x", s.boot.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    assert s.gate.entered.wait(20)
    deadline_now(s.recv, "x")
    # The cancel reached the rank (no write of the fetch may start any more) while one runs.
    wait_until(lambda: any(a.closed for a in list(s.sender.ledger._open.values())))
    s.gate.open()
    f = wait_fetch(s.recv, "x", 20)
    assert f.error.timed_out, f.error
    hand_back_then_land(s, net, f)
    assert list(f.quarantined) == [0] and "cancelled by the consumer" in f.quarantined[0], f.quarantined


def late_write(arg: str) -> dict:
    helper = os.path.join(os.path.dirname(__file__), os.pardir, "support", "late_write.py")
    out = subprocess.run([sys.executable, helper, arg], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def test_mooncake_write_given_up_after_a_stall_still_lands():
    """The premise, on real processes (``support/late_write.py``): a target frozen during a
    whole write and for 4 s after the initiator's engine gave it up (-1 after a 3 s
    stall) still gets the write once it resumes, including bytes the engine read
    from the source after the -1."""
    got = late_write("4")
    assert got["rc"] != 0 and got["stalled_s"] >= 2.5, got
    assert set(got["values"]) - {0}, f"nothing landed after the -1: {got}"
    assert 0xC3 in got["values"], f"no byte read from the source after the -1: {got}"
