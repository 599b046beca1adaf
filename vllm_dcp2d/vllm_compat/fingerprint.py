"""The compatibility fingerprint of a worker's KV cache, read from vLLM's objects.

Prefill and decode ranks exchange it (``transfer.messages.Fingerprint``) and refuse
a peer whose KV would not read back the same. Everything it names comes from vLLM's
config and the KV cache tensors, so it is built here, beside the other adaptations
to vLLM, and the transfer system only compares it.
"""

from __future__ import annotations

from vllm_dcp2d.reshard import page_format
from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.transfer.messages import Fingerprint
from vllm_dcp2d.vllm_compat import connector_api as compat

__all__ = ["kv_fingerprint"]


def kv_fingerprint(vllm_config, kv_caches: dict, regions: KVRegions, num_blocks: int, layer_ids: dict[str, int],
                   num_layers: int, num_kv_heads: int) -> Fingerprint:
    """``kv_caches``: ``{layer_name: tensor}`` as the model runner allocated them (see
    ``connector_api.kv_regions`` for their layouts); ``regions``: their ``KVRegions``;
    ``layer_ids``: layer name -> layer index in ``0..num_layers-1``; ``num_kv_heads``: the
    model's KV heads (all of them, not this rank's share)."""
    first = next(iter(kv_caches.values()))
    return Fingerprint(
        draft_layers=len({layer_ids[n] for n in kv_caches if compat.is_draft_layer(vllm_config, n)}),
        model=str(vllm_config.model_config.model), num_layers=num_layers,
        page_size=compat.page_size(vllm_config),
        kv_dtype=page_format.kv_dtype_name(vllm_config.cache_config.cache_dtype, first.dtype),
        kv_scales=compat.kv_scales(vllm_config, layer_ids),
        page_bytes=int(regions.page_bytes.sum()),
        layout=compat.kv_layout(vllm_config, kv_caches, num_blocks, layer_ids),
        model_config=compat.model_config_id(vllm_config), num_kv_heads=num_kv_heads)
