"""Page-sharded attention: every DCP rank's (O, LSE) over its local pages, merged,
equals float64 attention over the whole sequence."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm_dcp2d.attention import flash, gather
from vllm_dcp2d.attention.dcp import dcp_merge
from vllm_dcp2d.attention.gather import gather_pages, plain_layout
from vllm_dcp2d.attention.paged import attention_lse, paged_attention_lse, varlen_attention_lse
from tests.support.dcp_pages import dcp_local_slot, dcp_page_owner


class StackGroup:
    """Single-process stand-in for a DCP group: all_gather returns the partials of
    all simulated ranks, which the test registers before calling."""

    def __init__(self, world_size, rank, parts):
        self.world_size, self.rank_in_group, self.parts = world_size, rank, parts

    def all_gather(self, x, dim=-1):
        assert dim == 0 and x.shape[0] == 1
        mine = self.parts[self.rank_in_group]
        if x.dim() == 4 and x.shape[-1] == mine["o"].shape[-1] + 1:  # O and LSE packed together
            return torch.stack([torch.cat([p["o"], p["lse"][..., None]], -1) for p in self.parts])
        key = "o" if x.dim() == 4 else "lse"
        return torch.stack([p[key] for p in self.parts])


def _reference(q, k, v, q_lens, kv_lens, scale):
    """float64 causal attention, queries = last q_lens tokens of each sequence.
    q [T, H, D]; k/v per request lists of [L, Hkv, D]."""
    outs, lses, t0 = [], [], 0
    for r, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qq = q[t0:t0 + ql].double()
        kk = k[r][:kl].double().repeat_interleave(q.shape[1] // k[r].shape[1], dim=1)
        vv = v[r][:kl].double().repeat_interleave(q.shape[1] // k[r].shape[1], dim=1)
        s = torch.einsum("thd,lhd->htl", qq, kk) * scale
        mask = torch.arange(kl)[None, :] > (kl - ql + torch.arange(ql))[:, None]
        s = s.masked_fill(mask, float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", torch.softmax(s, -1), vv))
        lses.append(torch.logsumexp(s, -1).T)
        t0 += ql
    return torch.cat(outs), torch.cat(lses)


def _shard_pages(k_seq, v_seq, page, dcp, rank, num_slots, gen):
    """Place one rank's pages of each sequence in a random paged cache.

    Page p of a sequence belongs to rank p % dcp at local slot p // dcp (design §5.1),
    the layout vLLM's CP slot mapping gives with cp_kv_cache_interleave_size = page.
    Returns the cache [num_blocks, Hkv, page*D] (flat, plain layout), block_table and
    the local token counts. ``num_slots`` must cover this rank's pages of all sequences
    (size it from the drawn lengths); the remaining slots hold garbage."""
    hkv, d = k_seq[0].shape[1:]
    need = sum(int((dcp_page_owner(np.arange(math.ceil(len(k) / page)), dcp) == rank).sum()) for k in k_seq)
    assert need <= num_slots, f"pool of {num_slots} slots is too small: rank {rank} holds {need} pages"
    kc = torch.randn(num_slots, hkv, page, d, generator=gen)  # garbage where unused
    vc = torch.randn(num_slots, hkv, page, d, generator=gen)
    free = torch.randperm(num_slots, generator=gen).tolist()
    width = max(math.ceil(len(k) / page / dcp) for k in k_seq) + 1
    table = torch.zeros(len(k_seq), width, dtype=torch.int32)
    local_lens = []
    for r, (k, v) in enumerate(zip(k_seq, v_seq)):
        pages = np.arange(math.ceil(len(k) / page))
        mine = pages[dcp_page_owner(pages, dcp) == rank]
        n = 0
        for p in mine:
            blk = free.pop()
            table[r, dcp_local_slot(int(p), dcp)] = blk
            chunk = slice(p * page, min((p + 1) * page, len(k)))
            kc[blk, :, : chunk.stop - chunk.start] = k[chunk].transpose(0, 1)
            vc[blk, :, : chunk.stop - chunk.start] = v[chunk].transpose(0, 1)
            n += chunk.stop - chunk.start
        local_lens.append(n)
    flat = lambda c: c.reshape(num_slots, hkv, page * d)  # noqa: E731
    return flat(kc), flat(vc), table, torch.tensor(local_lens)


@settings(max_examples=20, deadline=None)
@given(
    dcp=st.integers(1, 4),
    page=st.sampled_from([4, 16]),
    ctx=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    new=st.data(),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    d=st.sampled_from([8, 40]),
    chunk_pages=st.sampled_from([1, 8, 256]),
    k_vec=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_sharded_context_plus_new_tokens_equals_full_attention(dcp, page, ctx, new, hkv, group, d, chunk_pages,
                                                               k_vec, seed):
    """Context on dcp ranks (empty shards included) + causal new tokens, merged;
    online softmax over chunks of one page per request, a few, or everything at once.
    Prefill-sized query runs (over ``flash.LONG_QUERY``) in the same batch take the
    flash route, with the same chunks. K pages are row-major or column-major (vLLM's
    ``vec`` layout; a one-page chunk of it reaches the flash kernel as a transposed view)."""
    gen = torch.Generator().manual_seed(seed)
    long_q = st.integers(flash.LONG_QUERY - 1, flash.LONG_QUERY + 24)
    q_lens = [new.draw(st.integers(1, 5) | long_q) for _ in ctx]
    h = hkv * group
    scale = 1 / math.sqrt(d)
    k_seq = [torch.randn(c + n, hkv, d, generator=gen) for c, n in zip(ctx, q_lens)]
    v_seq = [torch.randn(c + n, hkv, d, generator=gen) for c, n in zip(ctx, q_lens)]
    q = torch.randn(sum(q_lens), h, d, generator=gen)
    qsl = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    ref_o, ref_lse = _reference(q, k_seq, v_seq, q_lens, [c + n for c, n in zip(ctx, q_lens)], scale)

    layout = plain_layout(page, d)
    ctx_k = [k[:c] for k, c in zip(k_seq, ctx)]
    ctx_v = [v[:c] for v, c in zip(v_seq, ctx)]
    # Pool sized from the draw: the pages of all requests bound any one rank's share
    # (dcp=1 holds them all), plus 8 unused garbage slots so the shuffled placement matters.
    num_slots = sum(math.ceil(c / page) for c in ctx) + 8
    parts = []
    for rank in range(dcp):
        kc, vc, table, local = _shard_pages(ctx_k, ctx_v, page, dcp, rank, num_slots, gen)
        k_layout = layout
        if k_vec:  # element (t, d) of a page at d * page + t
            kc = kc.view(num_slots, hkv, page, d).transpose(-1, -2).reshape(num_slots, hkv, page * d)
            k_layout = torch.arange(page * d).view(d, page).t().contiguous()
        o, lse = paged_attention_lse(q, kc, vc, k_layout, layout, table, local, qsl, scale, chunk=chunk_pages * page)
        parts.append({"o": o, "lse": lse})
    new_k = torch.cat([k[c:] for k, c in zip(k_seq, ctx)])
    new_v = torch.cat([v[c:] for v, c in zip(v_seq, ctx)])
    local_new = varlen_attention_lse(q, new_k, new_v, qsl, scale)
    out, lse = dcp_merge(parts[0]["o"], parts[0]["lse"], StackGroup(dcp, 0, parts), local=local_new)
    torch.testing.assert_close(out.double(), ref_o, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


def test_flash_attend_copies_a_head_dim_with_stride():
    """torch's CPU flash kernel ignores the head dim's stride; attend must not pass it
    a transposed K (the regression: 94 prefill queries over a 2-token, one-page shard)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 16, 32, generator=gen)
    k = torch.randn(1, 32, 8, generator=gen).transpose(-1, -2)  # [1, 8, 32], head-dim stride 8
    v = torch.randn(1, 8, 32, generator=gen)
    o, lse = flash.attend(q, k, v, causal=False)
    s = q.double() @ k.double().transpose(-1, -2)
    torch.testing.assert_close(o.double(), torch.softmax(s, -1) @ v.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)


