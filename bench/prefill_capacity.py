"""KV capacity of prefill CP layer-split: layer slots per rank, owned + 1 vs L.

A rank of a layer-split group allocates ``owned + 1`` layer slots (its layers
plus the transient slot) instead of all ``L``, so the same KV memory holds
``L / (owned + 1)`` times more tokens. The group is bounded by its fullest
rank (``ceil(L / N) + 1`` slots), which is what the gain column uses: it is
how ``vllm_compat/kv_cache.py`` sizes vLLM's ``num_blocks``. The measured gain
inside vLLM, from vLLM's own "KV cache size" line, is ``bench/layer_split.py``.

    .venv/bin/python bench/prefill_capacity.py [--budget-gib 40] [--bytes 576]
"""

from __future__ import annotations

import argparse

from vllm_dcp2d.reshard.layout import local_layer_count

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
        per_slot = "/".join(str(s) for s in sorted(set(slots), reverse=True))
        print(f"{name:<16}{L:>4}{N:>4}  {per_slot:<22}{L:>5}{L / worst:>6.2f}x"
              f"{worst / L:>10.3f}"
              f"{budget / (L * args.bytes) / 1e6:>16.2f} M{budget / (worst * args.bytes) / 1e6:>17.2f} M")


if __name__ == "__main__":
    main()
