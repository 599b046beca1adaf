"""Byte layout of vLLM 0.32's paged KV: regions to move and the page format both sides must share.

vLLM 0.32 hands every attention backend, CPU and GPU alike, one view per layer
of logical shape ``[B, H, N, C]`` (blocks, KV heads, tokens, content), made by
``vllm.v1.worker.utils.allocate_kv_cache``. Its physical order is one of the six
``KVCacheLayout``\\ s, chosen once per instance by the engine core from what its
backends accept (``supported_kv_cache_layouts``) or ``VLLM_KV_CACHE_LAYOUT``:
``LBHNC``, ``LBNHC`` (page = one dense run), ``BLHNC``, ``BLNHC`` (the same runs,
the blocks of all layers interleaved), ``LHBNC``, ``BHLNC`` (a page is one run
per head). A backend whose kernel block is smaller than the block adds a split
of the block axis (``[B * k, H, N / k, C]``). Backends then differ only in what
they pack into ``C``:

* GPU attention (FLASH_ATTN, TRITON_ATTN, FLASHINFER, FLEX_ATTENTION): per (head,
  token) the K vector then the V vector (``kv_cache.transpose(1, 2).split(D, -1)``);
* MLA (CPU_MLA, TRITON_MLA, FLASHMLA, FLASH_ATTN_MLA, CUTLASS_MLA, FLASHINFER_MLA):
  one head, per token the latent ``kv_c`` then ``k_pe`` (576 values for DeepSeek);
* CPU_ATTN: per (page, head) all K then all V, packed per ISA
  (``vllm_compat.attention.cpu_kv_layout``), so it pairs with CPU_ATTN only;
* sparse MLA (FLASHMLA_SPARSE, DeepSeek-V3.2 and GLM-5.x): the MLA row, or as
  ``fp8_ds_mla`` 656 B per token with its scales inside; beside it in every
  layer the indexer's key cache (DEEPSEEK_V32_INDEXER: 128 fp8 values and a
  float32 scale per token, 132 B). vLLM puts both in one KV cache group with two
  page sizes; here they are two planes of one KV layer, each with its format. A
  layer that reuses an earlier layer's top-k (vLLM's ``indexer_types`` "shared",
  ``index_topk_freq``) has the latent plane only.

Two instances exchange pages byte for byte iff their :func:`page_format` strings
are equal. An fp8 KV cache (``fp8``/``fp8_e4m3``, ``fp8_e5m2``) has the same
format with one byte per element and one scale per layer and K/V held outside
the page, so both sides must also agree on the fp8 encoding (:func:`kv_dtype_name`)
and the scales (the fingerprint's ``kv_scales``). Other backends and caches (``nvfp4_ds_mla``,
per-token-head or NVFP4 scales, ``DIFFKV``, ROCm) are refused at start-up:
nothing here checks them.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import torch

from vllm_dcp2d.config import ConfigError
from vllm_dcp2d.reshard.regions import KVRegions

__all__ = ["kv_regions", "page_format", "kv_content", "kv_dtype_name", "order_digest", "plane_key", "layer_planes",
           "plane_kind", "plane_kinds", "planes_digest",
           "FP8_DTYPES", "FP8_BACKENDS", "MHA_BACKENDS", "MLA_BACKENDS", "SPARSE_MLA_BACKENDS", "INDEXER_BACKENDS"]

MHA_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION")
MLA_BACKENDS = ("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "FLASHINFER_MLA")
_OWN_FORMAT = ("CPU_ATTN", "AMX_MLA", "unknown")  # pages readable by the same backend only
# Sparse MLA (DSA: DeepSeek-V3.2, GLM-5.x): the latent cache of FLASHMLA_SPARSE, and the
# lightning indexer's key cache beside it in every layer (vLLM's DeepseekV32IndexerCache).
SPARSE_MLA_BACKENDS = ("FLASHMLA_SPARSE",)
INDEXER_BACKENDS = ("DEEPSEEK_V32_INDEXER",)
_LAYER_NUMBER = re.compile(r"(^|\.)\d+(\.|$)")
# vLLM's per-tensor-scaled fp8 caches: a uint8 tensor holding one of these encodings ("fp8" is
# e4m3: vLLM's MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP). The page stores x / scale.
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP8_ALIASES = {"fp8": "fp8_e4m3"}
# Backends whose fp8 page is the unquantized format at one byte per element (vLLM 0.32's supported_kv_cache_dtypes).
FP8_BACKENDS = {"fp8_e4m3": MHA_BACKENDS[:3] + ("CPU_ATTN", "TRITON_MLA", "FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA"),
                "fp8_e5m2": ("TRITON_ATTN", "FLASHINFER", "CPU_ATTN")}


def _page_dims(t: torch.Tensor, num_blocks: int, name: str) -> tuple[int, list[tuple[str, int, int]]]:
    """(block stride, [(axis, size, stride)] of one page in physical order, outermost
    first), all in bytes; size-1 axes left out, a kernel-block split merged into the
    token axis where it is just a longer run of tokens."""
    if t.ndim != 4 or t.shape[0] % num_blocks or t.stride(-1) != 1:
        raise ValueError(f"KV cache of {name} has shape {tuple(t.shape)} and strides {t.stride()}; expected vLLM "
                         f"0.32's [num_blocks={num_blocks} (or a multiple: kernel blocks), heads, tokens, content] "
                         f"view with a dense content axis")
    item = t.element_size()
    split = t.shape[0] // num_blocks
    dims = [("k", split, t.stride(0) * item)] if split > 1 else []
    dims += [("H", t.shape[1], t.stride(1) * item), ("N", t.shape[2], t.stride(2) * item),
             ("C", t.shape[3] * item, 1)]
    dims = sorted((d for d in dims if d[1] > 1), key=lambda d: -d[2])
    merged: list[tuple[str, int, int]] = []
    for d in dims:
        if merged and merged[-1][0] == "k" and d[0] == "N" and merged[-1][2] == d[1] * d[2]:
            merged[-1] = ("N", merged[-1][1] * d[1], d[2])
        else:
            merged.append(d)
    return t.stride(0) * item * split, merged


def _split_runs(dims: list[tuple[str, int, int]], name: str) -> tuple[int, list[tuple[str, int, int]]]:
    """(bytes of the innermost dense run, the axes outside it) of a page; raises if
    two elements of a page share a byte."""
    run, inner = 1, len(dims)
    while inner > 0 and dims[inner - 1][2] == run:
        inner -= 1
        run *= dims[inner][1]
    extent = run
    for axis, size, stride in reversed(dims[:inner]):
        if stride < extent:
            raise ValueError(f"KV cache of {name}: axis {axis} (stride {stride} B) overlaps the {extent} B inside "
                             f"it; not a layout vLLM allocates")
        extent = stride * size
    return run, dims[:inner]


def _head_geometry(run_dims: list[tuple[str, int, int]]) -> tuple[int, int]:
    """(heads, runs per head) of a page's dense run (``KVRegions.head_count/head_runs``):
    the head axis's size, and how many runs the axes outside it (tokens in NHD, none
    in HND and vLLM's CPU page) cut each head into; (1, 1) where the run holds one head
    (the page has one, or each head is its own region: ``LHBNC``/``BHLNC``)."""
    names = [d[0] for d in run_dims]
    if "H" not in names:
        return 1, 1
    at = names.index("H")
    return run_dims[at][1], int(np.prod([d[1] for d in run_dims[:at]], dtype=np.int64))


def page_format(t: torch.Tensor, num_blocks: int, name: str = "KV cache") -> str:
    """The physical page format of KV view ``t``, without the block count or device:
    the axes that split a page into runs, then the dense run, outermost first, sizes
    in elements (content in bytes): "H8/N16,C512" (``LHBNC``, 8 heads), "N16,H8,C512"
    (``LBNHC``), "N64,C1152" (MLA, one head)."""
    _, dims = _page_dims(t, num_blocks, name)
    _, outer = _split_runs(dims, name)
    names = [",".join(f"{a}{s}" for a, s, _ in part) for part in (outer, dims[len(outer):])]
    return "/".join(n for n in names if n)


def plane_key(name: str) -> str:
    """A cache's place within its layer: the name without the layer number
    ("model.layers.*.self_attn.indexer.k_cache"). A layer's caches are its planes in this
    order, on both sides of a transfer."""
    return _LAYER_NUMBER.sub(r"\1*\2", name, count=1)


def plane_kind(name: str) -> str:
    """What a cache is within its layer, whoever's layer it is: the name after the layer
    number ("self_attn.indexer.k_cache"; a draft model's ``draft_model.model.layers.0.
    self_attn.attn`` is the same kind as the target's ``model.layers.0.self_attn.attn``)."""
    m = _LAYER_NUMBER.search(name)
    return name[m.end():] if m else name


def layer_planes(kv_caches: dict, layer_ids: dict[str, int] | None, layer_index) -> dict[int, list[str]]:
    """KV layer id -> the names of its caches (planes), in :func:`plane_key` order."""
    planes: dict[int, list[str]] = {}
    for name in kv_caches:
        planes.setdefault(layer_ids[name] if layer_ids else layer_index(name), []).append(name)
    return {lid: sorted(names, key=plane_key) for lid, names in planes.items()}


def plane_kinds(planes: dict[int, list[str]]) -> list[str]:
    """Every :func:`plane_kind` any layer of ``planes`` (``layer_planes``) holds, in the
    order a layer's planes take (sparse MLA: "self_attn.attn", then "self_attn.indexer.k_cache")."""
    return sorted({plane_kind(n) for names in planes.values() for n in names})


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int, layer_ids: dict[str, int] | None = None,
               groups: dict[str, int] | None = None, sharded: list[bool] | None = None,
               layer_index=None) -> tuple[KVRegions, list[tuple[int, int]]]:
    """The ``KVRegions`` of a worker's paged KV, and the memory ranges to register.

    kv_caches:  layer name -> vLLM 0.32 KV view ``[num_blocks (* kernel blocks per
                block), H, N, C]`` in any ``KVCacheLayout``. Each dense run of a page
                is one region: one per layer in the layer- or block-outer layouts,
                one per head in ``LHBNC`` / ``BHLNC``. Caches with the same KV layer
                id are that layer's planes (sparse MLA: the latent cache and the
                indexer's key cache of one layer), each with its own page format;
                their regions follow one another in :func:`plane_kind` order. Layers
                may hold different planes (a DSA layer without an indexer): the regions
                are those of every kind of plane, and ``region_mask`` marks the ones a
                layer has (where it has none, ``base`` repeats another layer's, so every
                base lies in registered memory).
    num_blocks: blocks per layer (``kv_cache_config.num_blocks``).
    layer_ids:  layer name -> KV layer id; default ``layer_index(name)``.
    groups, sharded: layer name -> KV cache group, and each group's sharding;
                default one sharded group. A layer's planes share one group.
    Returns (regions over KV layer ids, [(addr, nbytes)] of distinct storages).
    Raises ValueError where one kind of plane has different page formats in two layers.
    """
    planes = layer_planes(kv_caches, layer_ids, layer_index)
    kinds = plane_kinds(planes)
    fmt: dict[str, tuple] = {}  # kind -> its page (block stride, run, axes, runs, heads, runs per head)
    first: dict[str, np.ndarray] = {}  # kind -> bases of the first layer holding it
    layers, rows, mem, group_of = [], [], {}, []
    for lid, names in planes.items():
        row = {}
        for name in names:
            kind = plane_kind(name)
            if kind in row:
                raise ValueError(f"KV layer {lid} holds two caches of kind {kind!r}: {names}")
            t = kv_caches[name]
            block_stride, dims = _page_dims(t, num_blocks, name)
            run, outer = _split_runs(dims, name)
            offsets = np.zeros(1, dtype=np.int64)
            for _, size, stride in outer:  # outermost first: regions in address order
                offsets = (offsets[:, None] + stride * np.arange(size, dtype=np.int64)).reshape(-1)
            page = (block_stride, run, dims, offsets.size, *_head_geometry(dims[len(outer):]))
            if fmt.setdefault(kind, page) != page:
                raise ValueError(f"KV cache {name}: pages (block stride, run bytes, axes, runs) {page} differ from "
                                 f"other layers' {kind!r} caches {fmt[kind]}; DCP2DConnector needs one page format "
                                 f"per kind of cache")
            row[kind] = t.data_ptr() + offsets
            first.setdefault(kind, row[kind])
            storage = t.untyped_storage()
            mem[storage.data_ptr()] = storage.nbytes()
        owners = {groups.get(name, 0) if groups else 0 for name in names}
        if len(owners) != 1:
            raise ValueError(f"KV caches {names} of one layer are in different KV cache groups {sorted(owners)}")
        layers.append(lid)
        group_of.append(owners.pop())
        rows.append(row)
    if not layers:
        raise ValueError("register_kv_caches got no KV cache tensors")
    base = np.array([np.concatenate([row.get(k, first[k]) for k in kinds]) for row in rows])
    mask = np.array([np.concatenate([np.full(fmt[k][3], k in row) for k in kinds]) for row in rows])
    per = [fmt[k] for k in kinds]
    regions = KVRegions(np.array(layers), base, np.concatenate([np.full(f[3], f[0]) for f in per]),
                        np.concatenate([np.full(f[3], f[1]) for f in per]), np.array(group_of),
                        np.array(sharded if sharded else [True]), np.concatenate([np.full(f[3], f[4]) for f in per]),
                        np.concatenate([np.full(f[3], f[5]) for f in per]), None if mask.all() else mask)
    return regions, sorted(mem.items())


