"""Send staging (``transfer/staging.py``): a path's pages gathered into a registered
slot in the decode's order and written as merged descriptors land byte for byte
where the plan's in-place descriptors put them; a slot a stalled write went through
is never reused (its late delivery carries its own bytes)."""

import contextlib
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.pair import StalledThenRetried
from vllm_dcp2d.transfer import send_ledger
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.messages import Fingerprint
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.transfer.staging import MIN_GAIN, MIN_UNIT, Slot, stage
from vllm_dcp2d.transfer.transport import MooncakeTransport
from vllm_dcp2d.reshard.layout import cdiv
from vllm_dcp2d.reshard.plan import Descriptors, plan_path
from vllm_dcp2d.reshard.regions import KVRegions, Memory
from tests.support.transfer import PD, wait_fetch


class Pools:
    """Real host memory: a prefill rank's and a decode rank's paged KV, ``layers`` x
    regions x ``blocks`` pages of ``page_bytes[j]`` (stride ``page_bytes[j] + pad``)."""

    def __init__(self, rng, layers: int, page_bytes, pad: int, src_blocks: int, dst_blocks: int):
        self.page_bytes = np.array(page_bytes, dtype=np.int64)
        self.stride = self.page_bytes + pad
        self.src = rng.integers(1, 256, int(layers * src_blocks * self.stride.sum()), dtype=np.uint8)
        self.dst = np.zeros(int(layers * dst_blocks * self.stride.sum()), np.uint8)
        self.src_regions = self._regions(self.src, layers, src_blocks)
        self.dst_regions = self._regions(self.dst, layers, dst_blocks)

    def _regions(self, buf, layers, blocks):
        region_off = np.concatenate(([0], np.cumsum(blocks * self.stride)[:-1]))
        base = buf.ctypes.data + np.arange(layers)[:, None] * blocks * self.stride.sum() + region_off[None, :]
        return KVRegions(np.arange(layers), base, self.stride, self.page_bytes)


def memmove(desc: Descriptors, src_base: int = 0) -> None:
    """What a Mooncake write does, on local memory."""
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist()):
        ctypes.memmove(d, src_base + s, n)


def dst_table(rng, n: int, pool: int, gaps: bool, shuffled: bool) -> np.ndarray:
    """``n`` distinct blocks of ``[0, pool)``: ascending as vLLM hands out a fresh
    cache, with holes (``gaps``), or in any order."""
    ids = np.sort(rng.choice(pool, n, replace=False)) if gaps else np.arange(n)
    return rng.permutation(ids) if shuffled else ids


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 3), regions=st.integers(1, 2),
       page_units=st.integers(1, 4), unit=st.sampled_from([64, 256, 512]), pad=st.sampled_from([0, 256]),
       num_pages=st.integers(0, 40), dcp_size=st.integers(1, 4), data=st.data())
def test_staged_writes_land_what_the_plan_writes_in_place(seed, layers, regions, page_units, unit, pad, num_pages,
                                                         dcp_size, data):
    rng = np.random.default_rng(seed)
    page_bytes = [page_units * unit * (j + 1) for j in range(regions)]
    dcp_rank = data.draw(st.integers(0, dcp_size - 1))
    first_page = data.draw(st.integers(0, num_pages))
    local = cdiv(num_pages, dcp_size)
    src_ids = rng.permutation(num_pages + 2)[:num_pages]
    ids = dst_table(rng, local, local + 5, data.draw(st.booleans()), data.draw(st.booleans()))
    pools = Pools(rng, layers, page_bytes, pad, num_pages + 2, local + 5)
    desc = plan_path(pools.src_regions, src_ids, range(layers), pools.dst_regions, ids, dcp_size, dcp_rank,
                     first_page, num_pages)
    memmove(desc)
    want, pools.dst[:] = pools.dst.copy(), 0
    # the smallest slot holds the largest page (smaller ones put pages in place)
    slot_bytes = data.draw(st.integers(MIN_UNIT, 2 * int(desc.length.max(initial=MIN_UNIT)) + 4 * MIN_UNIT))
    # the consumer registered each layer's KV apart: a merged write must not span two
    per_layer = pools.dst.nbytes // layers
    dst_memory = Memory.of([(pools.dst.ctypes.data + i * per_layer, per_layer) for i in range(layers)])
    chunks, in_place = stage(desc, slot_bytes, dst_memory)
    slot = Slot(slot_bytes)
    memory = Memory.of([(pools.src.ctypes.data, pools.src.nbytes)])
    for c in chunks:
        assert c.pages.nbytes == c.write.nbytes <= slot_bytes
        assert dst_memory.holds(c.write.dst, c.write.length).all()
        assert np.array_equal(c.offset, np.cumsum(c.pages.length) - c.pages.length)
        slot.gather(c, memory)
        memmove(c.write, slot.addr)
    memmove(in_place)
    assert np.array_equal(pools.dst, want)
    staged = sum(len(c.pages) for c in chunks)
    assert staged + len(in_place) == len(desc) and sum(c.pages.nbytes for c in chunks) + in_place.nbytes == desc.nbytes
    if chunks:
        assert sum(len(c.write) for c in chunks) + len(in_place) <= len(desc) / MIN_GAIN
    assert len(in_place) == len(desc) or np.gcd.reduce(desc.length[desc.length <= slot_bytes]) >= MIN_UNIT


