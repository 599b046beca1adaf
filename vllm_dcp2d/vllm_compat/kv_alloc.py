"""Paged KV exactly as vLLM's model runner allocates it, on any device (tests, GPU check).

``get_kv_cache_config_from_groups`` + ``allocate_kv_cache`` are the functions the GPU
model runner calls (0.32: ``vllm.v1.core.kv_cache_utils``; 0.33 moved the first to
``vllm.v1.core.kv_cache_planning``); only the resolved ``KVCacheLayout`` and the memory
size are handed in directly instead of coming from the engine core's profiling.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

__all__ = ["allocate_kv", "allocate_sparse_mla", "sparse_mla_specs", "logical_pages", "kv_cache_layouts",
           "instance_kv_capacity"]


def kv_cache_layouts():
    """vLLM's ``KVCacheLayout`` enum (the six physical orders of a paged KV view)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout


def allocate_kv(layout, mla: bool, layers: int, blocks: int, block: int, heads: int, head: int,
                dtype: torch.dtype, device="cpu", kernel_block: int | None = None) -> dict[str, torch.Tensor]:
    """Layer name -> KV view ``[blocks (* kernel blocks), H, N, C]`` in ``layout``
    (a ``KVCacheLayout``): MLA ``head`` is the latent width (one head), else
    ``heads`` KV heads of ``head`` dims, K and V; names ``model.layers.{i}.self_attn.attn``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec

    spec = (MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head, dtype=dtype, cache_dtype_str="auto")
            if mla else FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return _allocate(layout, [KVCacheGroupSpec(names, spec)], spec.page_size_bytes * layers, blocks, device,
                     kernel_block)


def _vllm_config(layout, block: int = 16, cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16):
    """What vLLM's KV planning reads of a ``VllmConfig``, for ``layout``."""
    cache = NS(kv_cache_layout=getattr(layout, "name", None), num_gpu_blocks_override=None,
               prefix_cache_retention_interval=None, get_resolved_kv_cache_layout=lambda: layout, block_size=block,
               cache_dtype=cache_dtype)
    return NS(cache_config=cache, attention_config=NS(hisparse_config=None), model_config=NS(dtype=dtype),
              scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
              parallel_config=NS(decode_context_parallel_size=1))


def _allocate(layout, groups, bytes_per_block: int, blocks: int, device, kernel_block: int | None):
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # 0.33
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # 0.32
    from vllm.v1.worker.utils import allocate_kv_cache

    def plan(memory: int):
        return get_kv_cache_config_from_groups(_vllm_config(layout), groups, memory)

    # A block may take more than its pages where a backend aligns the block stride
    # (FLASHMLA_SPARSE's customize_spec; block-outer layouts pad): the least memory vLLM
    # makes ``blocks`` blocks of, found by bisection (planning only, nothing allocated).
    lo, hi = bytes_per_block * blocks, bytes_per_block * blocks * 4
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if plan(mid).num_blocks >= blocks else (mid + 1, hi)
    cfg = plan(lo)
    if cfg.num_blocks != blocks:
        raise AssertionError(f"vLLM made {cfg.num_blocks} blocks of the memory for {blocks}")
    return allocate_kv_cache(cfg, torch.device(device), layout, [kernel_block] if kernel_block else None)


