"""The cross-rank step of DCP attention: which collectives (issue 15, item 3).

After each rank attends over its KV shard it holds a partial ``(O [T, Hg, D],
LSE [T, Hg])`` for all ``Hg`` query heads of the DCP group, and must end with the
exact merge for its own ``H = Hg / N`` heads. Three ways, timed over gloo between
``--ranks`` real processes on loopback (what vLLM's CPU workers use):

* ``ag(O|LSE)``: one all-gather of O with LSE packed as an extra column, then a
  local merge of the kept heads (this package's ``attention/dcp.py``, with its
  ``merge_lse``);
* ``ag(LSE)+rs(O)``: all-gather the LSE, scale O by its merge weight, reduce-scatter
  O over the heads (vLLM's GPU path, ``cp_lse_ag_out_rs``);
* ``ag(LSE)+ar(O)``: the same with an all-reduce, for backends without reduce-scatter.

Each variant's output is checked against a float64 merge of the same partials.
Prints p50 / p99 / max microseconds per call over ``--iters`` calls, interleaved.

Then the transport of the one all-gather DCP attention does, ``[O|LSE]`` float32 of a
decode step and of a 4096-token prefill chunk: gloo (what a DCP group gets from vLLM),
vLLM's shared-memory collectives (``_CPUSHMDistributed``, what patch 6 gives it where the
build has them) and the plugin's ``ShmAllGather`` (``attention/shm_gather.py``, what it
gets on vLLM's AVX2 build), each checked byte for byte against gloo's output; p50/p99
of calls that each follow a barrier (so they include how far apart the ranks leave it),
and the mean of calls back to back.
``--avx2-host`` runs the ranks as on an AVX2 host (``tests/support/avx2_host``: vLLM
loads its AVX2 build, which has no shared-memory collectives).

    .venv/bin/python bench/dcp_collectives.py [--ranks 2] [--iters 300] [--avx2-host]
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)  # this checkout's vllm_dcp2d, and tests/support/ (tests/README.md)

from vllm_dcp2d.attention.merge import merge_lse  # noqa: E402
from vllm_dcp2d.local import shm  # noqa: E402

SHAPES = [(4, 8, 128), (64, 32, 128), (4096, 8, 128)]  # T, Hg, D: decode batch 4, batch 64, a prefill chunk


def _partials(rank: int, n: int, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    t, hg, d = shape
    lse = torch.randn(t, hg, generator=g) * 3
    lse[rank::7] = float("-inf")  # some empty shards
    return torch.randn(t, hg, d, generator=g), lse


def _weights(lses: torch.Tensor) -> torch.Tensor:
    """[N, T, H] LSEs -> merge weights exp(LSE_n - LSE), 0 for empty shards."""
    mx = lses.amax(0)
    mx = torch.where(torch.isinf(mx), 0.0, mx)
    w = torch.exp(lses - mx)
    return w / w.sum(0).clamp_min(1e-30)


def ag_packed(o, lse, n, rank):
    h = o.shape[1] // n
    both = torch.empty(n, *o.shape[:2], o.shape[2] + 1)
    dist.all_gather_into_tensor(both, torch.cat([o, lse[..., None]], -1)[None])
    mine = both[:, :, rank * h:(rank + 1) * h]
    return merge_lse(mine[..., :-1], mine[..., -1])[0]  # the package's own merge


def ag_lse_rs(o, lse, n, rank):
    h = o.shape[1] // n
    lses = torch.empty(n, *lse.shape)
    dist.all_gather_into_tensor(lses, lse[None])
    scaled = (_weights(lses)[rank][..., None] * o).transpose(0, 1).contiguous()  # heads first
    out = torch.empty(h, *scaled.shape[1:])
    dist.reduce_scatter_tensor(out, scaled)
    return out.transpose(0, 1)


def ag_lse_ar(o, lse, n, rank):
    h = o.shape[1] // n
    lses = torch.empty(n, *lse.shape)
    dist.all_gather_into_tensor(lses, lse[None])
    scaled = _weights(lses)[rank][..., None] * o
    dist.all_reduce(scaled)
    return scaled[:, rank * h:(rank + 1) * h]


VARIANTS = {"ag(O|LSE)": ag_packed, "ag(LSE)+rs(O)": ag_lse_rs, "ag(LSE)+ar(O)": ag_lse_ar}
# [1, T, Hg, D + 1] float32, as attention/dcp.py stacks O and LSE: decode batch 4, batch 64,
# a 4096-token prefill chunk.
PACKED = [(1, 4, 8, 129), (1, 64, 32, 129), (1, 4096, 8, 129)]
SLOTS = (1 << 20, 4 << 20)  # ShmAllGather slot sizes timed: the default and a larger one


def _transports(n: int, port: int) -> dict:
    """name -> ``all_gather_into_tensor(output, input)`` over the default (gloo) group."""
    from vllm_dcp2d.attention.shm_gather import open_group

    def exchange(obj) -> list:
        out = [None] * n
        dist.all_gather_object(out, obj)
        return out

    os.environ["VLLM_DIST_IDENT"] = f"bench-dcp-collectives-{port}"
    importlib.import_module("vllm._custom_ops")  # the build vLLM's loader picks on this host
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    world = dist.group.WORLD
    found = {"gloo": dist.all_gather_into_tensor}
    if hasattr(torch.ops._C, "init_shm_manager"):  # a "tp" group gets vLLM's collectives
        found["vLLM shm"] = CpuCommunicator(world, device_group=world, unique_name="tp:0").dist_module \
            .all_gather_into_tensor
    for slot in SLOTS:
        found[f"vllm_dcp2d shm {slot >> 20} MiB"] = open_group(n, dist.get_rank(), exchange,
                                                                slot_bytes=slot).all_gather_into_tensor
    return found


def time_transports(rank: int, n: int, port: int, iters: int) -> list[tuple]:
    """Rows ``(shape, transport, seconds per call, mean seconds per call back to back,
    byte-exact with gloo)`` of the packed all-gather; the timed calls interleave the
    transports call by call, each after a barrier."""
    transports = _transports(n, port)
    rows = []
    for shape in PACKED:
        x = _partials(rank, n, shape[1:3] + (shape[3] - 1,))
        x = torch.cat([x[0], x[1][..., None]], -1)[None]
        outs = {name: torch.empty(n, *shape[1:]) for name in transports}
        for name, fn in transports.items():
            fn(outs[name], x)
        exact = {name: torch.equal(out.view(torch.uint8), outs["gloo"].view(torch.uint8)) for name, out in outs.items()}
        times = {name: [] for name in transports}
        for _ in range(iters if shape[1] <= 64 else max(30, iters // 10)):
            for name, fn in transports.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn(outs[name], x)
                times[name].append(time.perf_counter() - t0)
        back_to_back = {}
        for name, fn in transports.items():  # calls in a row, as a forward pass makes them: no barrier skew
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(len(times[name])):
                fn(outs[name], x)
            back_to_back[name] = (time.perf_counter() - t0) / len(times[name])
        rows += [(shape, name, times[name], back_to_back[name], exact[name]) for name in transports]
    return rows


def _worker(rank: int, n: int, port: int, iters: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    rows = []
    for shape in SHAPES:
        o, lse = _partials(rank, n, shape)
        all_o = torch.stack([_partials(r, n, shape)[0] for r in range(n)]).double()
        all_lse = torch.stack([_partials(r, n, shape)[1] for r in range(n)]).double()
        h = shape[1] // n
        ref = (_weights(all_lse)[..., None] * all_o).sum(0)[:, rank * h:(rank + 1) * h]
        times = {name: [] for name in VARIANTS}
        err, usable = {}, {}
        for name, fn in VARIANTS.items():
            try:
                err[name] = (fn(o, lse, n, rank).double() - ref).abs().max().item()
                usable[name] = True
            except (RuntimeError, NotImplementedError) as e:  # gloo lacks the collective
                err[name], usable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}", False
        reps = iters if shape[0] <= 64 else max(10, iters // 20)
        for _ in range(reps):
            for name, fn in VARIANTS.items():
                if not usable[name]:
                    continue
                dist.barrier()
                t0 = time.perf_counter()
                fn(o, lse, n, rank)
                times[name].append(time.perf_counter() - t0)
        for name in VARIANTS:
            rows.append((shape, name, times[name], err[name]))
    transport_rows = time_transports(rank, n, port, iters)
    if rank == 0:
        out.put((rows, transport_rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--avx2-host", action="store_true", help="ranks see an AVX2 host (vLLM's AVX2 build)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    if args.avx2_host:
        from tests.support import avx2_host

        os.environ["PYTHONPATH"] = avx2_host.env()["PYTHONPATH"]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args.iters, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        rows, transport_rows = q.get(timeout=900)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        # vLLM never unlinks its communicator's files (vllm_dcp2d/local/shm.py)
        shm.remove_unheld({Path(f) for f in glob.glob(f"/dev/shm/vllm_dist_bench-dcp-collectives-{port}-*")})
    print(f"DCP merge collectives over gloo, {args.ranks} processes on loopback, fp32, "
          f"rank 0's view (us per call; T x Hg x D = tokens x DCP group heads x head dim)")
    print(f"{'T x Hg x D':>14} {'variant':>15} {'calls':>6} {'p50 us':>9} {'p99 us':>9} {'max us':>9} "
          f"{'x ag(O|LSE)':>12} {'max |err|':>10}")
    base = {}
    for shape, name, ts, err in rows:
        label = "x".join(map(str, shape))
        if not ts:
            print(f"{label:>14} {name:>15}  not available: {err}")
            continue
        p50, p99 = np.percentile(ts, [50, 99]) * 1e6
        base.setdefault(label, p50)
        print(f"{label:>14} {name:>15} {len(ts):>6} {p50:9.0f} {p99:9.0f} {max(ts) * 1e6:9.0f} "
              f"{p50 / base[label]:12.2f} {err:10.1e}")
    host = "as an AVX2 host (vLLM's AVX2 build)" if args.avx2_host else "vLLM's build for this host"
    print(f"\nOne all-gather of [O|LSE] float32 ([1, T, Hg, D+1] per rank), {args.ranks} processes, {host}; "
          f"rank 0's view (us per call, after a barrier; transports interleaved)")
    print(f"{'T x Hg x D+1':>14} {'transport':>24} {'calls':>6} {'p50 us':>9} {'p99 us':>9} {'max us':>9} "
          f"{'x gloo':>7} {'in a row us':>12} {'= gloo':>7}")
    gloo = {}
    for shape, name, ts, row, exact in transport_rows:
        label = "x".join(map(str, shape[1:]))
        p50, p99 = np.percentile(ts, [50, 99]) * 1e6
        gloo.setdefault(label, p50)
        print(f"{label:>14} {name:>24} {len(ts):>6} {p50:9.0f} {p99:9.0f} {max(ts) * 1e6:9.0f} "
              f"{p50 / gloo[label]:7.2f} {row * 1e6:12.0f} {str(exact):>7}")
    print("(in a row: the mean of as many calls back to back, no barrier between them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
