"""``plugin.register()`` where a patch does not fit the installed vLLM (issue 26, item 1).

vLLM calls every ``general_plugins`` entry point in every process without a
try/except: a patch that does not fit the installed vLLM would break every engine,
DCP2D or not. So a patch whose target is missing, or takes other parameters than
the patch was written for, or that targets another vLLM version, is not installed
(``vllm_compat/registry.py``): every attribute of every vLLM module and class
loaded by then stays the object vLLM made, ``register()`` does not raise, and a
DCP2D instance that needs the patch is refused with one message naming the vLLM
version, the patch and the reason.

Each case runs in a fresh interpreter, the only way to see vLLM unpatched: a vLLM
version the patches were not written for (0.31.1, 0.34.0); on the installed 0.32.0
every patch made unavailable (its target missing, or its target's parameters
changed); and each patch made unavailable in turn, half of them per interpreter,
beside the other half installed. The control case (0.32.0 as it is) checks that the
snapshot does see the patches, so the comparison cannot pass by looking at nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent("""
    import dataclasses, importlib, inspect, json, sys
    import vllm
    from types import SimpleNamespace as NS
    version, broken, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from vllm_dcp2d.vllm_compat import patches, registry
    if version != "installed":
        registry.installed_vllm_version = lambda: version
    def breaks(i, p):
        # the patch's targets made unavailable, alternately: missing, or taking other
        # parameters than the patch was written for
        if i % 4 < 2:
            return {v: tuple(patches.Target("vllm.no_such_module:" + t.path.split(":")[1], t.params) for t in ts)
                    for v, ts in p.targets.items()}
        return {v: tuple(patches.Target(t.path, t.params + ("changed",)) for t in ts) for v, ts in p.targets.items()}

    def raw(path):  # the object at a target's path now, wrapped or not
        module, _, qual = path.partition(":")
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        return obj
    # Every module a patch targets, loaded before the snapshot so a rebinding shows.
    for p in patches.PATCHES:
        for ts in p.targets.values():
            for t in ts:
                try:
                    importlib.import_module(t.path.split(":")[0])
                except ImportError:
                    pass  # a target of the other supported version
    importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory")
    # broken: "none", "all", or "even"/"odd": those patches broken, the others as they are
    # (a patch the installed vLLM does not need has nothing to break)
    parity = {"even": 0, "odd": 1}.get(broken)
    version_targets = [p.targets.get(vllm.__version__.split("+")[0], ()) for p in patches.PATCHES]
    hit = [bool(version_targets[i]) and (broken == "all" or (parity is not None and i % 2 == parity))
           for i in range(len(patches.PATCHES))]
    own = {t.path: raw(t.path) for ts in version_targets for t in ts}
    broken_paths = [t.path for i, ts in enumerate(version_targets) if hit[i] for t in ts]
    if any(hit):  # the registry reads this same list
        patches.PATCHES[:] = [dataclasses.replace(p, targets=breaks(i, p)) if hit[i] else p
                              for i, p in enumerate(patches.PATCHES)]

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
    # every target of a broken patch is still vLLM's own object
    kept = all(raw(path) is own[path] for path in broken_paths)

    # DCP2D instances: a decode with DCP=2 serving an MLA model with a draft, and a
    # layer-split prefill; between them every patch that is needed anywhere is needed.
    # Then every role and setting of ``cases``.
    def config(role, dcp=1, mla=False, draft=False, tp=2, layer_split="auto"):
        kv = NS(kv_connector=plugin.CONNECTOR_NAME, kv_role=role,
                kv_connector_extra_config={"layer_split": layer_split})
        spec = NS(uses_draft_kv_cache=lambda: True) if draft else None
        return NS(kv_transfer_config=kv, speculative_config=spec, model_config=NS(use_mla=mla),
                  parallel_config=NS(decode_context_parallel_size=dcp, tensor_parallel_size=tp))
    decode, prefill = dict(role="kv_consumer", dcp=2, mla=True, draft=True), dict(role="kv_producer", mla=True)
    refusals = {}
    for name, kw in [("decode", decode), ("prefill", prefill)] + [(json.dumps(c), c) for c in cases]:
        try:
            registry.require(config(**kw))
        except RuntimeError as e:
            refusals[name] = str(e)
    needed = sorted(p.name for p in patches.PATCHES if p.needed(config(**decode)) or p.needed(config(**prefill)))
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    print(json.dumps({"changed": changed, "status": registry.status(), "refusals": refusals, "needed": needed,
                      "registered": plugin.CONNECTOR_NAME in KVConnectorFactory._registry, "hit": hit,
                      "broken_kept": kept}))
