"""The capacity planner (``reshard/capacity.py``) against vLLM's own planning of the same instance
(``kv_alloc.instance_kv_capacity``: vLLM 0.32's ``VllmConfig``, ``get_kv_cache_configs`` and
``get_kv_cache_capacity``, no engine started): the demo's decode, tiny ``llama-mqa`` fp32 at
TP=2, with the KV specs its workers report (4 ``FullAttentionSpec`` layers, one KV head of 32
dims replicated over TP, 32-token pages), at DCP 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_dcp2d.reshard.capacity import Draft, DecodeMemory, capacity  # noqa: E402
from vllm_dcp2d.local.tiny_models import build_tiny_model  # noqa: E402
from vllm_dcp2d.vllm_compat.kv_alloc import instance_kv_capacity  # noqa: E402

PAGE, LAYERS, MAX_LEN = 32, 4, 1024
SPEC = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=32, dtype=torch.float32)
PER_TOKEN_LAYER = SPEC.page_size_bytes // PAGE  # 256: K and V, 32 fp32 each


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("llama-mqa", tmp_path_factory.mktemp("capacity") / "model")


def specs(draft_layers: int = 0) -> dict:
    """Layer name -> spec as the decode's workers report them; a draft's layers last, unsharded
    (``dcp_sharded=False``: what ``vllm_compat/spec_decode.py`` gives them under DCP)."""
    out = {f"model.layers.{i}.self_attn.attn": SPEC for i in range(LAYERS)}
    for i in range(LAYERS, LAYERS + draft_layers):
        out[f"model.layers.{i}.self_attn.attn"] = dataclasses.replace(SPEC, dcp_sharded=False)
    return out


@pytest.mark.parametrize("kv_bytes", [64 << 20, 1_114_112, (64 << 20) + 12_345])  # demo's, e2e's, not whole pages
@pytest.mark.parametrize("dcp", [1, 2])
def test_planner_tokens_equal_vllms(model, dcp, kv_bytes):
    v = instance_kv_capacity(model, specs(), tp=2, dcp=dcp, kv_cache_bytes=kv_bytes, block=PAGE,
                             max_model_len=MAX_LEN)
    c = capacity(DecodeMemory(kv_cache_bytes=kv_bytes), token_bytes=LAYERS * PER_TOKEN_LAYER,
                 page_size=PAGE, dcp_size=dcp, request_tokens=MAX_LEN)
    assert v["num_blocks"] == c.pages_per_rank
    assert v["block_tokens"] == PAGE * dcp  # resolve_dcp_kv_block_size: a block spans dcp pages of the sequence
    assert v["tokens"] == c.tokens_per_group == c.pages_per_rank * PAGE * dcp
    assert int(v["max_concurrency"]) == c.requests


@pytest.mark.parametrize("dcp", [1, 2])
def test_draft_pool_x_dcp_is_vllms_shared_pool(model, dcp):
    """With one unsharded draft layer vLLM makes one group per layer drawing whole blocks of
    one layer from a shared pool; a request takes ``cdiv(T, dcp * page)`` blocks per target
    layer and ``cdiv(T, page)`` for the draft's: the planner's "dcp" draft pool. Requests of
    max_model_len that fit: equal; tokens: within one page per DCP rank (the planner counts
    whole pages of all layers, vLLM single-layer blocks)."""
    v = instance_kv_capacity(model, specs(draft_layers=1), tp=2, dcp=dcp, kv_cache_bytes=64 << 20, block=PAGE,
                             max_model_len=MAX_LEN)
    assert sorted(v["groups"], key=lambda g: g[0]) == [([n], n != f"model.layers.{LAYERS}.self_attn.attn")
                                                       for n in sorted(specs(1))]
    c = capacity(DecodeMemory(kv_cache_bytes=64 << 20), token_bytes=LAYERS * PER_TOKEN_LAYER,
                 page_size=PAGE, dcp_size=dcp, request_tokens=MAX_LEN, draft=Draft(1, PER_TOKEN_LAYER, "dcp"))
    assert int(v["max_concurrency"]) == c.requests
    assert 0 <= v["tokens"] - c.tokens_per_group < PAGE * dcp
    if dcp > 1:  # a reservation fixed at DCP=1's draft pool (the model that fits Table 1) overstates vLLM's
        one = capacity(DecodeMemory(kv_cache_bytes=64 << 20), token_bytes=LAYERS * PER_TOKEN_LAYER,
                       page_size=PAGE, dcp_size=1, request_tokens=MAX_LEN, draft=Draft(1, PER_TOKEN_LAYER, "dcp"))
        fixed = Draft(1, PER_TOKEN_LAYER, "fixed", pool_bytes=one.draft_pages_per_rank * SPEC.page_size_bytes)
        assert capacity(DecodeMemory(kv_cache_bytes=64 << 20), token_bytes=LAYERS * PER_TOKEN_LAYER,
                        page_size=PAGE, dcp_size=dcp, request_tokens=MAX_LEN, draft=fixed).tokens_per_group \
            > v["tokens"] + PAGE * dcp
