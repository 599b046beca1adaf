"""Patch 6 of vllm_compat/attention.py: a DCP group's collectives run over vLLM's
shared-memory CPU communicator, not gloo, and gather byte-exact results.

Two real processes build vLLM's ``CpuCommunicator`` for a group named as vLLM
names the DCP group ("dcp:0") and for one it leaves alone ("ep:0").
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("vllm")

SHAPES = [(4, 8, 129), (4096, 8, 129)]  # a decode's [O|LSE], a prefill chunk's


def _worker(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    os.environ["VLLM_DIST_IDENT"] = f"test-dcp-shm-{port}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        importlib.import_module("vllm._custom_ops")  # loads torch.ops._C, as every vLLM worker does
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator, _CPUSHMDistributed

        from vllm_dcp2d.vllm_compat.attention import install_dcp_shm

        install_dcp_shm()
        install_dcp_shm()  # idempotent
        group = dist.new_group([0, 1], backend="gloo")
        dcp = CpuCommunicator(group, device_group=group, unique_name="dcp:0")
        other = CpuCommunicator(group, device_group=group, unique_name="ep:0")
        result = {"dcp_shm": isinstance(dcp.dist_module, _CPUSHMDistributed),
                  "other_shm": isinstance(other.dist_module, _CPUSHMDistributed), "exact": []}
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                mine = (torch.arange(torch.Size(shape).numel()).view(shape) * 0.5 + rank * 1000).to(dtype)
                got = dcp.all_gather(mine, dim=1)
                want = torch.cat([(torch.arange(torch.Size(shape).numel()).view(shape) * 0.5 + r * 1000).to(dtype)
                                  for r in range(2)], dim=1)
                result["exact"].append(torch.equal(got, want))
        out.put((rank, result))
    finally:
        dist.destroy_process_group()


def test_dcp_group_gathers_over_shared_memory():
    from vllm_dcp2d.local.servers import free_port

    port = free_port()  # bound seconds later by the spawned ranks: not from the ephemeral range
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, r in results.items():
        assert r["dcp_shm"], f"rank {rank}: the DCP group still gathers over gloo"
        assert not r["other_shm"], f"rank {rank}: a group other than DCP was switched too"
        assert all(r["exact"]), f"rank {rank}: gathered tensors differ: {r['exact']}"
