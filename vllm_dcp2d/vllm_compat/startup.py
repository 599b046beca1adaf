"""Start-up settings a DCP2D instance needs, chosen for the user (vLLM 0.32.0, 0.33.0, 0.34.0).

Without these, serving an MLA model through the connector took three flags
that nothing pointed to (``--attention-backend CPU_MLA``, ``--block-size 16``,
``--cp-kv-cache-interleave-size 16``). Each patch below acts only when
``kv_connector`` is ``DCP2DConnector``, logs what it chose, and yields to an
explicit setting, unless that setting cannot work: then start-up fails with
an error that names the flag to change.

1. ``CpuPlatform.check_and_update_config``: on a CPU with AMX, vLLM picks
   ``AMX_MLA`` for MLA models. It returns no LSE, so DCP cannot merge its
   partials, its page format is its own (the other side of a transfer and the
   layer-split fill are checked with CPU_MLA's), and it fails on float32 weights. :func:`mla_backend`
   switches every DCP2D MLA instance to ``CPU_MLA`` (unless ``AMX_MLA`` was
   asked for where it can work) before the platform fixes the block size
   (16 for ``CPU_MLA``).
2. ``VllmConfig.adjust_dcp_kv_cache_interleave_size``: vLLM pins the DCP
   interleave to the block size for NIXL, once the block size is known (0.32:
   in each worker, from its ``KVCacheConfig``; 0.33: once in the engine core,
   from the global KV cache groups, and the workers get the value with their
   layout). The connector writes whole pages into the DCP layout, which needs
   the same, so DCP2DConnector gets it too (unless
   ``--cp-kv-cache-interleave-size`` was given; ``check_interleave`` then
   names the mismatch).

Both are entries of the patch registry (``patches.py``: ``mla_backend_choice``,
``dcp_interleave``).
"""

from __future__ import annotations

import logging

from vllm_dcp2d.vllm_compat.instance import is_dcp2d, layer_split_may_apply

log = logging.getLogger(__name__)

__all__ = ["draft_backend", "install_mla_backend", "install_interleave", "mla_backend",
           "resolve_interleave"]


def mla_backend(vllm_config, amx: bool) -> str | None:
    """The MLA backend a DCP2D instance must use on CPU, or None to leave vLLM's choice.

    amx: whether this CPU has AMX tiles (vLLM then prefers ``AMX_MLA``).
    On AMX every DCP2D MLA instance defaults to ``CPU_MLA``: a decode with
    DCP > 1 needs its LSE, a layer-split prefill fills transient slots from its
    cache write, and the two sides of a transfer must share one page format
    (``AMX_MLA`` packs its own, and it also refuses float32 weights, which
    vLLM does not check before it picks it). An explicit ``AMX_MLA`` is kept
    where it can work (a DCP=1 decode or a producer without layer-split, with
    the same backend on the other side); elsewhere it raises ``ValueError``.
    """
    mc = vllm_config.model_config
    if not (is_dcp2d(vllm_config) and mc is not None and mc.use_mla and amx):
        return None
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    why = ("decode_context_parallel_size > 1 needs the attention's LSE, which AMX_MLA does not return"
           if dcp > 1 else "layer-split storage is checked with CPU_MLA's pages only (AMX_MLA packs its own format)"
           if layer_split_may_apply(vllm_config) else None)
    chosen = vllm_config.attention_config.backend
    name = getattr(chosen, "name", chosen)
    if name == "AMX_MLA" and why is not None:
        extra = " or kv_connector_extra_config layer_split='off'" if dcp == 1 else ""
        raise ValueError(f"--attention-backend AMX_MLA cannot serve this DCP2D instance: {why}. "
                         f"Use --attention-backend CPU_MLA{extra}.")
    return "CPU_MLA" if name in (None, "CPU_MLA") else None


def draft_backend(vllm_config, backend: str | None) -> str | None:
    """The backend to give an MLA draft model when :func:`mla_backend` chose ``backend``
    for the target, or None to leave it. vLLM picks a draft's backend on its own
    (``llm_base_proposer``: never inherited), which on AMX is ``AMX_MLA`` again."""
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None)
    if backend is None or draft is None or not draft.use_mla or spec.attention_backend is not None:
        return None
    return backend


def resolve_interleave(vllm_config, block_size: int) -> None:
    """Set ``cp_kv_cache_interleave_size`` to ``block_size`` on a DCP2D decode with
    DCP > 1, unless the user set it (vLLM's ``_allow_auto_resolve_cp_interleave_size``)."""
    pc = vllm_config.parallel_config
    if not is_dcp2d(vllm_config) or pc.decode_context_parallel_size <= 1:
        return
    if not pc._allow_auto_resolve_cp_interleave_size or pc.cp_kv_cache_interleave_size == block_size:
        return
    log.info("DCP2DConnector writes whole pages into the DCP layout: cp_kv_cache_interleave_size %d -> "
             "block_size %d", pc.cp_kv_cache_interleave_size, block_size)
    pc.cp_kv_cache_interleave_size = block_size


# ---- 1. CpuPlatform.check_and_update_config (vLLM 0.32.0, 0.33.0) ----

def install_mla_backend(version: str) -> None:
    import torch
    from vllm.platforms import CpuArchEnum, current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = type(current_platform)
    stock = cls.check_and_update_config.__func__
    if getattr(stock, "_dcp2d", False):
        return

    def check_and_update_config(klass, vllm_config) -> None:
        amx = klass.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
        backend = mla_backend(vllm_config, amx)
        if backend is not None and vllm_config.attention_config.backend is None:
            log.info("DCP2DConnector: MLA on an AMX CPU uses the CPU_MLA attention backend, not AMX_MLA "
                     "(it returns the LSE DCP merges with, fills layer-split transient slots, shares one "
                     "page format with the other side of a transfer, and takes float32)")
            vllm_config.attention_config.backend = AttentionBackendEnum[backend]
        if draft_backend(vllm_config, backend) is not None:
            log.info("DCP2DConnector: the MLA draft model uses %s too", backend)
            vllm_config.speculative_config.attention_backend = AttentionBackendEnum[backend]
        stock(klass, vllm_config)

    check_and_update_config._dcp2d, check_and_update_config._dcp2d_stock = True, stock
    cls.check_and_update_config = classmethod(check_and_update_config)


# ---- 2. VllmConfig.adjust_dcp_kv_cache_interleave_size (vLLM 0.32.0: a KVCacheConfig, 0.33.0: groups) ----

def install_interleave(version: str) -> None:
    from vllm.config import VllmConfig

    stock = VllmConfig.adjust_dcp_kv_cache_interleave_size
    if getattr(stock, "_dcp2d", False):
        return

    def adjust_dcp_kv_cache_interleave_size(self, kv_cache_config_or_groups) -> None:
        stock(self, kv_cache_config_or_groups)
        groups = getattr(kv_cache_config_or_groups, "kv_cache_groups", kv_cache_config_or_groups)
        if groups:
            resolve_interleave(self, min(g.kv_cache_spec.block_size for g in groups))

    adjust_dcp_kv_cache_interleave_size._dcp2d = True
    adjust_dcp_kv_cache_interleave_size._dcp2d_stock = stock
    VllmConfig.adjust_dcp_kv_cache_interleave_size = adjust_dcp_kv_cache_interleave_size

# ---- end of fenced pieces ----
