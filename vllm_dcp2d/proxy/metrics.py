"""The proxy's Prometheus metrics (served on its ``/metrics``).

``METRICS`` is the one list of names, types, labels and meanings: the
``## Proxy`` section of docs/metrics.md lists the same, and a test checks both
against a live ``/metrics``. Each ``Proxy`` has its own registry, so several
proxies (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .fit import free_tokens

PREFIX = "vllm_dcp2d_proxy_"
# 1 ms .. 10 min: a tiny model's decode step up to a stalled transfer's retries
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
           60.0, 120.0, 300.0, 600.0)

# name (without PREFIX), type, labels, meaning
METRICS = (
    ("requests_total", "counter", ("route", "status"),
     "Client requests answered, by route (/v1/completions, ...) and the HTTP status the client got "
     "(a stream that failed after its first byte counts as 200, see errors_total kind=mid_stream; "
     "499: the client left before the answer ended)."),
    ("errors_total", "counter", ("stage", "kind"),
     "Failures, by stage (prefill, decode, client, proxy) and kind: unreachable (connection refused, "
     "reset or closed), timeout, http_4xx, http_5xx, bad_answer (a prefill answer without usable "
     "kv_transfer_params), no_healthy (no instance of the kind in rotation), mid_stream (the decode "
     "failed after bytes went to the client), disconnected (the client left mid-stream), bad_request, "
     "too_long (no decode admits the request: the client got 400 naming the longest length served)."),
    ("retries_total", "counter", ("stage",),
     "Calls sent again to another instance of the stage's kind after the first failed before any "
     "byte reached the client."),
    ("upstream_calls_total", "counter", ("kind", "upstream"),
     "Calls sent to each upstream instance (every attempt, retries included): how the balancer "
     "spread the load."),
    ("prefill_seconds", "histogram", (),
     "Successful prefill calls: request sent to the prefill instance until its answer was read "
     "(the prompt's forward plus vLLM's queueing; in --pipelined mode this overlaps transfer_wait)."),
    ("transfer_wait_seconds", "histogram", (),
     "Streamed requests: decode request sent until the decode's first body byte, i.e. its KV fetch "
     "from the prefill ranks plus its first decode step (plus the prefill itself in --pipelined "
     "mode, where the decode waits for the KV being computed). Not recorded for non-streamed "
     "requests, whose body arrives in one piece at the end."),
    ("decode_seconds", "histogram", ("stream",),
     "Successful decode calls. stream=true: first body byte until the end of the stream (the "
     "tokens after the first); stream=false: request sent until the answer was read (fetch plus "
     "all tokens, which the proxy cannot separate)."),
    ("request_seconds", "histogram", ("route",),
     "Client requests answered 200: request received until the last byte went out."),
    ("outstanding_requests", "gauge", ("kind", "upstream"),
     "Calls in flight to each upstream instance now (the load balancer's measure)."),
    ("upstream_healthy", "gauge", ("kind", "upstream"),
     "1 while the instance is in rotation, 0 while its health checks fail or it was unreachable."),
    ("routed_total", "counter", ("dcp_size", "reason"),
     "Decode calls by the DCP size of the decode picked (\"unknown\": it has not said) and why: fits "
     "(the smallest DCP size that fits the request with room), fallback (a larger one: the smaller had "
     "no room), full (none had room: the fitting decode with the most free KV), affinity (the decode "
     "that served the prompt's prefix), unknown (length or decode not known: least loaded), too_long "
     "(no decode admits it and the prefill has run: the longest context's decode refuses it with "
     "its own 400 and frees the prefill's KV). Retries count again."),
    ("affinity_total", "counter", ("outcome",),
     "Decode picks of requests with affinity keys: hit (back to the decode that served the prefix), "
     "move (that decode was out of rotation, did not fit or was overloaded: the history moves once), "
     "miss (no remembered prefix)."),
    ("affinity_entries", "gauge", (),
     "Prefix and session keys remembered now (bounded by --affinity-entries, least recently used "
     "dropped)."),
    ("decode_free_tokens", "gauge", ("upstream", "dcp_size"),
     "KV tokens the router counts free on each decode that said what it is: capacity less others' use "
     "(its last reported usage less what the proxy's calls held then) and less what the proxy's calls "
     "in flight there may hold now."),
)


class _Upstreams:
    """Outstanding calls and health of every upstream, the router's view of each decode's
    free KV and its affinity memory, read at scrape time."""

    def __init__(self, pools, router):
        self.pools, self.router = pools, router

    def collect(self):
        out = GaugeMetricFamily(PREFIX + "outstanding_requests", _help("outstanding_requests"),
                                labels=["kind", "upstream"])
        health = GaugeMetricFamily(PREFIX + "upstream_healthy", _help("upstream_healthy"),
                                   labels=["kind", "upstream"])
        for pool in self.pools:
            for u in pool.upstreams:
                out.add_metric([u.kind, u.url], u.outstanding)
                health.add_metric([u.kind, u.url], 1.0 if u.healthy else 0.0)
        yield out
        yield health
        free = GaugeMetricFamily(PREFIX + "decode_free_tokens", _help("decode_free_tokens"),
                                 labels=["upstream", "dcp_size"])
        for u in self.router.decode_pool.upstreams:
            if u.info is not None:
                free.add_metric([u.url, str(u.info.dcp_size)],
                                free_tokens(u.info, u.kv_usage, u.in_flight_tokens, u.in_flight_at_poll))
        yield free
        aff = self.router.affinity
        yield GaugeMetricFamily(PREFIX + "affinity_entries", _help("affinity_entries"),
                                value=len(aff) if aff is not None else 0)


def _help(name: str) -> str:
    return next(m[3] for m in METRICS if m[0] == name)


class ProxyMetrics:
    def __init__(self, pools, router):
        self.registry = CollectorRegistry()
        r = self.registry
        # prometheus_client appends _total to counters itself
        self.requests = Counter(PREFIX + "requests", _help("requests_total"), ["route", "status"], registry=r)
        self.errors = Counter(PREFIX + "errors", _help("errors_total"), ["stage", "kind"], registry=r)
        self.retries = Counter(PREFIX + "retries", _help("retries_total"), ["stage"], registry=r)
        self.calls = Counter(PREFIX + "upstream_calls", _help("upstream_calls_total"), ["kind", "upstream"],
                             registry=r)
        self.prefill = Histogram(PREFIX + "prefill_seconds", _help("prefill_seconds"), buckets=BUCKETS, registry=r)
        self.transfer_wait = Histogram(PREFIX + "transfer_wait_seconds", _help("transfer_wait_seconds"),
                                       buckets=BUCKETS, registry=r)
        self.decode = Histogram(PREFIX + "decode_seconds", _help("decode_seconds"), ["stream"], buckets=BUCKETS,
                                registry=r)
        self.request = Histogram(PREFIX + "request_seconds", _help("request_seconds"), ["route"], buckets=BUCKETS,
                                 registry=r)
        self.routed = Counter(PREFIX + "routed", _help("routed_total"), ["dcp_size", "reason"], registry=r)
        self.affinity = Counter(PREFIX + "affinity", _help("affinity_total"), ["outcome"], registry=r)
        r.register(_Upstreams(pools, router))

    def error(self, stage: str, kind: str) -> None:
        self.errors.labels(stage, kind).inc()

    def decided(self, d) -> None:
        """Count a ``routing.Decision``."""
        self.routed.labels(str(d.upstream.info.dcp_size) if d.upstream.info else "unknown", d.reason).inc()
        if d.affinity is not None:
            self.affinity.labels(d.affinity).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def markdown_table() -> str:
    """The metrics table of docs/metrics.md's "Proxy" section: name, type, labels, meaning."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, doc in METRICS:
        rows.append(f"| `{PREFIX}{name}` | {kind} | {', '.join(f'`{x}`' for x in labels) or '-'} | {doc} |")
    return "\n".join(rows)
