"""Draft side of EAGLE/MTP speculative decoding under DCP (design §8).

The target model's KV is DCP-sharded: each of ``dcp_size`` ranks holds every
``dcp_size``-th page. The draft head must see the whole sequence, so it runs
with DCP disabled over a draft KV pool that is not sharded: every rank holds
the full context, ``draft_pool_token_multiplier = dcp_size`` times the
target's per-rank token capacity. Since every rank drafts from the same
tokens over the same full KV, every rank proposes the same draft tokens.

Attention code asks :func:`effective_dcp` (or :func:`dcp_enabled`) whether to
shard: inside ``with dcp_disabled():`` (or a function decorated with
``@dcp_disabled()``) the answer is 1, i.e. attend over the local, full pool
and merge nothing across ranks.

Run ``python -m vllm_dcp2d.spec_decode`` for the memory table (:func:`memory_table`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from vllm_dcp2d.layout import cdiv

__all__ = [
    "draft_pool_tokens",
    "dcp_disabled",
    "dcp_enabled",
    "effective_dcp",
    "effective_dcp_rank",
    "SpecKVBytes",
    "spec_kv_bytes",
    "memory_table",
]

# Depth of nested dcp_disabled() blocks in the current context. A ContextVar,
# not a global: each thread (and each asyncio task) has its own, so a draft
# forward on one thread never unshards a target forward running on another.
_DISABLED_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("dcp_disabled_depth", default=0)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def draft_pool_tokens(target_tokens_per_rank: int, dcp_size: int) -> int:
    """Token capacity of the draft KV pool on each rank.

    target_tokens_per_rank: the target pool's per-rank capacity
    (``max_total_num_tokens``), which under DCP is ``1/dcp_size`` of a sequence.
    Returns ``target_tokens_per_rank * dcp_size`` (``draft_pool_token_multiplier
    = dcp_size``): enough for every rank to hold the whole context unsharded.
    """
    return _check_int("target_tokens_per_rank", target_tokens_per_rank, 0) * _check_int("dcp_size", dcp_size, 1)


@contextmanager
def dcp_disabled() -> Iterator[None]:
    """Run a block (or, as ``@dcp_disabled()``, a function) with DCP off.

    Nestable; the previous state is restored on exit, exceptions included.
    Affects only the current thread / asyncio task (see ``_DISABLED_DEPTH``).
    Called around the draft forward, by whoever runs the draft model.
    """
    token = _DISABLED_DEPTH.set(_DISABLED_DEPTH.get() + 1)
    try:
        yield
    finally:
        _DISABLED_DEPTH.reset(token)


def dcp_enabled() -> bool:
    """False inside :func:`dcp_disabled` (in this thread / task), else True."""
    return _DISABLED_DEPTH.get() == 0


def effective_dcp(world_size: int) -> int:
    """The DCP size attention must use now: 1 under :func:`dcp_disabled`, else
    ``world_size`` (the DCP group's size). Called by attention code per forward."""
    world_size = _check_int("world_size", world_size, 1)
    return world_size if dcp_enabled() else 1


def effective_dcp_rank(rank_in_group: int) -> int:
    """This rank's DCP rank now: 0 under :func:`dcp_disabled` (it owns every
    page of the unsharded draft pool), else ``rank_in_group``."""
    rank_in_group = _check_int("rank_in_group", rank_in_group, 0)
    return rank_in_group if dcp_enabled() else 0


@dataclass(frozen=True)
class SpecKVBytes:
    """Per-rank KV bytes of one sequence with speculative decoding under DCP.

    target_shard: the largest rank's share of the target KV (its pages).
    draft_pool:   the draft pool sized by :func:`draft_pool_tokens` from
                  that share; it holds the whole sequence.
    full_target:  the target KV of the whole sequence (what one rank holds at DCP=1).
    """

    target_shard: int
    draft_pool: int
    full_target: int


def spec_kv_bytes(
    seq_tokens: int,
    dcp_size: int,
    kv_bytes_per_token_layer: int,
    target_layers: int,
    draft_layers: int = 1,
    page_size: int = 1,
) -> SpecKVBytes:
    """KV memory of the DCP-sharded target vs the unsharded draft pool, per rank.

    seq_tokens: context length; pages of ``page_size`` tokens are dealt
    round-robin (design §5.1), so the largest rank holds ``cdiv(pages, dcp_size)``.
    kv_bytes_per_token_layer: e.g. 576 for GLM-5.2's FP8 DSA latent.
    draft_layers: layers of the draft (1 for an MTP/NextN head).
    """
    seq_tokens = _check_int("seq_tokens", seq_tokens, 0)
    dcp_size = _check_int("dcp_size", dcp_size, 1)
    per_tok = _check_int("kv_bytes_per_token_layer", kv_bytes_per_token_layer, 0)
    target_layers = _check_int("target_layers", target_layers, 0)
    draft_layers = _check_int("draft_layers", draft_layers, 0)
    page_size = _check_int("page_size", page_size, 1)
    shard_tokens = cdiv(cdiv(seq_tokens, page_size), dcp_size) * page_size
    return SpecKVBytes(
        target_shard=shard_tokens * target_layers * per_tok,
        draft_pool=draft_pool_tokens(shard_tokens, dcp_size) * draft_layers * per_tok,
        full_target=cdiv(seq_tokens, page_size) * page_size * target_layers * per_tok,
    )


def memory_table() -> None:
    """Print :func:`spec_kv_bytes` for GLM-5.2 (78 layers, 576 B/token/layer, 64-token
    pages), per rank, in GB: a 1-layer MTP draft, and a draft as deep as the target."""
    print(f"{'seq':>7} {'dcp':>3} {'draft_layers':>12} {'target_shard_GB':>15} "
          f"{'draft_pool_GB':>13} {'full_target_GB':>14} {'draft/shard':>11}")
    for seq in (32768, 131072, 524288):
        for dcp in (1, 2, 4, 8):
            for dl in (1, 78):
                m = spec_kv_bytes(seq, dcp, 576, 78, dl, page_size=64)
                print(f"{seq:>7} {dcp:>3} {dl:>12} {m.target_shard / 1e9:>15.3f} {m.draft_pool / 1e9:>13.3f} "
                      f"{m.full_target / 1e9:>14.3f} {m.draft_pool / m.target_shard:>11.3f}")

