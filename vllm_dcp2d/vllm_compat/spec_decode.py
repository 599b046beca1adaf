"""Speculative decoding on a DCP instance: vLLM 0.32.0's V1 model runner.

The CPU platform runs vLLM's V1 runner (Model Runner V2 needs Triton). Under
DCP that runner shards the draft's KV like the target's: the draft's parallel
config copies ``decode_context_parallel_size``, its ``FullAttentionSpec`` keeps
``dcp_sharded=True``, and with ``num_speculative_tokens > 1`` the draft's
later steps compute slots with no DCP logic, so they write and read the wrong
pages (measured: 21 of 522 drafts accepted with the target as its own draft,
against 150 of 150 at DCP=1). Design §8 runs the draft with DCP disabled over
an unsharded pool instead, and lets the ranks agree on what was accepted.
vLLM's scheduler and KV cache manager already honour ``dcp_sharded=False``
(a replicated group gets full-length block tables from the shared block
pool); the runner side is what the patches below add. Each acts only when
``decode_context_parallel_size > 1`` and a draft is configured:

0. ``kv_cache_utils.get_kv_cache_groups``: replicated groups come first. The
   V1 runner gives a ``draft_model`` drafter the metadata of group 0 (with
   the target's group first, the draft wrote into the target's blocks).
1. The drafter's ``load_model``, ``dummy_run`` and ``propose`` run inside
   :func:`~vllm_dcp2d.spec_decode.draft.dcp_disabled`, and
   ``_create_draft_vllm_config`` asks
   :func:`~vllm_dcp2d.spec_decode.draft.effective_dcp` for the draft's DCP
   size: 1 there. vLLM's ``AttentionImplBase.__new__`` reads that config, so
   the draft's attention impls are built with ``dcp_world_size == 1`` and
   attend over their whole (local, unsharded) cache.
2. ``GPUModelRunner.get_kv_cache_spec``: the draft's layers get
   ``dcp_sharded=False`` (as Model Runner V2's ``get_kv_cache_spec`` does), so
   they form their own KV cache group: a block table of physical blocks and
   ``dcp_size`` times the target's per-rank tokens per sequence.
3. ``GPUModelRunner.may_reinitialize_input_batch``: a replicated group's
   ``BlockTable`` computes its slot mapping at DCP size 1, rank 0 (vLLM's V1
   ``BlockTable`` reads the DCP group for every group).
4. ``MLACommonMetadataBuilder.__init__``: a replicated MLA group's metadata
   uses global sequence lengths. The builder reads the DCP group's size and
   then asserts the layer has a DCP manager; for a replicated group it runs
   with ``get_dcp_group`` raising, which it reads as "no DCP" (size 1).
5. ``gpu_model_runner.check_attention_cp_compatibility``: the start-up check
   that every attention impl returns the LSE under DCP skips impls built at
   DCP size 1 (the draft's), as vLLM's own ``target_layer_names`` argument
   does for Model Runner V2.
6. ``GPUModelRunner._sample``: after rejection sampling, every rank of the
   TP group (which contains the DCP group) keeps the MIN accepted count over
   the group (:func:`~vllm_dcp2d.spec_decode.verify.agree_accepted_prefix`),
   so a rank whose drafts differ can make no rank commit a different token.

``install()`` runs in every vLLM process on CPU (``vllm_dcp2d.plugin``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

import torch

from vllm_dcp2d.spec_decode.draft import dcp_disabled, effective_dcp
from vllm_dcp2d.spec_decode.group import TorchGroup
from vllm_dcp2d.spec_decode.verify import agree_accepted_prefix

log = logging.getLogger(__name__)

__all__ = ["install", "agree_sampled"]

_PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: a rejected position in sampled_token_ids


def _dcp_size(runner) -> int:
    return runner.parallel_config.decode_context_parallel_size


def _draft_layers(runner) -> set[str]:
    """Attention layer names of the runner's draft model (empty without one)."""
    drafter = getattr(runner, "drafter", None)
    return set(getattr(drafter, "_draft_attn_layer_names", ()) or ())


def agree_sampled(sampled: torch.Tensor, group) -> torch.Tensor:
    """Cut each request's sampled tokens to the accepted count every rank agrees on.

    sampled: int ``[B, K + 1]``, vLLM's rejection-sampler output: request ``b``
    commits its leading non-placeholder tokens (``accepted + 1``), then ``-1``.
    group: vLLM's ``GroupCoordinator`` (or any ``world_size`` / ``all_gather`` group).
    Returns ``sampled`` itself, with positions past the group's MIN set to ``-1``.
    """
    if sampled.dim() != 2 or sampled.shape[1] < 2:
        return sampled
    valid = sampled != _PLACEHOLDER
    # Leading run of valid tokens; the sampler never leaves a gap, but a gap must
    # not let a later token through.
    kept = valid.long().cumprod(dim=1).sum(dim=1)
    accepted = (kept - 1).clamp_min(0)
    agreed = agree_accepted_prefix(accepted, group)
    cut = torch.arange(sampled.shape[1], device=sampled.device)[None, :] > agreed[:, None]
    return sampled.masked_fill_(cut | ~valid, _PLACEHOLDER)


# ---- 0. kv_cache_utils.get_kv_cache_groups (vLLM 0.32.0) ----

def _install_group_order() -> None:
    from vllm.v1.core import kv_cache_utils

    stock = kv_cache_utils.get_kv_cache_groups
    if getattr(stock, "_dcp2d", False):
        return

    @functools.wraps(stock)
    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        groups = stock(vllm_config, kv_cache_spec)
        # sorted() is stable: within each kind, vLLM's order stays.
        return sorted(groups, key=lambda g: bool(getattr(g.kv_cache_spec, "dcp_sharded", True)))

    get_kv_cache_groups._dcp2d = True
    kv_cache_utils.get_kv_cache_groups = get_kv_cache_groups