def planes_digest(kv_caches: dict, layer_ids: dict[str, int] | None, layer_index) -> str | None:
    """Which kinds of plane each layer holds, as "sha256:<12 hex>" over the KV layer ids in
    order, or None where every layer holds every kind (the fingerprint's ``layout`` then
    names the planes alone, as before layers could differ)."""
    planes = layer_planes(kv_caches, layer_ids, layer_index)
    kinds = plane_kinds(planes)
    held = np.array([[k in {plane_kind(n) for n in planes[lid]} for k in kinds] for lid in sorted(planes)])
    if held.all():
        return None
    return "sha256:" + hashlib.sha256(np.packbits(held).tobytes() + str(held.shape).encode()).hexdigest()[:12]


def kv_content(backend: str, t: torch.Tensor, cache_dtype: str, cpu_order=None) -> str:
    """What a backend packs into the content axis ``C`` of a page, as a name two
    instances must share; raises ``ConfigError`` naming a backend or KV dtype
    DCP2DConnector does not move.

    cpu_order: for CPU_ATTN, a callable returning its ISA and element-order digest.
    """

    if backend in SPARSE_MLA_BACKENDS:
        return _sparse_mla_content(backend, cache_dtype)
    if backend in INDEXER_BACKENDS:  # its own fp8 keys and scales, whatever --kv-cache-dtype says
        return "idx_k:fp8|scale:f32"
    name = kv_dtype_name(cache_dtype, t.dtype)
    if name == "fp8_ds_mla":
        raise ConfigError(f"kv_cache_dtype='fp8_ds_mla' is written by {', '.join(SPARSE_MLA_BACKENDS)} only; "
                          f"{backend} is not one of them")
    if name in FP8_BACKENDS and backend not in FP8_BACKENDS[name] + ("unknown",):
        raise ConfigError(f"DCP2DConnector moves an fp8 KV cache ({cache_dtype}) of the backends "
                          f"{', '.join(FP8_BACKENDS[name])}; {backend} is not one of them")
    if backend in MHA_BACKENDS:
        return "k|v"
    if backend in MLA_BACKENDS:
        return "kv_c|k_pe"
    if backend == "CPU_ATTN" and cpu_order is not None:
        return cpu_order()
    if backend in _OWN_FORMAT:
        return backend
    raise ConfigError(f"DCP2DConnector does not support the {backend} attention backend: its KV page format is "
                      f"not verified (supported: "
                      f"{', '.join(MHA_BACKENDS + MLA_BACKENDS + SPARSE_MLA_BACKENDS + _OWN_FORMAT[:2])}). "
                      f"Pick one with --attention-backend.")


