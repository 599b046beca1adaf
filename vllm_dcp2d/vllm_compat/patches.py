"""Every patch vllm_dcp2d applies to vLLM's internals: one patch table, a reason for each.

Each :class:`Patch` names the vLLM objects it wraps or rebinds, per vLLM version,
with the parameters it was written against (:class:`Target`), the function that
installs it, why it exists, and which DCP2DConnector instances cannot work
without it. ``registry.py`` installs what fits the installed vLLM and refuses an
instance that needs what does not; ``vllm-dcp2d compat`` prints the patch table.

A patch that a vLLM version made unnecessary (vLLM does it itself there) says so
in ``not_needed``, naming the upstream file: it is neither installed nor required
on that version, which is another thing than a patch whose targets do not fit.

Adding a vLLM version: add it to ``SUPPORTED``, add its targets to each patch
(what moved, what changed its parameters) or say why it is not needed there,
branch inside the install function where the wrapping itself differs, and run
``tests/vllm_compat/test_vllm_sources.py`` against that version's wheel (it resolves every
target and every vLLM import of the package in the wheel's sources, without
installing it).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_dcp2d.vllm_compat.instance import layer_split_may_apply

__all__ = ["Target", "Patch", "PATCHES", "SUPPORTED", "CPU_SUPPORTED", "CPU_UNCHECKED", "Unavailable",
           "installed_vllm_version"]

# The vLLM versions every DCP2D instance was checked against (0.32.0 run on CPU; 0.33.0 and
# 0.34.0 read from their wheels' sources, tests/vllm_compat/test_vllm_sources.py). On any other version a
# DCP2D instance refuses at start-up (registry.require), whatever its role and settings.
SUPPORTED = ("0.32.0", "0.33.0", "0.34.0")
# Of those, the ones whose CPU platform the plugin was checked on. 0.34's CPU platform runs
# Model Runner V2 on triton-cpu (platforms/cpu.py refuses x86 without it), which no registry
# serves and nothing here has run; the plugin's CPU attention backends were written against
# the V1 runner's metadata.
CPU_SUPPORTED = ("0.32.0", "0.33.0")
CPU_UNCHECKED = ("vLLM {version} on CPU was not checked: its CPU platform runs Model Runner V2 on triton-cpu, "
                 "which the plugin's CPU attention backends were not written against (CPU: vLLM "
                 + ", ".join(CPU_SUPPORTED) + ")")


def installed_vllm_version() -> str:
    """The installed vLLM version without a local suffix (``0.32.0+cpu`` -> ``0.32.0``)."""
    import vllm

    return str(vllm.__version__).split("+", 1)[0]


class Unavailable(Exception):
    """A patch's target is missing, or takes other parameters than the patch expects."""


@dataclass(frozen=True)
class Target:
    """One vLLM object a patch wraps or rebinds: ``"module:Qualified.name"``, and the
    parameter names (``self`` and ``cls`` included) the patch was written against."""

    path: str
    params: tuple[str, ...]

    def resolve(self):
        """The object vLLM defines (not a wrapper of ours); raises :class:`Unavailable`
        naming what is missing or how its parameters differ."""
        module, _, qualname = self.path.partition(":")
        try:
            obj = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure makes the target unavailable
            raise Unavailable(f"{module} cannot be imported ({type(e).__name__}: {e})") from None
        for part in qualname.split("."):
            try:
                obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
            except AttributeError:
                raise Unavailable(f"{module} has no {qualname}") from None
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        obj = getattr(obj, "_dcp2d_stock", obj)  # already wrapped here: check vLLM's own
        try:
            got = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as e:
            raise Unavailable(f"{self.path} has no readable signature ({e})") from None
        if got != self.params:
            raise Unavailable(f"{self.path} takes ({', '.join(got)}), the patch was written for "
                              f"({', '.join(self.params)})")
        return obj


@dataclass(frozen=True)
class Patch:
    """name: how messages and the patch table call it; reason: what vLLM lacks without it;
    targets: per vLLM version, the objects it wraps; install: ``"module:function"``,
    called with the vLLM version (None: the code that needs it installs it later, after
    ``registry.check``); needed: whether a DCP2DConnector instance with this
    ``VllmConfig`` cannot work without it (False for a patch that only makes it
    faster); needed_for: the same in words; cpu_only: installed on CPU platforms only;
    not_needed: per vLLM version where vLLM itself does what the patch did, the
    upstream file(s) that do it (nothing is installed or required there)."""

    name: str
    reason: str
    targets: dict[str, tuple[Target, ...]]
    install: str | None
    needed_for: str
    needed: Callable
    cpu_only: bool = False
    not_needed: dict[str, str] = field(default_factory=dict)


