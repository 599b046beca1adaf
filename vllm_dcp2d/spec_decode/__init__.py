"""Speculative decoding (EAGLE / MTP) under DCP (design §8): the pure pieces,
importing nothing from vLLM. ``vllm_compat/spec_decode.py`` wires them into
vLLM's V1 runner (the drafter under ``dcp_disabled()``, the MIN agreement
after rejection sampling).

draft   dcp_disabled() for the draft forward, draft pool sizing, memory figure
verify  greedy acceptance, MIN agreement of the accepted prefix across the DCP group
group   a DCP group (world_size, rank_in_group, all_gather) over torch.distributed
"""

from vllm_dcp2d.spec_decode.draft import (
    SpecKVBytes,
    dcp_disabled,
    dcp_enabled,
    draft_pool_tokens,
    effective_dcp,
    effective_dcp_rank,
    spec_kv_bytes,
)
from vllm_dcp2d.spec_decode.group import TorchGroup
from vllm_dcp2d.spec_decode.verify import accept_greedy, agree_accepted_prefix, kv_commit_mask, verify_greedy

__all__ = [
    "SpecKVBytes",
    "dcp_disabled",
    "dcp_enabled",
    "draft_pool_tokens",
    "effective_dcp",
    "effective_dcp_rank",
    "spec_kv_bytes",
    "TorchGroup",
    "accept_greedy",
    "agree_accepted_prefix",
    "kv_commit_mask",
    "verify_greedy",
]
