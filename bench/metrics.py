"""Cost of the connector's Prometheus metrics on the serving path: vLLM's API
server calls ``DCP2DPromMetrics.observe`` in its asyncio output handler once per
engine step that carried connector stats, so this time is taken from the event
loop that streams tokens. Also the worker's cost to snapshot its stats.

    .venv/bin/python bench/metrics.py [--repeat 2000]

One step's stats of a CP x DCP decode: every path completed ``writes`` requests.
Prints microseconds per step (p50/p99/max over ``--repeat`` steps).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from types import SimpleNamespace as NS

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_dcp2d.connector.prom import DCP2DPromMetrics
from vllm_dcp2d.connector.stats import DCP2DStats


def _prom(dcp: int) -> DCP2DPromMetrics:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    cfg = NS(kv_transfer_config=None, parallel_config=NS(decode_context_parallel_size=dcp))
    return DCP2DPromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})


def _pct(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))], xs[-1]


def bench(cp: int, dcp: int, writes: int, repeat: int) -> tuple[tuple, tuple]:
    prom, worker = _prom(dcp), DCP2DStats()
    snap_us, observe_us = [], []
    for i in range(repeat):
        for r in range(cp):
            for d in range(dcp):
                for _ in range(writes):
                    worker.record_path(r, d, 1 << 20, 64, 0.001 * (1 + i % 50))
        worker.count("lifted", 3)
        t0 = time.perf_counter()
        data = worker.clone_and_reset().to_dict()
        t1 = time.perf_counter()
        prom.observe(data, 0)
        t2 = time.perf_counter()
        snap_us.append((t1 - t0) * 1e6)
        observe_us.append((t2 - t1) * 1e6)
    return _pct(snap_us), _pct(observe_us)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    print(f"{'CP x DCP':>9} {'writes/path':>11} {'snapshot us p50/p99/max':>24} {'observe us p50/p99/max':>24}")
    for cp, dcp, writes in ((2, 2, 1), (2, 2, 8), (8, 4, 1), (8, 4, 8), (8, 4, 64)):
        snap, obs = bench(cp, dcp, writes, args.repeat)
        print(f"{f'{cp} x {dcp}':>9} {writes:>11} {'/'.join(f'{x:.0f}' for x in snap):>24} "
              f"{'/'.join(f'{x:.0f}' for x in obs):>24}")


if __name__ == "__main__":
    main()
