"""Layer-split KV storage on a prefill instance: vLLM's KV cache config (0.32.0, 0.33.0, 0.34.0).

vLLM sizes and lays out every worker's KV memory in the engine core
(``get_kv_cache_configs``, imported by name into ``vllm.v1.engine.core``) and
sends worker ``i`` its ``kv_cache_configs[i]``. Each config lists
``KVCacheTensor`` placements: layers of one backing allocation, each at
``offset + l * layer_stride + b * block_stride``. Placements may alias.

1. ``vllm.v1.engine.core.get_kv_cache_configs`` is rebound to
   :func:`get_kv_cache_configs`. When :func:`storage_plan` says layer-split
   applies, it asks vLLM's own function for the configs with the memory scaled
   by ``L / slots`` (``slots`` = most layers a rank owns, plus one transient
   slot), so vLLM's ``num_blocks``, capacity check and "KV cache size" line
   all see the real capacity. Then :func:`split_tensors` re-places each
   worker's layers: the owned ones in their own regions, every other layer
   on one shared transient region, and the allocation shrinks to
   ``(owned + 1)`` layer regions. Otherwise it is vLLM's function, unchanged.

2. :func:`hook_cache_writes` (each prefill worker, from the connector's
   ``register_kv_caches``): right before a layer writes its KV cache, the layer's
   owner broadcasts the step's earlier tokens into the other ranks' transient slot
   (``prefill/layer_split.py``). The hook sits on each layer's own attention impl
   (``impl.do_kv_cache_update``, which vLLM's KV-update custom ops call for every
   backend that writes outside ``forward``: CPU_ATTN, CPU_MLA, AMX_MLA, FLASH_ATTN,
   FLASHINFER, TRITON_ATTN, the GPU MLA backends), so CPU and GPU share one
   mechanism and no backend class is replaced. On GPU it needs the cache write
   outside CUDA graphs: vLLM's piecewise graphs split at the KV-update ops (its
   default ``splitting_ops``), FULL graphs replay it without Python
   (:func:`graphs_capture_cache_writes`; ``layer_split="on"`` asks vLLM for
   piecewise graphs through the connector's ``requires_piecewise_for_cudagraph``).

vLLM's own KV sharing (``kv_sharing_target_layer_name``) does not fit: a
sharing layer skips its cache write, and here every layer writes its cache.
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_dcp2d.config import ConfigError, parse_extra_config
from vllm_dcp2d.reshard.layout import StoragePlan
from vllm_dcp2d.vllm_compat.instance import cp_size, is_dcp2d, kv_replicated

log = logging.getLogger(__name__)

__all__ = ["StoragePlan", "storage_plan", "split_tensors", "get_kv_cache_configs", "install",
           "KV_CACHE_ARG", "hook_cache_writes", "unhook_cache_writes",
           "graphs_capture_cache_writes"]


def _fail_or_skip(mode: str, why: str) -> None:
    if mode == "on":
        raise ConfigError(f"kv_connector_extra_config['layer_split'] = 'on', but {why}. "
                          f"Set layer_split to 'auto' or 'off'.")
    log.info("DCP2D layer-split storage off: %s", why)


def storage_plan(vllm_config, num_layers: int) -> StoragePlan | None:
    """Whether this instance stores KV layer-split, and how; None when it does not.

    Raises ``ConfigError`` when ``layer_split`` is ``"on"`` and it cannot apply.
    """
    if not is_dcp2d(vllm_config):
        return None
    kv = vllm_config.kv_transfer_config
    cfg = parse_extra_config(kv.kv_connector_extra_config)
    mode = cfg.layer_split
    if mode == "off" or kv.kv_role != "kv_producer":
        if mode == "on":
            _fail_or_skip(mode, f"kv_role is {kv.kv_role!r} (layer-split storage is for kv_producer instances)")
        return None
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    cp, why = cp_size(vllm_config)

    if cp <= 1:
        _fail_or_skip(mode, f"cp_size is {cp}: nothing to split ({why})")
    elif getattr(vllm_config.model_config.hf_text_config, "index_topk", None) is not None:
        _fail_or_skip(mode, f"{vllm_config.model_config.model} uses sparse MLA: each layer keeps an indexer cache "
                            f"beside its latent cache (two placements), and layer-split storage places one cache "
                            f"per layer")
    elif not kv_replicated(vllm_config):
        _fail_or_skip(mode, f"{vllm_config.model_config.model} has "
                            f"{vllm_config.model_config.get_total_num_kv_heads()} KV heads sharded over TP={tp}; "
                            f"each rank must hold the whole KV of a layer (MLA, or one KV head)")
    elif pc.pipeline_parallel_size != 1 or pc.decode_context_parallel_size != 1:
        _fail_or_skip(mode, f"pipeline_parallel_size={pc.pipeline_parallel_size} and decode_context_parallel_size="
                            f"{pc.decode_context_parallel_size} (layer-split storage needs both to be 1)")
    elif (graphs := graphs_capture_cache_writes(vllm_config)) is not None:
        _fail_or_skip(mode, f"the transient-slot fill hooks each layer's KV-cache write, and {graphs}")
    elif cp > num_layers:
        _fail_or_skip(mode, f"cp_size={cp} exceeds the model's {num_layers} layers")
    elif vllm_config.speculative_config is not None and vllm_config.speculative_config.uses_draft_kv_cache():
        _fail_or_skip(mode, f"a speculative draft (method={vllm_config.speculative_config.method!r}) keeps its own "
                            f"KV, computed outside the target's forward; every rank stores every layer")
    else:
        return StoragePlan(num_layers, cp)
    return None


def split_tensors(config, plan: StoragePlan, rank: int, layer_index) -> object:
    """Worker ``rank``'s ``KVCacheConfig`` re-placed for layer-split storage.

    config: vLLM's config for that worker (one cache group, one placement with
    every layer in its own region: ``layer_stride >= num_blocks * block_stride``).
    layer_index: layer name -> model layer index. Returns a copy whose placements
    give each layer owned by ``rank`` its own region and every other layer the
    region right after them (the transient slot), in an allocation of
    ``(owned + 1) * layer_stride`` bytes.
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    tensors = config.kv_cache_tensors
    if len(config.kv_cache_groups) != 1 or len(tensors) != 1:
        raise ValueError(f"layer-split storage needs one KV cache group with one placement, got "
                         f"{len(config.kv_cache_groups)} groups and {len(tensors)} placements")
    t = tensors[0]
    if t.offset != 0 or t.layer_stride < config.num_blocks * t.block_stride:
        raise ValueError(f"layer-split storage needs each layer in its own region (a layer-outermost KV layout), "
                         f"got layer_stride={t.layer_stride}, block_stride={t.block_stride}, "
                         f"num_blocks={config.num_blocks}; unset VLLM_KV_CACHE_LAYOUT or use a layer-outer one")
    owned = [name for name in t.layers if plan.owner(layer_index(name)) == rank]
    others = [name for name in t.layers if plan.owner(layer_index(name)) != rank]
    size = (len(owned) + 1) * t.layer_stride
    placements = [KVCacheTensor(size=size, layers=owned, layer_stride=t.layer_stride, block_stride=t.block_stride)]
    placements = placements if owned else []
    transient = len(owned) * t.layer_stride
    placements += [KVCacheTensor(size=size, layers=[name], layer_stride=t.layer_stride,
                                 block_stride=t.block_stride, offset=transient) for name in others]
    return dataclasses.replace(config, kv_cache_tensors=placements)


