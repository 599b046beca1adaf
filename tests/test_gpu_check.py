"""scripts/gpu-check.sh on this GPU-less machine: it fails fast and clearly, and its
own path runs here with the Mooncake row on CPU memory standing in for the GPU's
(vLLM-allocated KV, the plan, real Mooncake writes, the page comparison)."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_rows_run_in_their_own_processes_and_print_one_table():
    """The script's own path (rows as subprocesses, the table, the exit code) with
    ``--device cpu``: the mooncake row on CPU memory (dense and sparse MLA), the
    layer-split and DCP rows skipped, each naming why."""
    p = subprocess.run([sys.executable, "-m", "vllm_dcp2d.gpu_check", "--device", "cpu",
                        "--rows", "mooncake,vllm-layer-split,vllm-dcp"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "MC_FORCE_TCP": "1"})
    table = p.stdout.split("\ncheck ")[-1].splitlines()
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert table[1].split()[:2] == ["mooncake", "PASS"] and "cpu->cpu" in table[1]
    assert "sparse MLA cpu->cpu" in table[1]
    assert table[2].split()[:2] == ["vllm-layer-split", "SKIP"] and "needs TP>=2" in table[2]
    assert table[3].split()[:2] == ["vllm-dcp", "SKIP"] and "one GPU per DCP rank" in table[3]
