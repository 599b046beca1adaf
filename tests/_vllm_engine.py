"""Run a test module's vLLM engine in a subprocess (TP workers are spawned, so
each engine needs its own ``__main__``) and read back its results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def run_engine(script: str, args: list[str], out: Path, label: str, *, expect_in_log: tuple[str, ...] = (),
               **env_extra: str) -> tuple:
    """``python script --run *args`` with TP=2 core binding; returns
    ``(json written to out, KV capacity in tokens from vLLM's log)``. Each string of
    ``expect_in_log`` must appear in the engine's log."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", **env_extra)
    env.pop("TRITON_INTERPRET", None)  # engines take vLLM's own Triton decision
    proc = subprocess.run([sys.executable, script, "--run", *args], env=env,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:  # the root cause is often far above the tail (warnings follow it)
        errors = [line for line in log.splitlines() if "Error" in line and "Warning" not in line]
        raise AssertionError(f"{label} engine failed:\n" + "\n".join(errors[-20:]) + f"\n...\n{log[-3000:]}")
    missing = [m for m in expect_in_log if m not in log]
    assert not missing, f"{label} engine log lacks {missing}"
    cap = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert cap, f"no KV capacity line in the {label} log"
    return json.loads(out.read_text()), int(cap[0].replace(",", ""))
