"""Paged KV exactly as vLLM's model runner allocates it, on any device (tests, GPU check).

``get_kv_cache_config_from_groups`` + ``allocate_kv_cache`` are the functions the GPU
model runner calls (0.32: ``vllm.v1.core.kv_cache_utils``; 0.33 moved the first to
``vllm.v1.core.kv_cache_planning``); only the resolved ``KVCacheLayout`` and the memory
size are handed in directly instead of coming from the engine core's profiling.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

__all__ = ["allocate_kv", "logical_pages", "kv_cache_layouts"]


def kv_cache_layouts():
    """vLLM's ``KVCacheLayout`` enum (the six physical orders of a paged KV view)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout


def allocate_kv(layout, mla: bool, layers: int, blocks: int, block: int, heads: int, head: int,
                dtype: torch.dtype, device="cpu", kernel_block: int | None = None) -> dict[str, torch.Tensor]:
    """Layer name -> KV view ``[blocks (* kernel blocks), H, N, C]`` in ``layout``
    (a ``KVCacheLayout``): MLA ``head`` is the latent width (one head), else
    ``heads`` KV heads of ``head`` dims, K and V; names ``model.layers.{i}.self_attn.attn``."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # 0.33
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # 0.32
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = (MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head, dtype=dtype, cache_dtype_str="auto")
            if mla else FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    cache = NS(kv_cache_layout=layout.name, num_gpu_blocks_override=None, prefix_cache_retention_interval=None,
               get_resolved_kv_cache_layout=lambda: layout)
    vc = NS(cache_config=cache, attention_config=NS(hisparse_config=None))
    cfg = get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(names, spec)], spec.page_size_bytes * layers * blocks)
    if cfg.num_blocks != blocks:
        raise AssertionError(f"vLLM made {cfg.num_blocks} blocks of the memory for {blocks}")
    return allocate_kv_cache(cfg, torch.device(device), layout, [kernel_block] if kernel_block else None)


def logical_pages(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[blocks, H, tokens, C bytes]`` uint8 of KV view ``t`` (a copy where kernel
    blocks split the tokens): one page per block, comparable across layouts."""
    t = t.view(torch.uint8)
    if t.shape[0] == blocks:
        return t
    return t.unflatten(0, (blocks, -1)).transpose(1, 2).reshape(blocks, t.shape[1], -1, t.shape[3])
