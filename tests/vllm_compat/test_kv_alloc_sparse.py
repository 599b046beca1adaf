"""Sparse MLA (DSA: DeepSeek-V3.2, GLM-5.x) KV through the reshard, built on CPU with vLLM's
own GPU allocator (issue 40, item 6; ``tests/vllm_compat/test_kv_alloc.py`` does the other layouts).

Every such layer has two caches: the MLA latent of FLASHMLA_SPARSE (576 values; as
``fp8_ds_mla`` 656 B per token with its scales inside) and the lightning indexer's key
cache (DEEPSEEK_V32_INDEXER: 128 fp8 values and a float32 scale, 132 B). The specs come
from vLLM's own layer classes (``kv_alloc.sparse_mla_specs``); vLLM's planning puts both
in one KV cache group with two page sizes, and both are DCP-sharded on a decode (neither
layer sets ``dcp_sharded``, and vLLM's indexer merges each DCP rank's top-k over its own
keys: ``sparse_attn_indexer.py``). Here they are two planes of one KV layer, each with its
own page format, moved byte for byte from every CP rank to every DCP rank. A layer that
reuses an earlier layer's top-k (vLLM's ``indexer_types`` "shared", ``index_topk_freq``) has
no indexer cache: each layer moves its own planes (issue 51). The specs are adjusted by
the layers' backends as vLLM's model runner does (``customize_attention_spec``:
FLASHMLA_SPARSE aligns the block stride to 64-token pages off Blackwell, to whole rows on
Blackwell, which pads the block-outer layouts).
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from tests.support.kv_layouts import fingerprint, transfer_exact  # noqa: E402
from vllm_dcp2d.reshard import page_format  # noqa: E402
from vllm_dcp2d.transfer.messages import FingerprintMismatch  # noqa: E402
from vllm_dcp2d.vllm_compat import connector_api as compat  # noqa: E402
from vllm_dcp2d.vllm_compat.kv_alloc import allocate_kv, allocate_sparse_mla, sparse_mla_specs  # noqa: E402

# The layouts vLLM can lay two page sizes out in (it refuses LHBNC and BHLNC itself).
LAYOUTS = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC]
LATENT, INDEXER = "model.layers.{}.self_attn.attn", "model.layers.{}.self_attn.indexer.k_cache"


def _config(kv: dict, cache_dtype: str) -> NS:
    """The worker's view of the layers: each cache's backend, as vLLM's layer reports it."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    sparse = AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    indexer = DeepseekV32IndexerCache.get_attn_backend(None)
    ctx = {n: NS(get_attn_backend=lambda b=(indexer if "indexer" in n else sparse): b) for n in kv}
    return NS(compilation_config=NS(static_forward_context=ctx), cache_config=NS(cache_dtype=cache_dtype))


def _layout(kv: dict, blocks: int, cache_dtype: str) -> str:
    return compat.kv_layout(_config(kv, cache_dtype), kv, blocks)


def _blackwell(on: bool = True):
    """vLLM's platform answering as an SM100 GPU would (FLASHMLA_SPARSE's customize_spec asks)."""
    from vllm.platforms import current_platform

    return mock.patch.object(current_platform, "is_device_capability_family", lambda family: on and family == 100,
                             create=True)


