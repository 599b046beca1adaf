"""The 2D reshard matrix of one request, for people (``vllm-dcp2d plan``).

Builds each rank's KV regions on synthetic addresses (prefill rank ``r``
holds only its own layers, decode DCP rank ``d`` holds all layers) and plans
every ``(cp_rank, dcp_rank)`` path with :func:`plan_request`.
"""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.plan import Descriptors, KVRegions, plan_request
from vllm_dcp2d.layout import _check_size, cdiv, cp_layer_range

__all__ = ["synthetic_request", "reshard_matrix", "format_matrix", "matrix_from_records"]

_SPACE = 1 << 40  # each synthetic rank gets its own 1 TiB of address space


def synthetic_request(num_layers: int, cp_size: int, dcp_size: int, tokens: int, page_size: int,
                      page_bytes: int, shuffle_seed: int | None = None):
    """Regions and block tables of one request on synthetic addresses.

    Returns ``(src_regions[cp_size], src_block_ids[P], dst_regions[dcp_size], dst_block_ids[M])``
    with ``P = cdiv(tokens, page_size)`` and ``M = cdiv(P, dcp_size)``. Block ids
    are ``arange`` or, with ``shuffle_seed``, a random permutation of a 2x larger pool.
    """
    if tokens < 0 or page_size < 1 or page_bytes < 1:
        raise ValueError(f"need tokens >= 0, page_size >= 1, page_bytes >= 1; got {tokens}, "
                         f"{page_size}, {page_bytes}")
    cp_size, dcp_size = _check_size("cp_size", cp_size), _check_size("dcp_size", dcp_size)
    pages = cdiv(tokens, page_size)
    local = cdiv(pages, dcp_size)
    rng = np.random.default_rng(shuffle_seed)
    if shuffle_seed is None:
        src_ids, dst_ids, src_pool, dst_pool = np.arange(pages), np.arange(local), pages, local
    else:
        src_pool, dst_pool = 2 * pages, 2 * local
        src_ids, dst_ids = rng.permutation(src_pool)[:pages], rng.permutation(dst_pool)[:local]
    src = []
    for r in range(cp_size):
        layers = np.array(cp_layer_range(num_layers, cp_size, r), dtype=np.int64)
        base = (r + 1) * _SPACE + np.arange(layers.size) * src_pool * page_bytes
        src.append(KVRegions.uniform(layers, base, page_bytes))
    dst = []
    for d in range(dcp_size):
        base = (cp_size + d + 1) * _SPACE + np.arange(num_layers) * dst_pool * page_bytes
        dst.append(KVRegions.uniform(np.arange(num_layers), base, page_bytes))
    return src, src_ids, dst, dst_ids


def reshard_matrix(num_layers: int, cp_size: int, dcp_size: int, tokens: int, page_size: int,
                   bytes_per_token_layer: int, shuffle_seed: int | None = None) -> dict:
    """Plan every path of one request and summarize it as a JSON-ready dict.

    ``{"paths": [{"cp_rank", "dcp_rank", "layers": [start, end], "pages", "bytes",
    "descriptors"}, ...], "total_bytes", "naive_bytes", "kv_bytes", ...}``
    """
    page_bytes = page_size * bytes_per_token_layer
    src, src_ids, dst, dst_ids = synthetic_request(num_layers, cp_size, dcp_size, tokens, page_size,
                                                   page_bytes, shuffle_seed)
    plans: dict[tuple[int, int], Descriptors] = plan_request(num_layers, cp_size, src, src_ids, dst, dst_ids)
    pages = len(src_ids)
    paths = []
    for (r, d), desc in plans.items():
        lr = cp_layer_range(num_layers, cp_size, r)
        paths.append({"cp_rank": r, "dcp_rank": d, "layers": [lr.start, lr.stop],
                      "pages": len(range(d, pages, dcp_size)), "bytes": desc.nbytes,
                      "descriptors": len(desc)})
    kv_bytes = num_layers * pages * page_bytes
    return {"num_layers": num_layers, "cp_size": cp_size, "dcp_size": dcp_size, "tokens": tokens,
            "page_size": page_size, "pages": pages, "page_bytes": page_bytes, "paths": paths,
            "kv_bytes": kv_bytes, "total_bytes": sum(p["bytes"] for p in paths),
            "naive_bytes": kv_bytes * dcp_size}


def matrix_from_records(records: list[dict], tokens: int) -> dict | None:
    """The :func:`reshard_matrix` of a request served through PD, from its consumer
    ``stats_file`` records (one per (cp rank, decode TP rank) path that moved it); None
    when no record tells the bytes per token and layer.

    The bytes per token and layer come from a record that moved pages: a DCP rank may
    have none (a prompt shorter than ``dcp_size`` pages), and a draft's replicated bytes
    are left out (records with any are skipped)."""
    ok = [r for r in records if r.get("ok") and r.get("bytes", 0) > 0 and not r.get("replicated_bytes", 0)]
    if not ok:
        return None
    r = max(ok, key=lambda r: r["bytes"])
    rank_pages = len(range(r["dcp_rank"], r["pages"], r["dcp_size"]))
    layers = r["layers"][1] - r["layers"][0]
    per_token_layer, rest = divmod(r["bytes"], layers * rank_pages * r["page_size"])
    if rest:  # not whole pages of one size (a cached prefix): no honest figure
        return None
    num_layers = max(x["layers"][1] for x in records if x.get("ok"))
    return reshard_matrix(num_layers, r["cp_size"], r["dcp_size"], tokens, r["page_size"], per_token_layer)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    raise AssertionError("unreachable")


def format_matrix(m: dict) -> str:
    """A table of the paths plus totals, in decimal units (1 GB = 1e9 B)."""
    lines = [
        f"2D reshard of one request: {m['num_layers']} layers, CP={m['cp_size']} -> DCP={m['dcp_size']}, "
        f"{m['tokens']} tokens = {m['pages']} pages x {m['page_size']} tokens, "
        f"{m['page_bytes']} B per page per layer",
        "",
        f"{'cp_rank':>7} {'dcp_rank':>8}  {'layers':<10} {'pages':>7} {'bytes':>11} {'descriptors':>11}",
    ]
    for p in m["paths"]:
        lr = f"[{p['layers'][0]}, {p['layers'][1]})"
        lines.append(f"{p['cp_rank']:>7} {p['dcp_rank']:>8}  {lr:<10} {p['pages']:>7} "
                     f"{_human(p['bytes']):>11} {p['descriptors']:>11}")
    per_d = {}
    for p in m["paths"]:
        per_d[p["dcp_rank"]] = per_d.get(p["dcp_rank"], 0) + p["bytes"]
    lines.append("")
    for d, b in sorted(per_d.items()):
        lines.append(f"into DCP rank {d}: {_human(b)}")
    total, naive = m["total_bytes"], m["naive_bytes"]
    ratio = total / m["kv_bytes"] if m["kv_bytes"] else 0.0
    lines.append(f"total on the wire (2D reshard): {_human(total)} = {ratio:.2f}x the KV")
    lines.append(f"naive (full KV to every DCP rank): {_human(naive)} = {m['dcp_size']:.2f}x the KV")
    return "\n".join(lines)
