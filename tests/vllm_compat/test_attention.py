"""The vLLM adaptations: backend override, CP slot mapping, CPU page layout."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("vllm")

from tests.support.dcp_pages import dcp_local_slot, dcp_page_owner  # noqa: E402
from vllm_dcp2d.reshard.layout import cdiv  # noqa: E402
from vllm_dcp2d.vllm_compat import attention as compat  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered():
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # torch.ops._C, as every vLLM worker does
    from vllm_dcp2d.vllm_compat import registry

    registry.install_all()
    registry.install_all()  # idempotent
    assert registry.status()["cpu_attention_backends"] is None and registry.status()["cp_slot_mapping"] is None


def test_cpu_attn_is_overridden_by_a_subclass_of_the_stock_backend():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_dcp2d.vllm_compat.cpu_attn import DCPCPUAttentionBackend

    cls = AttentionBackendEnum.CPU_ATTN.get_class()
    assert cls is DCPCPUAttentionBackend and issubclass(cls, CPUAttentionBackend)
    assert cls.get_name() == "CPU_ATTN" and cls.supports_dcp()
    assert issubclass(cls.get_impl_cls(), CPUAttentionBackendImpl)
    assert cls.get_impl_cls().can_return_lse_for_decode


def _slot_reference(qsl, positions, table, bs, cp, rank, inter):
    """Token-by-token port of vLLM's Triton ComputeSlotMappingKernel."""
    out = []
    for r in range(len(qsl) - 1):
        for t in range(qsl[r], qsl[r + 1]):
            p = int(positions[t])
            vb, vo = divmod(p, bs * cp)
            if (vo // inter) % cp != rank:
                out.append(-1)
                continue
            out.append(int(table[r, vb]) * bs + (vo // (cp * inter)) * inter + vo % inter)
    return out


@settings(max_examples=25, deadline=None)
@given(cp=st.integers(1, 4), bs=st.sampled_from([4, 16, 32]), inter_div=st.sampled_from([1, 2, 4]),
       lens=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 20)), min_size=1, max_size=4),
       seed=st.integers(0, 99))
def test_cp_slot_mapping_matches_the_triton_kernel_math(cp, bs, inter_div, lens, seed):
    rng = np.random.default_rng(seed)
    inter = bs // inter_div
    qlens = [n for _, n in lens]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    positions = torch.tensor(np.concatenate([np.arange(s, s + n) for s, n in lens]), dtype=torch.int64)
    # Table sized from the draw, like vLLM's [max_num_reqs, max_blocks] table: more rows
    # than requests and more columns than the longest request needs (cp=1 is the worst case).
    rows, stride = len(lens) + 2, max(cdiv(s + n, bs) for s, n in lens) + 2
    table = torch.tensor(rng.permutation(max(1000, rows * stride))[: rows * stride].reshape(rows, stride),
                         dtype=torch.int32)
    for rank in range(cp):
        slots = torch.full((positions.numel() + 5,), 7, dtype=torch.int64)
        compat.cp_slot_mapping(positions.numel(), slots.numel(), qsl, positions, table, stride, slots,
                               bs, cp, rank, inter, -1)
        ref = _slot_reference(qsl.tolist(), positions, table, bs, cp, rank, inter)
        assert slots[: len(ref)].tolist() == ref
        if cp > 1:  # vLLM's CP=1 CPU op leaves the tail alone; the Triton kernel pads it
            assert (slots[len(ref):] == -1).all()
        if inter == bs and cp > 1:
            # Page granularity: the design's page p -> rank p % N, local slot p // N.
            page = positions // bs
            mine = dcp_page_owner(page.numpy(), cp) == rank
            assert ((slots[: len(ref)] >= 0).numpy() == mine).all()
            req = torch.searchsorted(qsl[1:].long(), torch.arange(len(ref)), right=True)
            want = table[req, dcp_local_slot(page.numpy(), cp)].long() * bs + positions % bs
            assert torch.equal(slots[: len(ref)][mine], want[mine])


def test_cp_slot_mapping_without_cp_delegates_to_vllm():
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    positions = torch.tensor([30, 31, 32])
    table = torch.tensor([[5, 9, 0, 0]], dtype=torch.int32)
    slots = torch.zeros(4, dtype=torch.int64)
    compat.cp_slot_mapping(3, 4, qsl, positions, table, 4, slots, 32)
    assert slots[:3].tolist() == [5 * 32 + 30, 5 * 32 + 31, 9 * 32]


FP8_HOST = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
FP8 = pytest.mark.skipif(not FP8_HOST, reason="vLLM's CPU fp8 KV writer needs x86 with AVX-512 or AMX")
CACHE_DTYPES = ["auto", pytest.param("fp8", marks=FP8), pytest.param("fp8_e5m2", marks=FP8)]


