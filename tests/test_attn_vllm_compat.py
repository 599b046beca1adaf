"""The vLLM adaptations: backend override, CP slot mapping, CPU page layout."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("vllm")

from vllm_dcp2d.layout import cdiv, dcp_local_slot, dcp_page_owner  # noqa: E402
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


@pytest.mark.parametrize("dtype,block_size,head_size", [
    (torch.float32, 32, 32), (torch.bfloat16, 32, 32), (torch.bfloat16, 32, 80), (torch.float16, 16, 64),
])
def test_cpu_kv_layout_reads_back_what_vllm_wrote(dtype, block_size, head_size):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_dcp2d.attention.paged import gather_pages

    isa = _get_attn_isa(dtype, block_size, head_size)
    k_layout, v_layout = compat.cpu_kv_layout(isa, dtype, block_size, head_size)
    nb, hkv, n = 5, 2, 2 * block_size + 7
    kv = torch.zeros(nb, hkv, block_size, 2 * head_size, dtype=dtype)
    kc, vc = kv.view(nb, hkv, 2 * block_size, head_size).chunk(2, dim=2)
    k = torch.randn(n, hkv, head_size).to(dtype)
    v = torch.randn(n, hkv, head_size).to(dtype)
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    slots = (table[0, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    pages = kv.view(nb, hkv, -1)
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