def test_vllms_sparse_mla_caches_and_what_dcp_shards():
    """The specs vLLM's own layers give, the one group vLLM's planning makes of them, the
    backends' names and dtypes as page_format lists them, and the sharding a decode uses."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    specs = sparse_mla_specs(2)
    assert [(s.page_size_bytes, s.dtype, s.dcp_sharded) for s in specs.values()] == \
        [(64 * 656, torch.uint8, True), (64 * 132, torch.uint8, True)] * 2
    assert sparse_mla_specs(1, cache_dtype="auto")[LATENT.format(0)].page_size_bytes == 64 * 576 * 2  # bf16
    group = UniformTypeKVCacheSpecs.from_specs(specs)
    assert group is not None and group.dcp_sharded
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), group)])
    assert compat.group_sharded(config) == [True]
    sparse = AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    assert page_format.SPARSE_MLA_BACKENDS == (sparse.get_name(),) and "fp8_ds_mla" in sparse.supported_kv_cache_dtypes
    assert page_format.INDEXER_BACKENDS == (DeepseekV32IndexerCache.get_attn_backend(None).get_name(),)
    from vllm.v1.attention.backend import MultipleOf

    # The backends' customize_spec, as the model runner applies it: Hopper (fp8) reads 64-token
    # pages, Blackwell and the bf16 kernels whole rows; the indexer's kernel blocks are 64 tokens.
    assert [s.block_stride_alignment for s in specs.values()][:2] == [MultipleOf(64), MultipleOf(64)]
    with _blackwell():
        assert sparse_mla_specs(1)[LATENT.format(0)].block_stride_alignment == 656
    assert sparse_mla_specs(1, cache_dtype="auto")[LATENT.format(0)].block_stride_alignment == 1152
    ids = compat.kv_layer_ids(NS(speculative_config=None), list(specs))
    assert ids == {LATENT.format(0): 0, INDEXER.format(0): 0, LATENT.format(1): 1, INDEXER.format(1): 1}
    for layout in (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC):
        with pytest.raises(ValueError, match=f"{layout.name} cannot express this model's mixed page sizes"):
            allocate_sparse_mla(layout, 2, 3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.sampled_from(LAYOUTS), dst=st.sampled_from(LAYOUTS), cache_dtype=st.sampled_from(["fp8_ds_mla", "auto"]),
       layers=st.integers(1, 3), src_blocks=st.integers(3, 6), dst_blocks=st.integers(2, 4), cp=st.integers(1, 2),
       dcp=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_sparse_mla_pages_move_byte_for_byte(src, dst, cache_dtype, layers, src_blocks, dst_blocks, cp, dcp, seed):
    """CP prefill ranks -> DCP decode ranks, any two layouts vLLM allocates: both caches of
    every layer land in the decode's DCP layout exactly, nothing else touched; both sides
    name both page formats in their fingerprint, and they agree."""
    s_kv = [allocate_sparse_mla(src, layers, src_blocks, cache_dtype=cache_dtype) for _ in range(cp)]
    d_kv = [allocate_sparse_mla(dst, layers, dst_blocks, cache_dtype=cache_dtype) for _ in range(dcp)]
    reg = compat.kv_regions(d_kv[0], dst_blocks)[0]
    latent = 656 if cache_dtype == "fp8_ds_mla" else 1152
    assert reg.page_bytes.tolist() == [64 * latent, 64 * 132] and reg.layer_ids.tolist() == list(range(layers))
    transfer_exact(s_kv, src_blocks, d_kv, dst_blocks, layers, np.random.default_rng(seed))
    content = "fp8_ds_mla:kv_c|scales|k_pe" if cache_dtype == "fp8_ds_mla" else "kv_c|k_pe"
    want = f"N64,C{latent}:{content} + N64,C132:idx_k:fp8|scale:f32"
    assert _layout(s_kv[0], src_blocks, cache_dtype) == _layout(d_kv[0], dst_blocks, cache_dtype) == want


def test_a_side_without_the_indexer_or_with_another_encoding_is_refused():
    """A dense MLA instance (FLASHMLA, one cache per layer) and an fp8_ds_mla one differ in
    their fingerprint's layout, as do fp8_ds_mla and bf16 sparse instances, and a model with
    an indexer in every layer and one whose layer 1 reuses layer 0's top-k."""
    sparse = allocate_sparse_mla(KVCacheLayout.LBHNC, 2, 4)
    plain = allocate_sparse_mla(KVCacheLayout.LBHNC, 2, 4, cache_dtype="auto")
    dense = allocate_kv(KVCacheLayout.LBHNC, True, 2, 4, 64, 1, 576, torch.bfloat16)
    ours = fingerprint(sparse, 4, _layout(sparse, 4, "fp8_ds_mla").split(":", 1)[1], 64, "fp8_ds_mla")
    assert ours.layout == _layout(sparse, 4, "fp8_ds_mla")
    shared = allocate_sparse_mla(KVCacheLayout.LBHNC, 2, 4, indexer_layers=[0])  # layer 1 reuses layer 0's top-k
    assert _layout(shared, 4, "fp8_ds_mla").startswith(_layout(sparse, 4, "fp8_ds_mla") + " @ layers sha256:")
    for other, dtype, layout in ((plain, "auto", _layout(plain, 4, "auto")), (dense, "auto", "N64,C1152:kv_c|k_pe"),
                                 (shared, "fp8_ds_mla", _layout(shared, 4, "fp8_ds_mla"))):
        peer = fingerprint(other, 4, layout.split(":", 1)[1], 64, dtype)
        with pytest.raises(FingerprintMismatch, match="layout: ours 'N64,C656:fp8_ds_mla"):
            ours.check(peer)


