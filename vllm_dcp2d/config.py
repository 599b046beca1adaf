"""DCP2DConnector's name and its ``kv_connector_extra_config``: parse and validate.

A leaf (standard library only), so the plugin entry point, the vLLM glue
(``vllm_compat``) and the connector all read it without importing each other.
Every key, its type, default and meaning is in ``KEYS`` (the tables in docs/config.md
and docs/connector.md are generated from the same text). An unknown key or an invalid value raises
``ConfigError`` from the connector's constructor, which stops vLLM's start-up
with that message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["CONNECTOR_NAME", "CONNECTOR_CLASS", "ConfigError", "DCP2DConfig", "KEYS", "parse_extra_config",
           "markdown_table"]

CONNECTOR_NAME = "DCP2DConnector"  # as users write it in --kv-transfer-config
CONNECTOR_CLASS = ("vllm_dcp2d.connector.connector", "DCP2DConnector")  # module, class, for vLLM's factory


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message names key, value and what is expected."""


@dataclass(frozen=True)
class DCP2DConfig:
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 17500
    http_bootstrap_port: int = -1
    cp_size: int = 0
    layer_split: str = "auto"
    transfer_timeout_s: float = 60.0
    max_transfer_timeout_s: float = 600.0
    send_timeout_s: float = 120.0
    claim_timeout_s: float = 30.0
    prefill_wait_s: float = 30.0
    cancel_grace_s: float = 2.0
    fence_s: float = 120.0
    max_quarantined_blocks: int = 0
    release_unfetched: bool = True
    protocol: str = "tcp"
    send_staging_mib: int = 32
    local_hostname: str = "127.0.0.1"
    stats_file: str = ""
    cpu_poll_sleep_us: int = 500
    cpu_start_method: str = "spawn"
    router_discovery_address: str = ""
    router_http_address: str = ""
    auth_secret_file: str = ""
    verify_kv: bool = False
    max_prefill_wait_s: float = 60.0
    handshake_timeout_s: float = 2.0


