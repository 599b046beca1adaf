"""How many KV tokens a decode rank holds, and how many requests of a length fit, per DCP size
(``vllm-dcp2d plan --capacity``; pure arithmetic: no vLLM, no I/O).

One decode rank's memory: ``gpu_bytes * utilization`` minus the weights, the LoRA
experts, the activation peak and the CUDA graphs is the KV budget (or vLLM's
``--kv-cache-memory-bytes`` given directly). The target's KV is paged: a page is
``page_size`` tokens of every target layer, ``page_size * token_bytes`` bytes on one rank
(``token_bytes``: a token's bytes over every target layer and cache on that rank: sparse MLA's
latent and, in the layers that have one, the indexer's keys). With DCP=N a rank holds every
N-th page of a sequence (page ``p`` on rank ``p % N``: ``layout.dcp_pages_for_rank``), so the
group holds N times the tokens a rank holds; a request of T tokens takes
``cdiv(T, N * page_size)`` pages of each rank (rank 0 holds the most), which is vLLM's own
``cdiv(cdiv(T, N), block_size)``.

A speculative draft (MTP, EAGLE) keeps its own unsharded KV pool and its CUDA graphs
(design §8, ``@dcp_disabled``). Two models of its pool, both here because the seed's text
and its Table 1 disagree (BENCHMARKS.md, "Decode KV capacity"):

* ``"dcp"``: the draft pool holds ``dcp_size`` times the target's tokens per rank (the
  seed's ``draft_pool_token_multiplier = dcp_size``; what vLLM does with this plugin, whose
  draft layers are ``dcp_sharded=False``: a request's draft group takes every page on every
  rank). Per target page on a rank: ``dcp_size`` draft pages.
* ``"fixed"``: a reservation of ``pool_bytes`` that does not change with DCP.

Both subtract the draft's graphs. Sizes are bytes (int); ``parse_bytes`` reads "288GB",
"64MiB", "3.5e9".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_dcp2d.reshard.layout import cdiv

__all__ = ["DecodeMemory", "Draft", "Capacity", "capacity", "parse_bytes", "format_capacity", "SEED",
           "seed_table1", "format_seed_table1"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"288GB"`` (10^9), ``"64MiB"`` (2^20), ``"3.5e9"``, ``"1114112"`` -> bytes (int, rounded
    down); ValueError naming the text for anything else or a negative size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit "
                         f"({', '.join(u for u in _UNITS if u)}), e.g. 288GB or 64MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def _nonneg(**values) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"{name} = {v}: expected >= 0")


@dataclass(frozen=True)
class DecodeMemory:
    """One decode rank's memory, bytes. ``kv_cache_bytes`` (vLLM's ``--kv-cache-memory-bytes``)
    replaces the subtraction when given. ``lora_bytes``: all LoRA experts loaded at once."""

    gpu_bytes: int = 0
    utilization: float = 1.0
    weights_bytes: int = 0
    lora_bytes: int = 0
    activations_bytes: int = 0
    graphs_bytes: int = 0
    kv_cache_bytes: int | None = None

    def reserved(self) -> int:
        """What the KV does not get: everything but the KV, and what utilization leaves out."""
        return self.gpu_bytes - self.kv_budget()

    def kv_budget(self) -> int:
        _nonneg(gpu_bytes=self.gpu_bytes, weights_bytes=self.weights_bytes, lora_bytes=self.lora_bytes,
                activations_bytes=self.activations_bytes, graphs_bytes=self.graphs_bytes)
        if self.kv_cache_bytes is not None:
            _nonneg(kv_cache_bytes=self.kv_cache_bytes)
            return self.kv_cache_bytes
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization = {self.utilization}: expected in (0, 1]")
        budget = (int(self.gpu_bytes * self.utilization) - self.weights_bytes - self.lora_bytes
                  - self.activations_bytes - self.graphs_bytes)
        if budget <= 0:
            raise ValueError(f"no memory left for KV: {self.gpu_bytes} B x {self.utilization} - weights "
                             f"{self.weights_bytes} - LoRA {self.lora_bytes} - activations {self.activations_bytes} "
                             f"- graphs {self.graphs_bytes} = {budget} B")
        return budget


@dataclass(frozen=True)
class Draft:
    """A speculative draft's KV on a decode rank: ``layers`` x ``bytes_per_token_layer`` per token,
    its pool sized by ``pool`` ("dcp" or "fixed", see the module doc; ``pool_bytes`` for
    "fixed"), and ``graphs_bytes`` for its CUDA graphs."""

    layers: int
    bytes_per_token_layer: int
    pool: str = "dcp"
    pool_bytes: int = 0
    graphs_bytes: int = 0

    def __post_init__(self):
        if self.pool not in ("dcp", "fixed"):
            raise ValueError(f"draft pool {self.pool!r}: expected 'dcp' (draft tokens = dcp_size x the target's "
                             f"per rank) or 'fixed' (pool_bytes whatever the DCP size)")
        if self.layers < 1 or self.bytes_per_token_layer < 1:
            raise ValueError(f"draft layers {self.layers}, bytes per token and layer {self.bytes_per_token_layer}: "
                             f"expected >= 1 each")
        _nonneg(pool_bytes=self.pool_bytes, graphs_bytes=self.graphs_bytes)


@dataclass(frozen=True)
class Capacity:
    """One (memory, DCP size, draft) point. Pages and tokens are of the target's pool;
    ``draft_pages_per_rank`` is the draft's pool in pages of ``page_size`` tokens (0 without a
    draft, or a fixed pool: then its bytes are ``draft_reserved_bytes``)."""

    dcp_size: int
    page_size: int
    kv_budget_bytes: int
    page_bytes: int               # one target page on one rank: page_size x token_bytes
    pages_per_rank: int
    draft_pages_per_rank: int
    draft_reserved_bytes: int     # the draft's graphs, plus its pool if fixed
    request_tokens: int
    requests: int                 # concurrent requests of request_tokens that fit the group

    @property
    def tokens_per_rank(self) -> int:
        return self.pages_per_rank * self.page_size

    @property
    def tokens_per_group(self) -> int:
        """What vLLM's "KV cache size: N tokens" line reports for a DCP instance."""
        return self.tokens_per_rank * self.dcp_size


