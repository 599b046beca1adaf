"""Cross-rank step of DCP attention: all-gather the partial (O, LSE) and merge
(design §5.2).

``group`` is anything with ``world_size``, ``rank_in_group`` and
``all_gather(tensor, dim)`` (vLLM's ``GroupCoordinator``), so tests can pass a
single-process stand-in.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_dcp2d.attention.merge import merge_lse

__all__ = ["Group", "all_gather_partials", "dcp_merge"]


class Group(Protocol):
    world_size: int
    rank_in_group: int

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


def all_gather_partials(o: torch.Tensor, lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack every rank's partial result.

    o: ``[T, H, D]``; lse: ``[T, H]`` (the same shapes on every rank).
    Returns ``(o [N, T, H, D], lse [N, T, H])``, rank ``n``'s result at index ``n``.
    """
    if group.world_size == 1:
        return o[None], lse[None]
    if o.dtype == lse.dtype:
        # One collective instead of two: LSE rides along as an extra column.
        both = group.all_gather(torch.cat([o, lse[..., None]], dim=-1)[None], dim=0)
        return both[..., :-1], both[..., -1]
    return (group.all_gather(o.contiguous()[None], dim=0),
            group.all_gather(lse.contiguous()[None], dim=0))


def dcp_merge(
    o: torch.Tensor,
    lse: torch.Tensor,
    group: Group,
    heads: slice | None = None,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
    base_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's shard result with every other rank's.

    o: ``[T, Hg, D]`` and lse: ``[T, Hg]``, this rank's attention over its local KV
    pages, for all ``Hg`` query heads of the DCP group (queries were all-gathered).
    heads: the slice of ``Hg`` this rank keeps (its own TP heads); all if None.
    local: an extra partial ``(o [T, H, D], lse [T, H])`` over the kept heads that only
    this rank contributes: the attention of the step's new tokens over themselves.
    Returns ``(out [T, H, D], lse [T, H])`` float32, the exact attention over all pages
    (and the new tokens).
    """
    os, lses = all_gather_partials(o, lse, group)
    if heads is not None:
        os, lses = os[:, :, heads], lses[:, :, heads]
    if local is not None:
        os = torch.cat([os, local[0].to(os.dtype)[None]])
        lses = torch.cat([lses, local[1].to(lses.dtype)[None]])
    return merge_lse(os, lses, base_e=base_e)