# ---- 2. The transient-slot fill: a hook on each layer's KV-cache write (workers) ----

# Where vLLM passes the KV cache tensor about to be written to ``impl.do_kv_cache_update``
# (0.32, 0.33 and 0.34): ``Attention``'s ``unified_kv_cache_update`` calls it with (layer, key,
# value, kv_cache, slot_mapping), ``MLAAttention.update_kv_cache`` with (kv_c_normed, k_pe,
# kv_cache, slot_mapping, kv_cache_dtype, k_scale[, skip_scale]). tests/vllm_compat/test_vllm_sources.py
# checks every such call in each supported version's sources.
KV_CACHE_ARG = {"attention": 3, "mla": 2}


def hook_cache_writes(vllm_config, names, before) -> None:
    """Call ``before(layer_name, kv_cache)`` right before each of these layers writes
    its KV cache, on any backend, CPU or GPU.

    vLLM's attention layers write their cache through ``layer.impl.do_kv_cache_update``,
    called from the KV-update custom op, which finds the layer in the forward context
    and looks the method up at every call: a function set on that impl instance is
    reached, for that layer only, and no backend class is replaced. Raises
    ``RuntimeError`` naming the layer where that does not hold (a backend that writes
    inside ``forward``, KV sharing, encoder attention)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = vllm_config.compilation_config.static_forward_context
    for name in names:
        layer = ctx.get(name)
        impl = getattr(layer, "impl", None)
        if impl is None:
            raise RuntimeError(f"layer-split storage: {name!r} is not an attention layer of this model")
        mla = isinstance(layer, MLAAttention)
        why = (f"it shares layer {layer.kv_sharing_target_layer_name!r}'s KV"
               if getattr(layer, "kv_sharing_target_layer_name", None) else
               f"its backend {layer.attn_backend.get_name()} writes the cache inside forward"
               if not mla and layer.attn_backend.forward_includes_kv_cache_update else
               f"it is {impl.attn_type} attention"
               if not mla and getattr(impl, "attn_type", "decoder") != "decoder" else None)
        if why is not None:
            raise RuntimeError(f"layer-split storage cannot fill layer {name!r}'s transient slot: {why}. "
                               f"Set kv_connector_extra_config layer_split='off'.")
        stock, at = impl.do_kv_cache_update, KV_CACHE_ARG["mla" if mla else "attention"]

        def do_kv_cache_update(*args, _stock=stock, _name=name, _at=at, **kwargs):
            before(_name, args[_at])
            return _stock(*args, **kwargs)

        impl.do_kv_cache_update = do_kv_cache_update


def unhook_cache_writes(vllm_config, names) -> None:
    """Undo :func:`hook_cache_writes` (vLLM's own method again)."""
    ctx = vllm_config.compilation_config.static_forward_context
    for name in names:
        impl = getattr(ctx.get(name), "impl", None)
        if impl is not None:
            impl.__dict__.pop("do_kv_cache_update", None)


def graphs_capture_cache_writes(vllm_config) -> str | None:
    """Why this instance's CUDA graphs or compile passes would run a layer's KV-cache
    write without its Python hook (so a transient slot would not be filled), or None.

    Piecewise graphs are fine: vLLM splits its graphs at the KV-update ops (they are in
    the default ``splitting_ops``), so the hook runs eagerly every step. A FULL graph
    replays the whole forward without Python, and so does anything else that captures
    or fuses the cache write."""
    cc = vllm_config.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)():
        return (f"cudagraph_mode={mode.name} replays whole forwards without the hook; start the prefill with "
                f"-cc.cudagraph_mode=PIECEWISE (or -O1, or --enforce-eager)")
    if mode is not None and mode.name != "NONE":
        ops = set(cc.splitting_ops or ())
        if getattr(cc, "use_inductor_graph_partition", False) or not \
                {"vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"} <= ops:
            return ("the KV-update ops are captured inside piecewise graphs (use_inductor_graph_partition, or "
                    "splitting_ops without vllm::unified_kv_cache_update and vllm::unified_mla_kv_cache_update); "
                    "leave splitting_ops unset")
    passes = getattr(cc, "pass_config", None)
    fused = [k for k in ("fuse_attn_quant", "fuse_rope_kvcache", "fuse_rope_kvcache_cat_mla",
                         "fuse_qk_norm_rope_kvcache") if getattr(passes, k, False)]
    if fused:
        return f"the compile passes {fused} write the cache without the hook; turn them off"
    return None


