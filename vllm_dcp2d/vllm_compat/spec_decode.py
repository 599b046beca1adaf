"""Speculative decoding on a DCP instance: vLLM's V1 model runner (0.32.0, 0.33.0).

(vLLM 0.34 has no V1 runner: ``spec_decode_v2.py`` says what it does there.)

The CPU platform runs vLLM's V1 runner (Model Runner V2 needs Triton); GPU
instances run it unless Model Runner V2 is chosen. Under
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
   TP group (which contains the DCP group) cuts its sampled tokens to the MIN
   accepted count over the group
   (:func:`~vllm_dcp2d.spec_decode.verify.agree_sampled`, over gloo), so a
   rank whose drafts differ can make no rank commit a different token.

The patch registry (``patches.py``) installs them in every vLLM process, on
every platform, as three entries: ``draft_group_order`` (0), ``draft_dcp_disabled``
(1-5) and ``agreed_acceptance`` (6). They patch the V1 runner's classes, so a
Model Runner V2 instance never reaches them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

from vllm_dcp2d.spec_decode.draft import dcp_disabled, effective_dcp
from vllm_dcp2d.spec_decode.group import TorchGroup
from vllm_dcp2d.spec_decode.verify import agree_sampled
from vllm_dcp2d.vllm_compat.instance import spec_patches_act as _active

log = logging.getLogger(__name__)

__all__ = ["install_group_order", "install_draft", "install_agreement"]


def _draft_layers(runner) -> set[str]:
    """Attention layer names of the runner's draft model (empty without one)."""
    drafter = getattr(runner, "drafter", None)
    return set(getattr(drafter, "_draft_attn_layer_names", ()) or ())


# ---- 0. get_kv_cache_groups (vLLM 0.32.0: kv_cache_utils, 0.33.0: kv_cache_planning) ----

def install_group_order(version: str) -> None:
    try:
        from vllm.v1.core import kv_cache_planning as kv_cache_utils  # 0.33
    except ImportError:
        from vllm.v1.core import kv_cache_utils  # 0.32
    stock = kv_cache_utils.get_kv_cache_groups
    if getattr(stock, "_dcp2d", False):
        return

    @functools.wraps(stock)
    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        groups = stock(vllm_config, kv_cache_spec)
        if not _active(vllm_config):
            return groups
        # sorted() is stable: within each kind, vLLM's order stays.
        return sorted(groups, key=lambda g: bool(getattr(g.kv_cache_spec, "dcp_sharded", True)))

    get_kv_cache_groups._dcp2d, get_kv_cache_groups._dcp2d_stock = True, stock
    kv_cache_utils.get_kv_cache_groups = get_kv_cache_groups


# ---- 1. the drafter runs with DCP disabled (SpecDecodeBaseProposer and its subclasses) ----

def _proposer_classes():
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer  # only vLLM 0.32.0, 0.33.0
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
        if not _active(self.vllm_config):
            return fn(self, *args, **kwargs)
        with dcp_disabled():
            return fn(self, *args, **kwargs)

    wrapper._dcp2d, wrapper._dcp2d_stock = True, fn
    return wrapper


