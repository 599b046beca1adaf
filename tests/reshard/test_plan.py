"""Transfer plan on fake integer addresses: applying every path's descriptors
to byte arenas must build exactly the decode DCP layout that a per-token
reference builds, each (layer, page) exactly once, with 1.0x the KV bytes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.reshard.plan import Descriptors, plan_path, plan_request
from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.reshard.layout import cdiv, cp_layer_owner, cp_layer_range

ARENA = 1 << 32  # arena k owns fake addresses [k * ARENA, (k + 1) * ARENA)


class World:
    """Producer and consumer ranks' paged KV in byte arenas with fake addresses.

    Region j of a layer is a block pool ``[pool, stride_j]``; a page's bytes are
    the first ``page_size * token_bytes_j`` of its block, token-major.
    """

    def __init__(self, rng, num_layers, cp_size, dcp_size, page_size, token_bytes, pad, num_pages,
                 layer_group=None, sharded=None):
        """layer_group [L], sharded [G]: the consumer's KV cache groups (default: one
        DCP-sharded group); each group gets its own block table."""
        self.L, self.cp, self.dcp, self.ps = num_layers, cp_size, dcp_size, page_size
        self.layer_group = np.zeros(num_layers, dtype=np.int64) if layer_group is None else np.array(layer_group)
        self.sharded = np.array([True] if sharded is None else sharded, dtype=bool)
        self.tb = np.array(token_bytes)                      # [R] bytes per token per region
        self.page_bytes = self.tb * page_size                # [R]
        self.stride = self.page_bytes + np.array(pad)        # [R]
        self.P = num_pages
        self.src_pool = num_pages + 3
        self.dst_pool = num_pages + 2
        self.src_ids = rng.permutation(self.src_pool)[:num_pages]
        self.tables = [rng.permutation(self.dst_pool)[:cdiv(num_pages, dcp_size) if sh else num_pages]
                       for sh in self.sharded]
        self.dst_ids = self.tables[0] if len(self.tables) == 1 else tuple(self.tables)
        self.arenas, self.src, self.dst = [], [], []
        for r in range(cp_size):  # a prefill rank holds only its own layers
            layers = np.array(list(cp_layer_range(num_layers, cp_size, r)), dtype=np.int64)
            regions = self._regions(layers, self.src_pool, rng, fill=True)
            self.src.append(regions)
        for d in range(dcp_size):
            self.dst.append(self._regions(np.arange(num_layers), self.dst_pool, rng, fill=False))

    def _regions(self, layers, pool, rng, fill):
        k = len(self.arenas)
        size = int(len(layers) * pool * self.stride.sum())
        buf = rng.integers(0, 256, size, dtype=np.uint8) if fill else np.full(size, 0xAB, np.uint8)
        self.arenas.append(buf)
        reg_off = np.concatenate(([0], np.cumsum(pool * self.stride)[:-1]))      # [R]
        layer_off = np.arange(len(layers))[:, None] * pool * self.stride.sum()  # [Lh, 1]
        base = k * ARENA + layer_off + reg_off[None, :]
        if fill:
            return KVRegions(layers, base, self.stride, self.page_bytes)
        return KVRegions(layers, base, self.stride, self.page_bytes, self.layer_group[layers], self.sharded)

    def addr(self, regions, layer, region, block, token):
        row = int(np.flatnonzero(regions.layer_ids == layer)[0])
        return int(regions.base[row, region] + block * self.stride[region] + token * self.tb[region])

    def read(self, addr, n):
        return self.arenas[addr // ARENA][addr % ARENA: addr % ARENA + n]

    def apply(self, desc: Descriptors, coverage):
        for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist()):
            self.arenas[d // ARENA][d % ARENA: d % ARENA + n] = self.read(s, n)
            coverage[d // ARENA][d % ARENA: d % ARENA + n] += 1

    def reference(self, first_page):
        """Consumer arenas built token by token, without the plan."""
        out = [a.copy() for a in self.arenas]
        for layer in range(self.L):
            src = self.src[cp_layer_owner(layer, self.L, self.cp)]
            g = self.layer_group[layer]
            for i in range(first_page, self.P):
                # sharded: page i on rank i % dcp in block [i // dcp]; replicated: on every rank in [i]
                dests = ([(self.dst[i % self.dcp], self.tables[g][i // self.dcp])] if self.sharded[g]
                         else [(dst, self.tables[g][i]) for dst in self.dst])
                for dst, block in dests:
                    for j in range(len(self.tb)):
                        for t in range(self.ps):
                            s = self.addr(src, layer, j, self.src_ids[i], t)
                            d = self.addr(dst, layer, j, block, t)
                            out[d // ARENA][d % ARENA: d % ARENA + self.tb[j]] = self.read(s, self.tb[j])
        return out


worlds = st.builds(
    dict,
    seed=st.integers(0, 2**32 - 1),
    num_layers=st.integers(1, 7),
    cp_size=st.integers(1, 5),          # includes cp > layers
    dcp_size=st.integers(1, 4),
    page_size=st.integers(1, 4),
    regions=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=3),
    num_pages=st.integers(0, 13),       # includes fewer pages than DCP ranks
    first_page=st.integers(0, 14),
)


def _rebuild(w: dict, layer_group=None, sharded=None):
    """Apply every path's plan of world ``w``; the consumer arenas must equal the
    per-token reference. Returns (world, first page, plans, per-byte coverage)."""
    world = World(np.random.default_rng(w["seed"]), w["num_layers"], w["cp_size"], w["dcp_size"],
                  w["page_size"], [tb for tb, _ in w["regions"]], [pad for _, pad in w["regions"]],
                  w["num_pages"], layer_group, sharded)
    first = min(w["first_page"], w["num_pages"])
    want = world.reference(first)
    plans = plan_request(world.L, world.cp, world.src, world.src_ids, world.dst, world.dst_ids, first)
    coverage = [np.zeros_like(a, dtype=np.int32) for a in world.arenas]
    for desc in plans.values():
        world.apply(desc, coverage)
    for got, exp in zip(world.arenas, want):
        assert np.array_equal(got, exp)
    return world, first, plans, coverage


@settings(max_examples=150, deadline=None)
@given(worlds)
def test_all_paths_rebuild_the_dcp_layout_exactly(w):
    world, first, plans, coverage = _rebuild(w)
    # every byte of every sent (layer, page) lands exactly once; nothing else is touched
    sent_pages = world.P - first
    kv_bytes = world.L * sent_pages * int(world.page_bytes.sum())
    assert max((int(c.max()) for c in coverage if c.size), default=0) <= 1
    assert sum(int(c.sum()) for c in coverage) == kv_bytes
    total = sum(p.nbytes for p in plans.values())
    assert total == kv_bytes                      # 1.0x the KV
    naive = world.dcp * kv_bytes                  # whole sequence to every DCP rank
    assert naive == world.dcp * total
    for (r, d), desc in plans.items():           # each path: layers(r) x pages(d)
        pages_d = len(range(first + (d - first) % world.dcp, world.P, world.dcp))
        layers_r = len(cp_layer_range(world.L, world.cp, r))
        assert desc.nbytes == layers_r * pages_d * int(world.page_bytes.sum())


@settings(max_examples=100, deadline=None)
@given(worlds, st.data())
def test_replicated_groups_get_every_page_on_every_rank(w, data):
    """A decode with several KV cache groups (a replicated draft beside the sharded
    target): sharded layers land as above, replicated layers whole on every rank."""
    num_groups = data.draw(st.integers(1, 3))
    layer_group = data.draw(st.lists(st.integers(0, num_groups - 1), min_size=w["num_layers"],
                                     max_size=w["num_layers"]))
    sharded = data.draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    world, first, plans, coverage = _rebuild(w, layer_group, sharded)
    assert max((int(c.max()) for c in coverage if c.size), default=0) <= 1
    replicated = int((~world.sharded[world.layer_group]).sum())
    sent = (world.P - first) * int(world.page_bytes.sum())
    # The target's KV once (1.0x); each replicated layer once per decode rank.
    assert sum(p.nbytes for p in plans.values()) == (world.L - replicated) * sent + replicated * sent * world.dcp


def test_contiguous_blocks_merge_into_one_run_per_layer():
    # 1 DCP rank, identity block ids on both sides: each layer is one run.
    src = KVRegions.uniform([0, 1], [0, 10_000], 100)
    dst = KVRegions.uniform([0, 1], [50_000, 60_000], 100)
    desc = plan_path(src, np.arange(8), range(2), dst, np.arange(8), 1, 0)
    assert desc.src.tolist() == [0, 10_000]
    assert desc.dst.tolist() == [50_000, 60_000]
    assert desc.length.tolist() == [800, 800]


def test_dcp_filter_exact_descriptors():
    # 2 DCP ranks, 5 pages, rank 1 gets pages 1 and 3 into local blocks ids[0], ids[1].
    src = KVRegions.uniform([0], [1000], 10)
    dst = KVRegions.uniform([0], [5000], 10)
    desc = plan_path(src, [4, 3, 2, 1, 0], [0], dst, [7, 2, 9], 2, 1)
    assert desc.src.tolist() == [1000 + 3 * 10, 1000 + 1 * 10]
    assert desc.dst.tolist() == [5000 + 7 * 10, 5000 + 2 * 10]
    assert desc.length.tolist() == [10, 10]
    # skipping a cached prefix of 2 pages leaves only page 3
    assert plan_path(src, [4, 3, 2, 1, 0], [0], dst, [7, 2, 9], 2, 1, first_page=2).src.tolist() == [1010]


def test_batches_split_and_keep_order():
    d = Descriptors(np.arange(5), np.arange(5) + 100, np.ones(5, dtype=np.int64))
    parts = list(d.batches(2))
    assert [len(p) for p in parts] == [2, 2, 1]
    assert np.concatenate([p.src for p in parts]).tolist() == list(range(5))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dst=KVRegions.uniform([0], [0], 20, 16)), r"bytes per page differ: producer \[10\], consumer \[16\]"),
    (dict(dst=KVRegions([0], [[0, 100]], [10, 10], [5, 5])), "region count differs: producer 1, consumer 2"),
    (dict(layers=[0, 3]), r"producer holds no KV for layers \[3\]"),
    (dict(dst_block_ids=[0]), r"dst_block_ids has 1 blocks, need cdiv\(num_pages=4, dcp_size=2\) = 2"),
    (dict(dcp_rank=2), r"dcp_rank must be in \[0, dcp_size=2\), got 2"),
    (dict(src_block_ids=[0, -1, 2, 3]), "src_block_ids must be >= 0, got min -1"),
])
def test_mismatches_raise_naming_both_values(kwargs, match):
    args = dict(src=KVRegions.uniform([0, 1], [0, 1000], 10), src_block_ids=[0, 1, 2, 3], layers=[0, 1],
                dst=KVRegions.uniform([0, 1], [0, 1000], 10), dst_block_ids=[0, 1], dcp_size=2, dcp_rank=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_path(**args)


def test_regions_validate():
    with pytest.raises(ValueError, match="layer_ids must be distinct"):
        KVRegions.uniform([0, 0], [0, 10], 10)
    with pytest.raises(ValueError, match=r"need 0 < page_bytes <= page_stride"):
        KVRegions.uniform([0], [0], 10, 11)


# ---- which prefill ranks a decode rank fetches from (issue 37, item 0) ----

from vllm_dcp2d.reshard.layout import kv_head_range, send_shard  # noqa: E402
from vllm_dcp2d.reshard.head_split import ShardError, senders_for  # noqa: E402


def _table(layers: int, k: int, tp: int, cp: int = 0):
    shards = sorted(s for r in range(tp) if (s := send_shard(layers, k, tp, r, cp)) is not None)
    return (np.array([(s[2].start, s[2].stop) for s in shards]).reshape(-1),
            np.array([(s[3].start, s[3].stop) for s in shards]).reshape(-1))


@given(k=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 40))
def test_a_decode_with_the_prefills_head_split_fetches_each_layer_once(k, tp, layers):
    """Prefill and decode split the KV heads alike (the same TP, or heads replicated on
    both): each decode rank asks exactly the prefill ranks holding its heads."""
    if k % tp and tp % k:
        return
    lay, heads = _table(layers, k, tp)
    for t in range(tp):
        want = kv_head_range(k, tp, t)
        ask = senders_for(lay, heads, layers, k, want)
        assert all(range(int(heads[2 * r]), int(heads[2 * r + 1])) == want for r in ask)
        assert sum(int(lay[2 * r + 1] - lay[2 * r]) for r in ask) == layers


@given(k=st.sampled_from([1, 2, 4, 8]), tp_p=st.sampled_from([1, 2, 4, 8]), tp_d=st.sampled_from([1, 2, 4, 8]),
       layers=st.integers(1, 40))
def test_a_decode_whose_heads_the_prefill_splits_otherwise_fetches_each_layer_and_head_once(k, tp_p, tp_d, layers):
    """Prefill TP != decode TP (issue 39): each decode rank asks every prefill rank holding
    any of its heads, and together they send each (layer, head) of its heads once."""
    if (k % tp_p and tp_p % k) or (k % tp_d and tp_d % k):
        return
    lay, heads = _table(layers, k, tp_p)
    for t in range(tp_d):
        want = kv_head_range(k, tp_d, t)
        ask = senders_for(lay, heads, layers, k, want)
        got = sum((int(lay[2 * r + 1] - lay[2 * r]))
                  * len(range(max(int(heads[2 * r]), want.start), min(int(heads[2 * r + 1]), want.stop))) for r in ask)
        assert got == layers * len(want)
        assert all(heads[2 * r] < want.stop and heads[2 * r + 1] > want.start for r in ask)


def test_layers_covered_twice_or_not_at_all_are_refused():
    with pytest.raises(ShardError, match=r"send layer 2 of head 0 0 times instead of once \(2 \(layer, head\)"):
        senders_for(np.array([0, 2]), np.array([0, 1]), 4, 1, range(0, 1))
    with pytest.raises(ShardError, match=r"send layer 1 of head 0 2 times instead of once"):
        senders_for(np.array([0, 2, 1, 4]), np.array([0, 1, 0, 1]), 4, 1, range(0, 1))
