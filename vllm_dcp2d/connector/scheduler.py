"""Scheduler side of DCP2DConnector: which request fetches or sends what.

Runs in vLLM's engine-core process, once per instance. No I/O: it only turns
the scheduler's decisions into ``DCP2DMetadata`` for the workers, and reads
back what the workers report through ``KVConnectorOutput`` (both in
``metadata.py``, the contract between the two halves).

Producer (prefill, ``kv_role="kv_producer"``), per request that came with
``kv_transfer_params={"do_remote_decode": true, ...}``:
  * decode ranks fetch it by its transfer key: the client's ``kv_transfer_params["transfer_id"]``
    (if given and not in use by a live request) or its vLLM request id;
  * the step in which its prompt completes lists it in ``computing`` so a
    worker can send each layer right after computing it, for decode ranks
    that already asked (layer pipelining);
  * if vLLM preempts it after that (its blocks are freed at once; under async
    scheduling even a ``max_tokens=1`` prefill can be), the next step lists it
    in ``preempted``: before that step's forward can overwrite the blocks, the
    workers void every layer written from them (``handle_preemptions``), and
    the re-prefill's ``computing`` step writes them again;
  * ``request_finished`` keeps its blocks (returns True) and answers with the
    ``kv_transfer_params`` a decode instance needs; the next step lists it in
    ``ready``: the workers serve it to every decode rank that asks, and report
    it in ``finished_sending`` once all have their pages (or ``send_timeout_s``
    passed); vLLM then frees the blocks.
  * aborted after its prompt completed: its blocks are kept (layer writes may
    read them) and it is listed in ``aborted``; the workers report it in
    ``finished_sending`` once no write reads them. Aborted before (or while
    preempted): nothing is kept; ``dropped`` fails the fetches waiting for it.

Consumer (decode, ``kv_role="kv_consumer"``), per request that came with
``kv_transfer_params={"do_remote_prefill": true, ...}`` from a producer:
  * ``get_num_new_matched_tokens`` counts the prompt tokens not cached
    locally, fetched asynchronously (the request waits in WAITING_FOR_REMOTE_KVS);
  * ``update_state_after_alloc`` checks the params (``metadata.fetch_params``)
    and records the fetch for the next step's ``fetches``; refused params go there
    too, with the reason, and every worker reports that fetch failed, so
    ``kv_load_failure_policy`` ends or recomputes the request in that step (it
    must not wait for a fetch that never starts); each worker (DCP rank) fetches its
    pages from every prefill CP rank and reports ``finished_recving``, or the
    blocks as load errors;
  * a fetch that ended while a prefill rank may still write into its blocks is
    reported in ``failed_recving`` (vLLM frees the blocks and recomputes the
    request in fresh ones) and its blocks in ``DCP2DWorkerMeta.quarantine``:
    this side keeps them out of the free queue until a worker reports the
    quarantine ``lifted`` (docs/connector.md, "Block lifetime");
  * engine requests that carry one key (``n > 1``, a batch: vLLM copies the HTTP
    request's params to each) fetch it once: the others wait for that fetch and
    prefill locally on the prefix cache, or at once when their prompt is not the
    key's (``siblings``);
  * a request this instance will not fetch (nothing left to fetch after its
    prefix-cache hit, or finished before it was admitted: an abort while it
    waited, the proxy giving up) is listed in ``releases``: each worker tells
    every prefill CP rank (``ReleaseTransfer``), which frees its blocks now
    rather than at ``send_timeout_s``. Workers also release failed and refused
    fetches themselves (``worker``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from vllm_dcp2d.config import DCP2DConfig
from vllm_dcp2d.transfer.messages import MAX_NAME, clip, prompt_digest
from vllm_dcp2d.connector.metadata import (CLIENT_KEY_FIELD, KEY_FIELD, DCP2DMetadata, DCP2DWorkerMeta, FetchSpec,
                                           ReleaseSpec, SendSpec, Siblings, TransferKeys, bootstrap_addr,
                                           check_bootstrap_addr, fetch_params, flag, key_of)
from vllm_dcp2d.connector.stats import DCP2DStats, DecodeTimeline, StatsFile
from vllm_dcp2d.connector.step_bell import StepBell
from vllm_dcp2d.reshard.layout import cdiv
from vllm_dcp2d.vllm_compat import connector_api as compat

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # engine steps with no tokens to compute: poll transfers at <= 50 Hz

__all__ = ["SchedulerSide", "transfer_params"]


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
        self.failure_policy = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_load_failure_policy", "fail")
        self.bootstrap_addr = bootstrap_addr(cfg)
        self.kv_cache_manager = None
        self._fetches: dict[str, FetchSpec] = {}
        self._releases: dict[str, ReleaseSpec] = {}
        self._ready: dict[str, SendSpec] = {}
        self._aborted: dict[str, str] = {}
        self._dropped: dict[str, str] = {}
        self._computed: dict[str, int] = {}  # producer: prompt completed (layer writes possible) -> prompt length
        self._quarantined: dict[tuple[str, int], list] = {}  # consumer: blocks per (request, tp rank)
        self._remote_decode: dict[str, int] = {}  # producer: prompt length of requests still prefilling
        self._digests: dict[str, str] = {}  # producer: prompt digest of each request it will send
        self._refused: dict[str, str] = {}  # producer: why a request's do_remote_decode was refused
        self.keys = TransferKeys()  # producer: request id <-> transfer key, until its blocks are freed
        self.siblings = Siblings()  # consumer: engine requests sharing one transfer key (n > 1, batches)
        self.bell = StepBell() if is_consumer else None  # ends an idle step when a fetch ends
        # consumer: admit, resume and first step of each fetched request (issue 29)
        self.timeline = DecodeTimeline(StatsFile(cfg.stats_file, "consumer", engine_id)) if is_consumer else None
        self._was_idle = False  # the last step had nothing to compute or hand over

    # -- consumer ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called by the scheduler for a waiting request, possibly several times
        before it is admitted; changes no state but a cache of the prompt's digest. Returns the prompt tokens
        the producer will write beyond the ``num_computed_tokens`` cached locally,
        and True (fetched asynchronously: vLLM's "load" flag)."""
        params = transfer_params(request.kv_transfer_params)
        if not (self.is_consumer and flag(params, "do_remote_prefill")[0]):
            return 0, False
        shared = self.siblings.verdict(request, params)
        if shared is not None:  # another request fetches (or fetched) this key: never twice
            return (None, False) if shared else (0, False)
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Called by the scheduler once blocks are allocated for a newly admitted
        request (``blocks``: all its blocks). Records the fetch for the next step."""
        params = transfer_params(request.kv_transfer_params)
        sends, refused = flag(params, "do_remote_decode")
        if self.is_producer and refused:  # not prefilled for a decode; its answer says why (request_finished)
            log.warning("request %s: %s; it is not prefilled for a decode", request.request_id, refused)
            self._refused[request.request_id] = refused
        elif self.is_producer and sends:
            self._remote_decode[request.request_id] = request.num_prompt_tokens
            self._digests[request.request_id] = prompt_digest(**compat.prompt_inputs(request))
            self._bind_key(request.request_id, params.get(CLIENT_KEY_FIELD))
        if not (self.is_consumer and flag(params, "do_remote_prefill")[0]):
            return
        try:
            self._admit(request, params, blocks, num_external_tokens)
        finally:
            self.siblings.admitted(request.request_id)

    def _admit(self, request, params: dict, blocks, num_external_tokens: int) -> None:
        """Consumer: record the fetch of a newly admitted ``request`` (or why it has none)."""
        bad = flag(params, "do_remote_prefill")[1]  # refused below, whatever else the params hold
        # One transfer per request: a preempted request recomputes locally.
        params["do_remote_prefill"] = False
        if bad and num_external_tokens == 0:  # nothing to fetch to fail: served from the local cache
            log.warning("request %s: %s; its prompt is cached here, so nothing is fetched", request.request_id, bad)
            return
        if not bad and self.siblings.verdict(request, params) is not None:
            key = key_of(params)
            holder = self.siblings.fetcher(key) or self.siblings.ended(key) if isinstance(key, str) else None
            why = (f"transfer key {clip(repr(key), 80)} is fetched by request {holder} on this instance" if holder
                   else "its kv_transfer_params carry another prompt's digest")
            log.info("request %s: prefilled here, reusing what the prefix cache holds: %s (n > 1, or a batch "
                     "answered with one prefill's params)", request.request_id, why)
            return  # no release either: the prefill keeps the KV for the request that fetches it
        if num_external_tokens == 0:
            # Fully cached here: nothing to fetch, so the producer may free it now.
            self._release(request, params)
            return
        num_tokens = request.num_prompt_tokens
        ids, first_page = compat.block_ids(blocks), (num_tokens - num_external_tokens) // self.page_size
        try:
            if bad:
                raise ValueError(bad)
            spec, warning = fetch_params(params, self.cfg, block_ids=ids, num_tokens=num_tokens, first_page=first_page,
                                        prompt_digest=self.siblings.prompt_digest(request))
        except ValueError as e:
            log.warning("request %s: %s; its load fails (kv_load_failure_policy %r applies)", request.request_id,
                        clip(str(e), 400), self.failure_policy)
            self._fetches[request.request_id] = FetchSpec("", "", "", ids, first_page, num_tokens, None, 0.0,
                                                       refused=f"kv_transfer_params refused: {e}")
            return
        if warning:
            log.warning("request %s: %s", request.request_id, warning)
        self._fetches[request.request_id] = spec
        self.siblings.start(spec.transfer_key, request.request_id)
        self.timeline.admitted(request.request_id, spec.transfer_key, getattr(request, "arrival_time", None))

    def _release(self, request, params: dict) -> None:
        """Consumer: this instance will not fetch ``request``'s KV from its producer."""
        if not self.cfg.release_unfetched:
            return
        key = key_of(params)
        try:
            addr = check_bootstrap_addr(params.get("remote_bootstrap_addr"))
        except ValueError:
            return  # nowhere to send it: the producer's send_timeout_s frees the request
        # The producer's count when it gave one: vLLM's front end, refusing a request
        # (say, longer than this instance's max_model_len), hands the connector a
        # stand-in of one token (``notify_kv_transfer_request_rejected``), and a release
        # naming another count than the producer's is ignored as a reused key.
        remote = params.get("remote_num_tokens")
        own = type(remote) is not int or remote == request.num_prompt_tokens
        num_tokens = request.num_prompt_tokens if own or remote < 0 else remote
        digest = self.siblings.prompt_digest(request) if own else params.get("remote_prompt_digest", "")
        engine = params.get("remote_engine_id")
        engine = engine if isinstance(engine, str) and 0 < len(engine) <= MAX_NAME else None
        if isinstance(key, str) and 0 < len(key) <= MAX_NAME and isinstance(digest, str) and len(digest) <= 64:
            self._releases[request.request_id] = ReleaseSpec(key, addr, num_tokens, engine, digest)

    # -- producer ----------------------------------------------------------------------------

    def _bind_key(self, req_id: str, asked) -> None:
        """``asked``: the transfer key the client gave (``CLIENT_KEY_FIELD``), if any."""
        key = req_id
        if isinstance(asked, str) and 0 < len(asked) <= MAX_NAME:
            if self.keys.owner(asked, req_id) == req_id:
                key = asked
            else:
                log.warning("request %s: transfer key %r is in use by request %s; decode must fetch it as %r",
                            req_id, asked, self.keys.owner(asked), req_id)
        self.keys.bind(req_id, key)

    def update_connector_output(self, connector_output) -> None:
        """Called by the scheduler with the workers' merged output every step,
        before it frees any block of this step's finished transfers.
        Producer: requests whose blocks are now freed release their transfer key.
        Consumer: blocks go into quarantine or come out of it (``DCP2DWorkerMeta``)."""
        for req_id in connector_output.finished_sending or ():
            self.keys.unbind(req_id)
        meta = connector_output.kv_connector_worker_meta
        if self.is_consumer:  # fetches that ended: their siblings stop waiting
            for req_id in (*(connector_output.finished_recving or ()), *(connector_output.failed_recving or ()),
                           *(meta.failed_fetches if isinstance(meta, DCP2DWorkerMeta) else ())):
                self.siblings.end(req_id)
        if self.timeline is not None:
            self.timeline.failed(connector_output.failed_recving or ())
            if isinstance(meta, DCP2DWorkerMeta):
                self.timeline.failed(meta.failed_fetches)
                self.timeline.ran(meta.ran)
            self.timeline.fetched(connector_output.finished_recving or ())
        if not isinstance(meta, DCP2DWorkerMeta):
            return
        for key, ids in meta.quarantine.items():
            self._quarantined[key] = compat.quarantine_blocks(self.kv_cache_manager, ids)
            log.warning("request %s: %d blocks quarantined (tp rank %d): a prefill rank may still write into "
                        "them; %d quarantines active", key[0], len(ids), key[1], len(self._quarantined))
        for key in meta.lifted:
            blocks = self._quarantined.pop(key, None)
            if blocks is not None:
                compat.lift_quarantine(self.kv_cache_manager, blocks)
                log.info("request %s: quarantine of %d blocks lifted (tp rank %d)", key[0], len(blocks), key[1])

    def has_pending_work(self) -> bool:
        """Blocks in quarantine, or releases not yet handed to the workers. Both end only
        through a step (a worker reports a settled rank in its step output; releases
        travel in the step's metadata), so the engine must keep stepping with no request
        left: an idle engine would keep the blocks until the next request arrived."""
        return bool(self._quarantined or self._releases)

    # -- both --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> DCP2DMetadata:
        """Called by the scheduler at the end of ``schedule()``; resets the pending sets."""
        idle = scheduler_output.total_num_scheduled_tokens == 0 and not (
            self._fetches or self._ready or self._aborted or self._releases or self._dropped)
        if idle and self._was_idle:
            # Nothing to compute: vLLM keeps stepping only to poll transfers (held
            # blocks, remote KV). Unthrottled, that loop and the TP workers it drives
            # starve the API server on small machines (measured: new requests wait
            # ~10 s with TP=2 on 2 cores). A short sleep bounds the polling rate;
            # a worker whose fetch ended rings the bell to end it early (step_bell).
            # The first idle step after work does not sleep: it is often vLLM's
            # clean-up step for requests that just finished, and a request arriving
            # during a sleep there waited for it (issue 29: +20 ms after every
            # colocated request on a prefill). Bounded all the same: one full-speed
            # step per stretch of work.
            # After a ring the next idle step does not sleep either: under async
            # scheduling the rung step's output (the finished fetch) is processed
            # only after the next step is scheduled (step_bell).
            rung = False
            if self.bell is not None:
                rung = self.bell.sleep(IDLE_POLL_S)
            else:
                time.sleep(IDLE_POLL_S)
            idle = not rung
        self._was_idle = idle
        meta = DCP2DMetadata(fetches=self._fetches, ready=self._ready, aborted=self._aborted, releases=self._releases,
                             dropped=self._dropped, bell=self.bell.address if self.bell is not None else "")
        self._fetches, self._ready, self._aborted, self._releases, self._dropped = {}, {}, {}, {}, {}
        for req_id in meta.dropped:  # the workers learn of it in this step: its key may be reused now
            self.keys.unbind(req_id)
        if self.layer_split:
            meta.context_blocks = self._context_blocks(scheduler_output)
        for req_id in compat.preempted(scheduler_output):
            prompt_len = self._computed.pop(req_id, None)
            if prompt_len is not None:  # layer writes may have read its freed blocks
                meta.preempted[req_id] = self.keys.key(req_id, req_id)
                self._remote_decode[req_id] = prompt_len  # its re-prefill lists it in computing again
        if self.is_producer and self._remote_decode:
            for req_id, num_tokens in compat.scheduled_tokens(scheduler_output):
                prompt_len = self._remote_decode.get(req_id)
                if prompt_len is not None and num_tokens >= prompt_len:
                    del self._remote_decode[req_id]
                    self._computed[req_id] = prompt_len
                    meta.computing[req_id] = SendSpec(self._block_ids(req_id, prompt_len), prompt_len,
                                                      self.keys.key(req_id, req_id),
                                                      prompt_digest=self._digests.get(req_id, ""))
        if self.timeline is not None:
            meta.first_run = self.timeline.scheduled(req_id for req_id, _ in compat.scheduled_tokens(scheduler_output))
        return meta

    def get_stats(self) -> DCP2DStats | None:
        """Called by vLLM after it processed each step's output (``update_from_output``,
        via ``get_kv_connector_stats``): the stages the scheduler timed."""
        return None if self.timeline is None else self.timeline.take_stats()

    def shutdown(self) -> None:
        if self.bell is not None:
            self.bell.close()

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
        that finished before it was admitted (its fetch never started) is released
        on the producer."""
        self._remote_decode.pop(request.request_id, None)
        digest = self._digests.pop(request.request_id, None)
        if self.timeline is not None:
            self.timeline.forget(request.request_id)
        computed = self._computed.pop(request.request_id, None) is not None
        self.siblings.end(request.request_id)
        params = transfer_params(request.kv_transfer_params)
        refused = self._refused.pop(request.request_id, None)
        if self.is_consumer and params.get("do_remote_prefill") is True:  # still set: never admitted
            params["do_remote_prefill"] = False
            # Not while a sibling fetches the key (it needs the prefill's blocks); the digest is not
            # asked: vLLM's stand-in for a request its front end refused has a one-token prompt.
            if self.siblings.verdict(request, params, digest=False) is None:
                self._release(request, params)
        self.siblings.admitted(request.request_id)  # never admitted, or finished: its digest goes
        if refused is not None:  # the client learns why no decode can fetch it
            return False, {"error": f"kv_transfer_params refused: {refused}"}
        if not (self.is_producer and params.get("do_remote_decode") is True):
            return False, None
        has_blocks = any(block_ids)
        if not compat.finished_normally(request) or not has_blocks:
            key = self.keys.key(request.request_id, request.request_id)
            if computed and has_blocks:  # layer writes may read the blocks: free them once none can
                self._aborted[request.request_id] = key
                return True, None
            self._dropped[request.request_id] = key  # fetches may wait for it: they fail now
            return False, None
        num_tokens = request.num_prompt_tokens
        key = self.keys.key(request.request_id, request.request_id)
        if digest is None:
            digest = prompt_digest(**compat.prompt_inputs(request))
        self._ready[request.request_id] = SendSpec(self._pages(block_ids, num_tokens), num_tokens, key,
                                                   time.monotonic(), digest)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            KEY_FIELD: key,
            "remote_bootstrap_addr": self.bootstrap_addr,
            "remote_engine_id": self.engine_id,
            "remote_num_tokens": num_tokens,
            "remote_prompt_digest": digest,
            CLIENT_KEY_FIELD: params.get(CLIENT_KEY_FIELD, request.request_id),
        }
