"""LSE-weighted merge of partial attention outputs (design §5.2).

Each of ``N`` DCP ranks attends over its own shard of the KV pages and returns
a partial output ``O_n`` with its log-sum-exp ``LSE_n``. The exact result over
the union of the shards is::

    LSE = log(sum_n exp(LSE_n))
    O   = sum_n exp(LSE_n - LSE) * O_n

A rank whose shard is empty for a row has ``LSE_n = -inf``: it gets weight 0
and its ``O_n`` is never read, so garbage or NaN there cannot leak. When every
rank is empty the row is 0 with ``LSE = -inf``. NaN LSEs are treated as empty,
as vLLM's own combine kernel does.

Two implementations with one contract: a Triton kernel (compiled on CUDA,
interpreted on CPU when ``TRITON_INTERPRET=1``) and a torch reference.
``backend=None`` picks Triton for CUDA tensors or under the interpreter, torch
otherwise.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with vLLM and torch
    HAS_TRITON = False

# Read once, at the moment @triton.jit below reads it too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["merge_lse", "merge_lse_torch", "merge_lse_triton", "pick_backend", "HAS_TRITON", "INTERPRET"]


def pick_backend(t: torch.Tensor) -> str:
    """``"triton"`` for CUDA tensors or under the interpreter, else ``"torch"``."""
    if not HAS_TRITON:
        return "torch"
    if INTERPRET or t.is_cuda:
        return "triton"
    return "torch"


def _check(o: torch.Tensor, lse: torch.Tensor) -> None:
    if o.dim() != 4:
        raise ValueError(f"o must be [N, T, H, D], got shape {tuple(o.shape)}")
    if lse.shape != o.shape[:3]:
        raise ValueError(f"lse must be [N, T, H] = {tuple(o.shape[:3])}, got {tuple(lse.shape)}")
    if o.shape[0] < 1:
        raise ValueError("o must hold at least one partial result (N >= 1)")
    if o.device != lse.device:
        raise ValueError(f"o is on {o.device} but lse is on {lse.device}")


def merge_lse_torch(o: torch.Tensor, lse: torch.Tensor, base_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the merge.

    o:   ``[N, T, H, D]``, float16 / bfloat16 / float32 / float64, any strides.
    lse: ``[N, T, H]``, any float dtype; ``-inf`` (or NaN) marks an empty shard.
    base_e: natural-log LSE when True, base-2 LSE when False.
    Returns ``(out [T, H, D] in o.dtype, lse [T, H] float32)`` (float64 for
    float64 inputs). Accumulates in float32 at least.
    """
    _check(o, lse)
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    lse = lse.to(acc)
    lse = torch.where(torch.isnan(lse), float("-inf"), lse)
    empty = lse == float("-inf")
    shift = lse.amax(dim=0)
    shift = torch.where(shift == float("-inf"), 0.0, shift)
    pw = torch.exp if base_e else torch.exp2
    total = pw(lse - shift).sum(dim=0)  # exp(-inf) == 0 for empty shards
    lg = torch.log if base_e else torch.log2
    out_lse = torch.where(total > 0, shift + lg(total), float("-inf"))
    w = torch.where(empty, 0.0, pw(lse - out_lse))
    # where(), not w * o: 0 * NaN would let an empty shard's garbage through.
    contrib = torch.where(empty[..., None], 0.0, w[..., None] * o.to(acc))
    out = contrib.sum(dim=0)
    return out.to(o.dtype), out_lse.to(torch.float64 if acc == torch.float64 else torch.float32)


