"""The consumer (decode) role of a worker: its receiver, the fetches it starts,
the releases it sends, and what it reports back (ended fetches, vLLM's load errors,
quarantines).

Consumer TP rank = DCP rank ``d`` of ``dcp_size`` (vLLM's DCP group): its
``Receiver`` asks every producer CP rank for this rank's pages, written by
Mooncake straight into vLLM's DCP layout (page ``i`` -> local block
``block_ids[i // dcp_size]``). No copy or reshuffle happens on decode.
"""

from __future__ import annotations

import logging
import time

from vllm_dcp2d.connector.metadata import DCP2DMetadata, DCP2DWorkerMeta, FetchSpec
from vllm_dcp2d.connector.worker import KVCaches, WorkerBase, close_all
from vllm_dcp2d.reshard.layout import kv_head_range
from vllm_dcp2d.transfer.receiver import Fetch, Receiver

log = logging.getLogger(__name__)

__all__ = ["ConsumerWorker"]


class ConsumerWorker:
    """One consumer TP rank's side of the transfer (see module doc), over the rank's
    ``WorkerBase`` (shared with its producer role on a kv_both instance)."""

    def __init__(self, base: WorkerBase):
        self.base, self.cfg, self.engine_id = base, base.cfg, base.engine_id
        self.dcp_rank, self.dcp_size = base.dcp_rank, base.dcp_size
        self.tp_rank, self.tp_size, self.num_kv_heads = base.tp_rank, base.tp_size, base.num_kv_heads
        self.heads = kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)
        self.group_sharded, self.page_size = base.group_sharded, base.page_size
        self.stats, self.stats_file = base.stats, base.stats_file
        self.receiver: Receiver | None = None
        self._refused: list[tuple[str, FetchSpec, str]] = []  # fetches failed before they started: (req id, spec, why)
        self._quarantines: dict[int, tuple[Fetch, str, int]] = {}  # id(fetch) -> (fetch, req id, blocks)
        self._reported_quarantines = False  # the last step reported an age: report 0 once none is left
        self._meta = DCP2DWorkerMeta()
        self._first_run: list[str] = []  # the bound step's DCP2DMetadata.first_run
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()

    def start(self, kv: KVCaches) -> None:
        """Start this rank's receiver on the base's transport (``kv``'s memory registered).
        It rings the step bell whenever a fetch ended or a quarantine lifted: the idle
        step wakes."""
        self.receiver = Receiver(self.base.transport, kv.regions, kv.fingerprint, engine_id=self.engine_id,
                                 consumer_rank=self.tp_rank, consumer_size=self.tp_size,
                                 dcp_size=self.dcp_size, dcp_rank=self.dcp_rank,
                                 transfer_timeout_s=self.cfg.transfer_timeout_s,
                                 prefill_wait_s=self.cfg.prefill_wait_s,
                                 cancel_grace_s=self.cfg.cancel_grace_s, on_output=self.base.rope.ring,
                                 heads=self.heads, auth=self.base.auth, verify_kv=self.cfg.verify_kv,
                                 fence_s=self.cfg.fence_s, max_quarantined_blocks=self.cfg.max_quarantined_blocks,
                                 kv_bytes=kv.kv_bytes)
        log.info("DCP2D consumer: TP rank %d = DCP rank %d/%d, KV heads [%d, %d) of %d", self.tp_rank,
                 self.dcp_rank, self.dcp_size, self.heads.start, self.heads.stop, self.num_kv_heads)

    # -- per step -----------------------------------------------------------------------------

    def bind(self, meta) -> None:
        if isinstance(meta, DCP2DMetadata):
            self._first_run = meta.first_run

    def start_fetches(self, meta: DCP2DMetadata) -> None:
        """Start this step's fetches; tell the producers about requests this rank will not fetch."""
        for spec in meta.releases.values():
            self._release(spec.transfer_key, spec.bootstrap_addr, spec.num_tokens, spec.remote_engine_id,
                          spec.prompt_digest)
        for req_id, spec in meta.fetches.items():
            key = spec.transfer_key
            if spec.refused:  # nowhere to fetch from, or not what the wire takes: fail it now
                self._refused.append((req_id, spec, spec.refused))
                continue
            running = self.receiver.fetching(key)
            if running is not None:
                why = (f"transfer key {key!r} is already being fetched by request {running.tag} on "
                       f"this decode instance; each request needs its own (kv_transfer_params['remote_request_id'])")
            elif spec.remote_num_tokens is not None and spec.remote_num_tokens != spec.num_tokens:
                why = (f"length mismatch: the prefill computed remote_num_tokens={spec.remote_num_tokens} prompt "
                       f"tokens, this decode has {spec.num_tokens}")
            else:
                self.receiver.start(key, spec.bootstrap_addr, spec.block_ids, spec.first_page,
                                    transfer_timeout_s=spec.transfer_timeout_s, num_tokens=spec.num_tokens,
                                    remote_engine_id=spec.remote_engine_id, prompt_digest=spec.prompt_digest,
                                    tag=req_id)
                continue
            self._refused.append((req_id, spec, why))
            # no-op for the duplicate key
            self._release(key, spec.bootstrap_addr, spec.num_tokens, spec.remote_engine_id, spec.prompt_digest)

    def _release(self, key: str, bootstrap: str, num_tokens: int, remote_engine_id: str | None,
                 prompt_digest: str) -> None:
        """This rank will never fetch ``key``; the producer may free it
        (``Receiver.release``). Not while this instance fetches the same key for
        another request: that fetch still needs it."""
        if self.cfg.release_unfetched and self.receiver is not None and self.receiver.fetching(key) is None:
            self.receiver.release(key, bootstrap, num_tokens, remote_engine_id, prompt_digest)

    def pop_finished(self) -> tuple[set[str], set[str]]:
        """``(recving, failed)`` request ids since the last call: recving, their fetch
        ended on this rank, ok or failed (a failed one's blocks are in
        ``pop_load_errors``, unless it is in failed: failed as a whole, to be recomputed
        in fresh blocks while the old ones are quarantined)."""
        recving = set()
        if self.receiver is not None:
            # Lifted quarantines first: the receiver reports a fetch as done before it can
            # lift its quarantine, so every one drained here belongs to a fetch drained
            # just below or in an earlier call, whose quarantine is registered first.
            lifted = self.receiver.poll_lifted()
            for f in self.receiver.poll():
                recving.add(f.tag)
                if f.ok:
                    self._record(f)
                else:
                    self._fail(f.tag, f.transfer_key, f, [t.tolist() for t in f.block_ids], f.first_page)
                    self._release(f.transfer_key, f.bootstrap, f.num_tokens, f.remote_engine_id, f.prompt_digest)
            now = time.monotonic()
            for f in lifted:
                _, req_id, n = self._quarantines.pop(id(f))
                self._meta.lifted.add((req_id, self.tp_rank))
                self.stats.count("lifted", n)
                self.stats.record_stage("quarantine_seconds", now - f.started - f.seconds)
            if self._quarantines or self._reported_quarantines:
                ended = [f.started + f.seconds for f, _, _ in self._quarantines.values()]
                self.stats.record_level("quarantine_oldest_seconds", now - min(ended) if ended else 0.0)
                self._reported_quarantines = bool(self._quarantines)
        refused, self._refused = self._refused, []
        for req_id, spec, why in refused:
            recving.add(req_id)
            self._fail(req_id, spec.transfer_key, None, spec.block_ids, spec.first_page, why)
        failed, self._failed = self._failed, set()
        return recving, failed

    def pop_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_meta(self) -> DCP2DWorkerMeta:
        """Blocks to quarantine and quarantines lifted, failed fetches, and the bound
        step's ``first_run`` echoed as ``ran`` (the scheduler side times a request's
        first step by its own output: ``timeline``); a fresh one starts."""
        m, self._meta = self._meta, DCP2DWorkerMeta()
        m.ran, self._first_run = set(self._first_run), []
        return m

    def _record(self, f: Fetch) -> None:
        # how long the ended fetch waited for this step to report it (issue 29: the idle sleep)
        reported_after_s = max(0.0, time.monotonic() - f.started - f.seconds)
        self.stats.record_fetch(f.seconds, reported_after_s)
        for cp_rank, o in sorted(f.outcomes.items()):
            self.stats.record_path(cp_rank, self.dcp_rank, o.nbytes, o.descriptors, o.write_s, o.replicated_bytes)
            self.stats_file.write(transfer_key=f.transfer_key, cp_rank=cp_rank, cp_size=o.cp_size,
                                  replicated_bytes=o.replicated_bytes,
                                  draft_layers=self.receiver.fingerprint.draft_layers,
                                  tp_rank=self.tp_rank, dcp_rank=self.dcp_rank, dcp_size=self.dcp_size,
                                  layers=[o.layer_start, o.layer_end], pages=o.num_pages, page_size=self.page_size,
                                  bytes=o.nbytes, naive_bytes=o.naive_bytes, early_layers=o.early_layers,
                                  descriptors=o.descriptors, seconds=o.write_s, fetch_seconds=f.seconds,
                                  reported_after_seconds=reported_after_s, ok=True)

    def _fail(self, req_id: str, key: str, f: Fetch | None, block_ids: list[int], first_page: int,
              why: str = "") -> None:
        """The KV of ``req_id`` was not fetched (fetch ``f`` failed, or ``why``): vLLM
        fails or recomputes it (``kv_load_failure_policy``)."""
        expired = f is not None and f.error.timed_out
        self.stats.count("expired" if expired else "failed")
        if f is not None and f.error.corrupt:
            self.stats.count("corrupt")
        self._meta.failed_fetches.add(req_id)
        # Undefined from the first fetched page on, in every group.
        blocks = [b for ids, sharded in zip(block_ids, self.group_sharded)
                  for b in ids[first_page // (self.dcp_size if sharded else 1):]]
        reason = why or str(f.error)
        if f is not None and f.quarantined:
            # A prefill rank may still write into these blocks: recompute the whole
            # request in fresh blocks while the scheduler keeps these out of use.
            self._failed.add(req_id)
            self._meta.quarantine[(req_id, self.tp_rank)] = blocks
            self._quarantines[id(f)] = (f, req_id, len(blocks))
            self.stats.count("quarantined", len(blocks))
            what = f"{len(blocks)} blocks quarantined until cp ranks {sorted(f.quarantined)} settle"
        elif len(self.group_sharded) > 1:
            # vLLM 0.32 takes no block-level load errors with several KV cache groups
            # (its engine core stops): report the request, which kv_load_failure_policy
            # then fails or recomputes from scratch.
            self._failed.add(req_id)
            what = "reporting the request as failed (several KV cache groups: no block-level load errors)"
        else:
            self._load_errors.update(blocks)
            what = f"reporting {len(blocks)} blocks as load errors"
        self.stats_file.write(transfer_key=key, dcp_rank=self.dcp_rank, ok=False, expired=expired, reason=reason,
                              fetch_seconds=0.0 if f is None else f.seconds,
                              quarantined=len(blocks) if f is not None and f.quarantined else 0)
        log.warning("DCP2D: KV of request %s not fetched on DCP rank %d (%s); %s", req_id, self.dcp_rank, reason,
                    what)

    def identity(self) -> bytes:
        """The routing id this rank's receiver fetches under (kv_both: its own sender trusts it)."""
        return self.receiver.identity

    def check_alive(self) -> None:
        """Raise if this role's receiver thread died (``WorkerBase.check_alive``)."""
        self.base.check_alive(() if self.receiver is None else (self.receiver,))

    def close(self) -> None:
        close_all((self.receiver,))
        self.receiver = None
