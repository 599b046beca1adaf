"""Attention that returns its log-sum-exp, over paged or ragged KV (torch).

A DCP rank holds only its shard of every sequence's KV pages (design §5.1). It
attends over those local pages, returns ``(O, LSE)``, and the ranks merge
(:mod:`vllm_dcp2d.attention.merge`). Also used for the attention of the
tokens of the current step over themselves, which every rank has in full.

Math runs in float32 (float64 for float64 inputs). Grouped-query attention
maps query head ``h`` to KV head ``h // (H // Hkv)``, as vLLM does; the ``G =
H // Hkv`` query heads of a KV group are folded into the query-length
dimension (``[R, Hkv, Q * G, D]``), so K and V are never copied per query head.
Keys are consumed in chunks of about ``chunk * 8 / M`` tokens per request
(``M`` folded query rows; whole pages for paged KV, at least one) merged by an
online softmax, so no score matrix spans the whole context.
A row that sees no key gets ``O = 0`` and ``LSE = -inf``. Requests with
more than ``flash.LONG_QUERY`` query tokens (prefill chunks) go one at a time
through torch's fused CPU flash kernel instead (:mod:`.flash`).

**Memory per call** (``R`` requests, ``M = Qmax * G`` folded query rows,
``C`` chunk tokens over the batch in pages of ``bs``, ``e`` the cache element
size, ``a`` = 4 bytes (8 for float64)), independent of the context length:

* one chunk of pages as stored, in a scratch buffer reused by every chunk, step
  and layer: ``Hkv * C * (Dk + Dv) * e`` (K only when V is a prefix of K's
  rows, as in MLA), plus its conversion to ``a`` when ``e != a``;
* scores, their page-merged copy and the mask: ``Hkv * M * C * (2a + 1)``;
* the queries broadcast over the chunk's pages: ``Hkv * M * (C / bs) * Dk * a``;
* the running state (queries, output, max, sum): ``R * Hkv * M * (Dk + Dv + 2) * a``.

Chunk temporaries are freed before the next chunk is read, so the peak is this
sum (``tests/attention/test_paged.py::test_peak_memory_is_bounded_by_one_chunk``).
"""

from __future__ import annotations

import torch

from vllm_dcp2d.attention import flash
from vllm_dcp2d.attention.gather import page_reader

__all__ = ["attention_lse", "paged_attention_lse", "varlen_attention_lse", "pad_tokens", "CHUNK_TOKENS"]

# Keys per online-softmax step, over the whole batch. 8192 keeps an 8-head,
# head-dim-128 decode chunk near 10 MB in float32 and the Python loop short
# (64 steps for 4 requests of 32K tokens).
CHUNK_TOKENS = 8192
# Query rows per request the chunk is sized for (one decode token, 8 heads per KV
# head); with more rows (prefill chunks, verify) keys per step shrink in
# proportion, so scores stay at ``chunk * 8`` elements: a 4096-token prefill
# chunk would otherwise score 8192 keys for 32K rows at once (measured: 6 GB RSS).
_DECODE_ROWS = 8
_MIN_CAUSAL_KEYS = 256


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _fold(q: torch.Tensor, hkv: int, acc: torch.dtype, scale: float) -> torch.Tensor:
    """``[R, Q, H, D]`` -> ``[R, Hkv, Q * G, D]`` in ``acc``, pre-scaled; row
    ``i * G + g`` is query ``i``, head ``kv * G + g``."""
    r, nq, h, d = q.shape
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    g = h // hkv
    return (q.reshape(r, nq, hkv, g, d).permute(0, 2, 1, 3, 4).to(acc) * scale).reshape(r, hkv, nq * g, d)


def _unfold(x: torch.Tensor, nq: int) -> torch.Tensor:
    """``[R, Hkv, Q * G, *rest]`` -> ``[R, Q, Hkv * G, *rest]``."""
    r, hkv, m = x.shape[:3]
    rest = x.shape[3:]
    g = m // nq
    perm = (0, 2, 1, 3, *range(4, 4 + len(rest)))
    return x.view(r, hkv, nq, g, *rest).permute(perm).reshape(r, nq, hkv * g, *rest)