# key -> (role it matters to, doc). Order is the docs tables' order.
KEYS: dict[str, tuple[str, str]] = {
    "bootstrap_host": ("producer", "Address the prefill instance's bootstrap server binds to and "
                       "advertises to decode instances in `kv_transfer_params` (`remote_bootstrap_addr`)."),
    "bootstrap_port": ("producer", "TCP port of that bootstrap server: one per prefill instance; "
                       "its CP ranks register their side channel there."),
    "http_bootstrap_port": ("producer", "Port of the prefill instance's HTTP bootstrap, the one routers that "
                            "speak vLLM's MooncakeConnector protocol query (`GET /query`; vllm-router "
                            "`--kv-connector mooncake --prefill URL PORT`), beside `bootstrap_port`. -1 (default): "
                            "`VLLM_MOONCAKE_BOOTSTRAP_PORT` (vLLM's default 8998), left out with a warning if that "
                            "port is taken; 0: off; any other port: start-up fails if it is taken."),
    "cp_size": ("producer", "Prefill layer-split size: the TP ranks holding the same KV heads split their "
                "layers, replica `i < cp_size` sending `cp_layer_range(L, cp_size, i)` of its heads. 0 (default) "
                "= what the model allows, logged at start-up: the TP size where every rank holds the whole KV "
                "(MLA, one KV head), the ranks per head where there are fewer KV heads than TP ranks, 1 where "
                "KV heads are sharded over TP (each rank sends every layer of its heads). A value above the "
                "ranks per head is refused at start-up."),
    "layer_split": ("producer", "Layer-split *storage*: each TP rank allocates KV only for the layers it owns "
                    "plus one transient slot that its other layers share, so the same `kv_cache_memory_bytes` "
                    "holds `L / (max owned + 1)` times the tokens. Before a non-owned layer writes its cache, "
                    "the owner broadcasts the blocks of the step's earlier tokens over the TP group. `\"auto\"` "
                    "(default): on for a `kv_producer` with cp_size > 1 and replicated KV, and no CUDA graph that "
                    "replays the cache write (GPU: `-cc.cudagraph_mode=PIECEWISE`), off otherwise (logged). "
                    "`\"on\"`: start-up fails if it cannot apply. `\"off\"`: every rank stores every layer "
                    "(docs/connector.md, \"Layer-split storage\")."),
    "transfer_timeout_s": ("consumer", "Decode-side expiry: seconds from the decode worker asking for "
                           "a request's KV until all of it must have arrived. Past it the request's "
                           "blocks are reported as load errors, so `kv_load_failure_policy` decides: "
                           "`\"fail\"` ends the request with an error, `\"recompute\"` prefills it locally. "
                           "A request's `kv_transfer_params` may carry its own `transfer_timeout_s`, "
                           "at most `max_transfer_timeout_s`."),
    "max_transfer_timeout_s": ("consumer", "Cap on a request's own `kv_transfer_params[\"transfer_timeout_s\"]`: "
                               "a larger value is cut to this (logged), so no client can hold a decode's blocks "
                               "longer. An invalid value (not a number > 0) falls back to `transfer_timeout_s`."),
    "send_timeout_s": ("producer", "Prefill-side expiry, the backstop for a decode instance that vanished: "
                       "seconds a finished request's KV blocks are held for decode ranks that have neither "
                       "fetched their pages nor released them (`release_unfetched`); then they are freed."),
    "claim_timeout_s": ("producer", "Seconds a finished request's KV blocks are held when no decode rank has "
                        "asked for them (no transfer request, no release): then they are freed, and a fetch "
                        "that comes later fails (its decode recomputes or errors, by its "
                        "`kv_load_failure_policy`). Frees the prefill fast behind a router without retries "
                        "whose decode call failed. Set it above the longest a decode may queue a request "
                        "before admitting it; once a decode rank asked, `send_timeout_s` applies."),
    "prefill_wait_s": ("consumer", "How long a decode rank's transfer request may wait at a prefill rank "
                       "for a request it does not know yet (its prefill is still running)."),
    "cancel_grace_s": ("consumer", "After a fetch fails, seconds to wait for the prefill ranks still "
                       "writing to settle its cancel (answer that they stopped). A rank that has not settled by then may still write "
                       "into the request's blocks: the request is recomputed in fresh blocks and the old ones "
                       "stay quarantined (out of use) until that rank settles, is seen restarted, or "
                       "`fence_s` passes (docs/connector.md, \"Block lifetime\")."),
    "fence_s": ("consumer", "A quarantine ends at the latest this many seconds after its fetch's deadline, "
                "whatever the prefill says: every transfer request carries the deadline (`not_after_ns`, the "
                "wall clock), after which a prefill rank starts no write of it, and a write it started before "
                "ends within 60 s (`WRITE_LIMIT_S`) plus Mooncake's progress timeout. Keep it above 70 s plus "
                "the largest clock difference between prefill and decode hosts."),
    "max_quarantined_blocks": ("consumer", "Blocks one prefill instance may keep quarantined on a decode rank; "
                               "past it that instance's fetches are refused until its quarantines lift, and past "
                               "twice it for all instances together every fetch is. 0: a quarter of the rank's KV "
                               "blocks (at least 64)."),
    "release_unfetched": ("consumer", "A decode instance that will not fetch a request's KV (its prompt is "
                          "cached, it was aborted before its fetch began, its fetch was refused or "
                          "failed) tells every prefill CP rank at once (`ReleaseTransfer`), so the prefill frees "
                          "the blocks now instead of after `send_timeout_s`. `false` sends nothing (the "
                          "previous behaviour; for comparison)."),
    "protocol": ("both", "Mooncake transport: `\"tcp\"` (default, any machine) or `\"rdma\"` "
                 "(the engine then discovers the NICs itself)."),
    "send_staging_mib": ("producer", "KV in host memory (CPU instances): MiB per prefill CP rank into which "
                         "it copies a path's pages, in the decode rank's order, before writing them, so pages "
                         "adjacent in the decode's blocks go out as one Mooncake descriptor (a DCP rank's pages are "
                         "every N-th page of the prefill's and never adjacent there; over TCP each descriptor costs "
                         "~10 us whatever its size). A path larger than half of it goes in several copies. 0: "
                         "every page written in place. KV on a GPU is always written in place "
                         "(docs/connector.md, \"Send staging\")."),
    "local_hostname": ("both", "Host name or IP this instance's Mooncake engine listens on and "
                       "advertises to its peers."),
    "stats_file": ("both", "If set, every worker appends one JSON line per transfer path and request "
                   "(`cp_rank`, `dcp_rank`, `bytes` and of them `replicated_bytes`, a draft's, the instance's "
                   "`draft_layers`, `descriptors`, "
                   "`seconds`, `ok`; a decode's also `fetch_seconds` and `reported_after_seconds`, the wait from the "
                   "fetch's end to the engine step that reported it), a prefill worker one line per request its "
                   "senders let go of (`event`: done, released, expired, unclaimed, aborted; `handover_seconds` from "
                   "`request_finished` to its senders, `held_seconds` since), and a decode's scheduler one line per "
                   "fetched request (`event` \"first_step\": `admit_seconds`, `resume_seconds`, "
                   "`first_step_seconds`; docs/metrics.md, \"A request's timeline\") to this file; the "
                   "same figures also go to vLLM's periodic `KV Transfer metrics` log."),
    "cpu_poll_sleep_us": ("both", "CPU hosts only: microseconds vLLM's shared-memory queues sleep between "
                          "polls instead of spinning (their latency grows by at most this). Without it, "
                          "every TP worker of an instance that holds or awaits KV spins a core, starving "
                          "the transfers on small hosts. 0 keeps vLLM's spinning; ignored on GPU hosts."),
    "cpu_start_method": ("both", "CPU hosts only: how vLLM starts this instance's engine core and TP workers. "
                         "`\"spawn\"` (default): as vLLM does on CPU, each imports vLLM anew. `\"fork\"`: vLLM's "
                         "default on GPU hosts; each is forked from the process that starts it, with its imports, "
                         "and runs on the cores vLLM's `VLLM_CPU_OMP_THREADS_BIND` gives it (its OpenMP runtime, "
                         "loaded before the fork, cannot read them; its threads are not pinned one per core within "
                         "them, and vLLM's `LD_PRELOAD`, where its build bundles tcmalloc, reaches only spawned "
                         "processes). A TP=2 start takes ~11 CPU-s instead of ~26, the requests after it the same "
                         "(BENCHMARKS.md, \"Start-up\"). Ignored on GPU hosts."),
    "router_discovery_address": ("both", "`host:port` of vllm-router's `--vllm-discovery-address`: the instance "
                                 "joins that router (a prefill as `P`, a decode as `D`) by registering "
                                 "`router_http_address` every 2 s while it answers `/health`, and leaves by "
                                 "stopping (the router drops it 5 s after the last). `\"\"` (default): off."),
    "router_http_address": ("both", "`host:port` the router sends this instance's requests to (its "
                            "`vllm serve --host/--port`, as reachable from the router); needed with "
                            "`router_discovery_address`."),
    "auth_secret_file": ("both", "File holding the shared secret (at least 16 bytes; mode 0600 or 0400) that "
                         "authenticates every side-channel message: each is sealed with an HMAC-SHA256 tag, a "
                         "timestamp and a nonce, and one that is unsealed, forged, replayed or more than 60 s "
                         "off is dropped and counted (`vllm:dcp2d_unauthenticated_messages_total`). `\"\"` "
                         "(default): the secret in `$DCP2D_AUTH_SECRET`, else none (the side channel is then "
                         "open to whoever reaches it: docs/security.md). Give prefill and decode the same secret."),
    "verify_kv": ("consumer", "Each prefill rank sends a checksum (`checksum.py`: 16 lanes of an int8-GEMM linear sum, computed with torch where the KV is) of the bytes it wrote for this decode "
                  "rank, which checks its blocks against it before reporting the load: a page that arrived wrong, "
                  "whoever wrote it, fails the load (`kv_load_failure_policy`) and never enters the prefix cache. "
                  "Costs a read of the KV on both sides, about as long as the write over TCP (BENCHMARKS.md, "
                  "\"The trust boundary's cost\"); on a GPU the checksum runs on the GPU."),
    "max_prefill_wait_s": ("producer", "The longest a decode's transfer request may wait at this prefill for a "
                           "request it does not know yet (the decode's `prefill_wait_s` is cut to it), so no peer "
                           "can hold this rank's memory longer."),
    "handshake_timeout_s": ("producer", "The longest this prefill waits for a decode's Mooncake session to answer "
                            "its handshake, checked on a socket of its own before the engine opens the session "
                            "(which it does under a lock all its writes share, for up to 60 s). A session that "
                            "does not answer in time (a black hole, a frozen or vanished decode) fails its fetch "
                            "and is refused for 10 s; the other decodes' writes never wait for it "
                            "(docs/security.md, \"Sessions that do not answer\"). At most 60."),
}

