"""The 2D reshard matrix of one request, for people (``vllm-dcp2d plan``).

Builds each rank's KV regions on synthetic addresses (prefill rank ``r``
holds only its own layers, decode DCP rank ``d`` holds all layers) and plans
every ``(cp_rank, dcp_rank)`` path with :func:`plan_request`.
"""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.reshard.layout import cdiv, check_size, cp_layer_range
from vllm_dcp2d.reshard.plan import Descriptors, plan_request
from vllm_dcp2d.reshard.regions import KVRegions

__all__ = ["synthetic_request", "reshard_matrix", "format_matrix", "matrix_from_records", "layer_pattern"]

_SPACE = 1 << 40  # each synthetic rank gets its own 1 TiB of address space


def synthetic_request(num_layers: int, cp_size: int, dcp_size: int, tokens: int, page_size: int,
                      page_bytes, shuffle_seed: int | None = None, draft_layers: int = 0,
                      plane_layers: np.ndarray | None = None):
    """Regions and block tables of one request on synthetic addresses.

    page_bytes: bytes of one page of one layer, or a sequence of them, one per cache a
    layer holds (its planes: sparse MLA's latent and indexer caches), each its own region.
    plane_layers: bool ``[num_layers, planes]``, which layer holds which plane (default
    every layer every plane; a DSA layer that reuses an earlier layer's top-k has no
    indexer cache): ``KVRegions.region_mask`` on both sides.
    Returns ``(src_regions[cp_size], src_block_ids[P], dst_regions[dcp_size], dst_block_ids)``
    with ``P = cdiv(tokens, page_size)``. ``dst_block_ids`` is ``[M]``, ``M = cdiv(P, dcp_size)``,
    or with ``draft_layers`` (the last layers: a speculative draft's, a replicated group on
    decode, every page on every DCP rank) the pair ``([M], [P])``. Block ids are ``arange``
    or, with ``shuffle_seed``, a random permutation of a 2x larger pool.
    """
    planes = np.atleast_1d(np.asarray(page_bytes, dtype=np.int64))
    if tokens < 0 or page_size < 1 or planes.size < 1 or planes.min() < 1 or not 0 <= draft_layers <= num_layers:
        raise ValueError(f"need tokens >= 0, page_size >= 1, page_bytes >= 1, 0 <= draft_layers <= num_layers; "
                         f"got {tokens}, {page_size}, {planes.tolist() if planes.size > 1 else int(planes[0])}, "
                         f"{draft_layers} of {num_layers}")
    cp_size, dcp_size = check_size("cp_size", cp_size), check_size("dcp_size", dcp_size)
    held = (np.ones((num_layers, planes.size), dtype=bool) if plane_layers is None
            else np.asarray(plane_layers, dtype=bool))
    if held.shape != (num_layers, planes.size):
        raise ValueError(f"plane_layers has shape {held.shape}, expected layers x planes = {(num_layers, planes.size)}")
    pages = cdiv(tokens, page_size)
    local = cdiv(pages, dcp_size)
    rng = np.random.default_rng(shuffle_seed)
    if shuffle_seed is None:
        src_ids, dst_ids, draft_ids = np.arange(pages), np.arange(local), np.arange(pages)
        src_pool, dst_pool, draft_pool = pages, local, pages
    else:
        src_pool, dst_pool, draft_pool = 2 * pages, 2 * local, 2 * pages
        src_ids, dst_ids = rng.permutation(src_pool)[:pages], rng.permutation(dst_pool)[:local]
        draft_ids = rng.permutation(draft_pool)[:pages]
    src = []
    for r in range(cp_size):
        layers = np.array(cp_layer_range(num_layers, cp_size, r), dtype=np.int64)
        base = (r + 1) * _SPACE + _offsets(np.full(layers.size, src_pool), planes)
        src.append(KVRegions(layers, base, planes, planes, region_mask=held[layers]))
    # Decode: the target's layers, then the draft's, each (layer, plane) a pool of its group's size.
    group = (np.arange(num_layers) >= num_layers - draft_layers).astype(np.int64)
    offsets = _offsets(np.where(group == 1, draft_pool, dst_pool), planes)
    dst = []
    for d in range(dcp_size):
        dst.append(KVRegions(np.arange(num_layers), (cp_size + d + 1) * _SPACE + offsets, planes, planes, group,
                             np.array([True, False][: 2 if draft_layers else 1]), region_mask=held))
    return src, src_ids, dst, ((dst_ids, draft_ids) if draft_layers else dst_ids)


