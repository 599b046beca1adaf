"""The accepted prefix every rank of a DCP group commits (design §8).

The target model scores ``K`` draft tokens in one forward under DCP: each
rank attends over its own KV pages, and the all-gather + LSE merge gives the
same logits on every rank, so vLLM's rejection sampler accepts the same
prefix on every rank. The ranks still reduce their accepted counts to the MIN
over the group before anything is committed: should one rank's drafts or
logits differ (a bug, a corrupted buffer), every rank still commits the
same number of tokens and the sharded KV pool stays consistent. The
committed tokens are the same too: target outputs up to the first draft index
where ranks differ come from identical inputs, and at that index at most one
of the differing drafts matches the target, so the MIN stops there or before.

vLLM's V1 runner cuts its sampler's output with :func:`agree_sampled` (the MIN
of :func:`agree_accepted_prefix`; ``vllm_compat/spec_decode.py``), Model Runner
V2 (vLLM 0.34) its per-request counts with :func:`agree_num_sampled`
(``vllm_compat/spec_decode_v2.py``).
"""

from __future__ import annotations

import torch

from vllm_dcp2d.attention.dcp import Group

__all__ = ["agree_accepted_prefix", "agree_sampled", "agree_num_sampled"]

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID (0.32, 0.33): a rejected position in sampled_token_ids


def agree_accepted_prefix(accepted: torch.Tensor, group: Group) -> torch.Tensor:
    """The accepted count every rank of ``group`` commits: the MIN over ranks.

    Called by every rank of the DCP group once per verify step, after its
    rejection sampling and before any KV or token is committed.

    accepted: int ``[B]``, this rank's counts, requests in the order all ranks share.
    group: ``world_size``, ``rank_in_group``, ``all_gather(tensor, dim)`` (vLLM's
    ``GroupCoordinator``, or :class:`~vllm_dcp2d.spec_decode.group.TorchGroup`).
    Returns int64 ``[B]`` on ``accepted.device``. A request that some rank does
    not have (its batch is shorter) gets 0, as in ``consensus_prefix_lens``.

    Collectives, the same on every rank: an all-gather of the batch size, then
    (unless every size is 0, or some rank's input is invalid) an all-gather of
    the counts zero-padded to the largest size. Acceptance is
    prefix-closed, so the MIN is a prefix every rank verified. A rank whose
    ``accepted`` is invalid still joins the first collective, with size -1,
    and then every rank raises ``ValueError``: the group stays usable.
    """
    try:
        counts, invalid = _counts(accepted), None
    except ValueError as e:
        counts, invalid = torch.zeros(0, dtype=torch.int64, device=getattr(accepted, "device", "cpu")), e
    if group.world_size == 1:
        if invalid:
            raise invalid
        return counts.clone()
    size = torch.tensor([-1 if invalid else counts.numel()], dtype=torch.int64, device=counts.device)
    sizes = group.all_gather(size, dim=0)  # [N]
    bad = (sizes < 0).nonzero().flatten().tolist()
    if bad:
        msg = f"dcp rank {group.rank_in_group}: accepted counts invalid on rank(s) {bad}; nothing committed"
        raise ValueError(msg + (f"; here: {invalid}" if invalid else "")) from invalid
    width = int(sizes.max())
    if width == 0:
        return counts
    padded = torch.zeros(width, dtype=torch.int64, device=counts.device)
    padded[: counts.numel()] = counts
    return group.all_gather(padded[None], dim=0).amin(dim=0)[: counts.numel()]


def _counts(accepted) -> torch.Tensor:
    if not isinstance(accepted, torch.Tensor):
        raise ValueError(f"accepted must be a torch.Tensor, got {type(accepted).__name__}")
    if accepted.dim() != 1:
        raise ValueError(f"accepted must be 1-D [B], got shape {tuple(accepted.shape)}")
    if accepted.dtype.is_floating_point or accepted.dtype.is_complex or accepted.dtype == torch.bool:
        raise ValueError(f"accepted must hold integers, got dtype {accepted.dtype}")
    if accepted.numel() and int(accepted.min()) < 0:
        raise ValueError(f"accepted must be >= 0, got min {int(accepted.min())}")
    return accepted.long()


def agree_sampled(sampled: torch.Tensor, group: Group) -> torch.Tensor:
    """Cut each request's sampled tokens to the accepted count every rank agrees on.

    sampled: int ``[B, K + 1]``, vLLM's rejection-sampler output: request ``b``
    commits its leading non-placeholder tokens (``accepted + 1``), then ``-1``.
    group: as :func:`agree_accepted_prefix` takes it (vLLM's V1 runner: a
    :class:`~vllm_dcp2d.spec_decode.group.TorchGroup` over the TP group's gloo group).
    Returns ``sampled`` itself, with positions past the group's MIN set to ``-1``.
    """
    if sampled.dim() != 2 or sampled.shape[1] < 2:
        return sampled
    valid = sampled != PLACEHOLDER
    # Leading run of valid tokens; the sampler never leaves a gap, but a gap must
    # not let a later token through.
    kept = valid.long().cumprod(dim=1).sum(dim=1)
    accepted = (kept - 1).clamp_min(0)
    agreed = agree_accepted_prefix(accepted, group)
    cut = torch.arange(sampled.shape[1], device=sampled.device)[None, :] > agreed[:, None]
    return sampled.masked_fill_(cut | ~valid, PLACEHOLDER)


def agree_num_sampled(num_sampled: torch.Tensor, num_rejected: torch.Tensor, group) -> None:
    """Model Runner V2's form of :func:`agree_sampled` (vLLM 0.34): in place, every rank
    keeps the MIN over ``group`` of each request's sampled count, and counts what it cut
    as rejected.

    num_sampled, num_rejected: int ``[B]`` on the device, vLLM's per-request counts
    after rejection sampling (``num_rejected = logits - num_sampled``; both 0 for a
    chunked prefill, which the MIN keeps at 0 since every rank has the same batch).
    group: ``all_gather(tensor, dim)`` over ranks that hold the same batch (vLLM's TP
    ``GroupCoordinator``). One all-gather, on the device: no host sync, so it keeps V2's
    asynchronous scheduling. The committed tokens are ``sampled[b, :num_sampled[b]]``,
    so cutting the count cuts the tokens (:func:`agree_sampled`'s docstring says why the
    MIN keeps them equal).
    """
    if num_sampled.shape != num_rejected.shape or num_sampled.dim() != 1:
        raise ValueError(f"num_sampled and num_rejected must both be [B], got {tuple(num_sampled.shape)} and "
                         f"{tuple(num_rejected.shape)}")
    agreed = group.all_gather(num_sampled[None], dim=0).amin(dim=0)
    num_rejected.add_(num_sampled - agreed)
    num_sampled.copy_(agreed)