def sparse_mla_specs(layers: int, block: int = 64, cache_dtype: str = "fp8_ds_mla",
                     indexer_layers=None) -> dict:
    """Layer name -> the ``KVCacheSpec`` vLLM's model runner gives a sparse-MLA model's layers
    (DeepSeek-V3.2, GLM-5.x): each layer's own spec (``MLAAttention.get_kv_cache_spec`` for
    the latent cache, 576 values, as ``fp8_ds_mla`` 656 B per token;
    ``DeepseekV32IndexerCache.get_kv_cache_spec`` for the indexer's key cache, 128 fp8 + one
    float32 scale, 132 B), called on the attributes those layers set in ``__init__`` (no
    model is built), then adjusted by the layer's backend as the runner does
    (``customize_attention_spec``: FLASHMLA_SPARSE's ``customize_spec`` sets the block
    stride alignment its kernels read the cache with; DEEPSEEK_V32_INDEXER's 64-token kernel
    blocks). indexer_layers: the layers with an indexer (default all; vLLM builds none on a
    layer that reuses an earlier one's top-k: ``indexer_types`` "shared", ``index_topk_freq``),
    which 0.34 also marks on the latent (``is_index_group_leader``)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.attention.backend import MLAAttentionImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import customize_attention_spec

    vc = _vllm_config(None, block, cache_dtype)
    with_indexer = set(range(layers)) if indexer_layers is None else {int(i) for i in indexer_layers}
    sparse = AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    # 0.34 asks the impl for the fp8_ds_mla row (FLASHMLA_SPARSE keeps MLAAttentionImpl's) and
    # reads the top-k buffer's width (DeepSeek-V3.2's index_topk); 0.32 reads neither.
    row = getattr(MLAAttentionImpl, "get_fp8_ds_mla_row_bytes", None)
    indexer = NS(cache_config=vc.cache_config, head_dim=128 + 128 // 128 * 4, dtype=torch.uint8)
    specs = {}
    for i in range(layers):
        latent = NS(kv_cache_dtype=cache_dtype, head_size=576, sliding_window=None,
                    indexer=object() if i in with_indexer else None, non_causal_multi_token_decode=False,
                    topk_buffer_width=2048, impl=NS(get_fp8_ds_mla_row_bytes=lambda: row(None)))
        specs[f"model.layers.{i}.self_attn.attn"] = customize_attention_spec(
            sparse, MLAAttention.get_kv_cache_spec(latent, vc))
        if i in with_indexer:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = customize_attention_spec(
                DeepseekV32IndexerCache.get_attn_backend(None), DeepseekV32IndexerCache.get_kv_cache_spec(indexer, vc))
    return specs


def allocate_sparse_mla(layout, layers: int, blocks: int, block: int = 64, cache_dtype: str = "fp8_ds_mla",
                        device="cpu", indexer_layers=None) -> dict[str, torch.Tensor]:
    """Layer name -> KV view of a sparse-MLA model's caches, as vLLM's planning groups them
    (``get_kv_cache_groups``: one group, two page sizes) and its model runner allocates them:
    latent ``[blocks, 1, block, 656]`` uint8 (fp8_ds_mla) or ``[..., 576]`` bf16, indexer
    ``[blocks, 1, block, 132]`` uint8 on the layers in ``indexer_layers`` (default all).
    Raises vLLM's own ``ValueError`` for a layout that cannot hold two page sizes (LHBNC,
    BHLNC)."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # 0.33
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # 0.32

    specs = sparse_mla_specs(layers, block, cache_dtype, indexer_layers)
    groups = getattr(get_kv_cache_groups, "_dcp2d_stock", get_kv_cache_groups)(_vllm_config(layout), specs)
    return _allocate(layout, groups, sum(s.page_size_bytes for s in specs.values()), blocks, device, None)


def logical_pages(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[blocks, H, tokens, C bytes]`` uint8 of KV view ``t`` (a copy where kernel
    blocks split the tokens): one page per block, comparable across layouts."""
    t = t.view(torch.uint8)
    if t.shape[0] == blocks:
        return t
    return t.unflatten(0, (blocks, -1)).transpose(1, 2).reshape(blocks, t.shape[1], -1, t.shape[3])


def instance_kv_capacity(model: str, layer_specs: dict, *, tp: int, dcp: int, kv_cache_bytes: int, block: int,
                         max_model_len: int, dtype: str = "float32", layout: str = "LBHNC") -> dict:
    """What vLLM's engine core plans for a ``vllm serve`` instance of ``model`` whose every TP
    worker reports ``layer_specs`` (layer name -> ``KVCacheSpec``) and has ``kv_cache_bytes``
    (``--kv-cache-memory-bytes``): vLLM's own ``VllmConfig`` (``EngineArgs``, as the CLI builds
    it), ``get_kv_cache_configs``, ``generate_scheduler_kv_cache_config`` and
    ``get_kv_cache_capacity`` (its "KV cache size: N tokens" line), no engine started.

    Returns ``num_blocks`` (per worker: each holds that many blocks of every group),
    ``block_tokens`` (the token span of a group-0 block in the scheduler,
    ``resolve_dcp_kv_block_size``), ``tokens`` and ``max_concurrency`` (of ``max_model_len``)
    as vLLM logs them, and ``groups`` ([(layer names, dcp_sharded)])."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs  # 0.33
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # 0.32
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_kv_cache_capacity,
                                             resolve_dcp_kv_block_size)

    vc = EngineArgs(model=model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=block,
                    dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, max_model_len=max_model_len,
                    enforce_eager=True).create_engine_config()
    vc.cache_config.kv_cache_layout = layout  # what the engine core resolves before planning (CPU: LBHNC)
    configs = get_kv_cache_configs(vc, [dict(layer_specs) for _ in range(tp)], [kv_cache_bytes] * tp)
    sched = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(vc, sched)
    group0 = sched.kv_cache_groups[0].kv_cache_spec
    return {"num_blocks": sched.num_blocks, "block_tokens": resolve_dcp_kv_block_size(group0, dcp),
            "tokens": tokens, "max_concurrency": concurrency,
            "groups": [(list(g.layer_names), bool(getattr(g.kv_cache_spec, "dcp_sharded", True)))
                       for g in sched.kv_cache_groups]}