class _OnlineSoftmax:
    """Running (max, sum, output) of rows ``[R, Hkv, M]`` over key chunks."""

    def __init__(self, r: int, hkv: int, m: int, dv: int, acc: torch.dtype, device) -> None:
        self.mx = torch.full((r, hkv, m), float("-inf"), dtype=acc, device=device)
        self.sum = torch.zeros((r, hkv, m), dtype=acc, device=device)
        self.o = torch.zeros((r, hkv, m, dv), dtype=acc, device=device)

    def add(self, s: torch.Tensor, v: torch.Tensor) -> None:
        """s: ``[R, P, Hkv, M, bs]`` scores of ``P`` blocks of ``bs`` keys, ``-inf``
        where hidden (overwritten); v: ``[R, P, Hkv, bs, Dv]``. Blocks are pages:
        K stays in its page layout (vLLM's ``vec`` K pages are column-major)."""
        mx = torch.maximum(self.mx, s.amax(dim=(1, 4)))
        shift = torch.where(mx == float("-inf"), 0.0, mx)  # rows that saw nothing yet
        p = s.sub_(shift[:, None, :, :, None]).exp_()  # exp(-inf) == 0 for hidden keys
        alpha = torch.exp(self.mx - shift)  # 0 for a row's first visible chunk
        self.sum.mul_(alpha).add_(p.sum(dim=(1, 4)))
        r, np_, hkv, m, bs = p.shape
        # One GEMM per (request, KV head) over the whole chunk, not one per page:
        # p is small (M rows); V's pages merge into [C, Dv] without a copy when Hkv == 1.
        pm = p.permute(0, 2, 3, 1, 4).reshape(r, hkv, m, np_ * bs)
        vm = v.permute(0, 2, 1, 3, 4).reshape(r, hkv, np_ * bs, v.shape[-1])
        self.o.mul_(alpha[..., None]).add_(torch.matmul(pm, vm))
        self.mx = mx

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o [R, Hkv, M, Dv], lse [R, Hkv, M])``; rows with no key: 0 and -inf."""
        seen = self.sum > 0
        lse = torch.where(seen, self.mx + torch.log(torch.where(seen, self.sum, 1.0)), float("-inf"))
        return self.o.div_(torch.where(seen, self.sum, 1.0)[..., None]), lse


def _hide(s: torch.Tensor, start: int, limit: torch.Tensor) -> torch.Tensor:
    """Set ``s [R, P, Hkv, M, bs]`` to -inf where key ``start + p * bs + b >= limit [R, M]``."""
    p, bs = s.shape[1], s.shape[4]
    j = torch.arange(start, start + p * bs, device=s.device).view(p, bs)
    return s.masked_fill_(j[None, :, None, None, :] >= limit[:, None, None, :, None], float("-inf"))


def _scores(qf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qf ``[R, Hkv, M, Dk]``, k ``[R, P, Hkv, bs, Dk]`` (any strides) -> ``[R, P, Hkv, M, bs]``."""
    return torch.matmul(qf[:, None], k.transpose(-1, -2))


def _row_limits(q_lens: torch.Tensor, kv_lens: torch.Tensor, nq: int, causal: bool) -> torch.Tensor:
    """Keys visible to each padded query row, ``[R, Q]`` (0 for padding rows)."""
    i = torch.arange(nq, device=q_lens.device)
    lim = kv_lens[:, None] - q_lens[:, None] + i[None, :] + 1 if causal else kv_lens[:, None].expand(-1, nq)
    return torch.where(i[None, :] < q_lens[:, None], lim, 0)


