"""``plugin.register()`` on a vLLM other than the one its patches target.

vLLM calls every ``general_plugins`` entry point in every process without a
try/except: a patch that does not fit the installed vLLM breaks every engine,
DCP2D or not (issue 26: vLLM 0.33 moved ``get_kv_cache_configs`` and changed its
arity). So on another version ``register()`` must install nothing: every
attribute of every vLLM module and class loaded by then is the object vLLM
made. A DCP2D instance is refused by ``check_vllm_version``, naming both.

Each case runs in a fresh interpreter, the only way to see vLLM unpatched.
The control case (the target version) checks that the snapshot does see the
patches, so the comparison cannot pass by looking at nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from vllm_dcp2d.vllm_compat import VLLM_VERSION

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent("""
    import importlib, inspect, json, sys
    import vllm_dcp2d.vllm_compat as compat
    compat.installed_vllm_version = lambda: sys.argv[1]
    # Every module a patch targets, loaded before the snapshot so a rebinding shows.
    for name in ["vllm.config", "vllm.v1.engine.core", "vllm.v1.core.kv_cache_utils",
                 "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.registry",
                 "vllm.v1.spec_decode.llm_base_proposer", "vllm.distributed.device_communicators.cpu_communicator",
                 "vllm.model_executor.layers.attention.mla_attention", "vllm.v1.attention.ops.dcp",
                 "vllm.distributed.kv_transfer.kv_connector.factory"]:
        importlib.import_module(name)

    def snapshot():
        seen = {}
        for mod_name, mod in list(sys.modules.items()):
            if not mod_name.startswith("vllm.") or mod is None:
                continue
            for k, v in list(vars(mod).items()):
                seen[f"{mod_name}.{k}"] = id(v)
                if inspect.isclass(v) and v.__module__ == mod_name:
                    for ck, cv in list(vars(v).items()):
                        seen[f"{mod_name}.{k}.{ck}"] = id(cv)
        return seen

    before = snapshot()
    from vllm_dcp2d import plugin
    plugin.register()
    after = snapshot()
    changed = sorted(k for k in before if after.get(k) != before[k])
    refusal = ""
    try:
        compat.check_vllm_version()
    except RuntimeError as e:
        refusal = str(e)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    print(json.dumps({"changed": changed, "refusal": refusal,
                      "registered": plugin.CONNECTOR_NAME in KVConnectorFactory._registry}))
""")


def run(version: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, version], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", ["0.33.0", "0.31.1"])
def test_another_vllm_is_left_as_vllm_made_it(version):
    got = run(version)
    assert got["changed"] == []
    assert got["registered"]  # the name resolves, so a DCP2D instance reaches the refusal below
    assert f"vLLM {version} is installed" in got["refusal"] and VLLM_VERSION in got["refusal"]


def test_the_target_vllm_is_patched():
    got = run(VLLM_VERSION)
    assert "vllm.v1.engine.core.get_kv_cache_configs" in got["changed"], got["changed"]
    assert got["refusal"] == "" and got["registered"]
