"""Layer-split storage inside vLLM: the transient slot's fill (design §4).

On a prefill instance with layer-split storage (``vllm_compat/kv_cache.py``
lays the memory out), TP rank ``r`` keeps its owned layers
``cp_layer_range(L, cp_size, r)`` in their own regions, and every other layer
writes and reads one shared transient region. vLLM runs every layer on every
rank as usual; what a non-owned layer lacks is the KV of the step's earlier
tokens. Right before each layer's cache write, :func:`before_cache_write`
(called by the plugin's CPU attention backends) has the owner broadcast the
blocks that hold them (``DCP2DMetadata.context_blocks``, computed once per
step by the scheduler side, so every rank has the same list) into the other
ranks' transient slot. The step's own tokens are then written by vLLM's cache
write, and attention runs unchanged. The next layer overwrites the slot.

What stays untouched: the transfer reads each layer only on its owner
(``Sender`` serves ``layers(r)``), so the bytes per path are as planned.
"""

from __future__ import annotations

import logging

import torch

from vllm_dcp2d.prefill.broadcast import block_digest, broadcast_owner_layer_prefix
from vllm_dcp2d.prefill.dist import CPGroup

log = logging.getLogger(__name__)

__all__ = ["LayerSplit", "before_cache_write", "activate", "deactivate"]


class LayerSplit:
    """One prefill worker's side of layer-split storage.

    cp:        the TP group as a ``CPGroup`` (CP rank = TP rank).
    owners:    ``id(kv cache tensor) -> (layer name, owning CP rank)`` for every
               attention layer, keyed by the tensor object vLLM hands the layer's
               cache write (non-owned layers alias one region but are distinct views).
    num_blocks: KV cache blocks per layer (``kv_cache_config.num_blocks``).
    """

    def __init__(self, cp: CPGroup, owners: dict[int, tuple[str, int]], num_blocks: int):
        self.cp, self.owners, self.num_blocks = cp, owners, num_blocks
        self.blocks: torch.Tensor | None = None
        self.digest = 0  # block_digest(self.blocks), once per step
        self.bytes = 0  # sent or received since the last take_bytes()

    def bind(self, context_blocks) -> None:
        """Called once per step before the forward, on every rank, with the step's
        ``context_blocks`` (int ``[n]``, sorted), or None when the step carries no
        DCP2D metadata (vLLM's dummy runs): then no layer broadcasts."""
        self.blocks = None if context_blocks is None else torch.as_tensor(context_blocks, dtype=torch.int64)
        self.digest = 0 if self.blocks is None else block_digest(self.blocks)

    def fill(self, kv_cache: torch.Tensor) -> None:
        """Size-broadcast the step's context blocks of the layer whose cache is
        ``kv_cache`` (``[num_blocks * r, ...]``, ``r`` kernel blocks per block)."""
        if self.blocks is None:
            return
        entry = self.owners.get(id(kv_cache))
        if entry is None:
            raise RuntimeError(f"layer-split storage: a cache write into a KV tensor of shape {tuple(kv_cache.shape)} "
                               f"that no attention layer registered; its prefix cannot be filled")
        name, owner = entry
        blocks = self.blocks
        ratio = kv_cache.shape[0] // self.num_blocks
        if ratio > 1:  # the backend splits each block into `ratio` kernel blocks
            blocks = (blocks[:, None] * ratio + torch.arange(ratio)).reshape(-1)
        self.bytes += broadcast_owner_layer_prefix(kv_cache, blocks, owner, self.cp, what=name, digest=self.digest)

    def take_bytes(self) -> int:
        n, self.bytes = self.bytes, 0
        return n


_active: LayerSplit | None = None


def activate(split: LayerSplit) -> None:
    """Make ``split`` this worker process's layer-split (once, from ``register_kv_caches``)."""
    global _active
    _active = split


def deactivate() -> None:
    global _active
    _active = None


def before_cache_write(kv_cache: torch.Tensor) -> None:
    """Called by the plugin's attention backends right before a layer's cache write
    (``do_kv_cache_update``) on every rank; a no-op without layer-split storage."""
    if _active is not None:
        _active.fill(kv_cache)
