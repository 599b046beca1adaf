"""Process groups for prefill CP: gloo on CPU, NCCL on GPU, torch.distributed only.

Every collective in this package goes through a :class:`CPGroup`, which says
which group to use, which rank is which, and on which device the tensors that
cross the wire must live (CUDA for NCCL, CPU for gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["CPGroup", "default_backend", "init_cp_group", "cp_group_from"]


@dataclass(frozen=True)
class CPGroup:
    """One prefill context-parallel group as seen from one of its ranks.

    group:  the process group (``None`` is the default world group).
    rank:   this process's CP rank, ``0 <= rank < size`` (its rank in ``group``).
    size:   the CP size, ``cp_size``.
    device: where tensors handed to collectives must live.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    device: torch.device

    def global_rank(self, cp_rank: int) -> int:
        """The world rank of CP rank ``cp_rank`` (``src`` of a broadcast)."""
        if not 0 <= cp_rank < self.size:
            raise ValueError(f"cp_rank must be in [0, cp_size={self.size}), got {cp_rank}")
        if self.group is None:
            return cp_rank
        return dist.get_global_rank(self.group, cp_rank)


def default_backend() -> str:
    """``"nccl"`` when CUDA and NCCL are usable here, else ``"gloo"``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_cp_group(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    backend: str | None = None,
    timeout_s: float = 60.0,
) -> CPGroup:
    """Join the default process group and use all of it as the CP group.

    Called once per process before any prefill collective. ``timeout_s``
    bounds every gloo collective (and NCCL's watchdog): a rank that waits on a
    collective the others never join fails instead of hanging forever.
    With NCCL the caller must have selected this process's CUDA device.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return CPGroup(group=None, rank=rank, size=world_size, device=_device_for(backend))


def cp_group_from(group: dist.ProcessGroup | None = None) -> CPGroup:
    """Wrap an existing process group (e.g. one the serving engine built)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_cp_group or init_process_group first")
    backend = str(dist.get_backend(group))
    return CPGroup(
        group=group,
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        device=_device_for(backend),
    )

