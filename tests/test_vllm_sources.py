"""vllm_compat against the sources of every vLLM version it supports (issue 26, item 3).

0.32.0 is installed; 0.33.0 has no CPU build, so ``scripts/setup.sh`` caches its
wheel's Python sources (``.venv/vllm-src/0.33.0``), which import on this venv in
front of the installed package (``PYTHONPATH``). For each version, in a fresh
interpreter that imports that version:

* every patch of ``vllm_compat/patches.py`` resolves: its targets exist and take
  the parameters the patch was written for (the registry's own check), so the
  patch is installed;
* every vLLM import anywhere in the package (read from its source, lazy imports
  included) resolves;
* ``register()`` leaves an engine without the connector with vLLM's own results:
  each wrapped function that can be called without an engine is called the way
  that version's callers call it, for a configuration without the connector, and
  gives what vLLM's own function gives.

And without running that version: every call vLLM makes of a function the plugin
wraps or overrides (found in that version's sources) binds to the plugin's
function, with its positional and keyword arguments.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
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


VERSIONS = ["0.32.0", "0.33.0"]


def _need(version: str) -> Path:
    src = sources(version)
    if src is None:
        pytest.fail(f"vLLM {version}'s sources are not cached in {Path(sys.prefix) / 'vllm-src' / version}; "
                    f"run bash scripts/setup.sh")
    return src


def _imports_of(nodes) -> list[tuple[str, str | None]]:
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                (node.module == "vllm" or node.module.startswith("vllm.")):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name == "vllm" or a.name.startswith("vllm.")]
    return out


def vllm_imports() -> list[list[tuple[str, str | None]]]:
    """Every ``from vllm... import name`` / ``import vllm...`` in the package, as groups
    of alternatives: the imports of one ``try: ... except ImportError:`` (a module that
    moved between versions) form one group, of which one must resolve; any other
    import is a group of its own."""
    groups = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        alternatives = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in node.handlers):
                body = list(node.body) + [n for h in node.handlers for n in h.body]
                group = _imports_of(body)
                if group:
                    groups.append(sorted(group, key=str))
                    alternatives |= {id(n) for n in body}
        groups += [[imp] for node in ast.walk(tree) if id(node) not in alternatives for imp in _imports_of([node])]
    return sorted({json.dumps(g) for g in groups})


CHILD = textwrap.dedent("""
    import importlib, inspect, json, sys
    imports, impls = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    import vllm
    from vllm_dcp2d.vllm_compat import registry
    registry.install_all()
    def why_not(module, name):
        try:
            m = importlib.import_module(module)
        except Exception as e:
            return f"{module}: {type(e).__name__}: {e}"
        if name is not None and not hasattr(m, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except Exception:
                return f"{module} has no {name}"

    missing = []
    for group in map(json.loads, imports):
        whys = [why_not(module, name) for module, name in group]
        if all(whys):
            missing.append(" / ".join(whys))

    def params(path):
        module, _, qual = path.partition(":")
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
                for p in inspect.signature(obj).parameters.values()]

    # An engine without the connector: every wrapped function called as this version's
    # callers call it gives what vLLM's own function (``_dcp2d_stock``) gives.
    import copy
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine import core
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker import gpu_model_runner
    try:
        from vllm.v1.core import kv_cache_planning as planning  # 0.33
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planning  # 0.32
    cfg = EngineArgs(model=sys.argv[3], enforce_eager=True, dtype="float32", block_size=32,
                     kv_cache_memory_bytes=64 << 20).create_engine_config()
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    record_kv_cache_layout(cfg.cache_config, "LBHNC")  # what the engine core resolves on CPU first
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32,
                                                                   dtype=torch.float32) for i in range(4)}
    mem = [64 << 20]
    extra = [planning.get_global_kv_cache_groups(cfg, [specs])] if hasattr(planning, "get_global_kv_cache_groups") else []

    def both(fn, *args):
        stock = getattr(fn, "_dcp2d_stock", None)
        assert stock is not None, f"{fn} is not wrapped"
        return fn(*args), stock(*args)

    same = {}
    got, want = both(core.get_kv_cache_configs, cfg, [specs], mem, *extra)
    same["get_kv_cache_configs"] = repr(got) == repr(want)
    got, want = both(planning.get_kv_cache_groups, cfg, specs)
    same["get_kv_cache_groups"] = repr(got) == repr(want)
    arg = extra[0] if extra else core.get_kv_cache_configs(cfg, [specs], mem)[0]
    a, b = copy.deepcopy(cfg), copy.deepcopy(cfg)
    wrapped = type(cfg).adjust_dcp_kv_cache_interleave_size
    wrapped(a, arg), wrapped._dcp2d_stock(b, arg)
    same["adjust_dcp_kv_cache_interleave_size"] = repr(a.parallel_config) == repr(b.parallel_config)
    a, b = copy.deepcopy(cfg), copy.deepcopy(cfg)
    cls = type(current_platform)
    cls.check_and_update_config(a), cls.check_and_update_config.__func__._dcp2d_stock(cls, b)
    same["check_and_update_config"] = (repr(a.attention_config), a.cache_config.block_size) == \
        (repr(b.attention_config), b.cache_config.block_size)
    got, want = both(gpu_model_runner.check_attention_cp_compatibility, cfg)
    same["check_attention_cp_compatibility"] = got is None and want is None
    print(json.dumps({"version": vllm.__version__, "status": registry.status(), "missing": missing,
                      "impls": {name: params(path) for name, path in impls.items()}, "same": same}))
