"""KV caches as vLLM's allocator lays them out, for the layout tests: allocate one, read its
pages back in logical order, fingerprint it, and move it byte for byte between two layouts
through the plugin's plan (``vllm_compat/kv_alloc.py`` holds the allocation itself)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_dcp2d.reshard import page_format
from vllm_dcp2d.reshard.layout import cp_layer_range
from vllm_dcp2d.reshard.plan import plan_request
from vllm_dcp2d.transfer.messages import Fingerprint
from vllm_dcp2d.vllm_compat import connector_api as compat
from vllm_dcp2d.vllm_compat.kv_alloc import allocate_kv, logical_pages

def allocate(layout: KVCacheLayout, mla: bool, layers: int, blocks: int, block: int, heads: int, head: int,
             dtype: torch.dtype, kernel_block: int | None = None) -> dict[str, torch.Tensor]:
    return allocate_kv(layout, mla, layers, blocks, block, heads, head, dtype, "cpu", kernel_block)


def pages(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[blocks, ...]``: one logical page per block (kernel blocks regrouped)."""
    return t.unflatten(0, (blocks, -1)) if t.shape[0] != blocks else t


def stream(kv: dict[str, torch.Tensor], blocks: int) -> np.ndarray:
    """The int32 words of block 0 of the first layer in region order, after writing
    there the index of each word in the logical page ``[H, tokens, C]``: the page as
    a byte copy sees it."""
    t = next(iter(kv.values()))
    page = pages(t.view(torch.int32), blocks)[0]  # [H, N, C] or, split, [k, H, N / k, C]
    heads, width = page.shape[-3], page.shape[-1]
    index = torch.arange(page.numel(), dtype=torch.int32).view(heads, -1, width)
    if page.ndim == 4:
        index = index.view(heads, page.shape[0], -1, width).transpose(0, 1)
    page.copy_(index)
    reg, _ = compat.kv_regions(kv, blocks)
    words = [np.ctypeslib.as_array((ctypes.c_int32 * (int(n) // 4)).from_address(int(b)))
             for b, n in zip(reg.base[0], reg.page_bytes)]
    return np.concatenate(words).copy()


def fingerprint(kv: dict[str, torch.Tensor], blocks: int, content: str, block: int = 16,
                cache_dtype: str = "auto") -> Fingerprint:
    """The fields of the worker's fingerprint that depend on the KV memory."""
    t = next(iter(kv.values()))
    reg, _ = compat.kv_regions(kv, blocks)
    return Fingerprint(model="m", num_layers=len(kv), page_size=block,
                       kv_dtype=page_format.kv_dtype_name(cache_dtype, t.dtype),
                       page_bytes=int(reg.page_bytes.sum()), layout=f"{compat.page_layout(t, blocks)}:{content}",
                       model_config="c")


def transfer_exact(src_kv: list[dict], src_blocks: int, dst_kv: list[dict], dst_blocks: int, num_layers: int,
                   rng: np.random.Generator) -> None:
    """Plan one request from every prefill CP rank to every decode DCP rank, copy the
    bytes the descriptors name (memmove stands in for Mooncake's write) and check
    that each decode rank holds exactly its pages, nothing else touched."""
    for kv in src_kv:
        for t in kv.values():
            t.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, t.view(torch.uint8).shape,
                                                                    dtype=np.uint8)))
    dcp = len(dst_kv)
    num_pages = int(rng.integers(1, min(src_blocks, dst_blocks * dcp) + 1))
    src_ids = rng.permutation(src_blocks)[:num_pages]
    dst_ids = rng.permutation(dst_blocks)[:-(-num_pages // dcp)]
    plans = plan_request(num_layers, len(src_kv), [compat.kv_regions(kv, src_blocks)[0] for kv in src_kv], src_ids,
                         [compat.kv_regions(kv, dst_blocks)[0] for kv in dst_kv], dst_ids)
    expect = [{n: logical_pages(t, dst_blocks).clone() for n, t in kv.items()} for kv in dst_kv]
    for (r, d), desc in plans.items():
        for s, t, n in zip(desc.src, desc.dst, desc.length):
            ctypes.memmove(int(t), int(s), int(n))
        layers = cp_layer_range(num_layers, len(src_kv), r)
        for name in (n for n in dst_kv[0] if compat.layer_index(n) in layers):  # every cache of those layers
            for i in range(d, num_pages, dcp):
                expect[d][name][dst_ids[i // dcp]] = logical_pages(src_kv[r][name], src_blocks)[src_ids[i]]
    for d, kv in enumerate(dst_kv):
        for name, t in kv.items():
            assert torch.equal(logical_pages(t, dst_blocks), expect[d][name]), (d, name)
