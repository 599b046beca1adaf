"""Load and observation for the serving benches (``bench/cliff.py``, ``bench/soak.py``,
``bench/gate.py``, ``bench/pd_latency.py``): streamed completions timed per token, the
prompts of independent long requests and of agent sessions, greedy references from a
colocated instance, and what the servers hold meanwhile (their metrics, their processes).

Every request and every scrape has a timeout; nothing here retries on its own.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_dcp2d.local.servers import post_json

__all__ = ["host_cpu", "prompt_ids", "session_prompt", "Stream", "stream", "references", "pct", "scrape", "hist_delta",
           "session_stats", "Sampler"]

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def host_cpu() -> str:
    """``"Intel(R) Xeon(R) Processor, 2 cores: avx2 avx512f avx512_bf16 amx_tile"``: the CPU
    flags that choose vLLM's CPU build (AVX2 or AVX-512) and its kernels (bf16, AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = set((re.search(r"^flags\s*:\s*(.*)$", text, re.M) or [None, ""])[1].split())
    have = [f for f in _FLAGS if f in flags]
    return f"{model.group(1) if model else 'unknown CPU'}, {os.cpu_count()} cores: {' '.join(have) or 'no AVX2'}"


def prompt_ids(seed: int, n: int, vocab: int = 500) -> list[int]:
    """``n`` token ids in [6, 6 + vocab), random with ``seed``: distinct prompts share no page."""
    return np.random.default_rng(seed).integers(6, 6 + vocab, n).tolist()


def session_prompt(session: int, turn: int, base: int, step: int) -> list[int]:
    """An agent session's prompt at ``turn`` (0-based): its first ``base + step * turn`` tokens,
    so each turn is the previous prompt plus ``step`` new tokens (the history it carries)."""
    return prompt_ids(1_000_003 * (session + 1), base + step * turn)  # numpy draws them in order: a prefix


def pct(xs, q: float) -> float:
    """The ``q``-th percentile of the numbers in ``xs`` that are not NaN; NaN if none."""
    a = np.asarray([x for x in xs if x == x], dtype=float)
    return float(np.percentile(a, q)) if a.size else float("nan")


