"""What one Mooncake TCP write costs per descriptor, against its bytes (issue 29).

Two ``MooncakeTransport`` engines in one process, loopback TCP, nothing else
running: the same path's pages written as one descriptor per page (how the 2D
reshard sends a DCP rank's pages, every N-th page of the prefill's) and as one
contiguous descriptor, at the page sizes of the tiny test model in fp32 (8 KiB
per 32-token page and layer) and in fp8 (2 KiB), and the per-page case again
through send staging (``transfer/staging.py``: the pages gathered into a
registered slot, then written as one descriptor; the gather alone timed apart).
Every write is checked byte for byte.

    MC_LOG_LEVEL=ERROR .venv/bin/python bench/descriptors.py [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

CASES = [  # (label, descriptors, bytes each)
    ("fp32 pages, one path of an 8K request", 250, 8192),
    ("the same bytes, one descriptor", 1, 250 * 8192),
    ("fp8 pages, one path of an 8K request", 250, 2048),
    ("the same bytes, one descriptor", 1, 250 * 2048),
    ("fp8 pages, one path of a 32K request", 1000, 2048),
]


def main() -> None:
    from vllm_dcp2d.transfer import staging
    from vllm_dcp2d.transfer.transport import MooncakeTransport
    from vllm_dcp2d.reshard.plan import Descriptors
    from vllm_dcp2d.reshard.regions import Memory

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    reps = ap.parse_args().reps
    if reps < 1:
        raise SystemExit(f"--reps {reps}: expected at least 1")
    size = 8 << 20
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    with MooncakeTransport() as a, MooncakeTransport() as b:
        a.register(src.ctypes.data, src.nbytes)
        b.register(dst.ctypes.data, dst.nbytes)
        pool = staging.StagingPool(a, 16 << 20, 1)
        memory = Memory.of([(src.ctypes.data, src.nbytes)])
        print("| case | descriptors written | bytes | p50 ms | p99 ms | max ms | us per descriptor (p50) | GB/s (p50) |")
        print("|---|---|---|---|---|---|---|---|")
        cases = [(label, n, each, "plain") for label, n, each in CASES]
        cases[1:1] = [("fp32 pages, staged: gather + write", 250, 8192, "staged"),
                      ("fp32 pages, the gather alone", 250, 8192, "gather")]
        for label, n, each, how in cases:
            # every other slot in the source, as a DCP=2 rank's pages lie in the prefill's blocks;
            # adjacent in the destination, as in a fresh decode cache
            off = np.arange(n, dtype=np.int64) * (2 * each)
            to = off if how == "plain" else np.arange(n, dtype=np.int64) * each
            desc = Descriptors(src.ctypes.data + off, dst.ctypes.data + to, np.full(n, each, dtype=np.int64))
            times, written = [], n
            for _ in range(reps):
                dst[:] = 0
                t0 = time.perf_counter()
                if how == "plain":
                    a.write(b.session_id, desc)
                elif how == "staged":
                    _, written, _ = staging.write(a, pool, memory, b.session_id, desc, [])
                else:
                    slot = pool.take()
                    (chunk,), _ = staging.stage(desc, slot.nbytes)
                    slot.gather(chunk, memory)
                    pool.give_back(slot, clean=True)
                    written = 0
                times.append(time.perf_counter() - t0)
                if how != "gather":
                    moved = (off[:, None] + np.arange(each)[None, :]).reshape(-1)
                    landed = (to[:, None] + np.arange(each)[None, :]).reshape(-1)
                    if not np.array_equal(dst[landed], src[moved]):
                        raise AssertionError(f"{label}: bytes differ after the write")
            p50, p99, mx = np.percentile(times, 50), np.percentile(times, 99), max(times)
            print(f"| {label} | {written} | {n * each:,} | {1e3 * p50:.2f} | {1e3 * p99:.2f} | {1e3 * mx:.2f} | "
                  f"{f'{1e6 * p50 / written:.1f}' if written else '-'} | {n * each / p50 / 1e9:.2f} |")


if __name__ == "__main__":
    main()
