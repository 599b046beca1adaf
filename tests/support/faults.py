"""Faults injected into a real PD cluster under streaming load, and the checks
after each one (tests/e2e/test_load_faults.py runs it quick, bench/load_faults.py long).

``FaultCluster`` starts a prefill ``vllm serve`` (tiny ``llama-mqa`` in fp32,
TP=2 = 2 layer-split CP ranks), a decode one (TP=2, DCP=2,
``kv_load_failure_policy="fail"``) and the PD proxy, all on loopback with short
connector timeouts (``FaultConfig``). The prefill instance asked without
``kv_transfer_params`` is the colocated reference: its greedy answer to every
prompt is taken before any fault. ``run_fault`` puts ``Load`` on the proxy,
injects one fault while a fetch is in flight (a probe request held by a frozen
prefill, ``hold_fetch``),
restarts what it killed on the same ports, and checks:

* every outcome passes ``load.check`` (completed answers equal the reference,
  failures are HTTP errors with a status and a message, no request took longer
  than ``FaultConfig.bound_s``);
* a restarted instance serves again (a second load, at least one answer right;
  up to ``AFTER_WAVES`` loads, since its first forwards may outlast the proxy timeout);
* ``vllm:kv_cache_usage_perc`` returns to 0 on every live instance within ``drain_s``.

Faults (``FAULTS``): ``hang_up`` (every 3rd client disconnects after 2 chunks),
``kill_decode`` / ``kill_prefill`` (SIGKILL to the instance's whole process
group: API server, engine core, workers; then a restart), ``freeze_prefill``
(SIGSTOP for ``transfer_timeout_s + 3`` s, then SIGCONT). Each fault but
``hang_up`` is injected while a decode fetch waits for the prefill (``hold_fetch``). New faults: add a
name to ``FAULTS`` and a branch to ``FaultCluster.inject``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dcp2d.proxy import decode_body, prefill_body
from vllm_dcp2d.local.servers import Process, free_port, post_json, proxy_server, vllm_server, wait_all
from tests.support.load import Load, Outcome, check, prompt_ids

__all__ = ["FAULTS", "FaultConfig", "FaultCluster", "FaultResult", "metric"]

FAULTS = ("hang_up", "kill_decode", "kill_prefill", "freeze_prefill")
AFTER_WAVES = 3  # loads after a fault until one answers right
PAGE = 32
DTYPE = "float32"  # the DCP=2 decode matches the stock kernel token for token in fp32 (tests/support/pd_cluster.py)


@dataclass(frozen=True)
class FaultConfig:
    """Timeouts handed to the connector and the proxy, and the load's shape.
    ``bound_s``: the longest any request may take: the proxy's prefill hop plus its
    decode hop (``proxy_timeout_s`` each, aiohttp's total per call) plus 5 s of client
    and proxy overhead. ``drain_s``: the longest KV usage may take to return to 0
    (``send_timeout_s`` for blocks held for a dead decode, plus the cancel backoff, 1+2+4+8+16 s,
    that frees quarantined blocks after a thaw, plus slack)."""

    transfer_timeout_s: float = 6.0
    send_timeout_s: float = 10.0
    cancel_grace_s: float = 2.0
    prefill_wait_s: float = 10.0
    proxy_timeout_s: float = 20.0
    concurrency: int = 6
    max_tokens: int = 16
    prompts: int = 24
    dcp: int = 2
    drain_s: float = 90.0
    start_s: float = 900.0
    max_model_len: int = 1024
    kv_cache_bytes: int = 64 << 20

    @property
    def bound_s(self) -> float:
        return 2 * self.proxy_timeout_s + 5.0


@dataclass
class FaultResult:
    """One fault: the load during it, the load after (``after``), whether a fetch was seen
    in flight when it was injected, the KV usage per instance at the end, the violations."""

    fault: str
    outcomes: list[Outcome]
    after: list[Outcome]
    seconds: float
    load_s: float
    in_flight: bool
    usage: dict[str, float]
    violations: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes + self.after)


def metric(url: str, name: str, timeout_s: float = 5.0) -> float:
    """Sum over label sets of Prometheus sample ``name`` on ``url``/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Probe:
    """One non-streaming decode hop posted from a thread (``FaultCluster.hold_fetch``);
    ``outcome()`` waits for it and returns it as a load ``Outcome`` (prompt -1)."""

    def __init__(self, url: str, body: dict, ref: str, bound_s: float):
        self.url, self.body, self.ref, self.bound_s = url, body, ref, bound_s
        self._out: Outcome | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            status, out = post_json(self.url, self.body, self.bound_s + 30)
        except OSError as e:  # the decode died under it: no HTTP answer at all
            self._out = Outcome(-1, t0, time.monotonic(), "error", status=599, message=f"connection: {e}")
            return
        t1 = time.monotonic()
        if status == 200:
            text = out["choices"][0]["text"]
            kind = "ok" if text == self.ref else "wrong"
            self._out = Outcome(-1, t0, t1, kind, text, 200, "" if kind == "ok" else f"{text!r} != {self.ref!r}")
        else:
            msg = (out.get("error") or {}).get("message") if isinstance(out.get("error"), dict) else None
            self._out = Outcome(-1, t0, t1, "error", status=status, message=str(msg or out)[:300])

    def outcome(self, timeout_s: float) -> Outcome:
        self._thread.join(timeout_s)
        if self._out is None:
            now = time.monotonic()
            return Outcome(-1, now - timeout_s, now, "error", message="probe did not finish")
        return self._out


def _signal_group(p: Process, sig: int) -> None:
    os.killpg(p.proc.pid, sig)


class FaultCluster:
    """The cluster; a context manager that always stops (and first thaws) every process."""

    def __init__(self, work: Path, cfg: FaultConfig = FaultConfig()):
        from vllm_dcp2d.local.tiny_models import build_tiny_model

        self.work, self.cfg = Path(work), cfg
        self.model = build_tiny_model("llama-mqa", self.work / "model")
        self.stats = self.work / "stats.jsonl"
        self.procs = self._processes()
        self.prompts = [prompt_ids(i) for i in range(cfg.prompts)]
        self.refs: list[str] = []
        self._frozen: set[str] = set()
        self._starts: dict[str, int] = {}
        self._probes = 0
        self.probe: Probe | None = None

    def _processes(self) -> dict[str, Process]:
        """The servers, on ports free right now."""
        cfg, common = self.cfg, {"stats_file": str(self.stats)}
        size = {"max_model_len": cfg.max_model_len, "kv_cache_bytes": cfg.kv_cache_bytes}
        procs = {
            "prefill": vllm_server("prefill", self.model, free_port(), self.work, role="kv_producer", tp=2,
                                   block_size=PAGE, dtype=DTYPE, **size,
                                   extra_config={**common, "bootstrap_port": free_port(),
                                                 "send_timeout_s": cfg.send_timeout_s}),
            "decode": vllm_server("decode", self.model, free_port(), self.work, role="kv_consumer", tp=2,
                                  dcp=cfg.dcp, block_size=PAGE, dtype=DTYPE, failure_policy="fail", **size,
                                  args=("--max-num-seqs", str(max(8, cfg.concurrency + 2))),
                                  extra_config={**common, "transfer_timeout_s": cfg.transfer_timeout_s,
                                                "prefill_wait_s": cfg.prefill_wait_s,
                                                "cancel_grace_s": cfg.cancel_grace_s}),
        }
        procs["proxy"] = proxy_server(free_port(), [procs["prefill"].url], [procs["decode"].url], self.work)
        procs["proxy"].cmd += ["--timeout", str(cfg.proxy_timeout_s)]
        return procs

    def __enter__(self) -> FaultCluster:
        for attempt in (1, 2):
            try:
                for p in self.procs.values():
                    p.start()
                wait_all(list(self.procs.values()), self.cfg.start_s)
                self.refs = [self.reference(ids) for ids in self.prompts]
                return self
            except BaseException as e:
                self.close()
                # free_port() only says a port was free when asked; on a shared host another
                # process may bind it first (seen: the bootstrap port). Once, with new ports.
                if attempt == 1 and isinstance(e, RuntimeError) and any(
                        "Address already in use" in p.log_tail(400) for p in self.procs.values()):
                    self.procs = self._processes()
                    continue
                raise

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for name in list(self._frozen):
            self.thaw(name)
        for p in reversed(list(self.procs.values())):
            p.stop()

    @property
    def url(self) -> str:
        return self.procs["proxy"].url

    def reference(self, ids: list[int]) -> str:
        """The colocated greedy answer: the prefill instance without ``kv_transfer_params``."""
        status, out = post_json(self.procs["prefill"].url + "/v1/completions",
                                {"model": self.model, "prompt": ids, "max_tokens": self.cfg.max_tokens,
                                 "temperature": 0.0, "ignore_eos": True}, timeout_s=120)
        if status != 200:
            raise RuntimeError(f"reference answer failed ({status}): {out}")
        return out["choices"][0]["text"]

    def load(self, n: int, hang_up_every: int | None = None) -> Load:
        return Load(self.url, self.model, self.prompts, self.refs, n, concurrency=self.cfg.concurrency,
                    max_tokens=self.cfg.max_tokens, hang_up_every=hang_up_every,
                    timeout_s=self.cfg.bound_s + 30)

    # ---- faults ----

    def kill(self, name: str) -> None:
        """SIGKILL the instance's whole process group and reap it."""
        p = self.procs[name]
        _signal_group(p, signal.SIGKILL)
        p.proc.wait(30)
        self._frozen.discard(name)

    def freeze(self, name: str) -> None:
        _signal_group(self.procs[name], signal.SIGSTOP)
        self._frozen.add(name)

    def thaw(self, name: str) -> None:
        _signal_group(self.procs[name], signal.SIGCONT)
        self._frozen.discard(name)

    def restart(self, name: str) -> None:
        """Start a killed instance again with the same command (same ports), its own log."""
        old = self.procs[name]
        if old.proc is not None and old.proc.poll() is None:
            raise RuntimeError(f"{name} (pid {old.proc.pid}) is still running; kill it first")
        k = self._starts[name] = self._starts.get(name, 0) + 1
        new = dataclasses.replace(old, log_path=old.log_path.with_name(f"{name}-restart{k}.log"), proc=None)
        self.procs[name] = new.start()
        wait_all([new], self.cfg.start_s)

    def hold_fetch(self, wait_s: float = 15.0) -> bool:
        """Start a fetch that stays in flight, then leave the prefill frozen; True once
        the decode shows it waiting.

        A fetch of the tiny model takes milliseconds, too short to hit by polling
        ``/metrics``. So a probe of its own: a new prompt is prefilled on the prefill
        instance, the prefill is frozen (its ranks do the writes), and the decode hop
        goes to the decode instance from a thread (``self.probe``); its fetch then
        waits for the frozen ranks. The probe's answer is checked like the load's."""
        self._probes += 1
        ids = prompt_ids(1000 + self._probes)  # new to both instances: no prefix-cache hit, a real fetch
        ref = self.reference(ids)
        transfer_key = uuid.uuid4().hex
        req = {"model": self.model, "prompt": ids, "max_tokens": self.cfg.max_tokens,
               "temperature": 0.0, "ignore_eos": True}
        status, out = post_json(self.procs["prefill"].url + "/v1/completions", prefill_body(req, transfer_key), 60)
        params = out.get("kv_transfer_params") if status == 200 else None
        if not isinstance(params, dict):
            raise RuntimeError(f"probe prefill failed ({status}): {out}")
        self.freeze("prefill")
        self.probe = Probe(self.procs["decode"].url + "/v1/completions", decode_body(req, params), ref,
                           self.cfg.bound_s).start()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.fetch_in_flight():
                return True
            time.sleep(0.05)
        return False

    def inject(self, fault: str) -> bool:
        """Inject ``fault`` while a decode fetch is in flight; returns whether one was."""
        injected = tuple(f for f in FAULTS if f != "hang_up")  # hang_up is the load's own doing
        if fault not in injected:
            raise ValueError(f"unknown fault {fault!r}; expected one of {injected}")
        in_flight = self.hold_fetch()  # the prefill is frozen from here
        if fault == "kill_decode":
            self.kill("decode")
            self.thaw("prefill")
        elif fault == "kill_prefill":
            self.kill("prefill")
        else:  # freeze_prefill
            time.sleep(self.cfg.transfer_timeout_s + 3.0)
            self.thaw("prefill")
        return in_flight

    # ---- observations ----

    def fetch_in_flight(self) -> bool:
        """A decode request waits for its KV (``vllm:num_requests_waiting``: the decode
        admits more requests than the load's concurrency, so only fetches wait)."""
        try:
            return metric(self.procs["decode"].url, "vllm:num_requests_waiting") >= 1
        except OSError:
            return False

    def kv_usage(self) -> dict[str, float]:
        usage = {}
        for name in ("prefill", "decode"):
            p = self.procs[name]
            try:
                usage[name] = metric(p.url, "vllm:kv_cache_usage_perc")
            except OSError as e:  # e.g. the host's OOM killer took a worker: say which and where
                raise RuntimeError(f"{name} {p.url}/metrics unreachable ({e}); exit code "
                                   f"{p.proc.poll()}; log {p.log_path}:\n{p.log_tail(15)}") from e
        return usage

    def wait_drained(self) -> dict[str, float]:
        """KV usage per instance once all are 0, or the last values after ``drain_s``."""
        deadline = time.monotonic() + self.cfg.drain_s
        while True:
            usage = self.kv_usage()
            if not any(usage.values()) or time.monotonic() > deadline:
                return usage
            time.sleep(1.0)

    def run_fault(self, fault: str, n: int) -> FaultResult:
        """``n`` requests with ``fault`` (``"none"``: a baseline) injected once a fetch is
        seen in flight (or after 30 s), then the checks of the module doc."""
        t0 = time.monotonic()
        load = self.load(n, hang_up_every=3 if fault == "hang_up" else None).start()
        in_flight = True
        if fault not in ("none", "hang_up"):
            deadline = time.monotonic() + 30.0
            while load.done_count() < min(2, n - 1) and time.monotonic() < deadline:
                time.sleep(0.05)  # past the first requests: connections open, the load in full swing
            in_flight = self.inject(fault)
        waves = math.ceil(n / self.cfg.concurrency)
        outcomes = load.join(waves * self.cfg.bound_s + 60)
        if self.probe is not None:
            outcomes.append(self.probe.outcome(self.cfg.bound_s + 60))
            self.probe = None
        load_s = load.t1 - load.t0
        if fault.startswith("kill_"):
            self.restart(fault.split("_", 1)[1])
        after: list[Outcome] = []
        for _ in range(AFTER_WAVES):
            # A restarted engine's first forwards can outlast the proxy's timeout on a loaded
            # 2-core host (measured: 6 of 6 past 20 s beside three other TP=2 engines): the
            # check is that it serves again, so a wave with no right answer is retried.
            wave = self.load(self.cfg.concurrency).start().join(2 * self.cfg.bound_s + 60)
            after += wave
            if any(o.kind == "ok" for o in wave):
                break
        usage = self.wait_drained()
        violations = check(outcomes + after, self.cfg.bound_s)
        if not any(o.kind == "ok" for o in after):
            violations.append(f"after {fault}: no request answered right: "
                              f"{[(o.kind, o.status, o.message[:120]) for o in after]}")
        violations += [f"after {fault}: {name} KV usage {u} did not return to 0 within {self.cfg.drain_s:.0f} s"
                       for name, u in usage.items() if u]
        return FaultResult(fault, outcomes, after, time.monotonic() - t0, load_s, in_flight, usage, violations)
