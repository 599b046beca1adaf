"""The 3D reshard (layer x head x page) of one request, for people (``vllm-dcp2d plan
--kv-heads``, ``bench/plan_heads.py``).

A model's ``K`` KV heads are sharded over each side's TP ranks (``layout.kv_head_range``);
prefill TP rank ``t`` sends ``layout.send_shard``'s layers of its heads, decode TP rank
``t`` holds heads ``kv_head_range(K, decode_tp, t)`` of the pages of DCP rank
``t % dcp_size``. Each rank's KV regions are built on synthetic addresses with the page
layout asked for (``"hnd"``: heads outside the tokens, vLLM's CPU page and GPU
``LBHNC``; ``"nhd"``: heads inside them, ``LBNHC``) and every path whose heads meet is
planned with ``plan.plan_request``.
"""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.reshard.layout import cdiv, check_size, kv_head_range, send_shard
from vllm_dcp2d.reshard.plan import plan_request
from vllm_dcp2d.reshard.regions import KVRegions

__all__ = ["head_matrix", "format_head_matrix", "check_dcp"]

_SPACE = 1 << 40  # each synthetic rank gets its own 1 TiB of address space


def check_dcp(num_kv_heads: int, decode_tp: int, dcp_size: int) -> None:
    """vLLM 0.32's rule for DCP with sharded KV heads (``ModelConfig.verify_with_parallel_config``):
    DCP > 1 needs more TP ranks than KV heads and at most ``TP / K`` DCP ranks (DCP runs over
    the ranks that hold one head). Raises ValueError naming it."""
    if dcp_size > 1 and num_kv_heads > 1 and (decode_tp <= num_kv_heads or dcp_size > decode_tp // num_kv_heads):
        raise ValueError(f"vLLM refuses decode_context_parallel_size={dcp_size} with {num_kv_heads} KV heads at "
                         f"tensor_parallel_size={decode_tp}: DCP needs TP > KV heads and DCP <= TP / KV heads "
                         f"({max(1, decode_tp // num_kv_heads) if decode_tp > num_kv_heads else 1} here)")
    if decode_tp % dcp_size:
        raise ValueError(f"decode_context_parallel_size={dcp_size} must divide tensor_parallel_size={decode_tp}")


def _regions(rank: int, layers: np.ndarray, heads: int, pool: int, token_head_bytes: int, page_size: int,
             nhd: bool) -> KVRegions:
    page = heads * page_size * token_head_bytes
    base = (rank + 1) * _SPACE + np.arange(layers.size, dtype=np.int64)[:, None] * pool * page
    return KVRegions(layers, base, [page], [page], head_count=[heads],
                     head_runs=[page_size if nhd and heads > 1 else 1])


def head_matrix(num_layers: int, num_kv_heads: int, prefill_tp: int, decode_tp: int, dcp_size: int, tokens: int,
                page_size: int, token_head_bytes: int, layout: str = "hnd", cp_size: int = 0,
                shuffle_seed: int | None = None) -> dict:
    """Plan every path of one request and summarize it as a JSON-ready dict:
    ``{"paths": [{"tp_rank", "cp_rank", "decode_rank", "dcp_rank", "layers": [a, b],
    "heads": [a, b], "pages", "bytes", "descriptors"}], "kv_bytes", "total_bytes",
    "need_bytes", ...}``. ``token_head_bytes``: K and V of one token and head (2 x
    head_size x dtype bytes); ``kv_bytes``: the model's KV of the request; ``need_bytes``:
    what the decode ranks hold together (the KV once per decode rank holding a head)."""
    if layout not in ("hnd", "nhd"):
        raise ValueError(f"layout must be 'hnd' or 'nhd', got {layout!r}")
    for name, v in (("num_layers", num_layers), ("tokens", tokens + 1), ("page_size", page_size),
                    ("token_head_bytes", token_head_bytes)):
        check_size(name, v)
    check_dcp(num_kv_heads, decode_tp, dcp_size)
    pages = cdiv(tokens, page_size)
    local = cdiv(pages, dcp_size)
    rng = np.random.default_rng(shuffle_seed)
    src_ids = np.arange(pages) if shuffle_seed is None else rng.permutation(2 * pages)[:pages]
    dst_ids = np.arange(local) if shuffle_seed is None else rng.permutation(2 * local)[:local]
    src_pool, dst_pool = max(1, 2 * pages), max(1, 2 * local)
    nhd = layout == "nhd"
    tp_of, src, src_layers, src_heads = [], [], [], []
    for t in range(prefill_tp):
        shard = send_shard(num_layers, num_kv_heads, prefill_tp, t, cp_size)  # raises for a cp_size too large
        if shard is None:
            continue
        _, _, layers, heads = shard
        tp_of.append(t)
        src_layers.append(layers)
        src_heads.append(heads)
        src.append(_regions(t, np.arange(layers.start, layers.stop), len(heads), src_pool, token_head_bytes,
                            page_size, nhd))
    dst_heads = [kv_head_range(num_kv_heads, decode_tp, t) for t in range(decode_tp)]
    dst = [_regions(prefill_tp + t, np.arange(num_layers), len(h), dst_pool, token_head_bytes, page_size, nhd)
           for t, h in enumerate(dst_heads)]
    dcp_ranks = [t % dcp_size for t in range(decode_tp)]
    plans = plan_request(num_layers, len(src), src, src_ids, dst, dst_ids, src_heads=src_heads,
                         dst_heads=dst_heads, src_layers=src_layers, dcp_ranks=dcp_ranks)
    paths = []
    for (r, d), desc in plans.items():
        sh, dh = src_heads[r], dst_heads[d]
        paths.append({"tp_rank": tp_of[r], "cp_rank": r, "decode_rank": d, "dcp_rank": dcp_ranks[d],
                      "layers": [src_layers[r].start, src_layers[r].stop],
                      "heads": [max(sh.start, dh.start), min(sh.stop, dh.stop)],
                      "pages": len(range(dcp_ranks[d], pages, dcp_size)), "bytes": desc.nbytes,
                      "descriptors": len(desc)})
    head_page = page_size * token_head_bytes
    kv_bytes = num_layers * pages * num_kv_heads * head_page
    need = sum(num_layers * len(range(dcp_ranks[d], pages, dcp_size)) * len(h) * head_page
               for d, h in enumerate(dst_heads))
    return {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
            "dcp_size": dcp_size, "cp_size": len(src) // len(set(src_heads)), "tokens": tokens, "page_size": page_size, "pages": pages,
            "token_head_bytes": token_head_bytes, "layout": layout, "paths": paths, "kv_bytes": kv_bytes,
            "need_bytes": need, "total_bytes": sum(p["bytes"] for p in paths),
            "descriptors": sum(p["descriptors"] for p in paths)}


def _span(a: list[int], word: str) -> str:
    return f"{word} {a[0]}" if a[1] - a[0] == 1 else f"{word}s {a[0]}-{a[1] - 1}"


def format_head_matrix(m: dict) -> str:
    """A table of the paths plus totals (bytes exact)."""
    lines = [f"3D reshard of one request: {m['num_layers']} layers x {m['num_kv_heads']} KV heads x {m['pages']} "
             f"pages of {m['page_size']} tokens ({m['tokens']} tokens), {m['token_head_bytes']} B per token and "
             f"head, {m['layout'].upper()} pages; prefill TP={m['prefill_tp']} (cp_size {m['cp_size']}) -> decode "
             f"TP={m['decode_tp']} DCP={m['dcp_size']}", "",
             f"{'prefill':>7} {'decode':>6} {'dcp':>3}  {'layers':<12} {'heads':<9} {'pages':>6} {'bytes':>12} "
             f"{'descriptors':>11}"]
    for p in m["paths"]:
        lines.append(f"{p['tp_rank']:>7} {p['decode_rank']:>6} {p['dcp_rank']:>3}  "
                     f"{_span(p['layers'], 'layer'):<12} {_span(p['heads'], 'head'):<9} {p['pages']:>6} "
                     f"{p['bytes']:>12} {p['descriptors']:>11}")
    ratio = m["total_bytes"] / m["kv_bytes"] if m["kv_bytes"] else 0.0
    lines += ["", f"total on the wire: {m['total_bytes']} B = {ratio:.2f}x the KV ({m['kv_bytes']} B); the decode "
                  f"ranks hold {m['need_bytes']} B ({m['need_bytes'] / m['kv_bytes'] if m['kv_bytes'] else 0:.2f}x: "
                  f"each decode rank holding a head gets it); {m['descriptors']} descriptors"]
    return "\n".join(lines)