def _v1(*targets: Target) -> dict[str, tuple[Target, ...]]:
    """The same targets on the versions that run vLLM's V1 model runner (0.32.0, 0.33.0)."""
    return {v: targets for v in ("0.32.0", "0.33.0")}


def _dcp(vllm_config) -> int:
    return vllm_config.parallel_config.decode_context_parallel_size


def _cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _never(vllm_config) -> bool:
    return False


def _dcp_on_cpu(vllm_config) -> bool:
    return _dcp(vllm_config) > 1 and _cpu()


def _mla_on_cpu(vllm_config) -> bool:
    return vllm_config.model_config.use_mla and _cpu()


def _mla_dcp_on_cpu(vllm_config) -> bool:
    return _dcp_on_cpu(vllm_config) and vllm_config.model_config.use_mla


def _cpu_backends(vllm_config) -> bool:
    return _cpu() and (_dcp(vllm_config) > 1 or layer_split_may_apply(vllm_config))


def _layer_split(vllm_config) -> bool:
    return layer_split_may_apply(vllm_config)


def _draft_under_dcp(vllm_config) -> bool:
    spec = vllm_config.speculative_config
    return _dcp(vllm_config) > 1 and spec is not None and spec.uses_draft_kv_cache()


_COMPAT = "vllm_dcp2d.vllm_compat"
_MP = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"  # the V1 runner (0.32, 0.33; gone in 0.34)
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_PROPOSE = ("self", "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
            "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
            "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")
_SLOTS = ("num_tokens", "max_num_tokens", "query_start_loc", "positions", "block_table", "block_table_stride",
          "slot_mapping", "KV_CACHE_BLOCK_SIZE", "TOTAL_CP_WORLD_SIZE", "TOTAL_CP_RANK",
          "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE")
_MLA_UPDATE = ("self", "kv_c_normed", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "k_scale")
# What vLLM 0.34 does itself that V1-runner patches did (paths under vllm/).
_V2_DRAFT = ("config/speculative.py (draft_decode_context_parallel_size: the draft's own DCP size, set to 1 for "
             "DCP2D by draft_dcp_size), v1/worker/gpu/spec_decode/speculator.py (DraftModelSpeculator builds the "
             "draft at that size), v1/worker/gpu/model_runner.py (get_kv_cache_spec: a DCP=1 draft keeps "
             "dcp_sharded=False; check_attention_cp_compatibility gets the target's layers), "
             "model_executor/layers/attention/mla_attention.py (the MLA builder reads dcp_sharded)")

