"""Context-parallel prefill forward of a tiny transformer over a layer-split pool.

The model is small on purpose (embedding + position table, then per layer
causal multi-head attention and a ReLU MLP, both residual); what it exercises
is the data flow of prefill CP layer-split:

0. the ranks check, with two small all-reduces, that they hold the same
   batch (the collectives below are sized by it) and all raise if not;
1. the batch's extend tokens are split into ``cp_size`` contiguous chunks and
   rank ``r`` computes chunk ``r`` only;
2. per layer, each rank's K/V rows are all-gathered, so every rank has the K/V
   of every extend token;
3. the owner of the layer broadcasts the cached prefix K/V
   (:func:`broadcast_owner_layer_prefix`);
4. the layer's K/V (prefix + extend) sit in the owner's own layer slot, and in
   the transient slot on the other ranks, which the next layer overwrites;
5. each rank's queries attend over that slot through its page table.

Bit-exactness against :func:`reference_forward` (no CP, no cache: every
sequence recomputed from token 0, on the same device) is by construction,
not by tolerance: every reduction has a shape that depends neither on the
batch nor on the chunk. Linear layers reduce with an explicit broadcast-multiply + ``sum``
over the input dim (a BLAS GEMM may pick a different kernel, hence summation
order, for a different row count), and attention always reads a fixed window
of ``max_len`` key slots, masked, so a query's softmax and weighted sum see
the same shapes whether it runs in a chunk of 3 tokens or a batch of 300.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vllm_dcp2d.layout import cp_layer_range
from vllm_dcp2d.prefill.broadcast import broadcast_owner_layer_prefix, normalize_prefix_lens
from vllm_dcp2d.prefill.dist import CPGroup
from vllm_dcp2d.prefill.pool import LayerSplitKVPool

__all__ = [
    "TinyConfig", "PrefillBatch", "init_weights", "cp_token_range", "cp_prefill_forward", "reference_forward",
]


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the tiny model. ``max_len`` is the longest sequence and the
    fixed attention window every query reads."""

    num_layers: int = 4
    hidden: int = 16
    num_heads: int = 2
    head_dim: int = 8
    ffn: int = 32
    vocab: int = 64
    max_len: int = 64


@dataclass
class PrefillBatch:
    """One prefill (extend) step on one rank.

    input_ids:        int64 ``[T]``, the extend tokens, request after request.
    req_pool_indices: int64 ``[B]``, the requests' rows in ``req_to_token``.
    prefix_lens:      int64 ``[B]`` or ``None`` (zeros), cached tokens per request;
                      must be the same on every rank (the consensus prefix).
    extend_lens:      int64 ``[B]``, new tokens per request, ``sum == T``.
    req_to_token:     int64 ``[max_reqs, >= max_len]``, this rank's page table: token
                      slot of each position. Slots of the extend positions must
                      already be allocated; entries past a sequence are ignored.
                      Only this tensor may differ across ranks.
    """

    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: np.ndarray | None
    extend_lens: np.ndarray
    req_to_token: torch.Tensor


def init_weights(cfg: TinyConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Random weights (CPU); per-layer matrices are stacked on dim 0 (``[L, in, out]``)."""
    g = torch.Generator().manual_seed(seed)
    L, D, HD, F = cfg.num_layers, cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.ffn

    def rand(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-2])).to(dtype)

    return {
        "emb": torch.randn(cfg.vocab, D, generator=g, dtype=torch.float64).to(dtype),
        "pos": (0.1 * torch.randn(cfg.max_len, D, generator=g, dtype=torch.float64)).to(dtype),
        "wq": rand(L, D, HD), "wk": rand(L, D, HD), "wv": rand(L, D, HD),
        "wo": rand(L, HD, D), "w1": rand(L, D, F), "w2": rand(L, F, D),
    }


def cp_token_range(num_tokens: int, cp_size: int, cp_rank: int) -> range:
    """Extend tokens computed by ``cp_rank``: a contiguous chunk, the first
    ``num_tokens % cp_size`` ranks one token more (the split of ``cp_layer_range``)."""
    return cp_layer_range(num_tokens, cp_size, cp_rank)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, K] x [K, N] -> [M, N]``; row ``i`` depends on ``x[i]`` only, in a fixed order."""
    return (x[:, :, None] * w).sum(1)


def _qkv(w, layer: int, x: torch.Tensor, cfg: TinyConfig):
    """x ``[M, hidden]`` -> q, k, v each ``[M, num_heads, head_dim]``."""
    shape = (x.shape[0], cfg.num_heads, cfg.head_dim)
    return tuple(_linear(x, w[name][layer]).view(shape) for name in ("wq", "wk", "wv"))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Masked attention of each query over its own key window.

    q: ``[M, H, Dh]``; k, v: ``[M, W, H, Dh]`` (window of each query); valid: bool ``[M, W]``.
    Returns ``[M, H, Dh]``. Invalid window entries may hold anything (even NaN).
    """
    scores = (q[:, None] * k).sum(-1) / math.sqrt(q.shape[-1])  # [M, W, H]
    scores = scores.masked_fill(~valid[..., None], float("-inf"))
    p = torch.softmax(scores, dim=1)
    v = torch.where(valid[..., None, None], v, 0.0)
    return (p[..., None] * v).sum(1)


def _block(w, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Output projection + residual, then ReLU MLP + residual: ``[M, hidden]``."""
    x = x + _linear(attn.flatten(1), w["wo"][layer])
    return x + _linear(torch.relu(_linear(x, w["w1"][layer])), w["w2"][layer])


def _gather_rows(rows: torch.Tensor, num_tokens: int, cp: CPGroup) -> torch.Tensor:
    """All-gather each rank's chunk ``[2, t_r, H, Dh]`` into ``[2, num_tokens, H, Dh]``.

    Chunks differ by at most one row, so each is zero-padded to the largest
    (rank 0's) and the padding dropped after the gather.
    """
    chunk = len(cp_token_range(num_tokens, cp.size, 0))
    padded = torch.zeros((rows.shape[0], chunk, *rows.shape[2:]), dtype=rows.dtype, device=cp.device)
    padded[:, : rows.shape[1]] = rows.to(cp.device)
    parts = [torch.empty_like(padded) for _ in range(cp.size)]
    dist.all_gather(parts, padded, group=cp.group)
    sizes = [len(cp_token_range(num_tokens, cp.size, r)) for r in range(cp.size)]
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1).to(rows.device)


