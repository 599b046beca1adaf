"""Scenarios run on every rank of a gloo group by tests/test_prefill_*.py.

Each is called as ``fn(cp, **args)`` in a spawned process (see
``_prefill_group.run_group``) and returns a picklable dict. Randomness is
split in two: a step's batch comes from a seed every rank shares, a rank's
local view (prefix matches, page table) from a seed of its own. Every rank
can therefore recompute every other rank's view, and so the exact outcome
the protocol must produce on it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from vllm_dcp2d.prefill.broadcast import (
    broadcast_owner_layer_prefix,
    consensus_prefix_lens,
    normalize_prefix_lens,
    prefix_slots,
)
from vllm_dcp2d.prefill.forward import PrefillBatch, TinyConfig, cp_prefill_forward, cp_token_range, init_weights
from vllm_dcp2d.prefill.pool import LayerSplitKVPool

MAX_ROWS = 8


def ref_kv(layer: int, req: np.ndarray, pos: np.ndarray, heads: int, dim: int) -> torch.Tensor:
    """The K/V the owner computed for tokens ``(req[i], pos[i])`` of ``layer``:
    float64 ``[2, n, heads, dim]``, distinct integers (exact in float64)."""
    base = torch.from_numpy(((layer * 4096 + req) * 64 + pos) * 2)
    kv = torch.arange(2)[:, None, None, None]
    hd = torch.arange(heads * dim).view(heads, dim)
    return ((base[None, :, None, None] + kv) * heads * dim + hd).double()


def _plan(seed: int, step: int, cp_size: int, max_len: int) -> dict:
    """Step ``step``: the shared batch and every rank's local view of it."""
    g = np.random.default_rng([seed, step])
    B = int(g.integers(1, 7))
    full = g.integers(1, max_len + 1, B)
    cached = (g.random(B) * full).astype(np.int64)  # tokens some rank has cached
    mode = str(g.choice(["consensus", "raw", "ragged"], p=[0.6, 0.25, 0.15]))
    ranks = []
    for r in range(cp_size):
        gr = np.random.default_rng([seed, step, 1000 + r])
        # local prefix-cache matches diverge: each rank may have lost a suffix
        match = np.where(gr.random(B) < 0.5, cached, gr.integers(0, cached + 1))
        size = B - int(gr.integers(0, min(B, 2) + 1)) if mode == "ragged" else B
        ranks.append({
            "size": size,
            "lens": None if gr.random() < 0.1 else match[:size],
            "rows": gr.permutation(MAX_ROWS)[:size],
            "seed": [seed, step, 2000 + r],
        })
    return {"B": B, "req_ids": step * 8 + np.arange(B), "mode": mode, "ranks": ranks}


def _used_lens(plan: dict) -> list[np.ndarray]:
    """Prefix lens each rank passes to the broadcast (what consensus must give)."""
    local = [normalize_prefix_lens(r["lens"], r["size"]) for r in plan["ranks"]]
    if plan["mode"] == "raw":
        return local
    width = max(len(x) for x in local)
    padded = np.zeros((len(local), width), dtype=np.int64)
    for i, x in enumerate(local):
        padded[i, : len(x)] = x
    agreed = padded.min(0)
    return [agreed[: len(x)] for x in local]


