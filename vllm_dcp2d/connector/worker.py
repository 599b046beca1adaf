"""Worker side of DCP2DConnector: one per TP rank, in vLLM's worker process.

Producer (prefill) TP ranks that hold the same KV heads split the layers among
themselves (``layout.send_shard``): with one KV head (MQA, MLA) TP rank ``r`` is
layer-split CP rank ``r`` and its ``Sender`` serves only ``cp_layer_range(L,
cp_size, r)``; with KV heads sharded over TP every rank sends every layer of its
heads. So path ``(r, d)`` carries layers(r) x pages(d) of the heads both hold,
and nothing else. TP rank 0 also runs the instance's bootstrap server, where
every CP rank registers its side channel with the token rank 0 handed out.

Consumer (decode) TP rank = DCP rank ``d`` of ``dcp_size`` (vLLM's DCP group):
its ``Receiver`` asks every producer CP rank for this rank's pages, written
by Mooncake straight into vLLM's DCP layout (page ``i`` -> local block
``block_ids[i // dcp_size]``). No copy or reshuffle happens on decode.

Hook order per engine step (vLLM 0.32 ``KVConnectorModelRunnerMixin``):
``handle_preemptions`` (before anything of the step runs) -> the step's
metadata is bound -> forward (``wait_for_layer_load`` / ``save_kv_layer``
around each attention layer) -> ``start_load_kv`` (after the forward: our loads
are asynchronous) -> ``wait_for_save`` -> ``get_finished`` ->
``get_block_ids_with_load_errors`` -> ``get_kv_connector_stats``.

Layer pipelining (``save_kv_layer``): decode ranks may ask for a request
before its prefill finished (a router that sends the decode request at once,
with the client's ``"transfer_id"`` as ``"remote_request_id"``; see
``vllm-dcp2d proxy --pipelined``). Such fetches wait at the sender, and in the
step that completes the prompt each layer goes to them right after it is
computed (``Sender.layer_ready``), overlapping the transfer with the rest of
the forward. ``request_finished`` then hands the whole request over; the
sender writes what is left and answers. With the sequential flow (decode asked
only after the prefill answered) nobody waits yet, so the whole request is
sent from ``request_finished`` on, on the sender's threads, overlapping the
next requests' compute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time

import numpy as np

from vllm_dcp2d.transfer.auth import Auth, load_secret
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.connector.discovery import Registration, registration
from vllm_dcp2d.transfer.http_bootstrap import HttpBootstrap, start_http_bootstrap
from vllm_dcp2d.config import ConfigError, DCP2DConfig
from vllm_dcp2d.transfer.messages import Fingerprint
from vllm_dcp2d.transfer.receiver import Fetch, Receiver
from vllm_dcp2d.connector.metadata import DCP2DMetadata, DCP2DWorkerMeta, LoadSpec
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile
from vllm_dcp2d.connector.step_bell import BellRope
from vllm_dcp2d.transfer.transport import MooncakeTransport
from vllm_dcp2d import page_format
from vllm_dcp2d.layout import cp_layer_range, kv_head_range, send_shard
from vllm_dcp2d.prefill import layer_split
from vllm_dcp2d.vllm_compat import connector_api as compat
from vllm_dcp2d.vllm_compat import instance
from vllm_dcp2d.vllm_compat.kv_cache import graphs_capture_cache_writes, hook_cache_writes, storage_plan, unhook_cache_writes

log = logging.getLogger(__name__)

__all__ = ["WorkerSide"]


class WorkerSide:
    """The worker-role half of DCP2DConnector (see module doc)."""

    def __init__(self, vllm_config, cfg: DCP2DConfig, engine_id: str, is_producer: bool, is_consumer: bool,
                 kv_cache_config=None):
        self.vllm_config, self.cfg, self.engine_id = vllm_config, cfg, engine_id
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        self.groups = compat.layer_groups(kv_cache_config)  # layer name -> KV cache group
        self.group_sharded = compat.group_sharded(kv_cache_config)
        self.page_size = compat.page_size(vllm_config)
        self.tp_rank, self.tp_size = compat.tp_rank_size()
        self.dcp_rank, self.dcp_size = compat.dcp_rank_size()
        self.num_kv_heads = compat.num_kv_heads(vllm_config)
        self.heads = kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)
        self._one_host = compat.single_host(vllm_config)  # the handover is timed across processes
        self.auth = Auth(load_secret(cfg.auth_secret_file))  # raises ConfigError for a bad secret file
        if is_producer:
            try:  # the layer count does not matter for the check
                send_shard(1, self.num_kv_heads, self.tp_size, self.tp_rank, cfg.cp_size)
            except ValueError as e:
                raise ConfigError(f"kv_connector_extra_config['cp_size'] = {cfg.cp_size}: {e}") from None
            if self.tp_rank == 0:
                cp, why = instance.cp_size(vllm_config)
                log.info("DCP2D producer: cp_size %d (%s)", cp, why)
        if is_consumer:
            compat.check_interleave(vllm_config)
        self.stats = DCP2DStats()
        self.stats_file = StatsFile(cfg.stats_file, "consumer" if is_consumer else "producer", engine_id)
        self.transport: MooncakeTransport | None = None
        self.bootstrap: BootstrapServer | None = None
        self.http_bootstrap: HttpBootstrap | None = None
        self.registration: Registration | None = None  # with vllm-router's discovery (TP rank 0)
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self.rope = BellRope("")  # rings the scheduler's step bell once a step names it
        self._loading: dict[str, tuple[str, list[int], int]] = {}  # transfer key -> (req id, blocks, first page)
        self._refused: list[tuple[str, LoadSpec, str]] = []  # loads failed before fetching: (req id, spec, why)
        self._quarantines: dict[int, tuple[Fetch, str, int]] = {}  # id(fetch) -> (fetch, req id, blocks)
        self._meta = DCP2DWorkerMeta()
        self._first_run: list[str] = []  # consumer: the bound step's DCP2DMetadata.first_run
        self._sending: dict[str, str] = {}  # producer: transfer key -> request id, until finished
        # producer: transfer key -> (when its blocks went to the senders, seconds since request_finished)
        self._handed: dict[str, tuple[float, float | None]] = {}
        self._finished_sending: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._kv_ptrs: dict[str, int] = {}
        self.layer_split: layer_split.LayerSplit | None = None

    # -- start-up -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Called once by the model runner after it allocated the paged KV
        (``{layer_name: tensor}``, see ``compat.kv_regions`` for the layouts).
        Registers the memory with Mooncake and starts this rank's sender/receiver."""
        self.layer_ids = compat.kv_layer_ids(self.vllm_config, kv_caches)
        regions, memory = compat.kv_regions(kv_caches, self.num_blocks, self.layer_ids, self.groups,
                                            self.group_sharded)
        self._kv_ptrs = {name: t.data_ptr() for name, t in kv_caches.items()}
        layers = np.sort(regions.layer_ids)
        if not np.array_equal(layers, np.arange(layers.size)):
            raise ValueError(f"KV layers must be 0..L-1, got {layers.tolist()}")
        first = next(iter(kv_caches.values()))
        fingerprint = Fingerprint(
            draft_layers=len({self.layer_ids[n] for n in kv_caches if compat.is_draft_layer(self.vllm_config, n)}),
            model=str(self.vllm_config.model_config.model), num_layers=int(layers.size),
            page_size=self.page_size,
            kv_dtype=page_format.kv_dtype_name(self.vllm_config.cache_config.cache_dtype, first.dtype),
            kv_scales=compat.kv_scales(self.vllm_config, self.layer_ids),
            page_bytes=int(regions.page_bytes.sum()),
            layout=compat.kv_layout(self.vllm_config, kv_caches, self.num_blocks, self.layer_ids),
            model_config=compat.model_config_id(self.vllm_config), num_kv_heads=self.num_kv_heads)
        if self.is_producer:
            self._start_layer_split(kv_caches, int(layers.size))
            # a collective: every TP rank registers its KV caches at this point
            token = compat.tp_broadcast(secrets.token_hex(16) if self.tp_rank == 0 else None)
        else:
            token = ""
        # The gather and the checksum read KV through numpy: host memory only.
        host_kv = first.device.type == "cpu"
        if self.is_consumer and self.cfg.verify_kv and not host_kv:
            raise ConfigError("kv_connector_extra_config['verify_kv'] = True: this decode's KV is in "
                              f"{first.device.type} memory; verify_kv reads host memory only (set it false)")
        staging = self.cfg.send_staging_mib << 20 if host_kv else 0
        with _unpinned():
            self._start(regions, memory, fingerprint, int(layers.size), staging, token, host_kv)

    def _start_layer_split(self, kv_caches: dict, num_layers: int) -> None:
        """With layer-split storage (``vllm_compat.kv_cache`` laid the memory out in
        the engine core), check the layout and hook the transient-slot fill."""
        plan = storage_plan(self.vllm_config, num_layers)
        if plan is None:
            return
        owned = [n for n in kv_caches if plan.owner(self.layer_ids[n]) == self.tp_rank]
        others = [n for n in kv_caches if plan.owner(self.layer_ids[n]) != self.tp_rank]
        ptrs = {n: t.data_ptr() for n, t in kv_caches.items()}
        transient = {ptrs[n] for n in others}
        if len(transient) != 1 or len({ptrs[n] for n in owned} | transient) != len(owned) + 1:
            raise RuntimeError(f"layer-split storage is configured (layer_split={self.cfg.layer_split!r}), but the KV "
                               f"cache of TP rank {self.tp_rank} is not laid out for it: {len(owned)} owned layers "
                               f"and {len(transient)} distinct regions for the {len(others)} others (expected 1). "
                               f"Was vllm_dcp2d's plugin loaded in the engine core?")
        why = graphs_capture_cache_writes(self.vllm_config)
        if why is not None:
            raise RuntimeError(f"layer-split storage fills each layer's transient slot from a hook on its KV-cache "
                               f"write, but {why} (or set layer_split='off').")
        owners = {n: plan.owner(self.layer_ids[n]) for n in kv_caches}
        self.layer_split = layer_split.LayerSplit(compat.tp_cp_group(), owners, self.num_blocks)
        hook_cache_writes(self.vllm_config, list(kv_caches), self.layer_split.fill)
        r = cp_layer_range(num_layers, plan.cp_size, self.tp_rank) if self.tp_rank < plan.cp_size else range(0)
        log.info("DCP2D layer-split storage: TP rank %d stores layers [%d, %d) plus one transient slot for the "
                 "other %d (%d layer slots instead of %d)", self.tp_rank, r.start, r.stop, len(others),
                 len(owned) + 1, num_layers)

    def _start(self, regions, memory, fingerprint, num_layers: int, staging_bytes: int, token: str,
               host_kv: bool) -> None:
        # A producer's engine only writes: it may be replaced after a failed write.
        self.transport = MooncakeTransport(self.cfg.local_hostname, protocol=self.cfg.protocol,
                                           renew_on_failure=self.is_producer and not self.is_consumer)
        for addr, nbytes in memory:
            self.transport.register(addr, nbytes)
        boot = f"tcp://{self.cfg.bootstrap_host}:{self.cfg.bootstrap_port}"
        if self.is_producer:
            if self.tp_rank == 0:
                self.bootstrap = BootstrapServer(self.cfg.bootstrap_host, self.cfg.bootstrap_port, token, self.auth)
                self.http_bootstrap = start_http_bootstrap(self.cfg, self.bootstrap, self.engine_id)
            shard = send_shard(num_layers, self.num_kv_heads, self.tp_size, self.tp_rank, self.cfg.cp_size)
            if shard is not None:
                cp_rank, cp_size, layers, heads = shard
                self.sender = Sender(self.transport, regions, fingerprint, engine_id=self.engine_id,
                                     cp_rank=cp_rank, cp_size=cp_size, host=self.cfg.local_hostname,
                                     bootstrap=boot, expiry_s=self.cfg.send_timeout_s,
                                     claim_s=self.cfg.claim_timeout_s, staging_bytes=staging_bytes,
                                     layers=layers, heads=heads, token=token, auth=self.auth,
                                     max_wait_s=self.cfg.max_prefill_wait_s, host_kv=host_kv)
                log.info("DCP2D producer: TP rank %d = CP rank %d/%d sends layers [%d, %d) of KV heads [%d, %d) "
                         "via %s", self.tp_rank, cp_rank, cp_size, layers.start, layers.stop, heads.start,
                         heads.stop, self.sender.address)
        if self.is_consumer:
            self.receiver = Receiver(self.transport, regions, fingerprint, engine_id=self.engine_id,
                                     consumer_rank=self.tp_rank, consumer_size=self.tp_size,
                                     dcp_size=self.dcp_size, dcp_rank=self.dcp_rank,
                                     timeout_s=self.cfg.transfer_timeout_s, wait_s=self.cfg.prefill_wait_s,
                                     cancel_grace_s=self.cfg.cancel_grace_s, on_output=self._ring,
                                     heads=self.heads, auth=self.auth, verify=self.cfg.verify_kv)
            log.info("DCP2D consumer: TP rank %d = DCP rank %d/%d, KV heads [%d, %d) of %d", self.tp_rank,
                     self.dcp_rank, self.dcp_size, self.heads.start, self.heads.stop, self.num_kv_heads)
        if self.tp_rank == 0:  # last: the router may send requests from now on
            self.registration = registration(self.cfg, self.is_producer, self.is_consumer)

    # -- per step -----------------------------------------------------------------------------

    def bind(self, meta) -> None:
        """Called every step with its metadata, before the forward (None after it):
        the context blocks the layer-split fill broadcasts, the step bell to ring."""
        if isinstance(meta, DCP2DMetadata):
            self._first_run = meta.first_run
        if isinstance(meta, DCP2DMetadata) and meta.bell != self.rope.address:
            self.rope.close()
            self.rope = BellRope(meta.bell)
        if self.layer_split is not None:
            blocks = meta.context_blocks if isinstance(meta, DCP2DMetadata) else None
            if isinstance(meta, DCP2DMetadata) and blocks is None:
                raise RuntimeError("layer-split storage is on in this worker, but the scheduler side sent no "
                                   "context_blocks: the owners cannot fill the transient slots")
            self.layer_split.bind(blocks)

    def _ring(self) -> None:
        self.rope.ring()

    def handle_preemptions(self, meta) -> None:
        """Called by the model runner first thing in every step, before the forward
        that may overwrite the blocks of requests preempted while it was scheduled.
        Producer: their attempts start over (``Sender.restart``): a layer written, or
        being written, from the freed blocks counts for nothing, and every layer is
        written again from the re-prefill's blocks. Nothing waits here: writes of an
        attempt are ordered by its lock, so a stale write that is still reading
        lands before its replacement, and no answer goes out until the last one."""
        self._check_threads()
        if self.sender is None or not isinstance(meta, DCP2DMetadata):
            return
        for req_id, key in meta.preempted.items():
            n = self.sender.restart(key)
            log.info("DCP2D: request %s (transfer key %r) preempted after its prompt completed on CP rank %d; "
                     "%d waiting fetches rewrite every layer after its re-prefill", req_id, key, self.tp_rank, n)

    def _check_threads(self) -> None:
        """A connector thread that died fails the engine (so its health check fails)
        instead of leaving requests waiting for it forever."""
        for part in (self.sender, self.receiver, self.bootstrap):
            if part is not None and part.failed:
                raise RuntimeError(f"DCP2D {type(part).__name__} of TP rank {self.tp_rank} stopped: {part.failed}")

    def start_load_kv(self, meta) -> None:
        """Called by the model runner every step with this step's metadata bound.
        Producer: hands finished prefills to the sender, aborts aborted ones.
        Consumer: starts fetches; tells the producers about requests it will not fetch."""
        for key in meta.dropped.values():
            if self.sender is not None:
                self.sender.drop(key)
        for req_id, key in meta.aborted.items():
            if self.sender is None:  # a TP rank that sends nothing (layout.send_shard)
                self._finished_sending.add(req_id)
            else:
                self._sending[key] = req_id
                self.sender.abort(key)
        for req_id, spec in meta.ready.items():
            if self.sender is None:
                self._finished_sending.add(req_id)
            else:
                self._sending[spec.transfer_key] = req_id
                now = time.monotonic()
                handover = now - spec.finished_at
                # CLOCK_MONOTONIC is one clock for the engine core and its workers on one host
                if not (spec.finished_at and self._one_host and handover >= 0):
                    handover = None
                else:
                    self.stats.record_stage("handover_seconds", handover)
                self._handed[spec.transfer_key] = (now, handover)
                self.sender.add_request(spec.transfer_key, spec.block_ids, spec.num_tokens, spec.prompt_digest)
        for spec in meta.releases.values():
            self._release(spec.transfer_key, spec.bootstrap_addr, spec.num_tokens, spec.remote_engine_id,
                          spec.prompt_digest)
        for req_id, spec in meta.loads.items():
            if self.receiver is None:
                raise RuntimeError(f"request {req_id} asks to load KV but this instance is not a kv_consumer")
            key = spec.transfer_key
            if spec.refused:  # nowhere to fetch from, or not what the wire takes: fail it now
                self._refused.append((req_id, spec, spec.refused))
                continue
            if key in self._loading:
                why = (f"transfer key {key!r} is already being fetched by request {self._loading[key][0]} on "
                       f"this decode instance; each request needs its own (kv_transfer_params['remote_request_id'])")
            elif spec.remote_num_tokens is not None and spec.remote_num_tokens != spec.num_tokens:
                why = (f"length mismatch: the prefill computed remote_num_tokens={spec.remote_num_tokens} prompt "
                       f"tokens, this decode has {spec.num_tokens}")
            else:
                self._loading[key] = (req_id, spec.block_ids, spec.first_page)
                self.receiver.start(key, spec.bootstrap_addr, spec.block_ids, spec.first_page,
                                    timeout_s=spec.timeout_s, num_tokens=spec.num_tokens,
                                    remote_engine_id=spec.remote_engine_id, prompt_digest=spec.prompt_digest)
                continue
            self._refused.append((req_id, spec, why))
            # no-op for the duplicate key
            self._release(key, spec.bootstrap_addr, spec.num_tokens, spec.remote_engine_id, spec.prompt_digest)

    def _release(self, key: str, bootstrap: str, num_tokens: int, remote_engine_id: str | None,
                 prompt_digest: str) -> None:
        """Consumer: this rank will never fetch ``key``; the producer may free it
        (``Receiver.release``). Not while this instance fetches the same key for
        another request: that fetch still needs it."""
        if self.cfg.release_unfetched and self.receiver is not None and key not in self._loading:
            self.receiver.release(key, bootstrap, num_tokens, remote_engine_id, prompt_digest)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """Called by the model runner after every step (``get_transfer_results``).
        Returns three sets of request ids:

        * sending: the producer may free their blocks (all decode ranks served,
          expired or aborted; no write reads them any more);
        * recving: their fetch ended on this consumer rank, ok or failed. A failed
          one's blocks are in ``get_block_ids_with_load_errors``, unless it is in
        * failed: failed as a whole, to be recomputed in fresh blocks while the
          old ones are quarantined (``build_worker_meta``)."""
        self._check_threads()
        sending, recving = self._finished_sending, set()
        self._finished_sending = set()
        if self.sender is not None:
            for key, why in self.sender.pop_finished().items():
                req_id = self._sending.pop(key, key)
                sending.add(req_id)
                handed, handover = self._handed.pop(key, (None, None))
                held = None if handed is None else time.monotonic() - handed
                if held is not None:
                    self.stats.record_held(held)
                # side "producer" on a kv_both instance too
                self.stats_file.write(side="producer", request_id=req_id, transfer_key=key, cp_rank=self.tp_rank,
                                      event=why, held_seconds=held, handover_seconds=handover)
                if why == "released":
                    log.debug("DCP2D: request %s released by its decode ranks on CP rank %d", req_id, self.tp_rank)
                if why in ("expired", "unclaimed"):
                    self.stats.count("expired")
                    after = (f"claim_timeout_s={self.cfg.claim_timeout_s:.0f} s without a decode rank asking for it"
                             if why == "unclaimed" else f"send_timeout_s={self.cfg.send_timeout_s:.0f} s")
                    log.warning("DCP2D: request %s %s on CP rank %d after %s; blocks freed", req_id, why,
                                self.tp_rank, after)
        if self.receiver is not None:
            # Lifted quarantines first: the receiver reports a fetch as done before it can
            # lift its quarantine, so every one drained here belongs to a fetch drained
            # just below or in an earlier call, whose quarantine is registered first.
            lifted = self.receiver.poll_lifted()
            for f in self.receiver.poll():
                req_id, block_ids, first_page = self._loading.pop(f.transfer_key, (None, None, 0))
                if req_id is None:
                    continue
                recving.add(req_id)
                if f.ok:
                    self._record(f)
                else:
                    self._fail(req_id, f.transfer_key, f, block_ids, first_page)
                    self._release(f.transfer_key, f.bootstrap, f.num_tokens, f.remote_engine_id, f.prompt_digest)
            for f in lifted:
                _, req_id, n = self._quarantines.pop(id(f))
                self._meta.lifted.add((req_id, self.tp_rank))
                self.stats.count("lifted", n)
        refused, self._refused = self._refused, []
        for req_id, spec, why in refused:
            recving.add(req_id)
            self._fail(req_id, spec.transfer_key, None, spec.block_ids, spec.first_page, why)
        failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def build_worker_meta(self) -> DCP2DWorkerMeta | None:
        """Called by the model runner after ``get_finished``, with the step's metadata
        still bound: blocks to quarantine and quarantines lifted, failed loads, and
        the requests whose first step on loaded KV this was, for the scheduler side."""
        self._meta.ran, self._first_run = set(self._first_run), []
        m = self._meta
        if not (m.quarantine or m.lifted or m.ran or m.failed_loads):
            return None
        self._meta = DCP2DWorkerMeta()
        return m

    def _record(self, f) -> None:
        # how long the ended fetch waited for this step to report it (issue 29: the idle sleep)
        reported_after_s = max(0.0, time.monotonic() - f.started - f.seconds)
        self.stats.record_fetch(f.seconds, reported_after_s)
        for cp_rank, o in sorted(f.outcomes.items()):
            self.stats.record_path(cp_rank, self.dcp_rank, o.nbytes, o.descriptors, o.write_s, o.replicated_bytes)
            self.stats_file.write(transfer_key=f.transfer_key, cp_rank=cp_rank, cp_size=o.cp_size,
                                  replicated_bytes=o.replicated_bytes,
                                  draft_layers=self.receiver.fingerprint.draft_layers,
                                  tp_rank=self.tp_rank, dcp_rank=self.dcp_rank, dcp_size=self.dcp_size, layers=[o.layer_start, o.layer_end],
                                  pages=o.num_pages, page_size=self.page_size, bytes=o.nbytes, naive_bytes=o.naive_bytes, early_layers=o.early_layers,
                                  descriptors=o.descriptors, seconds=o.write_s, fetch_seconds=f.seconds,
                                  reported_after_seconds=reported_after_s, ok=True)

    def _fail(self, req_id: str, key: str, f: Fetch | None, block_ids: list[int], first_page: int,
              why: str = "") -> None:
        """The KV of ``req_id`` did not load (fetch ``f`` failed, or ``why``): vLLM
        fails or recomputes it (``kv_load_failure_policy``)."""
        expired = f is not None and f.error.timed_out
        self.stats.count("expired" if expired else "failed")
        if f is not None and f.error.corrupt:
            self.stats.count("corrupt")
        self._meta.failed_loads.add(req_id)
        # Undefined from the first fetched page on, in every group.
        blocks = [b for ids, sharded in zip(block_ids, self.group_sharded)
                  for b in ids[first_page // (self.dcp_size if sharded else 1):]]
        reason = why or str(f.error)
        if f is not None and f.quarantined:
            # A prefill rank may still write into these blocks: recompute the whole
            # request in fresh blocks while the scheduler keeps these out of use.
            self._failed_recving.add(req_id)
            self._meta.quarantine[(req_id, self.tp_rank)] = blocks
            self._quarantines[id(f)] = (f, req_id, len(blocks))
            self.stats.count("quarantined", len(blocks))
            what = f"{len(blocks)} blocks quarantined until cp ranks {sorted(f.quarantined)} settle"
        elif len(self.group_sharded) > 1:
            # vLLM 0.32 takes no block-level load errors with several KV cache groups
            # (its engine core stops): report the request, which kv_load_failure_policy
            # then fails or recomputes from scratch.
            self._failed_recving.add(req_id)
            what = "reporting the request as failed (several KV cache groups: no block-level load errors)"
        else:
            self._load_errors.update(blocks)
            what = f"reporting {len(blocks)} blocks as load errors"
        self.stats_file.write(transfer_key=key, dcp_rank=self.dcp_rank, ok=False, expired=expired, reason=reason,
                              fetch_seconds=0.0 if f is None else f.seconds,
                              quarantined=len(blocks) if f is not None and f.quarantined else 0)
        log.warning("DCP2D: KV of request %s not loaded on DCP rank %d (%s); %s", req_id, self.dcp_rank, reason,
                    what)

    def save_kv_layer(self, layer_name: str, kv_layer, meta) -> None:
        """Called by the attention layer right after it computed (and cached) the KV
        of ``layer_name`` in this step's forward (``meta``: this step's metadata).
        Producer: fetches already waiting for a request whose prompt completes in this
        step (``meta.computing``) get this layer now."""
        ptr = self._kv_ptrs.get(layer_name)
        if ptr is not None and kv_layer.data_ptr() != ptr:
            raise RuntimeError(f"KV cache of {layer_name} moved from {ptr:#x} (registered with Mooncake) to "
                               f"{kv_layer.data_ptr():#x}; transfers would write freed memory")
        if self.sender is None:
            return
        waiting = [spec for spec in meta.computing.values() if self.sender.waiting(spec.transfer_key)]
        if not waiting:  # the usual case: nobody asked before the prefill finished
            return
        layer = self.layer_ids[layer_name]
        # On GPU the KV write is queued on the compute stream: the sender waits for it.
        event = compat.record_event(kv_layer)
        for spec in waiting:
            self.sender.layer_ready(spec.transfer_key, layer, spec.block_ids, spec.num_tokens, event,
                                    spec.prompt_digest)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by the model runner after ``get_finished``; returns and clears."""
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> DCP2DStats | None:
        if self.layer_split is not None:
            self.stats.count("prefix_broadcast_bytes", self.layer_split.take_bytes())
        if self.transport is not None:
            for name, n in self.transport.take_counts().items():
                self.stats.count(name, n)
        self.stats.count("unauthenticated", self.auth.take_refused())
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self.layer_split is not None:
            unhook_cache_writes(self.vllm_config, list(self.layer_split.owners))
            self.layer_split = None
        for part in (self.registration, self.receiver, self.sender, self.http_bootstrap, self.bootstrap):
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # shutting down: report and go on
                    log.warning("DCP2D: closing %s failed: %s", type(part).__name__, e)
        if self.transport is not None:
            self.transport.close()
        self.rope.close()
        self.registration = self.receiver = self.sender = self.bootstrap = self.transport = None


@contextlib.contextmanager
def _unpinned():
    """Let the threads started inside (Mooncake's engine, ZMQ's I/O thread, the
    sender/receiver threads) run on every CPU of the machine.

    vLLM's CPU worker pins its process to its OpenMP cores (e.g.
    ``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one core per TP rank), and new threads
    inherit the creating thread's affinity. Pinned there, the connector's I/O
    competed with the worker's spinning compute threads and, on a loaded 2-core
    machine, a decode rank's ZMQ handshake with a prefill rank timed out. The
    calling thread's own affinity is restored on exit.
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    pinned = os.sched_getaffinity(0)  # pid 0: the calling thread
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # e.g. a cgroup cpuset narrower than cpu_count: keep the pinning
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
