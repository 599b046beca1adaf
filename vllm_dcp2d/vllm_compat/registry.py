"""Installs the patches of ``patches.PATCHES`` that fit the installed vLLM, and
refuses a DCP2DConnector instance that needs one that does not.

vLLM calls the plugin's ``register()`` in every process, without a try/except,
whatever the engine (``vllm/plugins/__init__.py``). So nothing here may break an
engine that does not use DCP2DConnector. For each patch, :func:`install_all`
looks up the objects it wraps for the installed vLLM version, checks that each
still takes the parameters the patch was written for, and only then installs
it; otherwise it records why not, and vLLM's own object stays. A DCP2DConnector
instance that needs a patch that is not installed refuses to start
(:func:`require`), naming the vLLM version, the patch and the reason.
``vllm-dcp2d compat`` prints the table (:func:`rows`).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

from vllm_dcp2d.vllm_compat.patches import PATCHES, SUPPORTED, Patch, Unavailable, installed_vllm_version

log = logging.getLogger(__name__)

__all__ = ["register_connector", "install_all", "status", "require", "check", "rows"]


def register_connector() -> None:
    """Make ``kv_connector="DCP2DConnector"`` resolvable through vLLM's connector factory
    (a public vLLM API, the same in 0.32 and 0.33; idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_dcp2d.config import CONNECTOR_CLASS, CONNECTOR_NAME

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, *CONNECTOR_CLASS)


@dataclass
class _State:
    version: str = ""
    why_not: dict[str, str] = field(default_factory=dict)  # patch -> why it is not installed
    elsewhere: dict[str, str] = field(default_factory=dict)  # patch -> why it does not apply here
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
    for patch in PATCHES:
        if patch.cpu_only and not cpu:
            _state.elsewhere[patch.name] = "CPU only (vLLM's GPU backends do this themselves)"
            continue
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
    """Patch name -> None if installed (or ready for its later install), else why not."""
    install_all()
    return {p.name: _state.why_not.get(p.name, _state.elsewhere.get(p.name)) for p in PATCHES}


def _refusal(patch: Patch, why: str) -> str:
    return (f"vllm_dcp2d cannot serve this DCP2DConnector instance on vLLM {_state.version}: it needs the "
            f"patch {patch.name!r} ({patch.reason}), which is not installed: {why}. Supported vLLM versions: "
            f"{', '.join(SUPPORTED)}.")


def check(name: str) -> None:
    """Raise ``RuntimeError`` unless patch ``name`` fits this vLLM: for a patch that
    the code needing it installs later (``Patch.install`` None), before it does."""
    install_all()
    patch = next(p for p in PATCHES if p.name == name)
    why = _state.why_not.get(name, _state.elsewhere.get(name))
    if why is not None:
        raise RuntimeError(_refusal(patch, why))


def require(vllm_config) -> None:
    """Raise ``RuntimeError`` naming the vLLM version, the patch and the reason if this
    DCP2DConnector instance needs a patch that is not installed. Called when the
    connector is built (engine core and every worker), before the first step."""
    install_all()
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
        out.append((p.name, targets, state, p.needed_for))
    return out


def main(argv: list[str] | None = None) -> int:
    """``vllm-dcp2d compat``: the table for the installed vLLM; exits 1 if a patch that
    some DCP2D instance needs is not installed."""
    import logging as _logging

    _logging.getLogger(__name__).setLevel(_logging.ERROR)  # the table says it
    register_connector()
    table = rows()
    print(f"vLLM {_state.version}; vllm_dcp2d supports {', '.join(SUPPORTED)}")
    width = max(len(r[0]) for r in table)
    for name, targets, state, needed in table:
        print(f"{name:<{width}}  {state}\n{'':<{width}}  needed for: {needed}\n{'':<{width}}  wraps: {targets}")
    return int(any(r[2].startswith("not installed") and "nothing" not in r[3] for r in table))


if __name__ == "__main__":
    raise SystemExit(main())
