"""The child of ``tests/vllm_compat/test_vllm_sources.py``: runs in a fresh interpreter that imports one
vLLM version (the installed 0.32.0, or a wheel's Python sources first on ``PYTHONPATH``)
and prints one JSON object with what the test checks.

    python tests/support/sources_child.py IMPORTS IMPLS MODEL RUNNER

IMPORTS: the package's vLLM imports (JSON, ``vllm_imports()``); IMPLS: name -> the plugin's
function that receives vLLM's call (JSON); MODEL: a tiny local model; RUNNER: "v1" (0.32,
0.33) or "v2" (0.34: Model Runner V2 only).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
import types

imports, impls, model, runner = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
if runner == "v2":
    # vLLM 0.34 imports its Triton kernels at module level (Model Runner V2, the extensible
    # KV cache), and on a CPU vLLM it accepts triton only with a "cpu" backend (triton-cpu,
    # which no registry serves). Naming one lets those modules import; nothing is compiled
    # or run, and the platform stays CPU.
    import triton.backends

    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=object()))

import torch  # noqa: E402
import vllm  # noqa: E402

from vllm_dcp2d.vllm_compat import registry  # noqa: E402

registry.register_connector()
registry.install_all()
version = vllm.__version__.split("+")[0]


def why_not(module, name):
    try:
        m = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the reason is the point
        return f"{module}: {type(e).__name__}: {e}"
    if name is not None and not hasattr(m, name):
        try:
            importlib.import_module(f"{module}.{name}")
        except Exception:  # noqa: BLE001
            return f"{module} has no {name}"


# Each group of alternatives needs one that resolves; an optional group (a try/except
# ImportError whose fallback imports nothing from vLLM) may resolve on no version.
missing, optional = [], {}
for group in map(json.loads, imports["required"]):
    whys = [why_not(module, name) for module, name in group]
    if all(whys):
        missing.append(" / ".join(whys))
for group in map(json.loads, imports["optional"]):
    optional[json.dumps(group)] = not any(why_not(module, name) for module, name in group)


def params(path):
    module, _, qual = path.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(obj).parameters.values()]


from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.utils import record_kv_cache_layout  # noqa: E402
from vllm.v1.engine import core  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

try:
    from vllm.v1.core import kv_cache_planning as planning  # 0.33, 0.34
except ImportError:
    from vllm.v1.core import kv_cache_utils as planning  # 0.32


def config(**kw):
    return EngineArgs(model=model, enforce_eager=True, dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20,
                      **kw).create_engine_config()


def both(fn, *args):
    stock = getattr(fn, "_dcp2d_stock", None)
    assert stock is not None, f"{fn} is not wrapped"
    return fn(*args), stock(*args)


def specs(n: int) -> dict:
    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32,
                                                                  dtype=torch.float32) for i in range(n)}


# An engine without the connector: every wrapped function called as this version's callers
# call it gives what vLLM's own function (``_dcp2d_stock``) gives.
cfg = config()
record_kv_cache_layout(cfg.cache_config, "LBHNC")  # what the engine core resolves on CPU first
mem = [64 << 20]
extra = ([planning.get_global_kv_cache_groups(cfg, [specs(4)])]
         if hasattr(planning, "get_global_kv_cache_groups") else [])
same = {}
got, want = both(core.get_kv_cache_configs, cfg, [specs(4)], mem, *extra)
same["get_kv_cache_configs"] = repr(got) == repr(want)
arg = extra[0] if extra else core.get_kv_cache_configs(cfg, [specs(4)], mem)[0]
a, b = copy.deepcopy(cfg), copy.deepcopy(cfg)
wrapped = type(cfg).adjust_dcp_kv_cache_interleave_size
wrapped(a, arg), wrapped._dcp2d_stock(b, arg)
same["adjust_dcp_kv_cache_interleave_size"] = repr(a.parallel_config) == repr(b.parallel_config)
out = {"version": vllm.__version__, "status": registry.status(), "missing": missing, "optional": optional,
       "impls": {name: params(path) for name, path in impls.items()}, "roles": registry.roles()}

if runner == "v1":
    from vllm.v1.worker import gpu_model_runner

    got, want = both(planning.get_kv_cache_groups, cfg, specs(4))
    same["get_kv_cache_groups"] = repr(got) == repr(want)
    a, b = copy.deepcopy(cfg), copy.deepcopy(cfg)
    cls = type(current_platform)
    cls.check_and_update_config(a), cls.check_and_update_config.__func__._dcp2d_stock(cls, b)
    same["check_and_update_config"] = (repr(a.attention_config), a.cache_config.block_size) == \
        (repr(b.attention_config), b.cache_config.block_size)
    got, want = both(gpu_model_runner.check_attention_cp_compatibility, cfg)
    same["check_attention_cp_compatibility"] = got is None and want is None
else:
    from vllm_dcp2d.vllm_compat.connector_api import kv_cache_registers

    # draft_dcp_size: vLLM's draft DCP size for a DCP=2 decode with a draft, through the
    # wrapped EngineArgs.create_speculative_config (vLLM's own config code does the rest).
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    consumer = {"kv_connector": "DCP2DConnector", "kv_role": "kv_consumer"}
    draft_dcp = {}
    for name, kv, spec in (("dcp2d", consumer, draft), ("dcp2d, user's 2", consumer,
                                                         {**draft, "draft_decode_context_parallel_size": 2}),
                           ("no connector", None, draft)):
        c = config(tensor_parallel_size=2, decode_context_parallel_size=2, kv_transfer_config=kv,
                   speculative_config=dict(spec))
        draft_dcp[name] = c.speculative_config.draft_decode_context_parallel_size
    out["draft_dcp"] = draft_dcp
    # An engine without the connector: the speculative config vLLM itself makes.
    ea = EngineArgs(model=model, speculative_config=dict(draft), decode_context_parallel_size=2)
    fn = EngineArgs.create_speculative_config
    got = fn(copy.deepcopy(ea), cfg.model_config, copy.deepcopy(cfg.parallel_config))
    want = fn._dcp2d_stock(copy.deepcopy(ea), cfg.model_config, copy.deepcopy(cfg.parallel_config))
    same["create_speculative_config"] = repr(got) == repr(want)

    # kv_cache_access: what vLLM's config asks the connector class (KVConnectorFactory).
    producer = config(tensor_parallel_size=2, kv_transfer_config={
        "kv_connector": "DCP2DConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"layer_split": "on"}})
    out["kv_cache_access"] = [int(producer.kv_transfer_config.kv_cache_access()), int(kv_cache_registers()),
                              producer.kv_transfer_config.registers_kv_cache_memory()]

    # Layer-split placements under vLLM's extensible KV cache: vLLM's own padding (each
    # segment one physical chunk, as REGISTERS asks), segmenting and measured shrinking.
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache, pad_kv_cache_segments

    record_kv_cache_layout(producer.cache_config, "LBHNC")
    layers, place = 5, lambda c: [(t.layers, t.layer_stride, t.block_stride, t.offset) for t in c.kv_cache_tensors]
    groups = planning.get_global_kv_cache_groups(producer, [specs(layers)] * 2)
    configs = core.get_kv_cache_configs(producer, [specs(layers)] * 2, [8 << 20] * 2, groups)
    before = [(c.num_blocks, place(c), [t.size for t in c.kv_cache_tensors]) for c in configs]
    padded = [pad_kv_cache_segments(c, KVCacheLayout.LBHNC, 2 << 20, registers_memory=True) for c in configs]
    segments = [ExtensibleKVCache._segments(types.SimpleNamespace(capacity_blocks=p.num_blocks,
                                                                  size=p.kv_cache_tensors[0].size),
                                            p.kv_cache_tensors, KVCacheLayout.LBHNC) for p in padded]
    shrunk_to = configs[0].num_blocks * 3 // 4  # still holds max_model_len, as vLLM checks
    planning.shrink_kv_cache_configs(producer, configs, shrunk_to)
    out["extensible"] = {"before": before, "padded": [place(p) for p in padded], "segments": segments,
                         "shrunk": [(c.num_blocks, place(c), [t.size for t in c.kv_cache_tensors]) for c in configs],
                         "shrunk_to": shrunk_to, "layers": layers}

# Sparse MLA: the two caches vLLM's own layers give (bytes per page, DCP-sharded on a decode).
from vllm_dcp2d.vllm_compat.kv_alloc import sparse_mla_specs  # noqa: E402

out["sparse_mla"] = [(s.page_size_bytes, s.dcp_sharded) for s in sparse_mla_specs(1).values()]
# The GPU check's allocation (its mooncake row), with this version's allocator, on CPU memory.
from vllm_dcp2d.vllm_compat.connector_api import kv_regions  # noqa: E402
from vllm_dcp2d.vllm_compat.kv_alloc import allocate_kv, allocate_sparse_mla, kv_cache_layouts  # noqa: E402

layout = kv_cache_layouts().BLNHC
out["alloc"] = [kv_regions(allocate_kv(layout, False, 2, 5, 16, 8, 128, torch.bfloat16), 5)[0].page_bytes.tolist(),
                kv_regions(allocate_sparse_mla(layout, 2, 5), 5)[0].page_bytes.tolist()]
out["same"] = same

# The DSA architectures on CUDA (issue 51): the class vLLM's registry loads for each (its
# package's CUDA branch, re-imported with the platform answering "CUDA"), the attention
# classes of that package, and for each why the plugin would not hear its KV write (None:
# vLLM's connector call follows it, or the plugin's dsa_fused_kv_write hooks it).
from vllm_dcp2d.vllm_compat import dsa  # noqa: E402

dsa_out = {}
was = current_platform.is_cuda, current_platform.is_rocm
current_platform.is_cuda, current_platform.is_rocm = (lambda: True), (lambda: False)
try:
    importlib.reload(importlib.import_module("vllm.models.deepseek_v32"))
    from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
    from vllm.model_executor.models.registry import ModelRegistry  # noqa: E402

    fused = dsa.fused_writer_classes()
    for arch in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV32MTPModel"):
        cls = ModelRegistry._try_load_model_cls(arch)
        package = ".".join(cls.__module__.split(".")[:3])
        layers = {f"{c.__module__}:{c.__qualname__}": c for m in list(sys.modules.values())
                  if getattr(m, "__name__", "").startswith(package)
                  for c in vars(m).values() if isinstance(c, type) and issubclass(c, (Attention, MLAAttention))}
        dsa_out[arch] = {"class": f"{cls.__module__}:{cls.__qualname__}",
                         "attention": {k: dsa.unseen_writes(c, fused) for k, c in layers.items()},
                         "fused": sorted(k for k, c in layers.items() if issubclass(c, fused))}
finally:
    current_platform.is_cuda, current_platform.is_rocm = was
out["dsa"] = dsa_out

# Layers without an indexer with vLLM's own settings (0.34: compute_skip_topk_layers), their
# specs built by the real backends' customize_spec (Hopper and Blackwell), allocated by this
# version's allocator: each layer's own planes moved byte for byte (tests/vllm_compat/test_kv_alloc).
if runner == "v2":
    from types import SimpleNamespace as NS  # noqa: E402

    import numpy as np  # noqa: E402
    from vllm.model_executor.models.utils import compute_skip_topk_layers  # noqa: E402

    from tests.support.kv_layouts import transfer_exact  # noqa: E402

    configs = {"indexer_types": NS(index_topk=2048, num_hidden_layers=6,
                                   indexer_types=["full", "full", "shared", "full", "shared", "shared"]),
               "index_topk_freq=2": NS(index_topk=2048, num_hidden_layers=6, index_topk_freq=2)}
    skip, L = {}, kv_cache_layouts()
    for name, hf in configs.items():
        indexer = sorted(set(range(6)) - compute_skip_topk_layers(hf))
        moved = []
        for blackwell in (False, True):
            current_platform.is_device_capability_family = lambda f, b=blackwell: b and f == 100
            for src_l, dst_l in ((L.LBNHC, L.BLNHC), (L.BLHNC, L.LBHNC)):
                src = [allocate_sparse_mla(src_l, 6, 5, indexer_layers=indexer) for _ in range(2)]
                dst = [allocate_sparse_mla(dst_l, 6, 3, indexer_layers=indexer) for _ in range(2)]
                masks = kv_regions(dst[0], 3)[0]
                transfer_exact(src, 5, dst, 3, 6, np.random.default_rng(0))
                moved.append(sorted(int(lid) for lid, m in zip(masks.layer_ids, masks.region_mask) if m.all()))
        skip[name] = {"indexer": indexer, "with_indexer": moved}
    out["skip_topk"] = skip
# What a GPU host of this version would decide: the registry asked again with the platform
# answering "not CPU" (CPU-only patches then do not apply; the others are installed above).
current_platform.is_cpu = lambda: False
registry._state = registry._State()
out["roles_gpu"] = registry.roles()
out["status_gpu"] = registry.status()
print(json.dumps(out))
