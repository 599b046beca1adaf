"""Layers that hold different planes (issue 51, item 2): a DSA model whose "shared" layers
reuse an earlier layer's top-k and have no indexer cache (vLLM's ``indexer_types``,
``index_topk_freq``). Each layer moves its own planes byte for byte and nothing of the
planes it does not have, whether the consumer's regions carry the mask (its own, the
checksum's plan) or came over the wire without one (``TransferRequest.regions``: the
producer's mask decides, and the fingerprint has checked both hold the same planes).

Pure numpy: every rank's KV is a byte buffer at its own fake address, the descriptors are
applied as copies, and the result is compared with a per-page reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.reshard.layout import cdiv, cp_layer_range
from vllm_dcp2d.reshard.plan import plan_request
from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.reshard.regions import Memory, blocks_within, region_ends

SPACE = 1 << 24  # each rank's fake address space


def _rank(index: int, layers: np.ndarray, planes: np.ndarray, mask: np.ndarray, pool: int):
    """A rank's buffer and regions: each (layer, plane) it has is a pool of ``pool`` pages of
    ``planes[p]`` bytes; a plane a layer lacks gets no memory, and its base points at another
    layer's pool of that plane (as ``page_format.kv_regions`` fills it): a plan that read or
    wrote it would touch that layer's pages."""
    sizes = np.where(mask, pool * planes[None, :], 0)
    starts = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(sizes.shape)
    addr = index * SPACE + starts
    for p in range(planes.size):
        holders = np.flatnonzero(mask[:, p])
        fill = addr[holders[0], p] if holders.size else index * SPACE
        addr[~mask[:, p], p] = fill
    buf = np.zeros(int(sizes.sum()) or 1, dtype=np.uint8)
    return buf, KVRegions(layers, addr, planes, planes, region_mask=None if mask.all() else mask)


def _page(buf, regions: KVRegions, index: int, layer: int, p: int, block: int) -> np.ndarray:
    k = int(np.flatnonzero(regions.layer_ids == layer)[0])
    start = int(regions.base[k, p]) - index * SPACE + block * int(regions.page_stride[p])
    return buf[start:start + int(regions.page_bytes[p])]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), num_layers=st.integers(1, 6), num_planes=st.integers(1, 3), cp=st.integers(1, 3),
       dcp=st.integers(1, 3), pages=st.integers(0, 9), wire=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_each_layer_moves_its_own_planes_byte_for_byte(data, num_layers, num_planes, cp, dcp, pages, wire, seed):
    cp = min(cp, num_layers)
    rng = np.random.default_rng(seed)
    planes = np.array(data.draw(st.lists(st.integers(1, 24), min_size=num_planes, max_size=num_planes)))
    mask = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=num_planes, max_size=num_planes),
                                       min_size=num_layers, max_size=num_layers)), dtype=bool).reshape(
        num_layers, num_planes)
    mask[:, 0] = True  # every DSA layer has its latent
    nsrc, ndst = pages + int(rng.integers(0, 3)), cdiv(pages, dcp) + int(rng.integers(0, 3))
    src_ids, dst_ids = rng.permutation(max(nsrc, 1))[:pages], rng.permutation(max(ndst, 1))[:cdiv(pages, dcp)]
    src = []
    for r in range(cp):
        layers = np.array(cp_layer_range(num_layers, cp, r))
        buf, reg = _rank(r + 1, layers, planes, mask[layers], max(nsrc, 1))
        buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
        src.append((buf, reg))
    dst = [_rank(cp + d + 1, np.arange(num_layers), planes, mask, max(ndst, 1)) for d in range(dcp)]
    sent = [KVRegions(reg.layer_ids, reg.base, reg.page_stride, reg.page_bytes) if wire else reg for _, reg in dst]
    for (buf, reg), n in zip(dst, [max(ndst, 1)] * dcp):
        region_ends(reg, n)  # every region a layer has lies in its pool; the others are not checked
        assert blocks_within(reg, Memory.of([(int(reg.base.min()), buf.size)])) >= n
    plans = plan_request(num_layers, cp, [reg for _, reg in src], src_ids, sent, dst_ids)
    want = [buf.copy() for buf, _ in dst]
    for (r, d), desc in plans.items():
        for s, t, n in zip(desc.src, desc.dst, desc.length):
            sb, tb = src[r][0], dst[d][0]
            tb[int(t) - (cp + d + 1) * SPACE:][:int(n)] = sb[int(s) - (r + 1) * SPACE:][:int(n)]
        for layer in cp_layer_range(num_layers, cp, r):
            for p in np.flatnonzero(mask[layer]):
                for i in range(d, pages, dcp):
                    page = _page(src[r][0], src[r][1], r + 1, layer, p, src_ids[i])
                    _page(want[d], dst[d][1], cp + d + 1, layer, p, dst_ids[i // dcp])[:] = page
        held = sum(int(mask[layer].dot(planes)) for layer in cp_layer_range(num_layers, cp, r))
        assert desc.nbytes == held * len(range(d, pages, dcp))
    for d in range(dcp):
        assert np.array_equal(dst[d][0], want[d]), d


def test_a_consumer_whose_layer_holds_other_planes_is_refused():
    """Both sides' masks differ on a layer (a model whose indexer pattern differs): the plan
    refuses naming the layer, before any descriptor."""
    planes = np.array([8, 4])
    mask = np.array([[True, True], [True, False], [True, True]])
    _, src = _rank(1, np.arange(3), planes, mask, 4)
    other = mask.copy()
    other[1, 1], other[2, 1] = True, False
    _, dst = _rank(2, np.arange(3), planes, other, 4)
    with pytest.raises(ValueError, match=r"layer 1: the producer has regions \[0\], the consumer \[0, 1\]"):
        plan_request(3, 1, [src], [0, 1], [dst], [2, 3])
    with pytest.raises(ValueError, match=r"region_mask has shape \(3, 1\), expected layers x regions = \(3, 2\)"):
        KVRegions(np.arange(3), src.base, planes, planes, region_mask=mask[:, :1])
