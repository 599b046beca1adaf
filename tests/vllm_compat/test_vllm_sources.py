"""vllm_compat against the sources of every vLLM version it supports (issues 26 and 40).

0.32.0 is installed; 0.33.0 and 0.34.0 have no CPU build, so ``scripts/setup.sh``
caches their wheels' Python sources (``.venv/vllm-src/VERSION``), which import on
this venv in front of the installed package (``PYTHONPATH``). For each version, in
a fresh interpreter that imports that version (``tests/support/sources_child.py``; 0.34
has no V1 model runner, so its child checks Model Runner V2's targets):

* every patch of ``vllm_compat/patches.py`` resolves: its targets exist and take
  the parameters the patch was written for (the registry's own check), so the
  patch is installed, unless the table says that version does not need it (or it
  is CPU-only on a version whose CPU platform was not checked);
* every vLLM import anywhere in the package (read from its source, lazy imports
  included) resolves;
* ``register()`` leaves an engine without the connector with vLLM's own results:
  each wrapped function that can be called without an engine is called the way
  that version's callers call it, for a configuration without the connector, and
  gives what vLLM's own function gives;
* which DCP2D instances start (``registry.roles``): all of them on a GPU host.

On 0.34 also: a DCP=2 decode with a draft gets vLLM's
``draft_decode_context_parallel_size=1`` (the user's own value kept; vLLM's
default without the connector), the connector's ``kv_cache_access`` is vLLM's
``REGISTERS``, and layer-split placements keep their strides and offsets through
vLLM's extensible KV cache (``pad_kv_cache_segments``, its segments,
``shrink_kv_cache_configs``).

And without running that version: every call vLLM makes of a function the plugin
wraps or overrides (found in that version's sources) binds to the plugin's
function, with its positional and keyword arguments.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_dcp2d"


def _installed_src() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("vllm").origin).parent.parent


def sources(version: str) -> Path | None:
    """The directory holding that version's ``vllm/`` package, or None."""
    if version == "0.32.0":
        return _installed_src()
    src = Path(sys.prefix) / "vllm-src" / version
    return src if (src / ".complete").exists() else None


VERSIONS = ["0.32.0", "0.33.0", "0.34.0"]
V2 = {"0.34.0"}  # versions with Model Runner V2 only


def _need(version: str) -> Path:
    src = sources(version)
    if src is None:
        pytest.fail(f"vLLM {version}'s sources are not cached in {Path(sys.prefix) / 'vllm-src' / version}; "
                    f"run bash scripts/setup.sh")
    return src


_ONLY = re.compile(r"#.*\bonly vLLM ((?:\d+\.\d+\.\d+)(?:, \d+\.\d+\.\d+)*)")


def _imports_of(nodes, lines: list[str] | None = None, version: str | None = None) -> list[tuple[str, str | None]]:
    """The vLLM imports of ``nodes``; with ``version``, leaving out those whose line says
    "# ... only vLLM X, Y" (code reached on those versions only: the V1 runner's patches)
    for another version."""
    out = []
    for node in nodes:
        if version is not None and lines is not None and hasattr(node, "lineno"):
            only = _ONLY.search(lines[node.lineno - 1])
            if only and version not in only.group(1).split(", "):
                continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                (node.module == "vllm" or node.module.startswith("vllm.")):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name == "vllm" or a.name.startswith("vllm.")]
    return out


def vllm_imports(version: str | None = None) -> dict[str, list[str]]:
    """Every ``from vllm... import name`` / ``import vllm...`` in the package, as groups
    of alternatives: the imports of one ``try: ... except ImportError:`` (a module that
    moved between versions) form one group, of which one must resolve; any other
    import is a group of its own. A try whose fallback imports nothing from vLLM (an
    API only newer versions have) is "optional"; the rest are "required"."""
    groups, optional = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        tree, lines = ast.parse(text), text.splitlines()
        alternatives = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in node.handlers):
                body = list(node.body) + [n for h in node.handlers for n in h.body]
                group = _imports_of(body)
                if group:
                    fallback = [n for h in node.handlers for n in h.body]
                    (groups if _imports_of(fallback) else optional).append(sorted(group, key=str))
                    alternatives |= {id(n) for n in body}
        groups += [[imp] for node in ast.walk(tree) if id(node) not in alternatives
                   for imp in _imports_of([node], lines, version)]
    return {"required": sorted({json.dumps(g) for g in groups}), "optional": sorted({json.dumps(g) for g in optional})}


