"""Prefix-KV broadcast of prefill CP layer-split, safe under prefix divergence
(design §4.2, §7).

Each CP rank matches cached prefixes on its own (a local radix tree, a local
prefetch), so the prefix a rank sees for a request can differ between ranks.
Any collective whose participation depends on that local view deadlocks the
group: one rank skips a broadcast the others wait on, and from then on the
call counts never line up again. Two rules keep every rank in the same
collectives, in the same order, with the same sizes:

size-broadcast (:func:`broadcast_owner_layer_prefix`)
    The owner of the layer broadcasts its prefix slot count ``n`` first, in a
    1-element broadcast every rank joins. Then all ranks skip (``n == 0``) or
    all join one ``n``-token broadcast. A non-owner commits the data to its
    transient slot only when its own slot count is ``n``; otherwise it
    consumes the collective and reports that it has not committed.

consensus prefix (:func:`consensus_prefix_lens`)
    Before a batch is built, ranks agree per request on the shortest prefix
    any of them has (MIN all-reduce). Batch sizes may differ, so the size is
    agreed first (MAX all-reduce) and every rank pads to it. With consensus
    lengths every rank's count equals the owner's and every rank commits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from vllm_dcp2d.prefill.dist import CPGroup
from vllm_dcp2d.prefill.pool import LayerSplitKVPool

__all__ = ["normalize_prefix_lens", "prefix_slots", "broadcast_owner_layer_prefix", "consensus_prefix_lens"]


def normalize_prefix_lens(
    prefix_lens: Sequence[int] | np.ndarray | torch.Tensor | None, batch_size: int
) -> np.ndarray:
    """Prefix lengths as int64 ``[batch_size]``; ``None`` becomes zeros.

    The ``None`` guard runs on every rank, so a rank that has no prefix
    information still joins the same collectives as one that has.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    if prefix_lens is None:
        return np.zeros(int(batch_size), dtype=np.int64)
    if isinstance(prefix_lens, torch.Tensor):
        prefix_lens = prefix_lens.detach().cpu().numpy()
    lens = np.asarray(prefix_lens).reshape(-1)
    if lens.size and lens.dtype.kind not in "iu":
        raise ValueError(f"prefix_lens must hold integers, got dtype {lens.dtype}")
    if lens.size != batch_size:
        raise ValueError(f"prefix_lens has {lens.size} entries, expected batch_size={batch_size}")
    if lens.size and lens.min() < 0:
        raise ValueError(f"prefix_lens must be >= 0, got min {lens.min()}")
    return lens.astype(np.int64)


def prefix_slots(req_to_token: torch.Tensor, req_pool_indices, prefix_lens) -> torch.Tensor:
    """Token slots of the cached prefixes of a batch, request by request.

    req_to_token:     int ``[max_reqs, max_len]``, token slot of each position of each request row.
    req_pool_indices: int ``[B]``, the batch's rows in ``req_to_token``.
    prefix_lens:      int ``[B]`` (or ``None``: no prefix), cached tokens per request.
    Returns int64 ``[sum(prefix_lens)]`` on ``req_to_token.device``: the slots of
    positions ``0 .. prefix_lens[i]-1`` of request ``i``, requests in batch order.
    """
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D [max_reqs, max_len], got shape {tuple(req_to_token.shape)}")
    rows = torch.as_tensor(req_pool_indices, dtype=torch.int64, device=req_to_token.device).reshape(-1)
    lens = torch.from_numpy(normalize_prefix_lens(prefix_lens, rows.numel())).to(req_to_token.device)
    max_len = req_to_token.shape[1]
    if rows.numel() and int(lens.max()) > max_len:
        raise ValueError(f"prefix_lens must be <= req_to_token.shape[1]={max_len}, got max {int(lens.max())}")
    mask = torch.arange(max_len, device=req_to_token.device) < lens[:, None]
    return req_to_token[rows][mask].to(torch.int64)