# vLLM's own settings for which layers run an indexer (compute_skip_topk_layers, models/utils.py of
# 0.34; the same rule inline in 0.32's and 0.33's DSA attention): index_topk_freq with the default
# index_skip_topk_offset 2, layer i runs one iff max(i - 1, 0) % freq == 0.
def _freq(layers: int, freq: int) -> list[int]:
    return [i for i in range(layers) if max(i - 1, 0) % freq == 0]


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.sampled_from(LAYOUTS), dst=st.sampled_from(LAYOUTS), cache_dtype=st.sampled_from(["fp8_ds_mla", "auto"]),
       layers=st.integers(2, 5), data=st.data(), blackwell=st.booleans(), src_blocks=st.integers(3, 6),
       dst_blocks=st.integers(2, 4), cp=st.integers(1, 2), dcp=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_layers_without_an_indexer_move_their_own_planes(src, dst, cache_dtype, layers, data, blackwell, src_blocks,
                                                         dst_blocks, cp, dcp, seed):
    """A model whose layers differ in their caches (an indexer in some only: vLLM's
    index_topk_freq, or any subset), allocated by vLLM's planning and allocator with the
    backends' block-stride alignment (Hopper and Blackwell), through every pair of layouts:
    each layer's planes land byte for byte in the decode's DCP layout, nothing else touched
    (no page of a layer without an indexer, none of another layer's); both sides' layouts
    name both formats and which layers hold them, and agree."""
    indexer = data.draw(st.one_of(st.builds(_freq, st.just(layers), st.integers(2, 4)),
                                  st.lists(st.integers(0, layers - 1), unique=True)))
    with _blackwell(blackwell):
        s_kv = [allocate_sparse_mla(src, layers, src_blocks, cache_dtype=cache_dtype, indexer_layers=indexer)
                for _ in range(cp)]
        d_kv = [allocate_sparse_mla(dst, layers, dst_blocks, cache_dtype=cache_dtype, indexer_layers=indexer)
                for _ in range(dcp)]
    assert sorted(n for n in d_kv[0] if "indexer" in n) == sorted(INDEXER.format(i) for i in indexer)
    reg = compat.kv_regions(d_kv[0], dst_blocks)[0]
    held = {int(lid): bool(m[1]) for lid, m in zip(reg.layer_ids, reg.region_mask)} if indexer else {}
    assert all(held[i] == (i in indexer) for i in range(layers)) if indexer else reg.num_regions == 1
    transfer_exact(s_kv, src_blocks, d_kv, dst_blocks, layers, np.random.default_rng(seed))
    a, b = _layout(s_kv[0], src_blocks, cache_dtype), _layout(d_kv[0], dst_blocks, cache_dtype)
    assert a == b and (("@ layers sha256:" in a) == (0 < len(indexer) < layers))
