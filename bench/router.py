"""The PD fronts side by side, and the prefill's KV after decodes that failed (issue 27).

Part 1 starts the demo's cluster on loopback (tiny ``llama-mqa`` in float32: prefill
TP=2 = 2 layer-split CP ranks, decode TP=2 DCP=2) with four fronts: our proxy,
vLLM's router in NIXL mode, in Mooncake mode and with no instance list, the
instances registering with it (``router_discovery_address``; ``vllm-router`` 0.1.17), and sends
the same ``--requests`` prompts through each, one after another, front by front
in turn, with every answer checked against the prefill's own (after one warm-up call
per front, not counted). Printed per front: end-to-end p50 / p99 / max.

Part 2 is what a router without retries leaves behind: two more prefill instances
(TP=1), one with ``claim_timeout_s`` (``--claim``) and one with it at
``send_timeout_s`` (what every prefill did before the key), each behind a vLLM
router in NIXL mode whose one decode answers 500 to every completion (healthy on
``/health``). After a burst of ``--burst`` requests (all fail at the decode), the
prefills' ``vllm:kv_cache_usage_perc`` is sampled every second: printed, the usage
at a few points and when it reached 0.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/router.py [--requests 40] [--burst 6] [--claim 10]
        [--skip-fronts] [--skip-failed]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from vllm_dcp2d.local.servers import (free_port, kv_cache_usage, post_json, proxy_server, router_server,
                                        vllm_server, wait_all)
from vllm_dcp2d.local.tiny_models import build_tiny_model

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
PAGE, SEND_TIMEOUT_S = 32, 120.0


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


def body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def fronts(work: Path, model: str, n: int) -> None:
    disc, ports = f"127.0.0.1:{free_port()}", (free_port(), free_port())
    joins = [{"router_discovery_address": disc, "router_http_address": f"127.0.0.1:{p}"} for p in ports]
    prefill = vllm_server("prefill", model, ports[0], work, role="kv_producer", tp=2, block_size=PAGE,
                          dtype="float32", extra_config={"bootstrap_port": free_port(),
                                                         "send_timeout_s": SEND_TIMEOUT_S, **joins[0]})
    decode = vllm_server("decode", model, ports[1], work, role="kv_consumer", tp=2, dcp=2, block_size=PAGE,
                         dtype="float32", extra_config={"transfer_timeout_s": 60.0, **joins[1]})
    front = {"proxy": proxy_server(free_port(), [prefill.url], [decode.url], work),
             "router nixl": router_server(free_port(), [prefill], [decode], work, "nixl", "router_nixl"),
             "router mooncake": router_server(free_port(), [prefill], [decode], work, "mooncake", "router_mc"),
             "router discovery": router_server(free_port(), [], [], work, name="router_disc", discovery=disc)}
    procs = [prefill, decode, *front.values()]
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        prompts = [ids(100 + 37 * (i % 7), 1000 + i) for i in range(n)]  # 100-322 tokens, distinct
        refs = []
        for p in prompts:
            status, out = post_json(prefill.url + "/v1/completions", body(model, p), timeout_s=120)
            assert status == 200, out
            refs.append(out["choices"][0]["token_ids"])
        for name, f in front.items():  # warm-up, not counted: each front's first call (connections, caches)
            status, out = post_json(f.url + "/v1/completions", body(model, ids(50, 999)), timeout_s=120)
            assert status == 200, (name, out)
        seconds = {name: [] for name in front}
        wrong = {name: 0 for name in front}
        for i, p in enumerate(prompts):  # the fronts take turns: each sees the machine in the same state
            for name, f in front.items():
                t0 = time.monotonic()
                status, out = post_json(f.url + "/v1/completions", body(model, p), timeout_s=120)
                seconds[name].append(time.monotonic() - t0)
                wrong[name] += status != 200 or out["choices"][0]["token_ids"] != refs[i]
        print(f"\n## End to end through each front ({n} requests each, 8 output tokens, prefill TP=2 "
              f"layer-split -> decode TP=2 DCP=2, tiny llama-mqa fp32, loopback)\n")
        print("| front | answers equal to the prefill's own | p50 (s) | p99 (s) | max (s) |")
        print("|---|---|---|---|---|")
        for name, xs in seconds.items():
            print(f"| {name} | {n - wrong[name]}/{n} | {pct(xs, 50):.3f} | {pct(xs, 99):.3f} | {max(xs):.3f} |")
    finally:
        for p in reversed(procs):
            p.stop()


def failing_decode() -> tuple[int, threading.Thread]:
    """A decode that is healthy but answers 500 to every completion (a decode that failed)."""
    port = free_port()

    async def health(_):
        return web.json_response({})

    async def models(_):
        return web.json_response({"object": "list", "data": []})

    async def fail(_):
        return web.json_response({"error": {"message": "decode failed (bench)"}}, status=500)

    def run():
        app = web.Application()
        app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.post("/v1/completions", fail)])
        asyncio.run(_serve(app, port))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t


async def _serve(app, port: int) -> None:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    while True:
        await asyncio.sleep(3600)


def failed_decodes(work: Path, model: str, burst: int, claim: float) -> None:
    port, _ = failing_decode()
    from vllm_dcp2d.local.servers import Process

    dead = Process("dead-decode", [], port, work / "dead.log")  # only its url is used
    cases = {f"claim_timeout_s={claim:g}": claim, f"claim_timeout_s={SEND_TIMEOUT_S:g} (= send_timeout_s: before)":
             SEND_TIMEOUT_S}
    prefills = {name: vllm_server(f"p{i}", model, free_port(), work, role="kv_producer", tp=1, block_size=PAGE,
                                  dtype="float32", kv_cache_bytes=16 << 20,
                                  extra_config={"bootstrap_port": free_port(), "send_timeout_s": SEND_TIMEOUT_S,
                                                "claim_timeout_s": c})
                for i, (name, c) in enumerate(cases.items())}
    routers = {name: router_server(free_port(), [p], [dead], work, "nixl", f"router{i}")
               for i, (name, p) in enumerate(prefills.items())}
    procs = [*prefills.values(), *routers.values()]
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        for name, r in routers.items():
            for i in range(burst):
                status, _ = post_json(r.url + "/v1/completions", body(model, ids(600, 5000 + i)), timeout_s=120)
                assert status >= 400, (name, status)
        t0 = time.monotonic()
        usage = {name: [] for name in cases}
        while time.monotonic() - t0 < SEND_TIMEOUT_S + 15:
            for name, p in prefills.items():
                usage[name].append((time.monotonic() - t0, kv_cache_usage(p.url)))
            if all(u[-1][1] == 0.0 for u in usage.values()):
                break
            time.sleep(1.0)
        print(f"\n## Prefill KV usage after {burst} failed decodes behind vllm-router (NIXL mode, no retries; "
              f"600-token prompts, prefill TP=1, send_timeout_s={SEND_TIMEOUT_S:g})\n")
        marks = (0, 5, 10, 20, 60)
        print("| prefill | " + " | ".join(f"usage at {m} s" for m in marks) + " | back to 0 after (s) |")
        print("|---|" + "---|" * (len(marks) + 1))
        for name, us in usage.items():
            at = [next((u for t, u in us if t >= m), us[-1][1]) for m in marks]
            zero = next((t for t, u in us if u == 0.0), None)
            print(f"| {name} | " + " | ".join(f"{u:.1%}" for u in at) +
                  f" | {'not within %d s' % (SEND_TIMEOUT_S + 15) if zero is None else f'{zero:.0f}'} |")
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--burst", type=int, default=6)
    ap.add_argument("--claim", type=float, default=10.0)
    ap.add_argument("--skip-fronts", action="store_true")
    ap.add_argument("--skip-failed", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcp2d-router-") as tmp:
        work = Path(tmp)
        model = build_tiny_model("llama-mqa", work / "model")
        if not args.skip_fronts:
            fronts(work, model, args.requests)
        if not args.skip_failed:
            failed_decodes(work, model, args.burst, args.claim)


if __name__ == "__main__":
    main()
