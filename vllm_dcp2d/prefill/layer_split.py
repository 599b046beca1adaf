"""Layer-split storage inside vLLM: the transient slot's fill (design §4).

On a prefill instance with layer-split storage (``vllm_compat/kv_cache.py``
lays the memory out), TP rank ``r`` keeps its owned layers
``cp_layer_range(L, cp_size, r)`` in their own regions, and every other layer
writes and reads one shared transient region. vLLM runs every layer on every
rank as usual; what a non-owned layer lacks is the KV of the step's earlier
tokens. Right before each layer's cache write, :meth:`LayerSplit.fill` (a hook
the connector puts on that layer's attention impl, ``vllm_compat/kv_cache.py``, ``hook_cache_writes``:
every backend, CPU and GPU) has the owner broadcast the blocks that hold them (``DCP2DMetadata.context_blocks``, computed once per
step by the scheduler side, so every rank has the same list) into the other
ranks' transient slot. The step's own tokens are then written by vLLM's cache
write, and attention runs unchanged. The next layer overwrites the slot.

What stays untouched: the transfer reads each layer only on its owner
(``Sender`` serves ``layers(r)``), so the bytes per path are as planned.
"""

from __future__ import annotations

import logging

import torch

from vllm_dcp2d.prefill.broadcast import Scratch, block_digest, broadcast_owner_layer_prefix
from vllm_dcp2d.prefill.dist import CPGroup

log = logging.getLogger(__name__)

__all__ = ["LayerSplit"]


class LayerSplit:
    """One prefill worker's side of layer-split storage.

    cp:        the TP group as a ``CPGroup`` (CP rank = TP rank).
    owners:    layer name -> the CP rank that owns the layer, for every attention layer.
    num_blocks: KV cache blocks per layer (``kv_cache_config.num_blocks``).
    """

    def __init__(self, cp: CPGroup, owners: dict[str, int], num_blocks: int):
        self.cp, self.owners, self.num_blocks = cp, owners, num_blocks
        self.blocks: torch.Tensor | None = None
        self.digest = 0  # block_digest(self.blocks), once per step
        self.bytes = 0  # sent or received since the last take_bytes()
        self.scratch = Scratch(cp.device)  # every layer's blocks cross the wire in it

    def bind(self, context_blocks) -> None:
        """Called once per step before the forward, on every rank, with the step's
        ``context_blocks`` (int ``[n]``, sorted), or None when the step carries no
        DCP2D metadata (vLLM's dummy runs): then no layer broadcasts."""
        self.blocks = None if context_blocks is None else torch.as_tensor(context_blocks, dtype=torch.int64)
        self.digest = 0 if self.blocks is None else block_digest(self.blocks)

    def fill(self, name: str, kv_cache: torch.Tensor) -> None:
        """Size-broadcast the step's context blocks of layer ``name`` into ``kv_cache``
        (the tensor its cache write is about to write, ``[num_blocks * r, ...]``, ``r``
        kernel blocks per block), right before that write, on every rank."""
        if self.blocks is None:
            return
        owner = self.owners.get(name)
        if owner is None:
            raise RuntimeError(f"layer-split storage: a cache write of layer {name!r}, which is not among the "
                               f"{len(self.owners)} layers it was set up for; its prefix cannot be filled")
        blocks = self.blocks
        ratio = kv_cache.shape[0] // self.num_blocks
        if ratio > 1:  # the backend splits each block into `ratio` kernel blocks
            blocks = (blocks[:, None] * ratio + torch.arange(ratio)).reshape(-1)
        self.bytes += broadcast_owner_layer_prefix(kv_cache, blocks, owner, self.cp, what=name, digest=self.digest,
                                                   scratch=self.scratch)

    def take_bytes(self) -> int:
        n, self.bytes = self.bytes, 0
        return n
