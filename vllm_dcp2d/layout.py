"""Sharding math of the 2D reshard: layers across prefill CP ranks, pages
across decode DCP ranks (design §4.1, §5.1, §6.2).

Pure functions over ints and numpy arrays. No vLLM, no torch, no I/O.

Prefill (CP layer-split): rank ``r`` of ``cp_size`` owns the contiguous,
half-open layer range ``cp_layer_range(num_layers, cp_size, r)``; the first
``num_layers % cp_size`` ranks get one layer more (div + remainder, not ceil).

Decode (DCP): sequence page ``p`` lives on rank ``p % dcp_size`` at local
slot ``p // dcp_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "StoragePlan",
    "cp_layer_range",
    "cp_layer_owner",
    "local_layer_count",
    "dcp_page_owner",
    "dcp_local_slot",
    "filter_kv_indices_for_dcp_rank",
    "dcp_pages_for_rank",
    "cdiv",
]


def _check_size(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_rank(name: str, value: int, size: int, size_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in [0, {size_name}={size}), got {value}")
    return int(value)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cp_layer_range(num_layers: int, cp_size: int, cp_rank: int) -> range:
    """Layers owned by prefill CP rank ``cp_rank``: ``range(start, end)``.

    78 layers on 8 ranks -> ranks 0-5 own 10 layers, ranks 6-7 own 9.
    A rank owns no layer when ``num_layers < cp_size`` and ``cp_rank >= num_layers``.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
    cp_size = _check_size("cp_size", cp_size)
    cp_rank = _check_rank("cp_rank", cp_rank, cp_size, "cp_size")
    base, extra = divmod(int(num_layers), cp_size)
    start = cp_rank * base + min(cp_rank, extra)
    return range(start, start + base + (1 if cp_rank < extra else 0))


def cp_layer_owner(layer: int, num_layers: int, cp_size: int) -> int:
    """The CP rank whose ``cp_layer_range`` contains ``layer``."""
    cp_size = _check_size("cp_size", cp_size)
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, num_layers={num_layers}), got {layer!r}")
    base, extra = divmod(int(num_layers), cp_size)
    big = extra * (base + 1)  # layers held by the ranks that own one extra
    if layer < big:
        return int(layer) // (base + 1)
    return extra + (int(layer) - big) // base


def local_layer_count(num_layers: int, cp_size: int, cp_rank: int) -> int:
    """KV layer slots rank ``cp_rank`` allocates: owned layers + 1 transient slot."""
    return len(cp_layer_range(num_layers, cp_size, cp_rank)) + 1


def _as_index_array(name: str, pages) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be >= 0, got min {arr.min()}")
    return arr


def dcp_page_owner(pages, dcp_size: int):
    """DCP rank holding page(s) ``pages``: ``pages % dcp_size`` (scalar or array)."""
    dcp_size = _check_size("dcp_size", dcp_size)
    arr = _as_index_array("pages", pages)
    out = arr % dcp_size
    return int(out) if np.ndim(pages) == 0 else out


def dcp_local_slot(pages, dcp_size: int):
    """Local slot of page(s) ``pages`` on its owner: ``pages // dcp_size``."""
    dcp_size = _check_size("dcp_size", dcp_size)
    arr = _as_index_array("pages", pages)
    out = arr // dcp_size
    return int(out) if np.ndim(pages) == 0 else out


def filter_kv_indices_for_dcp_rank(kv_indices, dcp_size: int, dcp_rank: int) -> np.ndarray:
    """Keep the pages DCP rank ``dcp_rank`` owns and map them to its local slots
    (design §6.2): ``kv_indices[kv_indices % N == d] // N``.

    kv_indices: int array ``[n]`` of global logical page indices.
    Returns an int array ``[m]``, ``m ~= n / dcp_size``; with ``dcp_size == 1``
    the input unchanged.
    """
    dcp_size = _check_size("dcp_size", dcp_size)
    dcp_rank = _check_rank("dcp_rank", dcp_rank, dcp_size, "dcp_size")
    arr = _as_index_array("kv_indices", kv_indices)
    if dcp_size == 1:
        return arr
    return arr[arr % dcp_size == dcp_rank] // dcp_size


def dcp_pages_for_rank(num_pages: int, dcp_size: int, dcp_rank: int, first_page: int = 0) -> np.ndarray:
    """Sequence pages ``i`` in ``[first_page, num_pages)`` with ``i % dcp_size == dcp_rank``,
    ascending, as an int64 array."""
    dcp_size = _check_size("dcp_size", dcp_size)
    dcp_rank = _check_rank("dcp_rank", dcp_rank, dcp_size, "dcp_size")
    if num_pages < 0 or first_page < 0:
        raise ValueError(f"num_pages and first_page must be >= 0, got {num_pages}, {first_page}")
    start = first_page + (dcp_rank - first_page) % dcp_size
    return np.arange(start, num_pages, dcp_size, dtype=np.int64)


@dataclass(frozen=True)
class StoragePlan:
    """Layer-split storage of one prefill instance (design §4.1): num_layers ``L``;
    cp_size: ranks owning layers (the first ``cp_size`` TP ranks); slots: layer
    regions the largest owner allocates (owned + 1 transient)."""

    num_layers: int
    cp_size: int

    @property
    def slots(self) -> int:
        return local_layer_count(self.num_layers, self.cp_size, 0)  # rank 0 owns the most layers

    def owner(self, layer: int) -> int:
        return cp_layer_owner(layer, self.num_layers, self.cp_size)
