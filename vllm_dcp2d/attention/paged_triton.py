"""Triton version of :func:`vllm_dcp2d.attention.paged.paged_attention_lse` (GPU;
interpreted on CPU for tests).

One program per (query token, KV head): it walks the token's local pages with
an online softmax for the ``H // Hkv`` query heads sharing that KV head and
writes ``O`` and the natural-log ``LSE``. Pages are read through strides, so the
cache may be any 4-D view indexed ``[page, token, kv_head, dim]`` with a
row-major page interior (vLLM's GPU layouts; not the ISA-packed CPU pages).
"""

from __future__ import annotations

import torch

from vllm_dcp2d.attention.merge import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["paged_attention_lse_triton"]

if HAS_TRITON:

    @triton.jit
    def _paged_attn_lse_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, kv_lens_ptr, tok_req_ptr, o_ptr, lse_ptr,
        scale, Dk, Dv,
        sq_t, sq_h, sq_d,
        sk_b, sk_t, sk_h, sk_d,
        sv_b, sv_t, sv_h, sv_d,
        sbt_r, sbt_c,
        so_t, so_h, so_d,
        sl_t, sl_h,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        req = tl.load(tok_req_ptr + t).to(tl.int64)
        n = tl.load(kv_lens_ptr + req)
        g = tl.arange(0, BLOCK_G)
        heads = kvh * GROUP + g
        mask_g = g < GROUP
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        mask_dk = dk < Dk
        mask_dv = dv < Dv
        q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + dk[None, :] * sq_d,
                    mask=mask_g[:, None] & mask_dk[None, :], other=0.0).to(tl.float32)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        offs = tl.arange(0, PAGE)
        k_in = offs[:, None] * sk_t + kvh * sk_h + dk[None, :] * sk_d
        v_in = offs[:, None] * sv_t + kvh * sv_h + dv[None, :] * sv_d
        for p in range(0, tl.cdiv(n, PAGE)):
            blk = tl.load(bt_ptr + req * sbt_r + p * sbt_c).to(tl.int64)
            live = offs < n - p * PAGE  # scalar limit folded into a block mask
            k = tl.load(k_ptr + blk * sk_b + k_in, mask=live[:, None] & mask_dk[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + blk * sv_b + v_in, mask=live[:, None] & mask_dv[None, :], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, PAGE]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every visited page has a live token
            alpha = tl.exp(m - m_new)
            prob = tl.exp(s - m_new[:, None])
            s_sum = s_sum * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        nonempty = s_sum > 0.0
        safe = tl.where(nonempty, s_sum, 1.0)
        out = tl.where(nonempty[:, None], acc / safe[:, None], 0.0)
        lse = tl.where(nonempty, tl.where(nonempty, m, 0.0) + tl.log(safe), float("-inf"))
        tl.store(o_ptr + t * so_t + heads[:, None] * so_h + dv[None, :] * so_d, out,
                 mask=mask_g[:, None] & mask_dv[None, :])
        tl.store(lse_ptr + t * sl_t + heads * sl_h, lse, mask=mask_g)


def paged_attention_lse_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of ragged queries over each request's first ``kv_lens``
    paged tokens (a DCP rank's context attention).

    q: ``[T, H, Dk]``; k_cache: ``[num_blocks, block_size, Hkv, Dk]`` and v_cache:
    ``[num_blocks, block_size, Hkv, Dv]``, any strides, float16/bfloat16/float32;
    block_table: ``[R, W]`` int; kv_lens: ``[R]`` int; query_start_loc: ``[R + 1]`` int.
    Returns ``(o [T, H, Dv], lse [T, H])`` float32, natural log; queries of an empty
    shard get ``O = 0`` and ``LSE = -inf``. ``block_size`` must be a power of 2.
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_lse_triton needs triton, which is not installed")
    t, h, dk = q.shape
    nb, page, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of 2 for the Triton kernel, got {page}")
    o = torch.empty((t, h, dv), dtype=torch.float32, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    if t == 0:
        return o, lse
    qsl = query_start_loc.long()
    tok_req = torch.searchsorted(qsl[1:], torch.arange(t, device=q.device), right=True)
    group = h // hkv
    _paged_attn_lse_kernel[(t, hkv)](
        q, k_cache, v_cache, block_table, kv_lens, tok_req, o, lse,
        float(scale), dk, dv,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        *o.stride(), *lse.stride(),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), PAGE=page,
        BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=triton.next_power_of_2(dv),
    )
    return o, lse
