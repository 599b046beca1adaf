"""Attention that returns its log-sum-exp, over paged or ragged KV (torch).

A DCP rank holds only its shard of every sequence's KV pages (design §5.1). It
attends over those local pages, returns ``(O, LSE)``, and the ranks merge
(:mod:`vllm_dcp2d.attention.merge`). Also used for the attention of the
tokens of the current step over themselves, which every rank has in full.

All math runs in float32 (float64 for float64 inputs) on padded per-request
batches: ``[R, Q, H, D]`` queries against ``[R, L, Hkv, D]`` keys. Grouped-query
attention maps query head ``h`` to KV head ``h // (H // Hkv)``, as vLLM does.
A row that sees no key gets ``O = 0`` and ``LSE = -inf``.
"""

from __future__ import annotations

import torch

__all__ = ["attention_lse", "gather_pages", "plain_layout", "paged_attention_lse", "varlen_attention_lse", "pad_tokens"]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded batched attention with LSE.

    q: ``[R, Q, H, Dk]``; k: ``[R, L, Hkv, Dk]``; v: ``[R, L, Hkv, Dv]``, any float dtype.
    q_lens, kv_lens: ``[R]`` integers, valid rows of ``q`` and ``k``/``v`` per request.
    causal: query ``i`` of request ``r`` sees keys ``j <= kv_lens[r] - q_lens[r] + i``
    (queries are the last ``q_lens`` tokens of the sequence); otherwise it sees all
    ``kv_lens[r]`` keys.
    Returns ``(o [R, Q, H, Dv], lse [R, Q, H])`` in float32 (float64 for float64 q),
    natural-log LSE; padded query rows are zeros with LSE -inf.
    """
    r, nq, h, dk = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    acc = _acc_dtype(q)
    qf = q.to(acc).permute(0, 2, 1, 3)  # [R, H, Q, Dk]
    group = h // hkv
    kf = k.to(acc).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [R, H, L, Dk]
    vf = v.to(acc).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [R, H, L, Dv]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [R, H, Q, L]
    j = torch.arange(k.shape[1], device=q.device)
    kv_lens = kv_lens.to(device=q.device, dtype=torch.long)
    q_lens = q_lens.to(device=q.device, dtype=torch.long)
    visible = j[None, None, :] < kv_lens[:, None, None]  # [R, 1, L]
    if causal:
        i = torch.arange(nq, device=q.device)
        last = kv_lens[:, None] - q_lens[:, None] + i[None, :]  # [R, Q]
        visible = visible & (j[None, None, :] <= last[:, :, None])  # [R, Q, L]
    visible = visible & (torch.arange(nq, device=q.device)[None, :, None] < q_lens[:, None, None])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, H, Q]; -inf where nothing is visible
    p = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    o = torch.matmul(p, vf)  # rows with no visible key: p == 0 -> o == 0
    return o.permute(0, 2, 1, 3), lse.permute(0, 2, 1)


def plain_layout(block_size: int, head_size: int, device=None) -> torch.Tensor:
    """Layout of a row-major ``[block_size, head_size]`` page interior: ``[bs, D]`` int64,
    element ``(t, d)`` at flat position ``t * head_size + d``."""
    return torch.arange(block_size * head_size, device=device).view(block_size, head_size)


def gather_pages(cache: torch.Tensor, layout: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first ``length`` tokens of each request out of a paged cache.

    cache: ``[num_blocks, Hkv, S]``, the flat interior of each (page, KV head).
    layout: ``[block_size, D]`` int64, flat position in ``S`` of token ``t``'s
    element ``d`` (vLLM's CPU kernels pack pages per ISA, so this is not always
    row-major; see :func:`plain_layout`).
    block_table: ``[R, W]`` integer page ids; token ``j`` of request ``r`` is token
    ``j % block_size`` of page ``block_table[r, j // block_size]``.
    Returns ``[R, length, Hkv, D]`` in cache.dtype; entries past a request's own
    length hold whatever its table points at and must be masked by the caller.
    """
    block_size = layout.shape[0]
    j = torch.arange(length, device=cache.device)
    cols = torch.clamp(j // block_size, max=max(block_table.shape[1] - 1, 0))
    blocks = block_table[:, cols].long()  # [R, length]
    pos = layout[j % block_size]  # [length, D]
    # Advanced indices around a slice: the result is [R, length, D, Hkv].
    return cache[blocks[:, :, None], :, pos[None]].permute(0, 1, 3, 2)


def pad_tokens(x: torch.Tensor, query_start_loc: torch.Tensor, max_len: int) -> torch.Tensor:
    """Scatter ragged tokens ``x [T, ...]`` into ``[R, max_len, ...]`` (zeros elsewhere).

    query_start_loc: ``[R + 1]`` integer offsets of each request's tokens in ``x``.
    """
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    r = lens.shape[0]
    out = x.new_zeros((r, max_len, *x.shape[1:]))
    i = torch.arange(max_len, device=x.device)
    valid = i[None, :] < lens[:, None]  # [R, max_len]
    out[valid] = x[(starts[:, None] + i[None, :])[valid]]
    return out


def _unpad(x: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    i = torch.arange(x.shape[1], device=x.device)
    valid = i[None, :] < lens[:, None]
    out = x.new_empty((num_tokens, *x.shape[2:]))
    out[(starts[:, None] + i[None, :])[valid]] = x[valid]
    return out


def paged_attention_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_layout: torch.Tensor,
    v_layout: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_kv_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of ragged queries over each request's paged KV.

    This is a DCP rank's context attention: every query of request ``r`` sees
    the first ``kv_lens[r]`` tokens of its local pages (all of them precede the
    queries in the sequence, so no causal mask applies).

    q: ``[T, H, Dk]``; k_cache, v_cache: ``[num_blocks, Hkv, S]`` flat page interiors
    with layouts k_layout ``[block_size, Dk]``, v_layout ``[block_size, Dv]`` (see
    :func:`gather_pages`; the same tensor may serve as K and V, as in MLA);
    block_table: ``[R, W]`` int;
    kv_lens: ``[R]`` int (0 = empty shard); query_start_loc: ``[R + 1]`` int.
    max_kv_len: ``max(kv_lens)`` when the caller knows it (saves a host sync).
    Returns ``(o [T, H, Dv], lse [T, H])`` float32, natural log; LSE is -inf and
    O is 0 for queries whose shard is empty.
    """
    t = q.shape[0]
    r = kv_lens.shape[0]
    q_lens = query_start_loc[1:].long() - query_start_loc[:-1].long()
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max()) if r else 0
    acc = _acc_dtype(q)
    if t == 0 or max_kv_len == 0:
        return q.new_zeros((t, q.shape[1], v_layout.shape[-1]), dtype=acc), q.new_full(
            (t, q.shape[1]), float("-inf"), dtype=acc
        )
    max_q = int(q_lens.max())
    qp = pad_tokens(q, query_start_loc, max_q)
    k = gather_pages(k_cache, k_layout, block_table[:r], max_kv_len)
    v = gather_pages(v_cache, v_layout, block_table[:r], max_kv_len)
    o, lse = attention_lse(qp, k, v, q_lens, kv_lens, scale, causal=False)
    return _unpad(o, query_start_loc, t), _unpad(lse, query_start_loc, t)


def varlen_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's new tokens over themselves.

    q: ``[T, H, Dk]``; k: ``[T, Hkv, Dk]``; v: ``[T, Hkv, Dv]``; query_start_loc:
    ``[R + 1]`` int. Returns ``(o [T, H, Dv], lse [T, H])`` float32, natural log.
    """
    t = q.shape[0]
    q_lens = query_start_loc[1:].long() - query_start_loc[:-1].long()
    if t == 0:
        return q.new_zeros((0, q.shape[1], v.shape[-1]), dtype=_acc_dtype(q)), q.new_zeros(
            (0, q.shape[1]), dtype=_acc_dtype(q)
        )
    max_q = int(q_lens.max())
    o, lse = attention_lse(
        pad_tokens(q, query_start_loc, max_q),
        pad_tokens(k, query_start_loc, max_q),
        pad_tokens(v, query_start_loc, max_q),
        q_lens, q_lens, scale, causal=True,
    )
    return _unpad(o, query_start_loc, t), _unpad(lse, query_start_loc, t)
