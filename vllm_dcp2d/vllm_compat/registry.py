"""Installs the patches of ``patches.PATCHES`` that fit the installed vLLM, and
refuses a DCP2DConnector instance that needs one that does not.

vLLM calls the plugin's ``register()`` in every process, without a try/except,
whatever the engine (``vllm/plugins/__init__.py``). So nothing here may break an
engine that does not use DCP2DConnector. For each patch, :func:`install_all`
looks up the objects it wraps for the installed vLLM version, checks that each
still takes the parameters the patch was written for, and only then installs
it; otherwise it records why not, and vLLM's own object stays. A patch the
installed vLLM made unnecessary (``Patch.not_needed``) is neither installed nor
required. A DCP2DConnector instance refuses to start (:func:`require`), naming
the vLLM version and the reason, on a vLLM version (or a CPU platform of one)
the plugin was not checked against, and where it needs a patch that is not
installed. ``vllm-dcp2d compat`` prints the patch table (:func:`rows`) and what each
kind of DCP2D instance would do (:func:`roles`).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

from vllm_dcp2d.vllm_compat.patches import (CPU_SUPPORTED, CPU_UNCHECKED, PATCHES, SUPPORTED, Patch, Unavailable,
                                            installed_vllm_version)

log = logging.getLogger(__name__)

__all__ = ["register_connector", "install_all", "status", "unchecked", "require", "check", "rows", "roles"]


def register_connector() -> None:
    """Make ``kv_connector="DCP2DConnector"`` resolvable through vLLM's connector factory
    (a public vLLM API, the same in 0.32, 0.33 and 0.34; idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_dcp2d.config import CONNECTOR_CLASS, CONNECTOR_NAME

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, *CONNECTOR_CLASS)


@dataclass
class _State:
    version: str = ""
    cpu: bool = False
    why_not: dict[str, str] = field(default_factory=dict)  # patch -> why it is not installed
    elsewhere: dict[str, str] = field(default_factory=dict)  # patch -> why it does not apply here
    unneeded: dict[str, str] = field(default_factory=dict)  # patch -> the upstream file doing it on this vLLM
    done: bool = False


_state = _State()


def _why_not(patch: Patch, version: str) -> str | None:
    targets = patch.targets.get(version)
    if targets is None:
        return f"it is written for vLLM {', '.join(patch.targets)}, not {version}"
    try:
        for t in targets:
            t.resolve()
    except Unavailable as e:
        return str(e)
    return None


def install_all() -> None:
    """Install every patch whose targets fit the installed vLLM (idempotent).

    Called by ``vllm_dcp2d.plugin.register`` in every vLLM process. Never raises:
    a patch that does not fit, or whose install fails, is recorded and left out."""
    if _state.done:
        return
    from vllm.platforms import current_platform

    _state.version, cpu = installed_vllm_version(), current_platform.is_cpu()
    _state.cpu = cpu
    for patch in PATCHES:
        if _state.version in patch.not_needed:
            _state.unneeded[patch.name] = f"not needed on vLLM {_state.version}: {patch.not_needed[_state.version]}"
            continue
        if patch.cpu_only and not cpu:
            _state.elsewhere[patch.name] = "CPU only (vLLM's GPU backends do this themselves)"
            continue
        if patch.cpu_only and _state.version in SUPPORTED and _state.version not in CPU_SUPPORTED:
            why = CPU_UNCHECKED.format(version=_state.version)
        else:
            why = _why_not(patch, _state.version)
        if why is None and patch.install is not None:
            module, _, fn = patch.install.partition(":")
            try:
                getattr(importlib.import_module(module), fn)(_state.version)
            except Exception as e:  # noqa: BLE001 - a patch that fails is left out; the engine starts
                why = f"its install raised {type(e).__name__}: {e}"
        if why is not None:
            _state.why_not[patch.name] = why
            log.warning("vllm_dcp2d: patch %r not installed on vLLM %s: %s", patch.name, _state.version, why)
    _state.done = True


def status() -> dict[str, str | None]:
    """Patch name -> None if installed (or ready for its later install), else why not
    (not installed, not applicable on this platform, or not needed on this vLLM)."""
    install_all()
    return {p.name: _state.why_not.get(p.name, _state.elsewhere.get(p.name, _state.unneeded.get(p.name)))
            for p in PATCHES}


def _refusal(patch: Patch, why: str) -> str:
    return (f"vllm_dcp2d cannot serve this DCP2DConnector instance on vLLM {_state.version}: it needs the "
            f"patch {patch.name!r} ({patch.reason}), which is not installed: {why}. Supported vLLM versions: "
            f"{', '.join(SUPPORTED)}.")


def unchecked() -> str | None:
    """Why no DCP2D instance may start on this vLLM and platform, or None: a version the
    plugin was not checked against (whatever patches happen to fit it), or the CPU
    platform of a version checked on GPU only."""
    install_all()
    if _state.version not in SUPPORTED:
        return (f"vllm_dcp2d was not checked against vLLM {_state.version} (it supports "
                f"{', '.join(SUPPORTED)}); no DCP2DConnector instance starts on it, whatever its role and "
                f"settings. Install a supported vLLM (pip install 'vllm-dcp2d[gpu]').")
    if _state.cpu and _state.version not in CPU_SUPPORTED:
        return CPU_UNCHECKED.format(version=_state.version) + "; no DCP2DConnector instance starts on it."
    return None


