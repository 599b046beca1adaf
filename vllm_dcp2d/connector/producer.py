"""The producer (prefill) role of a worker: its sender, the bootstrap server,
layer-split storage and the hand-over of finished requests.

Producer TP ranks that hold the same KV heads split the layers among
themselves (``layout.send_shard``): with one KV head (MQA, MLA) TP rank ``r`` is
layer-split CP rank ``r`` and its ``Sender`` serves only ``cp_layer_range(L,
cp_size, r)``; with KV heads sharded over TP every rank sends every layer of its
heads. So path ``(r, d)`` carries layers(r) x pages(d) of the heads both hold,
and nothing else. TP rank 0 also runs the instance's bootstrap server, where
every CP rank registers its side channel with the token rank 0 handed out.

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

The draft's KV is read after it is written (``hand_over``). A speculative draft (MTP,
EAGLE) writes its layers' KV for the prompt after the target's forward and sampling, in
the same step. On the GPU that is queued work, and a request reaches ``request_finished``
once the engine core saw its sampled token: on vLLM 0.32/0.33 (V1 runner) the output's
copy event is recorded after the drafter's kernels were queued
(``gpu_model_runner.sample_tokens`` proposes before ``AsyncGPUModelRunnerOutput``), but on
0.34 (Model Runner V2) ``AsyncOutput`` records it before the drafter runs
(``v1/worker/gpu/model_runner.py``, "so that it can overlap with speculator proposal"), so
the engine core may finish the request while the draft's KV writes still run. The hand-over
happens a step later in the same worker, after all of that step's kernels were queued on
the same stream: a CUDA event recorded there completes only after the draft's writes, and a
request goes to the sender (which reads its blocks from other threads, over Mooncake) only
once it has. The same on every version; on CPU everything ran before the hand-over.

When: on a GPU at ``start_load_kv``, which vLLM calls after the next step's forward was
launched (``kv_connector_model_runner_mixin``: async loads start "after the forward
launch"; before it in a step with sync loads): either way the event above is recorded
after the earlier step's queued work, which is what it must cover. On CPU the forward is not
a launch but the whole step (a prefill chunk of other prompts: ~2 s on 2 cores), and
every KV write of the finished request already ran, so the connector hands over as the
next step's metadata is bound, before its forward (``hands_over_at_bind``): a request
waited for one more step of the prefill before (BENCHMARKS.md, "Regression gate").
"""

from __future__ import annotations

import logging
import secrets
import time

from vllm_dcp2d.config import ConfigError
from vllm_dcp2d.connector.metadata import DCP2DMetadata, SendSpec, TransferKeys, bootstrap_addr
from vllm_dcp2d.connector.worker import KVCaches, WorkerBase, close_all
from vllm_dcp2d.reshard.layout import cp_layer_range, send_shard
from vllm_dcp2d.prefill import layer_split
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.http_bootstrap import HttpBootstrap, start_http_bootstrap
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.vllm_compat import connector_api as compat
from vllm_dcp2d.vllm_compat import dsa
from vllm_dcp2d.vllm_compat.kv_cache import graphs_capture_cache_writes, hook_cache_writes, storage_plan, unhook_cache_writes

log = logging.getLogger(__name__)

__all__ = ["ProducerWorker"]