""")

# Functions vLLM calls that the plugin wraps or overrides: the name vLLM calls, the
# plugin's function that receives the call, whether vLLM calls it on an object (so
# ``self`` comes first), and the files whose calls reach it (None: every call of
# that name in the sources).
CALLS = {
    "get_kv_cache_configs": ("vllm.v1.engine.core:get_kv_cache_configs", False, ["v1/engine/core.py"]),
    "adjust_dcp_kv_cache_interleave_size": ("vllm.config:VllmConfig.adjust_dcp_kv_cache_interleave_size", True,
                                            None),
    "get_kv_cache_groups": ({"0.32.0": "vllm.v1.core.kv_cache_utils:get_kv_cache_groups",
                             "0.33.0": "vllm.v1.core.kv_cache_planning:get_kv_cache_groups"}, False, None),
    "check_attention_cp_compatibility": ("vllm.v1.worker.gpu_model_runner:check_attention_cp_compatibility",
                                         False, None),
    "may_reinitialize_input_batch": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.may_reinitialize_input_batch",
                                     True, None),
    "_sample": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample", True, ["v1/worker/gpu_model_runner.py"]),
    "_init_combine": ("vllm.v1.attention.ops.dcp:MLADCPManager._init_combine", True, None),
    "check_and_update_config": ("vllm.platforms.cpu:CpuPlatform.check_and_update_config", True,
                                ["config/vllm.py"]),
}


def _key(name: str) -> str:
    return name


def run_child(version: str, tmp: Path) -> dict:
    src = _need(version)
    env = {**__import__("os").environ}
    env.pop("TRITON_INTERPRET", None)
    if version != "0.32.0":
        env["PYTHONPATH"] = f"{src}:{ROOT}"
    impls = {_key(name): path if isinstance(path, str) else path[version] for name, (path, _, _) in CALLS.items()}
    from vllm_dcp2d.testing.tiny_models import build_tiny_model

    model = build_tiny_model("llama-mqa", Path(tmp) / "model")
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(vllm_imports()), json.dumps(impls), str(model)],
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


@pytest.mark.timeout(600)
def test_every_patch_fits_and_every_vllm_import_resolves(child):
    version, got = child
    assert got["version"].split("+")[0] == version
    assert got["status"] == {name: None for name in got["status"]} or \
        {k: v for k, v in got["status"].items() if v and not v.startswith("CPU only")} == {}, got["status"]
    assert got["missing"] == [], got["missing"]


@pytest.mark.timeout(600)
def test_every_vllm_call_of_a_wrapped_function_binds(child):
    version, got = child
    src = _need(version)
    bad, seen = [], 0
    for name, (_, method, files) in CALLS.items():
        key = _key(name)
        for file, line, n, kw in calls_in(src, name, files):
            seen += 1
            if not binds(got["impls"][key], n, kw, method):
                bad.append(f"vllm/{file}:{line} calls {name} with {n} positional and {kw} keyword "
                           f"arguments; the plugin's takes {[p[0] for p in got['impls'][key]]}")
    assert not bad, "\n".join(bad)
    assert seen >= len(CALLS), seen  # every wrapped function is called somewhere we looked


def test_the_import_scan_sees_the_package():
    found = [json.loads(g) for g in vllm_imports()]
    assert [["vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"]] in found
    assert any(len(g) == 2 for g in found), found  # a try/except ImportError pair (kv_alloc.py)
    assert len(found) > 40, found


@pytest.mark.timeout(600)
def test_an_engine_without_the_connector_gets_vllms_own_results(child):
    """Each wrapped function that runs without an engine, called for a configuration
    without the connector as this version's callers call it: vLLM's own result."""
    version, got = child
    assert got["same"] == dict.fromkeys(got["same"], True) and len(got["same"]) == 5, got["same"]


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
