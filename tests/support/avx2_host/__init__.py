"""An AVX2-only host on any x86 host: see ``sitecustomize.py``."""

import os

import torch

DIR = os.path.dirname(os.path.abspath(__file__))
# True where vLLM loads its AVX2 build anyway (the shim would change nothing there).
HOST_LACKS_AVX512 = not torch.cpu._is_avx512_supported()


def env(base: dict | None = None) -> dict:
    """``base`` (default ``os.environ``) with this folder first on ``PYTHONPATH``."""
    base = dict(os.environ if base is None else base)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (DIR, base.get("PYTHONPATH")) if p)
    return base
