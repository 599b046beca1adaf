"""What a ``VllmConfig`` says about this instance, as the plugin reads it (vLLM 0.32.0-0.34.0).

A leaf of ``vllm_compat`` (it imports no other module of it, and nothing of
vLLM's), so the patch table, the start-up choices and the KV layout can all ask
"is this a DCP2D instance, and does it want layer-split storage?" without
importing each other.
"""

from __future__ import annotations

from vllm_dcp2d.config import CONNECTOR_NAME, parse_extra_config

__all__ = ["is_dcp2d", "num_kv_heads", "kv_replicated", "layer_split_may_apply", "cp_size", "serving_info"]


def is_dcp2d(vllm_config) -> bool:
    """Whether this instance's KV connector is DCP2DConnector."""
    kv = vllm_config.kv_transfer_config
    return kv is not None and kv.kv_connector == CONNECTOR_NAME


def num_kv_heads(vllm_config) -> int:
    """The model's KV heads as the transfer counts them: MLA's one latent is one head."""
    mc = vllm_config.model_config
    return 1 if mc.use_mla else int(mc.get_total_num_kv_heads())


def kv_replicated(vllm_config) -> bool:
    """Whether every TP rank holds the whole KV of each layer (MLA, or one KV head)."""
    return num_kv_heads(vllm_config) == 1


def layer_split_may_apply(vllm_config) -> bool:
    """Whether this is a DCP2D producer that asks for layer-split storage (``layer_split``
    not "off", ``cp_size`` > 1); ``kv_cache.storage_plan`` decides whether it can apply."""
    if not is_dcp2d(vllm_config):
        return False
    kv = vllm_config.kv_transfer_config
    cfg = parse_extra_config(kv.kv_connector_extra_config)
    return kv.kv_role == "kv_producer" and cfg.layer_split != "off" and cp_size(vllm_config)[0] > 1


def cp_size(vllm_config) -> tuple[int, str]:
    """This prefill's layer-split size and why: ``kv_connector_extra_config['cp_size']`` when
    set, else what the model allows (``layout.default_cp_size``: the TP ranks holding each
    KV head; 1 where KV heads are sharded over TP)."""
    cfg = parse_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    tp = vllm_config.parallel_config.tensor_parallel_size
    if cfg.cp_size:
        return cfg.cp_size, f"kv_connector_extra_config['cp_size'] = {cfg.cp_size}"
    # imported here: vllm_compat's import chain runs in setup's bare interpreter (cli_metadata),
    # where numpy, which layout needs, is not installed yet
    from vllm_dcp2d.reshard.layout import default_cp_size

    return default_cp_size(num_kv_heads(vllm_config), tp)


def spec_patches_act(vllm_config) -> bool:
    """Whether the speculative-decoding patches act on this instance: DCP > 1 on CPU (where
    vLLM has DCP only through this plugin) or on a DCP2DConnector instance. Other GPU
    instances keep vLLM's own behaviour."""
    if vllm_config.parallel_config.decode_context_parallel_size <= 1:
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu() or is_dcp2d(vllm_config)


def serving_info(vllm_config) -> dict[str, str]:
    """What a front needs to know to route a request here, as Prometheus label values
    (``connector/prom.py``, ``vllm:dcp2d_instance_info``; the proxy reads it, ``proxy/fit.py``):
    ``dcp_size``; ``block_size`` (tokens per page on one rank); ``max_model_len`` (the longest
    prompt + output vLLM admits here); ``kv_cache_tokens`` (the KV capacity in tokens over the
    whole DCP group, vLLM's "KV cache size" line); ``max_num_seqs`` (requests running at once).

    Read in the API server once the engine answered its handshake: vLLM 0.32-0.34 copy
    ``num_gpu_blocks`` and ``kv_cache_size_tokens`` into its ``cache_config`` there
    (``core_client.py``), before the stat loggers (and so this) are built. Where
    ``kv_cache_size_tokens`` is unset, blocks x block size x DCP size (one KV cache group)."""
    cc, pc = vllm_config.cache_config, vllm_config.parallel_config
    dcp = int(pc.decode_context_parallel_size)
    tokens = getattr(cc, "kv_cache_size_tokens", None)
    if tokens is None:
        tokens = int(cc.num_gpu_blocks or 0) * int(cc.block_size) * dcp
    return {"dcp_size": str(dcp), "block_size": str(int(cc.block_size)),
            "max_model_len": str(int(vllm_config.model_config.max_model_len)), "kv_cache_tokens": str(int(tokens)),
            "max_num_seqs": str(int(vllm_config.scheduler_config.max_num_seqs))}
