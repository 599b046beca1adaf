"""Every KV page layout vLLM 0.32 allocates, CPU and GPU, built on CPU with vLLM's own allocator.

vLLM 0.32 gives every attention backend a ``[B, H, N, C]`` view per layer in one
of the six ``KVCacheLayout``\\ s (``reshard/page_format.py``); a GPU backend
differs from a CPU one only in which layouts it accepts, its block sizes and what
it packs into ``C``. So the tensors here come from the GPU model runner's own code
(``vllm_compat/kv_alloc.py``: ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``) on a CPU device:
exact shape, strides, dtype and kernel-block split, just not on a GPU.

Backends whose class does not import on this CPU build (their layouts then come
from the enum; every layout is tested anyway):
  FLASHINFER, FLASHINFER_MLA: need the ``flashinfer`` package (CUDA only);
  CUTLASS_MLA: asserts CUDA at import (``torch.cuda`` capability query);
  FLASH_ATTN_MLA: imports ``flash_attn_varlen_func`` from ``vllm_flash_attn``, absent on CPU.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from vllm_dcp2d.config import ConfigError  # noqa: E402
from vllm_dcp2d.transfer.messages import FingerprintMismatch  # noqa: E402
from vllm_dcp2d.vllm_compat import connector_api as compat  # noqa: E402
from vllm_dcp2d.reshard import page_format  # noqa: E402
from tests.support.kv_layouts import allocate, fingerprint, stream, transfer_exact  # noqa: E402

LAYOUTS = list(KVCacheLayout)
NO_IMPORT = {"FLASHINFER": "needs the flashinfer package", "FLASHINFER_MLA": "needs the flashinfer package",
             "CUTLASS_MLA": "asserts CUDA at import", "FLASH_ATTN_MLA": "needs vllm_flash_attn"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.sampled_from(LAYOUTS), dst=st.sampled_from(LAYOUTS), mla=st.booleans(), heads=st.integers(1, 3),
       head=st.sampled_from([8, 16, 24]), block=st.sampled_from([16, 32]), split=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), layers=st.integers(1, 4),
       src_blocks=st.integers(3, 9), dst_blocks=st.integers(2, 7), cp=st.integers(1, 2), dcp=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_page_format_agrees_iff_bytes_do_and_transfers_are_exact(src, dst, mla, heads, head, block, split, dtype,
                                                                  layers, src_blocks, dst_blocks, cp, dcp, seed):
    """For any two layouts (kernel-block split on decode too): equal page formats
    <=> the same regions per page whose bytes are in the same logical order; and
    then every (CP rank, DCP rank) path moves exactly its pages, other memory untouched."""
    heads = 1 if mla else heads
    kernel = block // split if split > 1 else None
    try:
        d_kv = [allocate(dst, mla, layers, dst_blocks, block, heads, head, dtype, kernel) for _ in range(dcp)]
    except (ValueError, RuntimeError) as e:  # vLLM cannot split pages that are not dense runs one after another
        assert "dense, unpadded pages" in str(e) or "out of bounds" in str(e)
        d_kv = [allocate(dst, mla, layers, dst_blocks, block, heads, head, dtype) for _ in range(dcp)]
    s_kv = [allocate(src, mla, layers, src_blocks, block, heads, head, dtype) for _ in range(cp)]
    runs = [compat.kv_regions(kv[0], n)[0].page_bytes.tolist() for kv, n in ((s_kv, src_blocks), (d_kv, dst_blocks))]
    same = runs[0] == runs[1] and np.array_equal(stream(s_kv[0], src_blocks), stream(d_kv[0], dst_blocks))
    fmt = (compat.page_layout(next(iter(s_kv[0].values())), src_blocks),
           compat.page_layout(next(iter(d_kv[0].values())), dst_blocks))
    assert (fmt[0] == fmt[1]) == same, (src.name, dst.name, fmt)
    if same:
        fingerprint(s_kv[0], src_blocks, "k|v").check(fingerprint(d_kv[0], dst_blocks, "k|v"))
        transfer_exact(s_kv, src_blocks, d_kv, dst_blocks, layers, np.random.default_rng(seed))
    else:
        with pytest.raises(FingerprintMismatch, match="layout"):
            fingerprint(s_kv[0], src_blocks, "k|v").check(fingerprint(d_kv[0], dst_blocks, "k|v"))


def _backend(name: str):
    try:
        return AttentionBackendEnum[name].get_class()
    except Exception as e:  # noqa: BLE001 - the reason is the point
        assert name in NO_IMPORT, f"{name} failed to import: {e!r}"
        return None


def _shape(name: str):
    """(backend class or None, mla, layouts, block, heads, head) that ``name`` accepts."""
    cls = _backend(name)
    mla = name in page_format.MLA_BACKENDS
    layouts = (cls.supported_kv_cache_layouts() if cls else None) or LAYOUTS
    block = {"FLASHMLA": 64, "CUTLASS_MLA": 128, "FLASHINFER_MLA": 32}.get(name, 16)
    if cls is not None:
        sizes = cls.get_supported_kernel_block_sizes()
        assert any(block == s if isinstance(s, int) else block % s.base == 0 for s in sizes), (name, sizes)
    return (cls, mla, layouts, block) + ((1, 576) if mla else (2, 64))


@pytest.mark.parametrize("name", page_format.MHA_BACKENDS + page_format.MLA_BACKENDS)
def test_every_backend_layout_pairs_with_itself_and_with_cpu(name):
    """Each supported backend, in each layout it accepts, at a block size and head
    size it accepts: prefill and decode on that layout move pages byte-exactly; the
    CPU prefill (CPU_ATTN, CPU_MLA on LBHNC at their block sizes) agrees exactly where
    the page format and content agree, and is refused with the layout named otherwise."""
    cls, mla, layouts, block, heads, head = _shape(name)
    rng = np.random.default_rng(0)
    cpu = allocate(KVCacheLayout.LBHNC, mla, 2, 4, 16 if mla else 32, heads, head, torch.bfloat16)
    cpu_content = "kv_c|k_pe" if mla else "CPU_ATTN:isa=x"
    for layout in layouts:
        src = allocate(layout, mla, 2, 5, block, heads, head, torch.bfloat16)
        dst = [allocate(layout, mla, 2, 3, block, heads, head, torch.bfloat16) for _ in range(2)]
        transfer_exact([src], 5, dst, 3, 2, rng)
        content = page_format.kv_content(name, next(iter(src.values())), "auto")
        gpu = fingerprint(dst[0], 3, content, block)
        host = fingerprint(cpu, 4, cpu_content, 16 if mla else 32)
        if mla and block == 16:  # one head: every layout stores a page as the same run of rows
            assert host.layout == gpu.layout == "N16,C1152:kv_c|k_pe"
            host.check(gpu)
        else:
            with pytest.raises(FingerprintMismatch):
                host.check(gpu)


@pytest.mark.parametrize("name", page_format.MHA_BACKENDS + page_format.MLA_BACKENDS)
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_pages_move_byte_for_byte_on_the_backends_that_write_them(name, cache_dtype):
    """An fp8 cache (a uint8 tensor, one byte per element) in each layout the backend
    accepts moves byte-exactly. Which backends take which encoding is vLLM's own list
    (``supported_kv_cache_dtypes``); the others are refused naming the ones that do.
    An fp8 instance and an unquantized one of the same layout fail the fingerprint,
    naming both dtypes; so do e4m3 and e5m2 (the same bytes, other values)."""
    cls, mla, layouts, block, heads, head = _shape(name)
    encoding = page_format.kv_dtype_name(cache_dtype, torch.uint8)
    moved = name in page_format.FP8_BACKENDS[encoding]
    if cls is not None:
        assert (cache_dtype in cls.supported_kv_cache_dtypes) == moved, (name, cls.supported_kv_cache_dtypes)
    bf16 = allocate(layouts[0], mla, 2, 3, block, heads, head, torch.bfloat16)
    plain = page_format.kv_content(name, next(iter(bf16.values())), "auto")
    if not moved:
        with pytest.raises(ConfigError, match=f"{name} is not one of them"):
            page_format.kv_content(name, next(iter(bf16.values())), cache_dtype)
        return
    rng = np.random.default_rng(2)
    for layout in layouts:
        src = [allocate(layout, mla, 2, 5, block, heads, head, torch.uint8) for _ in range(2)]
        dst = [allocate(layout, mla, 2, 3, block, heads, head, torch.uint8) for _ in range(2)]
        transfer_exact(src, 5, dst, 3, 2, rng)
        content = page_format.kv_content(name, next(iter(src[0].values())), cache_dtype)
        assert content == plain
        fp8 = fingerprint(dst[0], 3, content, block, cache_dtype)
        fp8.check(fingerprint(src[0], 5, content, block, cache_dtype))
        assert fp8.page_bytes * 2 == fingerprint(bf16, 3, plain, block).page_bytes
    with pytest.raises(FingerprintMismatch, match=f"kv_dtype: ours '{encoding}', peer 'bfloat16'"):
        fp8.check(fingerprint(bf16, 3, plain, block))
    other = "fp8_e5m2" if encoding == "fp8_e4m3" else "fp8"
    with pytest.raises(FingerprintMismatch, match=f"kv_dtype: ours '{encoding}', peer 'fp8_e"):
        fp8.check(fingerprint(dst[0], 3, content, block, other))


def test_mla_cpu_prefill_to_gpu_decode_is_exact():
    """CPU_MLA prefill (LBHNC, block 16) into TRITON_MLA decode in its preferred
    layout (LBNHC for MHA-free MLA pages it is the same bytes) at DCP=2."""
    rng = np.random.default_rng(1)
    src = [allocate(KVCacheLayout.LBHNC, True, 3, 6, 16, 1, 576, torch.bfloat16) for _ in range(2)]
    dst = [allocate(KVCacheLayout.LBNHC, True, 3, 4, 16, 1, 576, torch.bfloat16) for _ in range(2)]
    assert (compat.page_layout(src[0]["model.layers.0.self_attn.attn"], 6)
            == compat.page_layout(dst[0]["model.layers.0.self_attn.attn"], 4) == "N16,C1152")
    transfer_exact(src, 6, dst, 4, 3, rng)


def test_block_count_is_not_part_of_the_fingerprint():
    """Instances with different memory (num_blocks) agree; another layout disagrees, naming both."""
    a = allocate(KVCacheLayout.LBNHC, False, 2, 7, 16, 2, 8, torch.bfloat16)
    b = allocate(KVCacheLayout.LBNHC, False, 2, 3, 16, 2, 8, torch.bfloat16)
    c = allocate(KVCacheLayout.LHBNC, False, 2, 3, 16, 2, 8, torch.bfloat16)
    fingerprint(a, 7, "k|v").check(fingerprint(b, 3, "k|v"))
    with pytest.raises(FingerprintMismatch, match=r"layout: ours 'N16,H2,C32:k\|v', peer 'H2/N16,C32:k\|v'; "
                                                  r"start both instances with the same VLLM_KV_CACHE_LAYOUT"):
        fingerprint(a, 7, "k|v").check(fingerprint(c, 3, "k|v"))
    with pytest.raises(FingerprintMismatch, match="layout"):
        fingerprint(a, 7, "k|v").check(fingerprint(b, 3, "kv_c|k_pe"))


def test_unsupported_backends_and_layouts_stop_start_up():
    t = allocate(KVCacheLayout.LBHNC, False, 1, 2, 16, 2, 8, torch.bfloat16)["model.layers.0.self_attn.attn"]
    for name in ("FLASHMLA_SPARSE_DSV4", "TURBOQUANT", "ROCM_ATTN", "FLASH_ATTN_DIFFKV"):
        with pytest.raises(ConfigError, match=f"does not support the {name} attention backend"):
            page_format.kv_content(name, t, "auto")
    for dtype in ("nvfp4", "fp8_per_token_head", "int8", "nvfp4_ds_mla"):
        with pytest.raises(ConfigError,
                           match=f"fp8_e5m2; fp8_ds_mla on FLASHMLA_SPARSE\\); got kv_cache_dtype='{dtype}'"):
            page_format.kv_content("FLASH_ATTN", t, dtype)
    with pytest.raises(ConfigError, match="'fp8_ds_mla' is written by FLASHMLA_SPARSE only; FLASH_ATTN is not"):
        page_format.kv_content("FLASH_ATTN", t, "fp8_ds_mla")
    with pytest.raises(ConfigError, match="FLASHMLA_SPARSE caches unquantized or as fp8_ds_mla.*'nvfp4_ds_mla'"):
        page_format.kv_content("FLASHMLA_SPARSE", t, "nvfp4_ds_mla")
    with pytest.raises(ConfigError, match="fp8_e5m2.*FLASH_ATTN is not one of them"):
        page_format.kv_content("FLASH_ATTN", t, "fp8_e5m2")
    with pytest.raises(ValueError, match=r"layers.0.attn has shape \(2, 6, 16, 2, 8\)"):  # pre-0.32 [2, blocks, ...]
        compat.kv_regions({"model.layers.0.attn": torch.zeros(2, 6, 16, 2, 8)}, 6)
    with pytest.raises(ValueError, match="expected vLLM 0.32's \\[num_blocks=5"):
        compat.kv_regions({"model.layers.0.attn": t}, 5)
    overlap = torch.zeros(64).as_strided((2, 2, 4, 8), (8, 8, 8, 1))
    with pytest.raises(ValueError, match="overlaps"):
        compat.kv_regions({"model.layers.0.attn": overlap}, 2)


def test_worker_start_up_names_an_unsupported_backend():
    """The worker's fingerprint asks the layer's own backend (as register_kv_caches does)."""
    t = allocate(KVCacheLayout.LBNHC, False, 1, 2, 16, 2, 8, torch.bfloat16)["model.layers.0.self_attn.attn"]

    def config(backend: str) -> NS:
        layer = NS(get_attn_backend=lambda: NS(get_name=lambda: backend))
        return NS(compilation_config=NS(static_forward_context={"model.layers.0.self_attn.attn": layer}),
                  cache_config=NS(cache_dtype="auto"))

    assert compat.kv_element_order(config("FLASH_ATTN"), "model.layers.0.self_attn.attn", t) == "k|v"
    with pytest.raises(ConfigError, match="does not support the TURBOQUANT attention backend"):
        compat.kv_element_order(config("TURBOQUANT"), "model.layers.0.self_attn.attn", t)
