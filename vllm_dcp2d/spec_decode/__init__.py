"""Speculative decoding (EAGLE / MTP) under DCP (design §8): the pure pieces,
importing nothing from vLLM. ``vllm_compat/spec_decode.py`` wires them into
vLLM's V1 runner (the drafter under ``dcp_disabled()``, the MIN agreement
after rejection sampling), ``vllm_compat/spec_decode_v2.py`` into Model Runner V2.

draft   dcp_disabled() for the draft forward, effective_dcp() for its config
verify  MIN agreement of the accepted prefix across the DCP group
group   a DCP group (world_size, rank_in_group, all_gather) over torch.distributed
"""

from vllm_dcp2d.spec_decode.draft import dcp_disabled, effective_dcp
from vllm_dcp2d.spec_decode.group import TorchGroup
from vllm_dcp2d.spec_decode.verify import agree_accepted_prefix, agree_num_sampled, agree_sampled

__all__ = [
    "dcp_disabled",
    "effective_dcp",
    "TorchGroup",
    "agree_accepted_prefix",
    "agree_num_sampled",
    "agree_sampled",
]
