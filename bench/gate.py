"""A regression gate for the serving path (issue 49, item 5): not a CI test (timings are
noisy), a table to quote when resolving an issue that touches the serving path.

Runs, in about 5 minutes on a quiet 2-core host:

* PD latency at 100 and 2,000 tokens (``pd_latency.py``, ``--requests`` per length, no router or
  pipelined ways): what PD adds over colocated, and its transfer part (PD minus a colocated
  instance of the decode's shape, TP=2 DCP=2), p50 ms;
* the cliff at one point (``cliff.py``, the long workload): ``--fit`` x 2 concurrent requests of
  2,000 + 160 tokens on decodes of DCP 1 and 2 with the KV of ``--fit`` requests per rank: DCP=2's
  TTFT p99 and output throughput over DCP=1's;
* the TPOT ratio: DCP=2's TPOT p50 over DCP=1's at ``--fit`` concurrent requests (both hold them).

Each figure is compared with the baseline of this host's class (``amx``, ``avx512``, ``avx2``: the
flags that pick vLLM's CPU build and kernels) in BENCHMARKS.md's fenced ``gate`` block; a
figure worse than its baseline by more than ``--tolerance`` percent (and, for ms, by more than
``--floor-ms``) reads "regressed". ``--record`` prints this run as a ``gate`` block for the host.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/gate.py [--tolerance 25] [--record]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches
import cliff  # noqa: E402
import pd_latency  # noqa: E402
from vllm_dcp2d.local.servers import free_port, proxy_server, wait_all  # noqa: E402
from vllm_dcp2d.local.tiny_models import build_tiny_model  # noqa: E402
from vllm_dcp2d.local.workload import host_cpu  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
LOWER_IS_BETTER = {"pd_ms@100": True, "pd_ms@2000": True, "transfer_ms@100": True, "transfer_ms@2000": True,
                   "cliff_ttft_p99_ratio": True, "cliff_throughput_ratio": False, "tpot_ratio": True}


def host_class(cpu: str) -> str:
    flags = cpu.rpartition(":")[2].split()
    return "amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2"


def baselines(text: str, cls: str) -> dict[str, tuple[float, str]]:
    """``metric -> (value, source)`` of the ``gate`` block's lines for host class ``cls``
    (``CLASS METRIC VALUE SOURCE...``; ``#`` starts a comment)."""
    out = {}
    for block in re.findall(r"```gate\n(.*?)```", text, re.S):
        for line in block.splitlines():
            parts = line.split("#", 1)[0].split(None, 3)
            if len(parts) >= 3 and parts[0] == cls:
                out[parts[1]] = (float(parts[2]), parts[3] if len(parts) > 3 else "")
    return out


def verdict(metric: str, now: float, base: float | None, tolerance: float, floor_ms: float) -> str:
    if base is None:
        return "no baseline"
    worse = (now - base) if LOWER_IS_BETTER[metric] else (base - now)
    rel = worse / abs(base) * 100 if base else float("inf")
    if rel > tolerance and ("_ms@" not in metric or worse > floor_ms):
        return f"regressed by {rel:.0f}%"
    return f"ok ({'worse' if worse > 0 else 'better'} by {abs(rel):.0f}%)"


def pd_figures(work: Path, requests: int) -> dict[str, float]:
    res = pd_latency.run(work, [100, 2000], requests, routers=False, pipelined=False)
    out = {}
    for length, e2e in res["rows"]:
        s = pd_latency.split(e2e)
        out[f"pd_ms@{length}"], out[f"transfer_ms@{length}"] = s["pd"], s["transfer"]
    return out


def cliff_figures(work: Path, fit: int) -> dict[str, float]:
    a = SimpleNamespace(prompt_tokens=2000, out_tokens=160, waves=1, timeout=600.0, base=0, step=0, turns=1)
    max_len = cliff.max_len_for(2000 + 160)
    kv = cliff.kv_bytes_for(fit, 2000 + 160, (2,))
    model = build_tiny_model("llama-mqa", work / "model", dtype="float32")
    prefill = cliff.prefill_server(work, model, max_len, 4 * fit)
    decodes = {d: cliff.decode_server(work, model, d, kv, max_len, 4 * fit, work / f"stats-{d}.jsonl") for d in (1, 2)}
    proxies = {d: proxy_server(free_port(), [prefill.url], [p.url], work, name=f"proxy-{d}") for d, p in decodes.items()}
    procs = [prefill, *decodes.values(), *proxies.values()]
    rows = {}
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        for d in (1, 2):
            for c in (fit, 2 * fit):
                rows[d, c] = cliff.run_point(proxies[d].url, prefill.url, decodes[d].url, model,
                                             work / f"stats-{d}.jsonl", "long", c, a, seed=10**7 * d + 10**5 * c)
                if rows[d, c]["equal"] != rows[d, c]["requests"]:
                    raise SystemExit(f"DCP={d} at {c}: answers differ from the prefill's own: {rows[d, c]}")
    finally:
        for p in reversed(procs):
            p.stop()
    hi = 2 * fit
    return {"cliff_ttft_p99_ratio": rows[2, hi]["ttft_p99"] / rows[1, hi]["ttft_p99"],
            "cliff_throughput_ratio": rows[2, hi]["tok_s"] / rows[1, hi]["tok_s"],
            "tpot_ratio": rows[2, fit]["tpot_p50"] / rows[1, fit]["tpot_p50"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tolerance", type=float, default=25.0, help="percent worse than the baseline that regresses")
    ap.add_argument("--floor-ms", type=float, default=5.0, help="ms worse that a ms figure may be in any case")
    ap.add_argument("--requests", type=int, default=8, help="PD latency: requests per length")
    ap.add_argument("--fit", type=int, default=3, help="cliff: requests DCP=1 holds")
    ap.add_argument("--record", action="store_true", help="print this run as a gate block")
    a = ap.parse_args(argv)
    cpu, t0 = host_cpu(), time.monotonic()
    cls = host_class(cpu)
    base = baselines(BENCHMARKS.read_text(), cls)
    with tempfile.TemporaryDirectory(prefix="dcp2d-gate-") as d:
        now = {**pd_figures(Path(d) / "pd", a.requests), **cliff_figures(Path(d) / "cliff", a.fit)}
    print(f"\n{cpu} (class {cls}); {time.monotonic() - t0:.0f} s\n")
    print(f"| figure | now | baseline | verdict (tolerance {a.tolerance:g}%, {a.floor_ms:g} ms) | baseline from |")
    print("|---|---|---|---|---|")
    for m, v in now.items():
        b, src = base.get(m, (None, ""))
        print(f"| {m} | {v:.2f} | {'-' if b is None else f'{b:.2f}'} | {verdict(m, v, b, a.tolerance, a.floor_ms)} "
              f"| {src} |")
    if a.record:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                              cwd=BENCHMARKS.parent).stdout.strip() or "?"
        print(f"\n```gate\n# {cpu}; {time.strftime('%Y-%m-%d')}; {head}; bench/gate.py --requests {a.requests} "
              f"--fit {a.fit}")
        for m, v in now.items():
            print(f"{cls} {m} {v:.3g} gate.py on {head}, {cpu.split(',')[0]}")
        print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
