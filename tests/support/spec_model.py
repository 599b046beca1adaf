"""A tiny target decoder, its draft head, paged KV pools, and a plain greedy
reference, for the speculative-decoding tests (tests/spec_decode/test_loop.py).

Target: ``cfg.num_layers`` blocks of prefill.forward's tiny transformer, plus
an untied LM head. Draft: the target's embedding, first block and head with a
KV pool of its own (layer-skip self-speculation standing in for the MTP head,
which also shares the target's embedding and head). Layers past the first
are damped by ``DEEP_SCALE`` so the draft is right often, not always.

Both run through :func:`forward`, whose attention consults
``effective_dcp``: under DCP, context attention over this rank's pages of the
pool, new tokens over themselves, then ``dcp_merge`` across the group; under
``dcp_disabled()``, the same over a full (unsharded) pool, merged locally.

Exactness. Math runs in float64; the hidden state and K/V are rounded to
float32 (the KV cache dtype), as bf16 activations are in real models. The LSE
merge is a different summation than the reference's single softmax and
differs from it by ~1e-16 relative, far below float32's half-ulp (~3e-8), so
the rounded values, hence the KV pool and the greedy tokens, come out
bit-identical to :func:`reference_forward` unless a value lands within 1e-16
of a float32 rounding boundary (~1e-9 per value; fixed seeds, so deterministic).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_dcp2d.attention.dcp import dcp_merge
from vllm_dcp2d.attention.merge import merge_lse
from vllm_dcp2d.attention.gather import plain_layout
from vllm_dcp2d.attention.paged import paged_attention_lse, varlen_attention_lse
from tests.support.dcp_pages import dcp_local_slot, dcp_page_owner
from tests.support.tiny_cp_model import TinyConfig, init_weights
from vllm_dcp2d.spec_decode.draft import effective_dcp

POISON = 1e30  # never-written pool entries; finite, so masked attention reads 0 * POISON = 0
DEEP_SCALE = 0.25


def make_weights(cfg: TinyConfig, seed: int) -> dict[str, torch.Tensor]:
    """prefill.forward's float64 weights, deep blocks damped, plus ``head [hidden, vocab]``."""
    w = init_weights(cfg, seed)
    w["wo"][1:] *= DEEP_SCALE
    w["w2"][1:] *= DEEP_SCALE
    g = torch.Generator().manual_seed(seed + 1)
    w["head"] = torch.randn(cfg.hidden, cfg.vocab, generator=g, dtype=torch.float64)
    return w


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, K] x [K, N] -> [M, N]``, each row in a fixed order whatever ``M`` (no GEMM kernel choice)."""
    return (x[:, :, None] * w).sum(1)


def _embed(w, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return _f32(w["emb"][ids] + w["pos"][pos])


def _qkv(w, layer: int, x: torch.Tensor, cfg: TinyConfig):
    """x ``[M, hidden]`` -> q ``[M, H, Dh]`` float64; k, v rounded to float32 values."""
    shape = (x.shape[0], cfg.num_heads, cfg.head_dim)
    q, k, v = (_linear(x, w[n][layer]).view(shape) for n in ("wq", "wk", "wv"))
    return q, _f32(k), _f32(v)


def _block(w, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    x = x + _linear(attn.flatten(1), w["wo"][layer])
    return _f32(x + _linear(torch.relu(_linear(x, w["w1"][layer])), w["w2"][layer]))


class PagedPool:
    """Paged KV of ``num_layers`` layers for ``batch`` requests on one DCP rank.

    Request ``b``'s sequence page ``i`` is virtual page ``g = b * pages_per_req + i``,
    held by rank ``g % dcp_size`` at local slot ``g // dcp_size`` (design §5.1);
    ``pages_per_req`` is a multiple of ``dcp_size``, so rank ``r`` holds pages
    ``i = r, r + N, ...`` of every request. ``dcp_size == 1``: the full, unsharded pool.

    kv: float32 ``[num_layers, 2, num_slots, H, page_size, Dh]``, POISON until written.
    """

    def __init__(self, num_layers, batch, pages_per_req, page_size, heads, head_dim, dcp_size, dcp_rank, num_slots):
        if pages_per_req % dcp_size:
            raise ValueError(f"pages_per_req={pages_per_req} must be a multiple of dcp_size={dcp_size}")
        need = batch * pages_per_req // dcp_size
        if num_slots < need:
            raise ValueError(f"num_slots={num_slots} cannot hold {batch} x {pages_per_req} pages / {dcp_size}")
        self.batch, self.pages_per_req, self.page_size = batch, pages_per_req, page_size
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        self.kv = torch.full((num_layers, 2, num_slots, heads, page_size, head_dim), POISON, dtype=torch.float32)
        self.layout = plain_layout(page_size, head_dim)

    def place(self, req: torch.Tensor, pos: torch.Tensor):
        """Tokens ``(req [T], pos [T])`` -> (mine bool ``[T]``, slot ``[T]``, offset ``[T]``)."""
        g = (req * self.pages_per_req + pos // self.page_size).numpy()
        mine = torch.from_numpy(dcp_page_owner(g, self.dcp_size) == self.dcp_rank)
        return mine, torch.from_numpy(dcp_local_slot(g, self.dcp_size)), pos % self.page_size

    def write(self, kv: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> None:
        """Commit ``kv`` float ``[L, 2, T, H, Dh]`` of tokens ``(req [T], pos [T])``; keeps only owned pages."""
        mine, slot, off = self.place(req, pos)
        # Advanced indices around a slice put the token dim first: [M, L, 2, H, Dh].
        self.kv[:, :, slot[mine], :, off[mine]] = kv[:, :, mine].permute(2, 0, 1, 3, 4).float()

    def view(self, ctx_lens: torch.Tensor):
        """This rank's part of each request's first ``ctx_lens [B]`` tokens:
        (block_table int64 ``[B, W]`` local slots, kv_lens int64 ``[B]`` local tokens)."""
        w = self.pages_per_req // self.dcp_size
        table = torch.arange(self.batch)[:, None] * w + torch.arange(w)
        first = (torch.arange(w) * self.dcp_size + self.dcp_rank) * self.page_size  # first position of each local page
        kv_lens = (ctx_lens[:, None] - first).clamp(0, self.page_size).sum(1)
        return table, kv_lens


def _attention(q, k, v, qsl, layer_kv, table, kv_lens, pool: PagedPool, group):
    """One layer's attention of new tokens ``q [T, H, Dh]`` (their own ``k``, ``v``
    ``[T, H, Dh]``, ragged by ``qsl [B + 1]``) over the context in ``pool`` and themselves.
    Returns ``[T, H, Dh]`` float64."""
    dcp = effective_dcp(group.world_size)
    if pool.dcp_size != dcp:
        raise ValueError(f"pool is sharded over {pool.dcp_size} ranks but attention runs at DCP={dcp}")
    kc, vc = (layer_kv[i].flatten(-2) for i in (0, 1))  # [slots, H, page_size * Dh]
    scale = 1.0 / math.sqrt(q.shape[-1])
    o_ctx, lse_ctx = paged_attention_lse(q, kc, vc, pool.layout, pool.layout, table, kv_lens, qsl, scale)
    o_new, lse_new = varlen_attention_lse(q, k, v, qsl, scale)
    if dcp == 1:
        return merge_lse(torch.stack([o_ctx, o_new]), torch.stack([lse_ctx, lse_new]))[0]
    return dcp_merge(o_ctx, lse_ctx, group, local=(o_new, lse_new))[0]


@torch.no_grad()
def forward(w, cfg: TinyConfig, num_layers: int, ids, lens, ctx_lens, pool: PagedPool, group):
    """Extend each request by its new tokens; the pool is read, not written.

    ids: int64 ``[T]`` new tokens, request after request; lens: int64 ``[B]`` new
    tokens per request; ctx_lens: int64 ``[B]`` tokens already in ``pool`` (positions
    of the new tokens start there). Runs blocks ``0 .. num_layers - 1``.
    Returns (logits float64 ``[T, vocab]``, kv float32 ``[num_layers, 2, T, H, Dh]``,
    req int64 ``[T]``, pos int64 ``[T]``).
    """
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    req = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pos = ctx_lens[req] + torch.arange(ids.numel()) - qsl[req]
    table, kv_lens = pool.view(ctx_lens)
    x = _embed(w, ids, pos)
    kvs = []
    for layer in range(num_layers):
        q, k, v = _qkv(w, layer, x, cfg)
        kvs.append(torch.stack([k, v]).float())
        attn = _attention(q, k, v, qsl, pool.kv[layer], table, kv_lens, pool, group)
        x = _block(w, layer, x, attn)
    return _linear(x, w["head"]), torch.stack(kvs), req, pos


@torch.no_grad()
def reference_forward(w, cfg: TinyConfig, ids: torch.Tensor):
    """Plain target forward of one whole sequence, no pool, no DCP, dense causal softmax.

    ids: int64 ``[S]``. Returns (logits float64 ``[S, vocab]``, kv float32
    ``[num_layers, 2, S, H, Dh]``).
    """
    s = ids.numel()
    x = _embed(w, ids, torch.arange(s))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    kvs = []
    for layer in range(cfg.num_layers):
        q, k, v = _qkv(w, layer, x, cfg)
        kvs.append(torch.stack([k, v]).float())
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        x = _block(w, layer, x, torch.einsum("hqk,khd->qhd", p, v))
    return _linear(x, w["head"]), torch.stack(kvs)


def reference_greedy(w, cfg: TinyConfig, prompt: torch.Tensor, num_new: int):
    """Plain greedy decoding, one token per step, recomputing the whole sequence.

    Returns (tokens int64 ``[len(prompt) + num_new]``, kv float32 ``[L, 2, S - 1, H, Dh]``
    of all but the last token: what a decoder's pool holds after generating them).
    """
    seq = prompt.clone()
    for _ in range(num_new):
        logits, _ = reference_forward(w, cfg, seq)
        seq = torch.cat([seq, logits[-1].argmax().view(1)])
    _, kv = reference_forward(w, cfg, seq[:-1])
    return seq, kv


def prompts_for(seed: int, batch: int, vocab: int, max_prompt: int) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, int(g.integers(1, max_prompt + 1))) for _ in range(batch)]
