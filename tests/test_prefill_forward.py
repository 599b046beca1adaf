"""Context-parallel prefill forward over a layer-split pool vs a non-CP reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _prefill_group import run_group
from vllm_dcp2d.prefill.forward import TinyConfig, init_weights, reference_forward

CFG = dict(num_layers=5, max_len=32)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_cp_forward_equals_reference_bit_exact():
    """3 ranks (layers 2/2/1), 6 steps whose requests reuse earlier prefixes
    with divergent local matches; the last extends a single token. Every
    rank's output rows and the K/V every owner keeps equal the no-CP,
    no-cache reference exactly; a batch run with disagreeing prefix lens
    raises on every rank and the group serves it right after with the
    consensus."""
    steps, seed = 6, 3
    results = run_group("_prefill_workers:forward_steps", 3, dict(cfg=CFG, seed=seed, steps=steps),
                        timeout_s=120, gloo_timeout_s=20)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    for r in results:
        assert [(s, kind) for s, kind, _ in r["raised"]] == [(2, "local")]
        assert "batch differs across CP ranks" in r["raised"][0][2]
        assert len(r["steps"]) == steps

    cfg = TinyConfig(**CFG)
    weights = init_weights(cfg, seed)
    reused = 0
    all_seqs = []
    for s in range(steps):
        views = [r["steps"][s] for r in results]
        seqs, lens = views[0]["seqs"], views[0]["prefix_lens"]
        for v in views[1:]:
            assert np.array_equal(v["prefix_lens"], lens)
        hidden, _ = reference_forward(weights, cfg, [torch.from_numpy(t) for t in seqs])
        expected = torch.cat([h[p:] for h, p in zip(hidden, lens)])
        got = torch.cat([v["hidden"] for v in views])
        assert [v["rank_range"] for v in views] == [range(a, b) for a, b in
                                                   _bounds([len(v["hidden"]) for v in views])]
        assert torch.equal(got, expected), f"step {s}: max diff {(got - expected).abs().max()}"
        reused += int(np.sum(lens))
        all_seqs.extend(seqs)
    assert reused > 0  # some prefix K/V really went through the owner broadcast
    assert [len(r["steps"][-1]["hidden"]) for r in results] == [1, 0, 0]  # fewer tokens than ranks

    _, ref_kv = reference_forward(weights, cfg, [torch.from_numpy(t) for t in all_seqs])
    for r in results:
        layers = list(r["layers"])
        for i, kv in enumerate(r["kv"]):
            assert torch.equal(kv, ref_kv[i][layers]), f"sequence {i}, layers {layers}"


def _bounds(sizes):
    ends = np.cumsum(sizes)
    return list(zip(ends - sizes, ends))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 32), min_size=1, max_size=4), st.integers(0, 3))
def test_reference_is_batch_invariant(lens, pick):
    """The basis of bit-exactness: a sequence's hidden states and K/V do not
    depend on what else is in the batch."""
    cfg = TinyConfig(**CFG)
    weights = init_weights(cfg, 1)
    g = torch.Generator().manual_seed(sum(lens))
    seqs = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in lens]
    pick %= len(seqs)
    hidden, kv = reference_forward(weights, cfg, seqs)
    alone_hidden, alone_kv = reference_forward(weights, cfg, [seqs[pick]])
    assert torch.equal(hidden[pick], alone_hidden[0])
    assert torch.equal(kv[pick], alone_kv[0])
    assert torch.equal(hidden[pick][:3], reference_forward(weights, cfg, [seqs[pick][:3]])[0][0])


def test_reference_rejects_long_sequence():
    cfg = TinyConfig(**CFG)
    with pytest.raises(ValueError, match="max_len=32"):
        reference_forward(init_weights(cfg), cfg, [torch.zeros(33, dtype=torch.int64)])
