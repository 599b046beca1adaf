"""Prometheus metrics of DCP2DConnector on each instance's ``/metrics``.

vLLM's KV-connector convention (0.32, ``kv_connector/v1/metrics.py``): the
front-end's ``PrometheusStatLogger`` builds one ``KVConnectorPromMetrics`` via
``DCP2DConnector.build_prom_metrics`` and hands it, after every engine step
that carried connector stats, that step's ``DCP2DStats.data`` (the workers'
snapshots, aggregated over TP ranks). So the metrics lag the transfers by one
step, not by the log interval (``VLLM_LOG_STATS_INTERVAL`` paces only the log
line). Counters grow by each step's figures; the histogram gets every write.

Every metric carries vLLM's ``model_name`` and ``engine`` labels; the per-path
ones add ``cp_rank`` (prefill layer-split rank), ``dcp_rank`` (decode DCP
rank) and ``dcp_size`` (this decode instance's DCP size), the 2D reshard
matrix. ``METRICS`` is the one list: it builds the metrics, the table in
docs/metrics.md (``markdown_table``) and the names the Grafana dashboard may use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dcp2d.vllm_compat.connector_api import KVConnectorPromMetrics

from vllm_dcp2d.connector.stats import LEVELS, parse_path_key
from vllm_dcp2d.vllm_compat.instance import serving_info

__all__ = ["METRICS", "INFO_LABELS", "Metric", "DCP2DPromMetrics", "WRITE_SECONDS_BUCKETS", "exposed_names", "markdown_table"]

# Write, fetch and reporting seconds: from 1 ms (a page of a tiny model) to the 10-30 s
# of a Mooncake stall and its retry (issue 14), which the dashboard must tell apart
# from a slow write.
WRITE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                         30.0, 60.0)
PATH_LABELS = ("cp_rank", "dcp_rank", "dcp_size")
_PATH_COUNTERS = ("transfers", "bytes", "replicated_bytes", "descriptors")


@dataclass(frozen=True)
class Metric:
    """``name`` as registered (a counter is exposed as ``name + "_total"``);
    ``source``: the ``DCP2DStats.data`` field it is fed from."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    per_path: bool
    side: str  # which instance records it: "decode", "prefill" or "both"
    source: str
    doc: str


