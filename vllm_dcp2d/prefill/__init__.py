"""Prefill CP layer-split on torch.distributed (design §4, §7), usable without vLLM.

pool       per-rank paged KV pool: owned layers + 1 transient slot
broadcast  size-broadcast of the owner's prefix KV, consensus prefix lens
forward    context-parallel prefill of a tiny transformer, and its no-CP reference
dist       process groups (gloo on CPU, NCCL on GPU)
"""

from vllm_dcp2d.prefill.broadcast import (
    broadcast_owner_layer_prefix,
    consensus_prefix_lens,
    normalize_prefix_lens,
    prefix_slots,
)
from vllm_dcp2d.prefill.dist import CPGroup, cp_group_from, default_backend, init_cp_group
from vllm_dcp2d.prefill.pool import LayerSplitKVPool

__all__ = [
    "LayerSplitKVPool",
    "broadcast_owner_layer_prefix",
    "consensus_prefix_lens",
    "normalize_prefix_lens",
    "prefix_slots",
    "CPGroup",
    "init_cp_group",
    "cp_group_from",
    "default_backend",
]
