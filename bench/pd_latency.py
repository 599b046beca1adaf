"""PD latency beside a colocated instance, per prompt length, and where PD's extra time goes (issue 29).

Cluster on loopback: tiny ``llama-mqa`` in float32 (a bench copy with 16K positions),
prefill TP=2 = 2 layer-split CP ranks (``kv_producer``), decode TP=2 DCP=2 with a
``stats_file``, and ``vllm-dcp2d proxy`` (sequential, and a second one ``--pipelined``); prefix caching off on both instances.
For each prompt length, ``--requests`` distinct prompts, each sent every way in
turn (so each way sees the machine in the same state), 8 output tokens, greedy:

  colocated   the prefill instance alone, as a plain request (how issue 29 measured it)
  colocated TP=2 DCP=2  a plain instance of the decode's own shape (issue 49): PD minus it
              is what the transfer costs, it minus colocated what DCP costs
  PD          through the proxy
  PD pipelined  through ``vllm-dcp2d proxy --pipelined`` (the decode asks first; layers
              go as they are computed)
  vllm-router nixl / mooncake  through vLLM's router (``vllm-router`` 0.1.17) in each
              PD protocol (docs/serving.md, "Behind vLLM's router")
  PD by hand  the proxy's two hops made from here and timed apart: the prefill
              (``proxy.app.prefill_body``: one token, ``do_remote_decode``) and the
              decode (``decode_body`` with the prefill's ``kv_transfer_params``)

Every answer must equal the colocated one (token ids); a mismatch stops the bench.
Printed, with the host's CPU and the flags that pick vLLM's CPU build: end-to-end p50 / p99 / max per
way, PD minus colocated (difference of the medians, issue 29's target) split into the transfer's
cost and DCP's, and the stages of PD by hand: the prefill hop, the
decode hop and inside it, from the decode's ``stats_file``: admit (its API server
receiving the request to the scheduler recording its load), the fetch (slowest decode
rank's ``fetch_seconds``), the wait from the fetch's end to the step that reported it
(``reported_after_seconds``), resume (that report to the request being scheduled),
its first step, and the rest (the other decode steps, HTTP, and the gaps between the
stages). A warm-up round per length is not counted.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/pd_latency.py \
        [--lengths 100,400,2000,8000] [--requests 30] [--out-tokens 8] [--no-routers] [--no-pipelined]

With ``--out-tokens 1`` the stages of PD by hand are a TTFT split: "rest" is then the
HTTP around the decode hop and the gaps between its stages.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from vllm_dcp2d.proxy.app import decode_body, prefill_body
from vllm_dcp2d.local.servers import (free_port, post_json, proxy_server, read_stats, router_server, vllm_server,
                                        wait_all)
from vllm_dcp2d.local.tiny_models import build_tiny_model
from vllm_dcp2d.local.workload import host_cpu, pct

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
PAGE = 32
OUT_TOKENS = 8      # --out-tokens; 1 makes the decode hop's "rest" the first decode step
MAX_LEN = 8448      # set from --lengths: the longest prompt and its output, in whole pages
COLOCATED_DCP = "colocated TP=2 DCP=2"


def long_model(path: Path, positions: int) -> str:
    """The tiny model with ``max_position_embeddings`` raised to ``positions`` (rope
    tables are computed, not learned: the weights stay as built)."""
    model = build_tiny_model("llama-mqa", path, dtype="float32")
    cfg_path = Path(model) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("max_position_embeddings", 0) < positions:
        cfg["max_position_embeddings"] = positions
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return model


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 13) % 500 + 6 for i in range(n)]


def body(model: str, ids: list[int]) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": OUT_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}


def timed(url: str, payload: dict) -> tuple[float, dict]:
    t0 = time.monotonic()
    status, out = post_json(url, payload, timeout_s=300)
    dt = time.monotonic() - t0
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {out}")
    return dt, out


def proxy_sums(url: str) -> dict[str, float]:
    """The proxy's own histograms (``proxy/metrics.py``): sample name -> value, for the
    ``_sum`` and ``_count`` of its request, prefill and (non-streamed) decode seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.endswith(("_sum", "_count")) and smp.labels.get("stream", "false") == "false":
                out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


