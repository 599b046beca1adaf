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

Torch only: the merge runs in the plugin's CPU attention backends (through
:func:`~vllm_dcp2d.attention.dcp.dcp_merge`); on GPU vLLM's own DCP backends
attend and merge (docs/gpu.md, "Attention on GPU is vLLM's").
"""

from __future__ import annotations

import torch

__all__ = ["merge_lse"]


def _check(o: torch.Tensor, lse: torch.Tensor) -> None:
    if o.dim() != 4:
        raise ValueError(f"o must be [N, T, H, D], got shape {tuple(o.shape)}")
    if lse.shape != o.shape[:3]:
        raise ValueError(f"lse must be [N, T, H] = {tuple(o.shape[:3])}, got {tuple(lse.shape)}")
    if o.shape[0] < 1:
        raise ValueError("o must hold at least one partial result (N >= 1)")
    if o.device != lse.device:
        raise ValueError(f"o is on {o.device} but lse is on {lse.device}")


def merge_lse(o: torch.Tensor, lse: torch.Tensor, base_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` partial attention results into one.

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
