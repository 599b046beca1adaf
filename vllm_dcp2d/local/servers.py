"""Real processes for the demo, the end-to-end tests and the benches: ``vllm serve``
instances running DCP2DConnector and the PD proxy, each optionally on its own
host (a network namespace: ``netns=``; the tests make them with ``tests/support/netns.py``).

Every wait has a timeout, and every process runs in its own session so
``stop`` kills its whole tree (API server, engine core, TP workers) and
nothing else. Servers are started with the command users type
(``vllm serve MODEL ...``, ``vllm-dcp2d proxy ...``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dcp2d.local import shm

__all__ = ["free_port", "Process", "vllm_server", "proxy_server", "router_server", "extra_config", "post_json", "wait_all",
           "read_stats", "fetch_records", "bin_path"]


# The ports this module hands out (API servers, proxies, bootstrap ports) come from
# [20000, 32000): below the kernel's ephemeral range (32768-60999 by default), from which
# every bind(0) and every outgoing connection draws, and above Mooncake's random RPC and
# TCP ports (15000-17000). A port drawn from the ephemeral range is free only until
# its server binds it, tens of seconds later while vLLM starts; a connection or
# bind(0) of another engine can take it first (seen: a prefill's bootstrap port taken
# while its engine started). Each pytest session (DCP2D_PORT_SLICE="k/n", set by
# scripts/test.sh) and each of its pytest-xdist workers draws from its own slice, and a
# process never hands out a port twice, so neither can collide with another server of
# this module either.
_PORTS = (20000, 32000)
_next_port: list[int] = []


def _slice(lo: int, hi: int, k: str, n: str) -> tuple[int, int]:
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)) or hi <= lo:
        return lo, hi
    width = (hi - lo) // int(n)
    return lo + int(k) * width, lo + (int(k) + 1) * width


def _port_slice() -> tuple[int, int]:
    lo, hi = _PORTS
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        hi = min(hi, ephemeral)
    except (OSError, ValueError, IndexError):
        pass
    session = os.environ.get("DCP2D_PORT_SLICE", "0/1").partition("/")
    lo, hi = _slice(lo, hi, session[0], session[2])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return _slice(lo, hi, worker[2:], os.environ.get("PYTEST_XDIST_WORKER_COUNT", ""))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (in the caller's network namespace), that
    no one else is about to take (see ``_PORTS``)."""
    lo, hi = _port_slice()
    if hi - lo < 100:  # an ephemeral range reaching below 20100: let the kernel choose
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    if not _next_port:
        _next_port.append(lo + (os.getpid() * 7919) % (hi - lo))
    for _ in range(hi - lo):
        port = _next_port[0]
        _next_port[0] = lo + (port + 1 - lo) % (hi - lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on {host} in [{lo}, {hi})")


def bin_path(name: str) -> str:
    """A console script of this environment (``vllm``, ``vllm-dcp2d``), as on the user's PATH."""
    return str(Path(sys.executable).with_name(name))


@dataclass
class Process:
    """A server process. ``netns``: run it inside that network namespace (``ip netns
    exec``); ``host``: the address it serves on, where ``url`` points."""

    name: str
    cmd: list[str]
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    netns: str | None = None
    proc: subprocess.Popen | None = None
    shm: set = field(default_factory=set)  # /dev/shm files its processes held (local/shm.py)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = (["ip", "netns", "exec", self.netns] if self.netns else []) + self.cmd
        with open(self.log_path, "wb") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)
        return self

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines, after the log's first error lines: a dead engine's root
        cause (a worker's exception) is often far above the front end's traceback."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        head = [line for line in lines[:-n] if "Error" in line and "Warning" not in line][:10]
        return "\n".join(head + (["..."] if head else []) + lines[-n:])

    def ready(self) -> bool:
        """True once ``GET /health`` answers 200; raises if the process died."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited with code {code} before it was ready; "
                               f"log {self.log_path}:\n{self.log_tail()}")
        self.shm |= shm.held_by_session(self.proc.pid)  # while starting: it may die before stop()
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; then unlink
        the ``/dev/shm`` files it held that nothing holds any more (vLLM leaks them)."""
        if self.proc is None:
            return
        self.shm |= shm.held_by_session(self.proc.pid)
        try:
            self._stop(timeout_s)
        finally:
            shm.wait_session_gone(self.proc.pid, timeout_s=5.0)  # SIGKILLed workers unmap as they exit
            shm.remove_unheld(self.shm)

    def _stop(self, timeout_s: float) -> None:
        if self.proc.poll() is not None:
            try:  # the leader is gone, workers of its session may not be
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers may outlive the session leader for a moment
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_all(procs: list[Process], timeout_s: float) -> None:
    """Block until every process answers ``/health``; raises on death or timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        pending = [p for p in pending if not p.ready()]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{p.name} (log {p.log_path}):\n{p.log_tail(15)}" for p in pending)
            raise TimeoutError(f"not ready after {timeout_s:.0f} s: {names}")
        time.sleep(1.0)


@contextlib.contextmanager
def running(procs: list[Process], timeout_s: float):
    """Start ``procs``, wait until each answers (``wait_all``) and yield ``{name: process}``;
    always stop them, the last started first."""
    try:
        for p in procs:
            p.start()
        wait_all(procs, timeout_s)
        yield {p.name: p for p in procs}
    finally:
        for p in reversed(procs):
            p.stop()


# The connector's cpu_start_method for the DCP2D instances vllm_server starts, where this
# variable names one: the test suite sets "fork" (conftest.py; a TP=2 start ~11 CPU-s instead
# of ~26), the demo and the benches keep vLLM's "spawn".
START_METHOD_ENV = "DCP2D_CPU_START_METHOD"


def vllm_server(name: str, model: str, port: int, log_dir: Path, *, role: str, extra_config: dict,
                tp: int = 1, dcp: int = 1, block_size: int | None = None, cpu: bool = True,
                kv_cache_bytes: int = 64 << 20, max_model_len: int = 1024, failure_policy: str = "fail",
                dtype: str | None = None, host: str = "127.0.0.1", netns: str | None = None,
                args: tuple[str, ...] = (), engine_id: str | None = None) -> Process:
    """``vllm serve MODEL ...`` running DCP2DConnector on ``host:port`` (``role=""``:
    a plain instance without the connector, e.g. a colocated reference).

    On another host than loopback, the connector's advertised addresses follow
    ``host`` unless ``extra_config`` names them: the bootstrap server
    (``bootstrap_host``, producer) and the Mooncake engine (``local_hostname``).
    ``engine_id``: the connector's engine id (vLLM draws one when it is not given).
    """
    if host != "127.0.0.1":
        extra_config = {"local_hostname": host, **({"bootstrap_host": host} if role != "kv_consumer" else {}),
                        **extra_config}
    if cpu and role and os.environ.get(START_METHOD_ENV) and "cpu_start_method" not in extra_config:
        extra_config = {**extra_config, "cpu_start_method": os.environ[START_METHOD_ENV]}
    if role in ("kv_producer", "kv_both") and "http_bootstrap_port" not in extra_config:
        # its own port, not vLLM's default 8998: servers of this module run side by side
        extra_config = {**extra_config, "http_bootstrap_port": free_port()}
    kv = {"kv_connector": "DCP2DConnector", "kv_role": role, "kv_load_failure_policy": failure_policy,
          "kv_connector_extra_config": extra_config, **({"engine_id": engine_id} if engine_id else {})}
    cmd = [bin_path("vllm"), "serve", model, "--port", str(port), "--host", host,
           "--tensor-parallel-size", str(tp), "--max-model-len", str(max_model_len),
           "--disable-uvicorn-access-log"] + (["--kv-transfer-config", json.dumps(kv)] if role else [])
    if dcp > 1:
        cmd += ["--decode-context-parallel-size", str(dcp)]
    if dtype:
        cmd += ["--dtype", dtype]
    if block_size:  # the DCP interleave follows it (vllm_compat/startup.py)
        cmd += ["--block-size", str(block_size)]
    env = {}
    if cpu:
        cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-num-seqs", "4"]
        cores = os.cpu_count() or 1
        # One core per TP rank (vLLM's "auto" binding refuses TP=2 on one NUMA node). TP=1 stays
        # unbound: with "auto" its OpenMP threads pin every core and the connector's
        # threads starve (measured: fetches never served on a 2-core machine).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp)) if tp > 1 else "nobind"
    return Process(name, cmd + list(args), port, log_dir / f"{name}.log", env, host, netns)


def proxy_server(port: int, prefill: list[str], decode: list[str], log_dir: Path, name: str = "proxy",
                 pipelined: bool = False, host: str = "127.0.0.1", netns: str | None = None,
                 args: tuple[str, ...] = ()) -> Process:
    """``vllm-dcp2d proxy`` on ``host:port`` in front of the given instances (``args``: more flags)."""
    cmd = [bin_path("vllm-dcp2d"), "proxy", "--host", host, "--port", str(port), *args]
    cmd += ["--pipelined"] if pipelined else []
    for u in prefill:
        cmd += ["--prefill", u]
    for u in decode:
        cmd += ["--decode", u]
    return Process(name, cmd, port, log_dir / f"{name}.log", host=host, netns=netns)


def extra_config(p: Process) -> dict:
    """The ``kv_connector_extra_config`` a ``vllm_server`` process was started with."""
    arg = p.cmd[p.cmd.index("--kv-transfer-config") + 1]
    return json.loads(arg)["kv_connector_extra_config"]


def router_server(port: int, prefill: list[Process], decode: list[Process], log_dir: Path, mode: str = "nixl",
                  name: str = "router", host: str = "127.0.0.1", discovery: str = "",
                  args: tuple[str, ...] = ()) -> Process:
    """vLLM's router (``vllm-router``, pip ``vllm-router``) in PD mode in front of the given
    ``vllm_server`` instances, speaking ``mode``'s request protocol: ``"nixl"`` (the decode
    gets the prefill's ``kv_transfer_params`` verbatim) or ``"mooncake"`` (the router asks
    each prefill's HTTP bootstrap ``GET /query`` and builds the decode's parameters).
    ``discovery`` ("host:port"): no instance list; the router takes the instances that
    register there (``router_discovery_address``; its protocol is the nixl one). ``args``: more
    flags (a later ``--policy`` or ``--decode-policy`` overrides round-robin)."""
    cmd = [bin_path("vllm-router"), "--vllm-pd-disaggregation", "--kv-connector", mode, "--policy", "round_robin",
           "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(free_port()),
           "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2", *args]
    if discovery:
        cmd += ["--vllm-discovery-address", discovery]
    for p in prefill:
        cmd += ["--prefill", p.url] + ([str(extra_config(p)["http_bootstrap_port"])] if mode == "mooncake" else [])
    for d in decode:
        cmd += ["--decode", d.url]
    return Process(name, cmd, port, log_dir / f"{name}.log", host=host)


def post_json(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST ``body``; returns (status, parsed JSON body) for 2xx and error statuses alike."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, {"raw": raw.decode(errors="replace")}


def kv_cache_usage(url: str) -> float:
    """vLLM's ``vllm:kv_cache_usage_perc`` (a fraction, 0..1) from the instance's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no vllm:kv_cache_usage_perc in {url}/metrics")


def read_stats(path: Path) -> list[dict]:
    """Records of a ``stats_file`` (one JSON object per line)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fetch_records(records: list[dict]) -> list[dict]:
    """The decode workers' lines among ``records``: one per path and decode TP rank of
    a fetch (``ok`` true), or one per failed fetch (``ok`` false); not the decode
    scheduler's per-request ``first_step`` lines nor the prefill's lines."""
    return [r for r in records if r.get("side") == "consumer" and "ok" in r]
