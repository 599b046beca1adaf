"""The speculative decoding loop of tests/spec_decode/test_loop.py, run on every rank.

:func:`spec_decode` is one rank's loop over any DCP group (a spawned gloo
rank, or a single process with ``world_size == 1``); :func:`spec_cases` is
the entry of a spawned rank (see ``prefill_group.run_group``): the clean
loop, then the loop with this group's last rank drafting wrong tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.support.spec_model import PagedPool, forward, make_weights, prompts_for
from vllm_dcp2d.reshard.layout import cdiv
from tests.support.tiny_cp_model import consensus_prefix_lens
from tests.support.tiny_cp_model import TinyConfig
from vllm_dcp2d.spec_decode import TorchGroup, agree_sampled, dcp_disabled
from vllm_dcp2d.spec_decode.verify import PLACEHOLDER


def pools(cfg: TinyConfig, batch: int, page_size: int, group) -> tuple[PagedPool, PagedPool]:
    """(target pool: this rank's 1/N of every request's pages; draft pool: all of them)."""
    n, r = group.world_size, group.rank_in_group
    pages_per_req = cdiv(cdiv(cfg.max_len, page_size), n) * n
    slots = batch * pages_per_req // n
    dims = (cfg.num_heads, cfg.head_dim)
    target = PagedPool(cfg.num_layers, batch, pages_per_req, page_size, *dims, n, r, slots)
    # The draft pool is unsharded: n times the target's per-rank slots (design §8).
    return target, PagedPool(1, batch, pages_per_req, page_size, *dims, 1, 0, slots * n)


def propose(w, cfg, seqs, draft_len, k, pool, group, corrupt_at=None):
    """``k`` greedy draft tokens per request with DCP disabled.

    seqs: list of int64 ``[S_b]``; draft_len: int64 ``[B]``, positions whose draft
    KV is valid. The first step catches up on ``seqs[b][draft_len[b]:]`` (at
    least the pending last token), each later one feeds the previous draft.
    corrupt_at: draft step whose tokens are replaced (``+1 mod vocab``) and fed on.
    Returns (drafts int64 ``[B, k]``, draft_len ``[B]`` after writing their KV).
    """
    with dcp_disabled():
        ids = torch.cat([s[d:] for s, d in zip(seqs, draft_len.tolist())])
        lens = torch.tensor([len(s) for s in seqs]) - draft_len
        out = []
        for i in range(k):
            logits, kv, req, pos = forward(w, cfg, 1, ids, lens, draft_len, pool, group)
            pool.write(kv, req, pos)
            draft_len = draft_len + lens
            tok = logits[lens.cumsum(0) - 1].argmax(-1)
            if i == corrupt_at:
                tok = (tok + 1) % cfg.vocab
            out.append(tok)
            ids, lens = tok, torch.ones_like(lens)
    return torch.stack(out, 1), draft_len


def spec_decode(w, cfg, prompts, k, gen_len, page_size, group, corrupt=False) -> dict:
    """Greedy speculative decoding of ``prompts`` (list of int ``[P_b]``) until every
    request has ``>= gen_len`` new tokens. ``corrupt``: this rank's step ``s``
    corrupts draft step ``s % k``. Returns numpy results (see the end)."""
    b = len(prompts)
    target, draft = pools(cfg, b, page_size, group)
    seqs = [torch.as_tensor(p, dtype=torch.int64) for p in prompts]
    lens = torch.tensor([len(s) for s in seqs])
    # Prefill under DCP: the prompt attends over itself (every rank's context is empty).
    logits, kv, req, pos = forward(w, cfg, cfg.num_layers, torch.cat(seqs), lens, torch.zeros_like(lens), target, group)
    target.write(kv, req, pos)
    first = logits[lens.cumsum(0) - 1].argmax(-1)
    seqs = [torch.cat([s, first[i:i + 1]]) for i, s in enumerate(seqs)]
    kv_len, draft_len = lens.clone(), torch.zeros_like(lens)
    steps = []
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < gen_len:
        if max(len(s) for s in seqs) + k > cfg.max_len:
            raise ValueError(f"sequences would pass max_len={cfg.max_len}")
        drafts, draft_len = propose(w, cfg, seqs, draft_len, k, draft, group,
                                    corrupt_at=len(steps) % k if corrupt else None)
        # Verify under DCP: the pending token, then the drafts, against this rank's pages.
        inputs = torch.cat([torch.stack([s[-1] for s in seqs])[:, None], drafts], 1)  # [B, k + 1]
        logits, kv, req, pos = forward(w, cfg, cfg.num_layers, inputs.flatten(), torch.full((b,), k + 1),
                                       kv_len, target, group)
        target_tokens = logits.argmax(-1).view(b, k + 1)
        # What vLLM's rejection sampler answers for greedy drafts: the target's tokens
        # while the drafts match, its correction (or bonus) token, then PLACEHOLDER.
        local = (drafts == target_tokens[:, :-1]).long().cumprod(1).sum(1)
        sampled = target_tokens.masked_fill(torch.arange(k + 1)[None, :] > local[:, None], PLACEHOLDER)
        kept = agree_sampled(sampled, group) != PLACEHOLDER  # [B, k + 1]: the agreed prefix
        accepted = kept.sum(1) - 1
        keep = kept.flatten()  # the KV of the pending token and the accepted drafts
        target.write(kv[:, :, keep], req[keep], pos[keep])
        kv_len = kv_len + accepted + 1
        seqs = [torch.cat([s, target_tokens[i, : int(accepted[i]) + 1]]) for i, s in enumerate(seqs)]
        assert all(len(s) - 1 == int(n) for s, n in zip(seqs, kv_len)), "all but the pending token are in the pool"
        draft_len = torch.minimum(draft_len, kv_len)  # draft KV past the committed prefix is stale
        steps.append({"drafts": drafts.numpy(), "local": local.numpy(), "accepted": accepted.numpy(),
                      "logits": logits.numpy()})
    return {
        "tokens": [s.numpy() for s in seqs],
        "kv_len": kv_len.numpy(),
        "target_kv": target.kv.numpy(),
        "draft_kv": draft.kv.numpy(),
        "draft_len": draft_len.numpy(),
        "steps": steps,
    }


def spec_cases(cp, cfg: TinyConfig, seed: int, batch: int, max_prompt: int, k: int, gen_len: int,
               page_size: int) -> dict:
    """Entry of a spawned rank: the clean loop, then the last rank corrupting its drafts.
    Each step's agreed counts are checked against prefill's consensus_prefix_lens."""
    torch.manual_seed(0)
    group = TorchGroup(cp.group, cp.device)
    w = make_weights(cfg, seed)
    prompts = prompts_for(seed, batch, cfg.vocab, max_prompt)
    out = {}
    for case in ("clean", "corrupt"):
        res = spec_decode(w, cfg, prompts, k, gen_len, page_size, group,
                          corrupt=case == "corrupt" and cp.rank == cp.size - 1)
        for st in res["steps"]:
            same = consensus_prefix_lens(st["local"], batch, cp)
            if not np.array_equal(same, st["accepted"]):
                raise AssertionError(f"agree_sampled {st['accepted']} != consensus_prefix_lens {same}")
        out[case] = res
    return out
