"""Layer-split KV storage on a prefill instance: vLLM 0.32.0's KV cache config.

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

vLLM's own KV sharing (``kv_sharing_target_layer_name``) does not fit: a
sharing layer skips its cache write, and here every layer writes its cache.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from vllm_dcp2d.layout import cp_layer_owner, local_layer_count

log = logging.getLogger(__name__)

__all__ = ["StoragePlan", "storage_plan", "split_tensors", "get_kv_cache_configs", "install"]


@dataclass(frozen=True)
class StoragePlan:
    """num_layers: ``L``; cp_size: ranks owning layers (the first ``cp_size`` TP
    ranks); slots: layer regions the largest owner allocates (owned + 1)."""

    num_layers: int
    cp_size: int

    @property
    def slots(self) -> int:
        return local_layer_count(self.num_layers, self.cp_size, 0)  # rank 0 owns the most layers

    def owner(self, layer: int) -> int:
        return cp_layer_owner(layer, self.num_layers, self.cp_size)


def _fail_or_skip(mode: str, why: str) -> None:
    if mode == "on":
        from vllm_dcp2d.connector.config import ConfigError
        raise ConfigError(f"kv_connector_extra_config['layer_split'] = 'on', but {why}. "
                          f"Set layer_split to 'auto' or 'off'.")
    log.info("DCP2D layer-split storage off: %s", why)


def storage_plan(vllm_config, num_layers: int) -> StoragePlan | None:
    """Whether this instance stores KV layer-split, and how; None when it does not.

    Raises ``ConfigError`` when ``layer_split`` is ``"on"`` and it cannot apply.
    """
    from vllm_dcp2d.vllm_compat.config import is_dcp2d

    if not is_dcp2d(vllm_config):
        return None
    kv = vllm_config.kv_transfer_config
    from vllm_dcp2d.connector.config import parse_extra_config
    from vllm_dcp2d.vllm_compat.connector import kv_replicated

    cfg = parse_extra_config(kv.kv_connector_extra_config)
    mode = cfg.layer_split
    if mode == "off" or kv.kv_role != "kv_producer":
        if mode == "on":
            _fail_or_skip(mode, f"kv_role is {kv.kv_role!r} (layer-split storage is for kv_producer instances)")
        return None
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    cp = cfg.cp_size or tp
    from vllm.platforms import current_platform

    if cp <= 1:
        _fail_or_skip(mode, f"cp_size is {cp} (nothing to split)")
    elif not kv_replicated(vllm_config):
        _fail_or_skip(mode, f"{vllm_config.model_config.model} has "
                            f"{vllm_config.model_config.get_total_num_kv_heads()} KV heads sharded over TP={tp}; "
                            f"each rank must hold the whole KV of a layer (MLA, or one KV head)")
    elif pc.pipeline_parallel_size != 1 or pc.decode_context_parallel_size != 1:
        _fail_or_skip(mode, f"pipeline_parallel_size={pc.pipeline_parallel_size} and decode_context_parallel_size="
                            f"{pc.decode_context_parallel_size} (layer-split storage needs both to be 1)")
    elif not current_platform.is_cpu():
        _fail_or_skip(mode, "the transient-slot fill is hooked into vLLM's CPU attention backends (CPU_ATTN, "
                            "CPU_MLA) only; on GPU every rank stores every layer")
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


# ---- 1. get_kv_cache_configs (vLLM 0.32.0: vllm.v1.engine.core) ----

_stock = None


def get_kv_cache_configs(vllm_config, kv_cache_specs: list[dict], available_memory: list[int]) -> list:
    """vLLM's ``get_kv_cache_configs`` with layer-split storage where it applies
    (same signature: per-worker ``{layer name: KVCacheSpec}`` and bytes)."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = sorted({n for specs in kv_cache_specs for n in specs})
    plan = storage_plan(vllm_config, len(names)) if names else None
    if plan is None:
        return _stock(vllm_config, kv_cache_specs, available_memory)
    indices = sorted(extract_layer_index(n) for n in names)
    if indices != list(range(len(names))):
        raise ValueError(f"layer-split storage needs KV layers 0..L-1, got {indices}")
    if len(kv_cache_specs) != vllm_config.parallel_config.tensor_parallel_size:
        raise ValueError(f"layer-split storage: {len(kv_cache_specs)} workers for "
                         f"TP={vllm_config.parallel_config.tensor_parallel_size}")
    scaled = [m * plan.num_layers // plan.slots for m in available_memory]
    configs = _stock(vllm_config, kv_cache_specs, scaled)
    out = [split_tensors(c, plan, rank, extract_layer_index) for rank, c in enumerate(configs)]
    log.info("DCP2D layer-split storage: %d layers on %d CP ranks, %d layer slots per rank instead of %d "
             "(%.2fx the tokens in the same memory), %d blocks", plan.num_layers, plan.cp_size, plan.slots,
             plan.num_layers, plan.num_layers / plan.slots, out[0].num_blocks)
    return out


def install() -> None:
    """Rebind ``vllm.v1.engine.core.get_kv_cache_configs`` (idempotent; called by
    the plugin in every process, acts only in the engine core's KV set-up)."""
    global _stock
    from vllm.v1.engine import core

    if getattr(core.get_kv_cache_configs, "_dcp2d", False):
        return
    _stock = core.get_kv_cache_configs
    get_kv_cache_configs._dcp2d = True
    core.get_kv_cache_configs = get_kv_cache_configs

# ---- end of fenced pieces ----
