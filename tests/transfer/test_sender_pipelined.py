"""Layer-pipelined sends: a fetch that arrives while the prefill still runs gets
each layer as soon as ``layer_ready`` reports it, the rest at ``add_request``.

Real Mooncake transports (two engines in this process), a real bootstrap server,
``Sender`` and ``Receiver``; byte arrays stand in for the paged KV.
"""

import threading
import time

import numpy as np
import pytest

from tests.support.pair import deadline_now, wait_until
from tests.support.pipelined import (DST_BLOCKS, DST_IDS, FP, L, NUM_PAGES, NUM_TOKENS, PAGE_BYTES, SRC_BLOCKS,
                                     SRC_IDS, expected_layer, regions)

from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.reshard.plan import plan_path
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.transfer.transport import MooncakeTransport
from tests.support.transfer import PD, wait_fetch

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

@pytest.fixture
def pair():
    rng = np.random.default_rng(0)
    src = rng.integers(1, 255, (L, SRC_BLOCKS, PAGE_BYTES), dtype=np.uint8)
    dst = np.zeros((L, DST_BLOCKS, PAGE_BYTES), np.uint8)
    tp, td = MooncakeTransport(), MooncakeTransport()
    tp.register(src.ctypes.data, src.nbytes)
    with BootstrapServer() as boot:
        sender = Sender(tp, regions(src), FP, engine_id="P", cp_rank=0, cp_size=1, bootstrap=boot.address)
        recv = Receiver(td, regions(dst), FP, engine_id="D", dcp_size=2, dcp_rank=1,
                        buffers=[(dst.ctypes.data, dst.nbytes)], transfer_timeout_s=30.0, prefill_wait_s=20.0)
        try:
            yield src, dst, sender, recv, boot.address
        finally:
            recv.close()
            sender.close()
            tp.close()
            td.close()


