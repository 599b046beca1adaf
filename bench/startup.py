"""A DCP2D instance's start-up on CPU, spawned (vLLM's choice) and forked (``cpu_start_method``).

vLLM's CPU platform spawns the engine core and each TP worker, and each imports vLLM
anew (``import vllm`` alone imports torch's inductor: ~3 CPU-s; a worker ~7). With
``cpu_start_method="fork"`` they are forked from the process that starts them and bound
to their cores by ``vllm_compat/startup.py``. For each method, ``--runs`` times: a TP=2
DCP=2 decode (tiny llama-mqa, fp32) until ``/health`` answers, the CPU seconds each of
its processes used by then, then ``--requests`` greedy requests one after another (their
wall time and the host's busy CPU: an unbound worker shows here, not in the start-up).

    .venv/bin/python bench/startup.py [--runs 3] [--requests 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_dcp2d.local.servers import free_port, post_json, vllm_server, wait_all  # noqa: E402
from vllm_dcp2d.local.tiny_models import build_tiny_model  # noqa: E402
from vllm_dcp2d.local.workload import host_cpu  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    """The host's busy CPU seconds so far (all cores; /proc/stat, idle and iowait left out)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) / TICK


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid`` and its descendants, by process name."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            name = Path(f"/proc/{p}/comm").read_text().strip()
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        name = "API server" if p == pid else name.removeprefix("VLLM::")
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / TICK
    return out


def one(model: str, work: Path, method: str, requests: int) -> dict:
    port = free_port()
    p = vllm_server(f"decode-{method}", model, port, work, role="kv_consumer", tp=2, dcp=2, block_size=32,
                    dtype="float32", extra_config={"cpu_start_method": method})
    t0 = time.monotonic()
    p.start()
    try:
        wait_all([p], 600)
        ready = time.monotonic() - t0
        cpu = tree_cpu(p.proc.pid)
        b0, t1 = busy_s(), time.monotonic()
        for i in range(requests):
            status, out = post_json(f"{p.url}/v1/completions", {"model": model, "prompt": list(range(5, 105 + i)),
                                                                "max_tokens": 32, "temperature": 0.0,
                                                                "ignore_eos": True})
            assert status == 200, out
        return {"ready_s": ready, "cpu_s": sum(cpu.values()), "by_process": cpu,
                "requests_s": time.monotonic() - t1, "requests_cpu_s": busy_s() - b0}
    finally:
        p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--json", default="", help="write every run's figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = build_tiny_model("llama-mqa", work / "model")
        runs = {"spawn": [], "fork": []}
        for _ in range(args.runs):  # alternating, so a change in the host's load hits both
            for method in runs:
                runs[method].append(one(model, work, method, args.requests))
    print(f"host: {host_cpu()}; TP=2 DCP=2 decode, tiny llama-mqa fp32; {args.runs} runs each, "
          f"{args.requests} requests of 32 tokens after each start")
    print(f"{'method':7} {'ready s':>18} {'start CPU-s':>18} {'requests s':>18} {'requests CPU-s':>18}")
    for method, rs in runs.items():
        cells = []
        for key in ("ready_s", "cpu_s", "requests_s", "requests_cpu_s"):
            v = [r[key] for r in rs]
            cells.append(f"{statistics.median(v):6.1f} ({min(v):4.1f}-{max(v):4.1f})")
        print(f"{method:7} " + " ".join(f"{c:>18}" for c in cells))
    for method, rs in runs.items():
        by = {k: statistics.median(r["by_process"].get(k, 0.0) for r in rs) for k in rs[0]["by_process"]}
        print(f"{method:7} start CPU-s by process (median): "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
