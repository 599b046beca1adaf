"""The seed's production claim as a workload: the concurrency cliff (issue 49, item 2).

"As long as decode KV fits your concurrency demand, TTFT stays low; the moment you exceed
capacity by a single request's KV, latency is dictated by how long the current decode batch
takes to drain." One prefill (tiny ``llama-mqa`` fp32, TP=2 = 2 layer-split CP ranks) and, one
at a time, a decode of each ``--dcp`` size (TP = max(2, DCP); DCP=4 needs TP=4) behind
``vllm-dcp2d proxy``, every decode rank with the same ``--kv-cache-memory-bytes``: what holds
``--fit`` requests of the longest length at DCP=1 (the capacity planner says what each DCP
size then holds). Per concurrency (default: below DCP=1's capacity up to 4x it), two workloads
through the proxy, streamed, greedy:

  long   ``concurrency x --waves`` independent prompts of ``--prompt-tokens``, ``concurrency``
         clients at a time;
  agent  ``concurrency x --waves`` sessions, ``concurrency`` at a time, each ``--turns`` turns
         in a row, every turn the previous prompt plus ``--step`` tokens from ``--base``
         (prefix caching on: the decode fetches only each turn's new pages).

Per point: TTFT and TPOT p50/p99 (client side), the decode's queue time (vLLM's
``request_queue_time_seconds``: mean and the p99 bucket), output tokens per second of the
point, peak running and waiting requests and peak KV usage on the decode (``/metrics`` every
0.2 s), KV bytes on the wire per request (the decode's ``stats_file``), and how many answers
equal the prefill's own (asked directly after the point; a mismatch is reported, and the exit
status is 1). Printed as a table; ``--json`` and ``--png`` (matplotlib, ``pip install -e
.[bench]``: TTFT p99 and throughput against concurrency, one line per DCP size) beside it.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/cliff.py [--dcp 1,2,4] [--fit 3] \\
        [--concurrency 2,3,6,12] [--workloads long,agent] [--png cliff.png] [--json cliff.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dcp2d.reshard.capacity import DecodeMemory, capacity
from vllm_dcp2d.reshard.layout import cdiv
from vllm_dcp2d.local.servers import free_port, proxy_server, read_stats, running, vllm_server, wait_all
from vllm_dcp2d.local.tiny_models import build_tiny_model
from vllm_dcp2d.local.workload import (Sampler, hist_delta, host_cpu, pct, prompt_ids, references, scrape,
                                       session_prompt, stream)

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
PAGE, LAYERS, TOKEN_LAYER_BYTES = 32, 4, 256  # llama-mqa on one rank: 1 KV head x 32 fp32 dims, K and V
DECODE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def max_len_for(tokens: int) -> int:
    """``--max-model-len`` for requests of ``tokens`` (prompt and output), in whole pages: no more,
    or a DCP=1 decode sized for ``--fit 1`` would not start (vLLM wants one such request to fit)."""
    return cdiv(tokens, PAGE) * PAGE


def kv_bytes_for(fit: int, tokens: int, dcps: tuple[int, ...] = (1,)) -> int:
    """The KV budget per decode rank that holds ``fit`` requests of ``tokens`` (prompt and output)
    at DCP=1 and ``N x fit`` at every DCP size N of ``dcps``, plus the block vLLM keeps back (its
    null block). A DCP=N rank holds ``ceil(pages / N)`` of a request's pages, so a budget of
    ``fit`` requests' pages alone would hold fewer than ``N x fit`` there (5, not 6, at DCP=2 for
    71-page requests): the point at twice DCP=1's capacity would sit on DCP=2's own edge, and
    whether the last request started at once depended on timing (TTFT p99 ratios 0.19 and 0.89 in
    two runs). DCP=1 still holds ``fit`` while ``fit x (N - 1) < pages``."""
    pages = cdiv(tokens, PAGE)
    per_request = max(n * cdiv(pages, n) for n in (1, *dcps))
    return (fit * per_request + 1) * PAGE * LAYERS * TOKEN_LAYER_BYTES


def planner_fits(kv_bytes: int, dcp: int, tokens: int) -> int:
    """Requests of ``tokens`` the planner says a DCP group holds (less vLLM's null block)."""
    return capacity(DecodeMemory(kv_cache_bytes=kv_bytes - PAGE * LAYERS * TOKEN_LAYER_BYTES),
                    token_bytes=LAYERS * TOKEN_LAYER_BYTES, page_size=PAGE, dcp_size=dcp, request_tokens=tokens).requests


def prefill_server(work: Path, model: str, max_len: int, seqs: int, name: str = "prefill"):
    """The prefill instance: its KV held for a queueing decode as long as a point may last."""
    return vllm_server(name, model, free_port(), work, role="kv_producer", tp=2, block_size=PAGE, dtype="float32",
                       kv_cache_bytes=512 << 20, max_model_len=max_len, args=("--max-num-seqs", str(seqs)),
                       extra_config={"bootstrap_port": free_port(), "claim_timeout_s": 900.0,
                                     "send_timeout_s": 900.0})


def decode_server(work: Path, model: str, dcp: int, kv_bytes: int, max_len: int, seqs: int, stats: Path):
    return vllm_server(f"decode-dcp{dcp}", model, free_port(), work, role="kv_consumer", tp=max(2, dcp), dcp=dcp,
                       block_size=PAGE, dtype="float32", kv_cache_bytes=kv_bytes, max_model_len=max_len,
                       args=("--max-num-seqs", str(seqs)),
                       extra_config={"stats_file": str(stats), "transfer_timeout_s": 300.0})


def jobs(workload: str, a, concurrency: int, seed: int) -> list[list[list[int]]]:
    """The point's jobs, each a list of prompts a client sends in a row."""
    n = concurrency * a.waves
    if workload == "long":
        return [[prompt_ids(seed + i, a.prompt_tokens)] for i in range(n)]
    return [[session_prompt(seed + i, t, a.base, a.step) for t in range(a.turns)] for i in range(n)]


def run_point(proxy_url: str, prefill_url: str, decode_url: str, model: str, stats: Path, workload: str,
              concurrency: int, a, seed: int) -> dict:
    """One point of the sweep; returns its row (see the module doc)."""
    work = jobs(workload, a, concurrency, seed)
    recs0, q0 = len(read_stats(stats)), scrape(decode_url)

    def client(prompts: list[list[int]]):
        return [(ids, stream(proxy_url, model, ids, a.out_tokens, a.timeout)) for ids in prompts]

    t0 = time.monotonic()
    with Sampler({"decode": (decode_url, None)}, DECODE_METRICS, 0.2) as s, ThreadPoolExecutor(concurrency) as pool:
        done = [r for job in pool.map(client, work) for r in job]
    wall = time.monotonic() - t0
    time.sleep(1.0)  # the last fetches' stats lines
    queue = hist_delta(q0, scrape(decode_url), "vllm:request_queue_time_seconds", 99)
    moved = [r for r in read_stats(stats)[recs0:] if r.get("side") == "consumer" and r.get("ok")]
    ok = [(ids, x) for ids, x in done if x.ok]
    refs = references(prefill_url, model, [ids for ids, _ in ok], a.out_tokens, a.timeout)
    equal = sum(x.text == ref for (_, x), ref in zip(ok, refs))
    return {"workload": workload, "concurrency": concurrency, "requests": len(done), "ok": len(ok), "equal": equal,
            "errors": sorted({x.error[:120] for _, x in done if not x.ok}),
            "ttft_p50": pct([x.ttft for _, x in ok], 50), "ttft_p99": pct([x.ttft for _, x in ok], 99),
            "tpot_p50": pct([x.tpot for _, x in ok], 50), "tpot_p99": pct([x.tpot for _, x in ok], 99),
            "queue_mean": queue[0], "queue_p99_le": queue[1], "tok_s": sum(x.tokens for _, x in ok) / wall,
            "peak_running": s.peak("decode", DECODE_METRICS[0]), "peak_waiting": s.peak("decode", DECODE_METRICS[1]),
            "peak_kv": s.peak("decode", DECODE_METRICS[2]), "bytes_per_req": sum(r["bytes"] for r in moved) / max(1, len(ok)),
            "wall_s": wall}


HEAD = (f"{'workload':>8} {'DCP':>3} {'TP':>2} {'fits':>4} {'conc':>4} {'ok':>7} {'equal':>5} {'TTFT p50':>8} "
        f"{'p99 s':>6} {'TPOT p50':>8} {'p99 ms':>6} {'queue s':>7} {'q p99<=':>7} {'tok/s':>6} {'run':>4} "
        f"{'wait':>4} {'KV':>5} {'MB/req':>6}")


def fmt_row(r: dict) -> str:
    return (f"{r['workload']:>8} {r['dcp']:>3} {r['tp']:>2} {r['fits']:>4} {r['concurrency']:>4} "
            f"{r['ok']:>3}/{r['requests']:<3} {r['equal']:>5} {r['ttft_p50']:>8.2f} {r['ttft_p99']:>6.2f} "
            f"{1e3 * r['tpot_p50']:>8.1f} {1e3 * r['tpot_p99']:>6.1f} {r['queue_mean']:>7.2f} {r['queue_p99_le']:>7.3g} "
            f"{r['tok_s']:>6.1f} {r['peak_running']:>4.0f} {r['peak_waiting']:>4.0f} {r['peak_kv']:>5.2f} "
            f"{r['bytes_per_req'] / 1e6:>6.2f}")


def plot(rows: list[dict], path: Path) -> str:
    """TTFT p99 and output throughput against concurrency, one line per DCP size (dotted: the
    requests its group holds), a row of plots per workload; returns what was written or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[bench]')"
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.6 * len(workloads)), squeeze=False)
    for i, w in enumerate(workloads):
        for dcp in sorted({r["dcp"] for r in rows}):
            pts = sorted((r["concurrency"], r["ttft_p99"], r["tok_s"]) for r in rows
                         if r["workload"] == w and r["dcp"] == dcp)
            fits = next(r["fits"] for r in rows if r["dcp"] == dcp)
            for j in (0, 1):
                line, = axes[i][j].plot([p[0] for p in pts], [p[j + 1] for p in pts], marker="o", label=f"DCP={dcp}")
                axes[i][j].axvline(fits, color=line.get_color(), ls=":", lw=1)  # what the group holds
        axes[i][0].set(title=f"{w}: TTFT p99", xlabel="concurrent requests" if w == "long" else "concurrent sessions",
                       ylabel="s")
        axes[i][1].set(title=f"{w}: output throughput", xlabel=axes[i][0].get_xlabel(), ylabel="tokens/s")
        for ax in axes[i]:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcp", default="1,2,4")
    ap.add_argument("--fit", type=int, default=3, help="requests of the longest length DCP=1 holds")
    ap.add_argument("--concurrency", default="", help="comma-separated (default: fit-1, fit, 2 fit, 4 fit)")
    ap.add_argument("--workloads", default="long,agent")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--out-tokens", type=int, default=160)
    ap.add_argument("--base", type=int, default=1500, help="agent: the first turn's prompt tokens")
    ap.add_argument("--step", type=int, default=300, help="agent: tokens each turn adds")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--waves", type=int, default=1, help="jobs per client")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--work", default="", help="directory for the model and logs (default: a temporary one)")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--png", default="", help="write the plot here")
    ap.add_argument("--replot", default="", metavar="JSON", help="only draw --png from an earlier run's --json")
    a = ap.parse_args(argv)
    if a.replot:
        print(plot(json.loads(Path(a.replot).read_text())["rows"], Path(a.png or "cliff.png")))
        return 0
    dcps = [int(x) for x in a.dcp.split(",")]
    conc = [int(x) for x in a.concurrency.split(",")] if a.concurrency else sorted({max(1, a.fit - 1), a.fit,
                                                                                    2 * a.fit, 4 * a.fit})
    workloads = a.workloads.split(",")
    if min(dcps + conc + [a.fit, a.out_tokens, a.turns, a.waves]) < 1 or set(workloads) - {"long", "agent"}:
        ap.error("expected positive sizes and counts, workloads among long,agent")
    longest = max(a.prompt_tokens if "long" in workloads else 0,
                  a.base + a.step * (a.turns - 1) if "agent" in workloads else 0) + a.out_tokens
    max_len = max_len_for(longest)
    kv = kv_bytes_for(a.fit, longest, tuple(dcps))
    work = Path(a.work or tempfile.mkdtemp(prefix="dcp2d-cliff-"))
    model = build_tiny_model("llama-mqa", work / "model", dtype="float32")
    seqs = 4 * max(conc) * max(1, a.turns)
    print(f"{host_cpu()}; decode KV {kv:,} B per rank (DCP=1 holds {a.fit} of {longest} tokens); logs in {work}",
          flush=True)
    rows, prefill = [], prefill_server(work, model, max_len, seqs)
    try:
        prefill.start()
        wait_all([prefill], 900)
        for dcp in dcps:
            stats = work / f"stats-dcp{dcp}.jsonl"
            decode = decode_server(work, model, dcp, kv, max_len, seqs, stats)
            proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, name=f"proxy-dcp{dcp}")
            proxy.cmd += ["--timeout", str(a.timeout)]
            with running([decode, proxy], 900):
                # one request first, not counted: the first Mooncake sessions and the engines' first steps
                stream(proxy.url, model, prompt_ids(dcp, 100), 4, a.timeout)
                for w in workloads:
                    for c in conc:
                        r = run_point(proxy.url, prefill.url, decode.url, model, stats, w, c, a,
                                      seed=10**7 * dcp + 10**5 * c + (0 if w == "long" else 5 * 10**4))
                        rows.append({**r, "dcp": dcp, "tp": max(2, dcp), "fits": planner_fits(kv, dcp, longest)})
                        print(fmt_row(rows[-1]), flush=True)
    finally:
        prefill.stop()
    print(f"\n{host_cpu()}; prefill TP=2 (layer-split) -> decode TP=max(2, DCP), tiny llama-mqa fp32, {kv:,} B KV per "
          f"decode rank, {a.out_tokens} output tokens; long: {a.prompt_tokens}-token prompts; agent: {a.turns} turns "
          f"from {a.base} tokens, +{a.step} each\n\n{HEAD}")
    for r in rows:
        print(fmt_row(r))
    print("fits = requests of the longest length the DCP group holds (capacity planner); TTFT/TPOT at the client; "
          "queue = the decode's queue time (mean; q p99<= its p99 bucket); run/wait = peak requests on the decode; "
          "KV = peak KV usage; MB/req = KV bytes on the wire per request")
    bad = [(r["workload"], r["dcp"], r["concurrency"], r["errors"]) for r in rows if r["equal"] != r["requests"]]
    for b in bad:
        print(f"NOT EQUAL to the prefill's own or failed: {b}")
    if a.json:
        Path(a.json).write_text(json.dumps({"host": host_cpu(), "kv_bytes": kv, "rows": rows}, indent=1))
    if a.png:
        print(plot(rows, Path(a.png)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
