"""Run a function on N real processes joined in one gloo group (test harness).

The parent starts the ranks, waits with a deadline, kills any rank still
running after it, and returns one result dict per rank. A rank that raised
returns ``{"error": "..."}``; a rank that never finished returns
``{"error": "hung: ..."}``. Every rank writes its result to a file, so a
rank stuck in a collective cannot block the others' reporting.
"""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


# Modules a forkserver imports once for every rank it forks: a spawned rank imported torch
# itself, ~2 CPU-s per rank and ~60 rank start-ups in the quick tier (issue 52).
PRELOAD = ["torch", "torch.distributed", "vllm_dcp2d.prefill.dist"]


def run_group(target: str, world_size: int, args: dict, *, timeout_s: float, gloo_timeout_s: float,
              start: str = "forkserver") -> list[dict]:
    """Run ``target`` (``"module:function"``, called as ``fn(cp, **args)``) on
    ``world_size`` processes; returns the ranks' result dicts, rank order.

    ``start``: "forkserver" (each rank forked from one process per test worker that
    imported ``PRELOAD``, with that process's environment) or "spawn" (a fresh
    interpreter with this process's environment now: ranks that must load something
    at start-up from a variable the test set, such as vLLM's AVX2 build)."""
    from vllm_dcp2d.local.servers import free_port

    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="prefill_group_") as out_dir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, init_method, target, args, out_dir, gloo_timeout_s),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for rank, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append({"error": f"hung: no result within {timeout_s}s (exitcode {p.exitcode})"})
        return results


def _entry(rank, world_size, init_method, target, args, out_dir, gloo_timeout_s):
    import torch

    torch.set_num_threads(1)  # ranks share 2 cores; intra-op threads only add contention
    import torch.distributed as dist

    from vllm_dcp2d.prefill.dist import cp_group_from

    def write(result):
        tmp = os.path.join(out_dir, f".rank{rank}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pkl"))

    try:
        # Rendezvous with a generous timeout (spawned ranks start seconds apart
        # on a loaded machine); the scenario then runs on a group whose every
        # collective is bounded by the short gloo_timeout_s.
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(60.0, gloo_timeout_s)))
        dist.barrier()
        cp = cp_group_from(dist.new_group(backend="gloo", timeout=timedelta(seconds=gloo_timeout_s)))
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(cp, **args)
    except BaseException as e:  # report anything, including gloo timeouts
        write({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        os._exit(1)  # skip teardown: peers may be gone or stuck mid-collective
    write(result)
    dist.destroy_process_group()