if HAS_TRITON:

    @triton.jit
    def _merge_lse_kernel(
        o_ptr, lse_ptr, out_ptr, out_lse_ptr,
        N, H, D,
        so_n, so_t, so_h, so_d,
        sl_n, sl_t, sl_h,
        sout_t, sout_h, sout_d,
        soutl_t, soutl_h,
        BASE_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        hb = tl.program_id(1)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < H
        mask_hd = mask_h[:, None] & (offs_d[None, :] < D)
        t64 = t.to(tl.int64)
        lse_row = lse_ptr + t64 * sl_t + offs_h * sl_h
        o_tile = o_ptr + t64 * so_t + offs_h[:, None] * so_h + offs_d[None, :] * so_d

        # Pass 1: the per-head max over ranks (NaN counts as an empty shard).
        shift = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for n in range(N):
            x = tl.load(lse_row + n * sl_n, mask=mask_h, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("-inf"), x)
            shift = tl.maximum(shift, x)
        shift = tl.where(shift == float("-inf"), 0.0, shift)

        # Pass 2: the merged LSE.
        total = tl.zeros([BLOCK_H], tl.float32)
        for n in range(N):
            x = tl.load(lse_row + n * sl_n, mask=mask_h, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("-inf"), x)
            if BASE_E:
                total += tl.exp(x - shift)
            else:
                total += tl.exp2(x - shift)
        nonempty = total > 0.0
        safe_total = tl.where(nonempty, total, 1.0)
        if BASE_E:
            out_lse = tl.where(nonempty, shift + tl.log(safe_total), float("-inf"))
        else:
            out_lse = tl.where(nonempty, shift + tl.log2(safe_total), float("-inf"))

        # Pass 3: weighted sum; an empty shard's O is masked out, never read.
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n in range(N):
            x = tl.load(lse_row + n * sl_n, mask=mask_h, other=float("-inf")).to(tl.float32)
            live = x == x
            live = live & (x != float("-inf"))
            # Select before subtracting: -inf - -inf would be NaN.
            diff = tl.where(live, x, 0.0) - tl.where(live, out_lse, 0.0)
            if BASE_E:
                w = tl.exp(diff)
            else:
                w = tl.exp2(diff)
            w = tl.where(live, w, 0.0)
            part = tl.load(o_tile + n * so_n, mask=mask_hd & live[:, None], other=0.0).to(tl.float32)
            acc += w[:, None] * part

        out_tile = out_ptr + t64 * sout_t + offs_h[:, None] * sout_h + offs_d[None, :] * sout_d
        tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=mask_hd)
        tl.store(out_lse_ptr + t64 * soutl_t + offs_h * soutl_h, out_lse, mask=mask_h)


def merge_lse_triton(o: torch.Tensor, lse: torch.Tensor, base_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`merge_lse_torch` (same shapes, dtypes, contract).

    One program per (token, block of heads); keep ``T * cdiv(H, BLOCK_H)`` to tens
    of programs under the interpreter.
    """
    if not HAS_TRITON:
        raise RuntimeError("merge_lse_triton needs triton, which is not installed")
    _check(o, lse)
    if o.dtype == torch.float64:
        raise ValueError("merge_lse_triton takes float16/bfloat16/float32 o, got float64; use merge_lse_torch")
    n, t, h, d = o.shape
    out = torch.empty((t, h, d), dtype=o.dtype, device=o.device)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=o.device)
    if t == 0 or h == 0:
        return out, out_lse
    block_d = triton.next_power_of_2(d)
    # Big tiles, few programs: the interpreter's cost is per program.
    block_h = max(1, min(triton.next_power_of_2(h), 4096 // block_d))
    grid = (t, math.ceil(h / block_h))
    _merge_lse_kernel[grid](
        o, lse, out, out_lse,
        n, h, d,
        *o.stride(), *lse.stride(), *out.stride(), *out_lse.stride(),
        BASE_E=base_e, BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return out, out_lse


def merge_lse(
    o: torch.Tensor, lse: torch.Tensor, base_e: bool = True, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` partial attention results into one.

    o:   ``[N, T, H, D]`` partial outputs; lse: ``[N, T, H]`` their log-sum-exps
    (base e, or base 2 with ``base_e=False``; ``-inf`` = empty shard).
    backend: ``None`` (auto, see :func:`pick_backend`), ``"torch"`` or ``"triton"``.
    Returns ``(out [T, H, D] in o.dtype, lse [T, H] float32)``.
    """
    backend = backend or pick_backend(o)
    if backend == "torch":
        return merge_lse_torch(o, lse, base_e)
    if backend == "triton":
        return merge_lse_triton(o, lse, base_e)
    raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
