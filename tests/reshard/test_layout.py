"""Sharding math (design §4.1, §5.1, §6.2)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.dcp_pages import dcp_local_slot, dcp_page_owner
from vllm_dcp2d.reshard.layout import cp_layer_owner, cp_layer_range, dcp_pages_for_rank, local_layer_count


def test_seed_78_layers_on_8_ranks():
    ranges = [cp_layer_range(78, 8, r) for r in range(8)]
    assert [(r.start, r.stop) for r in ranges] == [
        (0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60), (60, 69), (69, 78)]
    assert [local_layer_count(78, 8, r) for r in range(8)] == [11] * 6 + [10] * 2


@given(st.integers(0, 200), st.integers(1, 40))
def test_layer_ranges_partition_layers(num_layers, cp_size):
    ranges = [cp_layer_range(num_layers, cp_size, r) for r in range(cp_size)]
    assert [x for r in ranges for x in r] == list(range(num_layers))  # contiguous, ordered, disjoint
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # remainder goes to the first ranks
    for layer in range(num_layers):
        assert layer in ranges[cp_layer_owner(layer, num_layers, cp_size)]


def test_fewer_layers_than_ranks():
    assert [len(cp_layer_range(3, 5, r)) for r in range(5)] == [1, 1, 1, 0, 0]
    assert cp_layer_range(3, 5, 4) == range(3, 3)


@given(st.integers(0, 300), st.integers(1, 9), st.integers(0, 300))
def test_ranks_pages_are_the_definitions(num_pages, dcp_size, first_page):
    """The page filter the plan runs (design §6.2) against the interleave's definition
    (``tests/support/dcp_pages.py``): rank ``d`` gets exactly the pages ``p`` of
    ``[first_page, num_pages)`` with ``p % N == d``, into local slots ``p // N`` that
    invert (``p == slot * N + d``); the ranks together get each page once."""
    pages = np.arange(first_page, max(first_page, num_pages), dtype=np.int64)
    got = [dcp_pages_for_rank(num_pages, dcp_size, d, first_page) for d in range(dcp_size)]
    for d, mine in enumerate(got):
        assert mine.tolist() == pages[dcp_page_owner(pages, dcp_size) == d].tolist()
        assert (dcp_local_slot(mine, dcp_size) * dcp_size + d == mine).all()
    assert sorted(p for mine in got for p in mine.tolist()) == pages.tolist()


@given(st.integers(0, 100), st.integers(1, 6), st.integers(0, 100), st.data())
def test_pages_for_rank(num_pages, dcp_size, first_page, data):
    d = data.draw(st.integers(0, dcp_size - 1))
    want = [i for i in range(first_page, num_pages) if i % dcp_size == d]
    assert dcp_pages_for_rank(num_pages, dcp_size, d, first_page).tolist() == want


@pytest.mark.parametrize("call, match", [
    (lambda: cp_layer_range(10, 0, 0), "cp_size must be >= 1, got 0"),
    (lambda: cp_layer_range(10, 4, 4), r"cp_rank must be in \[0, cp_size=4\), got 4"),
    (lambda: cp_layer_range(-1, 4, 0), "num_layers must be an int >= 0, got -1"),
    (lambda: cp_layer_owner(10, 10, 2), r"layer must be in \[0, num_layers=10\), got 10"),
    (lambda: dcp_pages_for_rank(4, 2, -1), r"dcp_rank must be in \[0, dcp_size=2\), got -1"),
    (lambda: dcp_pages_for_rank(-2, 2, 0), "num_pages and first_page must be >= 0, got -2, 0"),
    (lambda: dcp_pages_for_rank(4, 2, 0, first_page=-1), "num_pages and first_page must be >= 0, got 4, -1"),
    (lambda: dcp_pages_for_rank(4, 0, 0), "dcp_size must be >= 1, got 0"),
    (lambda: cp_layer_range(10, 2.0, 0), "cp_size must be an int, got 2.0"),
])
def test_invalid_input_names_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- KV heads over TP (issue 37, item 0) ----

from vllm_dcp2d.reshard.layout import askers, head_replicas, kv_head_range, send_shard  # noqa: E402

_SHAPES = st.sampled_from([(k, t) for k in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8, 16) if k % t == 0 or t % k == 0])


@given(shape=_SHAPES)
def test_tp_ranks_hold_every_head_and_replicas_hold_the_same(shape):
    """vLLM's split: every head on head_replicas ranks, consecutive ranks sharing one."""
    k, tp = shape
    held = [kv_head_range(k, tp, r) for r in range(tp)]
    assert sorted(h for r in held for h in r) == sorted(list(range(k)) * head_replicas(k, tp))
    assert all(len(h) == max(1, k // tp) for h in held)


@given(shape=_SHAPES, layers=st.integers(1, 80), cp=st.integers(0, 16))
def test_the_senders_cover_every_layer_of_every_head_once(shape, layers, cp):
    """``send_shard``: the ranks that send partition layers x heads, whatever the shape;
    a cp_size above the replicas of a head is refused naming both."""
    k, tp = shape
    if cp > head_replicas(k, tp):
        with pytest.raises(ValueError, match=f"cp_size={cp}: .* expected 1..{head_replicas(k, tp)}"):
            send_shard(layers, k, tp, 0, cp)
        return
    cover = np.zeros((layers, k), dtype=int)
    shards = [s for r in range(tp) if (s := send_shard(layers, k, tp, r, cp)) is not None]
    assert sorted(s[0] for s in shards) == list(range(len(shards))) and {s[1] for s in shards} == {len(shards)}
    for _, _, ls, hs in shards:
        cover[ls.start:ls.stop, hs.start:hs.stop] += 1
    assert (cover == 1).all()


@given(shape=_SHAPES)
def test_askers_count_the_consumer_ranks_holding_a_head(shape):
    k, tp = shape
    for h in range(k):
        assert askers(k, tp, range(h, h + 1)) == [t for t in range(tp) if h in kv_head_range(k, tp, t)]