@pytest.mark.parametrize("dtype,block_size,head_size,cache_dtype", [
    (torch.float32, 32, 32, "auto"), (torch.bfloat16, 32, 32, "auto"), (torch.bfloat16, 32, 80, "auto"),
    (torch.float16, 16, 64, "auto"), pytest.param(torch.float32, 32, 64, "fp8", marks=FP8),
    pytest.param(torch.bfloat16, 32, 32, "fp8_e5m2", marks=FP8),
])
def test_cpu_kv_layout_reads_back_what_vllm_wrote(dtype, block_size, head_size, cache_dtype):
    """Byte for byte: an fp8 cache gets values fp8 holds exactly (the writer's
    truncation then changes nothing), so a misplaced element cannot go unseen."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_dcp2d.attention.gather import gather_pages
    from vllm_dcp2d.reshard.page_format import FP8_DTYPES, kv_dtype_name

    fp8 = FP8_DTYPES.get(kv_dtype_name(cache_dtype, dtype))
    isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    k_layout, v_layout = compat.cpu_kv_layout(isa, dtype, block_size, head_size, cache_dtype)
    nb, hkv, n = 5, 2, 2 * block_size + 7
    kv = torch.zeros(nb, hkv, block_size, 2 * head_size, dtype=torch.uint8 if fp8 else dtype)
    kc, vc = kv.view(nb, hkv, 2 * block_size, head_size).chunk(2, dim=2)
    k = torch.randn(n, hkv, head_size).to(fp8 or dtype).to(dtype)
    v = torch.randn(n, hkv, head_size).to(fp8 or dtype).to(dtype)
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    slots = (table[0, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, kv_cache_dtype=cache_dtype)
    pages = (kv.view(fp8) if fp8 else kv).view(nb, hkv, -1)
    if fp8:  # the attention over these pages: test_dcp_forward_equals_attention_over_what_vllm_wrote
        half = block_size * head_size
        assert torch.equal(gather_pages(pages[..., :half], k_layout, table, n)[0].to(dtype), k)
        assert torch.equal(gather_pages(pages[..., half:], v_layout, table, n)[0].to(dtype), v)
        return
    half = block_size * head_size
    assert torch.equal(gather_pages(pages[..., :half], k_layout, table, n)[0], k)
    assert torch.equal(gather_pages(pages[..., half:], v_layout, table, n)[0], v)
    # The DCP attention reads the same pages in place (column-major K pages of the
    # vec ISAs, packed amx pages), one page per online-softmax step, GQA group 3.
    from vllm_dcp2d.attention.paged import paged_attention_lse

    q = torch.randn(2, 3 * hkv, head_size).to(dtype)
    lens = [n, n - 9]
    o, lse = paged_attention_lse(q, pages[..., :half], pages[..., half:], k_layout, v_layout, table.repeat(2, 1),
                                 torch.tensor(lens), torch.tensor([0, 1, 2]), 0.1, chunk=block_size)
    for r, length in enumerate(lens):
        kk = k[:length].double().repeat_interleave(3, dim=1)
        vv = v[:length].double().repeat_interleave(3, dim=1)
        s = torch.einsum("hd,lhd->hl", q[r].double(), kk) * 0.1
        torch.testing.assert_close(o[r].double(), torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[r].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 3), reqs=st.lists(st.tuples(st.integers(0, 150), st.integers(1, 5)), min_size=1, max_size=3),
       k_scale=st.sampled_from([1.0, 0.37, 2.5]), v_scale=st.sampled_from([1.0, 0.8, 3.0]),
       seed=st.integers(0, 2**16))
def test_dcp_forward_equals_attention_over_what_vllm_wrote(cache_dtype, n, reqs, k_scale, v_scale, seed):
    """``DCPCPUAttentionImpl.forward`` on ``n`` ranks (threads): each rank's cache holds
    the context tokens vLLM's own writer put there under the CP slot mapping (fp8: ``x /
    scale``, truncated), and the ranks' merged output for the step's tokens (``reqs``:
    context and new tokens per request) equals float64 attention over what a DCP=1 cache
    holds after the same writer stored the context and the step's tokens: the stock
    kernel's inputs, scales applied. So the scales fold in once and the step's own
    tokens are quantized as the cache would hold them."""
    import threading
    from types import SimpleNamespace as NS

    from tests.support.ranks import run_ranks
    from vllm import _custom_ops as ops

    from vllm_dcp2d.attention.gather import gather_pages
    from vllm_dcp2d.reshard.page_format import FP8_DTYPES, kv_dtype_name
    from vllm_dcp2d.vllm_compat import cpu_attn

    bs, d, h, isa, scale = 32, 32, 2, "vec", 0.3
    fp8 = FP8_DTYPES.get(kv_dtype_name(cache_dtype, torch.float32))
    g = torch.Generator().manual_seed(seed)
    ctx, new = [c for c, _ in reqs], [q for _, q in reqs]
    seq = [c + q for c, q in reqs]
    k_all = [torch.randn(s, 1, d, generator=g) for s in seq]
    v_all = [torch.randn(s, 1, d, generator=g) for s in seq]
    q = torch.randn(sum(new), h * n, d, generator=g)
    cols = max(cdiv(s, bs) for s in seq) + 1
    table = torch.randperm(len(reqs) * cols + 1, generator=g)[: len(reqs) * cols].view(len(reqs), cols).int()
    nb = len(reqs) * cols + 1

    def write(cache, k, v, starts, lens, cp, rank):
        """The tokens ``[starts[r], starts[r] + lens[r])`` of each request, through vLLM's writer."""
        num = sum(lens)
        if num == 0:
            return
        qsl = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
        pos = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, lens)])
        slots = torch.empty(num, dtype=torch.int64)
        compat.cp_slot_mapping(num, num, qsl, pos, table, cols, slots, bs, cp, rank, bs, -1)
        kc, vc = cache.view(nb, 1, 2 * bs, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype=cache_dtype)

    cache_dtype_t = torch.uint8 if fp8 else torch.float32
    ctx_k = torch.cat([k[:c] for k, c in zip(k_all, ctx)])
    ctx_v = torch.cat([v[:c] for v, c in zip(v_all, ctx)])
    caches = [torch.zeros(nb, 1, bs, 2 * d, dtype=cache_dtype_t) for _ in range(n)]
    for rank, cache in enumerate(caches):
        write(cache, ctx_k, ctx_v, [0] * len(reqs), ctx, n, rank)
    new_k = torch.cat([k[c:] for k, c in zip(k_all, ctx)])
    new_v = torch.cat([v[c:] for v, c in zip(v_all, ctx)])

    # DCP=1: the context and the step's tokens, as the stock kernel reads them.
    ref = torch.zeros(nb, 1, bs, 2 * d, dtype=cache_dtype_t)
    write(ref, torch.cat(k_all), torch.cat(v_all), [0] * len(reqs), seq, 1, 0)
    k_layout, v_layout = compat.cpu_kv_layout(isa, torch.float32, bs, d, cache_dtype)
    pages = (ref.view(fp8) if fp8 else ref).view(nb, 1, 2 * bs * d)
    deq_k = gather_pages(pages[..., : bs * d], k_layout, table, max(seq)).double() * (k_scale if fp8 else 1)
    deq_v = gather_pages(pages[..., bs * d:], v_layout, table, max(seq)).double() * (v_scale if fp8 else 1)
    want, t = [], 0
    for r, (c, m) in enumerate(reqs):
        for i in range(m):
            s = torch.einsum("hd,ld->hl", q[t].double(), deq_k[r, : c + i + 1, 0]) * scale
            want.append(torch.softmax(s, -1) @ deq_v[r, : c + i + 1, 0])
            t += 1
    want = torch.stack(want)  # [T, h * n, d]

    local = threading.local()
    meta = NS(num_actual_tokens=sum(new), seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=table,
              query_start_loc=torch.tensor([0] + np.cumsum(new).tolist(), dtype=torch.int32))
    layer = NS(isa=isa, _k_scale_float=k_scale, _v_scale_float=v_scale)

    def rank_forward(rank, group):
        local.group = group
        impl = object.__new__(cpu_attn.DCPCPUAttentionImpl)  # the attributes forward reads, no vLLM config
        impl.num_heads, impl.head_size, impl.scale, impl.kv_cache_dtype = h, d, scale, cache_dtype
        impl.dcp_world_size, impl._fp8 = n, fp8
        impl._parallel_config = NS(cp_kv_cache_interleave_size=bs)
        out = torch.zeros(sum(new), h * d)
        return impl.forward(layer, q[:, rank * h:(rank + 1) * h].contiguous(), new_k, new_v, caches[rank], meta, out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_attn, "get_dcp_group", lambda: local.group)
        results, errors, _ = run_ranks(rank_forward, list(range(n)))
    assert errors == [None] * n, errors
    for rank, out in enumerate(results):
        torch.testing.assert_close(out.view(-1, h, d).double(), want[:, rank * h:(rank + 1) * h], atol=2e-5, rtol=2e-5)
