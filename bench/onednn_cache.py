"""What vLLM's CPU GEMMs keep per batch shape (issue 49: the soak's prefill RSS climb).

vLLM's CPU linear layers call oneDNN through a handler per weight
(``vllm._custom_ops.create_onednn_mm(weight, 32)``). oneDNN JIT-compiles a kernel per
problem shape, i.e. per number of rows ``M`` (tokens in the step), and keeps it: 32 per
handler in vLLM's handler, and up to ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (1,024 by default)
in oneDNN's own cache. A prefill meets new ``M`` values for a long time, so its RSS climbs
until those caches are full. This script feeds one handler ``--shapes`` distinct ``M``
values, then the same ones again, in a fresh process per cache capacity (oneDNN reads the
variable once), and prints the RSS growth and the time per call.

    .venv/bin/python bench/onednn_cache.py [--shapes 600] [--capacities default,0,64,128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_dcp2d.local.workload import host_cpu  # noqa: E402

K, N = 128, 384  # a tiny model's projection; the kernel's size barely depends on it


def child(shapes: int) -> dict:
    import time

    import psutil
    import torch
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    h = ops.create_onednn_mm(torch.randn(K, N), 32)
    xs = [torch.randn(m, K) for m in range(1, shapes + 1)]
    ops.onednn_mm(h, xs[0], None)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    growth = []
    t = time.perf_counter()
    for i, x in enumerate(xs, 1):
        ops.onednn_mm(h, x, None)
        if i % max(1, shapes // 6) == 0:
            growth.append((i, (proc.memory_info().rss - rss0) / 2**20))
    first = (time.perf_counter() - t) / shapes
    t = time.perf_counter()
    for x in xs:  # the same shapes again: hits where the caches kept them, rebuilds where not
        ops.onednn_mm(h, x, None)
    again = (time.perf_counter() - t) / shapes
    t = time.perf_counter()
    for _ in range(shapes):
        ops.onednn_mm(h, xs[6], None)
    one = (time.perf_counter() - t) / shapes
    return {"growth": growth, "again_mib": (proc.memory_info().rss - rss0) / 2**20,
            "first_ms": 1e3 * first, "again_ms": 1e3 * again, "one_ms": 1e3 * one}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=600)
    ap.add_argument("--capacities", default="default,0,64,128")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.shapes < 6:
        ap.error(f"--shapes must be at least 6, got {a.shapes}")
    if a.child:
        print(json.dumps(child(a.shapes)))
        return 0
    print(f"{host_cpu()}; one handler, K={K}, N={N}, float32; {a.shapes} distinct M, then the same again\n")
    rows = []
    for cap in a.capacities.split(","):
        env = dict(os.environ)
        env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
        if cap != "default":
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = cap
        p = subprocess.run([sys.executable, __file__, "--child", "--shapes", str(a.shapes)], env=env,
                           capture_output=True, text=True, timeout=600)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            print(f"capacity {cap}: the child failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
            return 1
        rows.append((cap, json.loads(lines[-1])))
    marks = [m for m, _ in rows[0][1]["growth"]]
    print(f"{'ONEDNN_PRIMITIVE_CACHE_CAPACITY':<32}" + "".join(f"{'M<=' + str(m):>9}" for m in marks)
          + f"{'again':>9}{'ms/call new':>13}{'again':>8}{'one M':>8}")
    for cap, r in rows:
        print(f"{cap + (' (1024)' if cap == 'default' else ''):<32}" + "".join(f"{g:>9.1f}" for _, g in r["growth"])
              + f"{r['again_mib']:>9.1f}{r['first_ms']:>13.3f}{r['again_ms']:>8.3f}{r['one_ms']:>8.3f}")
    print("\nRSS growth in MiB after the first M values; 'again': after replaying them all; ms per onednn_mm call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