PATCHES: list[Patch] = [
    Patch("cpu_attention_backends",
          "the CPU_ATTN and CPU_MLA backends with DCP (the LSE, the all-gather and merge) and the "
          "layer-split transient-slot fill before each cache write; vLLM's CPU backends have neither",
          {"0.32.0": (Target("vllm.v1.attention.backends.registry:register_backend",
                             ("backend", "class_path", "is_mamba")),
                      Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
                             ("self", "layer", "key", "value", "kv_cache", "slot_mapping")),
                      Target("vllm.v1.attention.backends.mla.cpu_mla:CPUMLAImpl.do_kv_cache_update", _MLA_UPDATE)),
           "0.33.0": (Target("vllm.v1.attention.backends.registry:register_backend",
                             ("backend", "class_path", "is_mamba")),
                      Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
                             ("self", "layer", "key", "value", "kv_cache", "slot_mapping")),
                      Target("vllm.v1.attention.backends.mla.cpu_mla:CPUMLAImpl.do_kv_cache_update",
                             _MLA_UPDATE + ("skip_scale",)))},
          f"{_COMPAT}.attention:install_backends", "DCP > 1 or layer-split storage, on CPU", _cpu_backends,
          cpu_only=True),
    Patch("cp_slot_mapping",
          "the DCP slot mapping on CPU (vLLM's C++ fallback asserts 'Context Parallelism is not supported')",
          _v1(Target("vllm.utils.cpu_triton_utils:_compute_slot_mapping_kernel_impl", _SLOTS)),
          f"{_COMPAT}.attention:install_slot_mapping", "DCP > 1 on CPU", _dcp_on_cpu, cpu_only=True,
          not_needed={"0.34.0": "v1/worker/gpu/block_table.py (_compute_slot_mappings_kernel computes the DCP "
                                "slot mapping for every platform; vllm.utils.cpu_triton_utils is gone)"}),
    Patch("dcp_shm_collectives",
          "the DCP group's all-gathers over shared memory instead of gloo: vLLM's CPU collectives, or the plugin's "
          "where vLLM's build has none (its AVX2 build) (speed only)",
          _v1(Target("vllm.distributed.device_communicators.cpu_communicator:CpuCommunicator.__init__",
                       ("self", "cpu_group", "device", "device_group", "unique_name", "use_all2all"))),
          f"{_COMPAT}.attention:install_dcp_shm", "nothing (a DCP group on CPU is faster with it)", _never,
          cpu_only=True),
    Patch("mla_dcp_combine",
          "MLA's DCP merge in torch (vLLM's is a Triton kernel, and Triton has no CPU backend)",
          _v1(Target("vllm.v1.attention.ops.dcp:MLADCPManager._init_combine",
                       ("self", "num_heads", "head_dim", "dtype", "is_lse_base_on_e", "use_pcp"))),
          None, "MLA with DCP > 1 on CPU", _mla_dcp_on_cpu, cpu_only=True),
    Patch("cpu_platform_choices",
          "CPU_MLA for DCP2D MLA instances on AMX CPUs (vLLM picks AMX_MLA: no LSE, its own page format, no fp32); "
          "with cpu_start_method='fork', the engine core and TP workers forked (vLLM's CPU platform spawns them, "
          "each importing vLLM anew), each bound to its cores as vLLM's OpenMP variables say",
          _v1(Target("vllm.platforms.cpu:CpuPlatform.check_and_update_config", ("cls", "vllm_config"))),
          f"{_COMPAT}.startup:install_cpu_choices",
          "MLA on CPU (cpu_start_method='fork' only saves start-up: without the patch it starts spawned)",
          _mla_on_cpu, cpu_only=True),
    Patch("dcp_interleave",
          "the DCP interleave set to the block size, as vLLM does for NIXL only: the connector writes whole "
          "pages into the DCP layout",
          {"0.32.0": (Target("vllm.config:VllmConfig.adjust_dcp_kv_cache_interleave_size",
                             ("self", "kv_cache_config")),),
           "0.33.0": (Target("vllm.config:VllmConfig.adjust_dcp_kv_cache_interleave_size",
                             ("self", "kv_cache_groups")),),
           # 0.34 still resolves the interleave for NixlConnector only (config/vllm.py).
           "0.34.0": (Target("vllm.config:VllmConfig.adjust_dcp_kv_cache_interleave_size",
                             ("self", "kv_cache_groups")),)},
          f"{_COMPAT}.startup:install_interleave", "DCP > 1", lambda c: _dcp(c) > 1),
    Patch("layer_split_kv_configs",
          "each prefill TP rank allocates KV for its own layers plus one transient slot",
          {"0.32.0": (Target("vllm.v1.engine.core:get_kv_cache_configs",
                             ("vllm_config", "kv_cache_specs", "available_memory")),),
           "0.33.0": (Target("vllm.v1.engine.core:get_kv_cache_configs",
                             ("vllm_config", "kv_cache_specs", "available_memory", "global_kv_cache_groups")),),
           "0.34.0": (Target("vllm.v1.engine.core:get_kv_cache_configs",
                             ("vllm_config", "kv_cache_specs", "available_memory", "global_kv_cache_groups")),)},
          f"{_COMPAT}.kv_cache:install", "layer-split storage (a kv_producer with cp_size > 1)", _layer_split),
    Patch("draft_group_order",
          "the draft's replicated KV cache group first (the V1 runner gives a draft model group 0's metadata)",
          {"0.32.0": (Target("vllm.v1.core.kv_cache_utils:get_kv_cache_groups", ("vllm_config", "kv_cache_spec")),),
           "0.33.0": (Target("vllm.v1.core.kv_cache_planning:get_kv_cache_groups",
                             ("vllm_config", "kv_cache_spec")),)},
          f"{_COMPAT}.spec_decode:install_group_order", "a speculative draft with DCP > 1", _draft_under_dcp,
          not_needed={"0.34.0": "v1/worker/gpu/spec_decode/speculator.py (set_attn: Model Runner V2's draft builds "
                                "its attention metadata from its own layers' groups)"}),
    Patch("draft_dcp_size",
          "a DCP2D instance with DCP > 1 runs its draft at vLLM's draft_decode_context_parallel_size=1 unless the "
          "user set it (design §8: the draft runs unsharded; vLLM 0.34 defaults it to the target's DCP size), logged",
          {"0.34.0": (Target("vllm.engine.arg_utils:EngineArgs.create_speculative_config",
                             ("self", "target_model_config", "target_parallel_config")),)},
          f"{_COMPAT}.spec_decode_v2:install_draft_dcp", "a speculative draft with DCP > 1", _draft_under_dcp,
          not_needed={v: "the V1 runner has no draft DCP size; draft_dcp_disabled runs its draft at DCP 1"
                      for v in ("0.32.0", "0.33.0")}),
    Patch("draft_dcp_disabled",
          "the draft runs with DCP disabled over an unsharded pool (vLLM's V1 runner shards an EAGLE/MTP draft "
          "like the target: 21 of 522 drafts accepted)",
          _v1(Target(f"{_PROPOSER}.load_model", ("self", "target_model")),
                Target(f"{_PROPOSER}.dummy_run", ("self", "num_tokens", "use_cudagraphs", "is_graph_capturing",
                                                  "slot_mappings")),
                Target(f"{_PROPOSER}.propose", _PROPOSE),
                Target(f"{_PROPOSER}._create_draft_vllm_config", ("self",)),
                Target(f"{_MP}.get_kv_cache_spec", ("self",)),
                Target(f"{_MP}.may_reinitialize_input_batch", ("self", "kv_cache_config")),
                Target("vllm.v1.worker.gpu_model_runner:check_attention_cp_compatibility",
                       ("vllm_config", "target_layer_names")),
                Target("vllm.model_executor.layers.attention.mla_attention:MLACommonMetadataBuilder.__init__",
                       ("self", "kv_cache_spec", "layer_names", "vllm_config", "device", "metadata_cls",
                        "supports_dcp_with_varlen"))),
          f"{_COMPAT}.spec_decode:install_draft", "a speculative draft with DCP > 1", _draft_under_dcp,
          not_needed={"0.34.0": _V2_DRAFT}),
    Patch("agreed_acceptance",
          "every DCP rank commits the MIN accepted count over the group, so a rank whose draft or logits differ "
          "can make no rank commit a different token or wait in another collective; vLLM (0.32, 0.33: V1 "
          "_sample; 0.34: Model Runner V2's sample) leaves each rank its own count",
          {**_v1(Target(f"{_MP}._sample", ("self", "logits", "spec_decode_metadata"))),
           "0.34.0": (Target("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
                             ("self", "hidden_states", "input_batch", "grammar_output")),)},
          f"{_COMPAT}.spec_decode:install_agreement", "a speculative draft with DCP > 1", _draft_under_dcp),
    Patch("dsa_fused_kv_write",
          "save_kv_layer after each DSA layer's KV write (layer pipelining): on CUDA, DeepseekV32ForCausalLM, "
          "GlmMoeDsaForCausalLM and DeepseekV32MTPModel write both caches of a layer inside fused_norm_rope and "
          "reach no connector call (vllm_compat/dsa.py); each such layer's _sparse_indexer_and_attn gets vLLM's own "
          "maybe_transfer_kv_layer under its eager_break_during_capture",
          {v: (Target("vllm.models.deepseek_v32.attention:DeepseekV32Attention._sparse_indexer_and_attn",
                      ("self", "positions", "q_c", "q_nope", "q_pe", "index_q_fp8", "index_k", "index_weights_out",
                       "kv_c", "k_pe", "ql_nope", "mqa_q", "output")),
               Target("vllm.compilation.breakable_cudagraph:eager_break_during_capture", ("fn",)),
               Target("vllm.model_executor.layers.attention.kv_transfer_utils:maybe_transfer_kv_layer", ("func",)))
           for v in SUPPORTED},
          None, "nothing (without it a DSA prefill sends each layer after the prompt completed, logged at start-up)",
          _never),
    Patch("shm_poll_sleep",
          "vLLM's shared-memory queue readers sleep cpu_poll_sleep_us between polls instead of spinning "
          "(on a small CPU host the spin starved the connector's threads)",
          _v1(Target("vllm.distributed.device_communicators.shm_broadcast:sched_yield", ())),
          None, "nothing (cpu_poll_sleep_us > 0 on CPU: installed by the connector)", _never, cpu_only=True),
]