def capacity(memory: DecodeMemory, *, token_bytes: int, page_size: int, dcp_size: int, request_tokens: int,
             draft: Draft | None = None) -> Capacity:
    """The capacity of one decode rank and its DCP group; ValueError naming a bad input.

    ``token_bytes``: one rank's KV bytes per token over every target layer and cache (MLA's
    latent is replicated over TP, a GQA model's heads are split: give one rank's share)."""
    if min(token_bytes, page_size, dcp_size, request_tokens) < 1:
        raise ValueError(f"bytes per token {token_bytes}, page size {page_size}, DCP size {dcp_size}, "
                         f"request tokens {request_tokens}: expected >= 1 each")
    budget = memory.kv_budget()
    page_bytes = page_size * token_bytes
    reserved, per_page, draft_ratio = 0, page_bytes, 0
    if draft is not None:
        reserved = draft.graphs_bytes + (draft.pool_bytes if draft.pool == "fixed" else 0)
        if draft.pool == "dcp":
            draft_ratio = dcp_size  # draft pages per target page on a rank
            per_page += dcp_size * page_size * draft.layers * draft.bytes_per_token_layer
    if reserved >= budget:
        raise ValueError(f"the draft's reservation ({reserved} B) leaves no KV of the budget ({budget} B)")
    pages = (budget - reserved) // per_page
    per_request = cdiv(request_tokens, dcp_size * page_size)  # target pages of one request on rank 0
    requests = pages // per_request
    if draft_ratio:
        requests = min(requests, pages * draft_ratio // cdiv(request_tokens, page_size))
    return Capacity(dcp_size, page_size, budget, page_bytes, pages, pages * draft_ratio, reserved, request_tokens,
                    requests)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _tok(t: float) -> str:
    return f"{t / 1e6:.3f}M" if t >= 1e6 else f"{t:,.0f}"


def format_capacity(rows: list[tuple[str, Capacity]], memory: DecodeMemory) -> str:
    """A table of ``(label, Capacity)`` rows (one per DCP size and draft setting)."""
    if memory.kv_cache_bytes is not None:
        head = f"KV budget per rank {memory.kv_cache_bytes:,} B (--kv-cache-memory-bytes)"
    else:
        head = (f"KV budget per rank: {_gb(memory.gpu_bytes)} x {memory.utilization:g} - weights "
                f"{_gb(memory.weights_bytes)} - LoRA {_gb(memory.lora_bytes)} - activations "
                f"{_gb(memory.activations_bytes)} - graphs {_gb(memory.graphs_bytes)} = {_gb(memory.kv_budget())}")
    t = rows[0][1].request_tokens
    lines = [head, f"{'DCP':>4}  {'draft':<26}{'page B/rank':>12}{'pages/rank':>12}{'tokens/rank':>13}"
                   f"{'tokens/group':>14}{'draft pool/rank':>17}  requests of {t:,} tokens"]
    for label, c in rows:
        pool = (f"{_tok(c.draft_pages_per_rank * c.page_size)} tok" if c.draft_pages_per_rank
                else (_gb(c.draft_reserved_bytes) if c.draft_reserved_bytes else "-"))
        lines.append(f"{c.dcp_size:>4}  {label:<26}{c.page_bytes:>12,}{c.pages_per_rank:>12,}{_tok(c.tokens_per_rank):>13}"
                     f"{_tok(c.tokens_per_group):>14}{pool:>17}  {c.requests:,}")
    return "\n".join(lines)


# ---- the seed's Table 1 ----

SEED = {  # what the seed states (page-level-2d-kv-resharding.txt, §1 and Table 1, §8)
    "gpu_bytes": 288 * 10**9,        # B300, "288GB HBM3e"
    "target_layers": 78,             # GLM-5.2 (§2: layers 0..77)
    "bytes_per_token_layer": 576,    # FP8 MLA latent, 576 B/token/layer (§8); replicated over TP8
    "page_size": 64,
    "draft_layers": 1,               # the built-in MTP layer (§8), an MLA layer like the others
    "tokens": {("none", 1): 2.0e6, ("draft", 1): 1.17e6, ("draft", 4): 4.67e6, ("draft", 8): 9.34e6},
}


def seed_table1(request_tokens: int = 500_000) -> dict:
    """The seed's Table 1 from its stated sizes. What it does not state is derived from two of
    its figures, and the other two are predicted with each draft-pool model:

    * everything but the KV (weights, 4 LoRA experts, activations, the target's graphs):
      ``gpu_bytes`` minus 2.0M tokens x 78 x 576 B (its DCP=1 figure without the draft);
    * the draft's reservation, from 1.17M (DCP=1 with the draft): with the "dcp" pool the
      draft's graphs (what is left once 1.17M target tokens and 1.17M x 1 draft-layer tokens
      are paid), with the "fixed" pool its pool and graphs together;
    * predicted: DCP=4 and DCP=8 with the draft (seed: 4.67M, 9.34M), and both without it.

    Returns ``{"derived": {...}, "rows": [(figure, seed or None, {model: Capacity}, role)]}``."""
    s = SEED
    kv_token = s["target_layers"] * s["bytes_per_token_layer"]
    reserved = s["gpu_bytes"] - int(s["tokens"][("none", 1)]) * kv_token
    mem = DecodeMemory(gpu_bytes=s["gpu_bytes"], graphs_bytes=reserved)  # one number: the seed names no split
    budget = mem.kv_budget()
    t1 = int(s["tokens"][("draft", 1)])
    draft_token = s["draft_layers"] * s["bytes_per_token_layer"]
    drafts = {"dcp": Draft(s["draft_layers"], s["bytes_per_token_layer"], "dcp",
                           graphs_bytes=budget - t1 * (kv_token + draft_token)),
              "fixed": Draft(s["draft_layers"], s["bytes_per_token_layer"], "fixed",
                             pool_bytes=budget - t1 * kv_token)}
    geo = dict(token_bytes=kv_token, page_size=s["page_size"], request_tokens=request_tokens)
    rows = []
    for dcp in (1, 4, 8):
        for kind in ("none", "draft"):
            seed = s["tokens"].get((kind, dcp))
            caps = {m: capacity(mem, dcp_size=dcp, draft=None if kind == "none" else d, **geo)
                    for m, d in drafts.items()}
            role = ("input: sets the non-KV reservation" if (kind, dcp) == ("none", 1) else
                    "input: sets the draft's reservation" if (kind, dcp) == ("draft", 1) else "prediction")
            rows.append((f"DCP={dcp} {'with the MTP draft' if kind == 'draft' else 'without a draft'}",
                         seed, caps, role))
    return {"derived": {"kv_bytes_per_token": kv_token, "non_kv_bytes": reserved, "kv_budget_bytes": budget,
                        # §8 read literally (the draft pool of a 32K context "holds the full 1.47 GB", all 78
                        # layers' bytes, x dcp_size): the most DCP=1 could hold with it and no graphs
                        "dcp1_tokens_if_draft_pool_is_full_kv": budget // (2 * kv_token),
                        "draft_graphs_bytes_dcp_pool": drafts["dcp"].graphs_bytes,
                        "draft_reserved_bytes_fixed_pool": drafts["fixed"].pool_bytes},
            "rows": rows}


def format_seed_table1(t: dict) -> str:
    d = t["derived"]
    out = [
        "The seed's Table 1 (B300 288 GB, TP8, FP8, page 64, 78 layers x 576 B/token/layer = "
        f"{d['kv_bytes_per_token']:,} B per token on each rank; MTP draft: 1 layer x 576 B)",
        f"derived from '~2.0M without EAGLE' (DCP=1): everything but the KV = {_gb(d['non_kv_bytes'])} "
        f"(weights, LoRA experts, activations, graphs: the seed does not split it), KV budget {_gb(d['kv_budget_bytes'])}",
        f"derived from '1.17M with EAGLE' (DCP=1): the draft's graphs {_gb(d['draft_graphs_bytes_dcp_pool'])} "
        f"(pool x dcp model), or its pool and graphs {_gb(d['draft_reserved_bytes_fixed_pool'])} (fixed model)",
        f"§8 read literally (a draft token costs all 78 layers' bytes, x dcp_size): DCP=1 could hold at most "
        f"{_tok(d['dcp1_tokens_if_draft_pool_is_full_kv'])} tokens even with no draft graphs, not 1.17M",
        f"{'figure':<30}{'seed':>8}{'pool x dcp':>12}{'dev':>8}{'req':>5}{'fixed pool':>12}{'dev':>8}{'req':>5}  role",
    ]
    for figure, seed, caps, role in t["rows"]:
        cells = ""
        for m in ("dcp", "fixed"):
            v = caps[m].tokens_per_group
            dev = f"{100 * (v / seed - 1):+.1f}%" if seed else "-"
            cells += f"{_tok(v):>12}{dev:>8}{caps[m].requests:>5}"
        out.append(f"{figure:<30}{_tok(seed) if seed else '-':>8}{cells}  {role}")
    req = t["rows"][0][2]["dcp"].request_tokens
    out.append(f"tokens = the DCP group's (rank 0's x DCP size), whole pages of 64; a deviation within 2% "
               f"reproduces the seed's figure; req = concurrent requests of {req:,} tokens that fit")
    return "\n".join(out)
