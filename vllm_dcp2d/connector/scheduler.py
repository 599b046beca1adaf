"""Scheduler side of DCP2DConnector: which request loads or sends what.

Runs in vLLM's engine-core process, once per instance. No I/O: it only turns
the scheduler's decisions into ``DCP2DMetadata`` for the workers, and reads
back what the workers report through ``KVConnectorOutput``.

Producer (prefill, ``kv_role="kv_producer"``), per request that came with
``kv_transfer_params={"do_remote_decode": true, ...}``:
  * decode ranks fetch it by its transfer key: the request's ``transfer_id``
    (if given and not in use by a live request) or its vLLM request id;
  * the step in which its prompt completes lists it in ``computing`` so a
    worker can send each layer right after computing it, for decode ranks
    that already asked (layer pipelining);
  * ``request_finished`` keeps its blocks (returns True) and answers with the
    ``kv_transfer_params`` a decode instance needs; the next step lists it in
    ``ready``: the workers serve it to every decode rank that asks, and report
    it in ``finished_sending`` once all have their pages (or ``send_timeout_s``
    passed); vLLM then frees the blocks.

Consumer (decode, ``kv_role="kv_consumer"``), per request that came with
``kv_transfer_params={"do_remote_prefill": true, ...}`` from a producer:
  * ``get_num_new_matched_tokens`` claims the prompt tokens not cached
    locally, loaded asynchronously (the request waits in WAITING_FOR_REMOTE_KVS);
  * ``update_state_after_alloc`` records the block table, the next step lists
    it in ``loads``; each worker (DCP rank) fetches its pages from every prefill
    CP rank and reports ``finished_recving``, or the blocks as load errors;
  * a fetch that ended while a prefill rank may still write into its blocks is
    reported in ``failed_recving`` (vLLM frees the blocks and recomputes the
    request in fresh ones) and its blocks in ``DCP2DWorkerMeta.hold``: this side
    holds them out of the free queue until the worker reports them in
    ``release`` (docs/connector.md, "Block lifetime");
  * a request this instance will not fetch (nothing left to load after its
    prefix-cache hit, or finished before it was admitted: an abort while it
    waited, the proxy giving up) is listed in ``releases``: each worker tells
    every prefill CP rank (``ReleaseTransfer``), which frees its blocks now
    rather than at ``send_timeout_s``. Workers also release failed and refused
    fetches themselves (``worker``).

Producer abort: a request aborted after its prompt completed may have layer
writes in flight (layer pipelining), so its blocks are kept (``request_finished``
returns True) and the workers abort it; they report it in ``finished_sending``
once no write reads them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_dcp2d.connector.config import DCP2DConfig
from vllm_dcp2d.layout import cdiv
from vllm_dcp2d.vllm_compat import connector as compat

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # engine steps with no tokens to compute: poll transfers at <= 50 Hz
KEY_MAX_LEN = 256   # a client's transfer_id longer than this is not used as the transfer key

__all__ = ["LoadSpec", "ReleaseSpec", "SendSpec", "DCP2DMetadata", "DCP2DWorkerMeta", "SchedulerSide", "transfer_params"]


@dataclass
class SendSpec:
    """A producer request's KV: ``block_ids``, one list per KV cache group, each
    int ``[cdiv(num_tokens, page_size)]``.

    transfer_key: the id decode ranks fetch it by (``remote_request_id``): the client's
    ``transfer_id`` when it gave one, so a router can send the decode request
    before the prefill finished (layer pipelining), else vLLM's request id.
    """

    block_ids: tuple[list[int], ...]
    num_tokens: int
    transfer_key: str


@dataclass
class LoadSpec:
    """What a consumer worker fetches for one request.

    transfer_key:      what the producer knows the request by (``remote_request_id``).
    bootstrap_addr:    producer's bootstrap server, "tcp://host:port".
    remote_engine_id:  producer's engine id (checked by the bootstrap).
    block_ids:         the request's block tables on this instance, one list per KV
                       cache group (in a DCP-sharded group one block per ``dcp_size``
                       pages, in a replicated one a block per page).
    first_page:        first page to fetch (earlier ones are cached locally).
    num_tokens:        prompt tokens of the request here; each prefill rank must hold as many.
    remote_num_tokens: what the producer said it computed (``kv_transfer_params``), None if absent.
    timeout_s:         deadline of the fetch: ``transfer_timeout_s`` from the request's
                       ``kv_transfer_params`` if given (a router's per-request budget), else the config's.
    """

    transfer_key: str
    bootstrap_addr: str
    remote_engine_id: str
    block_ids: tuple[list[int], ...]
    first_page: int
    num_tokens: int
    remote_num_tokens: int | None
    timeout_s: float


@dataclass
class ReleaseSpec:
    """A producer request this consumer will never fetch: ``transfer_key``
    (``remote_request_id``) of ``num_tokens`` prompt tokens at ``bootstrap_addr``."""

    transfer_key: str
    bootstrap_addr: str
    num_tokens: int


@dataclass
class DCP2DMetadata(compat.KVConnectorMetadata):
    """Scheduler -> workers, once per step. aborted: request id -> transfer key of
    producer requests aborted after their prompt completed. context_blocks: sorted
    ids of the blocks that hold the scheduled requests' tokens computed before this
    step (producer with layer-split storage: the owners broadcast them; else None).
    releases: request id -> what to release on the producer (consumer)."""

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    releases: dict[str, ReleaseSpec] = field(default_factory=dict)
    computing: dict[str, SendSpec] = field(default_factory=dict)
    ready: dict[str, SendSpec] = field(default_factory=dict)
    aborted: dict[str, str] = field(default_factory=dict)
    context_blocks: list[int] | None = None


@dataclass
class DCP2DWorkerMeta(compat.KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step (vLLM aggregates it over TP ranks).

    hold:    ``(request id, tp rank) -> block ids`` to keep out of the free queue.
    release: ``(request id, tp rank)`` holds to drop.
    """

    hold: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    release: set[tuple[str, int]] = field(default_factory=set)

    def aggregate(self, other: DCP2DWorkerMeta) -> DCP2DWorkerMeta:
        return DCP2DWorkerMeta({**self.hold, **other.hold}, self.release | other.release)


def transfer_params(params: dict | None) -> dict:
    """``request.kv_transfer_params`` as a dict (never None)."""
    return params if isinstance(params, dict) else {}


class SchedulerSide:
    """The scheduler-role half of DCP2DConnector (see module doc)."""

    def __init__(self, vllm_config, cfg: DCP2DConfig, engine_id: str, is_producer: bool, is_consumer: bool,
                 layer_split: bool = False):
        self.cfg = cfg
        self.layer_split = layer_split  # producer stores KV layer-split: list each step's context blocks
        self.engine_id = engine_id
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.page_size = compat.page_size(vllm_config)
        self.bootstrap_addr = f"tcp://{cfg.bootstrap_host}:{cfg.bootstrap_port}"
        self.kv_cache_manager = None
        self._loads: dict[str, LoadSpec] = {}
        self._releases: dict[str, ReleaseSpec] = {}
        self._ready: dict[str, SendSpec] = {}
        self._aborted: dict[str, str] = {}
        self._computed: set[str] = set()  # producer: prompt completed (layer writes possible), not finished
        self._held: dict[tuple[str, int], list] = {}  # consumer: quarantined blocks per (request, tp rank)
        self._remote_decode: dict[str, int] = {}  # producer: prompt length of requests still prefilling
        self._keys: dict[str, str] = {}  # producer: request id -> transfer key, until its blocks are freed
        self._key_owner: dict[str, str] = {}  # transfer key -> request id

    # -- consumer ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Called by the scheduler for a waiting request, possibly several times
        before it is admitted; must not change state. Returns the prompt tokens
        the producer will write beyond the ``num_computed_tokens`` cached locally,
        and True (loaded asynchronously)."""
        params = transfer_params(request.kv_transfer_params)
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Called by the scheduler once blocks are allocated for a newly admitted
        request (``blocks``: all its blocks). Records the load for the next step."""
        params = transfer_params(request.kv_transfer_params)
        if self.is_producer and params.get("do_remote_decode"):
            self._remote_decode[request.request_id] = request.num_prompt_tokens
            self._bind_key(request.request_id, params.get("transfer_id"))
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return
        # One transfer per request: a preempted request recomputes locally.
        params["do_remote_prefill"] = False
        missing = [k for k in ("remote_request_id", "remote_bootstrap_addr", "remote_engine_id") if k not in params]
        if missing:
            log.warning("request %s: kv_transfer_params lack %s (got %s); prefilling locally",
                        request.request_id, missing, sorted(params))
            return
        if num_external_tokens == 0:
            # Fully cached here: nothing to fetch, so the producer may free it now.
            self._release(request, params)
            return
        timeout = params.get("transfer_timeout_s", self.cfg.transfer_timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            log.warning("request %s: kv_transfer_params['transfer_timeout_s'] = %r is not seconds in (0, 86400]; "
                        "using %s", request.request_id, timeout, self.cfg.transfer_timeout_s)
            timeout = self.cfg.transfer_timeout_s
        num_tokens = request.num_prompt_tokens
        remote = params.get("remote_num_tokens")
        self._loads[request.request_id] = LoadSpec(
            transfer_key=str(params["remote_request_id"]),
            bootstrap_addr=str(params["remote_bootstrap_addr"]),
            remote_engine_id=str(params["remote_engine_id"]),
            block_ids=compat.block_ids(blocks),
            first_page=(num_tokens - num_external_tokens) // self.page_size,
            num_tokens=num_tokens, timeout_s=float(timeout),
            remote_num_tokens=None if remote is None else remote if type(remote) is int else -1)

    def _release(self, request, params: dict) -> None:
        """Consumer: this instance will not fetch ``request``'s KV from its producer."""
        if not self.cfg.release_unfetched or "remote_bootstrap_addr" not in params:
            return
        key = params.get("remote_request_id")
        if isinstance(key, str) and key:
            self._releases[request.request_id] = ReleaseSpec(key, str(params["remote_bootstrap_addr"]),
                                                             request.num_prompt_tokens)

    # -- producer ----------------------------------------------------------------------------

    def _bind_key(self, req_id: str, transfer_id) -> None:
        key = req_id
        if isinstance(transfer_id, str) and 0 < len(transfer_id) <= KEY_MAX_LEN:
            if self._key_owner.get(transfer_id, req_id) == req_id:
                key = transfer_id
            else:
                log.warning("request %s: transfer_id %r is in use by request %s; decode must fetch it as %r",
                            req_id, transfer_id, self._key_owner[transfer_id], req_id)
        self._keys[req_id] = key
        self._key_owner[key] = req_id

    def _unbind_key(self, req_id: str) -> None:
        key = self._keys.pop(req_id, None)
        if key is not None and self._key_owner.get(key) == req_id:
            del self._key_owner[key]

    def update_connector_output(self, connector_output) -> None:
        """Called by the scheduler with the workers' merged output every step,
        before it frees any block of this step's finished transfers.
        Producer: requests whose blocks are now freed release their transfer key.
        Consumer: quarantined blocks are held or released (``DCP2DWorkerMeta``)."""
        for req_id in connector_output.finished_sending or ():
            self._unbind_key(req_id)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, DCP2DWorkerMeta):
            return
        for key, ids in meta.hold.items():
            self._held[key] = compat.hold_blocks(self.kv_cache_manager, ids)
            log.warning("request %s: %d blocks quarantined (tp rank %d): a prefill rank may still write into "
                        "them; %d holds active", key[0], len(ids), key[1], len(self._held))
        for key in meta.release:
            blocks = self._held.pop(key, None)
            if blocks is not None:
                compat.release_blocks(self.kv_cache_manager, blocks)
                log.info("request %s: %d quarantined blocks released (tp rank %d)", key[0], len(blocks), key[1])

    def has_pending_work(self) -> bool:
        """Blocks in quarantine, or releases not yet handed to the workers. Both end only
        through a step (a worker reports a settled rank in its step output; releases
        travel in the step's metadata), so the engine must keep stepping with no request
        left: an idle engine would hold the blocks until the next request arrived."""
        return bool(self._held or self._releases)

    def quarantined_blocks(self) -> int:
        """Blocks held out of use now (a block held by two ranks counts twice)."""
        return sum(len(b) for b in self._held.values())

    # -- both --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> DCP2DMetadata:
        """Called by the scheduler at the end of ``schedule()``; resets the pending sets."""
        if scheduler_output.total_num_scheduled_tokens == 0 and not (self._loads or self._ready or self._aborted
                                                                    or self._releases):
            # Nothing to compute: vLLM keeps stepping only to poll transfers (held
            # blocks, remote KV). Unthrottled, that loop and the TP workers it drives
            # starve the API server on small machines (measured: new requests wait
            # ~10 s with TP=2 on 2 cores). A short sleep bounds the polling rate.
            time.sleep(IDLE_POLL_S)
        meta = DCP2DMetadata(loads=self._loads, ready=self._ready, aborted=self._aborted, releases=self._releases)
        self._loads, self._ready, self._aborted, self._releases = {}, {}, {}, {}
        if self.layer_split:
            meta.context_blocks = self._context_blocks(scheduler_output)
        if self.is_producer and self._remote_decode:
            for req_id, num_tokens in compat.scheduled_tokens(scheduler_output):
                prompt_len = self._remote_decode.get(req_id)
                if prompt_len is not None and num_tokens >= prompt_len:
                    del self._remote_decode[req_id]
                    self._computed.add(req_id)
                    meta.computing[req_id] = SendSpec(self._block_ids(req_id, prompt_len), prompt_len,
                                                      self._keys.get(req_id, req_id))
        return meta

    def _context_blocks(self, scheduler_output) -> list[int]:
        # Layer-split storage applies to one KV cache group only (vllm_compat.kv_cache).
        ids = [self._block_ids(req_id, n)[0] for req_id, n in compat.scheduled_context(scheduler_output) if n > 0]
        return np.unique(np.concatenate(ids)).tolist() if ids else []

    def _block_ids(self, req_id: str, num_tokens: int) -> tuple[list[int], ...]:
        return self._pages(compat.request_block_ids(self.kv_cache_manager, req_id), num_tokens)

    def _pages(self, block_ids: tuple[list[int], ...], num_tokens: int) -> tuple[list[int], ...]:
        """The blocks holding ``num_tokens`` tokens in each group (a producer's blocks
        are pages: it runs without DCP)."""
        return tuple(list(ids[:cdiv(num_tokens, self.page_size)]) for ids in block_ids)

    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed
        (``block_ids``: one list per KV cache group).

        Producer: returns ``(True, params for decode)`` to keep the blocks until the
        workers report ``finished_sending``. Consumer: nothing to keep; a request
        that finished before it was admitted (its load never started) is released
        on the producer."""
        self._remote_decode.pop(request.request_id, None)
        computed = request.request_id in self._computed
        self._computed.discard(request.request_id)
        params = transfer_params(request.kv_transfer_params)
        if self.is_consumer and params.get("do_remote_prefill"):  # still set: never admitted
            params["do_remote_prefill"] = False
            self._release(request, params)
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        has_blocks = any(block_ids)
        if not compat.finished_normally(request) or not has_blocks:
            if computed and has_blocks:  # layer writes may read the blocks: free them once none can
                self._aborted[request.request_id] = self._keys.get(request.request_id, request.request_id)
                return True, None
            self._unbind_key(request.request_id)
            return False, None
        num_tokens = request.num_prompt_tokens
        key = self._keys.get(request.request_id, request.request_id)
        self._ready[request.request_id] = SendSpec(self._pages(block_ids, num_tokens), num_tokens, key)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": key,
            "remote_bootstrap_addr": self.bootstrap_addr,
            "remote_engine_id": self.engine_id,
            "remote_num_tokens": num_tokens,
            "transfer_id": params.get("transfer_id", request.request_id),
        }
