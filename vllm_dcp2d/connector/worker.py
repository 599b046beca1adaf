"""Worker side of DCP2DConnector: one per TP rank, in vLLM's worker process.

``WorkerSide`` is what the connector's worker half calls; it owns what both
roles share (the Mooncake transport, the stats, the step bell, the router
registration) and hands each hook to its roles: ``producer.ProducerWorker``
(prefill: sender, bootstrap server, layer-split storage) and
``consumer.ConsumerWorker`` (decode: receiver, loads, releases, quarantines);
a kv_both instance has both.

Hook order per engine step (vLLM 0.32 ``KVConnectorModelRunnerMixin``):
``handle_preemptions`` (before anything of the step runs) -> the step's
metadata is bound -> forward (``wait_for_layer_load`` / ``save_kv_layer``
around each attention layer) -> ``start_load_kv`` (after the forward: our loads
are asynchronous) -> ``wait_for_save`` -> ``get_finished`` ->
``get_block_ids_with_load_errors`` -> ``get_kv_connector_stats``.
"""

from __future__ import annotations

import logging

import numpy as np

from vllm_dcp2d.config import DCP2DConfig
from vllm_dcp2d.connector.consumer import ConsumerWorker
from vllm_dcp2d.connector.discovery import Registration, registration
from vllm_dcp2d.connector.metadata import DCP2DMetadata, DCP2DWorkerMeta
from vllm_dcp2d.connector.params import bootstrap_addr
from vllm_dcp2d.connector.producer import ProducerWorker
from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile
from vllm_dcp2d.connector.step_bell import BellRope
from vllm_dcp2d.reshard.layout import kv_head_range
from vllm_dcp2d.transfer.auth import Auth, exposed, load_secret
from vllm_dcp2d.transfer.checksum import KVBytes
from vllm_dcp2d.transfer.transport import MooncakeTransport, unpinned
from vllm_dcp2d.vllm_compat import connector_api as compat
from vllm_dcp2d.vllm_compat.fingerprint import kv_fingerprint

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
        self.tp_rank, self.tp_size = compat.tp_rank_size()
        num_kv_heads = compat.num_kv_heads(vllm_config)
        self.auth = Auth(load_secret(cfg.auth_secret_file))  # raises ConfigError for a bad secret file
        if self.tp_rank == 0:  # one line per instance (docs/security.md)
            hosts = {"local_hostname": cfg.local_hostname}
            if is_producer:  # the bootstrap (ZMQ and HTTP) listens there too
                hosts["bootstrap_host"] = cfg.bootstrap_host
            warning = exposed(self.auth.enabled, hosts)
            if warning:
                log.warning("%s", warning)
        self.stats = DCP2DStats()
        self.stats_file = StatsFile(cfg.stats_file, "consumer" if is_consumer else "producer", engine_id)
        self.producer = ProducerWorker(vllm_config, cfg, engine_id, self.tp_rank, self.tp_size, num_kv_heads,
                                       self.auth, self.stats, self.stats_file) if is_producer else None
        self.consumer = None
        if is_consumer:
            dcp_rank, dcp_size = compat.dcp_rank_size()
            self.consumer = ConsumerWorker(vllm_config, cfg, engine_id, self.tp_rank, self.tp_size, dcp_rank,
                                           dcp_size, kv_head_range(num_kv_heads, self.tp_size, self.tp_rank),
                                           num_kv_heads, self.group_sharded,
                                           compat.page_size(vllm_config), self.auth, self.stats, self.stats_file)
        self.num_kv_heads = num_kv_heads
        self.transport: MooncakeTransport | None = None
        self.registration: Registration | None = None  # with vllm-router's discovery (TP rank 0)
        self.rope = BellRope("")  # rings the scheduler's step bell once a step names it
        self._kv_ptrs: dict[str, int] = {}

    # -- start-up -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Called once by the model runner after it allocated the paged KV
        (``{layer_name: tensor}``, see ``compat.kv_regions`` for the layouts).
        Registers the memory with Mooncake and starts this rank's roles."""
        layer_ids = compat.kv_layer_ids(self.vllm_config, kv_caches)
        regions, memory = compat.kv_regions(kv_caches, self.num_blocks, layer_ids, self.groups,
                                            self.group_sharded)
        self._kv_ptrs = {name: t.data_ptr() for name, t in kv_caches.items()}
        layers = np.sort(regions.layer_ids)
        if not np.array_equal(layers, np.arange(layers.size)):
            raise ValueError(f"KV layers must be 0..L-1, got {layers.tolist()}")
        num_layers = int(layers.size)
        fingerprint = kv_fingerprint(self.vllm_config, kv_caches, regions, self.num_blocks, layer_ids, num_layers,
                                     self.num_kv_heads)
        token = ""
        if self.producer is not None:
            self.producer.start_layer_split(kv_caches, layer_ids, self.num_blocks, num_layers)
            self.producer.watch_kv_writes(kv_caches)
            token = self.producer.token()
        # The send staging gathers through numpy: host memory only. The checksum reads the KV
        # as tensors where they are (the same code on a CPU and a GPU).
        host_kv = next(iter(kv_caches.values())).device.type == "cpu"
        staging = self.cfg.send_staging_mib << 20 if host_kv else 0
        kv_bytes = KVBytes.of_tensors(kv_caches.values())
        # vLLM's CPU worker pins this thread to its cores; the threads started here must not inherit it
        with unpinned():
            self._start(regions, memory, fingerprint, num_layers, staging, token, kv_bytes)

    def _start(self, regions, memory, fingerprint, num_layers: int, staging_bytes: int, token: str,
               kv_bytes: KVBytes) -> None:
        # A producer's engine only writes: it may be replaced after a failed write.
        self.transport = MooncakeTransport(self.cfg.local_hostname, protocol=self.cfg.protocol,
                                           renew_on_failure=self.is_producer and not self.is_consumer,
                                           handshake_timeout_s=self.cfg.handshake_timeout_s)
        for addr, nbytes in memory:
            self.transport.register(addr, nbytes)
        if self.producer is not None:
            self.producer.start(self.transport, regions, fingerprint, num_layers, staging_bytes, token, kv_bytes,
                                bootstrap_addr(self.cfg))
        if self.consumer is not None:
            # the receiver rings it when a fetch ended or a quarantine lifted: the idle step wakes
            self.consumer.start(self.transport, regions, fingerprint, self.rope.ring, kv_bytes)
        if self.producer is not None and self.consumer is not None:
            # kv_both: this rank's receiver may fetch from its own sender, into the same engine's memory
            self.producer.sender.consumers.trust(self.consumer.receiver.identity)
        if self.tp_rank == 0:  # last: the router may send requests from now on
            self.registration = registration(self.cfg, self.is_producer, self.is_consumer)

    # -- per step -----------------------------------------------------------------------------

    def bind(self, meta) -> None:
        """Called every step with its metadata, before the forward (None after it):
        the context blocks the layer-split fill broadcasts, the step bell to ring."""
        if isinstance(meta, DCP2DMetadata):
            self.rope.aim(meta.bell)
        if self.consumer is not None:
            self.consumer.bind(meta)
        if self.producer is not None:
            self.producer.bind(meta)

    def handle_preemptions(self, meta) -> None:
        """Called by the model runner first thing in every step, before the forward
        that may overwrite the blocks of requests preempted while it was scheduled.
        Producer: their attempts start over (``Sender.restart``): a layer written, or
        being written, from the freed blocks counts for nothing, and every layer is
        written again from the re-prefill's blocks. Nothing waits here: writes of an
        attempt are ordered by its lock, so a stale write that is still reading
        lands before its replacement, and no answer goes out until the last one."""
        self._check_threads()
        if self.producer is not None and isinstance(meta, DCP2DMetadata):
            self.producer.handle_preemptions(meta)

    def _check_threads(self) -> None:
        """A connector thread that died fails the engine (so its health check fails)
        instead of leaving requests waiting for it forever."""
        for role in (self.producer, self.consumer):
            for part in () if role is None else role.threads():
                if part.failed:
                    raise RuntimeError(f"DCP2D {type(part).__name__} of TP rank {self.tp_rank} stopped: "
                                       f"{part.failed}")

    def start_load_kv(self, meta) -> None:
        """Called by the model runner every step with this step's metadata bound.
        Producer: hands finished prefills to the sender, aborts aborted ones.
        Consumer: starts fetches; tells the producers about requests it will not fetch."""
        if self.producer is not None:
            self.producer.hand_over(meta)
        if self.consumer is not None:
            self.consumer.start_loads(meta)
        elif meta.loads:
            req_id = next(iter(meta.loads))
            raise RuntimeError(f"request {req_id} asks to load KV but this instance is not a kv_consumer")

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
        sending = set() if self.producer is None else self.producer.pop_finished()
        recving, failed = (set(), set()) if self.consumer is None else self.consumer.pop_finished()
        return sending, recving, failed

    def build_worker_meta(self) -> DCP2DWorkerMeta | None:
        """Called by the model runner after ``get_finished``, with the step's metadata
        still bound: blocks to quarantine and quarantines lifted, failed loads, and
        the requests whose first step on loaded KV this was, for the scheduler side."""
        if self.consumer is None:
            return None
        m = self.consumer.take_meta()
        return m if (m.quarantine or m.lifted or m.ran or m.failed_loads) else None

    def save_kv_layer(self, layer_name: str, kv_layer, meta) -> None:
        """Called by the attention layer right after it computed (and cached) the KV
        of ``layer_name`` (``kv_layer``, its KV cache tensor) in this step's forward
        (``meta``: this step's metadata). Producer: fetches already waiting for a
        request whose prompt completes in this step get this layer now."""
        ptr = self._kv_ptrs.get(layer_name)
        if ptr is not None and kv_layer.data_ptr() != ptr:
            raise RuntimeError(f"KV cache of {layer_name} moved from {ptr:#x} (registered with Mooncake) to "
                               f"{kv_layer.data_ptr():#x}; transfers would write freed memory")
        if self.producer is not None:
            self.producer.save_kv_layer(layer_name, kv_layer, meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by the model runner after ``get_finished``; returns and clears."""
        return set() if self.consumer is None else self.consumer.pop_load_errors()

    def get_kv_connector_stats(self) -> DCP2DStats | None:
        if self.producer is not None:
            self.producer.count_stats()
        if self.transport is not None:
            for name, n in self.transport.take_counts().items():
                self.stats.count(name, n)
        self.stats.count("unauthenticated", self.auth.take_refused())
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.unhook()
        parts = [self.registration, *(() if self.consumer is None else self.consumer.threads()),
                 *(() if self.producer is None else self.producer.parts())]
        for part in parts:
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # shutting down: report and go on
                    log.warning("DCP2D: closing %s failed: %s", type(part).__name__, e)
        if self.transport is not None:
            self.transport.close()
        self.rope.close()
        self.registration = self.transport = None
        if self.producer is not None:
            self.producer.sender = self.producer.bootstrap = self.producer.http_bootstrap = None
        if self.consumer is not None:
            self.consumer.receiver = None
