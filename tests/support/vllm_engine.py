"""Run a test module's vLLM engines in subprocesses (each engine needs its own
``__main__``: vLLM on CPU spawns its TP workers) and read back their results.

Where the suite asks for forked workers (``$DCP2D_CPU_START_METHOD=fork``, set by
``conftest.py``), every engine forks them, with or without a connector: a DCP2D
engine through its ``cpu_start_method`` key, an engine without one (the DCP=1
references, vLLM's DCP without the connector) through the same
``vllm_compat.startup.fork_workers`` called by this module's ``__main__``. Two TP
workers forked instead of spawned start in ~11 CPU-s instead of ~26 (BENCHMARKS.md
"Start-up").

``run_engines`` starts several engines at once: an engine spends most of its
start-up importing vLLM in its worker processes, one core each, and a test
that compares engines (DCP=2 with DCP=1, layer-split with and without) waits
for the slowest instead of the sum."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dcp2d.local import shm

TIMEOUT_S = 400


@dataclass
class Engine:
    """One engine run: ``python script --run *args``, writing its JSON to ``out``."""

    script: str
    args: list[str]
    out: Path
    label: str
    expect_in_log: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)

    def start(self) -> subprocess.Popen:
        # The engine core runs in the script's process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
        # these tests check the engine's results, not its process split, and a process
        # less to import vLLM in is ~8 s of CPU per engine. The TP workers are real processes.
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               **self.env}
        # through this module's __main__: it forks the TP workers where the suite asks (below)
        return subprocess.Popen([sys.executable, "-m", "tests.support.vllm_engine", self.script, "--run", *self.args],
                                env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its session's /dev/shm files are found after

    def result(self, proc: subprocess.Popen, on_poll=lambda: None) -> tuple:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:  # retrying communicate() after its timeout loses no output
                log, _ = proc.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                on_poll()
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    log, _ = proc.communicate()
                    raise AssertionError(f"{self.label} engine ran past {TIMEOUT_S} s:\n{log[-3000:]}") from None
        if proc.returncode != 0:  # the root cause is often far above the tail (warnings follow it)
            errors = [line for line in log.splitlines() if "Error" in line and "Warning" not in line]
            raise AssertionError(f"{self.label} engine failed:\n" + "\n".join(errors[-20:]) + f"\n...\n{log[-3000:]}")
        missing = [m for m in self.expect_in_log if m not in log]
        assert not missing, f"{self.label} engine log lacks {missing}"
        cap = re.findall(r"KV cache size: ([\d,]+) tokens", log)
        assert cap, f"no KV capacity line in the {self.label} log"
        return json.loads(self.out.read_text()), int(cap[0].replace(",", ""))


def run_engines(*engines: Engine, keep_going: bool = False) -> list:
    """Run ``engines`` at once; returns ``(json, KV capacity in tokens from vLLM's log)``
    for each, in order. Each string of an engine's ``expect_in_log`` must appear in its log.
    ``keep_going``: an engine that fails puts its ``AssertionError`` in its place instead of
    raising, and the others still run (tests sharing one start fail each on its own engine)."""
    procs = [e.start() for e in engines]
    held = [set() for _ in procs]

    def note_shm():  # vLLM leaves its CPU communicator's files in /dev/shm (local/shm.py)
        for h, p in zip(held, procs):
            h |= shm.held_by_session(p.pid)

    try:
        results = []
        for e, p in zip(engines, procs):
            note_shm()
            try:
                results.append(e.result(p, on_poll=note_shm))
            except AssertionError as err:
                if not keep_going:
                    raise
                results.append(err)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            shm.wait_session_gone(p.pid, timeout_s=5.0)
        shm.remove_unheld(set().union(*held))


def unwrap(result):
    """A ``run_engines(..., keep_going=True)`` result: the engine's, or its failure raised."""
    if isinstance(result, AssertionError):
        raise result
    return result


def run_engine(script: str, args: list[str], out: Path, label: str, *, expect_in_log: tuple[str, ...] = (),
               **env: str) -> tuple:
    """One engine (``run_engines`` of one)."""
    return run_engines(Engine(script, args, out, label, expect_in_log, env))[0]


def _fork_workers() -> None:
    """Make vLLM fork this engine's TP workers, as ``cpu_start_method`` "fork" does for a
    DCP2D engine: after vLLM's CPU platform chose spawn (``check_and_update_config``)."""
    from vllm.platforms import current_platform

    from vllm_dcp2d.vllm_compat.startup import fork_workers

    cls = type(current_platform)
    stock = cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:  # vLLM's signature: the patch registry checks it
        stock(cls, vllm_config)
        fork_workers()

    cls.check_and_update_config = classmethod(check_and_update_config)


if __name__ == "__main__":  # python -m tests.support.vllm_engine SCRIPT --run ARGS (Engine.start)
    import runpy

    from vllm_dcp2d.local.servers import START_METHOD_ENV

    if os.environ.get(START_METHOD_ENV) == "fork":
        _fork_workers()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
