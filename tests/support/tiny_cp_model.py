"""The tiny float64 transformer and the consensus-prefix helper the standalone
spec-decode tests (``spec_model``, ``spec_workers``) are built on.

They came from the pre-vLLM prefill library; vLLM now serves prefill (see
``vllm_dcp2d/prefill``), and only these test scaffolds still use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vllm_dcp2d.prefill.dist import CPGroup

__all__ = ["TinyConfig", "init_weights", "normalize_prefix_lens", "consensus_prefix_lens"]


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
