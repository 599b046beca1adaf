"""Speculative decoding under DCP=2 on real gloo ranks: draft with DCP disabled
over a replicated draft pool, verify under DCP, commit the agreed prefix.

One spawn of 2 ranks runs both cases (module fixture): ``clean``, and
``corrupt``, where rank 1 drafts wrong tokens at a different draft step each
round. Checked against plain greedy decoding without DCP or drafts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.prefill_group import run_group
from tests.support.spec_model import POISON, forward, make_weights, prompts_for, reference_greedy
from tests.support.spec_workers import pools, spec_decode
from tests.support.dcp_pages import dcp_local_slot, dcp_page_owner
from tests.support.tiny_cp_model import TinyConfig
from vllm_dcp2d.spec_decode import dcp_disabled

CFG = TinyConfig(num_layers=2, hidden=16, num_heads=2, head_dim=8, ffn=32, vocab=48, max_len=64)
ARGS = dict(cfg=CFG, seed=2, batch=3, max_prompt=12, k=4, gen_len=16, page_size=4)
N = 2
CASES = ("clean", "corrupt")
PROMPTS = prompts_for(ARGS["seed"], ARGS["batch"], CFG.vocab, ARGS["max_prompt"])

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ranks():
    results = run_group("tests.support.spec_workers:spec_cases", N, ARGS, timeout_s=200, gloo_timeout_s=30)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res['error']}\n{res.get('traceback', '')}"
    return results


@pytest.fixture(scope="module")
def reference(ranks):
    """Per request: (greedy tokens, KV of all but the last), long enough for both cases."""
    w = make_weights(CFG, ARGS["seed"])
    out = []
    for b, p in enumerate(PROMPTS):
        n = max(len(ranks[0][c]["tokens"][b]) for c in CASES) - len(p)
        seq, kv = reference_greedy(w, CFG, torch.as_tensor(p), n)
        out.append((seq.numpy(), kv.numpy()))
    return out


def _steps(res, key):
    return [s[key] for s in res["steps"]]


@pytest.mark.parametrize("case", CASES)
def test_tokens_equal_plain_greedy(ranks, reference, case):
    for r in range(N):
        for b, (seq, _) in enumerate(reference):
            got = ranks[r][case]["tokens"][b]
            assert len(got) - len(PROMPTS[b]) >= ARGS["gen_len"]
            np.testing.assert_array_equal(got, seq[: len(got)], err_msg=f"{case} rank {r} request {b}")


def test_ranks_draft_verify_and_accept_identically(ranks):
    clean = [res["clean"] for res in ranks]
    assert len({len(c["steps"]) for c in clean}) == 1
    for key in ("drafts", "local", "accepted", "logits"):
        for s, (a, b) in enumerate(zip(_steps(clean[0], key), _steps(clean[1], key))):
            # Bitwise: the merge all-gathers partials in rank order on every rank.
            assert a.tobytes() == b.tobytes(), f"step {s}: {key} differs between ranks"
    np.testing.assert_array_equal(_steps(clean[0], "local"), _steps(clean[0], "accepted"))
    acc = np.concatenate(_steps(clean[0], "accepted"))
    rate = acc.sum() / (acc.size * ARGS["k"])
    print(f"\nacceptance rate {rate:.3f} over {len(clean[0]['steps'])} steps x {ARGS['batch']} requests, "
          f"k={ARGS['k']}; accepted per step {acc.tolist()}")
    assert 0 < acc.sum() and acc.min() < ARGS["k"], "both accepted and rejected drafts must occur"


def test_divergent_rank_commits_the_agreed_prefix(ranks):
    runs = [res["corrupt"] for res in ranks]
    assert [a.tobytes() for a in _steps(runs[0], "accepted")] == [a.tobytes() for a in _steps(runs[1], "accepted")]
    local = np.stack([np.stack(_steps(r, "local")) for r in runs])  # [N, steps, B]
    np.testing.assert_array_equal(local.min(0), np.stack(_steps(runs[0], "accepted")))
    assert (local[0] != local[1]).any(), "the corrupted drafts never changed rank 1's acceptance"
    assert any((a != b).any() for a, b in zip(_steps(runs[0], "drafts"), _steps(runs[1], "drafts")))
    for r in range(N):
        np.testing.assert_array_equal(runs[r]["kv_len"], runs[0]["kv_len"])


@pytest.mark.parametrize("case", CASES)
def test_target_shards_equal_reference_page_by_page(ranks, reference, case):
    """Page ``i`` of request ``b`` is virtual page ``g = b * pages_per_req + i``,
    on rank ``g % N`` at slot ``g // N``; only committed tokens were written."""
    ps = ARGS["page_size"]
    shards = [res[case]["target_kv"] for res in ranks]  # [L, 2, slots, H, ps, Dh] per rank
    pages_per_req = shards[0].shape[2] * N // ARGS["batch"]
    kv_len = ranks[0][case]["kv_len"]
    for b, (_, ref) in enumerate(reference):  # ref [L, 2, S - 1, H, Dh]
        for i in range(pages_per_req):
            g = b * pages_per_req + i
            page = shards[dcp_page_owner(g, N)][:, :, dcp_local_slot(g, N)]  # [L, 2, H, ps, Dh]
            n = int(np.clip(kv_len[b] - i * ps, 0, ps))
            want = np.full_like(page, POISON)
            want[:, :, :, :n] = ref[:, :, i * ps: i * ps + n].transpose(0, 1, 3, 2, 4)
            assert page.tobytes() == want.tobytes(), f"{case}: request {b} page {i} (kv_len {kv_len[b]})"