def _check_batch(batch: PrefillBatch, cfg: TinyConfig, pool: LayerSplitKVPool):
    """Validate ``batch`` locally; returns (prefix_lens [B], extend_lens [B], positions [T], token_req [T])."""
    B = batch.req_pool_indices.numel()
    prefix = normalize_prefix_lens(batch.prefix_lens, B)
    extend = normalize_prefix_lens(batch.extend_lens, B)
    T = batch.input_ids.numel()
    if int(extend.sum()) != T:
        raise ValueError(f"sum(extend_lens)={int(extend.sum())} but input_ids has {T} tokens")
    if B and int((prefix + extend).max()) > cfg.max_len:
        raise ValueError(f"a sequence is longer than max_len={cfg.max_len}: {int((prefix + extend).max())}")
    table = batch.req_to_token
    if table.dim() != 2 or table.shape[1] < cfg.max_len:
        raise ValueError(f"req_to_token must be [max_reqs, >= max_len={cfg.max_len}], got {tuple(table.shape)}")
    rows = batch.req_pool_indices
    if B and not (0 <= int(rows.min()) and int(rows.max()) < table.shape[0]):
        raise ValueError(f"req_pool_indices must be in [0, {table.shape[0]}), got {rows.tolist()}")
    used = table[rows, : cfg.max_len][torch.arange(cfg.max_len) < torch.from_numpy(prefix + extend)[:, None]]
    if used.numel() and not (0 <= int(used.min()) and int(used.max()) < pool.num_tokens):
        raise ValueError(f"req_to_token must map the batch's positions to token slots in [0, {pool.num_tokens}), "
                         f"got [{int(used.min())}, {int(used.max())}]")
    token_req = np.repeat(np.arange(B), extend)
    starts = np.cumsum(extend) - extend
    positions = prefix[token_req] + np.arange(T) - starts[token_req]
    return prefix, extend, torch.from_numpy(positions), torch.from_numpy(token_req)


def _same_on_all_ranks(values: np.ndarray, cp: CPGroup) -> bool:
    """Whether int64 ``values`` (same length on every rank) are equal on all
    ranks: one MAX all-reduce of ``[values, -values]`` gives max and -min."""
    t = torch.from_numpy(np.concatenate([values, -values]).astype(np.int64)).to(cp.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cp.group)
    hi, neg_lo = t.cpu().numpy().reshape(2, -1)
    return bool(np.array_equal(hi, -neg_lo))


