"""The head axis of the 3D reshard (layer x head x page): which bytes of a page carry
which KV heads, on each side of a path (issue 39).

vLLM shards a model's KV heads over TP ranks (``layout.kv_head_range``); a prefill
rank's pages hold heads ``H(r)``, a decode rank's ``H(d)``, and when the two differ path
``(r, d)`` moves only ``H(r) & H(d)`` of each page, straight to that head's place in the
decode's page. Where heads sit in a page is the page format's business: a region's page
(``regions.KVRegions``) is ``head_runs`` dense runs, each of ``head_count`` heads, so

* heads outside the tokens (vLLM's CPU page ``[H, N, C]``, GPU ``LBHNC``/HND): a head
  range is one contiguous run of a page;
* heads inside the tokens (``LBNHC``/NHD ``[N, H, C]``): one run per token, ``head_count``
  heads apart (one descriptor per token, as vLLM's NIXL connector writes between
  unequal TP with NHD).

Which prefill ranks a decode rank fetches from (``senders_for``): every rank whose heads
intersect its own, together covering each (layer, head) it holds exactly once.

Pure numpy over byte offsets: no vLLM, no torch, no I/O; ``regions`` are
``regions.KVRegions``, read by attribute (this module imports nothing of the package).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PageSlice", "page_slice", "head_slices", "ShardError", "senders_for"]


@dataclass(frozen=True)
class PageSlice:
    """Where heads ``[first, first + n)`` of a page lie in one side's region: ``count``
    runs of ``length`` bytes, run ``i`` at ``offset + i * stride`` from the page start."""

    offset: int
    length: int
    count: int
    stride: int


def page_slice(regions, j: int, first: int, n: int) -> PageSlice:
    """The ``PageSlice`` of local heads ``[first, first + n)`` in a page of region ``j``:
    with heads outside the tokens (``head_runs`` 1) one run; with heads inside them one
    run per token, ``head_count`` heads apart."""
    per = int(regions.page_bytes[j] // (regions.head_count[j] * regions.head_runs[j]))  # one head, one run
    return PageSlice(first * per, n * per, int(regions.head_runs[j]), int(regions.head_count[j]) * per)


def head_slices(src, dst, src_heads: range, dst_heads: range):
    """Per region ``j``: ``(src_off, dst_off, length)``, the pieces of a page that carry
    ``src_heads & dst_heads``: int64 ``[Q]`` offsets from the page start on each side and
    one piece length. A piece is a run of ``page_slice`` where both sides cut a head the
    same way (``[run, heads]``: heads merge within a run); where one side keeps a head in
    one run and the other in ``k``, the head is cut into ``k`` pieces (``[run, head]``).

    Raises ValueError naming both sides where no head is common, a head's bytes differ,
    or a page does not hold the rank's heads inside it (``head_count``)."""
    common = range(max(src_heads.start, dst_heads.start), min(src_heads.stop, dst_heads.stop))
    if len(common) == 0:
        raise ValueError(f"the producer holds KV heads [{src_heads.start}, {src_heads.stop}), the consumer "
                         f"[{dst_heads.start}, {dst_heads.stop}): no head in common")
    for side, reg, heads in (("producer", src, src_heads), ("consumer", dst, dst_heads)):
        if (reg.head_count != len(heads)).any():
            raise ValueError(f"the {side}'s pages hold {reg.head_count.tolist()} KV heads per region, its rank "
                             f"holds {len(heads)}: moving a part of its heads needs them inside each page (a "
                             f"layout with heads outside the blocks, LHBNC or BHLNC, keeps one head per region)")
    if src.num_regions != dst.num_regions:
        raise ValueError(f"region count differs: producer {src.num_regions}, consumer {dst.num_regions}")
    if not np.array_equal(src.page_bytes // src.head_count, dst.page_bytes // dst.head_count):
        raise ValueError(f"bytes per KV head of a page differ: producer {(src.page_bytes // src.head_count).tolist()}"
                         f", consumer {(dst.page_bytes // dst.head_count).tolist()}")
    out = []
    for j in range(src.num_regions):  # regions per layer: 1 or 2
        s = page_slice(src, j, common.start - src_heads.start, len(common))
        d = page_slice(dst, j, common.start - dst_heads.start, len(common))
        if s.count == d.count:  # the same cut on both sides: a run of all common heads
            i = np.arange(s.count, dtype=np.int64)
            out.append((s.offset + i * s.stride, d.offset + i * d.stride, s.length))
            continue
        runs = max(s.count, d.count)
        if runs % min(s.count, d.count):
            raise ValueError(f"region {j}: a KV head is {s.count} run(s) on the producer, {d.count} on the "
                             f"consumer; neither divides the other")
        head = s.length // len(common)  # one head's bytes in one producer run
        piece = head * s.count // runs
        i = np.arange(runs, dtype=np.int64)[:, None]  # [runs, 1] pieces of a head, in token order
        h = np.arange(len(common), dtype=np.int64)[None, :]  # [1, n] common heads

        def at(sl: PageSlice, i=i, h=h, piece=piece, runs=runs) -> np.ndarray:
            per_run = runs // sl.count  # pieces in one of this side's runs of a head
            one = sl.length // len(common)
            return (sl.offset + (i // per_run) * sl.stride + h * one + (i % per_run) * piece).reshape(-1)

        out.append((at(s), at(d), piece))
    return out


class ShardError(ValueError):
    """A prefill's ranks cannot give a decode rank exactly its KV (which heads and layers
    each holds); the message names both sides' shards and the fix."""


def _heads(r: range) -> str:
    return f"head {r.start}" if len(r) == 1 else f"heads {r.start}-{r.stop - 1}"


def senders_for(layers: np.ndarray, heads: np.ndarray, num_layers: int, num_kv_heads: int, want: range) -> np.ndarray:
    """The CP ranks a consumer rank holding KV heads ``want`` fetches from, given a rank
    table's shards: rank ``r`` sends layers ``[layers[2r], layers[2r+1])`` of heads
    ``[heads[2r], heads[2r+1])`` (int64 ``[2R]`` each). Returns int64 ``[n]`` ascending:
    every rank whose heads intersect ``want`` (it sends ``its heads & want``).

    Raises ``ShardError`` unless those ranks cover each (layer, head) of
    ``range(num_layers) x want`` exactly once, naming what is missing or doubled."""
    lo, hi = heads[0::2], heads[1::2]
    ask = np.flatnonzero((lo < want.stop) & (hi > want.start))
    theirs = ", ".join(f"cp rank {r}: {_heads(range(int(lo[r]), int(hi[r])))} of layers "
                       f"{int(layers[2 * r])}-{int(layers[2 * r + 1]) - 1}" for r in range(lo.size))
    fix = (f"the prefill's ranks hold {theirs} (of {num_kv_heads} KV heads, {num_layers} layers); this decode rank "
           f"holds {_heads(want)}. Restart the prefill with its default cp_size (or one its head replicas allow)")
    if not ask.size:
        raise ShardError(f"KV heads differ: no prefill rank holds any of {_heads(want)}: {fix}")
    # (layer, head) coverage of the asked ranks' shards within want: a 2D difference grid
    a0, a1 = layers[0::2][ask], layers[1::2][ask]
    h0 = np.maximum(lo[ask], want.start) - want.start
    h1 = np.minimum(hi[ask], want.stop) - want.start
    grid = np.zeros((num_layers + 1, len(want) + 1), dtype=np.int64)
    np.add.at(grid, (a0, h0), 1)
    np.add.at(grid, (a0, h1), -1)
    np.add.at(grid, (a1, h0), -1)
    np.add.at(grid, (a1, h1), 1)
    cover = grid.cumsum(0).cumsum(1)[:num_layers, :len(want)]
    if (cover != 1).any():
        layer, head = map(int, np.argwhere(cover != 1)[0])
        count = int(cover[layer, head])
        raise ShardError(f"the prefill's ranks holding any of {_heads(want)} send layer {layer} of head "
                         f"{want.start + head} {count} times instead of once "
                         f"({(cover != 1).sum()} (layer, head) pairs wrong): {fix}")
    return ask.astype(np.int64)