def test_draft_pool_is_full_and_replicated(ranks, reference):
    """The draft pool holds every page of every request on every rank (clean case):
    the draft layer's KV, equal to the target's first layer, up to draft_len."""
    ps = ARGS["page_size"]
    replicas = [res["clean"]["draft_kv"] for res in ranks]  # [1, 2, slots, H, ps, Dh]
    assert replicas[0].tobytes() == replicas[1].tobytes()
    pages_per_req = replicas[0].shape[2] // ARGS["batch"]
    assert pages_per_req * ps >= CFG.max_len
    for b, (_, ref) in enumerate(reference):
        n = int(ranks[0]["clean"]["draft_len"][b])
        pages = replicas[0][0, :, b * pages_per_req: (b + 1) * pages_per_req]  # [2, pages, H, ps, Dh]
        _, _, h, _, dh = pages.shape
        flat = pages.transpose(0, 1, 3, 2, 4).reshape(2, -1, h, dh)  # [2, positions, H, Dh]
        np.testing.assert_array_equal(flat[:, :n], ref[0, :, :n])


class _OneRank:
    world_size, rank_in_group = 1, 0

    def all_gather(self, x, dim=-1):
        return x


@pytest.mark.timeout(60)
def test_single_rank_loop_equals_plain_greedy():
    """DCP=1 (no collectives): the same loop, in-process, on another seed."""
    w = make_weights(CFG, 5)
    prompts = prompts_for(5, 2, CFG.vocab, 10)
    res = spec_decode(w, CFG, prompts, 3, 10, 4, _OneRank())
    for b, p in enumerate(prompts):
        seq, _ = reference_greedy(w, CFG, torch.as_tensor(p), len(res["tokens"][b]) - len(p))
        np.testing.assert_array_equal(res["tokens"][b], seq.numpy())


def test_attention_refuses_a_pool_sharded_differently_from_the_effective_dcp():
    """The draft pool is unsharded: a draft forward outside dcp_disabled() (DCP=2
    here) fails before any collective; the target's sharded pool fails inside it."""
    class TwoRanks(_OneRank):
        world_size = 2

        def all_gather(self, x, dim=-1):
            raise AssertionError("no collective may run")

    w = make_weights(CFG, 0)
    target, draft = pools(CFG, 1, 4, TwoRanks())
    ids, lens, ctx = torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([0])
    with pytest.raises(ValueError, match="sharded over 1 ranks but attention runs at DCP=2"):
        forward(w, CFG, 1, ids, lens, ctx, draft, TwoRanks())
    with pytest.raises(ValueError, match="sharded over 2 ranks but attention runs at DCP=1"), dcp_disabled():
        forward(w, CFG, 1, ids, lens, ctx, target, TwoRanks())
