"""Time to plan all CP x DCP paths of one request (seed config: 78 layers,
CP8 x DCP4, page 64, 576 B/token/layer, shuffled block ids).

    .venv/bin/python bench/plan.py [--repeat 7]

Prints tokens -> ms (median and min of repeats), descriptors and bytes.
Target: < 5 ms for a 500K-token request, growing linearly.
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm_dcp2d.reshard.plan import plan_request
from vllm_dcp2d.reshard.report import synthetic_request


def bench(tokens: int, repeat: int, layers=78, cp=8, dcp=4, page=64, bptl=576):
    src, src_ids, dst, dst_ids = synthetic_request(layers, cp, dcp, tokens, page, page * bptl, shuffle_seed=0)
    times, plans = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plans = plan_request(layers, cp, src, src_ids, dst, dst_ids)
        times.append((time.perf_counter() - t0) * 1e3)
    ndesc = sum(len(p) for p in plans.values())
    nbytes = sum(p.nbytes for p in plans.values())
    return statistics.median(times), min(times), len(src_ids), ndesc, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print(f"{'tokens':>9} {'pages':>7} {'median ms':>10} {'min ms':>8} {'ms/100K tok':>12} "
          f"{'descriptors':>12} {'GB':>7}")
    for tokens in (32_768, 131_072, 262_144, 500_000, 1_000_000):
        med, best, pages, ndesc, nbytes = bench(tokens, args.repeat)
        print(f"{tokens:>9} {pages:>7} {med:>10.2f} {best:>8.2f} {best / tokens * 1e5:>12.2f} "
              f"{ndesc:>12} {nbytes / 1e9:>7.2f}")


if __name__ == "__main__":
    main()