def test_empty_shard_and_empty_rows():
    """A rank without pages of a request returns O = 0, LSE = -inf; padded query rows too."""
    q = torch.randn(1, 2, 3, 8)
    k = torch.randn(1, 5, 1, 8)
    o, lse = attention_lse(q, k, k, torch.tensor([2]), torch.tensor([0]), 0.5, causal=False)
    assert torch.equal(o, torch.zeros_like(o)) and (lse == float("-inf")).all()
    o, lse = attention_lse(q, k, k, torch.tensor([1]), torch.tensor([5]), 0.5, causal=False)
    assert (lse[0, 0] > float("-inf")).all() and (lse[0, 1] == float("-inf")).all()
    assert torch.equal(o[0, 1], torch.zeros(3, 8)) and not torch.isnan(o).any()


def test_head_dim_split_k_v_and_non_contiguous_queries():
    """MLA-style: K and V read from one latent page (V = first Dv dims of K)."""
    gen = torch.Generator().manual_seed(0)
    page, dk, dv, h = 4, 24, 16, 3
    kv_seq = torch.randn(10, 1, dk, generator=gen)
    q = torch.randn(h, 2, dk, generator=gen).transpose(0, 1)  # non-contiguous [T=2, H, Dk]
    kc, _, table, local = _shard_pages([kv_seq], [kv_seq], page, 1, 0, 8, gen)
    k_layout = plain_layout(page, dk)
    o, lse = paged_attention_lse(q, kc, kc, k_layout, k_layout[:, :dv], table, local,
                                 torch.tensor([0, 2]), 0.3)
    s = torch.einsum("thd,ld->thl", q.double(), kv_seq[:, 0].double()) * 0.3
    torch.testing.assert_close(o.double(), torch.softmax(s, -1) @ kv_seq[:, 0, :dv].double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)


