"""Size-broadcast of one layer's prefix KV from its owner (design §4.2).

Under layer-split storage only the owner of layer ``l`` keeps its KV. Before
``l`` writes this step's tokens, every other CP rank needs the KV of the
step's earlier tokens (earlier chunks of a chunked prefill, prefix-cache
hits, the context of a decode step) in its transient slot. The owner sends
it, block by block, in one broadcast per layer.

Every rank must join the same collectives with the same sizes, or the group
deadlocks. The owner therefore first broadcasts a 2-element header, the
block count and a digest of the block ids, that every rank joins whatever
its own list is. Then all ranks skip (count 0) or all join one broadcast of
the owner's size. A rank whose own list differs consumes that broadcast,
commits nothing and raises, naming both lists' counts and digests: a clear
error instead of a hang or a wrong cache.

The blocks cross the wire through a :class:`Scratch` the caller keeps for the
worker's life. A fresh buffer per layer (a different size each step, ~200 MB/s of
them in the 30-minute soak) left glibc's heap fragmented: the TP workers' RSS
crept up for the whole run (BENCHMARKS "Soak"). One buffer, grown to the largest
prefix seen, is reused by every layer of every step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vllm_dcp2d.prefill.dist import CPGroup

__all__ = ["broadcast_owner_layer_prefix", "block_digest", "Scratch", "SCRATCH_MAX_BYTES"]

SCRATCH_MAX_BYTES = 256 << 20  # a prefix larger than this gets a buffer of its own, freed after the layer


class Scratch:
    """One reusable byte buffer for a layer's blocks on the wire (see the module doc).

    device:    where the buffer lives (the CP group's ``device``).
    max_bytes: the most it keeps; a larger request gets a one-off tensor.
    """

    def __init__(self, device: torch.device, max_bytes: int = SCRATCH_MAX_BYTES):
        self.device, self.max_bytes = device, max_bytes
        self._buf = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``dtype`` on ``device``, its contents undefined;
        valid until the next ``take``. Grows to the next power of two (at least 1 MiB)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.max_bytes:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if nbytes > self._buf.numel():
            size = min(self.max_bytes, max(1 << 20, 1 << (nbytes - 1).bit_length()))
            self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)  # free the old one first
            self._buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._buf[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes it holds now."""
        return self._buf.numel()


def block_digest(blocks: torch.Tensor) -> int:
    """A digest of an int64 ``[n]`` block list that any reordering or change alters
    (sum of ``(i + 1) * block[i]``, wrapping in int64 the same way on every rank)."""
    weights = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=blocks.device)
    return int((blocks.to(torch.int64) * weights).sum())


def broadcast_owner_layer_prefix(kv_cache: torch.Tensor, blocks: torch.Tensor, owner: int, cp: CPGroup,
                                 what: str = "", digest: int | None = None, scratch: Scratch | None = None) -> int:
    """Copy the owner's ``kv_cache[blocks]`` into every other rank's ``kv_cache[blocks]``.

    Called by every rank of ``cp`` for the layer, before its cache write.

    kv_cache: ``[num_blocks, ...]`` any dtype, this layer's paged KV on this rank:
              the owner's own region, the shared transient slot on the others.
    blocks:   int64 ``[n]`` block ids along ``kv_cache``'s first dim, the same on
              every rank (each rank computes it from the step's metadata).
    owner:    CP rank that owns the layer, ``0 <= owner < cp.size``.
    what:     names the layer in errors.
    digest:   ``block_digest(blocks)`` if the caller has it (the same list serves
              every layer of a step).
    scratch:  the buffer the blocks cross the wire in (the serving path keeps one per
              worker); None allocates one for this call.
    Returns the bytes this rank sent or received.

    Raises ``RuntimeError`` on a non-owner whose ``(n, digest)`` differs from the
    owner's, after it joined the data broadcast (so the group is not left hanging).
    """
    src = cp.global_rank(owner)
    local = (blocks.numel(), block_digest(blocks) if digest is None else digest)
    head = torch.tensor(local, dtype=torch.int64, device=cp.device)
    dist.broadcast(head, src=src, group=cp.group)
    n, owner_digest = (int(x) for x in head.tolist())
    if n == 0 and local[0] == 0:
        return 0
    shape = (n, *kv_cache.shape[1:])
    buf = (scratch.take(shape, kv_cache.dtype) if scratch is not None
           else torch.empty(shape, dtype=kv_cache.dtype, device=cp.device))
    if cp.rank == owner:
        index = blocks.to(kv_cache.device)
        if kv_cache.device == buf.device:
            torch.index_select(kv_cache, 0, index, out=buf)
        else:
            buf.copy_(kv_cache.index_select(0, index))
    if n:
        dist.broadcast(buf, src=src, group=cp.group)
    if cp.rank != owner:
        if (n, owner_digest) != local:
            raise RuntimeError(
                f"layer-split prefix broadcast{' of ' + what if what else ''}: CP rank {cp.rank} has {local[0]} "
                f"blocks (digest {local[1]}) but the owner, CP rank {owner}, has {n} (digest {owner_digest}); the ranks "
                f"no longer agree on the step's batch")
        kv_cache.index_copy_(0, blocks.to(kv_cache.device), buf.to(kv_cache.device))
    return buf.numel() * buf.element_size()
