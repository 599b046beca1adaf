"""``vllm-dcp2d proxy`` command line."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from .app import Proxy

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
    p.add_argument("--batch-concurrency", type=int, default=8, metavar="N",
                   help="PD pairs in flight at once for the prompts of one batched /v1/completions request")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        proxy = Proxy(args.prefill, args.decode, args.timeout, args.pipelined, args.health_interval,
                      args.health_timeout, args.batch_concurrency)
    except ValueError as e:
        raise SystemExit(f"vllm-dcp2d proxy: {e}")
    log.info("proxy on http://%s:%d: prefill %s, decode %s, health checks %s", args.host, args.port,
             proxy.prefill, proxy.decode,
             f"every {args.health_interval} s" if args.health_interval > 0 else "off")
    # handler_cancellation: a client that goes away cancels its handler, which closes the
    # upstream calls (vLLM aborts them) instead of waiting for answers nobody reads
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, handler_cancellation=True)
    return 0
