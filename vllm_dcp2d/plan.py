"""Transfer plan of the 2D reshard: the ``(src_addr, dst_addr, length)``
descriptors one prefill rank writes to one decode DCP rank (design §6).

Pure numpy over integer addresses: no vLLM, no torch, no I/O, so it is
tested on fake addresses exactly like the bytes it will move.

Terms
-----
page
    One KV block of ``page_size`` tokens. The transfer unit is the sharding
    unit: prefill page ``i`` of a request goes whole to decode DCP rank
    ``i % dcp_size``, into its local block ``dst_block_ids[i // dcp_size]``.
    That is vLLM's DCP layout with ``cp_kv_cache_interleave_size ==
    block_size``: the scheduler hands out one block id per ``dcp_size`` pages
    and every DCP rank stores its page of that group under the same id.
region
    One strided plane of a layer's paged KV: ``base + block_id * page_stride``
    is where a page starts and ``page_bytes`` of it are moved. vLLM's CPU
    layout ``[blocks, heads, block_size, 2*head]`` is one region per layer;
    a ``[2, blocks, ...]`` layout is two (K and V).
group
    One of vLLM's KV cache groups: layers that share a block table. Each has
    its own sharding on a decode instance: DCP-sharded as above, or
    replicated: every DCP rank holds every page, page ``i`` in its block
    ``block_ids[i]`` (a speculative draft's KV runs with DCP disabled; a DSA
    indexer cache is the next such group). A request then has one block
    table per group: a tuple of int sequences, in group order.
heads
    The KV heads a rank's pages hold (vLLM shards them over TP). Where the
    two ranks of a path hold different heads the path moves only the heads
    both hold, a part of each page (``head_split``): the plan is then layer x
    head x page, and the descriptors of equal heads stay those of whole pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_dcp2d.head_split import PageSlice, ShardError, head_slices, page_slice, senders_for
from vllm_dcp2d.layout import _check_rank, _check_size, cdiv, cp_layer_range, dcp_pages_for_rank

__all__ = ["KVRegions", "Descriptors", "PageSlice", "page_slice", "head_slices", "plan_path", "plan_request",
           "block_tables", "Memory", "region_ends", "blocks_within", "senders_for", "ShardError"]

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
    """

    layer_ids: np.ndarray
    base: np.ndarray
    page_stride: np.ndarray
    page_bytes: np.ndarray
    layer_group: np.ndarray | None = None
    group_sharded: np.ndarray | None = None
    head_count: np.ndarray | None = None
    head_runs: np.ndarray | None = None

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
        row_of = np.full(int(ids.max()) + 1 if ids.size else 0, -1, dtype=np.int64)
        row_of[ids] = np.arange(ids.size)
        for name, val in (("layer_ids", ids), ("base", base), ("page_stride", stride), ("page_bytes", nbytes),
                          ("layer_group", group), ("group_sharded", sharded), ("head_count", heads),
                          ("head_runs", runs), ("_row_of", row_of)):
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
        count = _check_size("count", count)
        scale = np.where(self.head_count > 1, count, 1)
        nbytes = self.head_bytes * scale
        return KVRegions(self.layer_ids, self.base, np.maximum(self.page_stride, nbytes), nbytes, self.layer_group,
                         self.group_sharded, scale, self.head_runs)

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
class Descriptors:
    """Transfer descriptors of one path: ``length[k]`` bytes from ``src[k]`` to ``dst[k]``.

    src, dst, length: int64 ``[n]``.
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @classmethod
    def empty(cls) -> Descriptors:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, parts: list[Descriptors]) -> Descriptors:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("src", "dst", "length")))

    def batches(self, max_entries: int):
        """Consecutive slices of at most ``max_entries`` descriptors."""
        max_entries = _check_size("max_entries", max_entries)
        for s in range(0, len(self), max_entries):
            yield Descriptors(self.src[s:s + max_entries], self.dst[s:s + max_entries],
                              self.length[s:s + max_entries])


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
    (layer, region) reach, ``base + (num_blocks - 1) * page_stride + page_bytes``;
    raises ValueError (naming the layer) where that passes 2^63."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    room = MAX_ADDR - regions.base - regions.page_bytes[None, :]  # no overflow: all terms in [0, 2^63)
    bad = (room < 0) | ((num_blocks - 1) > room // regions.page_stride[None, :])
    if bad.any():
        k, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"layer {int(regions.layer_ids[k])} region {j}: base {int(regions.base[k, j])} + "
                         f"{num_blocks - 1} x page_stride {int(regions.page_stride[j])} overflows int64")
    return regions.base + (num_blocks - 1) * regions.page_stride[None, :] + regions.page_bytes[None, :]


def blocks_within(regions: KVRegions, memory: Memory) -> int:
    """The most blocks every (layer, region) of ``regions`` has inside ``memory``;
    raises ValueError (naming the layer) where a region starts outside it."""
    room = memory.room(regions.base.reshape(-1)).reshape(regions.base.shape)
    if (room < regions.page_bytes[None, :]).any():
        k, j = map(int, np.argwhere(room < regions.page_bytes[None, :])[0])
        raise ValueError(f"layer {int(regions.layer_ids[k])} region {j} at {int(regions.base[k, j]):#x} "
                         f"is not inside registered memory")
    return int(((room - regions.page_bytes[None, :]) // regions.page_stride[None, :]).min()) + 1


def _check_compatible(src: KVRegions, dst: KVRegions) -> None:
    if src.num_regions != dst.num_regions:
        raise ValueError(f"region count differs: producer {src.num_regions}, consumer {dst.num_regions}")
    if not np.array_equal(src.page_bytes, dst.page_bytes):
        raise ValueError(f"bytes per page differ: producer {src.page_bytes.tolist()}, "
                         f"consumer {dst.page_bytes.tolist()}")


def _block_ids(name: str, ids) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be >= 0, got min {arr.min()}")
    return arr


def block_tables(name: str, ids, num_groups: int) -> list[np.ndarray]:
    """A request's block tables, one int64 array per group: ``ids`` is an int
    sequence (one group) or a tuple of them (one per group). Raises ValueError."""
    tables = list(ids) if isinstance(ids, tuple) else [ids]
    if len(tables) != num_groups:
        raise ValueError(f"{name} has {len(tables)} block tables, the KV has {num_groups} cache groups")
    return [_block_ids(name, t) for t in tables]


def plan_path(src: KVRegions, src_block_ids, layers, dst: KVRegions, dst_block_ids,
              dcp_size: int, dcp_rank: int, first_page: int = 0,
              num_pages: int | None = None, src_heads: range | None = None,
              dst_heads: range | None = None) -> Descriptors:
    """Descriptors that move ``layers x heads x pages(dcp_rank)`` of one request.

    src:           producer KV regions (must hold every layer in ``layers``).
    src_block_ids: producer block of each sequence page, in sequence order: int ``[P]``,
                   or a tuple of them, one per producer group (``src.layer_group``).
    layers:        the producer rank's layers to send (its ``cp_layer_range``).
    dst:           consumer DCP rank's KV regions (all layers).
    dst_block_ids: the consumer's block table(s), one per consumer group. In a
                   DCP-sharded group page ``i`` lands in ``[i // dcp_size]`` on rank
                   ``i % dcp_size`` (``>= cdiv(P, dcp_size)`` entries); in a replicated
                   group every rank gets page ``i`` in ``[i]`` (``>= P`` entries).
    first_page:    first sequence page to send (earlier ones are cached on decode).
    num_pages:     pages of the request, default the producer table's length.
    src_heads, dst_heads: the KV heads each side's pages hold (absolute head ids; default:
                   the same on both sides). Where they differ only ``src_heads & dst_heads``
                   moves: a part of each page (``head_slices``), each run at its head's
                   place in the producer's page and in the consumer's.

    Order: per (producer group, consumer group), layer-major, then region, then
    page (then run, then head); runs contiguous on both sides are merged. Returns
    int64 arrays; no Python loop per page or layer. With equal heads the
    descriptors are those of whole pages.
    """
    dcp_size = _check_size("dcp_size", dcp_size)
    dcp_rank = _check_rank("dcp_rank", dcp_rank, dcp_size, "dcp_size")
    pieces = None
    if src_heads is not None and dst_heads is not None and src_heads != dst_heads:
        pieces = head_slices(src, dst, src_heads, dst_heads)
    else:
        _check_compatible(src, dst)
    src_tables = block_tables("src_block_ids", src_block_ids, src.num_groups)
    dst_tables = block_tables("dst_block_ids", dst_block_ids, dst.num_groups)
    sizes = {t.size for t in src_tables}
    if num_pages is None:
        if len(sizes) != 1:
            raise ValueError(f"the producer's block tables differ in length {sorted(sizes)}: pass num_pages")
        num_pages = sizes.pop()
    num_pages = int(num_pages)
    if not 0 <= num_pages <= min(t.size for t in src_tables):
        raise ValueError(f"num_pages must be in [0, len(src_block_ids)={min(t.size for t in src_tables)}], "
                         f"got {num_pages}")
    if first_page < 0:
        raise ValueError(f"first_page must be >= 0, got {first_page}")
    layers = np.asarray(layers, dtype=np.int64).reshape(-1)
    if layers.size == 0:
        return Descriptors.empty()
    pair = src.groups_of(layers, "producer") * dst.num_groups + dst.groups_of(layers, "consumer")
    parts = []
    for p in np.unique(pair):  # one per (producer group, consumer group): a handful, not per page
        sg, dg = divmod(int(p), dst.num_groups)
        size, rank = (dcp_size, dcp_rank) if dst.group_sharded[dg] else (1, 0)
        parts.append(_plan_group(src, src_tables[sg], layers[pair == p], dst, dst_tables[dg], size, rank,
                                 first_page, num_pages, pieces))
    return Descriptors.concat(parts)


def _plan_group(src: KVRegions, src_ids: np.ndarray, layers: np.ndarray, dst: KVRegions, dst_ids: np.ndarray,
                dcp_size: int, dcp_rank: int, first_page: int, num_pages: int, pieces=None) -> Descriptors:
    """``layers`` (one block table on each side) x pages(dcp_rank); ``pieces``: the
    ``head_slices`` of a page to move, None = whole pages."""
    if dst_ids.size < cdiv(num_pages, dcp_size):
        raise ValueError(f"dst_block_ids has {dst_ids.size} blocks, need cdiv(num_pages={num_pages}, "
                         f"dcp_size={dcp_size}) = {cdiv(num_pages, dcp_size)}")
    pages = dcp_pages_for_rank(num_pages, dcp_size, dcp_rank, first_page)
    if layers.size == 0 or pages.size == 0:
        return Descriptors.empty()
    src_base = src.rows(layers, "producer")  # [L, R]
    dst_base = dst.rows(layers, "consumer")
    # Page offsets, and so the runs along the page axis, are the same for
    # every layer: find them once per region on [Pd] arrays, then add the
    # layer bases. Runs therefore merge within a (layer, region) row.
    # pages = start, start + N, ...: both lookups are views, not gathers.
    start = int(pages[0])
    src_off = src_ids[start:num_pages:dcp_size]  # [Pd]
    dst_off = dst_ids[start // dcp_size: start // dcp_size + pages.size]
    s, d, n = [], [], []
    for j in range(src.num_regions):  # regions per layer: 1 or 2
        if pieces is None:
            rs, rd, rn = _page_runs(src_off * src.page_stride[j], dst_off * dst.page_stride[j],
                                    int(src.page_bytes[j]))
        else:  # [Pd, Q] pieces, page-major: merged where contiguous on both sides
            ps, pd, plen = pieces[j]
            rs, rd, rn = _page_runs((src_off[:, None] * src.page_stride[j] + ps[None, :]).reshape(-1),
                                    (dst_off[:, None] * dst.page_stride[j] + pd[None, :]).reshape(-1), plen)
        s.append(src_base[:, j, None] + rs[None, :])  # [L, runs_j]
        d.append(dst_base[:, j, None] + rd[None, :])
        n.append(np.broadcast_to(rn[None, :], (layers.size, rn.size)))
    return Descriptors(_rows_to_flat(s), _rows_to_flat(d), _rows_to_flat(n))


def _rows_to_flat(parts: list[np.ndarray]) -> np.ndarray:
    """``[L, runs_j]`` per region -> layer-major, region-minor flat int64 ``[n]``."""
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0]).reshape(-1)
    return np.concatenate(parts, axis=1).reshape(-1)


def _page_runs(src_off: np.ndarray, dst_off: np.ndarray, page_bytes: int):
    """Merge consecutive pages contiguous on both sides.

    src_off, dst_off: int64 ``[Pd]`` byte offsets of each page. Returns
    ``(src_off[runs], dst_off[runs], length[runs])``.
    """
    brk = (src_off[1:] != src_off[:-1] + page_bytes) | (dst_off[1:] != dst_off[:-1] + page_bytes)
    if brk.all():  # shuffled block ids: nothing merges, skip the run bookkeeping
        return src_off, dst_off, np.full(src_off.size, page_bytes, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    length = np.diff(np.append(starts, src_off.size)) * page_bytes
    return src_off[starts], dst_off[starts], length


def plan_request(num_layers: int, cp_size: int, src_regions: list[KVRegions], src_block_ids,
                 dst_regions: list[KVRegions], dst_block_ids, first_page: int = 0,
                 num_pages: int | None = None, src_heads: list[range] | None = None,
                 dst_heads: list[range] | None = None, src_layers: list[range] | None = None,
                 dcp_ranks: list[int] | None = None) -> dict[tuple[int, int], Descriptors]:
    """All paths of one request: ``{(cp_rank, dcp_rank): Descriptors}``.

    src_regions[r]: KV regions of prefill CP rank ``r``; dst_regions[d]: of
    decode rank ``d`` (``dcp_size = len(dst_regions)`` unless ``dcp_ranks`` is given).
    With heads (``src_heads[r]``, ``dst_heads[d]``: the KV heads each rank's pages hold)
    the plan is layer x head x page: path ``(r, d)`` carries ``src_layers[r]`` (default
    ``cp_layer_range``) x ``(src_heads[r] & dst_heads[d])`` x pages of ``d``'s DCP rank
    (``dcp_ranks[d]`` of ``max(dcp_ranks) + 1``, default ``d`` of ``len(dst_regions)``);
    paths whose heads do not meet are left out.
    """
    if len(src_regions) != cp_size:
        raise ValueError(f"src_regions has {len(src_regions)} entries, expected cp_size={cp_size}")
    dcp = list(range(len(dst_regions))) if dcp_ranks is None else list(dcp_ranks)
    dcp_size = max(dcp) + 1
    out = {}
    for r in range(cp_size):
        layers = cp_layer_range(num_layers, cp_size, r) if src_layers is None else src_layers[r]
        for d in range(len(dst_regions)):
            sh, dh = (None, None) if src_heads is None else (src_heads[r], dst_heads[d])
            if sh is not None and max(sh.start, dh.start) >= min(sh.stop, dh.stop):
                continue
            out[(r, d)] = plan_path(src_regions[r], src_block_ids, layers, dst_regions[d], dst_block_ids,
                                    dcp_size, dcp[d], first_page, num_pages, sh, dh)
    return out