def tokens(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def run(work: Path, lengths: list[int], n: int, kv_cache_dtype: str = "auto", routers: bool = True,
        pipelined: bool = True, proxy_args: tuple[str, ...] = ()) -> dict:
    """Start the cluster (``proxy_args``: more flags for both proxies), measure every way at every length, stop it; returns ``{"rows": [(length,
    {way: [seconds]})], "stages": [(length, {stage: [seconds]})], "inside": [(length, PD mean,
    {proxy histogram: mean})]}`` (``report`` prints them)."""
    model = long_model(work / "model", max(16384, MAX_LEN))
    stats = work / "decode-stats.jsonl"
    common = dict(block_size=PAGE, dtype="float32", kv_cache_bytes=256 << 20, max_model_len=MAX_LEN,
                  args=("--no-enable-prefix-caching", "--kv-cache-dtype", kv_cache_dtype))
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2,
                          extra_config={"bootstrap_port": free_port()}, **common)
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2,
                         extra_config={"stats_file": str(stats), "transfer_timeout_s": 120.0}, **common)
    # the decode's own shape without PD: PD minus it is the transfer's cost, it minus the
    # prefill instance (TP=2, DCP=1) is DCP's
    colocated_dcp = vllm_server("colocated-dcp2", model, free_port(), work, role="", tp=2, dcp=2, extra_config={},
                                **common)
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, args=proxy_args)
    procs = [prefill, decode, colocated_dcp, proxy]
    ways = {COLOCATED_DCP: colocated_dcp.url, "PD": proxy.url}
    if pipelined:
        procs.append(proxy_server(free_port(), [prefill.url], [decode.url], work, name="proxy-pipelined",
                                  pipelined=True, args=proxy_args))
        ways["PD pipelined"] = procs[-1].url
    for mode in ("nixl", "mooncake") if routers else ():
        procs.append(router_server(free_port(), [prefill], [decode], work, mode, f"router-{mode}"))
        ways[f"vllm-router {mode}"] = procs[-1].url
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        rows, stages, inside = [], [], []
        for length in lengths:
            e2e = {"colocated": [], **{name: [] for name in ways}, "PD by hand": []}
            hops = {k: [] for k in ("prefill hop", "decode hop", "admit", "fetch", "reported after", "resume",
                                    "first step", "rest")}
            keys, sums = [], {}
            for i in range(n + 1):  # round 0 warms up
                if i == 1:
                    sums = proxy_sums(proxy.url)
                ids = prompt(length, 1000 * length + i)
                dt, out = {}, {}
                # each round starts at another way: an engine that just ran (its workers still
                # spinning on the 2 cores) must not always slow the same next way
                order = ["colocated", *ways, "PD by hand"]
                for name in order[i % len(order):] + order[:i % len(order)]:
                    if name == "PD by hand":
                        dt_pre, pre = timed(prefill.url + "/v1/completions",
                                            prefill_body(body(model, ids), f"bench-{length}-{i}"))
                        dt_dec, out[name] = timed(decode.url + "/v1/completions",
                                                  decode_body(body(model, ids), pre["kv_transfer_params"]))
                        dt[name] = dt_pre + dt_dec
                    else:
                        url = prefill.url if name == "colocated" else ways[name]
                        dt[name], out[name] = timed(url + "/v1/completions", body(model, ids))
                for name in order:
                    assert tokens(out[name]) == tokens(out["colocated"]), (length, i, name, tokens(out[name]),
                                                                           tokens(out["colocated"]))
                if i == 0:
                    continue
                for name, v in dt.items():
                    e2e[name].append(v)
                hops["prefill hop"].append(dt_pre)
                hops["decode hop"].append(dt_dec)
                keys.append(pre["kv_transfer_params"]["remote_request_id"])
            after = proxy_sums(proxy.url)
            mean = {k.removeprefix("vllm_dcp2d_proxy_").removesuffix("_seconds_sum"):
                    (after[k] - sums.get(k, 0.0)) / max(1.0, after[k[:-4] + "_count"] - sums.get(k[:-4] + "_count", 0))
                    for k in after if k.endswith("_seconds_sum")}
            inside.append((length, float(np.mean(e2e["PD"])), mean))
            time.sleep(1.0)  # stats lines are written in the step that reports the fetch
            by_key: dict[str, list[dict]] = {}
            for r in read_stats(stats):
                by_key.setdefault(r.get("transfer_key"), []).append(r)
            for k, dec in zip(keys, hops["decode hop"]):
                paths = [r for r in by_key.get(k, []) if r.get("ok")]  # one per path and decode TP rank
                line = [r for r in by_key.get(k, []) if r.get("event") == "first_step"]  # the decode scheduler's
                stage = {"fetch": max((r["fetch_seconds"] for r in paths), default=float("nan")),
                         "reported after": max((r["reported_after_seconds"] for r in paths), default=float("nan"))}
                for name in ("admit", "resume", "first_step"):
                    stage[name.replace("_", " ")] = line[0][f"{name}_seconds"] if line else float("nan")
                for name, v in stage.items():
                    hops[name].append(v)
                hops["rest"].append(dec - sum(v for v in stage.values() if v == v))
            rows.append((length, e2e))
            stages.append((length, hops))
        return {"rows": rows, "stages": stages, "inside": inside}
    finally:
        for p in reversed(procs):
            p.stop()


