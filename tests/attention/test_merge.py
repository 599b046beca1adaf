"""LSE merge against float64 unsharded attention."""

import math

import pytest
import torch

from vllm_dcp2d.attention.merge import merge_lse

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sharded_attention(t, h, d, shard_lens, seed, base_e=True):
    """Random queries/keys split into key shards; returns float64 partial (O, LSE) per
    shard ([N, T, H, D], [N, T, H]) and the float64 unsharded result."""
    g = torch.Generator().manual_seed(seed)
    total = sum(shard_lens)
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(max(total, 1), h, d, generator=g, dtype=torch.float64)
    v = torch.randn(max(total, 1), h, d, generator=g, dtype=torch.float64)
    scores = torch.einsum("thd,lhd->thl", q, k) / math.sqrt(d)
    os, lses, start = [], [], 0
    for n in shard_lens:
        s = scores[..., start:start + n]
        if n == 0:
            os.append(torch.full((t, h, d), float("nan"), dtype=torch.float64))  # never read
            lses.append(torch.full((t, h), float("-inf"), dtype=torch.float64))
        else:
            lse = torch.logsumexp(s, -1)
            os.append(torch.einsum("thl,lhd->thd", torch.softmax(s, -1), v[start:start + n]))
            lses.append(lse if base_e else lse / math.log(2))
        start += n
    s = scores[..., :total]
    if total:
        ref_o = torch.einsum("thl,lhd->thd", torch.softmax(s, -1), v[:total])
        ref_lse = torch.logsumexp(s, -1)
    else:
        ref_o = torch.zeros(t, h, d, dtype=torch.float64)
        ref_lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    if not base_e:
        ref_lse = ref_lse / math.log(2)
    return torch.stack(os), torch.stack(lses), ref_o, ref_lse


def _check(out, lse, ref_o, ref_lse, atol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double().cpu(), ref_o, atol=atol, rtol=0)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse.cpu() == float("-inf"), empty)
    torch.testing.assert_close(lse.double().cpu()[~empty], ref_lse[~empty], atol=1e-5, rtol=0)


@pytest.mark.parametrize("base_e", [True, False])
def test_merge_matches_unsharded_attention_with_empty_shard(base_e):
    o, lse, ref_o, ref_lse = _sharded_attention(5, 3, 80, [7, 0, 12], seed=1, base_e=base_e)
    out, out_lse = merge_lse(o.float().to(DEV), lse.float().to(DEV), base_e=base_e)
    assert out.dtype == torch.float32 and out_lse.dtype == torch.float32
    assert out.shape == (5, 3, 80) and out_lse.shape == (5, 3)
    _check(out, out_lse, ref_o, ref_lse, atol=1e-5)


def test_all_empty_rows_are_zero_with_lse_minus_inf():
    o, lse, ref_o, ref_lse = _sharded_attention(4, 5, 48, [3, 4], seed=2)
    lse[:, 1] = float("-inf")  # token 1: every shard empty
    lse[:, 2, 3] = float("-inf")  # token 2, head 3: every shard empty
    lse[0, 3] = float("nan")  # NaN counts as empty
    o[:, 1] = float("nan")
    o[0, 3] = float("inf")
    out, out_lse = merge_lse(o.float().to(DEV), lse.float().to(DEV))
    assert not torch.isnan(out).any() and not torch.isinf(out).any()
    assert torch.equal(out[1].cpu(), torch.zeros(5, 48)) and torch.equal(out[2, 3].cpu(), torch.zeros(48))
    assert (out_lse[1] == float("-inf")).all() and out_lse[2, 3] == float("-inf")
    # Token 3 is the second shard alone.
    torch.testing.assert_close(out[3].cpu().double(), o[1, 3], atol=1e-5, rtol=0)
    torch.testing.assert_close(out_lse[3].cpu().double(), lse[1, 3], atol=1e-5, rtol=0)


def test_non_contiguous_inputs():
    o, lse, ref_o, ref_lse = _sharded_attention(7, 5, 72, [0, 9, 4], seed=3)
    # [T, N, H, D] / [H, T, N] buffers permuted to [N, T, H, D] / [N, T, H].
    o_nc = o.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3).float().to(DEV)
    lse_nc = lse.permute(2, 1, 0).contiguous().permute(2, 1, 0).float().to(DEV)
    assert not o_nc.is_contiguous() and not lse_nc.is_contiguous()
    out, out_lse = merge_lse(o_nc, lse_nc)
    _check(out, out_lse, ref_o, ref_lse, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_fp32(dtype):
    o, lse, ref_o, ref_lse = _sharded_attention(3, 4, 32, [5, 6, 0, 2], seed=4)
    out, out_lse = merge_lse(o.to(dtype).to(DEV), lse.float().to(DEV))
    assert out.dtype == dtype and out_lse.dtype == torch.float32
    # Input rounding + 1 ulp output rounding.
    atol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    _check(out, out_lse, ref_o, ref_lse, atol=atol)


def test_merge_agrees_with_vllm_reference():
    dcp = pytest.importorskip("vllm.v1.attention.ops.dcp")
    o, lse, ref_o, ref_lse = _sharded_attention(6, 4, 64, [3, 5, 2], seed=5)
    ours = merge_lse(o.float(), lse.float())
    theirs = dcp._lse_weighted_combine(o.float(), lse.float(), return_lse=True, is_lse_base_on_e=True)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1].float(), atol=1e-6, rtol=1e-6)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"\[N, T, H, D\]"):
        merge_lse(torch.zeros(2, 3, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="lse must be"):
        merge_lse(torch.zeros(2, 3, 4, 5), torch.zeros(2, 4, 3))