def test_gather_pages_follows_layout_and_table():
    cache = torch.arange(3 * 2 * 8).float().view(3, 2, 8)  # 3 pages, 2 heads, page 4 x D 2
    layout = torch.tensor([[0, 4], [1, 5], [2, 6], [3, 7]])  # K stored transposed ([D, page])
    table = torch.tensor([[2, 0]])
    g = gather_pages(cache, layout, table, 6)  # [1, 6, 2, 2]
    assert g.shape == (1, 6, 2, 2)
    assert g[0, 0, 1].tolist() == [cache[2, 1, 0].item(), cache[2, 1, 4].item()]
    assert g[0, 5, 0].tolist() == [cache[0, 0, 1].item(), cache[0, 0, 5].item()]


@settings(max_examples=10, deadline=None)
@given(ctx=st.lists(st.integers(1, 90), min_size=1, max_size=3), k1=st.integers(1, 4),
       chunk_pages=st.sampled_from([1, 6, 256]), seed=st.integers(0, 1000))
def test_mla_verify_rows_see_their_own_prefix(ctx, k1, chunk_pages, seed):
    """MLA verify shape: k + 1 query tokens per request over one latent cache (V = the
    first Dv columns of K, read once); token i sees the first token_kv_lens[i] keys."""
    gen = torch.Generator().manual_seed(seed)
    page, dk, dv, h = 4, 24, 16, 3
    seqs = [torch.randn(c + k1, 1, dk, generator=gen) for c in ctx]
    num_slots = sum(math.ceil(len(s) / page) for s in seqs) + 4
    kc, _, table, local = _shard_pages(seqs, seqs, page, 1, 0, num_slots, gen)
    q = torch.randn(len(ctx) * k1, h, dk, generator=gen)
    qsl = torch.arange(len(ctx) + 1) * k1
    token_lens = torch.tensor([c + i + 1 for c in ctx for i in range(k1)])
    layout = plain_layout(page, dk)
    o, lse = paged_attention_lse(q, kc, kc, layout, layout[:, :dv], table, local, qsl, 0.3,
                                 token_kv_lens=token_lens, chunk=chunk_pages * page)
    for tok, n in enumerate(token_lens.tolist()):
        kv = seqs[tok // k1][:n, 0].double()
        s = q[tok].double() @ kv.T * 0.3  # [H, n]
        torch.testing.assert_close(o[tok].double(), torch.softmax(s, -1) @ kv[:, :dv], atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[tok].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)


def test_causal_chunks_equal_one_chunk():
    """The causal self-attention of a long prefill chunk, keys in chunks of 14."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 40, n, 16, generator=gen) for n in (4, 2, 2))
    lens = torch.tensor([40, 23])
    ref_o, ref_lse = _reference(torch.cat([q[0], q[1, :23]]), [k[0], k[1]], [v[0], v[1]], [40, 23], [40, 23], 0.25)
    o, lse = attention_lse(q, k, v, lens, lens, 0.25, causal=True, chunk=14)  # 14 keys a step
    torch.testing.assert_close(torch.cat([o[0], o[1, :23]]).double(), ref_o, atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.cat([lse[0], lse[1, :23]]).double(), ref_lse, atol=2e-5, rtol=0)


def _peak_bytes(fn) -> int:
    """Peak of the bytes allocated and not yet freed while ``fn`` runs (the CPU
    allocator's events from torch's profiler, replayed in order: deterministic)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_is_bounded_by_one_chunk(dtype):
    """Batch 2, 8 query heads on 1 KV head (folded, never repeated), contexts of 4K and
    16K tokens: the peak allocation does not grow with the context and stays within
    the docstring's per-chunk bound, far below the per-head K/V copies that the
    unchunked reference made."""
    r, h, hkv, d, page, chunk = 2, 8, 1, 64, 32, 1024
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for length in (4096, 16384):
        pages = length // page
        cache = torch.randn(r * pages, hkv, 2 * page * d, generator=gen).to(dtype)
        table = torch.arange(r * pages, dtype=torch.int32).view(r, pages)
        q = torch.randn(r, h, d, generator=gen).to(dtype)
        layout = plain_layout(page, d)
        lens = torch.full((r,), length)
        qsl = torch.arange(r + 1)
        run = lambda: paged_attention_lse(q, cache[..., : page * d], cache[..., page * d:], layout,  # noqa: E731
                                          layout, table, lens, qsl, 0.1, max_kv_len=length, chunk=chunk)
        gather._buffers().clear()  # count the scratch buffers too
        peaks.append(_peak_bytes(run))
    e, a, m = torch.finfo(dtype).bits // 8, 4, h // hkv
    chunk_pages = hkv * chunk * 2 * d * (e + (a if e != a else 0))
    bound = (chunk_pages + hkv * m * chunk * (2 * a + 1) + hkv * m * (chunk // page) * d * a
             + r * hkv * m * (2 * d + 2) * a)
    assert peaks[1] < 1.05 * peaks[0], peaks  # 4x the context, same peak
    assert peaks[1] <= bound, (peaks[1], bound)
    assert peaks[1] * 16 < r * h * 16384 * 2 * d * a  # the per-head K/V copies alone, at 16K


def test_long_query_peak_memory_is_bounded_by_one_chunk():
    """A 512-token prefill chunk (8 query heads on 1 KV head) over contexts of 4K and
    16K tokens takes the flash route: the peak does not grow with the context and
    stays within the queries, outputs and one chunk of K and V (flash.py's bound)."""
    nq, h, hkv, d, page, chunk = 512, 8, 1, 64, 32, 1024
    gen = torch.Generator().manual_seed(1)
    peaks = []
    for length in (4096, 16384):
        pages = length // page
        cache = torch.randn(pages, hkv, 2 * page * d, generator=gen)
        table = torch.arange(pages, dtype=torch.int32)[None]
        q = torch.randn(nq, h, d, generator=gen)
        layout = plain_layout(page, d)
        run = lambda: paged_attention_lse(q, cache[..., : page * d], cache[..., page * d:], layout,  # noqa: E731
                                          layout, table, torch.tensor([length]), torch.tensor([0, nq]), 0.1,
                                          chunk=chunk)
        gather._buffers().clear()
        peaks.append(_peak_bytes(run))
    a = 4
    rows = nq * h * (d + 1) * a  # one [Q, H, D] output with its LSE
    bound = 6 * rows + 4 * hkv * chunk * d * a  # q fold, partial, running and merged outputs; K, V raw + copies
    assert peaks[1] < 1.05 * peaks[0], peaks
    assert peaks[1] <= bound, (peaks[1], bound)
