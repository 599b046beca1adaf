"""The agreed accepted prefix (in-process; ranks are threads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.ranks import run_ranks

from vllm_dcp2d.spec_decode import agree_accepted_prefix, agree_num_sampled, agree_sampled


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=5), min_size=n, max_size=n)))
def test_agreed_prefix_is_the_padded_min_on_every_rank(per_rank):
    """Ranks may disagree, even on the batch size: a request one rank lacks gets 0."""
    inputs = [torch.tensor(a, dtype=torch.int64) for a in per_rank]
    results, errors, calls = run_ranks(agree_accepted_prefix, inputs)
    assert errors == [None] * len(inputs)
    width = max(len(a) for a in per_rank)
    padded = np.zeros((len(per_rank), width), dtype=np.int64)
    for r, a in enumerate(per_rank):
        padded[r, : len(a)] = a
    mins = padded.min(0) if width else padded.sum(0)
    for r, res in enumerate(results):
        assert res.dtype == torch.int64 and res.tolist() == mins[: len(per_rank[r])].tolist()
    assert len(set(calls)) == 1  # the same collectives on every rank


@pytest.mark.parametrize("bad", [torch.tensor([1, -1]), torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0])])
def test_an_invalid_rank_makes_every_rank_raise_without_hanging(bad):
    inputs = [torch.tensor([2, 3]), bad, torch.tensor([1, 1])]
    results, errors, calls = run_ranks(agree_accepted_prefix, inputs)
    assert all(isinstance(e, ValueError) and "rank(s) [1]" in str(e) for e in errors), errors
    assert calls == [1, 1, 1]
    # The group is still usable: the next step's agreement works.
    results, errors, _ = run_ranks(agree_accepted_prefix, [torch.tensor([2, 3])] * 3)
    assert errors == [None] * 3 and all(r.tolist() == [2, 3] for r in results)


def test_a_divergent_rank_commits_the_agreed_prefix():
    """Rank 1's draft diverged at index 1: its sampler kept the first draft and the
    target's token after it; rank 0 kept all 3 drafts and the bonus token. Both
    commit [4, 5], which both computed identically."""
    sampled = [torch.tensor([[4, 5, 6, 7]]), torch.tensor([[4, 5, -1, -1]])]
    results, errors, _ = run_ranks(agree_sampled, sampled)
    assert errors == [None, None]
    assert [r.tolist() for r in results] == [[[4, 5, -1, -1]]] * 2


def test_non_tensor_input_still_joins_and_raises():
    results, errors, calls = run_ranks(agree_accepted_prefix, [torch.tensor([1]), [1]])
    assert all(isinstance(e, ValueError) for e in errors) and "torch.Tensor" in str(errors[1])
    assert calls == [1, 1]


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(0, 5), st.integers(1, 4))
def test_rejection_sampler_output_is_cut_to_the_agreed_count(data, n, b, k):
    """``spec_decode.verify.agree_sampled`` on vLLM's ``[B, K + 1]`` sampler
    output (tokens, then -1): every rank keeps the target's first MIN + 1 tokens."""
    target = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 511), min_size=k + 1, max_size=k + 1),
                                             min_size=b, max_size=b)), dtype=torch.int64).view(b, k + 1)
    accepted = [data.draw(st.lists(st.integers(0, k), min_size=b, max_size=b)) for _ in range(n)]
    keep = torch.arange(k + 1)[None, :]

    def sampled(acc):
        return target.masked_fill(keep > torch.tensor(acc, dtype=torch.int64).view(b, 1), -1)

    results, errors, _ = run_ranks(agree_sampled, [sampled(a) for a in accepted])
    assert errors == [None] * n
    mins = np.array(accepted, dtype=np.int64).reshape(n, b).min(0) if b else []
    for res in results:
        assert torch.equal(res, sampled(list(mins)))


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4))
def test_model_runner_v2_counts_are_cut_to_the_agreed_min(data, n, b, k):
    """``agree_num_sampled`` on vLLM 0.34's per-request counts (Model Runner V2): with
    ``k`` drafts a verified request has ``k + 1`` logits, ``num_sampled`` of them kept and
    the rest rejected; a chunked prefill has 0 and 0 on every rank. Every rank ends with
    the MIN of ``num_sampled`` and the same total per request, in one collective."""
    prefill = data.draw(st.lists(st.booleans(), min_size=b, max_size=b))
    sampled = [[0 if p else data.draw(st.integers(1, k + 1)) for p in prefill] for _ in range(n)]
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))

    def body(counts, group):
        num_sampled = torch.tensor(counts, dtype=dtype)
        num_rejected = torch.tensor([0 if p else k + 1 - c for p, c in zip(prefill, counts)], dtype=dtype)
        agree_num_sampled(num_sampled, num_rejected, group)
        return num_sampled.tolist(), num_rejected.tolist(), num_sampled.dtype

    results, errors, calls = run_ranks(body, sampled)
    assert errors == [None] * n and calls == [1] * n
    want = np.array(sampled, dtype=np.int64).reshape(n, b).min(0).tolist() if b else []
    for got_sampled, got_rejected, got_dtype in results:
        assert got_sampled == want and got_dtype == dtype
        assert got_rejected == [0 if p else k + 1 - w for p, w in zip(prefill, want)]


def test_model_runner_v2_counts_must_be_one_per_request():
    with pytest.raises(ValueError, match=r"both be \[B\], got \(2,\) and \(3,\)"):
        agree_num_sampled(torch.zeros(2), torch.zeros(3), None)