def test_a_decode_ranks_pages_in_fresh_blocks_go_out_as_one_descriptor_per_layer_and_plane():
    """The case it is for: DCP=2, the prefill's pages scattered, the decode's blocks
    consecutive; 2 layers x 2 planes of 30 pages each: 4 writes instead of 120."""
    rng = np.random.default_rng(1)
    pools = Pools(rng, 2, [512, 512], 0, 64, 40)
    desc = plan_path(pools.src_regions, np.arange(60) * 7 % 64, range(2), pools.dst_regions, np.arange(30) + 3,
                     2, 1, 0, 60)
    assert len(desc) == 2 * 2 * 30
    chunks, in_place = stage(desc, 1 << 20)
    assert len(in_place) == 0 and [len(c.write) for c in chunks] == [4]
    # a slot of 10 pages: chunks of 10 pages, merged where adjacent on the decode
    chunks, _ = stage(desc, 10 * 512)
    assert len(chunks) == 12 and all(len(c.pages) == 10 and len(c.write) == 1 for c in chunks)


def test_runs_adjacent_across_two_consumer_buffers_are_not_merged():
    """Layer 0's last decode block ends where layer 1's first begins: one run in
    memory, but two registered buffers on the consumer (Mooncake writes into one)."""
    rng = np.random.default_rng(4)
    pools = Pools(rng, 2, [512], 0, 16, 4)
    desc = plan_path(pools.src_regions, np.arange(8) * 2 % 16, range(2), pools.dst_regions, np.arange(4), 2, 0, 0, 8)
    (c,), _ = stage(desc, 1 << 16)
    assert len(c.write) == 1  # all 8 pages adjacent in memory
    half = pools.dst.nbytes // 2
    split = Memory.of([(pools.dst.ctypes.data, half), (pools.dst.ctypes.data + half, half)])
    (c,), _ = stage(desc, 1 << 16, split)
    assert len(c.write) == 2 and split.holds(c.write.dst, c.write.length).all()


def test_gather_refuses_a_source_outside_the_registered_memory():
    rng = np.random.default_rng(2)
    pools = Pools(rng, 1, [512], 0, 8, 8)
    desc = plan_path(pools.src_regions, np.arange(8), range(1), pools.dst_regions, np.arange(4), 2, 0, 0, 8)
    (c,), _ = stage(desc, 1 << 16)
    with pytest.raises(ValueError, match="outside the memory this rank registered"):
        Slot(1 << 16).gather(c, Memory.of([(pools.src.ctypes.data, 512 * 3)]))


# ---- through the real Sender and Receiver over Mooncake ----

L, PAGE, PAGE_BYTES, BLOCKS = 2, 16, 512, 16
FP = Fingerprint("m", L, PAGE, "uint8", PAGE_BYTES, "test", "cfg")
TOKENS = 8 * PAGE - 3


def regions(kv: np.ndarray) -> KVRegions:
    return KVRegions.uniform(np.arange(L), kv.ctypes.data + np.arange(L) * kv[0].nbytes, PAGE_BYTES)