V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
CALLS = {
    "get_kv_cache_configs": ("vllm.v1.engine.core:get_kv_cache_configs", False, ["v1/engine/core.py"]),
    "adjust_dcp_kv_cache_interleave_size": ("vllm.config:VllmConfig.adjust_dcp_kv_cache_interleave_size", True,
                                            None),
    "get_kv_cache_groups": ({"0.32.0": "vllm.v1.core.kv_cache_utils:get_kv_cache_groups",
                             "0.33.0": "vllm.v1.core.kv_cache_planning:get_kv_cache_groups"}, False, None),
    "check_attention_cp_compatibility": ({v: f"{V1_RUNNER}:check_attention_cp_compatibility"
                                          for v in ("0.32.0", "0.33.0")}, False, None),
    "may_reinitialize_input_batch": ({v: f"{V1_RUNNER}:GPUModelRunner.may_reinitialize_input_batch"
                                      for v in ("0.32.0", "0.33.0")}, True, None),
    "_sample": ({v: f"{V1_RUNNER}:GPUModelRunner._sample" for v in ("0.32.0", "0.33.0")}, True,
                ["v1/worker/gpu_model_runner.py"]),
    "sample": ({"0.34.0": "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample"}, True,
               ["v1/worker/gpu/model_runner.py"]),
    "create_speculative_config": ({"0.34.0": "vllm.engine.arg_utils:EngineArgs.create_speculative_config"}, True,
                                  ["engine/arg_utils.py"]),
    "_init_combine": ({v: "vllm.v1.attention.ops.dcp:MLADCPManager._init_combine" for v in ("0.32.0", "0.33.0")},
                      True, None),
    "check_and_update_config": ({v: "vllm.platforms.cpu:CpuPlatform.check_and_update_config"
                                 for v in ("0.32.0", "0.33.0")}, True, ["config/vllm.py"]),
}
"""Functions vLLM calls that the plugin wraps or overrides: the name vLLM calls, the plugin's
function that receives the call (per version: only where the plugin installs it), whether
vLLM calls it on an object (so ``self`` comes first), and the files whose calls reach it
(None: every call of that name in the sources)."""


def _calls(version: str) -> dict[str, tuple[str, bool, list[str] | None]]:
    out = {}
    for name, (path, method, files) in CALLS.items():
        path = path if isinstance(path, str) else path.get(version)
        if path is not None:
            out[name] = (path, method, files)
    return out


def _key(name: str) -> str:
    return name


def run_child(version: str, tmp: Path) -> dict:
    src = _need(version)
    env = {**__import__("os").environ}
    if version != "0.32.0":
        env["PYTHONPATH"] = f"{src}:{ROOT}"
    impls = {_key(name): path for name, (path, _, _) in _calls(version).items()}
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama-mqa", Path(tmp) / "model")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "sources_child.py"), json.dumps(vllm_imports(version)),
                          json.dumps(impls), str(model), "v2" if version in V2 else "v1"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def calls_in(src: Path, name: str, files: list[str] | None) -> list[tuple[str, int, int, list[str]]]:
    """``(file, line, positional count, keyword names)`` of every call of ``name`` (as a
    function or a method) in ``src/vllm``, or in ``files`` only; calls with ``*args``
    or ``**kwargs`` are left out (any arity binds)."""
    root = src / "vllm"
    paths = [root / f for f in files] if files else root.rglob("*.py")
    out = []
    for path in paths:
        text = path.read_text(errors="replace")
        if name not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if called != name or any(isinstance(a, ast.Starred) for a in node.args) or \
                    any(k.arg is None for k in node.keywords):
                continue
            out.append((str(path.relative_to(root)), node.lineno, len(node.args), [k.arg for k in node.keywords]))
    return out


def binds(params: list, n: int, keywords: list[str], method: bool) -> bool:
    import inspect

    sig = inspect.Signature([inspect.Parameter(name, getattr(inspect.Parameter, kind),
                                               default=0 if has_default else inspect.Parameter.empty)
                             for name, kind, has_default in params])
    try:
        sig.bind(*range(n + method), **dict.fromkeys(keywords, 0))
    except TypeError:
        return False
    return True


@pytest.fixture(scope="module", params=VERSIONS)
def child(request, tmp_path_factory):
    return request.param, run_child(request.param, tmp_path_factory.mktemp("model"))


