"""What a worker's two roles share: one per TP rank, in vLLM's worker process.

The connector's worker half (``connector.DCP2DConnector``) drives its roles itself:
``producer.ProducerWorker`` (prefill: sender, bootstrap server, layer-split storage)
and ``consumer.ConsumerWorker`` (decode: receiver, fetches, releases, quarantines); a
kv_both instance has both. Each role holds this rank's ``WorkerBase``: the Mooncake
transport, the auth, the stats and their file, the step bell's rope and the router
registration, and the KV as registered (``KVCaches``). Each role closes what it
started (``close``); the base closes what it holds.

Hook order per engine step (vLLM 0.32 ``KVConnectorModelRunnerMixin``):
``handle_preemptions`` (before anything of the step runs) -> the step's
metadata is bound -> forward (``wait_for_layer_load`` / ``save_kv_layer``
around each attention layer) -> ``start_load_kv`` (after the forward: our fetches
are asynchronous; the producer's hand-over runs there on a GPU, at the bind on CPU:
``ProducerWorker.hands_over_at_bind``) -> ``wait_for_save`` -> ``get_finished`` ->
``get_block_ids_with_load_errors`` -> ``get_kv_connector_stats``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from vllm_dcp2d.config import DCP2DConfig
from vllm_dcp2d.connector.discovery import Registration, registration
from vllm_dcp2d.connector.metadata import DCP2DMetadata
from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile
from vllm_dcp2d.connector.step_bell import BellRope
from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.transfer.auth import Auth, exposed, load_secret
from vllm_dcp2d.transfer.checksum import KVBytes
from vllm_dcp2d.transfer.messages import Fingerprint
from vllm_dcp2d.transfer.transport import MooncakeTransport
from vllm_dcp2d.vllm_compat import connector_api as compat
from vllm_dcp2d.vllm_compat import instance
from vllm_dcp2d.vllm_compat.fingerprint import kv_fingerprint

log = logging.getLogger(__name__)

__all__ = ["WorkerBase", "KVCaches", "close_all"]


@dataclass
class KVCaches:
    """This rank's paged KV as vLLM allocated it (``register_kv_caches``).

    tensors:     ``{layer_name: tensor}`` (layouts: ``compat.kv_regions``).
    layer_ids:   layer name -> layer index (0..num_layers-1).
    regions:     the KV regions (all layers); ``memory``: ``[(addr, nbytes)]`` behind them.
    fingerprint: the KV format the other side must match.
    kv_bytes:    the KV as tensors where they are (the checksum reads them).
    staging_bytes: the send staging (host KV only: it gathers through numpy; 0 on a GPU).
    """

    tensors: dict
    layer_ids: dict[str, int]
    regions: KVRegions
    memory: list
    fingerprint: Fingerprint
    num_layers: int
    kv_bytes: KVBytes
    staging_bytes: int


class WorkerBase:
    """What both roles of one TP rank share (see module doc). ``of`` builds it from vLLM's
    config; the constructor takes what it reads there, so a role can be driven without an
    engine (tests/connector/test_producer.py, test_consumer.py).

    tp_rank, tp_size: this worker among the instance's TP ranks; dcp_rank, dcp_size: its
    DCP group (a consumer's; (0, 1) without DCP). num_kv_heads: the model's. page_size:
    tokens per KV block. num_blocks: KV blocks per layer. groups: layer name -> KV cache
    group; group_sharded: per group, DCP-sharded or replicated. single_host: the engine
    core and every worker share one ``time.monotonic()`` (the handover is timed across them).
    """

    def __init__(self, cfg: DCP2DConfig, engine_id: str, is_producer: bool, is_consumer: bool, *,
                 tp_rank: int = 0, tp_size: int = 1, dcp_rank: int = 0, dcp_size: int = 1, num_kv_heads: int,
                 page_size: int, num_blocks: int, groups: dict | None = None, group_sharded: list | None = None,
                 single_host: bool = True, vllm_config=None):
        self.vllm_config, self.cfg, self.engine_id = vllm_config, cfg, engine_id
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.tp_rank, self.tp_size, self.dcp_rank, self.dcp_size = tp_rank, tp_size, dcp_rank, dcp_size
        self.num_kv_heads, self.page_size, self.num_blocks = num_kv_heads, page_size, num_blocks
        self.groups = groups or {}
        self.group_sharded = group_sharded or [True]
        self.single_host = single_host
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
        self.transport: MooncakeTransport | None = None
        self.registration: Registration | None = None  # with vllm-router's discovery (TP rank 0)
        self.rope = BellRope("")  # rings the scheduler's step bell once a step names it
        self._kv_ptrs: dict[str, int] = {}

    @classmethod
    def of(cls, vllm_config, cfg: DCP2DConfig, engine_id: str, is_producer: bool, is_consumer: bool,
           kv_cache_config=None) -> WorkerBase:
        """This worker's base, from vLLM's config (a worker process: its TP and DCP groups
        are up). Raises ``ConfigError`` for a DCP interleave that splits pages."""
        tp_rank, tp_size = compat.tp_rank_size()
        dcp_rank, dcp_size = 0, 1
        if is_consumer:
            compat.check_interleave(vllm_config)
            dcp_rank, dcp_size = compat.dcp_rank_size()
        if is_producer and tp_rank == 0:
            cp, why = instance.cp_size(vllm_config)
            log.info("DCP2D producer: cp_size %d (%s)", cp, why)
        return cls(cfg, engine_id, is_producer, is_consumer, tp_rank=tp_rank, tp_size=tp_size, dcp_rank=dcp_rank,
                   dcp_size=dcp_size, num_kv_heads=compat.num_kv_heads(vllm_config),
                   page_size=compat.page_size(vllm_config),
                   num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else 0,
                   groups=compat.layer_groups(kv_cache_config), group_sharded=compat.group_sharded(kv_cache_config),
                   single_host=compat.single_host(vllm_config), vllm_config=vllm_config)

    def kv_caches(self, tensors: dict) -> KVCaches:
        """What ``register_kv_caches`` hands over (``{layer_name: tensor}``), described and
        checked: layers 0..L-1, the regions, the fingerprint."""
        layer_ids = compat.kv_layer_ids(self.vllm_config, tensors)
        regions, memory = compat.kv_regions(tensors, self.num_blocks, layer_ids, self.groups, self.group_sharded)
        self._kv_ptrs = {name: t.data_ptr() for name, t in tensors.items()}
        layers = np.sort(regions.layer_ids)
        if not np.array_equal(layers, np.arange(layers.size)):
            raise ValueError(f"KV layers must be 0..L-1, got {layers.tolist()}")
        num_layers = int(layers.size)
        fingerprint = kv_fingerprint(self.vllm_config, tensors, regions, self.num_blocks, layer_ids, num_layers,
                                     self.num_kv_heads)
        # The send staging gathers through numpy: host memory only. The checksum reads the KV
        # as tensors where they are (the same code on a CPU and a GPU).
        host_kv = next(iter(tensors.values())).device.type == "cpu"
        return KVCaches(tensors, layer_ids, regions, memory, fingerprint, num_layers,
                        KVBytes.of_tensors(tensors.values()), self.cfg.send_staging_mib << 20 if host_kv else 0)

    def open_transport(self, kv: KVCaches) -> MooncakeTransport:
        """This rank's Mooncake engine, with ``kv``'s memory registered. A producer's engine
        only writes: it may be replaced after a failed write."""
        self.transport = MooncakeTransport(self.cfg.local_hostname, protocol=self.cfg.protocol,
                                           renew_on_failure=self.is_producer and not self.is_consumer,
                                           handshake_timeout_s=self.cfg.handshake_timeout_s)
        for addr, nbytes in kv.memory:
            self.transport.register(addr, nbytes)
        return self.transport

    def announce(self) -> None:
        """Register with vllm-router's discovery (TP rank 0; last: the router may send
        requests from then on)."""
        if self.tp_rank == 0:
            self.registration = registration(self.cfg, self.is_producer, self.is_consumer)

    def bind(self, meta) -> None:
        """The step's bell (``DCP2DMetadata.bell``): the rope rings it from now on."""
        if isinstance(meta, DCP2DMetadata):
            self.rope.aim(meta.bell)

    def check_kv(self, layer_name: str, kv_layer) -> None:
        """``kv_layer`` (the KV cache tensor of ``layer_name`` in this step's forward) is
        still where Mooncake registered it."""
        ptr = self._kv_ptrs.get(layer_name)
        if ptr is not None and kv_layer.data_ptr() != ptr:
            raise RuntimeError(f"KV cache of {layer_name} moved from {ptr:#x} (registered with Mooncake) to "
                               f"{kv_layer.data_ptr():#x}; transfers would write freed memory")

    def check_alive(self, parts) -> None:
        """A connector thread that died fails the engine (so its health check fails)
        instead of leaving requests waiting for it forever. ``parts``: what runs threads
        (each has ``.failed``)."""
        for part in parts:
            if part.failed:
                raise RuntimeError(f"DCP2D {type(part).__name__} of TP rank {self.tp_rank} stopped: {part.failed}")

    def take_stats(self) -> DCP2DStats | None:
        """The step's stats (both roles count into ``stats``), with the transport's and
        the auth's counts; None if nothing was counted."""
        if self.transport is not None:
            for name, n in self.transport.take_counts().items():
                self.stats.count(name, n)
        self.stats.count("unauthenticated", self.auth.take_refused())
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def withdraw(self) -> None:
        """Leave the router first at shutdown: it stops sending requests here."""
        close_all((self.registration,))
        self.registration = None

    def close(self) -> None:
        """After the roles closed: the transport and the bell's rope."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.rope.close()


def close_all(parts) -> None:
    """Close each of ``parts`` (None skipped), in order; shutting down: a failure is
    reported and the rest still close."""
    for part in parts:
        if part is not None:
            try:
                part.close()
            except Exception as e:
                log.warning("DCP2D: closing %s failed: %s", type(part).__name__, e)
