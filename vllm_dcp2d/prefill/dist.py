"""Process groups for prefill CP: gloo on CPU, NCCL on GPU, torch.distributed only.

Every collective in this package goes through a :class:`CPGroup`, which says
which group to use, which rank is which, and on which device the tensors that
cross the wire must live (CUDA for NCCL, CPU for gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CPGroup", "cp_group_from"]


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


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cp_group_from(group: dist.ProcessGroup | None = None) -> CPGroup:
    """Wrap an existing process group (e.g. one the serving engine built)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call torch.distributed.init_process_group first")
    backend = str(dist.get_backend(group))
    return CPGroup(
        group=group,
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        device=_device_for(backend),
    )