def broadcast_owner_layer_prefix(
    layer: int,
    pool: LayerSplitKVPool,
    cp: CPGroup,
    req_to_token: torch.Tensor,
    req_pool_indices,
    prefix_lens,
) -> bool:
    """Give every CP rank the owner's cached prefix KV of ``layer`` (size-broadcast).

    Called by every rank of ``cp`` for every layer, before the layer's
    attention reads its prefix, whatever the rank's local prefix is.

    pool:             this rank's pool; the owner reads ``layer``'s owned slot, the
                      other ranks write their transient slot.
    req_to_token:     int ``[max_reqs, max_len]``, this rank's page table (token slots).
    req_pool_indices: int ``[B]``, the batch's rows in ``req_to_token``.
    prefix_lens:      int ``[B]`` or ``None`` (normalized to zeros), this rank's cached
                      prefix per request.

    Returns whether ``pool.layer_kv(layer)`` now holds the owner's prefix KV at
    this rank's prefix slots: always on the owner; on another rank exactly
    when its slot count equals the owner's ``n``. A ``False`` rank has still
    joined every collective, so the group stays usable; its attention input
    for the prefix is not valid (use :func:`consensus_prefix_lens` to avoid it).

    Raises ``ValueError`` (after joining this call's collectives) on a rank
    whose own prefix is invalid, and on every rank if the owner's is.
    """
    if (pool.cp_rank, pool.cp_size) != (cp.rank, cp.size):
        raise ValueError(
            f"pool is for cp_rank {pool.cp_rank}/{pool.cp_size} but the group is rank {cp.rank}/{cp.size}"
        )
    owner = pool.owner(layer)
    src = cp.global_rank(owner)
    # A bad local view must not make this rank skip the collectives below:
    # it joins them and raises afterwards. An owner that cannot read its
    # prefix sends n = -1 and every rank raises.
    try:
        slots, invalid = _local_slots(pool, req_to_token, req_pool_indices, prefix_lens), None
    except ValueError as e:
        slots, invalid = torch.zeros(0, dtype=torch.int64), e
    local_n = -1 if invalid else slots.numel()

    # Step 1: every rank joins the count broadcast, whatever its local prefix.
    count = torch.tensor([local_n], dtype=torch.int64, device=cp.device)
    dist.broadcast(count, src=src, group=cp.group)
    n = int(count.item())
    # Step 2: the branch depends on n only, which is the same on every rank.
    if n < 0:
        raise ValueError(f"cp_rank {cp.rank}, layer {layer}: owner rank {owner} has an invalid prefix"
                         + (f"; here too: {invalid}" if invalid else ""))
    if n == 0:
        if invalid:
            raise ValueError(f"cp_rank {cp.rank}, layer {layer}: {invalid}") from invalid
        return cp.rank == owner or local_n == 0

    kv = pool.layer_kv(layer)  # [2, num_tokens, H, D]
    slots = slots.to(kv.device)
    if cp.rank == owner:
        buf = kv[:, slots].to(cp.device)
    else:
        buf = torch.empty((2, n, *kv.shape[2:]), dtype=kv.dtype, device=cp.device)
    dist.broadcast(buf, src=src, group=cp.group)
    if invalid:
        raise ValueError(f"cp_rank {cp.rank}, layer {layer}: {invalid}") from invalid
    if cp.rank == owner:
        return True
    if local_n != n:
        return False  # consumed without committing: the local view disagrees with the owner
    kv[:, slots] = buf.to(kv.device)
    return True


def _local_slots(pool: LayerSplitKVPool, req_to_token, req_pool_indices, prefix_lens) -> torch.Tensor:
    """:func:`prefix_slots`, checked against the pool's token slots."""
    slots = prefix_slots(req_to_token, req_pool_indices, prefix_lens)
    if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < pool.num_tokens):
        raise ValueError(f"prefix token slots must be in [0, {pool.num_tokens}), "
                         f"got [{int(slots.min())}, {int(slots.max())}]")
    return slots


def consensus_prefix_lens(prefix_lens, batch_size: int, cp: CPGroup) -> np.ndarray:
    """The prefix length every CP rank can use, per request: the MIN over ranks.

    Called by every rank of ``cp`` once per batch, before the batch's
    extend tokens are chosen, with that rank's local prefix matches.

    prefix_lens: int ``[batch_size]`` or ``None`` (zeros), this rank's matches,
                 requests in the order all ranks share.
    Returns int64 ``[batch_size]``. Entry ``i`` is the minimum over ranks of
    their entry ``i``; a request that some rank does not have (its batch is
    shorter) gets 0, since that rank holds no prefix for it.

    The same collectives, with the same shapes, on every rank: a 1-element
    MAX all-reduce of the batch size, then (unless that size is 0 everywhere)
    a MIN all-reduce of the lengths zero-padded to that size.
    """
    lens = normalize_prefix_lens(prefix_lens, batch_size)
    size = torch.tensor([lens.size], dtype=torch.int64, device=cp.device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=cp.group)
    if int(size.item()) == 0:
        return lens  # every rank saw the same 0: all skip the second collective
    padded = torch.zeros(int(size.item()), dtype=torch.int64)
    padded[: lens.size] = torch.from_numpy(lens)
    padded = padded.to(cp.device)
    dist.all_reduce(padded, op=dist.ReduceOp.MIN, group=cp.group)
    return padded[: lens.size].cpu().numpy()
