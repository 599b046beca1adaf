"""Every adaptation of vllm_dcp2d to vLLM internals lives in this package.

The code here reaches into vLLM modules that are not a stable API (backend
registry, Triton-kernel overrides, private cache layouts). Each patch to them is
an entry of the patch table (``patches.py``: its targets per vLLM version, its reason,
which instances need it); ``registry.py`` installs the entries that fit the
installed vLLM and refuses a DCP2DConnector instance that needs one that does
not. Supported: vLLM 0.32.0, 0.33.0 and 0.34.0 (``patches.SUPPORTED``; on CPU 0.32.0 and
0.33.0, ``patches.CPU_SUPPORTED``).
"""

from __future__ import annotations

from vllm_dcp2d.vllm_compat.patches import SUPPORTED, installed_vllm_version

__all__ = ["SUPPORTED", "installed_vllm_version"]