def _expected(version: str, status: dict, cpu: bool) -> dict:
    """Each patch's status that is not what the table promises for ``version``: installed,
    or not needed there (naming vLLM's file), or, if CPU-only, not applicable on a GPU
    host or unchecked on a CPU platform the plugin was not checked on."""
    from vllm_dcp2d.vllm_compat.patches import CPU_SUPPORTED, CPU_UNCHECKED, PATCHES

    bad = {}
    for p in PATCHES:
        state = status[p.name]
        if version in p.not_needed:
            ok = state == f"not needed on vLLM {version}: {p.not_needed[version]}"
        elif p.cpu_only and not cpu:
            ok = state is not None and state.startswith("CPU only")
        elif p.cpu_only and version not in CPU_SUPPORTED:
            ok = state == CPU_UNCHECKED.format(version=version)
        else:
            ok = state is None
        if not ok:
            bad[p.name] = state
    return bad


@pytest.mark.timeout(600)
def test_every_patch_fits_and_every_vllm_import_resolves(child):
    version, got = child
    assert got["version"].split("+")[0] == version
    assert _expected(version, got["status"], cpu=True) == {}, got["status"]
    assert _expected(version, got["status_gpu"], cpu=False) == {}, got["status_gpu"]
    assert got["missing"] == [], got["missing"]
    # An API only newer versions have: it must resolve on the newest at least.
    if version == VERSIONS[-1]:
        assert all(got["optional"].values()), got["optional"]


@pytest.mark.timeout(600)
def test_both_sparse_mla_caches_are_dcp_sharded(child):
    """DeepSeek-V3.2 / GLM-5.x: the latent cache (fp8_ds_mla, 656 B per token) and the
    indexer's key cache (132 B), as this version's own layer classes give them: both
    DCP-sharded on a decode, so both move like the rest of the KV (page i to DCP rank
    i % dcp_size)."""
    version, got = child
    assert got["sparse_mla"] == [[64 * 656, True], [64 * 132, True]], got["sparse_mla"]


@pytest.mark.timeout(600)
def test_the_gpu_checks_allocation_runs_on_this_version(child):
    """``scripts/gpu-check.sh --vllm VERSION``'s mooncake row allocates KV through
    ``kv_alloc`` with that version's allocator: dense (8 heads of 128, 16-token pages,
    BLNHC: one run per page) and sparse MLA (the latent and the indexer's keys)."""
    version, got = child
    assert got["alloc"] == [[16 * 8 * 2 * 128 * 2], [64 * 656, 64 * 132]], got["alloc"]


@pytest.mark.timeout(600)
def test_which_dcp2d_instances_start(child):
    """On a GPU host of every supported version every kind of DCP2D instance starts;
    on 0.34's CPU platform (not checked) every kind is refused, naming the version."""
    from vllm_dcp2d.vllm_compat.patches import CPU_SUPPORTED, CPU_UNCHECKED

    version, got = child
    assert [why for _, why in got["roles_gpu"]] == [None] * len(got["roles_gpu"]), got["roles_gpu"]
    want = None if version in CPU_SUPPORTED else CPU_UNCHECKED.format(version=version)
    for name, why in got["roles"]:
        assert why is None if want is None else why.startswith(want), (name, why)


@pytest.mark.timeout(600)
def test_every_vllm_call_of_a_wrapped_function_binds(child):
    version, got = child
    src = _need(version)
    bad, seen = [], 0
    for name, (_, method, files) in _calls(version).items():
        key = _key(name)
        for file, line, n, kw in calls_in(src, name, files):
            seen += 1
            if not binds(got["impls"][key], n, kw, method):
                bad.append(f"vllm/{file}:{line} calls {name} with {n} positional and {kw} keyword "
                           f"arguments; the plugin's takes {[p[0] for p in got['impls'][key]]}")
    assert not bad, "\n".join(bad)
    assert seen >= len(_calls(version)), seen  # every wrapped function is called somewhere we looked


def test_the_import_scan_sees_the_package():
    found = [json.loads(g) for g in vllm_imports()["required"]]
    assert [["vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"]] in found
    assert any(len(g) == 2 for g in found), found  # a try/except ImportError pair (kv_alloc.py)
    assert len(found) > 40, found
    v1 = ["vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer"]  # marked "only vLLM 0.32.0, 0.33.0"
    assert [v1] in [json.loads(g) for g in vllm_imports("0.32.0")["required"]]
    assert [v1] not in [json.loads(g) for g in vllm_imports("0.34.0")["required"]]