def _sparse_mla_content(backend: str, cache_dtype: str) -> str:
    """FLASHMLA_SPARSE's latent page content: unquantized, the dense MLA row; quantized
    (vLLM serves "fp8", "fp8_e4m3" and "fp8_ds_mla" all as fp8_ds_mla), 656 B per token:
    512 B fp8 ``kv_c``, its 4 float32 tile scales, 128 B bf16 ``k_pe``: the scales travel
    in the page."""

    if cache_dtype in ("auto", "bfloat16", "float16"):
        return "kv_c|k_pe"
    if cache_dtype in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        return "fp8_ds_mla:kv_c|scales|k_pe"
    raise ConfigError(f"DCP2DConnector moves {backend} caches unquantized or as fp8_ds_mla (--kv-cache-dtype auto, "
                      f"fp8, fp8_ds_mla); got kv_cache_dtype={cache_dtype!r}, whose page format it does not check")


def kv_dtype_name(cache_dtype: str, dtype: torch.dtype) -> str:
    """The KV cache element type two instances must share: the tensor's dtype for an
    unquantized cache ("bfloat16"), the fp8 encoding for an fp8 one ("fp8_e4m3",
    "fp8_e5m2"; vLLM's "fp8" is e4m3), "fp8_ds_mla" for sparse MLA's packed rows.
    Raises ``ConfigError`` for any other ``--kv-cache-dtype`` (its scales or format
    live outside the page)."""

    plain = str(dtype).removeprefix("torch.")
    if cache_dtype in ("auto", plain):
        return plain
    if cache_dtype == "fp8_ds_mla":  # sparse MLA's packed rows: their scales are in the page
        return cache_dtype
    name = _FP8_ALIASES.get(cache_dtype, cache_dtype)
    if name in FP8_DTYPES:
        return name
    raise ConfigError(f"DCP2DConnector moves unquantized KV or an fp8 KV cache with one scale per layer "
                      f"(--kv-cache-dtype auto, fp8, {', '.join(FP8_DTYPES)}; fp8_ds_mla on FLASHMLA_SPARSE); got "
                      f"kv_cache_dtype={cache_dtype!r}, whose scales or format live outside the page")


def order_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """12 hex digits naming a CPU_ATTN element permutation (``cpu_kv_layout``'s pair)."""
    return hashlib.sha256(k.numpy().tobytes() + v.numpy().tobytes()).hexdigest()[:12]
