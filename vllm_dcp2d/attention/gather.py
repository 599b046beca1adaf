"""Reading pages out of a paged KV cache, whatever its KV memory layout.

vLLM's CPU kernels store each (page, KV head) in an ISA-specific packed order
(``vllm_compat.attention.cpu_kv_layout`` reads it back from vLLM's own writer), so
a page's interior is described by a layout map ``[block_size, D]``: the flat
position of token ``t``'s element ``d`` (:func:`plain_layout` for row-major).
:func:`gather_pages` reads whole requests through it (the CPU backends' new
tokens, tests); :func:`page_reader` reads chunks of pages for :mod:`.paged`'s
attention into per-thread scratch buffers reused across chunks, steps and layers.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["plain_layout", "gather_pages", "page_reader"]


def plain_layout(block_size: int, head_size: int, device=None) -> torch.Tensor:
    """The KV memory layout of a row-major ``[block_size, head_size]`` page interior: ``[bs, D]`` int64,
    element ``(t, d)`` at flat position ``t * head_size + d``."""
    return torch.arange(block_size * head_size, device=device).view(block_size, head_size)


def gather_pages(cache: torch.Tensor, layout: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first ``length`` tokens of each request out of a paged cache.

    cache: ``[num_blocks, Hkv, S]``, the flat interior of each (page, KV head).
    layout: ``[block_size, D]`` int64, flat position in ``S`` of token ``t``'s
    element ``d`` (vLLM's CPU kernels pack pages per ISA, so this is not always
    row-major; see :func:`plain_layout`).
    block_table: ``[R, W]`` integer page ids; token ``j`` of request ``r`` is token
    ``j % block_size`` of page ``block_table[r, j // block_size]``.
    Returns ``[R, length, Hkv, D]`` in cache.dtype; entries past a request's own
    length hold whatever its block table points at and must be masked by the caller.
    """
    bs = layout.shape[0]
    pages = -(-length // bs)
    cols = torch.clamp(torch.arange(pages, device=cache.device), max=max(block_table.shape[1] - 1, 0))
    g = page_reader(layout, cache.shape[-1])(cache, block_table[:, cols].long(), "gather", cache.dtype)
    r, p, hkv, _, d = g.shape
    return g.transpose(2, 3).reshape(r, p * bs, hkv, d)[:, :length].clone()  # [R, P, bs, Hkv, D]


_WORKSPACE = threading.local()  # one set of buffers per thread: ranks may share a process (tests)


def _buffers() -> dict[tuple, torch.Tensor]:
    """This thread's scratch buffers by (key, dtype, device)."""
    return _WORKSPACE.__dict__.setdefault("bufs", {})


def _scratch(key: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer of ``shape`` reused across chunks, steps and layers (per thread and
    ``key``): a fresh multi-MB tensor per chunk costs more in page faults than the
    attention itself. Grows to the largest chunk seen; callers must not return it."""
    n = math.prod(shape)
    bufs = _buffers()
    buf = bufs.get((key, dtype, str(device)))
    if buf is None or buf.numel() < n:
        buf = bufs[(key, dtype, str(device))] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def page_reader(layout: torch.Tensor, size: int):
    """A function ``(cache [num_blocks, Hkv, S], ids [R, P], key, acc) -> [R, P, Hkv,
    bs, D]`` in ``acc``, a view of a scratch buffer: the pages are copied whole
    (one ``index_select``) and read in place when the interior is row-major with
    any row pitch (V pages, MLA latents) or column-major (vLLM's ``vec`` K pages);
    other packings (``amx``) are permuted element by element."""
    bs, d = layout.shape
    t = torch.arange(bs, device=layout.device)[:, None]
    dd = torch.arange(d, device=layout.device)[None, :]
    pitch = int(layout[1, 0] - layout[0, 0]) if bs > 1 else d
    if pitch >= d and bs * pitch <= size and torch.equal(layout, t * pitch + dd):
        used, view = bs * pitch, lambda x: x.unflatten(-1, (bs, pitch))[..., :d]
    elif d * bs <= size and torch.equal(layout, dd * bs + t):
        used, view = d * bs, lambda x: x.unflatten(-1, (d, bs)).transpose(-1, -2)
    else:
        flat = layout.reshape(-1)
        used, view = size, lambda x: x[..., flat].unflatten(-1, (bs, d))

    def read(cache: torch.Tensor, ids: torch.Tensor, key: str, acc: torch.dtype) -> torch.Tensor:
        r, p = ids.shape
        raw = _scratch(key, (r * p, cache.shape[1], used), cache.dtype, cache.device)
        torch.index_select(cache[..., :used], 0, ids.reshape(-1), out=raw)
        if raw.dtype != acc:
            raw = _scratch(key + "/acc", raw.shape, acc, cache.device).copy_(raw)
        return view(raw.view(r, p, *raw.shape[1:]))
    return read
