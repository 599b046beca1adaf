"""``DCP2DConnector``: vLLM KV connector for page-level 2D KV resharding.

Prefill instances (``kv_role="kv_producer"``) run layer-split: TP rank ``r``
sends only its layers. Decode instances (``kv_role="kv_consumer"``) run DCP:
each DCP rank receives only its pages, written straight into vLLM's DCP
layout. The DCP size and rank travel with every request, so decode instances
with different DCP sizes share one prefill instance.

vLLM builds this class twice per instance: once with ``role=SCHEDULER`` (engine
core), where it dispatches to ``scheduler.SchedulerSide``, and once per worker with
``role=WORKER``, where it drives the worker's roles itself: ``producer.ProducerWorker``
and ``consumer.ConsumerWorker`` (a kv_both instance has both) over the rank's
``worker.WorkerBase`` (transport, auth, stats, step bell). Settings come from
``kv_connector_extra_config`` (``config.py``; an unknown key or a bad value
stops start-up).

    vllm serve MODEL --kv-transfer-config \\
      '{"kv_connector":"DCP2DConnector","kv_role":"kv_producer",
        "kv_connector_extra_config":{"bootstrap_port":17500}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dcp2d.config import parse_extra_config
from vllm_dcp2d.connector.prom import DCP2DPromMetrics
from vllm_dcp2d.connector.metadata import DCP2DMetadata
from vllm_dcp2d.connector.scheduler import SchedulerSide
from vllm_dcp2d.connector.stats import DCP2DStats
from vllm_dcp2d.vllm_compat import connector_api as compat

if TYPE_CHECKING:
    import torch

__all__ = ["DCP2DConnector"]


class DCP2DConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    """Declares ``SupportsHMA``: it moves any number of KV cache groups (a
    speculative draft's replicated group beside the target's), so vLLM keeps
    its hybrid allocator and calls ``request_finished_all_groups``."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        """Called by vLLM when it builds the config, if its CUDA graph mode has FULL graphs.
        True makes vLLM use piecewise graphs, which run each layer's KV-cache write (and the
        layer-split fill hooked on it) outside the graphs. This sees only the extra config,
        not the role, so it asks only when layer_split is "on"; with "auto", a prefill under
        FULL graphs stores every layer and logs the flag to pass."""
        return extra_config.get("layer_split") == "on"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """Called by vLLM 0.33 at config time when sleep mode is on (0.32 has no such
        hook). False: the Mooncake registrations and the side channels' published
        addresses point at the KV memory of the first allocation; sleep/wake remaps
        it, and a prefill would then write into memory that is no longer the decode's
        KV. vLLM refuses ``--enable-sleep-mode`` with this connector, naming it."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """Called by vLLM 0.34 at config time (0.32 and 0.33 have no such hook): the
        workers register the KV cache with Mooncake (RDMA), so vLLM's extensible KV
        cache backs each segment with one physical allocation. The registration stays
        valid: vLLM builds the worker connector only after the cache's final commit
        (docs/connector.md, "Resizable KV cache")."""
        return compat.kv_cache_registers()

    def __init__(self, vllm_config, role, kv_cache_config=None):
        compat.base_init(self, vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        cfg = parse_extra_config(kv.kv_connector_extra_config)
        is_producer = kv.kv_role in ("kv_producer", "kv_both")
        is_consumer = kv.kv_role in ("kv_consumer", "kv_both")
        self._scheduler: SchedulerSide | None = None
        self._base = self._producer = self._consumer = None  # worker role
        self._handed_meta = None  # the step's metadata whose finished prefills went to the sender
        compat.sleep_between_shm_polls(cfg.cpu_poll_sleep_us)
        if role == compat.KVConnectorRole.SCHEDULER:
            if is_consumer:
                compat.check_interleave(vllm_config, resolved=False)
            self._scheduler = SchedulerSide(vllm_config, cfg, kv.engine_id, is_producer, is_consumer,
                                            layer_split=compat.layer_split_applies(vllm_config, kv_cache_config))
        else:  # Mooncake only in workers
            from vllm_dcp2d.connector.consumer import ConsumerWorker
            from vllm_dcp2d.connector.producer import ProducerWorker
            from vllm_dcp2d.connector.worker import WorkerBase
            self._base = WorkerBase.of(vllm_config, cfg, kv.engine_id, is_producer, is_consumer, kv_cache_config)
            self._producer = ProducerWorker(self._base) if is_producer else None
            self._consumer = ConsumerWorker(self._base) if is_consumer else None

    # ---- scheduler side (engine core process) ----

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> DCP2DMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        """Called by the scheduler (``has_requests``) when deciding whether the engine
        keeps stepping: yes while blocks are quarantined or releases wait to go out."""
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- worker side (one per TP rank; hook order: ``worker`` module doc) ----

    def _roles(self) -> tuple:
        return tuple(r for r in (self._producer, self._consumer) if r is not None)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once by the model runner after it allocated the paged KV
        (``{layer_name: tensor}``, see ``compat.kv_regions`` for the layouts).
        Registers the memory with Mooncake and starts this rank's roles."""
        from vllm_dcp2d.transfer.transport import unpinned

        kv = self._base.kv_caches(kv_caches)
        token = self._producer.prepare(kv) if self._producer is not None else ""
        # vLLM's CPU worker pins this thread to its cores; the threads started here must not inherit it
        with unpinned():
            self._base.open_transport(kv)
            if self._producer is not None:
                self._producer.start(kv, token)
            if self._consumer is not None:
                self._consumer.start(kv)
            if self._producer is not None and self._consumer is not None:
                # kv_both: this rank's receiver may fetch from its own sender, into the same engine's memory
                self._producer.trust(self._consumer.identity())
            self._base.announce()

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Called by the model runner before each step's forward: the step bell to ring,
        the context blocks the layer-split fill broadcasts, the step's ``first_run``; on CPU
        the finished prefills go to the sender now (``ProducerWorker.hands_over_at_bind``)."""
        super().bind_connector_metadata(connector_metadata)
        self._bind(connector_metadata)
        if self._producer is not None and self._producer.hands_over_at_bind:
            self._hand_over(connector_metadata)

    def _hand_over(self, meta) -> None:
        """``ProducerWorker.hand_over``, once per step's metadata (vLLM binds it once per
        step; a second call with the same object must not hand a request over twice)."""
        if meta is not self._handed_meta:
            self._handed_meta = meta
            self._producer.hand_over(meta)

    def clear_connector_metadata(self) -> None:
        """Called by the model runner after each step."""
        super().clear_connector_metadata()
        self._bind(None)

    def _bind(self, meta) -> None:
        if self._base is not None:
            self._base.bind(meta)
        for role in self._roles():
            role.bind(meta)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Called by the model runner at the start of every step, before anything of
        the step's forward runs: requests preempted while this step was scheduled
        lose the layers written from their (now free) blocks (``ProducerWorker.handle_preemptions``)."""
        for role in self._roles():
            role.check_alive()
        if self._producer is not None and isinstance(kv_connector_metadata, DCP2DMetadata):
            self._producer.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Called by the model runner every step with this step's metadata bound.
        Producer on a GPU: hands finished prefills to the sender, aborts aborted ones (on CPU
        that happened at ``bind_connector_metadata``; once per step's metadata either way).
        Consumer: starts fetches; tells the producers about requests it will not fetch."""
        meta = self._get_connector_metadata()
        if self._producer is not None:
            self._hand_over(meta)
        if self._consumer is not None:
            self._consumer.start_fetches(meta)
        elif meta.fetches:
            req_id = next(iter(meta.fetches))
            raise RuntimeError(f"request {req_id} asks to fetch KV but this instance is not a kv_consumer")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Fetches are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS
        until every page arrived): nothing to wait for inside the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Called by each attention layer right after it computed (and cached) the KV of
        ``layer_name`` (``kv_layer``, its KV cache tensor): layer pipelining, see
        ``producer``. The writes run on the sender's threads."""
        self._base.check_kv(layer_name, kv_layer)
        if self._producer is not None:
            self._producer.save_kv_layer(layer_name, kv_layer, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        """The sender reads the blocks of finished requests, which vLLM keeps
        until ``get_finished`` reports them: nothing to wait for per step."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> compat.KVConnectorTransferResults:
        """Called by the model runner after every step. Three sets of request ids:

        * sending: the producer may free their blocks (all decode ranks served,
          expired or aborted; no write reads them any more);
        * recving: their fetch ended on this consumer rank, ok or failed. A failed
          one's blocks are in ``get_block_ids_with_load_errors``, unless it is in
        * failed: failed as a whole, to be recomputed in fresh blocks while the
          old ones are quarantined (``build_connector_worker_meta``)."""
        for role in self._roles():
            role.check_alive()
        sending = set() if self._producer is None else self._producer.pop_finished()
        recving, failed = (set(), set()) if self._consumer is None else self._consumer.pop_finished()
        return compat.KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                                 failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.32 calls ``get_transfer_results`` instead; kept for the abstract API."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def build_connector_worker_meta(self):
        """Called by the model runner after ``get_finished``, with the step's metadata
        still bound: blocks to quarantine and quarantines lifted, failed fetches, and
        the requests whose first step on fetched KV this was, for the scheduler side."""
        if self._consumer is None:
            return None
        m = self._consumer.take_meta()
        return m if (m.quarantine or m.lifted or m.ran or m.failed_fetches) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by the model runner after ``get_finished``; returns and clears."""
        return set() if self._consumer is None else self._consumer.pop_load_errors()

    def get_kv_connector_stats(self) -> DCP2DStats | None:
        """Workers: after every step (the model runner). Scheduler: after processing every
        step's output (``update_from_output``); vLLM merges both."""
        if self._scheduler is not None:
            return self._scheduler.get_stats()
        if self._base is None:
            return None
        if self._producer is not None:
            self._producer.count_stats()
        return self._base.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DCP2DStats:
        return DCP2DStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """Called by vLLM's Prometheus logger in the front-end (``connector/prom.py``)."""
        return DCP2DPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Worker: leave the router, close each role (consumer first: no more fetches
        into the KV), then the transport and the bell's rope."""
        if self._base is not None:
            self._base.withdraw()
            for role in (self._consumer, self._producer):
                if role is not None:
                    role.close()
            self._base.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()
