"""Rank functions for the shared-memory all-gather tests (``attention/shm_gather.py`` and
its use by ``vllm_compat/attention.py``): each runs inside a spawned gloo rank
(``prefill_group.run_group``) and returns a picklable dict."""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import torch.distributed as dist

from vllm_dcp2d.attention.shm_gather import GatherUnavailable, ShmGatherError, open_group

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What the DCP backends all-gather (T tokens, Hg = H * N heads of the group, D head dim), as
# (input shape, dim): [O|LSE] of a decode step and of a 4096-token prefill chunk
# (attention/dcp.py, stacked at dim 0), the queries (vllm_compat/cpu_attn.py, heads at
# dim 1), MLA's absorbed queries (576 = 512 latent + 64 rope) and its two-collective merge
# of bf16 O with float32 LSE (dcp.py when the dtypes differ).
BACKEND_CASES = [((1, 4, 8, 129), 0), ((1, 4096, 8, 129), 0), ((4, 4, 128), 1), ((4096, 4, 128), 1),
                 ((4, 16, 576), 1), ((1, 4, 16, 512), 0), ((1, 4, 16), 0)]


def exchange_over(group):
    """``open_group``'s exchange: ``all_gather_object`` over ``group``."""
    def exchange(obj) -> list:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return exchange


def rank_bytes(rank: int, case: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of case ``case``: random bits of ``dtype`` (NaNs and infs
    included), the same wherever it is made."""
    g = torch.Generator().manual_seed(rank * 100_003 + case)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def gather_vs_gloo(cp, cases: list, slot_bytes: int) -> dict:
    """Each case ``(shape, dtype name)``: this rank's :func:`rank_bytes` all-gathered
    (``all_gather_into_tensor``) by ``ShmAllGather`` and by gloo. Returns per case
    whether the two outputs are equal byte for byte, and whether both equal every
    rank's input in rank order."""
    gather = open_group(cp.size, cp.rank, exchange_over(cp.group), slot_bytes=slot_bytes, timeout_s=60.0)
    dist.barrier(group=cp.group)  # rank 0 unlinks before open_group returns there
    left = os.path.exists(gather.name)
    same_as_gloo, as_expected = [], []
    for i, (shape, name) in enumerate(cases):
        dtype = DTYPES[name]
        mine = rank_bytes(cp.rank, i, tuple(shape), dtype)
        out_shape = (cp.size * shape[0], *shape[1:])
        ours, gloo = torch.empty(out_shape, dtype=dtype), torch.empty(out_shape, dtype=dtype)
        gather.all_gather_into_tensor(ours, mine)
        dist.all_gather_into_tensor(gloo, mine, group=cp.group)
        want = torch.cat([rank_bytes(r, i, tuple(shape), dtype) for r in range(cp.size)])
        same_as_gloo.append(torch.equal(ours.view(torch.uint8), gloo.view(torch.uint8)))
        as_expected.append(torch.equal(ours.view(torch.uint8), want.view(torch.uint8)))
    gather.close()
    return {"same_as_gloo": same_as_gloo, "as_expected": as_expected, "segment_left_in_dev_shm": left,
            "rounds": gather._seq}


def peer_fails(cp, how: str, timeout_s: float) -> dict:
    """Rank 1 joins the group, then ``how``: "killed" (SIGKILL), "exits", "closes" its
    end, "stalls" (alive, never gathers), or gathers "other_size". Rank 0 all-gathers a
    decode's [O|LSE] and reports the error it got and how long it took."""
    gather = open_group(cp.size, cp.rank, exchange_over(cp.group), timeout_s=timeout_s)
    pids = exchange_over(cp.group)(os.getpid())  # both ranks are past set-up
    x = torch.zeros(1, 4, 8, 129)
    if cp.rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exits":
            os._exit(0)
        if how == "closes":
            gather.close()
        if how == "stalls":
            time.sleep(timeout_s + 5)
        if how == "other_size":
            x = torch.zeros(1, 5, 8, 129)
        if how in ("closes", "stalls"):
            return {}
    t0 = time.monotonic()
    try:
        gather.all_gather_into_tensor(torch.empty(cp.size * x.shape[0], *x.shape[1:]), x)
        error = None
    except ShmGatherError as e:
        error = str(e)
    elapsed = time.monotonic() - t0
    try:  # the group stays unusable after a failed gather
        gather.all_gather_into_tensor(torch.empty(cp.size * x.shape[0], *x.shape[1:]), x)
        again = None
    except ShmGatherError as e:
        again = str(e)
    return {"error": error, "elapsed": elapsed, "again": again, "pids": pids}


def other_dev_shm(cp, directory: str) -> dict:
    """Rank 1 looks for the segment in ``directory`` (another ``/dev/shm``, as a rank on
    another host would): every rank must get GatherUnavailable, and no segment is left."""
    try:
        open_group(cp.size, cp.rank, exchange_over(cp.group), directory=directory if cp.rank else "/dev/shm")
        return {"unavailable": None}
    except GatherUnavailable as e:
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"vllm_dcp2d_gather-{os.getpid()}-")]
        return {"unavailable": str(e), "left": left}


def patch_choices(cp, ident: str, choices: list, rank1: list | None = None) -> dict:
    """vLLM's ``CpuCommunicator`` built as vLLM builds its groups, with the plugin's patch 6,
    once per ``DCP2D_DCP_GATHER`` value of ``choices`` (named "dcp:<i>"; rank 1 takes
    ``rank1``'s values where given), and once for a group that is not DCP ("ep:0").
    Returns per choice the class of its ``dist_module``, the patch's log lines and whether
    every BACKEND_CASES gather in both dtypes equals gloo's byte for byte."""
    import importlib

    os.environ["VLLM_DIST_IDENT"] = ident
    importlib.import_module("vllm._custom_ops")  # loads torch.ops._C, as every vLLM worker does
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from vllm_dcp2d.vllm_compat.attention import GATHER_ENV, install_dcp_shm

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("vllm_dcp2d.vllm_compat.attention")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    install_dcp_shm()
    install_dcp_shm()  # idempotent
    result = {"has_op": hasattr(torch.ops._C, "init_shm_manager")}
    for i, choice in enumerate(choices):
        os.environ[GATHER_ENV] = rank1[i] if rank1 and cp.rank == 1 else choice
        del lines[:]
        comm = CpuCommunicator(cp.group, device_group=cp.group, unique_name=f"dcp:{i}")
        exact = []
        for j, (shape, dim) in enumerate(BACKEND_CASES):
            for name, dtype in DTYPES.items():
                mine = rank_bytes(cp.rank, j, shape, dtype)
                parts = [torch.empty_like(mine) for _ in range(cp.size)]
                dist.all_gather(parts, mine, group=cp.group)
                exact.append(torch.equal(comm.all_gather(mine, dim=dim).view(torch.uint8),
                                         torch.cat(parts, dim=dim).view(torch.uint8)))
        result[choice] = {"module": type(comm.dist_module).__name__, "log": list(lines), "exact": exact}
    os.environ[GATHER_ENV] = "auto"
    other = CpuCommunicator(cp.group, device_group=cp.group, unique_name="ep:0")
    result["ep:0"] = type(other.dist_module).__name__
    return result


def stuck_in_set_up() -> None:
    """Rank 0 of a group whose other rank never answers: it makes its segment, then
    blocks in the first exchange (until killed)."""
    open_group(2, 0, lambda obj: time.sleep(3600))