class ProducerWorker:
    """One producer TP rank's side of the transfer (see module doc), over the rank's
    ``WorkerBase`` (shared with its consumer role on a kv_both instance)."""

    def __init__(self, base: WorkerBase):
        self.base = base
        vllm_config, cfg, tp_rank, tp_size = base.vllm_config, base.cfg, base.tp_rank, base.tp_size
        self.vllm_config, self.cfg, self.engine_id = vllm_config, cfg, base.engine_id
        self.tp_rank, self.tp_size, num_kv_heads = tp_rank, tp_size, base.num_kv_heads
        self.num_kv_heads, self.stats, self.stats_file = num_kv_heads, base.stats, base.stats_file
        self._one_host = base.single_host  # the handover is timed across processes
        try:  # the layer count does not matter for the check
            send_shard(1, num_kv_heads, tp_size, tp_rank, cfg.cp_size)
        except ValueError as e:
            raise ConfigError(f"kv_connector_extra_config['cp_size'] = {cfg.cp_size}: {e}") from None
        self.sender: Sender | None = None  # None on a TP rank that sends nothing (layout.send_shard)
        self.bootstrap: BootstrapServer | None = None  # TP rank 0
        self.http_bootstrap: HttpBootstrap | None = None
        self.layer_split: layer_split.LayerSplit | None = None
        self.layer_ids: dict[str, int] = {}
        self.keys = TransferKeys()  # request id <-> transfer key, until the sender finished it
        # transfer key -> (when its blocks went to the sender, seconds since request_finished)
        self._handed: dict[str, tuple[float, float | None]] = {}
        self._finished: set[str] = set()  # request ids finished without the sender
        self._fused: list[str] = []  # layers whose fused KV write dsa.hook_fused_writes hooked
        self._on_gpu = False  # the KV is on a GPU: writes are queued work (module doc)
        # requests handed over, with the CUDA event after their last KV write, not yet sent
        self._unwritten: list[tuple[object, str, SendSpec]] = []

    # -- start-up -----------------------------------------------------------------------------

    def prepare(self, kv: KVCaches) -> str:
        """Before the transport starts: layer-split storage, where KV writes are seen, and
        the instance's registration token (a collective: every TP rank calls it at the same
        point, while it registers its KV caches)."""
        self.start_layer_split(kv.tensors, kv.layer_ids, self.base.num_blocks, kv.num_layers)
        self.watch_kv_writes(kv.tensors)
        return self.token()

    def start_layer_split(self, kv_caches: dict, layer_ids: dict[str, int], num_blocks: int,
                          num_layers: int) -> None:
        """With layer-split storage (``vllm_compat.kv_cache`` laid the memory out in
        the engine core), check the layout and hook the transient-slot fill.
        ``kv_caches``: ``{layer_name: tensor}``; ``layer_ids``: layer name -> index."""
        self.layer_ids = layer_ids
        plan = storage_plan(self.vllm_config, num_layers)
        if plan is None:
            return
        owned = [n for n in kv_caches if plan.owner(layer_ids[n]) == self.tp_rank]
        others = [n for n in kv_caches if plan.owner(layer_ids[n]) != self.tp_rank]
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
        owners = {n: plan.owner(layer_ids[n]) for n in kv_caches}
        self.layer_split = layer_split.LayerSplit(compat.tp_cp_group(), owners, num_blocks)
        hook_cache_writes(self.vllm_config, list(kv_caches), self.layer_split.fill)
        r = cp_layer_range(num_layers, plan.cp_size, self.tp_rank) if self.tp_rank < plan.cp_size else range(0)
        log.info("DCP2D layer-split storage: TP rank %d stores layers [%d, %d) plus one transient slot for the "
                 "other %d (%d layer slots instead of %d)", self.tp_rank, r.start, r.stop, len(others),
                 len(owned) + 1, num_layers)

    def watch_kv_writes(self, kv_caches: dict) -> None:
        """Where this rank learns that KV is written. Per layer: layer pipelining sends each
        layer from ``save_kv_layer``; make it fire after the KV writes of DSA layers too, which
        vLLM's CUDA model writes in a fused kernel outside any connector call
        (``vllm_compat/dsa.py``); layers whose writes no connector call follows are sent after
        the prompt completes, logged once (TP rank 0). Per request: with KV on a GPU, a
        finished request goes to the sender after a CUDA event (module doc)."""
        self._on_gpu = next(iter(kv_caches.values())).is_cuda
        self._fused, unseen, refused = dsa.hook_fused_writes(self.vllm_config, list(kv_caches))
        if self.tp_rank != 0:
            return
        if self._fused:
            log.info("DCP2D layer pipelining: %d DSA layers write their KV inside a fused kernel; save_kv_layer "
                     "follows it on each (vllm_compat/dsa.py)", len(self._fused))
        if unseen:
            name, why = next(iter(unseen.items()))
            log.warning("DCP2D layer pipelining is off for %d layers (%s, ...: %s%s): no connector call follows "
                        "their KV write, so a fetch that waits for a request gets them after its prompt completes",
                        len(unseen), name, why, f"; {refused}" if refused else "")

    def token(self) -> str:
        """The instance's registration token, drawn by TP rank 0. A collective: every
        TP rank calls it at the same point (while it registers its KV caches)."""
        return compat.tp_broadcast(secrets.token_hex(16) if self.tp_rank == 0 else None)

    def start(self, kv: KVCaches, token: str) -> None:
        """Start the bootstrap server (TP rank 0) and this rank's sender, on the base's
        transport (``kv``'s memory registered)."""
        if self.tp_rank == 0:
            self.bootstrap = BootstrapServer(self.cfg.bootstrap_host, self.cfg.bootstrap_port, token, self.base.auth)
            self.http_bootstrap = start_http_bootstrap(self.cfg, self.bootstrap, self.engine_id)
        shard = send_shard(kv.num_layers, self.num_kv_heads, self.tp_size, self.tp_rank, self.cfg.cp_size)
        if shard is None:
            return
        cp_rank, cp_size, layers, heads = shard
        self.sender = Sender(self.base.transport, kv.regions, kv.fingerprint, engine_id=self.engine_id,
                             cp_rank=cp_rank, cp_size=cp_size, local_hostname=self.cfg.local_hostname,
                             bootstrap=bootstrap_addr(self.cfg), send_timeout_s=self.cfg.send_timeout_s,
                             claim_timeout_s=self.cfg.claim_timeout_s, staging_bytes=kv.staging_bytes,
                             layers=layers, heads=heads, token=token, auth=self.base.auth,
                             max_prefill_wait_s=self.cfg.max_prefill_wait_s, kv_bytes=kv.kv_bytes)
        log.info("DCP2D producer: TP rank %d = CP rank %d/%d sends layers [%d, %d) of KV heads [%d, %d) "
                 "via %s", self.tp_rank, cp_rank, cp_size, layers.start, layers.stop, heads.start,
                 heads.stop, self.sender.address)

    # -- per step -----------------------------------------------------------------------------

    def bind(self, meta) -> None:
        """The step's context blocks, which the layer-split fill broadcasts."""
        if self.layer_split is None:
            return
        blocks = meta.context_blocks if isinstance(meta, DCP2DMetadata) else None
        if isinstance(meta, DCP2DMetadata) and blocks is None:
            raise RuntimeError("layer-split storage is on in this worker, but the scheduler side sent no "
                               "context_blocks: the owners cannot fill the transient slots")
        self.layer_split.bind(blocks)

    def handle_preemptions(self, meta: DCP2DMetadata) -> None:
        """Attempts of requests preempted after their prompt completed start over
        (``Sender.restart``): a layer written, or being written, from the freed blocks
        counts for nothing, and every layer is written again from the re-prefill's blocks.
        Nothing waits here: writes of an attempt are ordered by its lock, so a stale write
        that is still reading lands before its replacement, and no answer goes out until
        the last one."""
        if self.sender is None:
            return
        for req_id, key in meta.preempted.items():
            n = self.sender.restart(key)
            log.info("DCP2D: request %s (transfer key %r) preempted after its prompt completed on CP rank %d; "
                     "%d waiting fetches rewrite every layer after its re-prefill", req_id, key, self.tp_rank, n)

    @property
    def hands_over_at_bind(self) -> bool:
        """Whether the connector hands a step's finished prefills over when it binds the
        step's metadata, before the forward (CPU), or at ``start_load_kv`` (GPU; module doc,
        "When")."""
        return not self._on_gpu

    def hand_over(self, meta: DCP2DMetadata) -> None:
        """Finished prefills go to the sender; aborted and dropped ones end there. Once per
        step's metadata (the connector calls it at bind or at ``start_load_kv``)."""
        for key in meta.dropped.values():
            if self.sender is not None:
                self.sender.drop(key)
        for req_id, key in meta.aborted.items():
            if self.sender is None:
                self._finished.add(req_id)
            else:
                self.keys.bind(req_id, key)
                self.sender.abort(key)
        # After every kernel of the step that finished them: the draft's KV writes included
        # (module doc, "The draft's KV"); None on CPU.
        event = compat.stream_event(self._on_gpu) if meta.ready and self.sender is not None else None
        for req_id, spec in meta.ready.items():
            if self.sender is None:
                self._finished.add(req_id)
                continue
            self.keys.bind(req_id, spec.transfer_key)
            self._unwritten.append((event, req_id, spec))
        self._send_written()

    def _send_written(self) -> None:
        """Give the sender the handed-over requests whose KV writes are done (their event
        completed; events complete in the order they were recorded, on one stream). Called
        every step, so a request waits at most one step past its writes."""
        while self._unwritten and (self._unwritten[0][0] is None or self._unwritten[0][0].query()):
            _, req_id, spec = self._unwritten.pop(0)
            now = time.monotonic()
            handover = now - spec.finished_at
            # CLOCK_MONOTONIC is one clock for the engine core and its workers on one host
            if not (spec.finished_at and self._one_host and handover >= 0):
                handover = None
            else:
                self.stats.record_stage("handover_seconds", handover)
            self._handed[spec.transfer_key] = (now, handover)
            self.sender.add_request(spec.transfer_key, spec.block_ids, spec.num_tokens, spec.prompt_digest)

    def save_kv_layer(self, layer_name: str, kv_layer, meta: DCP2DMetadata) -> None:
        """Fetches already waiting for a request whose prompt completes in this step
        (``meta.computing``) get layer ``layer_name`` (``kv_layer``, its KV cache tensor) now."""
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

    def pop_finished(self) -> set[str]:
        """Request ids whose blocks vLLM may free now (all decode ranks served,
        expired, released or aborted; no write reads them any more)."""
        sending, self._finished = self._finished, set()
        if self.sender is None:
            return sending
        for key, why in self.sender.pop_finished().items():
            req_id = self.keys.owner(key, key)
            self.keys.unbind(req_id)
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
        return sending

    def count_stats(self) -> None:
        if self.layer_split is not None:
            self.stats.count("prefix_broadcast_bytes", self.layer_split.take_bytes())
        if self.sender is not None:
            self.stats.count("refused_registrations", self.sender.consumers.take_refused())

    def check_alive(self) -> None:
        """Raise if a thread of this role died (``WorkerBase.check_alive``)."""
        self.base.check_alive(p for p in (self.sender, self.bootstrap) if p is not None)

    def trust(self, identity: bytes) -> None:
        """kv_both: this rank's own receiver (routing id ``identity``) may fetch from its sender."""
        self.sender.consumers.trust(identity)

    def close(self) -> None:
        """Unhook the KV writes, then close the sender and the bootstrap servers."""
        if self._fused:
            dsa.unhook_fused_writes(self.vllm_config, self._fused)
            self._fused = []
        if self.layer_split is not None:
            unhook_cache_writes(self.vllm_config, list(self.layer_split.owners))
            self.layer_split = None
        close_all((self.sender, self.http_bootstrap, self.bootstrap))
        self.sender = self.bootstrap = self.http_bootstrap = None