def test_layers_written_as_they_are_computed(pair):
    src, dst, sender, recv, boot = pair
    recv.start("r", boot, DST_IDS, num_tokens=NUM_TOKENS, prompt_digest=PD)
    wait_until(lambda: sender.waiting("r") == 1)
    for layer in range(L):
        sender.layer_ready("r", layer, SRC_IDS, NUM_TOKENS, prompt_digest=PD)
        # this layer has landed before the request is complete; later layers have not
        wait_until(lambda: np.array_equal(dst[layer], expected_layer(src, layer)))
        assert not dst[layer + 1:].any()
        assert not recv.poll()  # no answer before add_request
    sender.add_request("r", SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    f = wait_fetch(recv, "r", 20)
    assert f.ok, f.error
    o = f.outcomes[0]
    full = plan_path(regions(src), SRC_IDS, range(L), regions(dst), DST_IDS, 2, 1, 0, NUM_PAGES)
    assert (o.early_layers, o.nbytes) == (L, full.nbytes)  # every layer once: 1.0x
    for layer in range(L):
        assert np.array_equal(dst[layer], expected_layer(src, layer))
    assert sender.pop_finished() == {"r": "done"}


def test_remaining_layers_at_add_request(pair):
    """A fetch held mid-forward got the later layers early and the earlier ones at the end."""
    src, dst, sender, recv, boot = pair
    sender.layer_ready("r", 0, SRC_IDS, NUM_TOKENS, prompt_digest=PD)  # before anyone asked: nothing to do
    recv.start("r", boot, DST_IDS, num_tokens=NUM_TOKENS, prompt_digest=PD)
    wait_until(lambda: sender.waiting("r") == 1)
    sender.layer_ready("r", 2, SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    sender.layer_ready("r", 3, SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    sender.layer_ready("r", L, SRC_IDS, NUM_TOKENS, prompt_digest=PD)  # not this rank's layer: ignored
    wait_until(lambda: np.array_equal(dst[3], expected_layer(src, 3)))
    sender.add_request("r", SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    f = wait_fetch(recv, "r", 20)
    assert f.ok and f.outcomes[0].early_layers == 2
    assert all(np.array_equal(dst[x], expected_layer(src, x)) for x in range(L))


def test_held_fetch_expires_after_early_layers(pair):
    """Past wait_s the held fetch fails "not ready" even with layers written; a late
    layer_ready writes nothing more, and the sender serves the next request."""
    src, dst, sender, recv, boot = pair
    recv.start("late", boot, DST_IDS, num_tokens=NUM_TOKENS, prefill_wait_s=0.5, prompt_digest=PD)
    wait_until(lambda: sender.waiting("late") == 1)
    sender.layer_ready("late", 0, SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    f = wait_fetch(recv, "late", 20)
    assert not f.ok and "not ready" in f.error.reason
    assert sender.waiting("late") == 0
    dst[:] = 0
    sender.layer_ready("late", 1, SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    time.sleep(0.2)
    assert not dst.any()
    sender.add_request("next", SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    recv.start("next", boot, DST_IDS, num_tokens=NUM_TOKENS, prompt_digest=PD)
    f = wait_fetch(recv, "next", 20)
    assert f.ok and f.outcomes[0].early_layers == 0
    assert all(np.array_equal(dst[x], expected_layer(src, x)) for x in range(L))


def test_deadline_cancels_held_fetch(pair):
    """A fetch past its deadline is cancelled on the prefill rank: it stops holding it,
    and a later layer_ready / add_request writes nothing into the freed blocks."""
    src, dst, sender, recv, boot = pair
    recv.start("c", boot, DST_IDS, num_tokens=NUM_TOKENS, prompt_digest=PD)  # the rank would hold it for wait_s = 20 s
    wait_until(lambda: sender.waiting("c") == 1)
    deadline_now(recv, "c")
    f = wait_fetch(recv, "c", 10)
    assert f.error.timed_out and f.seconds < 5
    assert sender.waiting("c") == 0
    sender.layer_ready("c", 0, SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    sender.add_request("c", SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    time.sleep(0.3)
    assert not dst.any()


class SlowWrites:
    """A transport whose writes start ``delay_s`` late (a stalled peer), and not before
    ``go`` is set."""

    def __init__(self, transport, delay_s: float):
        self.transport, self.delay_s = transport, delay_s
        self.started = False
        self.go = threading.Event()

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        self.started = True
        time.sleep(self.delay_s)
        assert self.go.wait(30), "the test never let the write go"
        return self.transport.write(peer, desc, stalls, not_after_ns)

    def __getattr__(self, name):
        return getattr(self.transport, name)


def test_fetch_fails_only_after_the_write_in_flight(pair):
    """The decode gives up at its deadline, but reports the fetch (and so lets vLLM free
    its blocks) only once the rank confirmed the cancel, i.e. after its write finished."""
    src, dst, sender, recv, boot = pair
    slow = sender.transport = SlowWrites(sender.transport, 1.5)
    sender.add_request("w", SRC_IDS, NUM_TOKENS, prompt_digest=PD)
    recv.start("w", boot, DST_IDS, num_tokens=NUM_TOKENS, prompt_digest=PD)
    wait_until(lambda: slow.started)
    deadline_now(recv, "w")
    # the write goes on only once the receiver acted on the deadline (a loaded machine could
    # starve its thread until the write's answer came, and the fetch would end complete)
    wait_until(lambda: all(f.failing is not None for f in recv.ledger.active() if f.transfer_key == "w"))
    slow.go.set()
    f = wait_fetch(recv, "w", 20)
    assert f.error.timed_out and f.seconds > 1.4, f.seconds
    # the write had landed before the fetch ended; nothing lands after it
    done = dst.copy()
    assert all(np.array_equal(done[x], expected_layer(src, x)) for x in range(L))
    dst[:] = 0
    time.sleep(0.5)
    assert not dst.any()
