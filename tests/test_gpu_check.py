"""scripts/gpu-check.sh on this GPU-less machine: it fails fast and clearly, and its
Mooncake row's code (vLLM-allocated KV, the plan, real Mooncake writes, the page
comparison) runs here with CPU memory standing in for the GPU's."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[1]


def test_fails_fast_without_a_gpu():
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(ROOT / "scripts/gpu-check.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": "/usr/bin:/bin"})  # no nvidia-smi on PATH
    assert p.returncode == 2 and time.monotonic() - t0 < 60
    assert p.stdout.splitlines()[1].split()[:2] == ["gpu", "FAIL"] and "no NVIDIA GPU" in p.stdout


def test_mooncake_row_on_cpu_memory():
    from vllm_dcp2d.testing.gpu_check import check_mooncake

    assert check_mooncake("cpu").startswith("cpu->cpu ")