METRICS: tuple[Metric, ...] = (
    Metric("vllm:dcp2d_path_transfers", "counter", True, "decode", "transfers",
           "Completed path writes: one per request, prefill CP rank and decode TP rank."),
    Metric("vllm:dcp2d_path_bytes", "counter", True, "decode", "bytes",
           "KV bytes written into this decode instance per path (target and replicated groups)."),
    Metric("vllm:dcp2d_path_replicated_bytes", "counter", True, "decode", "replicated_bytes",
           "The part of `vllm:dcp2d_path_bytes_total` that went to replicated KV cache groups (a speculative "
           "draft's KV, every page to every DCP rank); the target's bytes are the difference."),
    Metric("vllm:dcp2d_path_descriptors", "counter", True, "decode", "descriptors",
           "Mooncake write descriptors per path: runs contiguous in the decode's memory, after send staging "
           "(docs/connector.md) merged them; one per page, layer and K/V plane without it."),
    Metric("vllm:dcp2d_path_write_seconds", "histogram", True, "decode", "write_seconds",
           "Seconds the prefill CP rank spent in Mooncake writes for one request's path (summed over "
           "its writes when layers go early; from its transfer outcome)."),
    Metric("vllm:dcp2d_fetch_seconds", "histogram", False, "decode", "fetch_seconds",
           "Seconds from a decode rank asking every prefill CP rank for a request's KV to the last answer "
           "(one observation per request and decode TP rank; successful fetches)."),
    Metric("vllm:dcp2d_fetch_reported_after_seconds", "histogram", False, "decode", "reported_after_seconds",
           "Seconds an ended fetch waited for the engine step that reported it to vLLM's scheduler, per decode "
           "TP rank (a request waits for its slowest rank): PD latency that is neither compute nor transfer "
           "(an idle step's sleep, ended early by the step bell)."),
    Metric("vllm:dcp2d_send_held_seconds", "histogram", False, "prefill", "held_seconds",
           "Seconds a prefill TP rank held a finished request's KV blocks for the decode: from `request_finished` "
           "handing them to its senders until every decode rank was served, released them, or they expired "
           "(one observation per request and prefill TP rank; a long tail is decodes that ask late or never)."),
    Metric("vllm:dcp2d_send_handover_seconds", "histogram", False, "prefill", "handover_seconds",
           "Seconds from vLLM's scheduler finishing a prefill (`request_finished`) to a TP rank handing its "
           "blocks to its senders (the next step's `start_load_kv`): when a decode that asked early gets "
           "the rest of its KV (one observation per request and prefill TP rank)."),
    Metric("vllm:dcp2d_decode_admit_seconds", "histogram", False, "decode", "admit_seconds",
           "Seconds from the decode's API server receiving a PD request to its scheduler allocating its "
           "blocks and recording its fetch (queueing on the decode; one per fetched request)."),
    Metric("vllm:dcp2d_decode_resume_seconds", "histogram", False, "decode", "resume_seconds",
           "Seconds from the scheduler learning a request's KV arrived (`finished_recving`) to scheduling it "
           "on that KV (one per fetched request)."),
    Metric("vllm:dcp2d_decode_first_step_seconds", "histogram", False, "decode", "first_step_seconds",
           "Seconds of a fetched request's first step on the decode: scheduled until its output (the first "
           "token) is back in the scheduler (one per fetched request)."),
    Metric("vllm:dcp2d_failed_fetches", "counter", False, "decode", "failed",
           "Fetches that ended with an error (length mismatches included); expiries are counted apart."),
    Metric("vllm:dcp2d_expired_requests", "counter", False, "both", "expired",
           "Decode: KV that did not arrive within `transfer_timeout_s`. Prefill: blocks freed after "
           "`send_timeout_s` without every decode rank served."),
    Metric("vllm:dcp2d_quarantined_blocks", "counter", False, "decode", "quarantined",
           "Blocks put in quarantine: a failed fetch whose prefill rank may still write into them."),
    Metric("vllm:dcp2d_lifted_blocks", "counter", False, "decode", "lifted",
           "Quarantined blocks given back once their prefill rank settled (the quarantine lifted)."),
    Metric("vllm:dcp2d_blocks_in_quarantine", "gauge", False, "decode", "quarantined - lifted",
           "Blocks in quarantine now (out of use): quarantined minus lifted since start."),
    Metric("vllm:dcp2d_quarantine_oldest_seconds", "gauge", False, "decode", "quarantine_oldest_seconds",
           "Age of the oldest quarantine now, the largest over the decode's TP ranks (0 when none): it lifts at "
           "the latest `fence_s` after its fetch's deadline, so a value growing past that is a bug."),
    Metric("vllm:dcp2d_quarantine_seconds", "histogram", False, "decode", "quarantine_seconds",
           "Seconds each quarantine lasted, from its fetch's end to the lift (its prefill rank settled, was "
           "seen restarted, or the fence passed)."),
    Metric("vllm:dcp2d_prefix_broadcast_bytes", "counter", False, "prefill", "prefix_broadcast_bytes",
           "Layer-split storage: bytes sent or received over the TP group filling transient layer slots."),
    Metric("vllm:dcp2d_stalls", "counter", False, "prefill", "stalls",
           "Mooncake write batches given up after `STALL_S` without progress, retried or not (the fetch "
           "is then answered unsettled: the decode quarantines its blocks)."),
    Metric("vllm:dcp2d_retries", "counter", False, "prefill", "retries",
           "Batches re-sent on a fresh Mooncake engine after a stall."),
    Metric("vllm:dcp2d_handshake_failures", "counter", False, "prefill", "handshake_failures",
           "Decode Mooncake sessions that did not answer their handshake within `handshake_timeout_s` (a "
           "black hole, a frozen or vanished decode): each is refused for 10 s, its fetch failed."),
    Metric("vllm:dcp2d_handshake_refusals", "counter", False, "prefill", "handshake_refusals",
           "Writes refused at once (nothing sent) to a session whose handshake failed within the last 10 s."),
    Metric("vllm:dcp2d_unauthenticated_messages", "counter", False, "both", "unauthenticated",
           "Side-channel frames dropped unread: unsealed, forged, replayed or stale with `auth_secret_file` "
           "set, or sealed without it (docs/security.md)."),
    Metric("vllm:dcp2d_refused_registrations", "counter", False, "prefill", "refused_registrations",
           "Decode links whose Mooncake session a prefill rank refused (docs/security.md, claim 2: without a "
           "secret, a session not on the host the link comes from; or the prefill's own): every request on such a "
           "link fails before any write."),
    Metric("vllm:dcp2d_corrupt_fetches", "counter", False, "decode", "corrupt",
           "Fetches whose KV did not match the checksum its prefill rank sent (`verify_kv`): failed, "
           "their blocks never used or cached."),
    Metric("vllm:dcp2d_instance_info", "gauge", False, "both", "info",
           "Always 1; its labels say what a front needs to route here (`vllm-dcp2d proxy` reads them): "
           "`dcp_size`, `block_size` (tokens per page on one rank), `max_model_len` (the longest prompt + "
           "output admitted), `kv_cache_tokens` (KV capacity over the DCP group, vLLM's \"KV cache size\"), "
           "`max_num_seqs`."),
)
INFO_LABELS = ("dcp_size", "block_size", "max_model_len", "kv_cache_tokens", "max_num_seqs")