def split(e2e: dict[str, list[float]]) -> dict[str, float]:
    """Medians, ms: PD minus colocated (what PD adds), and that split into the transfer's cost
    (PD minus the decode's shape colocated) and DCP's (the decode's shape minus the prefill's)."""
    p50 = {k: pct(v, 50) * 1e3 for k, v in e2e.items()}
    return {"pd": p50["PD"] - p50["colocated"], "transfer": p50["PD"] - p50[COLOCATED_DCP],
            "dcp": p50[COLOCATED_DCP] - p50["colocated"]}


def report(res: dict, n: int) -> None:
    rows, stages, inside = res["rows"], res["stages"], res["inside"]
    print(f"\n## PD and colocated end to end ({n} requests per length, {OUT_TOKENS} output tokens, "
          "prefill TP=2 layer-split -> decode TP=2 DCP=2, tiny llama-mqa fp32, loopback, prefix caching off; "
          f"{host_cpu()})\n")
    print("| prompt tokens | way | p50 (s) | p99 (s) | max (s) | p50 minus colocated p50 (ms) |")
    print("|---|---|---|---|---|---|")
    for length, e2e in rows:
        base = pct(e2e["colocated"], 50)
        for way, xs in e2e.items():
            print(f"| {length} | {way} | {pct(xs, 50):.3f} | {pct(xs, 99):.3f} | {max(xs):.3f} | "
                  f"{(pct(xs, 50) - base) * 1e3:+.0f} |")
    print(f"\n## What PD adds, split by cause (p50, ms; {host_cpu()})\n")
    print(f"| prompt tokens | PD minus colocated | transfer: PD minus {COLOCATED_DCP} | "
          f"DCP: {COLOCATED_DCP} minus colocated (TP=2, DCP=1) |")
    print("|---|---|---|---|")
    for length, e2e in rows:
        s = split(e2e)
        print(f"| {length} | {s['pd']:+.0f} | {s['transfer']:+.0f} | {s['dcp']:+.0f} |")
    print("\n## Stages of PD by hand (ms: p50 / p99 / max)\n")
    names = list(stages[0][1])
    print("| prompt tokens | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for length, hops in stages:
        cells = [f"{pct(hops[k], 50) * 1e3:.0f} / {pct(hops[k], 99) * 1e3:.0f} / "
                 f"{max(hops[k]) * 1e3:.0f}" for k in names]
        print(f"| {length} | " + " | ".join(cells) + " |")
    print("\n## Inside the proxy (means, ms; from its own histograms)\n")
    print("| prompt tokens | PD end to end | proxy request | its prefill call | its decode call | "
          "proxy's own (request - calls) | outside the proxy (end to end - request) |")
    print("|---|---|---|---|---|---|---|")
    for length, e2e_mean, m in inside:
        req, pre, dec = m.get("request", float("nan")), m.get("prefill", float("nan")), m.get("decode", float("nan"))
        print(f"| {length} | {e2e_mean * 1e3:.0f} | {req * 1e3:.0f} | {pre * 1e3:.0f} | {dec * 1e3:.0f} | "
              f"{(req - pre - dec) * 1e3:.0f} | {(e2e_mean - req) * 1e3:.0f} |")


def main() -> None:
    global OUT_TOKENS, MAX_LEN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="100,400,2000,8000")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--out-tokens", type=int, default=OUT_TOKENS)
    ap.add_argument("--work", default="", help="directory for the model and logs (default: a temporary one)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="both instances' --kv-cache-dtype (e.g. fp8)")
    ap.add_argument("--no-routers", action="store_true", help="skip the two vllm-router ways")
    ap.add_argument("--no-pipelined", action="store_true", help="skip the pipelined proxy")
    ap.add_argument("--proxy-args", default="", help="more flags for the proxies, e.g. '--routing least-loaded'")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.out_tokens < 1 or min(lengths) < 1:
        raise SystemExit(f"--out-tokens {a.out_tokens}, --lengths {a.lengths}: expected positive counts")
    OUT_TOKENS = a.out_tokens
    MAX_LEN = max(MAX_LEN, -(-(max(lengths) + OUT_TOKENS) // PAGE) * PAGE + PAGE)
    with tempfile.TemporaryDirectory() as d:
        report(run(Path(a.work or d), lengths, a.requests, a.kv_cache_dtype, not a.no_routers, not a.no_pipelined,
                   tuple(a.proxy_args.split())),
               a.requests)


if __name__ == "__main__":
    main()