@pytest.mark.timeout(600)
def test_an_engine_without_the_connector_gets_vllms_own_results(child):
    """Each wrapped function that runs without an engine, called for a configuration
    without the connector as this version's callers call it: vLLM's own result."""
    version, got = child
    assert got["same"] == dict.fromkeys(got["same"], True) and len(got["same"]) == (3 if version in V2 else 5), \
        got["same"]


@pytest.mark.timeout(600)
def test_a_dcp2d_decode_runs_its_draft_at_dcp_1_on_vllm_0_34(child):
    """vLLM 0.34's own ``draft_decode_context_parallel_size`` (its speculative config code)
    for a TP=2, DCP=2 engine with a draft model: 1 with DCP2DConnector, the user's own
    value kept, vLLM's default (the target's DCP) without the connector."""
    version, got = child
    if version not in V2:
        pytest.skip(f"vLLM {version} has no draft DCP size (its V1 runner: draft_dcp_disabled)")
    assert got["draft_dcp"] == {"dcp2d": 1, "dcp2d, user's 2": 2, "no connector": 2}, got["draft_dcp"]


@pytest.mark.timeout(600)
def test_layer_split_placements_survive_vllms_extensible_kv_cache(child):
    """vLLM 0.34 asks the connector how it reaches the KV cache: REGISTERS (so each
    segment is one physical allocation). Layer-split placements (TP=2, 5 layers: 3 + 2
    owned, each rank one transient slot) through vLLM's own ``pad_kv_cache_segments``
    (each layer region padded to a 2 MiB granule), the segments its extensible cache
    makes of them, and ``shrink_kv_cache_configs`` after measuring: owned layers and
    the shared transient slot keep their own regions, strides and offsets never change
    in shrinking, and only the sizes follow the block count."""
    version, got = child
    if version not in V2:
        pytest.skip(f"vLLM {version} has no extensible KV cache")
    assert got["kv_cache_access"] == [1, 1, True]  # KVCacheAccess.REGISTERS
    ext = got["extensible"]
    for rank, (blocks, place, sizes) in enumerate(ext["before"]):
        owned, stride = place[0][0], place[0][1]  # split_tensors: the owned layers' placement first
        assert stride >= blocks * place[0][2]
        assert [off for *_, off in place] == [0] + [len(owned) * stride] * (len(place) - 1), place
        assert sorted(n for layers, *_ in place for n in layers) == \
            sorted(f"model.layers.{i}.self_attn.attn" for i in range(ext["layers"]))
        assert set(sizes) == {(len(owned) + 1) * stride}
        offsets, strides = ext["segments"][rank]
        assert offsets == [i * ext["padded"][rank][0][1] for i in range(len(owned) + 1)] and len(set(strides)) == 1
        s_blocks, s_place, s_sizes = ext["shrunk"][rank]
        assert s_blocks == ext["shrunk_to"] and s_place == place
        assert s_sizes == [size * ext["shrunk_to"] // blocks for size in sizes]


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_passes_the_kv_cache_where_the_layer_split_hook_reads_it(version):
    """The layer-split fill hooks ``impl.do_kv_cache_update`` on each layer and reads the
    tensor about to be written at ``vllm_compat.kv_cache.KV_CACHE_ARG`` (every backend, CPU and
    GPU): in this version's sources, the attention layers' calls pass ``kv_cache`` there."""
    from vllm_dcp2d.vllm_compat.kv_cache import KV_CACHE_ARG

    root = _need(version) / "vllm" / "model_executor" / "layers" / "attention"
    for kind, file in (("attention", "attention.py"), ("mla", "mla_attention.py")):
        found = []
        for node in ast.walk(ast.parse((root / file).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "do_kv_cache_update":
                arg = node.args[KV_CACHE_ARG[kind]] if len(node.args) > KV_CACHE_ARG[kind] else None
                found.append((node.lineno, getattr(arg, "id", ast.dump(arg) if arg else None)))
        assert found and all(name == "kv_cache" for _, name in found), (version, file, found)


DSA_ATTENTION = "vllm.models.deepseek_v32.attention:DeepseekV32Attention"


@pytest.mark.timeout(600)
def test_the_dsa_architectures_kv_writes_reach_the_connector_on_cuda(child):
    """Issue 51: on CUDA vLLM's registry loads DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
    (GLM-5.x) and DeepseekV32MTPModel from ``vllm/models/deepseek_v32/nvidia``, whose attention
    (DeepseekV32Attention) overrides ``MLAAttention.forward`` and writes both caches inside
    ``fused_norm_rope``, outside the op vLLM's ``maybe_transfer_kv_layer`` wraps. Every
    attention class of that package must be one whose KV writes a connector hears: vLLM's
    own ``forward``, or hooked by the plugin (``vllm_compat/dsa.py``, patch
    ``dsa_fused_kv_write``). A new DSA attention class, or the hook's target gone, fails here."""
    version, got = child
    assert set(got["dsa"]) == {"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV32MTPModel"}
    for arch, seen in got["dsa"].items():
        assert seen["class"].startswith("vllm.models.deepseek_v32.nvidia."), (version, arch, seen["class"])
        assert DSA_ATTENTION in seen["attention"] and DSA_ATTENTION in seen["fused"], (version, arch, seen)
        unheard = {cls: why for cls, why in seen["attention"].items() if why is not None}
        assert not unheard, (version, arch, unheard)
    assert got["status_gpu"]["dsa_fused_kv_write"] is None, got["status_gpu"]["dsa_fused_kv_write"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_hooked_method_runs_after_both_caches_of_a_dsa_layer_are_written(version):
    """The hook fires where ``dsa.METHOD`` returns, so everything that writes a DSA layer's
    caches must run before that: in this version's ``DeepseekV32Attention.forward`` every call
    that writes them (``fused_norm_rope``: the latent and the indexer's keys;
    ``update_kv_cache``: HiSparse) precedes the call of ``dsa.METHOD``, after which only
    ``o_proj`` runs; inside it the only cache writes are the PCP ones (``do_kv_cache_update``,
    ``sparse_attn_indexer`` without ``skip_k_cache_insert``), before it returns. And vLLM's
    own attention op takes the connector call in the order the hook does
    (``eager_break_during_capture`` outside ``maybe_transfer_kv_layer``)."""
    from vllm_dcp2d.vllm_compat import dsa

    root = _need(version) / "vllm"
    tree = ast.parse((root / "models" / "deepseek_v32" / "attention.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV32Attention")
    fns = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}

    def calls(fn):
        out = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                f = node.func
                out.append((node.lineno, f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)))
        return sorted(out)

    forward = calls(fns["forward"])
    at = [line for line, name in forward if name == dsa.METHOD]
    writes = [line for line, name in forward if name in ("fused_norm_rope", "update_kv_cache", "do_kv_cache_update")]
    assert len(at) == 1 and writes and max(writes) < at[0], (version, at, writes)
    assert {name for line, name in forward if line > at[0]} <= {"o_proj"}, (version, forward)
    inner = {name for _, name in calls(fns[dsa.METHOD])}
    assert [getattr(d, "id", None) for d in fns[dsa.METHOD].decorator_list] == ["eager_break_during_capture"]
    assert "update_kv_cache" not in inner and "fused_norm_rope" not in inner, (version, inner)
    mla = ast.parse((root / "model_executor" / "layers" / "attention" / "mla_attention.py").read_text())
    op = next(n for n in ast.walk(mla) if isinstance(n, ast.FunctionDef) and n.name == "unified_mla_attention_with_output")
    assert [getattr(d, "id", None) for d in op.decorator_list] == ["eager_break_during_capture",
                                                                   "maybe_transfer_kv_layer"], (version, op.lineno)


@pytest.mark.timeout(600)
def test_layers_without_an_indexer_with_vllms_own_settings(child):
    """vLLM 0.34's ``compute_skip_topk_layers`` (``indexer_types`` "shared", ``index_topk_freq``)
    decides which layers build an indexer; with those layers' caches as vLLM's own specs,
    customized by the backends (Hopper and Blackwell alignments) and allocated by 0.34's
    allocator, each layer moves its own planes byte for byte between two layouts, and the
    regions say which layers hold the indexer's keys."""
    version, got = child
    if version not in V2:
        pytest.skip(f"vLLM {version} has no compute_skip_topk_layers (its DSA layers compute the same inline)")
    want = {"indexer_types": [0, 1, 3], "index_topk_freq=2": [0, 1, 3, 5]}
    for name, indexer in want.items():
        assert got["skip_topk"][name] == {"indexer": indexer, "with_indexer": [indexer] * 4}, (name, got["skip_topk"])