def exposed_names(m: Metric) -> tuple[str, ...]:
    """The sample names ``m`` appears under on ``/metrics`` (what PromQL selects)."""
    if m.kind == "counter":
        return (m.name + "_total",)
    if m.kind == "histogram":
        return (m.name + "_bucket", m.name + "_sum", m.name + "_count")
    return (m.name,)


def markdown_table() -> str:
    """The table of docs/metrics.md: every metric, its type, labels, side and meaning."""
    rows = ["| metric | type | labels | recorded by | meaning |", "|---|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(("model_name", "engine") + (PATH_LABELS if m.per_path else ())
                           + (INFO_LABELS if m.source == "info" else ()))
        rows.append(f"| `{' / '.join(exposed_names(m))}` | {m.kind} | {labels} | {m.side} | {m.doc} |")
    return "\n".join(rows)


class DCP2DPromMetrics(KVConnectorPromMetrics):
    """Registers ``METRICS`` with the metric classes vLLM passes (plain
    prometheus_client, or Ray's wrappers) and records each step's stats."""

    def __init__(self, vllm_config, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._dcp_size = str(vllm_config.parallel_config.decode_context_parallel_size)
        self._path: dict[str, Any] = {}   # source -> metric labelled by engine and path
        self._inst: dict[str, dict] = {}  # source -> {engine_idx: child}
        self._children: dict[tuple[int, str], dict[str, Any]] = {}  # (engine_idx, path key) -> source -> child
        for m in METRICS:
            if m.per_path:
                names = list(labelnames) + list(PATH_LABELS)
                if m.kind == "histogram":
                    self._path[m.source] = self._histogram_cls(name=m.name, documentation=m.doc,
                                                               labelnames=names, buckets=list(WRITE_SECONDS_BUCKETS))
                else:
                    self._path[m.source] = self._counter_cls(name=m.name, documentation=m.doc, labelnames=names)
                continue
            if m.source == "info":  # set once: what the instance is does not change while it runs
                info = serving_info(vllm_config)
                gauge = self._gauge_cls(name=m.name, documentation=m.doc, labelnames=list(labelnames) +
                                        list(INFO_LABELS), multiprocess_mode="mostrecent")
                for lv in per_engine_labelvalues.values():
                    gauge.labels(*lv, *(info[k] for k in INFO_LABELS)).set(1)
                continue
            if m.kind == "histogram":
                metric = self._histogram_cls(name=m.name, documentation=m.doc, labelnames=labelnames,
                                             buckets=list(WRITE_SECONDS_BUCKETS))
            elif m.kind == "gauge":
                # Each front-end process holds the deltas it was sent: their sum is the level; a
                # level itself (an age) is set, and across processes the largest counts.
                mode = "livemax" if m.source in LEVELS else "livesum"
                metric = self._gauge_cls(name=m.name, documentation=m.doc, labelnames=labelnames,
                                         multiprocess_mode=mode)
            else:
                metric = self._counter_cls(name=m.name, documentation=m.doc, labelnames=labelnames)
            # Children created now, so every instance metric shows (at 0) from start-up.
            self._inst[m.source] = {i: metric.labels(*lv) for i, lv in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's ``DCP2DStats.data`` for engine ``engine_idx``."""
        data = transfer_stats_data
        engine = self.per_engine_labelvalues[engine_idx]
        for key, p in data["paths"].items():
            children = self._children.get((engine_idx, key))
            if children is None:  # a path's first transfer: its series appear, all of them
                cp_rank, dcp_rank = parse_path_key(key)
                labels = (*engine, str(cp_rank), str(dcp_rank), self._dcp_size)
                children = self._children[(engine_idx, key)] = {
                    source: metric.labels(*labels) for source, metric in self._path.items()}
            for source in _PATH_COUNTERS:
                children[source].inc(p[source])
            hist = children["write_seconds"]
            for s in p["write_seconds"]:
                hist.observe(s)
        for m in METRICS:
            if not m.per_path and m.kind == "counter" and data[m.source]:
                self._inst[m.source][engine_idx].inc(data[m.source])
            elif not m.per_path and m.kind == "histogram":
                for s in data[m.source]:
                    self._inst[m.source][engine_idx].observe(s)
        level = data["quarantined"] - data["lifted"]
        if level:
            self._inst["quarantined - lifted"][engine_idx].inc(level)
        for source in LEVELS:
            if data.get(source):
                self._inst[source][engine_idx].set(max(data[source]))