# ---- 1. get_kv_cache_configs (vllm.v1.engine.core; 0.32.0: 3 arguments, 0.33.0: 4) ----

_stock = None


def get_kv_cache_configs(vllm_config, kv_cache_specs: list[dict], available_memory: list[int], *rest) -> list:
    """vLLM's ``get_kv_cache_configs`` with layer-split storage where it applies (same
    signature: per-worker ``{layer name: KVCacheSpec}`` and bytes; 0.33 adds the global
    KV cache groups, passed through)."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = sorted({n for specs in kv_cache_specs for n in specs})
    plan = storage_plan(vllm_config, len(names)) if names else None
    if plan is None:
        return _stock(vllm_config, kv_cache_specs, available_memory, *rest)
    indices = sorted(extract_layer_index(n) for n in names)
    if indices != list(range(len(names))):
        raise ValueError(f"layer-split storage needs KV layers 0..L-1, got {indices}")
    if len(kv_cache_specs) != vllm_config.parallel_config.tensor_parallel_size:
        raise ValueError(f"layer-split storage: {len(kv_cache_specs)} workers for "
                         f"TP={vllm_config.parallel_config.tensor_parallel_size}")
    scaled = [m * plan.num_layers // plan.slots for m in available_memory]
    configs = _stock(vllm_config, kv_cache_specs, scaled, *rest)
    out = [split_tensors(c, plan, rank, extract_layer_index) for rank, c in enumerate(configs)]
    log.info("DCP2D layer-split storage: %d layers on %d CP ranks, %d layer slots per rank instead of %d "
             "(%.2fx the tokens in the same memory), %d blocks", plan.num_layers, plan.cp_size, plan.slots,
             plan.num_layers, plan.num_layers / plan.slots, out[0].num_blocks)
    return out


def install(version: str) -> None:
    """Rebind ``vllm.v1.engine.core.get_kv_cache_configs`` (registry: ``layer_split_kv_configs``;
    idempotent). The engine core calls it by that module-level name in both versions (0.33
    imports it there from ``vllm.v1.core.kv_cache_planning``); it acts only in the engine
    core's KV set-up, and only for a DCP2D producer that stores KV layer-split."""
    global _stock
    from vllm.v1.engine import core

    if getattr(core.get_kv_cache_configs, "_dcp2d", False):
        return
    _stock = core.get_kv_cache_configs
    get_kv_cache_configs._dcp2d, get_kv_cache_configs._dcp2d_stock = True, _stock
    core.get_kv_cache_configs = get_kv_cache_configs

# ---- end of fenced pieces ----
