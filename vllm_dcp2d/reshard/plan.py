"""Transfer plan of the 2D reshard: the ``(src_addr, dst_addr, length)``
descriptors one prefill rank writes to one decode DCP rank (design §6).

Pure numpy over integer addresses: no vLLM, no torch, no I/O, so it is
tested on fake addresses exactly like the bytes it will move. Its inputs,
each side's :class:`~vllm_dcp2d.reshard.regions.KVRegions`, are in ``regions.py``
(regions and KV cache groups are defined there); callers import them from there.

Terms
-----
page
    One KV block of ``page_size`` tokens. The transfer unit is the sharding
    unit: prefill page ``i`` of a request goes whole to decode DCP rank
    ``i % dcp_size``, into its local block ``dst_block_ids[i // dcp_size]``.
    That is vLLM's DCP layout with ``cp_kv_cache_interleave_size ==
    block_size``: the scheduler hands out one block id per ``dcp_size`` pages
    and every DCP rank stores its page of that group under the same id.
heads
    The KV heads a rank's pages hold (vLLM shards them over TP). Where the
    two ranks of a path hold different heads the path moves only the heads
    both hold, a part of each page (``head_split``): the plan is then layer x
    head x page, and the descriptors of equal heads stay those of whole pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_dcp2d.reshard.head_split import head_slices
from vllm_dcp2d.reshard.layout import cdiv, check_rank, check_size, cp_layer_range, dcp_pages_for_rank
from vllm_dcp2d.reshard.regions import KVRegions

__all__ = ["Descriptors", "plan_path", "plan_request", "block_tables"]


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
        max_entries = check_size("max_entries", max_entries)
        for s in range(0, len(self), max_entries):
            yield Descriptors(self.src[s:s + max_entries], self.dst[s:s + max_entries],
                              self.length[s:s + max_entries])


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
    page (then run, then head); runs contiguous on both sides are merged. A layer
    moves only the regions it has (``KVRegions.region_mask``: a layer without a
    plane, e.g. a DSA layer without an indexer cache). Returns int64 arrays; no
    Python loop per page or layer. With equal heads the descriptors are those of
    whole pages.
    """
    dcp_size = check_size("dcp_size", dcp_size)
    dcp_rank = check_rank("dcp_rank", dcp_rank, dcp_size, "dcp_size")
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
    keep = _layer_regions(src, dst, layers)  # [L, R] bool, or None: every layer every region
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
    if keep is not None:  # layers without some planes: their runs of those regions go
        runs = [np.broadcast_to(keep[:, j, None], part.shape) for j, part in enumerate(s)]
        sel = _rows_to_flat(runs)
        return Descriptors(_rows_to_flat(s)[sel], _rows_to_flat(d)[sel], _rows_to_flat(n)[sel])
    return Descriptors(_rows_to_flat(s), _rows_to_flat(d), _rows_to_flat(n))


def _layer_regions(src: KVRegions, dst: KVRegions, layers: np.ndarray) -> np.ndarray | None:
    """bool ``[L, R]``: the regions each of ``layers`` has, the producer's and the consumer's
    alike, or None where every one of them has every region. A consumer's regions that came
    over the wire carry no mask (``TransferRequest``): the producer's own then decides, and
    the fingerprint (``layout``) has made sure both hold the same planes per layer."""
    mine = src.masks_of(layers, "producer")
    theirs = dst.masks_of(layers, "consumer")
    if not dst.uniform_planes and not np.array_equal(mine, theirs):
        k = int(np.argwhere((mine != theirs).any(axis=1))[0, 0])
        raise ValueError(f"layer {int(layers[k])}: the producer has regions {np.flatnonzero(mine[k]).tolist()}, the "
                         f"consumer {np.flatnonzero(theirs[k]).tolist()} (layers hold different planes)")
    return None if mine.all() else mine


def _rows_to_flat(parts: list[np.ndarray]) -> np.ndarray:
    """``[L, runs_j]`` per region -> layer-major, region-minor flat ``[n]``."""
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
