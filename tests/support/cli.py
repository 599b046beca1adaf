"""``vllm-dcp2d`` run as a user runs it: its own interpreter, a bounded wait."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "vllm_dcp2d.cli"]


def run(*args) -> subprocess.CompletedProcess:
    # 240 s: `compat` imports vLLM, which took over 60 s on a loaded 2-core machine
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
