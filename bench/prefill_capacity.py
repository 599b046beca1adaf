"""KV capacity of prefill CP layer-split: layer slots per rank, owned + 1 vs L.

A rank of a layer-split group allocates ``owned + 1`` layer slots (its layers
plus the transient slot) instead of all ``L``, so the same KV memory holds
``L / (owned + 1)`` times more tokens. The group is bounded by its fullest
rank (``ceil(L / N) + 1`` slots), which is what the gain column uses. Byte
figures come from ``LayerSplitKVPool`` itself, allocated on the meta device.

    .venv/bin/python bench/prefill_capacity.py [--budget-gib 40] [--bytes 576]
"""

from __future__ import annotations

import argparse

import torch

from vllm_dcp2d.layout import local_layer_count
from vllm_dcp2d.prefill.pool import LayerSplitKVPool

# (label, layers, cp_size). Layer counts of known models; the byte figures all
# use --bytes, so only the seed row's token counts describe its real model.
CONFIGS = [
    ("GLM-5.2 (seed)", 78, 8),
    ("78 layers", 78, 4),
    ("78 layers", 78, 2),
    ("61 layers", 61, 8),
    ("80 layers", 80, 8),
    ("94 layers", 94, 8),
    ("32 layers", 32, 4),
    ("32 layers", 32, 8),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV memory per rank")
    ap.add_argument("--bytes", type=int, default=576,
                    help="KV bytes per token per layer (GLM-5.2 FP8 latent: 576)")
    args = ap.parse_args()
    if args.bytes < 2 or args.bytes % 2:
        ap.error(f"--bytes must be even and >= 2 (K and V halves), got {args.bytes}")
    budget = args.budget_gib * 2**30

    print(f"KV bytes/token/layer = {args.bytes}, KV budget/rank = {args.budget_gib:g} GiB, page = 64 tokens")
    head = f"{'config':<16}{'L':>4}{'N':>4}  {'slots/rank (owned+1)':<22}{'full':>5}{'gain':>7}" \
           f"{'mem/full':>10}{'tokens/rank full':>18}{'tokens/rank split':>19}"
    print(head)
    print("-" * len(head))
    for name, L, N in CONFIGS:
        slots = [local_layer_count(L, N, r) for r in range(N)]
        worst = max(slots)
        # One 64-token page per layer slot, 1-byte elements: K and V halves of args.bytes.
        pool = LayerSplitKVPool(L, N, slots.index(worst), num_pages=1, page_size=64, num_kv_heads=1,
                                head_dim=args.bytes // 2, dtype=torch.uint8, device="meta")
        assert pool.nbytes == worst * 64 * (args.bytes // 2) * 2
        per_slot = "/".join(str(s) for s in sorted(set(slots), reverse=True))
        print(f"{name:<16}{L:>4}{N:>4}  {per_slot:<22}{L:>5}{L / worst:>6.2f}x"
              f"{pool.nbytes / pool.full_nbytes:>10.3f}"
              f"{budget / (L * args.bytes) / 1e6:>16.2f} M{budget / (worst * args.bytes) / 1e6:>17.2f} M")


if __name__ == "__main__":
    main()
