"""``vllm_dcp2d.reshard`` is pure math a user can import on its own: no module in it imports
vLLM, the connector, the transfer, the vLLM glue or anything that does I/O (sockets, ZMQ,
Mooncake, HTTP, processes, threads); from the package it imports only itself and the leaf
``vllm_dcp2d.config`` (``ConfigError``); and only ``page_format`` imports torch (it reads a
KV view's strides and element size, and names torch's fp8 dtypes).

Read twice: from the source (the AST of every file, so a lazy import inside a function
counts too), and in a fresh interpreter that imports every module of the package.
"""

import ast
import json
import pathlib
import pkgutil
import subprocess
import sys

import vllm_dcp2d.reshard
from tests.support.imports import imported, offending

PACKAGE = pathlib.Path(vllm_dcp2d.reshard.__file__).parent
FORBIDDEN = ("vllm", "vllm_dcp2d.connector", "vllm_dcp2d.transfer", "vllm_dcp2d.vllm_compat",
             "socket", "zmq", "mooncake", "msgpack", "aiohttp", "asyncio", "http", "urllib", "requests",
             "subprocess", "multiprocessing", "threading", "concurrent", "selectors", "ssl", "shutil",
             "tempfile", "io", "os", "pathlib", "logging")
OWN = ("vllm_dcp2d.reshard", "vllm_dcp2d.config")  # the only first-party imports allowed
TORCH = {"page_format.py"}  # the modules that import torch, and why: above


def modules() -> list[str]:
    return sorted(f"vllm_dcp2d.reshard.{m.name}" for m in pkgutil.iter_modules([str(PACKAGE)]))


def test_reshard_imports_no_vllm_no_glue_and_no_io():
    assert len(modules()) >= 8
    bad = offending(PACKAGE, FORBIDDEN)
    assert not bad, bad


def test_reshard_imports_only_itself_and_the_config_leaf_from_the_package():
    first_party = offending(PACKAGE, ("vllm_dcp2d",))
    bad = [line for line in first_party
           if not any(line.split(": ")[1] == p or line.split(": ")[1].startswith(p + ".") for p in OWN)]
    assert not bad, bad


def test_only_page_format_imports_torch():
    users = {f.name for f in PACKAGE.glob("**/*.py")
             if any(n == "torch" or n.startswith("torch.") for n in imported(ast.parse(f.read_text())))}
    assert users == TORCH, users


def test_a_fresh_interpreter_imports_the_package_without_vllm_and_the_math_without_torch():
    """Every module but ``page_format`` without torch; all of them without vLLM, ZMQ or
    Mooncake."""
    pure = [m for m in modules() if m.rsplit(".", 1)[1] + ".py" not in TORCH]
    probe = ("import importlib, json, sys\n"
             "watch = ('vllm', 'torch', 'zmq', 'mooncake', 'aiohttp', 'socket')\n"
             "loaded = lambda: sorted({m.split('.')[0] for m in sys.modules} & set(watch))\n"
             "import vllm_dcp2d.reshard\n"
             f"for m in {pure!r}: importlib.import_module(m)\n"
             "pure = loaded()\n"
             f"for m in {modules()!r}: importlib.import_module(m)\n"
             "print(json.dumps([pure, loaded()]))\n")
    # -I: a fresh interpreter as a user's, nothing from PYTHONPATH run at start-up (the suite as
    # an AVX2 host puts tests/support/avx2_host there, whose sitecustomize imports torch)
    p = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    pure_loaded, all_loaded = json.loads(p.stdout.splitlines()[-1])
    assert pure_loaded == [], pure_loaded
    assert not set(all_loaded) & {"vllm", "zmq", "mooncake", "aiohttp"}, all_loaded


def test_the_rule_catches_a_forbidden_import():
    tree = ast.parse("def f():\n    from vllm_dcp2d.transfer import sender\n    import zmq\n    import vllm\n")
    names = imported(tree)
    assert {"vllm_dcp2d.transfer.sender", "zmq", "vllm"} <= set(names)
