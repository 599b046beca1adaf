"""``vllm-dcp2d proxy`` command line."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from .app import KEEPALIVE_S, Proxy
from .routing import Policy

log = logging.getLogger("vllm_dcp2d.proxy")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-dcp2d proxy",
                                description="OpenAI-compatible prefill/decode proxy for DCP2DConnector.")
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="prefill instance base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="decode instance base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per upstream call")
    p.add_argument("--pipelined", action="store_true",
                   help="send prefill and decode at once (layer-pipelined transfer); see the module doc")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S",
                   help="seconds between /health polls of each upstream; 0 turns health checks off")
    p.add_argument("--health-timeout", type=float, default=5.0, metavar="S",
                   help="seconds a /health poll may take before the upstream counts as unhealthy")
    p.add_argument("--keepalive", type=float, default=KEEPALIVE_S, metavar="S",
                   help="seconds an idle upstream connection is reused; below the upstreams' own keep-alive "
                        "(vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) so the proxy never sends on a connection the "
                        "upstream is closing (default: %(default)s)")
    p.add_argument("--batch-concurrency", type=int, default=8, metavar="N",
                   help="PD pairs in flight at once for the prompts of one batched /v1/completions request")
    r = p.add_argument_group("routing", "which decode serves a request (vllm_dcp2d/proxy/routing.py); each decode "
                                        "says its DCP size, lengths and KV on its /metrics")
    r.add_argument("--routing", choices=("groups", "least-loaded"), default="groups",
                   help="groups: the smallest DCP size that fits the request with room, sessions back to their "
                        "decode; least-loaded: fewest calls in flight only (default: %(default)s)")
    r.add_argument("--kv-fraction", type=float, default=Policy.kv_fraction, metavar="F",
                   help="a request fits a decode with room if its KV tokens are at most F x the decode's free KV "
                        "(default: %(default)s)")
    r.add_argument("--affinity-entries", type=int, default=Policy.affinity_entries, metavar="N",
                   help="prefix and session keys remembered (LRU, ~125 B each); 0 turns affinity off "
                        "(default: %(default)s)")
    r.add_argument("--affinity-match", type=float, default=Policy.affinity_match, metavar="F",
                   help="share of a prompt a remembered prefix must cover to send it back (default: %(default)s)")
    r.add_argument("--affinity-slack", type=int, default=Policy.slack, metavar="N",
                   help="calls in flight a session's decode may have above the least loaded one before the "
                        "session moves (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        policy = None if args.routing == "least-loaded" else Policy(
            args.kv_fraction, args.affinity_entries, args.affinity_match, args.affinity_slack)
        proxy = Proxy(args.prefill, args.decode, args.timeout, args.pipelined, args.health_interval,
                      args.health_timeout, args.batch_concurrency, policy, args.keepalive)
    except ValueError as e:
        raise SystemExit(f"vllm-dcp2d proxy: {e}")
    log.info("proxy on http://%s:%d: prefill %s, decode %s, health checks %s, routing %s", args.host, args.port,
             proxy.prefill, proxy.decode,
             f"every {args.health_interval} s" if args.health_interval > 0 else "off", policy or "least-loaded")
    # handler_cancellation: a client that goes away cancels its handler, which closes the
    # upstream calls (vLLM aborts them) instead of waiting for answers nobody reads
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, handler_cancellation=True)
    return 0