assert list(KEYS) == [f.name for f in fields(DCP2DConfig)]


def _expect(key: str, value, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] = {value!r}: expected {what}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _host_port(v) -> bool:
    if not isinstance(v, str) or ":" not in v or "/" in v:
        return False
    host, port = v.rsplit(":", 1)
    return host.strip() != "" and port.isdigit() and 1 <= int(port) <= 65535


def parse_extra_config(extra: dict | None) -> DCP2DConfig:
    """Validated settings from ``KVTransferConfig.kv_connector_extra_config``.

    Raises ``ConfigError`` naming the first unknown key or invalid value.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config key(s) {unknown} for DCP2DConnector; "
                          f"valid keys: {sorted(KEYS)}")
    for key in ("bootstrap_host", "local_hostname"):
        if key in extra:
            v = extra[key]
            _expect(key, v, isinstance(v, str) and v.strip() != "", "a non-empty string")
    for key in ("stats_file", "auth_secret_file"):
        if key in extra:
            _expect(key, extra[key], isinstance(extra[key], str), "a file path string")
    if "bootstrap_port" in extra:
        v = extra["bootstrap_port"]
        _expect("bootstrap_port", v, _is_int(v) and 1 <= v <= 65535, "an int port in [1, 65535]")
    if "http_bootstrap_port" in extra:
        v = extra["http_bootstrap_port"]
        _expect("http_bootstrap_port", v, _is_int(v) and -1 <= v <= 65535,
                "an int port in [1, 65535], 0 (off) or -1 (VLLM_MOONCAKE_BOOTSTRAP_PORT)")
    if "cp_size" in extra:
        v = extra["cp_size"]
        _expect("cp_size", v, _is_int(v) and v >= 0, "an int >= 0 (0 = tensor-parallel size)")
    for key in ("transfer_timeout_s", "max_transfer_timeout_s", "send_timeout_s", "claim_timeout_s",
                "prefill_wait_s", "cancel_grace_s", "max_prefill_wait_s", "fence_s"):
        if key in extra:
            v = extra[key]
            _expect(key, v, _is_num(v) and 0 < v <= 86400, "seconds, a number in (0, 86400]")
            extra[key] = float(v)
    if "handshake_timeout_s" in extra:
        v = extra["handshake_timeout_s"]
        _expect("handshake_timeout_s", v, _is_num(v) and 0 < v <= 60, "seconds, a number in (0, 60]")
        extra["handshake_timeout_s"] = float(v)
    if "cpu_poll_sleep_us" in extra:
        v = extra["cpu_poll_sleep_us"]
        _expect("cpu_poll_sleep_us", v, _is_int(v) and 0 <= v <= 100_000, "an int in [0, 100000] microseconds")
    if "cpu_start_method" in extra:
        v = extra["cpu_start_method"]
        _expect("cpu_start_method", v, v in ("spawn", "fork"), 'one of "spawn", "fork"')
    if "max_quarantined_blocks" in extra:
        v = extra["max_quarantined_blocks"]
        _expect("max_quarantined_blocks", v, _is_int(v) and v >= 0, "an int >= 0 blocks (0 = a quarter of a rank's)")
    if "send_staging_mib" in extra:
        v = extra["send_staging_mib"]
        _expect("send_staging_mib", v, _is_int(v) and 0 <= v <= 65536, "an int in [0, 65536] MiB (0 = off)")
    if "layer_split" in extra:
        v = extra["layer_split"]
        _expect("layer_split", v, v in ("auto", "on", "off"), 'one of "auto", "on", "off"')
    for key in ("release_unfetched", "verify_kv"):
        if key in extra:
            _expect(key, extra[key], isinstance(extra[key], bool), "a bool (true or false)")
    if "protocol" in extra:
        v = extra["protocol"]
        _expect("protocol", v, v in ("tcp", "rdma"), 'one of "tcp", "rdma"')
    for key in ("router_discovery_address", "router_http_address"):
        if key in extra:
            _expect(key, extra[key], extra[key] == "" or _host_port(extra[key]), '"host:port" (port in [1, 65535]) or ""')
    cfg = DCP2DConfig(**extra)
    if cfg.router_discovery_address and not cfg.router_http_address:
        raise ConfigError(f"kv_connector_extra_config['router_discovery_address'] = {cfg.router_discovery_address!r} "
                          "needs kv_connector_extra_config['router_http_address']: expected the \"host:port\" the "
                          "router sends this instance's requests to (its vllm serve --host/--port)")
    if cfg.transfer_timeout_s > cfg.max_transfer_timeout_s:
        raise ConfigError(f"kv_connector_extra_config['transfer_timeout_s'] = {cfg.transfer_timeout_s}: expected "
                          f"at most max_transfer_timeout_s = {cfg.max_transfer_timeout_s}")
    return cfg


def markdown_table() -> str:
    """The docs table of every key (docs/config.md, docs/connector.md): name, default, side, meaning."""
    defaults = DCP2DConfig()
    rows = ["| key | default | side | meaning |", "|---|---|---|---|"]
    for key, (side, doc) in KEYS.items():
        rows.append(f"| `{key}` | `{getattr(defaults, key)!r}` | {side} | {doc} |")
    return "\n".join(rows)
