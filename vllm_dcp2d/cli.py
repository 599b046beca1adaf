"""``vllm-dcp2d`` command line.

  vllm-dcp2d plan   --num-layers 78 --cp 8 --dcp 4 --tokens 32768 --page-size 64 \\
                    (--bytes-per-token-layer 576 | --cache latent:656 --cache indexer:132[:FF(SSSF)])
                    [--draft-layers N] [--shuffle SEED] [--json]
  vllm-dcp2d plan   --kv-heads 8 --prefill-tp 2 --decode-tp 2 [--dcp 1] --num-layers 32 --page-size 16 \\
                    --tokens 8192 [--head-bytes 512] [--layout hnd|nhd] [--cp N] [--json]
                    (KV heads sharded over TP: the 3D paths, layer x head x page)
  vllm-dcp2d plan --capacity (--gpu-memory 288GB [--memory-utilization 0.9] [--weights B] [--lora-experts N
                    --lora-expert-bytes B] [--activations B] [--cuda-graphs B] | --kv-cache-memory-bytes B)
                    --num-layers 79 --draft-layers 1 (--bytes-per-token-layer 576 | --cache NAME:BYTES[:PATTERN] ...)
                    --page-size 64 --dcp 1,4,8 --tokens 500000 [--draft-pool dcp|fixed] [--draft-pool-bytes B]
                    [--draft-graphs B] [--draft-bytes-per-token-layer B] [--json]
  vllm-dcp2d plan --capacity --seed-table1  (the seed's Table 1: what is derived, what is predicted)
  vllm-dcp2d proxy  ...   (PD proxy, see ``vllm-dcp2d proxy --help``)
  vllm-dcp2d demo   ...   (end-to-end demo, see ``vllm-dcp2d demo --help``)
  vllm-dcp2d compat       (the vLLM patches, whether each fits the installed vLLM, and which DCP2D
                           instances start on it)
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys

# Subcommands implemented in their own modules, each exposing main(argv) -> int.
_DELEGATED = {"proxy": "vllm_dcp2d.proxy", "demo": "vllm_dcp2d.demo", "compat": "vllm_dcp2d.vllm_compat.registry"}


def _plan(argv: list[str]) -> int:
    if "--capacity" in argv:
        return _plan_capacity([a for a in argv if a != "--capacity"])
    from vllm_dcp2d.reshard.report import format_matrix, reshard_matrix

    ap = argparse.ArgumentParser(prog="vllm-dcp2d plan",
                                 description="Print the 2D reshard matrix of one request.")
    ap.add_argument("--num-layers", type=int, default=78)
    ap.add_argument("--cp", type=int, default=8, help="prefill CP (layer-split) ranks")
    ap.add_argument("--dcp", type=int, default=4, help="decode DCP ranks")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--bytes-per-token-layer", type=int, default=None,
                    help="KV bytes per token per layer (default 576: GLM-5.2's MLA latent, 512 + 64)")
    ap.add_argument("--cache", action="append", default=None, metavar="NAME:BYTES[:PATTERN]",
                    help="a cache the layers hold, with its bytes per token (repeat it; instead of "
                         "--bytes-per-token-layer): GLM-5.2 with sparse MLA: --cache latent:656 --cache indexer:132. "
                         "PATTERN: which of the target's layers hold it, one letter per layer as vLLM's "
                         "index_topk_pattern (F holds it, S does not: a 'shared' layer reusing an earlier "
                         "layer's top-k), a part in parentheses repeated: indexer:132:FF(SSSF) is "
                         "index_topk_freq=4; draft layers hold every cache")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="use shuffled block ids drawn with this seed")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="of --num-layers, the last ones a speculative draft's (MTP, EAGLE): every DCP rank gets "
                         "all their pages")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="the model's KV heads, sharded over each side's TP ranks: plan layer x head x page "
                         "(with --prefill-tp, --decode-tp; --cp is then the prefill's cp_size, default what the "
                         "model allows; --dcp default 1)")
    ap.add_argument("--prefill-tp", type=int, default=1, help="prefill tensor_parallel_size (with --kv-heads)")
    ap.add_argument("--decode-tp", type=int, default=1, help="decode tensor_parallel_size (with --kv-heads)")
    ap.add_argument("--head-bytes", type=int, default=512,
                    help="K and V bytes of one token and KV head (with --kv-heads; default 512: head_size 128, bf16)")
    ap.add_argument("--layout", choices=("hnd", "nhd"), default="hnd",
                    help="page layout (with --kv-heads): hnd = heads outside the tokens (vLLM's CPU page, GPU "
                         "LBHNC), nhd = inside them (LBNHC)")
    args = ap.parse_args(argv)
    if args.kv_heads is not None:
        return _plan_heads(ap, args, argv)
    if args.cache and args.bytes_per_token_layer is not None:
        ap.error("give --cache or --bytes-per-token-layer, not both")
    try:
        caches = [_cache(c) for c in args.cache] if args.cache else None
        m = reshard_matrix(args.num_layers, args.cp, args.dcp, args.tokens, args.page_size,
                           args.bytes_per_token_layer or 576, args.shuffle, args.draft_layers, caches)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        keys = ("paths", "total_bytes", "naive_bytes", "kv_bytes", "num_layers", "cp_size", "dcp_size",
                "tokens", "page_size", "pages", "page_bytes", "draft_layers", "draft_kv_bytes", "caches")
        print(json.dumps({k: m[k] for k in keys if k in m}))
    else:
        print(format_matrix(m))
    return 0


def _plan_heads(ap, args, argv: list[str]) -> int:
    from vllm_dcp2d.reshard.report_heads import format_head_matrix, head_matrix

    given = {a.split("=")[0] for a in argv}
    try:
        m = head_matrix(args.num_layers, args.kv_heads, args.prefill_tp, args.decode_tp,
                        args.dcp if "--dcp" in given else 1, args.tokens, args.page_size, args.head_bytes,
                        args.layout, args.cp if "--cp" in given else 0, args.shuffle)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(m) if args.json else format_head_matrix(m))
    return 0


def _plan_capacity(argv: list[str]) -> int:
    from vllm_dcp2d.reshard import capacity as cap
    from vllm_dcp2d.reshard.report import layer_pattern

    ap = argparse.ArgumentParser(prog="vllm-dcp2d plan --capacity",
                                 description="KV tokens per decode rank and DCP group, and the requests of a length "
                                             "that fit, with and without a speculative draft (sizes: 288GB, 64MiB, "
                                             "3.5e9 or bytes).")

    def size(text: str) -> int:
        try:
            return cap.parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    ap.add_argument("--seed-table1", action="store_true", help="reproduce the seed's Table 1 and say how")
    ap.add_argument("--gpu-memory", type=size, default=0, help="one GPU's memory")
    ap.add_argument("--memory-utilization", type=float, default=1.0, help="the share the engine may use")
    ap.add_argument("--weights", type=size, default=0, help="one rank's weights")
    ap.add_argument("--lora-experts", type=int, default=0, help="LoRA experts loaded at once")
    ap.add_argument("--lora-expert-bytes", type=size, default=0, help="one LoRA expert's bytes on one rank")
    ap.add_argument("--activations", type=size, default=0, help="the activation peak one rank reserves")
    ap.add_argument("--cuda-graphs", type=size, default=0, help="the target's CUDA graphs on one rank")
    ap.add_argument("--kv-cache-memory-bytes", type=size, default=None,
                    help="the KV budget per rank directly (vLLM's flag), instead of the memory above")
    ap.add_argument("--num-layers", type=int, default=78, help="KV layers, the draft's included")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="of --num-layers, the last ones a speculative draft's (GLM-5.2's MTP: --num-layers 79 "
                         "--draft-layers 1)")
    ap.add_argument("--bytes-per-token-layer", type=int, default=None,
                    help="one rank's KV bytes per token of one layer (default 576: GLM-5.2's latent)")
    ap.add_argument("--cache", action="append", default=None, metavar="NAME:BYTES[:PATTERN]",
                    help="a cache the layers hold, bytes per token on one rank (repeat it; PATTERN as for plan: "
                         "which target layers hold it, e.g. indexer:132:FF(SSSF))")
    ap.add_argument("--draft-bytes-per-token-layer", type=int, default=None,
                    help="the draft's, if not the target's")
    ap.add_argument("--draft-pool", choices=("dcp", "fixed"), default="dcp",
                    help="dcp: the draft pool holds dcp_size x the target's tokens per rank (design §8, vLLM with "
                         "this plugin); fixed: --draft-pool-bytes whatever the DCP size")
    ap.add_argument("--draft-pool-bytes", type=size, default=0, help="with --draft-pool fixed")
    ap.add_argument("--draft-graphs", type=size, default=0, help="the draft's CUDA graphs on one rank")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dcp", default="1,4,8", help="DCP sizes, comma-separated")
    ap.add_argument("--tokens", type=int, default=32768, help="the request length for the concurrency column")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        if args.seed_table1:
            t = cap.seed_table1(args.tokens if "--tokens" in argv else 500_000)
            if args.json:
                print(json.dumps({"derived": t["derived"], "rows": [
                    {"figure": f, "seed": s, "role": r, **{m: c.tokens_per_group for m, c in caps.items()}}
                    for f, s, caps, r in t["rows"]]}))
            else:
                print(cap.format_seed_table1(t))
            return 0
        if args.cache and args.bytes_per_token_layer is not None:
            raise ValueError("give --cache or --bytes-per-token-layer, not both")
        if args.draft_layers and args.draft_pool == "fixed" and not args.draft_pool_bytes:
            raise ValueError("--draft-pool fixed: give the pool's size with --draft-pool-bytes")
        if not 0 <= args.draft_layers < args.num_layers:
            raise ValueError(f"--draft-layers {args.draft_layers}: expected 0 <= it < --num-layers {args.num_layers}")
        target = args.num_layers - args.draft_layers
        caches = [_cache(c) for c in args.cache] if args.cache else [("kv", args.bytes_per_token_layer or 576, None)]
        # a cache with a layer pattern is in the target's layers it names; draft layers hold every cache
        token_bytes = sum(b * (int(layer_pattern(p, target).sum()) if p else target) for _, b, p in caches)
        per_layer = sum(b for _, b, _ in caches)
        mem = cap.DecodeMemory(args.gpu_memory, args.memory_utilization, args.weights,
                         args.lora_experts * args.lora_expert_bytes, args.activations, args.cuda_graphs,
                         args.kv_cache_memory_bytes)
        draft = (cap.Draft(args.draft_layers, args.draft_bytes_per_token_layer or per_layer, args.draft_pool,
                           args.draft_pool_bytes, args.draft_graphs) if args.draft_layers else None)
        rows = []
        if not re.fullmatch(r"\d+(,\d+)*", args.dcp):
            raise ValueError(f"--dcp {args.dcp!r}: expected DCP sizes separated by commas, e.g. 1,4,8")
        for dcp in (int(x) for x in args.dcp.split(",")):
            for label, d in ((("no draft", None),) + ((f"draft ({args.draft_pool} pool)", draft),) if draft else
                             (("no draft", None),)):
                rows.append((label, cap.capacity(mem, token_bytes=token_bytes, page_size=args.page_size,
                                                  dcp_size=dcp, request_tokens=args.tokens, draft=d)))
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        print(json.dumps({"kv_budget_bytes": mem.kv_budget(), "rows": [
            {"draft": label, **{k: getattr(c, k) for k in ("dcp_size", "page_bytes", "pages_per_rank",
                                                             "tokens_per_rank", "tokens_per_group",
                                                             "draft_pages_per_rank", "draft_reserved_bytes",
                                                             "request_tokens", "requests")}}
            for label, c in rows]}))
    else:
        print(cap.format_capacity(rows, mem))
    return 0


def _cache(text: str) -> tuple[str, int, str | None]:
    """``--cache NAME:BYTES[:PATTERN]`` -> (name, bytes per token and layer, layer pattern or
    None); ValueError naming it."""
    parts = text.split(":")
    name, value, pattern = parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) == 3 else None
    if len(parts) not in (2, 3) or not name or not value.isdigit() or int(value) < 1 or pattern == "":
        raise ValueError(f"--cache {text!r}: expected NAME:BYTES[:PATTERN] with BYTES >= 1 (e.g. latent:656, "
                         f"indexer:132:FF(SSSF))")
    return name, int(value), pattern


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = ["plan", *_DELEGATED]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "plan":
        return _plan(rest)
    return int(importlib.import_module(_DELEGATED[cmd]).main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