@torch.no_grad()
def cp_prefill_forward(
    weights: dict[str, torch.Tensor],
    cfg: TinyConfig,
    batch: PrefillBatch,
    pool: LayerSplitKVPool,
    cp: CPGroup,
) -> torch.Tensor:
    """Prefill ``batch`` with context parallelism over ``cp``; called by every rank.

    Returns this rank's hidden states, ``[len(cp_token_range(T, N, r)), hidden]``
    (weights' dtype), rows of extend tokens ``cp_token_range(T, N, r)``. Leaves
    in ``pool`` the K/V of every token of the batch for the layers this rank
    owns (read later as prefix); the transient slot holds the last non-owned layer.

    Raises ``ValueError`` on every rank, before any K/V moves, unless every
    rank's batch is valid and all have the same shape (``B``, ``T``,
    ``prefix_lens``, ``extend_lens``): the gathers are sized by it, so a rank
    that disagrees would otherwise mismatch the collectives (use the
    consensus prefix). The check costs two small all-reduces and leaves the
    group usable for the next batch.
    """
    # Rank-invariant gate, joined by every rank even when its own batch is
    # invalid; the second check runs on every rank or on none.
    B, T = batch.req_pool_indices.numel(), batch.input_ids.numel()
    try:
        prefix, extend, positions, token_req = _check_batch(batch, cfg, pool)
        invalid = None
    except ValueError as e:
        invalid = e
    same = _same_on_all_ranks(np.array([invalid is None, B, T]), cp)
    if invalid is not None:
        raise ValueError(f"cp_rank {cp.rank}: {invalid}; batch dropped on every rank") from invalid
    if not same or not _same_on_all_ranks(np.concatenate([prefix, extend]), cp):
        raise ValueError(
            f"cp_rank {cp.rank}: batch differs across CP ranks or is invalid on one (here B={B}, T={T}, "
            f"prefix_lens={prefix.tolist()}, extend_lens={extend.tolist()}); pass consensus_prefix_lens. "
            "Batch dropped on every rank."
        )
    dev = pool.device
    if T == 0:  # agreed above: every rank returns here, no collective skipped by one only
        return torch.zeros(0, cfg.hidden, dtype=weights["emb"].dtype, device=dev)
    rows = batch.req_pool_indices.to(dev, torch.int64)
    table = batch.req_to_token.to(dev)
    mine = cp_token_range(T, cp.size, cp.rank)
    sl = slice(mine.start, mine.stop)
    out_cache_loc = table[rows[token_req], positions]  # [T] slots of the extend tokens
    valid = (torch.arange(cfg.max_len) <= positions[sl][:, None]).to(dev)  # [t, W] causal mask
    # [t, W] key slots of my queries; masked entries read slot 0 (any valid slot would do)
    window = torch.where(valid, table[rows[token_req[sl]], : cfg.max_len], 0)
    w = {k: v.to(dev) for k, v in weights.items()}

    x = w["emb"][batch.input_ids[sl].to(dev)] + w["pos"][positions[sl].to(dev)]
    for layer in range(cfg.num_layers):
        q, k, v = _qkv(w, layer, x, cfg)
        kv_new = _gather_rows(torch.stack([k, v]), T, cp)  # [2, T, H, Dh]
        # Equal prefix_lens on all ranks (checked above) means equal counts: always commits.
        if not broadcast_owner_layer_prefix(layer, pool, cp, table, rows, prefix):
            raise AssertionError(f"cp_rank {cp.rank}: layer {layer} prefix did not commit despite equal lens")
        kv = pool.layer_kv(layer)  # owned slot, or the transient slot
        kv[:, out_cache_loc] = kv_new.to(kv.dtype)
        attn = _attend(q, kv[0][window], kv[1][window], valid)
        x = _block(w, layer, x, attn)
    return x


@torch.no_grad()
def reference_forward(weights: dict[str, torch.Tensor], cfg: TinyConfig, sequences: list[torch.Tensor]):
    """The same model without CP and without cache: every sequence from token 0.

    sequences: list of int64 ``[S_i]`` token ids, ``S_i <= max_len``.
    Returns ``(hidden, kv)``: lists over sequences of ``[S_i, hidden]`` and
    ``[num_layers, 2, S_i, num_heads, head_dim]`` (weights' dtype).
    """
    lens = np.array([s.numel() for s in sequences], dtype=np.int64)
    if lens.size and int(lens.max()) > cfg.max_len:
        raise ValueError(f"a sequence is longer than max_len={cfg.max_len}: {int(lens.max())}")
    ids = torch.cat(list(sequences)) if sequences else torch.zeros(0, dtype=torch.int64)
    token_seq = np.repeat(np.arange(lens.size), lens)
    starts = np.cumsum(lens) - lens
    positions = torch.from_numpy(np.arange(ids.numel()) - starts[token_seq])
    # Dense K/V: a query's window is the W rows starting at its sequence's
    # first token; rows past the sequence are masked, clamping keeps them in range.
    window = torch.from_numpy(starts[token_seq])[:, None] + torch.arange(cfg.max_len)
    window = window.clamp(max=max(ids.numel() - 1, 0))
    valid = torch.arange(cfg.max_len) <= positions[:, None]

    x = weights["emb"][ids] + weights["pos"][positions]
    kv_all = []
    for layer in range(cfg.num_layers):
        q, k, v = _qkv(weights, layer, x, cfg)
        kv_all.append(torch.stack([k, v]))
        x = _block(weights, layer, x, _attend(q, k[window], v[window], valid))
    kv_all = torch.stack(kv_all) if kv_all else torch.zeros(0)
    split = [int(n) for n in lens]
    return list(x.split(split)), list(kv_all.split(split, dim=2))
