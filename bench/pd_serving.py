"""Prefill -> decode serving through the PD proxy: spin vs sleep, sequential vs pipelined.

Starts, per ``cpu_poll_sleep_us`` setting, the demo's cluster on loopback (tiny
``llama-mqa`` in float32: prefill TP=2 = 2 layer-split CP ranks, decode TP=2
DCP=2) with a sequential and a ``--pipelined`` proxy, sends ``--requests``
prompts through each proxy one after another, and prints per case: requests
answered, median end-to-end latency, median fetch and write time of the
transfer (from ``stats_file``), layers written early (pipelining) and the CPU
cores the servers kept busy. ``cpu_poll_sleep_us=0`` is vLLM's own spinning
shared-memory queues (see docs/connector.md, "Known limitations").

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/pd_serving.py [--requests 6] [--sleep-us 500 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from vllm_dcp2d.testing.harness import free_port, post_json, proxy_server, read_stats, vllm_server, wait_all

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def session_cpu_s(sids: set[int]) -> float:
    """CPU seconds (user + system) of every live process in the sessions ``sids``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2:].split()  # fields from "state" on: sid is [3], utime/stime [11]/[12]
        if int(f[3]) in sids:
            total += int(f[11]) + int(f[12])
    return total / tick


def post(url: str, body: dict, timeout_s: float) -> int:
    """HTTP status of one request; 0 if it got no answer in ``timeout_s``."""
    try:
        return post_json(url, body, timeout_s)[0]
    except OSError:  # socket timeout, connection refused/reset
        return 0


def prompt(i: int) -> list[int]:
    n = 70 + 37 * (i % 20)  # 70..773 tokens, a different content per request: no prefix-cache hits
    return [(i * 131 + k * 13) % 500 + 6 for k in range(n)]


def run_case(work: Path, model: str, sleep_us: int, requests: int, timeout_s: float) -> list[dict]:
    stats = work / "stats.jsonl"
    common = {"stats_file": str(stats), "cpu_poll_sleep_us": sleep_us}
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, block_size=32,
                          dtype="float32", extra_config={**common, "bootstrap_port": free_port()})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2, block_size=32,
                         dtype="float32", extra_config={**common, "transfer_timeout_s": timeout_s})
    proxies = {"sequential": proxy_server(free_port(), [prefill.url], [decode.url], work, "proxy"),
               "pipelined": proxy_server(free_port(), [prefill.url], [decode.url], work, "proxyp", pipelined=True)}
    procs = [prefill, decode, *proxies.values()]
    rows = []
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        sids = {p.proc.pid for p in (prefill, decode)}
        for i, (mode, proxy) in enumerate(proxies.items()):
            # one warm-up request per proxy (first Mooncake connections; the pipelined
            # proxy learns the prefill's bootstrap address from it), not counted
            post(proxy.url + "/v1/completions", body(model, [(7 * k + i) % 500 + 6 for k in range(40)]), timeout_s)
            before, cpu0, t0 = len(read_stats(stats)), session_cpu_s(sids), time.monotonic()
            lat, ok = [], 0
            for r in range(requests):
                t = time.monotonic()
                status = post(proxy.url + "/v1/completions", body(model, prompt(1000 * i + r)), timeout_s)
                lat.append(time.monotonic() - t)
                ok += status == 200
            wall = time.monotonic() - t0
            recs = [x for x in read_stats(stats)[before:] if x.get("side") == "consumer" and x.get("ok")]
            rows.append({"sleep_us": sleep_us, "mode": mode, "ok": ok, "n": requests,
                         "e2e_ms": 1e3 * statistics.median(lat),
                         "fetch_ms": 1e3 * statistics.median([x["fetch_seconds"] for x in recs]) if recs else None,
                         "write_ms": 1e3 * statistics.median([x["seconds"] for x in recs]) if recs else None,
                         "early": statistics.mean([x["early_layers"] for x in recs]) if recs else None,
                         "cores": (session_cpu_s(sids) - cpu0) / wall})
    finally:
        for p in reversed(procs):
            p.stop()
    return rows


def body(model: str, ids: list[int]) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    from vllm_dcp2d.testing.tiny_models import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--sleep-us", type=int, nargs="+", default=[500, 0])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request and per fetch")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dcp2d-bench-pd-"))
    model = build_tiny_model("llama-mqa", work / "model")
    rows = []
    for us in a.sleep_us:
        rows += run_case(work / f"sleep{us}", model, us, a.requests, a.timeout)
    longest = max(len(prompt(i)) for i in range(a.requests))
    print(f"\nprefill TP=2 (2 layer-split CP ranks) -> decode TP=2 DCP=2, tiny llama-mqa fp32, {a.requests} requests "
          f"of 70-{longest} prompt tokens + 8 output tokens per case; logs in {work}\n")
    print(f"{'cpu_poll_sleep_us':>17} {'proxy':>10} {'ok':>5} {'e2e ms':>8} {'fetch ms':>9} {'write ms':>9} "
          f"{'early layers':>12} {'cores busy':>10}")
    print("-" * 87)
    for r in rows:
        print(f"{r['sleep_us']:>17} {r['mode']:>10} {r['ok']:>2}/{r['n']:<2} {r['e2e_ms']:>8.0f} "
              f"{fmt(r['fetch_ms'], '9.1f')} {fmt(r['write_ms'], '9.2f')} {fmt(r['early'], '12.2f')} "
              f"{r['cores']:>10.2f}")
    print("\nmedians over the requests; fetch = decode rank's whole fetch, write = one path's Mooncake writes;"
          "\nearly layers = mean per path of the 2 layers each CP rank sends; cores busy = CPU seconds of the"
          "\nprefill and decode servers per second of the case.")


if __name__ == "__main__":
    main()
