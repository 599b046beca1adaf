"""Bytes and descriptors per path of the 3D reshard (layer x head x page, issue 39) for
GQA models whose KV heads are sharded over TP, against the plan: a tiny GQA model
(2 KV heads) and a Llama-8B-like one (8 KV heads, 32 layers, head_size 128, bf16:
512 B of K and V per token and head), 16-token pages, prefill TP 1 and 2 -> decode TP 2
(DCP 1: vLLM 0.32 allows DCP > 1 with GQA only where TP > KV heads, DCP <= TP / KV heads,
so decode TP 4 DCP 2 for the 2-head model is shown too), each for vLLM's CPU page
and GPU HND (heads outside the tokens) and GPU NHD (heads inside them).

    .venv/bin/python bench/plan_heads.py [--tokens 8192] [--json]

Checks for every shape that the paths' bytes sum to 1.0x the KV (the decode ranks hold
each head once) and that each path carries layers x common heads x its pages, exactly;
prints one row per path, and the planning time.
"""

from __future__ import annotations

import argparse
import json
import time

from vllm_dcp2d.reshard.report_heads import check_dcp, head_matrix

MODELS = {"gqa-2h": dict(num_layers=4, num_kv_heads=2, token_head_bytes=2 * 32 * 4),   # tiny llama, fp32
          "llama8b": dict(num_layers=32, num_kv_heads=8, token_head_bytes=2 * 128 * 2)}  # bf16
SHAPES = [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2), (1, 4, 2), (2, 4, 2)]  # prefill TP, decode TP, DCP


def run(tokens: int, page: int = 16):
    rows, totals = [], []
    for model, kw in MODELS.items():
        for tp_p, tp_d, dcp in SHAPES:
            try:
                check_dcp(kw["num_kv_heads"], tp_d, dcp)
            except ValueError as e:
                totals.append({"model": model, "shape": f"TP{tp_p}->TP{tp_d} DCP{dcp}", "refused": str(e)})
                continue
            for layout in ("hnd", "nhd"):
                t0 = time.perf_counter()
                m = head_matrix(tokens=tokens, page_size=page, prefill_tp=tp_p, decode_tp=tp_d, dcp_size=dcp,
                                layout=layout, shuffle_seed=0, **kw)
                ms = (time.perf_counter() - t0) * 1e3
                head_page = page * kw["token_head_bytes"]
                for p in m["paths"]:  # each path: its layers x common heads x its pages, nothing else
                    assert p["bytes"] == ((p["layers"][1] - p["layers"][0]) * (p["heads"][1] - p["heads"][0])
                                          * p["pages"] * head_page), p
                    rows.append({"model": model, "layout": layout, "prefill_tp": tp_p, "decode_tp": tp_d,
                                 "dcp": dcp, **p})
                assert m["total_bytes"] == m["need_bytes"] == m["kv_bytes"], m  # 1.0x: no head replicated on decode
                totals.append({"model": model, "shape": f"TP{tp_p}->TP{tp_d} DCP{dcp}", "layout": layout,
                               "paths": len(m["paths"]), "bytes": m["total_bytes"], "kv_bytes": m["kv_bytes"],
                               "x_kv": m["total_bytes"] / m["kv_bytes"], "descriptors": m["descriptors"],
                               "plan_ms": ms})
    return rows, totals


def _span(a: list[int]) -> str:
    return str(a[0]) if a[1] - a[0] == 1 else f"{a[0]}-{a[1] - 1}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows, totals = run(args.tokens)
    if args.json:
        print(json.dumps({"paths": rows, "totals": totals}))
        return
    print(f"{args.tokens} tokens, 16-token pages, shuffled block ids; per path (prefill TP rank -> decode TP rank):")
    print(f"{'model':<8} {'layout':<6} {'shape':<14} {'path':<7} {'layers':<7} {'heads':<6} {'pages':>5} "
          f"{'bytes':>11} {'descriptors':>11}")
    for r in rows:
        shape = f"TP{r['prefill_tp']}->TP{r['decode_tp']}/{r['dcp']}"
        print(f"{r['model']:<8} {r['layout']:<6} {shape:<14} {r['tp_rank']}->{r['decode_rank']:<4} "
              f"{_span(r['layers']):<7} {_span(r['heads']):<6} {r['pages']:>5} "
              f"{r['bytes']:>11} {r['descriptors']:>11}")
    print("\nper shape (sum over paths against the plan):")
    for t in totals:
        if "refused" in t:
            print(f"{t['model']:<8} {t['shape']:<16} not run: {t['refused']}")
        else:
            print(f"{t['model']:<8} {t['shape']:<16} {t['layout']:<4} {t['paths']} paths, {t['bytes']} B = "
                  f"{t['x_kv']:.2f}x the KV, {t['descriptors']} descriptors, planned in {t['plan_ms']:.1f} ms")


if __name__ == "__main__":
    main()
