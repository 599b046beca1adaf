"""Address spaces of the 2D reshard: where one rank's paged KV lives
(:class:`KVRegions`), the memory a transport registered (:class:`Memory`), and
the checks between them (:func:`region_ends`, :func:`blocks_within`). The plan
(``plan.py``) reads both sides' regions; the transfer checks them against each
side's registered memory before anything is written.

Pure numpy over integer addresses: no vLLM, no torch, no I/O.

Terms
-----
region
    One strided plane of a layer's paged KV: ``base + block_id * page_stride``
    is where a page starts and ``page_bytes`` of it are moved. vLLM's CPU
    layout ``[blocks, heads, block_size, 2*head]`` is one region per layer;
    a ``[2, blocks, ...]`` layout is two (K and V).
group
    One of vLLM's KV cache groups: layers that share a block table. Each has
    its own sharding on a decode instance: DCP-sharded (page ``i`` on DCP rank
    ``i % dcp_size``), or replicated: every DCP rank holds every page, page
    ``i`` in its block ``block_ids[i]`` (a speculative draft's KV runs with DCP
    disabled; a DSA indexer cache is the next such group). A request then has
    one block table per group: a tuple of int sequences, in group order.
plane
    One cache of a layer (sparse MLA: the latent and the indexer's keys), one or
    more regions. Layers may hold different planes (a DSA layer that reuses an
    earlier layer's top-k has no indexer cache): the regions are those of every
    plane any layer holds, and ``region_mask`` says which a layer has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["KVRegions", "Memory", "region_ends", "blocks_within", "MAX_ADDR"]

MAX_ADDR = (1 << 63) - 1


@dataclass(frozen=True)
class KVRegions:
    """Where one rank's paged KV lives in its address space.

    layer_ids:     int64 ``[Lh]``    KV layer id of each held layer (distinct).
    base:          int64 ``[Lh, R]`` address of block 0 of region ``j`` of layer ``layer_ids[k]``.
    page_stride:   int64 ``[R]``     bytes from one block to the next, per region.
    page_bytes:    int64 ``[R]``     bytes of one page to move, per region (<= page_stride).
    layer_group:   int64 ``[Lh]``    KV cache group of each layer (default: all 0).
    group_sharded: bool ``[G]``      whether each group's pages are DCP-sharded on this
                                     rank's instance (default: one sharded group).
    head_count:    int64 ``[R]``     KV heads inside one page of each region (default 1): the
                                     rank's head count where heads lie inside the page's dense
                                     run, 1 where the page holds one head or each head is a region.
    head_runs:     int64 ``[R]``     dense runs one head occupies in a page (default 1): 1 where
                                     heads are outside the tokens (HND, vLLM's CPU page
                                     ``[H, N, C]``), the token count where heads are inside
                                     them (NHD ``[N, H, C]``). A page of region ``j`` is
                                     ``head_runs`` runs, each ``head_count`` heads of
                                     ``page_bytes / (head_count * head_runs)`` bytes.
    region_mask:   bool ``[Lh, R]``  whether layer ``layer_ids[k]`` has region ``j`` (default: every
                                     layer every region). A layer without a plane has none of
                                     its regions: nothing of it is planned or checked, and its
                                     ``base`` there is not read.
    """

    layer_ids: np.ndarray
    base: np.ndarray
    page_stride: np.ndarray
    page_bytes: np.ndarray
    layer_group: np.ndarray | None = None
    group_sharded: np.ndarray | None = None
    head_count: np.ndarray | None = None
    head_runs: np.ndarray | None = None
    region_mask: np.ndarray | None = None

    def __post_init__(self):
        ids = np.asarray(self.layer_ids, dtype=np.int64).reshape(-1)
        base = np.asarray(self.base, dtype=np.int64)
        if base.ndim == 1:
            base = base.reshape(-1, 1)
        stride = np.asarray(self.page_stride, dtype=np.int64).reshape(-1)
        nbytes = np.asarray(self.page_bytes, dtype=np.int64).reshape(-1)
        if base.shape[0] != ids.size:
            raise ValueError(f"base has {base.shape[0]} layer rows but layer_ids has {ids.size}")
        if not (base.shape[1] == stride.size == nbytes.size) or stride.size == 0:
            raise ValueError(
                f"region counts differ: base has {base.shape[1]} columns, page_stride {stride.size}, "
                f"page_bytes {nbytes.size}")
        if np.unique(ids).size != ids.size:
            raise ValueError(f"layer_ids must be distinct, got {ids.tolist()}")
        if (nbytes <= 0).any() or (nbytes > stride).any():
            raise ValueError(f"need 0 < page_bytes <= page_stride, got page_bytes {nbytes.tolist()} "
                             f"page_stride {stride.tolist()}")
        if ids.size and ids.min() < 0:
            raise ValueError(f"layer_ids must be >= 0, got {ids.tolist()}")
        group = (np.zeros(ids.size, dtype=np.int64) if self.layer_group is None
                 else np.asarray(self.layer_group, dtype=np.int64).reshape(-1))
        sharded = (np.ones(int(group.max()) + 1 if group.size else 1, dtype=bool) if self.group_sharded is None
                   else np.asarray(self.group_sharded).reshape(-1).astype(bool))
        if group.size != ids.size:
            raise ValueError(f"layer_group has {group.size} entries but layer_ids has {ids.size}")
        if group.size and (group.min() < 0 or group.max() >= sharded.size):
            raise ValueError(f"layer_group must be in [0, {sharded.size}) (one entry of group_sharded per "
                             f"group), got {group.tolist()}")
        heads, runs = (np.ones(stride.size, dtype=np.int64) if v is None else np.asarray(v, dtype=np.int64).reshape(-1)
                       for v in (self.head_count, self.head_runs))
        if heads.size != stride.size or runs.size != stride.size:
            raise ValueError(f"head_count has {heads.size} and head_runs {runs.size} entries, expected one per "
                             f"region ({stride.size})")
        if (heads < 1).any() or (runs < 1).any() or (nbytes % (heads * runs)).any():
            raise ValueError(f"need head_count >= 1 and head_runs >= 1 dividing page_bytes, got head_count "
                             f"{heads.tolist()} head_runs {runs.tolist()} page_bytes {nbytes.tolist()}")
        mask = (np.ones(base.shape, dtype=bool) if self.region_mask is None
                else np.asarray(self.region_mask, dtype=bool))
        if mask.shape != base.shape:
            raise ValueError(f"region_mask has shape {mask.shape}, expected layers x regions = {base.shape}")
        row_of = np.full(int(ids.max()) + 1 if ids.size else 0, -1, dtype=np.int64)
        row_of[ids] = np.arange(ids.size)
        for name, val in (("layer_ids", ids), ("base", base), ("page_stride", stride), ("page_bytes", nbytes),
                          ("layer_group", group), ("group_sharded", sharded), ("head_count", heads),
                          ("head_runs", runs), ("region_mask", mask), ("_row_of", row_of)):
            object.__setattr__(self, name, val)

    @classmethod
    def uniform(cls, layer_ids, base, page_stride: int, page_bytes: int | None = None) -> KVRegions:
        """One region per layer, same stride everywhere (e.g. vLLM's CPU layout)."""
        return cls(np.asarray(layer_ids), np.asarray(base).reshape(-1, 1), np.array([page_stride]),
                   np.array([page_stride if page_bytes is None else page_bytes]))

    @property
    def num_regions(self) -> int:
        return int(self.page_stride.size)

    @property
    def num_groups(self) -> int:
        return int(self.group_sharded.size)

    @property
    def head_bytes(self) -> np.ndarray:
        """int64 ``[R]``: bytes of one KV head in a page of each region (all its runs)."""
        return self.page_bytes // self.head_count

    def with_heads(self, count: int) -> KVRegions:
        """The same layers, bases and per-head layout, each page holding ``count`` heads
        where this one holds ``head_count``: a stand-in producer of that many heads
        (``checksum.path_ranges``). Only its destination-side use is meaningful."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        count = int(count)
        scale = np.where(self.head_count > 1, count, 1)
        nbytes = self.head_bytes * scale
        return KVRegions(self.layer_ids, self.base, np.maximum(self.page_stride, nbytes), nbytes, self.layer_group,
                         self.group_sharded, scale, self.head_runs, self.region_mask)

    @property
    def uniform_planes(self) -> bool:
        """Every layer has every region (no ``region_mask`` entry is False)."""
        return bool(self.region_mask.all())

    def masks_of(self, layers: np.ndarray, side: str) -> np.ndarray:
        """bool ``[n, R]``: the regions each of ``layers`` has; raises if a layer is not held."""
        return self.region_mask[self._rows_index(layers, side)]

    def groups_of(self, layers: np.ndarray, side: str) -> np.ndarray:
        """Group of each of ``layers`` (int64 ``[n]``); raises if a layer is not held."""
        rows = self._rows_index(layers, side)
        return self.layer_group[rows]

    def rows(self, layers: np.ndarray, side: str) -> np.ndarray:
        """``base`` rows of ``layers`` (int64 ``[n]``); raises if a layer is not held."""
        return self.base[self._rows_index(layers, side)]

    def _rows_index(self, layers: np.ndarray, side: str) -> np.ndarray:
        known = (layers >= 0) & (layers < self._row_of.size)
        idx = np.full(layers.shape, -1, dtype=np.int64)
        idx[known] = self._row_of[layers[known]]
        missing = idx < 0
        if missing.any():
            raise ValueError(f"{side} holds no KV for layers {layers[missing].tolist()} "
                             f"(it holds {self.layer_ids.tolist()})")
        return idx


@dataclass(frozen=True)
class Memory:
    """Address ranges a transport registered: ``[addr[k], addr[k] + nbytes[k])``,
    sorted and disjoint. addr, nbytes: int64 ``[m]``."""

    addr: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self):
        addr = np.asarray(self.addr, dtype=np.int64).reshape(-1)
        nbytes = np.asarray(self.nbytes, dtype=np.int64).reshape(-1)
        if addr.size != nbytes.size or addr.size == 0:
            raise ValueError(f"need as many range starts as sizes, at least one: got {addr.size} and {nbytes.size}")
        if (addr <= 0).any() or (nbytes <= 0).any() or (addr > MAX_ADDR - nbytes).any():
            raise ValueError("every range needs addr > 0, nbytes > 0 and addr + nbytes < 2^63")
        order = np.argsort(addr, kind="stable")
        addr, nbytes = addr[order], nbytes[order]
        if (addr[1:] < addr[:-1] + nbytes[:-1]).any():
            raise ValueError("registered ranges overlap")
        object.__setattr__(self, "addr", addr)
        object.__setattr__(self, "nbytes", nbytes)

    @classmethod
    def of(cls, ranges) -> Memory:
        """From ``[(addr, nbytes), ...]`` (e.g. ``MooncakeTransport.registered().items()``)."""
        pairs = np.asarray(list(ranges), dtype=np.int64).reshape(-1, 2)
        return cls(pairs[:, 0], pairs[:, 1])

    def room(self, start: np.ndarray) -> np.ndarray:
        """Bytes from each ``start`` (int64 ``[n]``) to the end of the range holding
        it; -1 where no range holds it."""
        k = np.searchsorted(self.addr, start, side="right") - 1
        end = self.addr[np.maximum(k, 0)] + self.nbytes[np.maximum(k, 0)]
        return np.where((k >= 0) & (start < end), end - start, -1)

    def holds(self, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """bool ``[n]``: ``[start, start + length)`` lies inside one range."""
        return length <= self.room(start)


def region_ends(regions: KVRegions, num_blocks: int) -> np.ndarray:
    """int64 ``[L, R]``: one past the last byte ``num_blocks`` blocks of each
    (layer, region) reach, ``base + (num_blocks - 1) * page_stride + page_bytes`` (0 where
    the layer does not have the region); raises ValueError (naming the layer) where that
    passes 2^63."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    base = np.where(regions.region_mask, regions.base, 0)  # a region a layer does not have reaches nothing
    room = MAX_ADDR - base - regions.page_bytes[None, :]  # no overflow: all terms in [0, 2^63)
    bad = regions.region_mask & ((room < 0) | ((num_blocks - 1) > room // regions.page_stride[None, :]))
    if bad.any():
        k, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"layer {int(regions.layer_ids[k])} region {j}: base {int(regions.base[k, j])} + "
                         f"{num_blocks - 1} x page_stride {int(regions.page_stride[j])} overflows int64")
    ends = base + (num_blocks - 1) * regions.page_stride[None, :] + regions.page_bytes[None, :]
    return np.where(regions.region_mask, ends, 0)


def blocks_within(regions: KVRegions, memory: Memory) -> int:
    """The most blocks every (layer, region) of ``regions`` has inside ``memory`` (the
    regions each layer has); raises ValueError (naming the layer) where a region starts
    outside it."""
    room = memory.room(regions.base.reshape(-1)).reshape(regions.base.shape)
    room = np.where(regions.region_mask, room, MAX_ADDR)  # a region a layer does not have needs no room
    if (room < regions.page_bytes[None, :]).any():
        k, j = map(int, np.argwhere(room < regions.page_bytes[None, :])[0])
        raise ValueError(f"layer {int(regions.layer_ids[k])} region {j} at {int(regions.base[k, j]):#x} "
                         f"is not inside registered memory")
    return int(((room - regions.page_bytes[None, :]) // regions.page_stride[None, :]).min()) + 1