def check(name: str) -> None:
    """Raise ``RuntimeError`` unless patch ``name`` fits this vLLM: for a patch that
    the code needing it installs later (``Patch.install`` None), before it does."""
    install_all()
    patch = next(p for p in PATCHES if p.name == name)
    why = _state.why_not.get(name, _state.elsewhere.get(name))
    if why is not None:
        raise RuntimeError(_refusal(patch, why))


def require(vllm_config) -> None:
    """Raise ``RuntimeError`` naming the vLLM version and the reason if this vLLM (or its
    CPU platform) was not checked (:func:`unchecked`: every DCP2D instance), or if this
    DCP2DConnector instance needs a patch that is not installed (naming the patch).
    Called when the connector is built (engine core and every worker), before the first
    step."""
    install_all()
    why = unchecked()
    if why is not None:
        raise RuntimeError(f"vllm_dcp2d cannot serve this DCP2DConnector instance on vLLM {_state.version}: {why}")
    for patch in PATCHES:
        why = _state.why_not.get(patch.name)
        if why is not None and patch.needed(vllm_config):
            raise RuntimeError(_refusal(patch, why))


def rows() -> list[tuple[str, str, str, str]]:
    """``(patch, its targets on this vLLM, status, needed for)``, one per patch."""
    install_all()
    out = []
    for p in PATCHES:
        targets = ", ".join(t.path for t in p.targets.get(_state.version, ())) or "-"
        why = _state.why_not.get(p.name)
        state = ("installed" if p.install else "fits (installed when needed)") if why is None else f"not installed: {why}"
        if p.name in _state.elsewhere:
            state = f"not applicable: {_state.elsewhere[p.name]}"
        if p.name in _state.unneeded:
            targets, state = "-", _state.unneeded[p.name]
        out.append((p.name, targets, state, p.needed_for))
    return out


def _instance(role: str, dcp: int = 1, mla: bool = False, draft: bool = False, layer_split: str = "auto"):
    """A stand-in ``VllmConfig`` with what ``require`` and the patches' ``needed`` read."""
    from types import SimpleNamespace as NS

    from vllm_dcp2d.config import CONNECTOR_NAME

    kv = NS(kv_connector=CONNECTOR_NAME, kv_role=role, kv_connector_extra_config={"layer_split": layer_split})
    spec = NS(uses_draft_kv_cache=lambda: True) if draft else None
    return NS(kv_transfer_config=kv, speculative_config=spec, model_config=NS(use_mla=mla),
              parallel_config=NS(decode_context_parallel_size=dcp, tensor_parallel_size=2))


ROLES = {  # what ``vllm-dcp2d compat`` shows: every role and setting require() tells apart
    "prefill, layer_split auto (TP=2)": dict(role="kv_producer"),
    "prefill, layer_split off": dict(role="kv_producer", layer_split="off"),
    "prefill, MLA, layer_split auto": dict(role="kv_producer", mla=True),
    "decode, DCP=1": dict(role="kv_consumer"),
    "decode, DCP=2": dict(role="kv_consumer", dcp=2),
    "decode, DCP=2, MLA, with a draft": dict(role="kv_consumer", dcp=2, mla=True, draft=True),
    "kv_both, DCP=1": dict(role="kv_both"),
}


def roles() -> list[tuple[str, str | None]]:
    """``(DCP2D instance, None if it starts on this vLLM else why it is refused)``."""
    out = []
    for name, kw in ROLES.items():
        try:
            require(_instance(**kw))
            out.append((name, None))
        except RuntimeError as e:
            out.append((name, str(e).split(": ", 1)[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    """``vllm-dcp2d compat``: the patch table for the installed vLLM, then each kind of DCP2D
    instance and whether it starts; exits 1 if some kind is refused."""
    import logging as _logging

    _logging.getLogger(__name__).setLevel(_logging.ERROR)  # the patch table says it
    register_connector()
    patch_rows = rows()
    print(f"vLLM {_state.version} ({'CPU' if _state.cpu else 'GPU'}); vllm_dcp2d supports {', '.join(SUPPORTED)} "
          f"(on CPU: {', '.join(CPU_SUPPORTED)})")
    width = max(len(r[0]) for r in patch_rows)
    for name, targets, state, needed in patch_rows:
        print(f"{name:<{width}}  {state}\n{'':<{width}}  needed for: {needed}\n{'':<{width}}  wraps: {targets}")
    verdicts = roles()
    width = max(len(r[0]) for r in verdicts)
    print("\nDCP2DConnector instances on this vLLM:")
    for name, why in verdicts:
        print(f"  {name:<{width}}  {'starts' if why is None else 'refused: ' + why}")
    return int(any(why is not None for _, why in verdicts))


if __name__ == "__main__":
    raise SystemExit(main())
