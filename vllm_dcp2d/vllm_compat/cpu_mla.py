"""vLLM CPU MLA backend with decode context parallel (DCP) support (vLLM 0.32.0, 0.33.0).

Registered over vLLM's ``CPU_MLA`` by :func:`vllm_dcp2d.vllm_compat.attention.install_backends`
(the patch registry's ``cpu_attention_backends``).
With ``dcp_world_size == 1`` it is the stock ``CPUMLAImpl``. With DCP > 1 vLLM's
shared MLA code (``MLAAttention.forward_impl``) does the DCP choreography: it
all-gathers the absorbed decode queries over the DCP group, calls
:meth:`DCPCPUMLAImpl.forward_mqa` (latent attention over this rank's pages,
returning the LSE), then combines the ranks' partials with
``MLADCPManager.combine``, which ``vllm_compat.attention`` points at the torch
merge (vLLM's is a Triton kernel, unusable on CPU).

Verification of speculative drafts (``k + 1`` query tokens per request) runs
as a decode here: :class:`DCPCPUMLAMetadataBuilder` declares variable-length
decode queries, and :meth:`DCPCPUMLAImpl.forward_mqa` attends each query token
over the cache up to its own position (vLLM's stock CPU kernel takes one token
per request, and vLLM 0.32 sends longer ones to its prefill attention, which on
CPU gives other tokens than decoding one at a time). A request's pages are read
once for all its query tokens (``token_kv_lens`` of
:func:`~vllm_dcp2d.attention.paged.paged_attention_lse`).

Limits (raised, not silently wrong): prefills without cached context (the CPU platform
turns chunked prefill and prefix caching off for MLA on non-AMX CPUs; on AMX
CPUs pass ``enable_chunked_prefill=False, enable_prefix_caching=False``): vLLM's
DCP context gather for MLA prefill calls ``ops.cp_gather_cache``, which the CPU
build of vLLM 0.32 lacks (``torch.ops._C_cache_ops`` has no ``cp_gather_cache``).
"""

from __future__ import annotations

import functools

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder, QueryLenSupport
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from vllm_dcp2d.attention.gather import plain_layout
from vllm_dcp2d.attention.paged import paged_attention_lse
from vllm_dcp2d.vllm_compat.attention import install_mla_dcp_combine, local_context_lens

__all__ = ["DCPCPUMLABackend", "DCPCPUMLAImpl", "DCPCPUMLAMetadataBuilder"]


class DCPCPUMLAMetadataBuilder(MLACommonMetadataBuilder):
    """vLLM's MLA metadata, with requests of up to ``1 + num_speculative_tokens``
    query tokens (of any mix of lengths) classed as decodes, at any DCP size."""

    query_len_support = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=None,
                 supports_dcp_with_varlen: bool = True):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls,
                         supports_dcp_with_varlen=supports_dcp_with_varlen)


class DCPCPUMLAImpl(CPUMLAImpl):
    can_return_lse_for_decode = True
    supports_dcp = True
    lse_base_on_e = True
    supports_mtp_with_cp_non_trivial_interleave_size = True  # forward_mqa splits by local_context_lens

    def __init__(self, *args, **kwargs) -> None:
        # AttentionImplBase.__new__ set the DCP size; CPUMLAImpl.__init__ forces 1.
        dcp_size, dcp_rank = self.dcp_world_size, self.dcp_rank
        super().__init__(*args, **kwargs)
        if dcp_size == 1:
            return
        self.dcp_world_size, self.dcp_rank = dcp_size, dcp_rank
        self.total_cp_world_size, self.total_cp_rank = dcp_size, dcp_rank
        self.need_to_return_lse_for_decode = True
        # Read at each forward: a KV connector may set the interleave after the model
        # is built (vllm_compat/startup.py, resolve_interleave).
        self._parallel_config = get_current_vllm_config().parallel_config
        self.cp_kv_cache_interleave_size = self._parallel_config.cp_kv_cache_interleave_size
        install_mla_dcp_combine()

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """Called by ``MLAAttention.forward_impl`` for the decode tokens of a step.

        q: ``[T, Hg, L + R]`` (or a ``(q_nope [T, Hg, L], q_pe [T, Hg, R])`` tuple),
        the absorbed queries of the ``T`` decode tokens of ``B`` requests (``T > B``
        when verifying drafts), for all ``Hg`` heads of the DCP group;
        kv_c_and_k_pe_cache: ``[num_blocks, block_size, L + R]`` (this rank's
        pages, the step's tokens already written). Returns ``(o [T, Hg, L] in
        q.dtype, lse [T, Hg] float32)`` over the local pages; with DCP == 1 and
        one token per request, the stock kernel's ``(o, None)``.
        """
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        dec = attn_metadata.decode
        t, b = q.shape[0], dec.seq_lens.shape[0]
        if self.dcp_world_size == 1 and t == b:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        # Token i of a request with q_len tokens sees the sequence up to
        # seq_len - (q_len - 1 - i): the step's tokens are already in the cache.
        qsl = attn_metadata.query_start_loc[: b + 1].long()
        qsl = qsl - qsl[0]  # decodes lead the batch; offsets into q
        q_lens = qsl[1:] - qsl[:-1]
        if int(q_lens.sum()) != t:
            raise RuntimeError(f"MLA decode got {t} query tokens, but the decode requests' query "
                               f"lengths sum to {int(q_lens.sum())}")
        req = torch.repeat_interleave(torch.arange(b, device=q.device), q_lens)
        pos = torch.arange(t, device=q.device) - qsl[:-1][req]
        total = (dec.dcp_tot_seq_lens if self.dcp_world_size > 1 else dec.seq_lens).long()
        visible = total[req] - (q_lens[req] - 1 - pos)
        req_lens = total
        if self.dcp_world_size > 1:
            inter = self._parallel_config.cp_kv_cache_interleave_size
            visible = local_context_lens(visible, self.dcp_world_size, self.dcp_rank, inter)
            req_lens = local_context_lens(total, self.dcp_world_size, self.dcp_rank, inter)
        nb, bs, dk = kv_c_and_k_pe_cache.shape
        pages = kv_c_and_k_pe_cache.view(nb, 1, bs * dk)
        layout = _plain_layout(bs, dk)  # the MLA writer stores rows as-is
        # One request per row of the block table, its pages read once for all k + 1 tokens.
        o, lse = paged_attention_lse(q, pages, pages, layout, layout[:, : self.kv_lora_rank], dec.block_table[:b],
                                     req_lens, qsl, self.scale, token_kv_lens=visible)
        return o.to(q.dtype), lse


@functools.lru_cache(maxsize=8)
def _plain_layout(block_size: int, row: int) -> torch.Tensor:
    return plain_layout(block_size, row)


class DCPCPUMLABackend(CPUMLABackend):
    """``CPU_MLA`` with DCP; keeps the name ``CPU_MLA``."""

    @staticmethod
    def get_impl_cls() -> type[DCPCPUMLAImpl]:
        return DCPCPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[DCPCPUMLAMetadataBuilder]:
        return DCPCPUMLAMetadataBuilder