@dataclass
class Stream:
    """One streamed completion: monotonic ``t0`` (sent), ``t_first`` (first text), ``t_end``;
    ``tokens`` the completion tokens vLLM counted (``usage``), ``status`` the HTTP status (0:
    no answer), ``error`` what went wrong, ``hung_up`` whether the client left on purpose."""

    t0: float
    t_first: float = float("nan")
    t_end: float = float("nan")
    text: str = ""
    tokens: int = 0
    status: int = 0
    error: str = ""
    hung_up: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and not self.hung_up

    @property
    def ttft(self) -> float:
        return self.t_first - self.t0

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (NaN for fewer than two)."""
        return (self.t_end - self.t_first) / (self.tokens - 1) if self.tokens > 1 else float("nan")


def stream(url: str, model: str, ids: list[int], max_tokens: int, timeout_s: float,
           hang_up_after: int | None = None, extra: dict | None = None) -> Stream:
    """POST a streamed greedy completion of ``ids`` to ``url`` (``/v1/completions``) and time
    it; with ``hang_up_after``, close the connection after that many chunks. ``extra``: more
    fields of the request (a session's ``user``)."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    s = Stream(time.monotonic())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            s.status, chunks = r.status, 0
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    s.error = str(event["error"])[:300]
                    break
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        if s.text == "":
                            s.t_first = time.monotonic()
                        s.text += choice["text"]
                s.tokens = (event.get("usage") or {}).get("completion_tokens", s.tokens)
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    s.hung_up = True
                    break
    except urllib.error.HTTPError as e:
        s.status, s.error = e.code, e.read()[:300].decode(errors="replace")
    except (OSError, ValueError) as e:  # refused, reset, timed out, a broken event
        s.error = f"{type(e).__name__}: {e}"[:300]
    s.t_end = time.monotonic()
    if s.ok and s.tokens != max_tokens:
        s.error = f"{s.tokens} completion tokens, expected {max_tokens}"
    return s


def references(url: str, model: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 600.0,
               parallel: int = 8) -> list[str]:
    """The greedy text of each prompt from the instance at ``url`` asked directly (no
    ``kv_transfer_params``: colocated), ``parallel`` at a time; raises on any failure."""
    def one(ids: list[int]) -> str:
        status, out = post_json(url + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_tokens,
                                                          "temperature": 0.0, "ignore_eos": True}, timeout_s)
        if status != 200:
            raise RuntimeError(f"reference from {url} failed ({status}): {str(out)[:300]}")
        return out["choices"][0]["text"]

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(one, prompts))


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """``url``/metrics as sample name -> value, summed over label sets (histogram buckets keep
    their ``le``: ``name{le=...}``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, value = line.rpartition(" ")
        key, labels = (name.split("{", 1) + [""])[:2]
        le = re.search(r'le="([^"]+)"', labels)
        key = f"{key}{{le={le.group(1)}}}" if le else key
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def hist_delta(before: dict[str, float], after: dict[str, float], name: str, q: float) -> tuple[float, float]:
    """Of histogram ``name`` between two ``scrape`` results: the mean and the upper bound of the
    bucket holding the ``q``-th percentile (NaN, NaN when nothing was observed)."""
    n = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
    if n <= 0:
        return float("nan"), float("nan")
    mean = (after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)) / n
    buckets = sorted((float(k[len(name) + 11:-1]), v - before.get(k, 0.0))
                     for k, v in after.items() if k.startswith(name + "_bucket{le="))
    return mean, next((le for le, c in buckets if c >= q / 100 * n), float("inf"))


def session_stats(sid: int) -> dict[str, float]:
    """Live processes of session ``sid`` (a server and its engine core, workers): their
    count, RSS bytes, threads, open file descriptors and CPU seconds, summed; and RSS bytes
    per process name (``rss_bytes/<comm>``, e.g. ``rss_bytes/VLLM::EngineCor``), so a
    growth can be told to its process."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    out = {"processes": 0, "rss_bytes": 0, "threads": 0, "fds": 0, "cpu_s": 0.0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            f = raw[raw.rindex(")") + 2:].split()  # from "state": sid [3], utime/stime [11]/[12], threads [17], rss [21]
            if int(f[3]) != sid:
                continue
            fds = len(os.listdir(stat.parent / "fd"))
        except (OSError, ValueError):  # gone meanwhile
            continue
        out["processes"] += 1
        out["cpu_s"] += (int(f[11]) + int(f[12])) / tick
        out["threads"] += int(f[17])
        out["rss_bytes"] += int(f[21]) * page
        out["rss_bytes/" + comm] = out.get("rss_bytes/" + comm, 0) + int(f[21]) * page
        out["fds"] += fds
    return out


class Sampler:
    """Every ``interval_s``, for each target ``name -> (url or None, session id or None)``: the
    metrics in ``metrics`` (from ``scrape``) and, given a session, ``session_stats``. Rows
    ``(t, name, key, value)`` in ``rows``; a target that does not answer is skipped that round
    (``missed`` counts it). ``targets`` may be changed between rounds (a restarted process)."""

    def __init__(self, targets: dict[str, tuple[str | None, int | None]], metrics: tuple[str, ...],
                 interval_s: float = 1.0):
        self.targets, self.metrics, self.interval_s = dict(targets), metrics, interval_s
        self.rows: list[tuple[float, str, str, float]] = []
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            for name, (url, sid) in list(self.targets.items()):
                if url:
                    try:
                        got = scrape(url)
                        self.rows += [(t, name, m, got.get(m, 0.0)) for m in self.metrics]
                    except (OSError, ValueError):
                        self.missed += 1
                if sid:
                    self.rows += [(t, name, k, v) for k, v in session_stats(sid).items()]
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def series(self, name: str, key: str, since: float = 0.0) -> list[tuple[float, float]]:
        return [(t, v) for t, n, k, v in list(self.rows) if n == name and k == key and t >= since]

    def peak(self, name: str, key: str, since: float = 0.0) -> float:
        return max((v for _, v in self.series(name, key, since)), default=float("nan"))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
