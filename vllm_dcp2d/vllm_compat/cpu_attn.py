"""vLLM CPU attention backend with decode context parallel (DCP) support (vLLM 0.32.0, 0.33.0).

Registered over vLLM's ``CPU_ATTN`` by :func:`vllm_dcp2d.vllm_compat.attention.install_backends`
(the patch registry's ``cpu_attention_backends``).
With ``dcp_world_size == 1`` every call goes to the stock ``CPUAttentionBackendImpl``
unchanged. With DCP > 1 (``decode_context_parallel_size``; DCP reuses TP ranks)
each rank holds 1/N of every sequence's KV pages and a forward pass is:

1. all-gather the queries over the DCP group (``[T, H, D] -> [T, H*N, D]``): the
   ranks of a DCP group have different query heads but the same KV heads;
2. attend over the local context pages -> ``(O, LSE)`` for all ``H*N`` heads;
3. attend the step's own tokens causally over themselves (every rank has their
   K/V) -> ``(O, LSE)`` for this rank's ``H`` heads;
4. all-gather the context partials and LSE-merge them with step 3, keeping this
   rank's heads (design §5.2).

The KV of the step's tokens is written only on the rank that owns each token
(the CP slot mapping gives the others slot -1, which the writer skips). Chunked
prefill, prefix-cache hits and mixed batches all reduce to "context" (tokens
before the step) plus "new" (the step's tokens), so one computation serves them all.

With an fp8 KV cache (``fp8``/``fp8_e4m3``, ``fp8_e5m2``; vLLM's CPU writer needs
AVX-512 or AMX) pages hold ``x / scale`` per layer and K/V. The layer's scales fold
into the softmax scale (K) and the context output (V), and step 3 attends the
step's K/V as the cache holds them (vLLM's writer truncates to fp8), as the stock
kernel does: it attends over the cache after writing the step's tokens into it.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.distributed import get_dcp_group
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_dcp2d.attention.dcp import dcp_merge
from vllm_dcp2d.attention.gather import gather_pages
from vllm_dcp2d.attention.paged import paged_attention_lse, varlen_attention_lse
from vllm_dcp2d.reshard.page_format import FP8_DTYPES, kv_dtype_name
from vllm_dcp2d.vllm_compat.attention import cpu_kv_layout, local_context_lens

__all__ = ["DCPCPUAttentionBackend", "DCPCPUAttentionImpl"]


class DCPCPUAttentionImpl(CPUAttentionBackendImpl):
    # Read by vLLM's DCP gate (v1/worker/cp_utils.py) and backend selection.
    can_return_lse_for_decode = True
    supports_dcp = True
    lse_base_on_e = True
    # Any number of query tokens per request (k + 1 when verifying drafts), at any
    # interleave: context and new tokens are split by the same local_context_lens.
    supports_mtp_with_cp_non_trivial_interleave_size = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.dcp_world_size == 1:
            return
        unsupported = {
            "attn_type != decoder": self.attn_type != AttentionType.DECODER,
            "ALiBi": self.alibi_slopes is not None,
            "sliding window": self.sliding_window != -1,
            "logits soft cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "KV sharing": self.kv_sharing_target_layer_name is not None,
        }
        bad = [name for name, hit in unsupported.items() if hit]
        if bad:
            raise NotImplementedError(f"vllm_dcp2d DCP attention on CPU does not support: {', '.join(bad)}")
        # None for an unquantized cache; raises ConfigError for a quantized one other than fp8.
        self._fp8 = FP8_DTYPES.get(kv_dtype_name(self.kv_cache_dtype, torch.uint8))
        # Read at each forward: a KV connector may set the interleave after the model is
        # built (vLLM's adjust_dcp_kv_cache_interleave_size, vllm_compat/startup.py).
        self._parallel_config = get_current_vllm_config().parallel_config

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """Called by vLLM's attention layer for every forward pass of this layer.

        query: ``[T, H, D]``; key, value: ``[T, Hkv, D]``; kv_cache:
        ``[num_blocks, Hkv, block_size, 2 * D]`` (this rank's pages); output:
        ``[T, H * D]`` or ``[T, H, D]``, written in place and returned.
        """
        if self.dcp_world_size == 1 or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported with DCP on CPU")
        t = attn_metadata.num_actual_tokens
        h, d = self.num_heads, self.head_size
        group = get_dcp_group()
        rank = group.rank_in_group
        q = query[:t]
        q_all = group.all_gather(q.contiguous(), dim=1)  # [T, H*N, D]

        qsl = attn_metadata.query_start_loc
        num_reqs = qsl.shape[0] - 1
        seq_lens = attn_metadata.seq_lens[:num_reqs]
        context = seq_lens - (qsl[1:] - qsl[:-1])
        local = local_context_lens(context, self.dcp_world_size, rank,
                                   self._parallel_config.cp_kv_cache_interleave_size)

        nb, hkv, bs, _ = kv_cache.shape
        pages = (kv_cache.view(self._fp8) if self._fp8 else kv_cache).view(nb, hkv, 2 * bs * d)
        k_layout, v_layout = cpu_kv_layout(layer.isa, query.dtype, bs, d, self.kv_cache_dtype)
        k_scale, v_scale = (layer._k_scale_float, layer._v_scale_float) if self._fp8 else (1.0, 1.0)
        o_ctx, lse_ctx = paged_attention_lse(
            q_all, pages[..., : bs * d], pages[..., bs * d:], k_layout, v_layout,
            attn_metadata.block_table[:num_reqs], local, qsl, self.scale * k_scale,
        )
        if v_scale != 1.0:
            o_ctx = o_ctx * v_scale
        k_new, v_new = key[:t], value[:t]
        if self._fp8:
            k_new, v_new = self._as_cached(layer, k_new, v_new, bs, k_layout, v_layout)
        new = varlen_attention_lse(q, k_new, v_new, qsl, self.scale)
        out, _ = dcp_merge(o_ctx, lse_ctx, group, heads=slice(rank * h, (rank + 1) * h), local=new)
        output[:t].copy_(out.reshape(output[:t].shape))
        return output

    def _as_cached(self, layer, key, value, bs, k_layout, v_layout):
        """The step's K/V ``[T, Hkv, D]`` as an fp8 cache holds them: written by vLLM's
        own writer into scratch pages, read back and scaled. Returns two float32
        ``[T, Hkv, D]``."""
        t, hkv, d = key.shape
        n = -(-t // bs)
        scratch = torch.empty(n, hkv, 2 * bs, d, dtype=torch.uint8)
        key_cache, value_cache = scratch.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(t), layer.isa,
                                       k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)
        flat, block_table = scratch.view(self._fp8).view(n, hkv, 2 * bs * d), torch.arange(n)[None]
        k = gather_pages(flat[..., : bs * d], k_layout, block_table, t)[0].float() * layer._k_scale_float
        v = gather_pages(flat[..., bs * d:], v_layout, block_table, t)[0].float() * layer._v_scale_float
        return k, v


class DCPCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with DCP; the name stays ``CPU_ATTN`` so anything keyed on the
    backend name (KV connectors' compatibility checks) sees no difference."""

    @staticmethod
    def get_impl_cls() -> type[DCPCPUAttentionImpl]:
        return DCPCPUAttentionImpl