# ---- 1. the drafter runs with DCP disabled (vLLM 0.32.0 SpecDecodeBaseProposer) ----

def _proposer_classes():
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    importlib.import_module("vllm.v1.worker.gpu_model_runner")  # imports every proposer subclass

    seen, todo = [], [SpecDecodeBaseProposer]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _under_dcp_disabled(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self.vllm_config.parallel_config.decode_context_parallel_size <= 1:
            return fn(self, *args, **kwargs)
        with dcp_disabled():
            return fn(self, *args, **kwargs)

    wrapper._dcp2d = True
    return wrapper


def _draft_config_at_effective_dcp(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        config = fn(self, *args, **kwargs)
        pc = config.parallel_config
        dcp = effective_dcp(pc.decode_context_parallel_size)
        if dcp == pc.decode_context_parallel_size:
            return config
        return dataclasses.replace(config, parallel_config=dataclasses.replace(pc, decode_context_parallel_size=dcp))

    wrapper._dcp2d = True
    return wrapper


def _install_drafter() -> None:
    for cls in _proposer_classes():
        for name, wrap in (("load_model", _under_dcp_disabled), ("dummy_run", _under_dcp_disabled),
                           ("propose", _under_dcp_disabled),
                           ("_create_draft_vllm_config", _draft_config_at_effective_dcp)):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_dcp2d", False):
                setattr(cls, name, wrap(fn))


# ---- 2, 3, 5, 6. GPUModelRunner (vLLM 0.32.0 V1; CPUModelRunner inherits these) ----

def _install_runner() -> None:
    from vllm.distributed import get_tp_group
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_spec = GPUModelRunner.get_kv_cache_spec
    if getattr(stock_spec, "_dcp2d", False):
        return

    def get_kv_cache_spec(self):
        specs = stock_spec(self)
        draft = _draft_layers(self)
        if _dcp_size(self) > 1 and draft:
            for name in draft & specs.keys():
                if getattr(specs[name], "dcp_sharded", False):
                    specs[name] = dataclasses.replace(specs[name], dcp_sharded=False)
            log.info("DCP draft: %d draft attention layer(s) keep an unsharded KV cache (dcp_sharded=False)",
                     len(draft & specs.keys()))
        return specs

    stock_reinit = GPUModelRunner.may_reinitialize_input_batch

    def may_reinitialize_input_batch(self, kv_cache_config) -> None:
        stock_reinit(self, kv_cache_config)
        if _dcp_size(self) <= 1:
            return
        from vllm.v1.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind

        groups = [g for g in kv_cache_config.kv_cache_groups
                  if get_kv_cache_spec_kind(g.kv_cache_spec) != KVCacheSpecKind.ENCODER_ONLY_ATTENTION]
        for group, table in zip(groups, self.input_batch.block_table.block_tables):
            if not getattr(group.kv_cache_spec, "dcp_sharded", True):
                table.dcp_world_size, table.dcp_rank = 1, 0

    stock_sample = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        out = stock_sample(self, logits, spec_decode_metadata)
        if spec_decode_metadata is not None and _dcp_size(self) > 1:
            if getattr(self, "_dcp2d_agree_group", None) is None:
                # Over gloo: vLLM's CPU shared-memory all-gather has no int64 kernel.
                self._dcp2d_agree_group = TorchGroup(get_tp_group().cpu_group)
            agree_sampled(out.sampled_token_ids, self._dcp2d_agree_group)
        return out

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker import gpu_model_runner

    stock_check = gpu_model_runner.check_attention_cp_compatibility

    def check_attention_cp_compatibility(vllm_config, target_layer_names=None) -> None:
        if target_layer_names is None:
            layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
            target_layer_names = {name for name, layer in layers.items()
                                  if getattr(getattr(layer, "impl", None), "dcp_world_size", 2) > 1}
        stock_check(vllm_config, target_layer_names)

    for fn in (get_kv_cache_spec, may_reinitialize_input_batch, _sample, check_attention_cp_compatibility):
        fn._dcp2d = True
    gpu_model_runner.check_attention_cp_compatibility = check_attention_cp_compatibility
    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    GPUModelRunner.may_reinitialize_input_batch = may_reinitialize_input_batch
    GPUModelRunner._sample = _sample


# ---- 4. MLACommonMetadataBuilder (vLLM 0.32.0) ----

def _install_mla_builder() -> None:
    from vllm.model_executor.layers.attention import mla_attention

    cls = mla_attention.MLACommonMetadataBuilder
    stock = cls.__init__
    if getattr(stock, "_dcp2d", False):
        return

    def no_dcp_group():
        raise AssertionError("a replicated KV cache group has no DCP group")  # read as DCP size 1

    @functools.wraps(stock)
    def __init__(self, kv_cache_spec, *args, **kwargs):
        if getattr(kv_cache_spec, "dcp_sharded", True):
            return stock(self, kv_cache_spec, *args, **kwargs)
        # The builder asks get_dcp_group() for its size (and then wants the layer's
        # DCP manager, which a DCP=1 draft layer has not): let it find no group.
        found = mla_attention.get_dcp_group
        mla_attention.get_dcp_group = no_dcp_group
        try:
            stock(self, kv_cache_spec, *args, **kwargs)
        finally:
            mla_attention.get_dcp_group = found

    __init__._dcp2d = True
    cls.__init__ = __init__

# ---- end of fenced pieces ----


def install() -> None:
    """Install every patch above (idempotent; the plugin calls it on CPU)."""
    _install_group_order()
    _install_drafter()
    _install_runner()
    _install_mla_builder()