def _tokens(lens: np.ndarray, req_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(req id, position) of each prefix token, in broadcast order."""
    req = np.repeat(req_ids[: len(lens)], lens)
    pos = np.concatenate([np.arange(n) for n in lens]) if len(lens) else np.zeros(0, np.int64)
    return req, pos.astype(np.int64)


def divergence(cp, num_layers: int, steps: int, seed: int, max_len: int = 24) -> dict:
    """Hundreds of steps of per-rank prefix divergence through the size-broadcast.

    Checks on every rank, layer and step: the commit flag is exactly what the
    protocol promises, consensus gives the MIN over ranks, and whenever this
    rank's prefix tokens are the owner's, the slot its attention reads
    (``pool.layer_kv(layer)``) holds the owner's K/V bit for bit.
    """
    heads, dim, page = 2, 4, 4
    pool = LayerSplitKVPool(num_layers, cp.size, cp.rank, MAX_ROWS * max_len // page, page, heads, dim,
                            dtype=torch.float64)
    stats = {"steps": 0, "checked": 0, "committed": 0, "not_committed": 0, "skipped": 0, "errors": []}
    for step in range(steps):
        plan = _plan(seed, step, cp.size, max_len)
        me = plan["ranks"][cp.rank]
        table = torch.from_numpy(
            np.random.default_rng(me["seed"]).permutation(pool.num_tokens).reshape(MAX_ROWS, max_len))
        rows = torch.from_numpy(me["rows"])
        local = normalize_prefix_lens(me["lens"], me["size"])
        # What this rank computed earlier for its own layers: its local prefix.
        pool.kv.fill_(float("nan"))
        req, pos = _tokens(local, plan["req_ids"])
        for layer in pool.layers:
            pool.layer_kv(layer)[:, prefix_slots(table, rows, local)] = ref_kv(layer, req, pos, heads, dim)

        if plan["mode"] == "raw":
            lens = me["lens"]
        else:
            lens = consensus_prefix_lens(me["lens"], me["size"], cp)
        used = _used_lens(plan)
        if not np.array_equal(normalize_prefix_lens(lens, me["size"]), used[cp.rank]):
            stats["errors"].append(f"step {step}: consensus {lens} != expected {used[cp.rank]}")
        counts = [int(u.sum()) for u in used]
        req, pos = _tokens(used[cp.rank], plan["req_ids"])
        slots = prefix_slots(table, rows, used[cp.rank])
        for layer in range(num_layers):
            owner = pool.owner(layer)
            pool.transient_kv().fill_(float("nan"))
            ok = broadcast_owner_layer_prefix(layer, pool, cp, table, rows, lens)
            expect = cp.rank == owner or counts[cp.rank] == counts[owner]
            stats["committed" if ok else "not_committed"] += 1
            stats["skipped"] += counts[owner] == 0
            if ok != expect:
                stats["errors"].append(f"step {step} layer {layer}: committed={ok}, expected {expect}")
            oreq, opos = _tokens(used[owner], plan["req_ids"])
            if ok and np.array_equal(req, oreq) and np.array_equal(pos, opos):
                got = pool.layer_kv(layer)[:, slots]
                if not torch.equal(got, ref_kv(layer, req, pos, heads, dim)):
                    stats["errors"].append(f"step {step} layer {layer}: attention input differs from reference")
                stats["checked"] += 1
            elif plan["mode"] == "consensus":
                stats["errors"].append(f"step {step} layer {layer}: consensus step not verifiable")
        stats["steps"] += 1
    stats["invalid"] = _invalid_views(cp, pool)
    # The group is still in lockstep: one more collective, same value everywhere.
    total = torch.tensor([stats["steps"]], dtype=torch.int64)
    dist.all_reduce(total, group=cp.group)
    if int(total) != cp.size * steps:
        raise RuntimeError(f"desynchronized: step-count all_reduce gave {int(total)}, expected {cp.size * steps}")
    return stats


def _invalid_views(cp, pool) -> list[bool]:
    """Layer 0 twice: rank 1's prefix, then the owner's (rank 0) points outside
    the pool. Returns, per call, whether this rank raised ``ValueError``; the
    caller's next collective shows the group is still in lockstep."""
    table = torch.arange(2 * 8).view(2, 8)
    raised = []
    for bad_rank in (1, 0):
        bad = table + pool.num_tokens if cp.rank == bad_rank else table
        try:
            broadcast_owner_layer_prefix(0, pool, cp, bad, [0, 1], [3, 5])
            raised.append(False)
        except ValueError:
            raised.append(True)
    return raised


def evicted_prefix(cp, naive: bool) -> dict:
    """Two ranks, two layers: rank 0 (owner of layer 0) has cached prefixes
    ``[5, 3]``, rank 1 lost them (``[0, 0]``), as a local eviction or a
    prefetch still in flight leaves it. Returns the commit flag per layer."""
    pool = LayerSplitKVPool(2, cp.size, cp.rank, 16, 4, 2, 4, dtype=torch.float64)
    table = torch.arange(64).view(4, 16)
    rows = torch.tensor([1, 3])
    lens = np.array([5, 3]) if cp.rank == 0 else np.array([0, 0])
    fn = naive_broadcast_owner_layer_prefix if naive else broadcast_owner_layer_prefix
    committed = [fn(layer, pool, cp, table, rows, lens) for layer in range(2)]
    done = torch.tensor([1], dtype=torch.int64)
    dist.all_reduce(done, group=cp.group)  # the next collective of the next step
    if int(done) != cp.size:
        raise RuntimeError(f"desynchronized: all_reduce gave {int(done)}, expected {cp.size}")
    return {"committed": committed}


def naive_broadcast_owner_layer_prefix(layer, pool, cp, req_to_token, req_pool_indices, prefix_lens) -> bool:
    """The bug the size-broadcast fixed: a rank with no local prefix returns
    before the count broadcast, so it joins fewer collectives than the others."""
    slots = prefix_slots(req_to_token, req_pool_indices, prefix_lens)
    if slots.numel() == 0:
        return True
    return broadcast_owner_layer_prefix(layer, pool, cp, req_to_token, req_pool_indices, prefix_lens)


def forward_steps(cp, cfg: dict, seed: int, steps: int, page_size: int = 4) -> dict:
    """Prefill ``steps`` batches with CP; requests reuse prefixes of earlier ones.

    Each rank matches prefixes locally (divergent), consensus picks the
    common part, the rest is recomputed. Step 2 is first run with prefix
    lens the ranks disagree on: every rank must raise ``ValueError``, and the
    group must still serve the same step with consensus right after (its
    failed attempt's slots are simply never reused). Returns per step
    the sequences, consensus lens and this rank's output chunk, and per
    sequence the KV this rank keeps for its owned layers.
    """
    cfg = TinyConfig(**cfg)
    weights = init_weights(cfg, seed)
    num_pages = steps * 3 * cfg.max_len // page_size
    pool = LayerSplitKVPool(cfg.num_layers, cp.size, cp.rank, num_pages, page_size, cfg.num_heads, cfg.head_dim,
                            dtype=torch.float64)
    pool.kv.fill_(float("nan"))
    mine = np.random.default_rng([seed, 7, cp.rank])
    free = list(mine.permutation(pool.num_tokens))  # this rank's allocator order
    table = torch.zeros(steps * 3, cfg.max_len, dtype=torch.int64)
    row_order = mine.permutation(steps * 3)
    g = np.random.default_rng([seed, 7])
    done = []  # (tokens, row) of cached sequences, same order on every rank
    out = {"steps": [], "kv": [], "raised": []}
    for step in range(steps):
        last = step == steps - 1  # one token to extend: fewer tokens than ranks
        B = 1 if last else int(g.integers(1, 4))
        seqs, rows, cached = [], [], []
        for i in range(B):
            n = int(g.integers(2, cfg.max_len + 1))
            if done and (g.random() < 0.7 or (step == 2 and i == 0) or last):
                src_tokens, src_row = done[int(g.integers(0, len(done)))]
                n = min(len(src_tokens) + 1, cfg.max_len) if last else n
                k = n - 1 if last else int(g.integers(1, min(len(src_tokens), n - 1) + 1))
                tokens = np.concatenate([src_tokens[:k], g.integers(0, cfg.vocab, n - k)])
            else:
                src_row, k, tokens = None, 0, g.integers(0, cfg.vocab, n)
            seqs.append(tokens)
            cached.append((src_row, k))
            rows.append(int(row_order[len(done) + i]))
        # This rank's local prefix matches: a random part of what is cached.
        local = np.array([int(mine.integers(0, k + 1)) if k else 0 for _, k in cached], dtype=np.int64)
        if last:
            local = np.array([k for _, k in cached], dtype=np.int64)
        attempts = [("consensus", None)]
        if step == 2:
            # First try lens on which rank 0 and the others disagree (request 0
            # has a cached prefix here): every rank must raise, the group must
            # still serve the same batch with consensus right after.
            wrong = np.maximum(np.array([k for _, k in cached]) - min(cp.rank, 1), 0)
            attempts.insert(0, ("local", wrong))
        for kind, lens in attempts:
            if kind == "consensus":
                lens = consensus_prefix_lens(None if step == 1 and cp.rank == 1 else local, B, cp)
            batch = _build_batch(seqs, rows, cached, lens, table, free, cfg)
            try:
                hidden = cp_prefill_forward(weights, cfg, batch, pool, cp)
            except ValueError as e:
                out["raised"].append((step, kind, str(e)))
                continue
            out["steps"].append({"seqs": seqs, "prefix_lens": lens, "hidden": hidden,
                                 "rank_range": cp_token_range(batch.input_ids.numel(), cp.size, cp.rank)})
        done.extend((s, r) for s, r in zip(seqs, rows))
    for tokens, row in done:
        slots = table[row, : len(tokens)]
        out["kv"].append(torch.stack([pool.layer_kv(l)[:, slots] for l in pool.layers]) if len(pool.layers)
                         else torch.zeros(0))
    out["layers"] = pool.layers
    return out


def _build_batch(seqs, rows, cached, lens, table, free, cfg) -> PrefillBatch:
    """Fill the page-table rows: the first ``lens[i]`` positions point at the
    cached source sequence's slots, the rest at freshly allocated slots."""
    ids = []
    for tokens, row, (src_row, _), p in zip(seqs, rows, cached, lens):
        if p:
            table[row, :p] = table[src_row, :p]
        table[row, p: len(tokens)] = torch.tensor([free.pop() for _ in range(len(tokens) - p)])
        ids.append(torch.from_numpy(tokens[p:]))
    extend = np.array([len(t) for t in seqs]) - lens
    return PrefillBatch(torch.cat(ids).long(), torch.tensor(rows), lens, extend, table)
