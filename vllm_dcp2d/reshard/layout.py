"""Sharding math of the 2D reshard: layers across prefill CP ranks, pages
across decode DCP ranks (design §4.1, §5.1, §6.2).

Pure functions over ints and numpy arrays. No vLLM, no torch, no I/O.

Prefill (CP layer-split): rank ``r`` of ``cp_size`` owns the contiguous,
half-open layer range ``cp_layer_range(num_layers, cp_size, r)``; the first
``num_layers % cp_size`` ranks get one layer more (div + remainder, not ceil).

Decode (DCP): sequence page ``p`` lives on rank ``p % dcp_size`` at local
slot ``p // dcp_size``.

KV heads (both sides): vLLM splits a model's ``K`` KV heads over TP ranks
(``kv_head_range``): ``K / TP`` consecutive heads each when ``K >= TP``, else one
head replicated on ``TP / K`` consecutive ranks. A prefill splits layers only among
the ranks that hold the same heads (``send_shard``), so every sending rank holds the
whole KV of its heads for the layers it sends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

__all__ = [
    "StoragePlan",
    "cp_layer_range",
    "cp_layer_owner",
    "local_layer_count",
    "dcp_pages_for_rank",
    "kv_head_range",
    "head_replicas",
    "send_shard",
    "askers",
    "per_head_layout",
    "default_cp_size",
    "cdiv",
    "check_size",
    "check_rank",
]


def check_size(name: str, value: int) -> int:
    """``value`` as an int if it is an int >= 1 (a group size, a count); else ValueError naming
    ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_rank(name: str, value: int, size: int, size_name: str) -> int:
    """``value`` as an int if it is an int in ``[0, size)`` (a rank of a group of ``size``); else
    ValueError naming ``name``, the value and the group's size as ``size_name``."""
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
    cp_size = check_size("cp_size", cp_size)
    cp_rank = check_rank("cp_rank", cp_rank, cp_size, "cp_size")
    base, extra = divmod(int(num_layers), cp_size)
    start = cp_rank * base + min(cp_rank, extra)
    return range(start, start + base + (1 if cp_rank < extra else 0))


def cp_layer_owner(layer: int, num_layers: int, cp_size: int) -> int:
    """The CP rank whose ``cp_layer_range`` contains ``layer``."""
    cp_size = check_size("cp_size", cp_size)
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


def dcp_pages_for_rank(num_pages: int, dcp_size: int, dcp_rank: int, first_page: int = 0) -> np.ndarray:
    """Sequence pages ``i`` in ``[first_page, num_pages)`` with ``i % dcp_size == dcp_rank``,
    ascending, as an int64 array."""
    dcp_size = check_size("dcp_size", dcp_size)
    dcp_rank = check_rank("dcp_rank", dcp_rank, dcp_size, "dcp_size")
    if num_pages < 0 or first_page < 0:
        raise ValueError(f"num_pages and first_page must be >= 0, got {num_pages}, {first_page}")
    start = first_page + (dcp_rank - first_page) % dcp_size
    return np.arange(start, num_pages, dcp_size, dtype=np.int64)


def _check_heads(num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    num_kv_heads, tp_size = check_size("num_kv_heads", num_kv_heads), check_size("tp_size", tp_size)
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} and tp_size={tp_size}: one must divide the other "
                         f"(vLLM splits KV heads over TP ranks or replicates them)")
    return num_kv_heads, tp_size


def head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many TP ranks hold each KV head: ``TP / K`` when ``K < TP``, else 1."""
    num_kv_heads, tp_size = _check_heads(num_kv_heads, tp_size)
    return max(1, tp_size // num_kv_heads)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads TP rank ``tp_rank`` holds, as vLLM's ``QKVParallelLinear`` splits them:
    8 heads on TP=4 -> rank 1 holds ``range(2, 4)``; 2 heads on TP=4 -> rank 1 holds ``range(0, 1)``."""
    num_kv_heads, tp_size = _check_heads(num_kv_heads, tp_size)
    tp_rank = check_rank("tp_rank", tp_rank, tp_size, "tp_size")
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def send_shard(num_layers: int, num_kv_heads: int, tp_size: int, tp_rank: int,
               cp_size: int = 0) -> tuple[int, int, range, range] | None:
    """What prefill TP rank ``tp_rank`` sends: ``(cp_rank, senders, layers, heads)``, or None.

    The ranks that hold the same heads (``head_replicas`` of them) split the layers:
    replica ``i < cp_size`` of each head group is CP rank ``group * cp_size + i`` and
    sends ``cp_layer_range(num_layers, cp_size, i)`` of its heads; the other replicas
    send nothing. ``cp_size`` 0 = every replica. Raises ValueError for a ``cp_size``
    above the replicas, naming both."""
    replicas = head_replicas(num_kv_heads, tp_size)
    cp_size = replicas if cp_size == 0 else check_size("cp_size", cp_size)
    if cp_size > replicas:
        raise ValueError(f"cp_size={cp_size}: the model's {num_kv_heads} KV heads over tensor_parallel_size={tp_size} "
                         f"leave {replicas} rank(s) holding each head to split the layers among; expected 1.."
                         f"{replicas} (or 0: {replicas})")
    heads = kv_head_range(num_kv_heads, tp_size, tp_rank)
    group, i = divmod(tp_rank, replicas)
    if i >= cp_size:
        return None
    return (group * cp_size + i, (tp_size // replicas) * cp_size, cp_layer_range(num_layers, cp_size, i), heads)


def askers(num_kv_heads: int, tp_size: int, heads: range) -> list[int]:
    """The TP ranks of a consumer's ``tp_size`` that hold any of ``heads`` (so fetch from
    the producer rank that sends them), ascending: a producer rank frees a request once
    each of them got its pages or released them."""
    return [t for t in range(tp_size) if set(kv_head_range(num_kv_heads, tp_size, t)) & set(heads)]


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


_HEAD_AXIS = re.compile(r"(?<![A-Za-z0-9])H\d+[,/]?")


def per_head_layout(layout: str) -> str:
    """A page format (``page_format.page_format`` + content, planes joined by " + ") with its
    head axis left out: the layout of one KV head's bytes, which two ranks holding different
    head counts must share. "H2,N16,C256:x" and "N16,H2,C256:k|v" -> "N16,C256:x", "N16,C256:k|v"
    (where a head sits among the tokens is the plan's business: ``KVRegions.head_runs``)."""
    return _HEAD_AXIS.sub("", layout).replace(",:", ":").replace("/:", ":")


def default_cp_size(num_kv_heads: int, tp_size: int) -> tuple[int, str]:
    """The layer-split size a prefill gets when ``cp_size`` is not set, and why: the TP ranks
    holding each KV head (``head_replicas``) split its layers. Every rank holds the whole KV
    (MQA, MLA, or fewer heads than TP ranks): layer split over them; KV heads sharded over
    TP: none (each rank sends every layer of its heads)."""
    replicas = head_replicas(num_kv_heads, tp_size)
    if tp_size == 1:
        return 1, "tensor_parallel_size=1: one rank sends every layer"
    if replicas == 1:
        return 1, (f"{num_kv_heads} KV heads sharded over tensor_parallel_size={tp_size}: each rank sends every "
                   f"layer of its {num_kv_heads // tp_size} head(s), no layer split")
    if num_kv_heads == 1:
        return replicas, f"every TP rank holds the whole KV (one KV head): layer split over {replicas} rank(s)"
    return replicas, (f"{num_kv_heads} KV heads over tensor_parallel_size={tp_size}: each head on {replicas} "
                      f"ranks, which split its layers")
