"""``vllm-dcp2d`` command line.

  vllm-dcp2d plan   --num-layers 78 --cp 8 --dcp 4 --tokens 32768 --page-size 64 \\
                    --bytes-per-token-layer 576 [--shuffle SEED] [--json]
  vllm-dcp2d proxy  ...   (PD proxy, see ``vllm-dcp2d proxy --help``)
  vllm-dcp2d demo   ...   (end-to-end demo, see ``vllm-dcp2d demo --help``)
  vllm-dcp2d compat       (the vLLM patches and whether each fits the installed vLLM)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# Subcommands implemented in their own modules, each exposing main(argv) -> int.
_DELEGATED = {"proxy": "vllm_dcp2d.proxy", "demo": "vllm_dcp2d.demo", "compat": "vllm_dcp2d.vllm_compat.registry"}


def _plan(argv: list[str]) -> int:
    from vllm_dcp2d.report import format_matrix, reshard_matrix

    ap = argparse.ArgumentParser(prog="vllm-dcp2d plan",
                                 description="Print the 2D reshard matrix of one request.")
    ap.add_argument("--num-layers", type=int, default=78)
    ap.add_argument("--cp", type=int, default=8, help="prefill CP (layer-split) ranks")
    ap.add_argument("--dcp", type=int, default=4, help="decode DCP ranks")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--bytes-per-token-layer", type=int, default=576,
                    help="KV bytes per token per layer (GLM-5.2 FP8 MLA latent: 512 + 64)")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="use shuffled block ids drawn with this seed")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="of --num-layers, the last ones a speculative draft's (MTP, EAGLE): every DCP rank gets "
                         "all their pages")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        m = reshard_matrix(args.num_layers, args.cp, args.dcp, args.tokens, args.page_size,
                           args.bytes_per_token_layer, args.shuffle, args.draft_layers)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        keys = ("paths", "total_bytes", "naive_bytes", "kv_bytes", "num_layers", "cp_size", "dcp_size",
                "tokens", "page_size", "pages", "page_bytes", "draft_layers", "draft_kv_bytes")
        print(json.dumps({k: m[k] for k in keys}))
    else:
        print(format_matrix(m))
    return 0


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
