"""Host memory as numpy: read byte ranges of registered KV without a Python loop per range.

The send staging (``staging.py``: a path's pages copied into a slot before one write)
gathers many equal-sized runs of host memory. ``gather`` does it with one fancy-indexed
copy per registered range: every run is cut into units of the runs' common divisor,
and each unit is a row of a strided view over that range. The KV checksum
(``checksum.KVBytes``) gathers the same way with torch, on whichever device holds the
KV, over ``bytes_at`` views where that is host memory.
"""

from __future__ import annotations

import ctypes

import numpy as np

from vllm_dcp2d.reshard.regions import Memory

__all__ = ["bytes_at", "gather"]


def bytes_at(addr: int, nbytes: int) -> np.ndarray:
    """uint8 ``[nbytes]`` over host memory at ``addr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _rows(buf: np.ndarray, unit: int) -> np.ndarray:
    """uint8 ``[len(buf) - unit + 1, unit]``: row ``i`` is ``buf[i:i + unit]`` (a view)."""
    return np.lib.stride_tricks.as_strided(buf, shape=(buf.size - unit + 1, unit), strides=(1, 1),
                                           writeable=False)


def gather(memory: Memory, src: np.ndarray, length: np.ndarray, out: np.ndarray) -> None:
    """Copy ``length[k]`` bytes at address ``src[k]`` (int64 ``[n]``) to consecutive places of
    ``out`` (uint8, ``length.sum()`` bytes), in order. Raises ValueError unless every
    range lies in one range of ``memory`` (host memory this process registered)."""
    if not src.size:
        return
    if not memory.holds(src, length).all():
        raise ValueError("a read falls outside the memory this rank registered")
    if out.size != int(length.sum()):
        raise ValueError(f"out holds {out.size} bytes, the ranges {int(length.sum())}")
    unit = int(np.gcd.reduce(length))
    count = length // unit
    first = np.repeat(np.cumsum(count) - count, count)
    k = np.repeat(np.arange(src.size), count)
    at = src[k] + (np.arange(int(count.sum())) - first) * unit
    rows = out.reshape(-1, unit)
    where = np.searchsorted(memory.addr, at, side="right") - 1
    for r in np.unique(where):  # one per registered range (a handful), not per page
        sel = where == r
        base, size = int(memory.addr[r]), int(memory.nbytes[r])
        rows[sel] = _rows(bytes_at(base, size), unit)[at[sel] - base]