def _fold_limits(lim: torch.Tensor, g: int) -> torch.Tensor:
    """``[R, Q]`` -> ``[R, Q * G]`` (each query row repeated for its G heads)."""
    return lim.repeat_interleave(g, dim=1)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool,
    chunk: int = CHUNK_TOKENS,
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
    r, nq, h, _ = q.shape
    hkv, acc = k.shape[2], _acc_dtype(q)
    qf = _fold(q, hkv, acc, scale)
    lim = _fold_limits(_row_limits(q_lens.to(q.device).long(), kv_lens.to(q.device).long(), nq, causal), h // hkv)
    state = _OnlineSoftmax(r, hkv, qf.shape[2], v.shape[-1], acc, q.device)
    step = max(min(_MIN_CAUSAL_KEYS, chunk), chunk * _DECODE_ROWS // max(r * qf.shape[2], 1))
    for s0 in range(0, k.shape[1], step):
        kc = k[:, None, s0:s0 + step].transpose(2, 3).to(acc)  # [R, 1, Hkv, C / R, Dk]
        vc = v[:, None, s0:s0 + step].transpose(2, 3).to(acc)  # [R, 1, Hkv, C / R, Dv]
        state.add(_hide(_scores(qf, kc), s0, lim), vc)
    o, lse = state.result()
    return _unfold(o, nq), _unfold(lse, nq)


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
    token_kv_lens: torch.Tensor | None = None,
    chunk: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of ragged queries over each request's paged KV.

    This is a DCP rank's context attention: every query of request ``r`` sees
    the first ``kv_lens[r]`` tokens of its local pages (all of them precede the
    queries in the sequence, so no causal mask applies).

    q: ``[T, H, Dk]``; k_cache, v_cache: ``[num_blocks, Hkv, S]`` flat page interiors
    with layouts k_layout ``[block_size, Dk]``, v_layout ``[block_size, Dv]`` (see
    :mod:`.gather`; the same tensor may serve as K and V, as in MLA, and is
    then read once when V's layout is a prefix of K's rows);
    block_table: ``[R, W]`` int;
    kv_lens: ``[R]`` int (0 = empty shard); query_start_loc: ``[R + 1]`` int.
    max_kv_len: ``max(kv_lens)`` when the caller knows it (saves a host sync).
    token_kv_lens: ``[T]`` int, keys visible to each query token, at most its
    request's ``kv_lens`` (verifying drafts with the step's tokens already in the
    cache, as MLA does); ``kv_lens[r]`` for every token when None.
    chunk: keys per online-softmax step over the batch, rounded down to whole pages
    per request (at least one).
    Returns ``(o [T, H, Dv], lse [T, H])`` float32, natural log; LSE is -inf and
    O is 0 for queries whose shard is empty.
    """
    t, h = q.shape[0], q.shape[1]
    r = kv_lens.shape[0]
    hkv, dv = k_cache.shape[1], v_layout.shape[-1]
    q_lens = query_start_loc[1:].long() - query_start_loc[:-1].long()
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max()) if r else 0
    acc = _acc_dtype(q)
    if t == 0 or max_kv_len == 0:
        return q.new_zeros((t, h, dv), dtype=acc), q.new_full((t, h), float("-inf"), dtype=acc)
    bs = k_layout.shape[0]
    read_k = page_reader(k_layout, k_cache.shape[-1])
    # MLA: V is the first Dv columns of the latent rows K already holds.
    v_in_k = (v_cache is k_cache and v_layout.shape[1] <= k_layout.shape[1]
              and torch.equal(v_layout, k_layout[:, : v_layout.shape[1]]))
    read_v = None if v_in_k else page_reader(v_layout, v_cache.shape[-1])
    block_rows = block_table[:r].long()
    flash_ok = token_kv_lens is None and read_v is not None and k_layout.shape[1] == dv
    long = flash.long_requests(q_lens) if flash_ok else []
    if long:
        return _route(query_start_loc, long, (t, h, dv), acc, lambda reqs, sel, qsl: paged_attention_lse(
            q[sel], k_cache, v_cache, k_layout, v_layout, block_table[reqs], kv_lens[reqs], qsl, scale, chunk=chunk),
            lambda i, s, e: _flash_context(q[s:e], k_cache, v_cache, read_k, read_v, block_rows[i], int(kv_lens[i]),
                                           bs, acc, scale, chunk))
    max_q = int(q_lens.max())
    qf = _fold(pad_tokens(q, query_start_loc, max_q), hkv, acc, scale)  # [R, Hkv, M, Dk]
    if token_kv_lens is None:
        lim = _row_limits(q_lens, kv_lens.long(), max_q, causal=False)
    else:
        lim = pad_tokens(token_kv_lens.long(), query_start_loc, max_q)
    lim = _fold_limits(lim, h // hkv)
    pages_per_chunk = max(1, chunk * _DECODE_ROWS // (bs * r * qf.shape[2]))
    state = _OnlineSoftmax(r, hkv, qf.shape[2], dv, acc, q.device)
    num_pages = -(-max_kv_len // bs)
    for p0 in range(0, num_pages, pages_per_chunk):
        # Columns past a request's block table row hold no visible key: clamp and mask.
        cols = torch.clamp(torch.arange(p0, min(p0 + pages_per_chunk, num_pages), device=q.device),
                           max=block_table.shape[1] - 1)
        ids = block_rows[:, cols]  # [R, P]
        k = read_k(k_cache, ids, "k", acc)  # [R, P, Hkv, bs, Dk]
        v = k[..., :dv] if v_in_k else read_v(v_cache, ids, "v", acc)
        state.add(_hide(_scores(qf, k), p0 * bs, lim), v)
        del k, v
    o, lse = state.result()
    return _unpad(_unfold(o, max_q), query_start_loc, t), _unpad(_unfold(lse, max_q), query_start_loc, t)


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
    acc = _acc_dtype(q)
    long = flash.long_requests(q_lens) if k.shape[-1] == v.shape[-1] else []
    if long:
        return _route(query_start_loc, long, (t, q.shape[1], v.shape[-1]), acc,
                      lambda reqs, sel, qsl: varlen_attention_lse(q[sel], k[sel], v[sel], qsl, scale),
                      lambda i, s, e: _flash_causal(q[s:e], k[s:e], v[s:e], acc, scale))
    max_q = int(q_lens.max())
    o, lse = attention_lse(
        pad_tokens(q, query_start_loc, max_q),
        pad_tokens(k, query_start_loc, max_q),
        pad_tokens(v, query_start_loc, max_q),
        q_lens, q_lens, scale, causal=True,
    )
    return _unpad(o, query_start_loc, t), _unpad(lse, query_start_loc, t)


def _route(query_start_loc: torch.Tensor, long: list[int], shape: tuple[int, int, int], acc: torch.dtype,
           short_fn, long_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Requests ``long`` one at a time through ``long_fn(i, start, end)``, the rest in
    one batch through ``short_fn(reqs [R'], tokens [T'], query_start_loc [R' + 1])``,
    each returning ``(o [n, H, Dv], lse [n, H])``. shape: ``(T, H, Dv)``."""
    qsl = query_start_loc.long()
    o = torch.empty(shape, dtype=acc, device=qsl.device)
    lse = torch.empty(shape[:2], dtype=acc, device=qsl.device)
    bounds = qsl.tolist()
    for i in long:
        s, e = bounds[i], bounds[i + 1]
        o[s:e], lse[s:e] = long_fn(i, s, e)
    short = torch.ones(qsl.shape[0] - 1, dtype=torch.bool, device=qsl.device)
    short[long] = False
    if bool(short.any()):
        lens = qsl[1:] - qsl[:-1]
        reqs = torch.nonzero(short).flatten()
        sel = torch.nonzero(torch.repeat_interleave(short, lens)).flatten()
        sub = torch.cat([lens.new_zeros(1), torch.cumsum(lens[reqs], 0)])
        o[sel], lse[sel] = short_fn(reqs, sel, sub)
    return o, lse


def _flash_context(q, k_cache, v_cache, read_k, read_v, row, kv_len, bs, acc, scale, chunk):
    """One long request's context attention through :mod:`.flash`: q ``[Q, H, D]``
    over the first ``kv_len`` tokens of the pages ``row [W]``, keys ``chunk`` at a time.
    Returns ``(o [Q, H, D], lse [Q, H])`` in ``acc``."""
    nq, h, hkv = q.shape[0], q.shape[1], k_cache.shape[1]
    if kv_len == 0:
        return q.new_zeros(q.shape, dtype=acc), q.new_full((nq, h), float("-inf"), dtype=acc)
    pages = -(-kv_len // bs)
    if pages > row.shape[0]:
        raise ValueError(f"{kv_len} context tokens need {pages} pages, the block table row has {row.shape[0]}")
    qf = _fold(q[None], hkv, acc, scale)[0]  # [Hkv, Q * G, D]
    step, run = max(1, chunk // bs), None
    for p0 in range(0, pages, step):
        ids = row[p0:min(p0 + step, pages)][None]
        n = min(kv_len - p0 * bs, ids.shape[1] * bs)
        k, v = read_k(k_cache, ids, "k", acc)[0], read_v(v_cache, ids, "v", acc)[0]  # [P, Hkv, bs, D]
        k = k.transpose(0, 1).reshape(hkv, -1, k.shape[-1])[:, :n]
        v = v.transpose(0, 1).reshape(hkv, -1, v.shape[-1])[:, :n]
        run = flash.merge_into(run, *flash.attend(qf, k, v, causal=False))
    return _unfold(run[0][None], nq)[0], _unfold(run[1][None], nq)[0]


def _flash_causal(q, k, v, acc, scale):
    """One long request's new tokens over themselves: q ``[Q, H, D]``, k, v ``[Q, Hkv, D]``
    -> ``(o [Q, H, D], lse [Q, H])`` in ``acc``."""
    o, lse = flash.attend((q.to(acc) * scale).transpose(0, 1), k.to(acc).transpose(0, 1),
                          v.to(acc).transpose(0, 1), causal=True)
    return o.transpose(0, 1), lse.transpose(0, 1)
