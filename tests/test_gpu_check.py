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


def _script(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """``scripts/gpu-check.sh ARGS`` without nvidia-smi on PATH, in a network namespace of its own
    where one can be made (then any download would fail): what a GPU-less host without egress runs."""
    unshare = ["unshare", "-n"] if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0 else []
    return subprocess.run([*unshare, "bash", str(ROOT / "scripts/gpu-check.sh"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": "/usr/bin:/bin"}, cwd=cwd)


def test_with_a_wheels_dir_it_runs_offline_up_to_the_gpu_step(tmp_path):
    """``--wheels DIR --vllm 0.34.0``: the arguments and DIR are checked without the network,
    then the first GPU step fails with one line; nothing is installed before it (the install
    follows the GPU step, bounded by --install-timeout, outside the rows' budget)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl").touch()
    p = _script("--wheels", str(wheels), "--vllm", "0.34.0")
    lines = p.stdout.splitlines()
    assert p.returncode == 2 and len(lines) == 2, p.stdout + p.stderr
    assert lines[1].split()[:2] == ["wheels", "FAIL"] and "has no mooncake-transfer-engine (CUDA) wheel" in lines[1]
    assert f"pip download -d {wheels} vllm==0.34.0 mooncake-transfer-engine>=0.3.13" in lines[1]
    (wheels / "mooncake_transfer_engine-0.3.13.post1-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    p = _script("--wheels", str(wheels), "--vllm", "0.34.0")
    assert p.returncode == 2 and p.stdout.splitlines()[1:] == [
        "gpu            FAIL   no NVIDIA GPU (nvidia-smi -L failed or is missing); this check needs one"], p.stdout
    assert "installing" not in p.stdout + p.stderr  # nothing installed before the GPU step
    for args, why in ((["--wheels", str(wheels)], "give --vllm VERSION too"),
                      (["--vllm", "0.35.0"], "--vllm 0.35.0: vllm_dcp2d supports 0.32.0, 0.33.0 and 0.34.0"),
                      (["--vllm", "0.34.0", "--install-timeout", "soon"], "expected whole seconds > 0"),
                      (["--vllm", "0.34.0", "--wheels", str(tmp_path / "none")], "not a directory")):
        p = _script(*args)
        assert p.returncode == 2 and len(p.stdout.splitlines()) == 2 and why in p.stdout, (args, p.stdout)


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
    scope = p.stdout.split("what each row proves, and what it cannot on one GPU:\n", 1)[1].splitlines()
    assert [line.split(":")[0].strip() for line in scope] == ["mooncake", "vllm-layer-split", "vllm-dcp"]
    assert "proves byte-exact Mooncake writes" in scope[0] and "cannot: RDMA and two hosts" in scope[0]