def _draft_config_at_effective_dcp(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        config = fn(self, *args, **kwargs)
        if not _active(self.vllm_config):
            return config
        pc = config.parallel_config
        dcp = effective_dcp(pc.decode_context_parallel_size)
        if dcp == pc.decode_context_parallel_size:
            return config
        return dataclasses.replace(config, parallel_config=dataclasses.replace(pc, decode_context_parallel_size=dcp))

    wrapper._dcp2d, wrapper._dcp2d_stock = True, fn
    return wrapper


def _install_drafter() -> None:  # part of install_draft
    for cls in _proposer_classes():
        for name, wrap in (("load_model", _under_dcp_disabled), ("dummy_run", _under_dcp_disabled),
                           ("propose", _under_dcp_disabled),
                           ("_create_draft_vllm_config", _draft_config_at_effective_dcp)):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_dcp2d", False):
                setattr(cls, name, wrap(fn))


# ---- 2, 3, 5. GPUModelRunner and check_attention_cp_compatibility (V1; CPUModelRunner inherits them) ----

def _install_runner() -> None:  # part of install_draft
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # only vLLM 0.32.0, 0.33.0

    stock_spec = GPUModelRunner.get_kv_cache_spec
    if getattr(stock_spec, "_dcp2d", False):
        return

    def get_kv_cache_spec(self):
        specs = stock_spec(self)
        draft = _draft_layers(self)
        if draft and _active(self.vllm_config):
            for name in draft & specs.keys():
                if getattr(specs[name], "dcp_sharded", False):
                    specs[name] = dataclasses.replace(specs[name], dcp_sharded=False)
            log.info("DCP draft: %d draft attention layer(s) keep an unsharded KV cache (dcp_sharded=False)",
                     len(draft & specs.keys()))
        return specs

    stock_reinit = GPUModelRunner.may_reinitialize_input_batch

    def may_reinitialize_input_batch(self, kv_cache_config) -> None:
        stock_reinit(self, kv_cache_config)
        if not _active(self.vllm_config):
            return
        from vllm.v1.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind

        groups = [g for g in kv_cache_config.kv_cache_groups
                  if get_kv_cache_spec_kind(g.kv_cache_spec) != KVCacheSpecKind.ENCODER_ONLY_ATTENTION]
        for group, block_table in zip(groups, self.input_batch.block_table.block_tables):
            if not getattr(group.kv_cache_spec, "dcp_sharded", True):
                block_table.dcp_world_size, block_table.dcp_rank = 1, 0

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker import gpu_model_runner  # only vLLM 0.32.0, 0.33.0

    stock_check = gpu_model_runner.check_attention_cp_compatibility

    def check_attention_cp_compatibility(vllm_config, target_layer_names=None) -> None:
        if target_layer_names is None and _active(vllm_config):
            layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
            target_layer_names = {name for name, layer in layers.items()
                                  if getattr(getattr(layer, "impl", None), "dcp_world_size", 2) > 1}
        stock_check(vllm_config, target_layer_names)

    for fn, stock in ((get_kv_cache_spec, stock_spec), (may_reinitialize_input_batch, stock_reinit),
                      (check_attention_cp_compatibility, stock_check)):
        fn._dcp2d, fn._dcp2d_stock = True, stock
    gpu_model_runner.check_attention_cp_compatibility = check_attention_cp_compatibility
    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    GPUModelRunner.may_reinitialize_input_batch = may_reinitialize_input_batch


# ---- 6. GPUModelRunner._sample: the ranks agree on what was accepted ----

def install_agreement(version: str) -> None:
    if version not in ("0.32.0", "0.33.0"):  # 0.34 has Model Runner V2 only
        from vllm_dcp2d.vllm_compat import spec_decode_v2

        return spec_decode_v2.install_agreement(version)
    from vllm.distributed import get_tp_group
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # only vLLM 0.32.0, 0.33.0

    stock_sample = GPUModelRunner._sample
    if getattr(stock_sample, "_dcp2d", False):
        return

    def _sample(self, logits, spec_decode_metadata):
        out = stock_sample(self, logits, spec_decode_metadata)
        if spec_decode_metadata is not None and _active(self.vllm_config):
            if getattr(self, "_dcp2d_agree_group", None) is None:
                # Over gloo: vLLM's CPU shared-memory all-gather has no int64 kernel.
                self._dcp2d_agree_group = TorchGroup(get_tp_group().cpu_group)
            agree_sampled(out.sampled_token_ids, self._dcp2d_agree_group)
        return out

    _sample._dcp2d, _sample._dcp2d_stock = True, stock_sample
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

    __init__._dcp2d, __init__._dcp2d_stock = True, stock
    cls.__init__ = __init__

# ---- end of fenced pieces ----


def install_draft(version: str) -> None:
    """Patches 1-5: the draft runs with DCP disabled over an unsharded KV cache group."""
    _install_drafter()
    _install_runner()
    _install_mla_builder()