class Pair:
    """One prefill rank with send staging and one decode DCP rank (of ``dcp_size``),
    over real Mooncake; ``net`` wraps the sender's transport (or is it)."""

    def __init__(self, stack, dcp_size: int, wrap=None, **sender_kw):
        self.src = np.random.default_rng(3).integers(1, 255, (L, BLOCKS, PAGE_BYTES), dtype=np.uint8)
        self.dst = np.zeros((L, BLOCKS, PAGE_BYTES), np.uint8)
        tp, td = MooncakeTransport(), MooncakeTransport()
        stack.callback(td.close)
        stack.callback(tp.close)
        tp.register(self.src.ctypes.data, self.src.nbytes)
        self.net = wrap(tp) if wrap else tp
        boot = stack.enter_context(BootstrapServer())
        self.sender = Sender(self.net, regions(self.src), FP, engine_id="P", cp_rank=0, cp_size=1,
                             bootstrap=boot.address, **sender_kw)
        stack.callback(self.sender.close)
        self.recv = Receiver(td, regions(self.dst), FP, engine_id="D", dcp_size=dcp_size, dcp_rank=dcp_size - 1,
                             buffers=[(self.dst.ctypes.data, self.dst.nbytes)], transfer_timeout_s=30.0, cancel_grace_s=0.5)
        stack.callback(self.recv.close)
        self.boot, self.dcp_size = boot.address, dcp_size

    def fetch(self, key: str, src_ids, dst_ids):
        self.sender.add_request(key, src_ids, TOKENS, prompt_digest=PD)
        self.recv.start(key, self.boot, dst_ids, num_tokens=TOKENS, prompt_digest=PD)
        return wait_fetch(self.recv, key, 30)

    def expected(self, src_ids, dst_ids) -> np.ndarray:
        mine = np.arange(self.dcp_size - 1, cdiv(TOKENS, PAGE), self.dcp_size)
        return self.src[:, np.asarray(src_ids)[mine]], np.asarray(dst_ids)[mine // self.dcp_size]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_sender_with_staging_writes_the_same_bytes_in_fewer_descriptors(stack):
    p = Pair(stack, 2, staging_bytes=1 << 16)
    src_ids, dst_ids = np.array([9, 2, 14, 0, 7, 11, 4, 5]), np.array([5, 6, 7, 8])
    f = p.fetch("x", src_ids, dst_ids)
    assert f.ok, f.error
    pages, blocks = p.expected(src_ids, dst_ids)
    assert np.array_equal(p.dst[:, blocks], pages)
    assert f.outcomes[0].descriptors == L  # one per layer instead of one per page and layer
    assert f.outcomes[0].nbytes == pages.nbytes


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_a_slot_a_stalled_write_went_through_is_not_reused(stack, monkeypatch):
    """Every write stalls once and is retried (``StalledThenRetried``); the given-up
    attempts' bytes land late, after the sender wrote a second request. Each must
    carry its own request's bytes: with the slot reused, request x's late delivery
    would write y's pages into x's blocks."""
    monkeypatch.setattr(send_ledger, "STALL_S", 1.0)
    p = Pair(stack, 1, wrap=StalledThenRetried, staging_bytes=2 << 16, num_workers=1)
    xs, xd = np.array([3, 1, 12, 6, 0, 9, 15, 10]), np.arange(8)
    ys, yd = np.array([2, 4, 5, 7, 8, 11, 13, 14]), np.arange(8, 16)
    for key, s, d in (("x", xs, xd), ("y", ys, yd)):
        f = p.fetch(key, s, d)
        assert not f.ok and f.quarantined, "a stalled attempt must leave the fetch unsettled"
    assert len({int(g[1].src[0]) for g in p.net.ghosts}) == 2, "both writes went through one slot"
    p.dst[:] = 0
    assert p.net.land() > 0
    for s, d in ((xs, xd), (ys, yd)):
        pages, blocks = p.expected(s, d)
        assert np.array_equal(p.dst[:, blocks], pages)


class Ledger:
    """A transport stand-in: which ranges are registered; writes succeed, stall once
    (the code ``MooncakeTransport.write`` reports in ``stalls``) or fail at once."""

    max_batch = 1024

    def __init__(self, outcome="ok"):
        self.regs, self.outcome, self.unregistered = {}, outcome, []

    def register(self, addr, nbytes):
        self.regs[addr] = nbytes

    def unregister(self, addr):
        self.unregistered.append(addr)
        if self.regs.pop(addr, None) is None:
            raise RuntimeError(f"{addr:#x} is not registered")

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        if self.outcome == "stall":
            stalls.append(-1)
        if self.outcome == "dead":
            raise RuntimeError("peer gone")
        return desc.nbytes


@pytest.mark.parametrize("outcome", ["ok", "dead", "stall"])
def test_a_slot_is_retired_only_after_a_stall_and_held_while_a_late_write_may_read_it(outcome, monkeypatch):
    from vllm_dcp2d.transfer import staging

    now = [100.0]
    monkeypatch.setattr(staging.time, "monotonic", lambda: now[0])
    rng = np.random.default_rng(5)
    pools = Pools(rng, 1, [512], 0, 16, 8)
    desc = plan_path(pools.src_regions, np.arange(16), range(1), pools.dst_regions, np.arange(8), 2, 0, 0, 16)
    net = Ledger(outcome)
    pool = staging.StagingPool(net, 1 << 16, 1)
    (first,) = net.regs
    memory = Memory.of([(pools.src.ctypes.data, pools.src.nbytes)])
    stalls = []
    try:
        assert staging.write(net, pool, memory, "peer", desc, stalls) == (desc.nbytes, 1, 1)
    except RuntimeError:
        assert outcome == "dead"
    slot = pool.take()
    if outcome != "stall":  # nothing can read it later: reused
        assert slot.addr == first and set(net.regs) == {first}
        return
    assert slot.addr != first and set(net.regs) == {first, slot.addr}  # a fresh one; the old one held
    pool.give_back(slot, clean=True)
    now[0] += staging.RETIRED_HOLD_S - 1
    staging.write(net, pool, memory, "peer", desc, stalls)  # retires the second slot
    assert net.unregistered == [] and len(net.regs) == 3
    now[0] += 2
    staging.write(net, pool, memory, "peer", desc, stalls)
    assert net.unregistered == [first] and len(net.regs) == 3  # held its time, then let go
    net.regs.clear()
    pool.close()  # unregistering what the transport no longer has: logged, not raised
