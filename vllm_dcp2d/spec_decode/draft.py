"""Draft side of EAGLE/MTP speculative decoding under DCP (design §8).

The target model's KV is DCP-sharded: each of ``dcp_size`` ranks holds every
``dcp_size``-th page. The draft head must see the whole sequence, so it runs
with DCP disabled over a draft KV pool that is not sharded (every rank holds
the full context: ``dcp_size`` times the target's per-rank tokens). Since every
rank drafts from the same tokens over the same full KV, every rank proposes
the same draft tokens.

Code that builds or runs the draft asks :func:`effective_dcp` which DCP size to
use: inside ``with dcp_disabled():`` (or a function decorated with
``@dcp_disabled()``) the answer is 1, i.e. attend over the local, full pool and
merge nothing across ranks. ``vllm_compat/spec_decode.py`` runs vLLM's drafter
under :func:`dcp_disabled` and builds the draft's config at :func:`effective_dcp`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

__all__ = ["dcp_disabled", "effective_dcp"]

# Depth of nested dcp_disabled() blocks in the current context. A ContextVar,
# not a global: each thread (and each asyncio task) has its own, so a draft
# forward on one thread never unshards a target forward running on another.
_DISABLED_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("dcp_disabled_depth", default=0)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


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


def effective_dcp(world_size: int) -> int:
    """The DCP size to use now: 1 under :func:`dcp_disabled`, else ``world_size``
    (the DCP group's size)."""
    world_size = _check_int("world_size", world_size, 1)
    return world_size if _DISABLED_DEPTH.get() == 0 else 1
