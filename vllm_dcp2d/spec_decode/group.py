"""A group over plain torch.distributed, with the interface of vLLM's
``GroupCoordinator`` that :func:`~vllm_dcp2d.spec_decode.verify.agree_sampled` and
:func:`~vllm_dcp2d.attention.dcp.dcp_merge` use: ``vllm_compat/spec_decode.py``
agrees over the TP group's gloo group with it, since vLLM's CPU shared-memory
all-gather has no int64 kernel."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["TorchGroup"]


class TorchGroup:
    """``world_size``, ``rank_in_group`` and ``all_gather(tensor, dim)`` over a
    process group (``None``: the default group). Tensors cross the wire on
    ``device`` (CPU for gloo, CUDA for NCCL) and come back on their own device.
    Each collective is bounded by the process group's timeout."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        self.group = group
        self.device = torch.device(device)
        self.world_size = dist.get_world_size(group)
        self.rank_in_group = dist.get_rank(group)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` (same shape and dtype on all) along
        ``dim``, rank order: ``[..., N * input_.shape[dim], ...]``."""
        if self.world_size == 1:
            return input_
        x = input_.contiguous().to(self.device)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim).to(input_.device)
