"""Head-sliced pages (issue 39) in every KV page layout vLLM 0.32 allocates, built on CPU
with vLLM's own allocator (``vllm_compat/kv_alloc.py``, as ``test_kv_alloc.py``): a
GQA model's KV heads split over a different TP on each side, in any pair of layouts.

Where heads lie inside each page's dense run (LBHNC/BLHNC: HND, one run per head range;
LBNHC/BLNHC: NHD, one run per token) the per-head fingerprints agree and every path
moves exactly the heads both ranks hold of its pages, byte-exact against the logical
pages sliced by head, nothing else touched. Where a side keeps each head in its own
region (LHBNC/BHLNC), or a kernel-block split cuts the tokens differently, the pair is
refused (by the fingerprint or the plan) naming it, never moved wrong.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from vllm_dcp2d.transfer.messages import Fingerprint, FingerprintMismatch  # noqa: E402
from vllm_dcp2d.reshard.layout import kv_head_range, send_shard  # noqa: E402
from vllm_dcp2d.reshard.plan import plan_request  # noqa: E402
from vllm_dcp2d.vllm_compat import connector_api as compat  # noqa: E402
from vllm_dcp2d.vllm_compat.kv_alloc import allocate_kv, logical_pages  # noqa: E402

LAYOUTS = list(KVCacheLayout)
HEADS_INSIDE = {KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLNHC}


def _fingerprint(kv: dict, blocks: int, heads: int, block: int) -> Fingerprint:
    t = next(iter(kv.values()))
    reg, _ = compat.kv_regions(kv, blocks)
    return Fingerprint("m", len(kv), block, str(t.dtype), int(reg.page_bytes.sum()),
                       f"{compat.page_layout(t, blocks)}:k|v", "c", num_kv_heads=heads)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.sampled_from(LAYOUTS), dst=st.sampled_from(LAYOUTS), k=st.sampled_from([2, 4]),
       tps=st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 2)]), head=st.sampled_from([8, 16]),
       split=st.sampled_from([1, 1, 2]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       layers=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_head_slices_move_exactly_in_vllms_layouts(src, dst, k, tps, head, split, dtype, layers, seed):
    tp_p, tp_d = tps
    if k % tp_p and tp_p % k or k % tp_d and tp_d % k:
        return
    block, src_blocks, dst_blocks = 16, 7, 5
    rng = np.random.default_rng(seed)
    shards = [s for t in range(tp_p) if (s := send_shard(layers, k, tp_p, t)) is not None]  # replicas split layers
    sh, src_layers, tp_p = [s[3] for s in shards], [s[2] for s in shards], len(shards)
    dh = [kv_head_range(k, tp_d, t) for t in range(tp_d)]
    kernel = block // split if split > 1 else None
    try:
        d_kv = [allocate_kv(dst, False, layers, dst_blocks, block, len(h), head, dtype, "cpu", kernel) for h in dh]
    except (ValueError, RuntimeError):  # vLLM cannot split pages that are not dense runs (as test_kv_alloc)
        kernel = None
        d_kv = [allocate_kv(dst, False, layers, dst_blocks, block, len(h), head, dtype, "cpu") for h in dh]
    s_kv = [allocate_kv(src, False, layers, src_blocks, block, len(h), head, dtype, "cpu") for h in sh]
    for kv in s_kv:
        for t in kv.values():
            t.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, t.view(torch.uint8).shape, np.uint8)))
    src_reg = [compat.kv_regions(kv, src_blocks)[0] for kv in s_kv]
    dst_reg = [compat.kv_regions(kv, dst_blocks)[0] for kv in d_kv]
    sfp, dfp = _fingerprint(s_kv[0], src_blocks, k, block), _fingerprint(d_kv[0], dst_blocks, k, block)
    servable = src in HEADS_INSIDE and dst in HEADS_INSIDE and kernel is None
    try:
        dfp.check(sfp, len(dh[0]), len(sh[0]))
        num_pages = int(rng.integers(1, min(src_blocks, dst_blocks) + 1))
        src_ids, dst_ids = rng.permutation(src_blocks)[:num_pages], rng.permutation(dst_blocks)[:num_pages]
        plans = plan_request(layers, tp_p, src_reg, src_ids, dst_reg, dst_ids, src_heads=sh, dst_heads=dh,
                             src_layers=src_layers, dcp_ranks=[0] * tp_d)
    except FingerprintMismatch as e:  # a token cut or head layout the two sides do not share
        assert not servable and "layout of one KV head" in str(e), (src.name, dst.name, kernel, str(e))
        return
    except ValueError as e:  # heads kept in regions of their own
        assert not servable and "LHBNC or BHLNC" in str(e), (src.name, dst.name, str(e))
        return
    expect = [{n: logical_pages(t, dst_blocks).clone() for n, t in kv.items()} for kv in d_kv]
    for (r, d), desc in plans.items():
        for s, t, n in zip(desc.src, desc.dst, desc.length):
            ctypes.memmove(int(t), int(s), int(n))
        common = range(max(sh[r].start, dh[d].start), min(sh[r].stop, dh[d].stop))
        for name in (n for n in d_kv[d] if compat.layer_index(n) in src_layers[r]):
            got = logical_pages(s_kv[r][name], src_blocks)[src_ids][:, common.start - sh[r].start:
                                                                     common.stop - sh[r].start]
            expect[d][name][dst_ids, common.start - dh[d].start: common.stop - dh[d].start] = got
    for d, kv in enumerate(d_kv):
        for name, t in kv.items():
            assert torch.equal(logical_pages(t, dst_blocks), expect[d][name]), (src.name, dst.name, d, name)
    assert sum(p.nbytes for p in plans.values()) == layers * num_pages * k * block * 2 * head * dtype.itemsize \
        * max(1, tp_d // k)
