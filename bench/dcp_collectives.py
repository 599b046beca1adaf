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

    .venv/bin/python bench/dcp_collectives.py [--ranks 2] [--iters 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_dcp2d.attention.merge import merge_lse

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
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args.iters, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = q.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
