"""The 3D plan (layer x head x page, issue 39) on fake integer addresses: a model's KV
heads sharded over TP on either side, differently; applying every path's descriptors
must build exactly the decode ranks' pages that a per-(layer, head, page, token)
reference builds, each byte written once, 1.0x the KV in all, every range inside both
sides' pages; with the same heads on both sides, exactly today's descriptors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.reshard.head_split import head_slices, page_slice
from vllm_dcp2d.reshard.layout import cdiv, kv_head_range, send_shard
from vllm_dcp2d.reshard.head_split import ShardError, senders_for
from vllm_dcp2d.reshard.plan import plan_path, plan_request
from vllm_dcp2d.reshard.regions import KVRegions

ARENA = 1 << 32  # arena k owns fake addresses [k * ARENA, (k + 1) * ARENA)


def _tp_sizes(k: int) -> list[int]:
    """TP sizes vLLM allows for ``k`` KV heads: divisors of k and multiples of it (<= 8)."""
    return [t for t in range(1, 9) if k % t == 0 or t % k == 0]


class World:
    """Prefill TP ranks (``send_shard``: layers and heads each sends) and decode TP ranks
    (heads ``kv_head_range``, pages of DCP rank ``t % dcp``) in byte arenas.

    A page of region j holds the rank's ``H`` heads of ``N`` tokens of ``cb[j]`` bytes:
    HND ``[H, N, cb]`` (nhd False) or NHD ``[N, H, cb]`` (nhd True), per side."""

    def __init__(self, rng, L, K, tp_p, cp, tp_d, dcp, N, cb, pad, P, nhd_p, nhd_d):
        self.L, self.K, self.N, self.cb, self.P, self.dcp = L, K, N, np.array(cb), P, dcp
        self.nhd = {"p": nhd_p, "d": nhd_d}
        self.arenas, self.src, self.dst = [], [], []
        self.src_layers, self.src_heads, self.dst_heads, self.dst_dcp = [], [], [], []
        self.src_pool, self.dst_pool = P + 2, cdiv(P, dcp) + 2
        self.src_ids = rng.permutation(self.src_pool)[:P]
        self.dst_ids = rng.permutation(self.dst_pool)[:cdiv(P, dcp)]
        self.pad = np.array(pad)
        for t in range(tp_p):
            shard = send_shard(L, K, tp_p, t, cp)
            if shard is None:
                continue
            _, _, layers, heads = shard
            self.src_layers.append(layers)
            self.src_heads.append(heads)
            self.src.append(self._regions(np.arange(L), heads, self.src_pool, rng, "p"))
        for t in range(tp_d):
            heads = kv_head_range(K, tp_d, t)
            self.dst_heads.append(heads)
            self.dst_dcp.append(t % dcp)
            self.dst.append(self._regions(np.arange(L), heads, self.dst_pool, rng, "d"))

    def page_bytes(self, heads):
        return len(heads) * self.N * self.cb

    def _regions(self, layers, heads, pool, rng, side):
        k = len(self.arenas)
        nbytes = self.page_bytes(heads)
        stride = nbytes + self.pad
        size = int(len(layers) * pool * stride.sum())
        buf = rng.integers(0, 256, size, dtype=np.uint8) if side == "p" else np.full(size, 0xAB, np.uint8)
        self.arenas.append(buf)
        reg_off = np.concatenate(([0], np.cumsum(pool * stride)[:-1]))
        base = k * ARENA + np.arange(len(layers))[:, None] * pool * stride.sum() + reg_off[None, :]
        runs = np.full(stride.size, self.N if self.nhd[side] and len(heads) > 1 else 1)
        return KVRegions(layers, base, stride, nbytes, head_count=np.full(stride.size, len(heads)), head_runs=runs)

    def addr(self, regions, heads, side, layer, j, block, head, token):
        """Where (head, token) of region j of a page lies: the layout, by hand."""
        h, H, cb = head - heads.start, len(heads), int(self.cb[j])
        inner = (token * H + h) * cb if self.nhd[side] else (h * self.N + token) * cb
        return int(regions.base[layer, j] + block * regions.page_stride[j] + inner)

    def read(self, addr, n):
        return self.arenas[addr // ARENA][addr % ARENA: addr % ARENA + n]

    def apply(self, desc, coverage):
        for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist()):
            self.arenas[d // ARENA][d % ARENA: d % ARENA + n] = self.read(s, n)
            coverage[d // ARENA][d % ARENA: d % ARENA + n] += 1

    def reference(self):
        """Decode arenas built per (layer, head, page, token), from the one prefill rank
        that sends that (layer, head)."""
        out = [a.copy() for a in self.arenas]
        for layer in range(self.L):
            for head in range(self.K):
                r = next(i for i, (ls, hs) in enumerate(zip(self.src_layers, self.src_heads))
                         if layer in ls and head in hs)
                for d, (dh, dd) in enumerate(zip(self.dst_heads, self.dst_dcp)):
                    if head not in dh:
                        continue
                    for i in range(dd, self.P, self.dcp):
                        for j in range(self.cb.size):
                            for t in range(self.N):
                                s = self.addr(self.src[r], self.src_heads[r], "p", layer, j, self.src_ids[i], head, t)
                                a = self.addr(self.dst[d], dh, "d", layer, j, self.dst_ids[i // self.dcp], head, t)
                                out[a // ARENA][a % ARENA: a % ARENA + self.cb[j]] = self.read(s, self.cb[j])
        return out


@st.composite
def worlds(draw):
    """Shapes vLLM can run: K heads, TP sizes that divide K or are divided by it, a cp_size
    within the prefill's head replicas, a DCP size within the decode's (vLLM: <= TP / K)."""
    K = draw(st.sampled_from([1, 2, 4]))
    tp_p, tp_d = draw(st.sampled_from(_tp_sizes(K))), draw(st.sampled_from(_tp_sizes(K)))
    L = draw(st.integers(1, 5))
    cp = draw(st.integers(1, max(1, tp_p // K)))
    rep = max(1, tp_d // K)  # decode ranks per head: vLLM's DCP divides them
    dcp = draw(st.sampled_from([x for x in range(1, rep + 1) if rep % x == 0]))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), L=L, K=K, tp_p=tp_p, cp=cp, tp_d=tp_d, dcp=dcp,
                N=draw(st.integers(1, 4)), cb=draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)),
                pad=draw(st.integers(0, 3)), P=draw(st.integers(0, 7)),
                nhd_p=draw(st.booleans()), nhd_d=draw(st.booleans()))


def _world(w):
    if max(1, w["K"] // w["tp_p"]) == max(1, w["K"] // w["tp_d"]):  # the same page on both sides, or refused
        w = {**w, "nhd_d": w["nhd_p"]}                                # (the fingerprint's layout)
    return World(np.random.default_rng(w["seed"]), w["L"], w["K"], w["tp_p"], w["cp"], w["tp_d"], w["dcp"],
                 w["N"], w["cb"], [w["pad"]] * len(w["cb"]), w["P"], w["nhd_p"], w["nhd_d"])


def _plans(world):
    return plan_request(world.L, len(world.src), world.src, world.src_ids, world.dst, world.dst_ids,
                        src_heads=world.src_heads, dst_heads=world.dst_heads, src_layers=world.src_layers,
                        dcp_ranks=world.dst_dcp)


@settings(max_examples=120, deadline=None)
@given(worlds())
def test_every_layer_head_page_lands_once_in_the_decode_layout(w):
    world = _world(w)
    want = world.reference()
    plans = _plans(world)
    coverage = [np.zeros_like(a, dtype=np.int32) for a in world.arenas]
    for desc in plans.values():
        world.apply(desc, coverage)
    for got, exp in zip(world.arenas, want):
        assert np.array_equal(got, exp)
    assert all(c.max(initial=0) <= 1 for c in coverage)  # no byte written twice
    # 1.0x: every decode rank gets its heads x its pages x all layers, nothing more
    need = sum(w["L"] * len(range(dd, w["P"], w["dcp"])) * int(world.page_bytes(dh).sum())
               for dh, dd in zip(world.dst_heads, world.dst_dcp))
    assert sum(d.nbytes for d in plans.values()) == need
    # and the wire carries the KV once per decode head replica: K heads x L x P pages per DCP group
    replicas = max(1, w["tp_d"] // w["K"]) // w["dcp"]  # decode ranks holding one head of one page
    assert need == replicas * w["L"] * w["P"] * w["K"] * w["N"] * sum(w["cb"])


@settings(max_examples=120, deadline=None)
@given(worlds())
def test_every_range_lies_inside_both_sides_pages(w):
    world = _world(w)
    for (r, d), desc in _plans(world).items():
        for side, regions, addr in (("src", world.src[r], desc.src), ("dst", world.dst[d], desc.dst)):
            pool = world.src_pool if side == "src" else world.dst_pool
            # first and last byte of each range in a page of one (layer, region) pool (a run
            # merged over consecutive blocks crosses only pages with no gap between them)
            rel = addr[None, None, :] - regions.base[:, :, None]  # [L, R, n]
            last = rel + desc.length[None, None, :] - 1
            stride, nbytes = regions.page_stride[None, :, None], regions.page_bytes[None, :, None]
            fits = ((rel >= 0) & (rel % stride < nbytes) & (last % stride < nbytes) & (last // stride < pool)
                    & ((last // stride == rel // stride) | (stride == nbytes)))
            assert fits.any(axis=(0, 1)).all(), (side, r, d)


@settings(max_examples=60, deadline=None)
@given(worlds())
def test_equal_heads_give_todays_descriptors(w):
    """Same heads on both sides: byte for byte the descriptors of the plan without heads."""
    world = _world(w)
    for r, heads in enumerate(world.src_heads):
        for d, dh in enumerate(world.dst_heads):
            if dh != heads:
                continue
            got = plan_path(world.src[r], world.src_ids, world.src_layers[r], world.dst[d], world.dst_ids,
                            w["dcp"], world.dst_dcp[d], src_heads=heads, dst_heads=dh)
            old = plan_path(world.src[r], world.src_ids, world.src_layers[r], world.dst[d], world.dst_ids,
                            w["dcp"], world.dst_dcp[d])
            assert all(np.array_equal(getattr(got, f), getattr(old, f)) for f in ("src", "dst", "length"))


def test_page_slices_of_the_cpu_and_gpu_layouts():
    """Heads 1-2 of a 4-head page of 16 tokens x 64 B: HND (CPU ``[H, N, C]``) one run of
    2 heads; NHD one run per token, 4 heads apart."""
    hnd = KVRegions([0], [[1 << 20]], [4096], [4096], head_count=[4], head_runs=[1])
    nhd = KVRegions([0], [[1 << 20]], [4096], [4096], head_count=[4], head_runs=[16])
    s = page_slice(hnd, 0, 1, 2)
    assert (s.offset, s.length, s.count) == (1024, 2048, 1)
    s = page_slice(nhd, 0, 1, 2)
    assert (s.offset, s.length, s.count, s.stride) == (64, 128, 16, 256)
    # prefill 4 heads NHD -> decode 2 heads (2-3) NHD: 16 runs of 2 heads
    dst = KVRegions([0], [[1 << 20]], [2048], [2048], head_count=[2], head_runs=[16])
    (src_off, dst_off, n), = head_slices(nhd, dst, range(0, 4), range(2, 4))
    assert n == 128 and src_off.tolist() == [128 + 256 * i for i in range(16)] and dst_off.tolist() == [
        128 * i for i in range(16)]


def test_a_path_without_a_common_head_is_refused_naming_both():
    a = KVRegions([0], [[1 << 20]], [64], [64])
    with pytest.raises(ValueError, match=r"producer holds KV heads \[0, 1\), the consumer \[1, 2\)"):
        plan_path(a, [0], [0], a, [0], 1, 0, src_heads=range(0, 1), dst_heads=range(1, 2))


def test_senders_cover_each_layer_and_head_once():
    # prefill TP2 (a head per rank, every layer) -> a decode rank holding both heads: both ranks
    assert senders_for(np.array([0, 4, 0, 4]), np.array([0, 1, 1, 2]), 4, 2, range(0, 2)).tolist() == [0, 1]
    # prefill TP1 -> a decode rank holding head 1: the one rank
    assert senders_for(np.array([0, 4]), np.array([0, 2]), 4, 2, range(1, 2)).tolist() == [0]
    # a head's layers split among its replicas (K=2, TP4, cp 2): 4 ranks, the decode's head 1 from ranks 2, 3
    layers, heads = np.array([0, 2, 2, 4, 0, 2, 2, 4]), np.array([0, 1, 0, 1, 1, 2, 1, 2])
    assert senders_for(layers, heads, 4, 2, range(1, 2)).tolist() == [2, 3]
    with pytest.raises(ShardError, match="send layer 2 of head 1 0 times instead of once"):
        senders_for(np.array([0, 4, 0, 2]), np.array([0, 1, 1, 2]), 4, 2, range(0, 2))
    with pytest.raises(ShardError, match="send layer 0 of head 0 2 times instead of once"):
        senders_for(np.array([0, 4, 0, 4]), np.array([0, 2, 0, 1]), 4, 2, range(0, 2))
