"""Layer-split KV pool addressing and the prefix helpers (single process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.layout import cp_layer_range
from vllm_dcp2d.prefill.broadcast import normalize_prefix_lens, prefix_slots
from vllm_dcp2d.prefill.pool import LayerSplitKVPool


@st.composite
def pools(draw):
    L = draw(st.integers(0, 20))
    N = draw(st.integers(1, 9))
    r = draw(st.integers(0, N - 1))
    return LayerSplitKVPool(L, N, r, num_pages=draw(st.integers(1, 5)), page_size=draw(st.integers(1, 4)),
                            num_kv_heads=2, head_dim=3)


@settings(max_examples=200, deadline=None)
@given(pools())
def test_slots_and_memory(pool):
    owned = cp_layer_range(pool.num_layers, pool.cp_size, pool.cp_rank)
    assert pool.num_slots == len(owned) + 1
    assert pool.kv.shape == (len(owned) + 1, 2, pool.num_pages, pool.page_size, 2, 3)
    slot_bytes = 2 * pool.num_tokens * 2 * 3 * 4
    assert pool.nbytes == slot_bytes * (len(owned) + 1)
    assert pool.saved_nbytes == slot_bytes * (pool.num_layers - len(owned) - 1)
    for layer in range(pool.num_layers):
        assert pool.owns(layer) == (layer in owned)
        assert pool.owner(layer) == pool.cp_rank or not pool.owns(layer)
        want = layer - owned.start if layer in owned else pool.transient_slot
        assert pool.slot_of(layer) == want


@settings(max_examples=100, deadline=None)
@given(pools(), st.data())
def test_token_slot_addresses_page_and_offset(pool, data):
    """Token slot ``s`` of a layer is page ``s // page_size``, offset ``s % page_size``
    of that layer's slot; a non-owned layer shares the transient slot."""
    if pool.num_layers == 0:
        return
    layer = data.draw(st.integers(0, pool.num_layers - 1))
    s = data.draw(st.integers(0, pool.num_tokens - 1))
    pool.layer_kv(layer)[1, s] = 7.0
    assert pool.page_view(layer)[1, s // pool.page_size, s % pool.page_size].eq(7.0).all()
    assert int(pool.kv.ne(0).sum()) == 2 * 3  # exactly one token's V was written
    if not pool.owns(layer):
        assert pool.transient_kv()[1, s].eq(7.0).all()


def test_seed_configuration_78_layers_8_ranks():
    counts = [LayerSplitKVPool(78, 8, r, 1, 1, 1, 1).num_slots for r in range(8)]
    assert counts == [11] * 6 + [10] * 2
    pool = LayerSplitKVPool(78, 8, 0, 1, 1, 1, 1)
    assert pool.full_nbytes == 78 * pool.nbytes // 11


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_pages"):
        LayerSplitKVPool(4, 2, 0, 0, 4, 1, 1)
    with pytest.raises(ValueError, match="cp_rank"):
        LayerSplitKVPool(4, 2, 2, 1, 4, 1, 1)
    pool = LayerSplitKVPool(4, 2, 0, 1, 4, 1, 1)
    with pytest.raises(ValueError, match=r"layer must be .*num_layers=4"):
        pool.layer_kv(4)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_prefix_slots_match_per_request_loop(data):
    rows_total, width = 6, 10
    table = torch.from_numpy(np.random.default_rng(data.draw(st.integers(0, 99))).permutation(60).reshape(6, 10))
    B = data.draw(st.integers(0, rows_total))
    rows = data.draw(st.permutations(range(rows_total)))[:B]
    lens = data.draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    want = [int(table[r, i]) for r, n in zip(rows, lens) for i in range(n)]
    got = prefix_slots(table, rows, lens)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert prefix_slots(table, rows, None).numel() == 0  # None: no prefix on any request


def test_prefix_lens_validation():
    assert normalize_prefix_lens(None, 3).tolist() == [0, 0, 0]
    assert normalize_prefix_lens(torch.tensor([1, 2]), 2).dtype == np.int64
    with pytest.raises(ValueError, match="expected batch_size=3"):
        normalize_prefix_lens([1, 2], 3)
    with pytest.raises(ValueError, match=">= 0"):
        normalize_prefix_lens([1, -2], 2)
    with pytest.raises(ValueError, match="integers"):
        normalize_prefix_lens([1.5], 1)
    with pytest.raises(ValueError, match=r"req_to_token.shape\[1\]=10"):
        prefix_slots(torch.zeros(2, 10, dtype=torch.int64), [0], [11])


def test_prefill_package_imports_no_vllm():
    """The prefill package is torch + torch.distributed only."""
    import subprocess
    import sys

    code = ("import sys, vllm_dcp2d.prefill.forward, vllm_dcp2d.prefill; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
