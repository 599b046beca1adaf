"""Draft side of spec decode under DCP: pool sizing, dcp_disabled(), memory figure."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.spec_decode import (
    dcp_disabled,
    dcp_enabled,
    draft_pool_tokens,
    effective_dcp,
    effective_dcp_rank,
    spec_kv_bytes,
)


def test_draft_pool_tokens_is_dcp_size_times_the_shard():
    assert draft_pool_tokens(1_170_000, 4) == 4_680_000
    assert draft_pool_tokens(0, 8) == 0
    assert draft_pool_tokens(100, 1) == 100
    for bad in ((-1, 2), (10, 0), (10, True), (1.5, 2), ("8", 2)):
        with pytest.raises(ValueError, match="must be an int"):
            draft_pool_tokens(*bad)


def test_disabled_nests_and_restores_on_exceptions():
    assert dcp_enabled() and effective_dcp(4) == 4 and effective_dcp_rank(3) == 3
    with dcp_disabled():
        assert not dcp_enabled() and effective_dcp(4) == 1 and effective_dcp_rank(3) == 0
        with dcp_disabled():
            assert not dcp_enabled()
        assert not dcp_enabled()  # the inner exit leaves the outer block disabled
        with pytest.raises(RuntimeError, match="boom"), dcp_disabled():
            raise RuntimeError("boom")
        assert not dcp_enabled()
    assert dcp_enabled() and effective_dcp(4) == 4


def test_decorator_form_as_in_the_seed():
    @dcp_disabled()
    def forward_draft(world_size):
        return effective_dcp(world_size)

    assert forward_draft(4) == 1 and forward_draft(2) == 1  # reusable: a fresh context per call
    assert effective_dcp(4) == 4

    @dcp_disabled()
    def failing():
        raise KeyError("x")

    with pytest.raises(KeyError):
        failing()
    assert dcp_enabled()


def test_disabled_is_per_thread():
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def draft_thread():
        with dcp_disabled():
            inside.set()
            seen["draft"] = effective_dcp(4)
            assert release.wait(10)
        seen["after"] = effective_dcp(4)

    t = threading.Thread(target=draft_thread, daemon=True)
    t.start()
    try:
        assert inside.wait(10)
        assert dcp_enabled() and effective_dcp(4) == 4  # the target thread still shards
    finally:
        release.set()
        t.join(10)
    assert not t.is_alive() and seen == {"draft": 1, "after": 4}


def test_disabled_is_per_asyncio_task():
    async def draft(ev):
        with dcp_disabled():
            ev.set()
            await asyncio.sleep(0.01)
            return effective_dcp(2)

    async def target(ev):
        await asyncio.wait_for(ev.wait(), 10)
        return effective_dcp(2)

    async def main():
        ev = asyncio.Event()
        return await asyncio.gather(draft(ev), target(ev))

    assert asyncio.run(main()) == [1, 2]


def test_effective_dcp_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world_size"):
        effective_dcp(0)
    with pytest.raises(ValueError, match="rank_in_group"):
        effective_dcp_rank(-1)


def test_memory_matches_the_seed_glm_figures():
    """Seed §8: 32K tokens of GLM-5.2 (78 layers, 576 B/token/layer) at DCP=4:
    ~1.47 GB in all, ~0.37 GB target shard per rank; the draft pool holds the
    full sequence: 1.47 GB if it had 78 layers, 18.9 MB for a 1-layer MTP head."""
    m = spec_kv_bytes(32768, 4, 576, 78, draft_layers=1, page_size=64)
    assert m.full_target == 78 * 576 * 32768 == 1_472_200_704
    assert m.target_shard == m.full_target // 4
    assert m.draft_pool == 32768 * 576
    assert spec_kv_bytes(32768, 4, 576, 78, draft_layers=78, page_size=64).draft_pool == m.full_target
    with pytest.raises(ValueError, match="page_size"):
        spec_kv_bytes(10, 2, 576, 78, page_size=0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 16), st.integers(1, 1024), st.integers(1, 128), st.integers(0, 4))
def test_draft_pool_always_holds_the_whole_sequence(seq, dcp, page, layers, draft_layers):
    m = spec_kv_bytes(seq, dcp, 2, layers, draft_layers, page)
    assert m.target_shard * dcp >= m.full_target >= seq * layers * 2
    assert m.draft_pool >= seq * draft_layers * 2  # every rank can hold the whole context
    assert m.target_shard * dcp - m.full_target < dcp * page * layers * 2  # 1/dcp of the pages, rounded up


def test_spec_package_imports_no_vllm():
    code = ("import sys, vllm_dcp2d.spec_decode, vllm_dcp2d.spec_decode.draft, vllm_dcp2d.spec_decode.verify; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