""")


# Every role and setting a DCP2D instance can have that the plugin's start-up check tells apart.
CASES = [dict(role="kv_producer", tp=tp, layer_split=ls, mla=mla)
         for tp in (1, 2) for ls in ("auto", "on", "off") for mla in (False, True)] + \
        [dict(role="kv_consumer", dcp=dcp, draft=draft, mla=mla)
         for dcp in (1, 2) for draft in (False, True) for mla in (False, True)] + \
        [dict(role="kv_both", dcp=dcp) for dcp in (1, 2)]
UNKNOWN = "99.0.0"  # a vLLM version that does not exist


def run(version: str = "installed", broken: str = "none", cases: list | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, version, broken, json.dumps(cases or [])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_nothing_patched_and_refused(got: dict, version: str, why, unchecked: bool = False) -> None:
    """``why``: what every refusal and status names, or ``why(patch_index)``; unchecked:
    the version is not one the plugin supports, so every refusal says that instead."""
    assert got["changed"] == []  # every vLLM object is the one vLLM made
    assert got["registered"]  # the name resolves, so a DCP2D instance reaches the refusal
    assert set(got["needed"]) >= {"cpu_attention_backends", "cp_slot_mapping", "draft_dcp_disabled",
                                  "layer_split_kv_configs", "dcp_interleave"}, got["needed"]
    reason = why if callable(why) else (lambda i: why)
    order = list(got["status"])
    for name, refusal in got["refusals"].items():
        head = f"vllm_dcp2d cannot serve this DCP2DConnector instance on vLLM {version}: "
        if unchecked:
            assert refusal.startswith(head + f"vllm_dcp2d was not checked against vLLM {version} "), (name, refusal)
            continue
        assert refusal.startswith(head + "it needs the patch "), (name, refusal)
        patch = refusal.split("the patch '", 1)[1].split("'", 1)[0]
        assert reason(order.index(patch)) in refusal, (name, refusal)
    assert {"decode", "prefill"} <= set(got["refusals"]), got["refusals"]
    for i, (name, state) in enumerate(got["status"].items()):
        if not unchecked and state.startswith(f"not needed on vLLM {version}"):
            continue  # nothing of it to break on this vLLM
        assert state is not None and reason(i) in state, (name, state)


@pytest.fixture(scope="module")
def unknown():
    return run(UNKNOWN, cases=CASES)


@pytest.mark.parametrize("version", ["0.31.1", UNKNOWN])
def test_another_vllm_is_left_as_vllm_made_it(version, unknown):
    got = unknown if version == UNKNOWN else run(version)
    _check_nothing_patched_and_refused(got, version, f"not {version}", unchecked=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_every_dcp2d_instance_refuses_on_an_unchecked_vllm(case, unknown):
    """Every role and setting, including the ones that need no patch (a DCP=1 decode, a
    producer with layer_split off): refused at start-up naming the version; the vLLM
    objects stay vLLM's (checked once for the interpreter, above)."""
    refusal = unknown["refusals"].get(json.dumps(case))
    assert refusal == (f"vllm_dcp2d cannot serve this DCP2DConnector instance on vLLM {UNKNOWN}: vllm_dcp2d was "
                       f"not checked against vLLM {UNKNOWN} (it supports 0.32.0, 0.33.0, 0.34.0); no "
                       f"DCP2DConnector instance starts on it, whatever its role and settings. Install a supported "
                       f"vLLM (pip install 'vllm-dcp2d[gpu]')."), refusal


def test_every_patch_made_unavailable_leaves_vllm_as_it_was():
    """Every patch's targets made unavailable on the installed vLLM (alternately missing,
    or taking other parameters): nothing changes, and DCP2D instances are refused."""
    from vllm_dcp2d.vllm_compat import installed_vllm_version

    _check_nothing_patched_and_refused(run(broken="all"), installed_vllm_version(), _why)


def _why(i: int) -> str:
    return ("vllm.no_such_module cannot be imported", "the patch was written for")[i % 4 >= 2]


@pytest.mark.parametrize("half", ["even", "odd"])
def test_a_patch_whose_target_does_not_fit_is_left_out_and_the_others_install(half):
    """Each patch forced unavailable in turn, half of them per interpreter: a broken
    patch is not installed (its targets stay vLLM's own objects) and is named with its
    reason; the other half installs as usual; a DCP2D instance that needs a broken one
    is refused naming it, one that needs only installed ones is not."""
    got = run(broken=half)
    status, hit = got["status"], got["hit"]
    assert got["broken_kept"] and got["registered"]
    for i, (name, state) in enumerate(status.items()):
        if hit[i]:
            assert state is not None and _why(i) in state, (name, state)
        else:
            assert state is None or state.startswith(("CPU only", "not needed on vLLM")), (name, state)
    for who, refusal in got["refusals"].items():
        patch = refusal.split("the patch '", 1)[1].split("'", 1)[0]
        assert hit[list(status).index(patch)], (who, refusal)


def test_the_installed_vllm_is_patched():
    """The control: on the installed vLLM every role and setting starts."""
    got = run(cases=CASES)
    assert "vllm.v1.engine.core.get_kv_cache_configs" in got["changed"], got["changed"]
    assert got["refusals"] == {} and got["registered"]
    assert {k: v for k, v in got["status"].items() if v is not None and not v.startswith("not needed")} == {}, \
        got["status"]