def _offsets(pool: np.ndarray, planes: np.ndarray) -> np.ndarray:
    """int64 ``[L, R]``: where each (layer, plane) pool of ``pool[l]`` pages of
    ``planes[p]`` bytes starts, one after another, layer-major."""
    sizes = (pool[:, None] * planes[None, :]).reshape(-1)
    return (np.cumsum(sizes) - sizes).reshape(pool.size, planes.size)


def layer_pattern(pattern: str, num_layers: int) -> np.ndarray:
    """bool ``[num_layers]``: which layers hold a cache, from ``pattern``, one letter per layer
    as vLLM's ``index_topk_pattern`` writes them: ``F`` holds it ("full": the layer runs its
    own indexer), ``S`` does not ("shared": it reuses an earlier layer's top-k). A part in
    parentheses repeats to the last layer: ``FF(SSSF)`` is vLLM's ``index_topk_freq=4``
    (with its default ``index_skip_topk_offset`` 2). Raises ValueError naming the pattern."""
    import re

    m = re.fullmatch(r"([FS]*)(?:\(([FS]+)\))?", pattern)
    if m is None or not pattern:
        raise ValueError(f"layer pattern {pattern!r}: expected letters F (holds the cache) and S (does not), one "
                         f"per layer, the last part in parentheses repeated (e.g. FF(SSSF))")
    head, tail = m.group(1), m.group(2) or ""
    if tail:
        text = head + tail * (max(0, num_layers - len(head)) // len(tail) + 1)
        text = text[:num_layers]
    else:
        text = head
    if len(text) != num_layers:
        raise ValueError(f"layer pattern {pattern!r} names {len(text)} layers, the model has {num_layers} "
                         f"(repeat a part with parentheses: FF(SSSF))")
    return np.frombuffer(text.encode(), dtype=np.uint8) == ord("F")


def reshard_matrix(num_layers: int, cp_size: int, dcp_size: int, tokens: int, page_size: int,
                   bytes_per_token_layer: int, shuffle_seed: int | None = None, draft_layers: int = 0,
                   caches: list[tuple] | None = None) -> dict:
    """Plan every path of one request and summarize it as a JSON-ready dict.

    ``{"paths": [{"cp_rank", "dcp_rank", "layers": [start, end], "pages", "bytes",
    "descriptors"}, ...], "total_bytes", "naive_bytes", "kv_bytes", "draft_kv_bytes", ...}``;
    ``draft_layers``: the last layers, a draft's, sent whole to every DCP rank; ``caches``:
    ``[(name, bytes per token and layer[, layer pattern])]`` of the caches the layers hold
    (sparse MLA: the latent and the indexer's keys, both DCP-sharded on decode), instead of
    one cache of ``bytes_per_token_layer``; a pattern (:func:`layer_pattern`, over the
    target's layers) says which layers hold it, every layer without one; a draft's layers
    hold every cache (vLLM builds an MTP layer's indexer whatever the pattern). Each one's
    KV comes back in ``"caches"``.
    """
    caches = [(c[0], c[1], c[2] if len(c) > 2 else None) for c in caches or [("kv", bytes_per_token_layer)]]
    per_token = [b for _, b, _ in caches]
    page_bytes = page_size * sum(per_token)
    held = np.ones((num_layers, len(caches)), dtype=bool)
    for p, (_, _, pattern) in enumerate(caches):
        if pattern is not None:
            held[:num_layers - draft_layers, p] = layer_pattern(pattern, num_layers - draft_layers)
    src, src_ids, dst, dst_ids = synthetic_request(num_layers, cp_size, dcp_size, tokens, page_size,
                                                   [page_size * b for b in per_token], shuffle_seed, draft_layers,
                                                   None if held.all() else held)
    plans: dict[tuple[int, int], Descriptors] = plan_request(num_layers, cp_size, src, src_ids, dst, dst_ids)
    pages = len(src_ids)
    paths = []
    for (r, d), desc in plans.items():
        lr = cp_layer_range(num_layers, cp_size, r)
        paths.append({"cp_rank": r, "dcp_rank": d, "layers": [lr.start, lr.stop],
                      "pages": len(range(d, pages, dcp_size)), "bytes": desc.nbytes,
                      "descriptors": len(desc)})
    layers_of = held.sum(axis=0)
    kv_bytes = int(sum(int(n) * pages * page_size * b for n, b in zip(layers_of, per_token)))
    out = {"num_layers": num_layers, "cp_size": cp_size, "dcp_size": dcp_size, "tokens": tokens,
           "page_size": page_size, "pages": pages, "page_bytes": page_bytes, "paths": paths,
           "kv_bytes": kv_bytes, "total_bytes": sum(p["bytes"] for p in paths),
           "naive_bytes": kv_bytes * dcp_size, "draft_layers": draft_layers,
           "draft_kv_bytes": draft_layers * pages * page_bytes}
    if len(caches) > 1:
        out["caches"] = [{"name": n, "bytes_per_token_layer": b, "page_bytes": page_size * b,
                          "layers": int(layers_of[p]), "kv_bytes": int(layers_of[p]) * pages * page_size * b}
                         for p, (n, b, _) in enumerate(caches)]
    return out


def matrix_from_records(records: list[dict], tokens: int) -> dict | None:
    """The :func:`reshard_matrix` of a request served through PD, from its consumer
    ``stats_file`` records (one per (cp rank, decode TP rank) path that moved it); None
    when no record tells the bytes per token and layer.

    The bytes per token and layer come from a record that moved pages (a DCP rank may
    have none: a prompt shorter than ``dcp_size`` pages): the target's part of its bytes
    over its target layers and pages, or its draft's (``replicated_bytes``, every page)
    over its draft layers. The matrix is returned only if it gives every record's path
    exactly the bytes the record moved (not so for records written before
    ``draft_layers`` was). A request whose first pages were cached on decode moved fewer
    pages than ``pages`` says, which the records cannot tell from smaller pages: the
    demo asks for its first request's matrix only, on instances it just started."""
    ok = [r for r in records if r.get("ok") and r.get("bytes", 0) > 0]
    if not ok:
        return None
    num_layers = max(x["layers"][1] for x in records if x.get("ok"))
    draft = ok[0].get("draft_layers", 0)
    m = _matrix_from(ok, num_layers, draft, tokens)
    if m is None:
        return None
    planned = {(p["cp_rank"], p["dcp_rank"]): p["bytes"] for p in m["paths"]}
    moved = all(planned.get((r["cp_rank"], r["dcp_rank"])) == r["bytes"] for r in records if r.get("ok"))
    return m if moved else None


def _matrix_from(ok: list[dict], num_layers: int, draft: int, tokens: int) -> dict | None:
    first_draft = num_layers - draft
    for r in sorted(ok, key=lambda r: -r["bytes"]):
        a, b = r["layers"]
        target = max(0, min(b, first_draft) - a)
        rank_pages = len(range(r["dcp_rank"], r["pages"], r["dcp_size"]))
        rep = r.get("replicated_bytes", 0)
        if target and rank_pages:
            per_token_layer, rest = divmod(r["bytes"] - rep, target * rank_pages * r["page_size"])
        elif rep:
            per_token_layer, rest = divmod(rep, (b - a - target) * r["pages"] * r["page_size"])
        else:
            continue
        if rest or per_token_layer < 1:  # not whole pages of one size: no honest figure
            return None
        return reshard_matrix(num_layers, r["cp_size"], r["dcp_size"], tokens, r["page_size"], per_token_layer,
                              draft_layers=draft)
    return None


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
        f"{m['page_bytes']} B per page per layer"
        + (" with every cache" if any(c["layers"] < m["num_layers"] for c in m.get("caches", ())) else ""),
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
    draft = m.get("draft_kv_bytes", 0)
    if draft:
        lines.insert(1, f"(pages: the target's on that DCP rank; the draft's last {m['draft_layers']} layer(s) "
                        f"send all {m['pages']} to each)")
        target = m["kv_bytes"] - draft
        lines.append(f"  the target's {m['num_layers'] - m['draft_layers']} layers: "
                     f"{_human(total - draft * m['dcp_size'])} = "
                     f"{(total - draft * m['dcp_size']) / target if target else 0.0:.2f}x their KV; the draft's "
                     f"{m['draft_layers']} (not sharded on decode): {_human(draft * m['dcp_size'])} = "
                     f"{m['dcp_size']:.2f}x their KV")
    for c in m.get("caches", ()):
        where = ("every layer" if c.get("layers", m["num_layers"]) == m["num_layers"]
                 else f"{c['layers']} of the {m['num_layers']} layers")
        lines.append(f"  {c['name']} cache: {c['bytes_per_token_layer']} B per token and layer, its own page format "
                     f"({c['page_bytes']} B per page), in {where}, DCP-sharded on decode: "
                     f"{_human(c['kv_bytes'])} of the KV")
    lines.append(f"naive (full KV to every DCP rank): {_human(naive)} = {m['dcp_size']:.2f}x the KV")
    return "\n".join(lines)
