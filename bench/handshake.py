"""What probing a Mooncake session before its engine opens it costs (``transfer/handshake.py``),
on the normal path: the first write to a new session (probe, the engine's own handshake, the
write), a write to a session the engine knows (the gate around each batch), and a probe alone.

One initiator ``MooncakeTransport`` and ``--sessions`` target transports in one process over
loopback (TCP). Each write is 1 KiB in one descriptor (the handshake dominates), or 64
descriptors of 16 KiB (``known, 64 x 16 KiB``: a batch), checked byte for byte. Runs on trees
without the probe too (then no probe line): the baseline, run the same way in the same minute.

    MC_LOG_LEVEL=ERROR .venv/bin/python bench/handshake.py [--sessions 30] [--reps 300]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

SMALL, BIG, N_BIG = 1024, 16384, 64


def ms(xs: list[float]) -> str:
    a = np.array(xs) * 1e3
    return f"{np.percentile(a, 50):8.3f} | {np.percentile(a, 90):8.3f} | {a.max():8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=30, help="target engines: first writes measured")
    ap.add_argument("--reps", type=int, default=300, help="writes to a known session")
    args = ap.parse_args()

    from vllm_dcp2d.reshard.plan import Descriptors
    from vllm_dcp2d.transfer.transport import MooncakeTransport

    try:
        from vllm_dcp2d.transfer.handshake import HANDSHAKE_TIMEOUT_S, probe
    except ImportError:
        probe = None
    a = MooncakeTransport()
    src = np.random.default_rng(0).integers(0, 256, N_BIG * BIG, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    targets = []
    for _ in range(args.sessions):
        t = MooncakeTransport()
        dst = np.zeros(N_BIG * BIG, np.uint8)
        t.register(dst.ctypes.data, dst.nbytes)
        targets.append((t, dst))

    def small(dst, off: int) -> Descriptors:
        return Descriptors(np.array([src.ctypes.data + off]), np.array([dst.ctypes.data + off]), np.array([SMALL]))

    def timed(session: str, desc: Descriptors, dst, lo: int, hi: int) -> float:
        t0 = time.perf_counter()
        a.write(session, desc)
        took = time.perf_counter() - t0
        assert np.array_equal(dst[lo:hi], src[lo:hi])
        return took

    first = [timed(t.session_id, small(dst, 0), dst, 0, SMALL) for t, dst in targets]
    t, dst = targets[0]
    known = [timed(t.session_id, small(dst, (i % 64) * SMALL), dst, (i % 64) * SMALL, (i % 64 + 1) * SMALL)
             for i in range(args.reps)]
    offs = np.arange(N_BIG, dtype=np.int64) * BIG
    batch = Descriptors(src.ctypes.data + offs, dst.ctypes.data + offs[::-1], np.full(N_BIG, BIG))
    batches = []
    for _ in range(max(1, args.reps // 10)):
        dst[:] = 0
        t0 = time.perf_counter()
        a.write(t.session_id, batch)
        batches.append(time.perf_counter() - t0)
        assert np.array_equal(dst.reshape(N_BIG, BIG)[::-1], src.reshape(N_BIG, BIG))
    print(f"{'write (ms)':>34} | {'p50':>8} | {'p90':>8} | {'max':>8} | n")
    print(f"{'first write to a new session':>34} | {ms(first)} | {len(first)}")
    print(f"{'known session, 1 x 1 KiB':>34} | {ms(known)} | {len(known)}")
    print(f"{f'known session, {N_BIG} x 16 KiB':>34} | {ms(batches)} | {len(batches)}")
    if probe is not None:
        probes = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            probe(targets[1 % len(targets)][0].session_id, HANDSHAKE_TIMEOUT_S)
            probes.append(time.perf_counter() - t0)
        print(f"{'probe alone':>34} | {ms(probes)} | {len(probes)}")
    for t, _ in targets:
        t.close()
    a.close()


if __name__ == "__main__":
    main()
