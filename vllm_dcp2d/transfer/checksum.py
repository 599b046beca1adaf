"""What landed is what was sent: a checksum of one path's bytes, computed on both sides
(``verify_kv``; docs/security.md, "What lands is what was asked for").

A prefill rank hashes the bytes it wrote for a decode rank (read from its own KV),
the decode rank hashes the same byte ranges of its own KV once every answer is in;
any difference (a page corrupted on the way, a write that did not happen, a peer
that answered ok without writing) fails the fetch before the blocks are used or
cached. Both hash the path's destination ranges in address order: each side can
list them (the decode from its own block tables, without the prefill's), and the
order does not depend on how a plan merged its runs or how staging chunked them.

xxh3-128 (``xxhash``): 21 GiB/s on the project's CPU, against 14 for crc32c and 2.2
for zlib's crc32 (BENCHMARKS.md, "The trust boundary's cost"). Host-memory KV only.

Public API
----------
``checksum(memory, src, length, order) -> str``: 32 hex digits over ``length[k]`` bytes
    at ``src[k]`` taken in the order ``order`` (int64 ``[n]`` each).
``path_ranges(regions, block_ids, layers, dcp_size, dcp_rank, first_page, num_pages, heads=None,
    sender_heads=None) -> Descriptors``: the destination ranges of a path on the consumer
    (``dst``, ``length``), of the KV heads both ranks hold.
"""

from __future__ import annotations

import numpy as np
import xxhash

from vllm_dcp2d.transfer.hostmem import gather
from vllm_dcp2d.plan import Descriptors, KVRegions, Memory, plan_path

__all__ = ["checksum", "path_ranges", "CHUNK_BYTES"]

CHUNK_BYTES = 32 << 20  # bytes gathered at once: what a checksum holds besides the KV


def checksum(memory: Memory, src: np.ndarray, length: np.ndarray, order: np.ndarray) -> str:
    """xxh3-128 of the bytes ``[src[k], src[k] + length[k])`` (in ``memory``), concatenated in
    the order ``np.argsort(order)``: pass each range's destination address as ``order``."""
    idx = np.argsort(order, kind="stable")
    src, length = src[idx], length[idx]
    h = xxhash.xxh3_128()
    end = np.cumsum(length)
    start = 0
    while start < src.size:  # a loop per CHUNK_BYTES, not per range
        stop = max(start + 1, int(np.searchsorted(end, end[start] - length[start] + CHUNK_BYTES, side="right")))
        buf = np.empty(int(length[start:stop].sum()), dtype=np.uint8)
        gather(memory, src[start:stop], length[start:stop], buf)
        h.update(buf)
        start = stop
    return h.hexdigest()


def path_ranges(regions: KVRegions, block_ids, layers, dcp_size: int, dcp_rank: int, first_page: int,
                num_pages: int, heads: range | None = None, sender_heads: range | None = None) -> Descriptors:
    """Where ``layers`` x heads x pages(``dcp_rank``) of a request land in a consumer's KV
    (``regions``, its block tables ``block_ids``): ``dst`` and ``length`` (``src`` is
    meaningless). The plan of the same path with the consumer standing in for the
    producer (no page contiguous at the stand-in source, so nothing merges). ``heads``:
    the consumer rank's KV heads, ``sender_heads``: the producer rank's (default: the
    same); where they differ only ``heads & sender_heads`` of each page."""
    stand_in = tuple(np.zeros(num_pages, dtype=np.int64) for _ in range(regions.num_groups))
    if heads is None or sender_heads is None or heads == sender_heads:
        return plan_path(regions, stand_in, layers, regions, block_ids, dcp_size, dcp_rank, first_page, num_pages)
    common = range(max(heads.start, sender_heads.start), min(heads.stop, sender_heads.stop))
    return plan_path(regions.with_heads(len(common)), stand_in, layers, regions, block_ids, dcp_size, dcp_rank,
                     first_page, num_pages, common, heads)
