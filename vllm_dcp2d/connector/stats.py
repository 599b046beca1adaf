"""Transfer statistics of DCP2DConnector, per 2D-reshard path.

A path is ``(cp_rank, dcp_rank)``: prefill layer-split rank ``cp_rank``
writing its layers of the pages of decode DCP rank ``dcp_rank``. The consumer
records paths, from each producer rank's ``TransferOutcome`` (bytes,
descriptors, and the producer's write seconds); the producer records expiries,
how long it held each request's blocks and, with layer-split storage,
prefix-broadcast bytes.

vLLM moves ``KVConnectorStats`` from workers to the engine's front-end after
every step (``aggregate`` over TP ranks). There ``connector/prom.py`` turns
each step's data into Prometheus metrics, and the periodic log line
``aggregate``s the steps of one logging interval and ``reduce``s them.
``data`` holds only str keys, ints, floats and lists of floats so it
serializes anywhere. Also written, one JSON line per path per request, to
``stats_file`` when that key is set (the demo and the end-to-end tests read it).

``DecodeTimeline`` (end of this file) times a decode request's stages as its
scheduler sees them (issue 29, the PD timeline); its own notes are there.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm_dcp2d.vllm_compat.connector_api import KVConnectorStats

__all__ = ["DCP2DStats", "path_key", "parse_path_key", "StatsFile", "DecodeTimeline", "MAX_OBSERVATIONS", "LEVELS"]

_COUNTERS = ("failed", "expired", "quarantined", "lifted", "prefix_broadcast_bytes", "stalls", "retries",
             "unauthenticated", "corrupt", "handshake_failures", "handshake_refusals", "refused_registrations")
_PATH_FIELDS = ("transfers", "bytes", "replicated_bytes", "descriptors", "seconds")
# Per-request stage durations (issue 29): a decode rank's, one observation per fetch; a prefill
# rank's, one per request it held blocks for.
_TIMERS = ("fetch_seconds", "reported_after_seconds", "held_seconds", "handover_seconds", "admit_seconds",
           "resume_seconds", "first_step_seconds", "quarantine_seconds")
# Levels each TP rank reports every step while they matter; the front-end keeps the largest.
LEVELS = ("quarantine_oldest_seconds",)
# Write durations kept per path between two snapshots, for the histogram. A
# snapshot covers one engine step, so a path sees at most one write per request
# per TP rank in it; past this bound the oldest are dropped (the log line's
# interval may drop some; the sums above stay exact).
MAX_OBSERVATIONS = 1024


def path_key(cp_rank: int, dcp_rank: int) -> str:
    return f"{cp_rank},{dcp_rank}"


def parse_path_key(key: str) -> tuple[int, int]:
    """``"r,d"`` -> ``(r, d)``; raises ``ValueError`` naming ``key`` otherwise."""
    parts = key.split(",")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        raise ValueError(f"path key {key!r}: expected 'cp_rank,dcp_rank' (two non-negative ints)")
    return int(parts[0]), int(parts[1])


def _new_path() -> dict[str, Any]:
    return {**dict.fromkeys(_PATH_FIELDS, 0), "write_seconds": []}


@dataclass
class DCP2DStats(KVConnectorStats):
    """``data = {"paths": {"r,d": {"transfers", "bytes", "replicated_bytes", "descriptors", "seconds",
    "write_seconds": [float]}}, "failed": int, "expired": int, "quarantined": int, "lifted": int,
    "prefix_broadcast_bytes": int, "stalls": int, "retries": int, "fetch_seconds": [float],
    "reported_after_seconds": [float], "held_seconds": [float]}``.

    bytes:       everything the path moved; replicated_bytes: the part that went to
                 replicated KV cache groups (a speculative draft's KV, every page to
                 every decode rank); the target's bytes are the difference.
    seconds:     the sum of the producer's write seconds; write_seconds: each
                 write's, oldest first, at most ``MAX_OBSERVATIONS`` (the histogram).

    failed:      fetches that ended with an error (decode), length mismatches included.
    expired:     requests given up on: decode KV that never arrived in
                 ``transfer_timeout_s``, or prefill blocks freed after ``send_timeout_s``.
    quarantined: decode blocks kept out of use because a prefill rank may still
                 write into them (docs/connector.md, "Block lifetime").
    lifted:      quarantined blocks given back once their rank settled.
    prefix_broadcast_bytes: prefill with layer-split storage: bytes this rank sent
                 or received filling transient slots (``prefill/layer_split.py``).
    stalls:      Mooncake writes (batches) this rank gave up after ``STALL_S`` without
                 progress (``transfer/transport.py``), retried or not.
    retries:     batches re-sent on a fresh Mooncake engine after a stall.
    unauthenticated: side-channel frames dropped unread (``auth.py``).
    refused_registrations: prefill, decode links whose Mooncake session was refused
                 (``transfer/consumers.py``: not on the link's host without a secret, or the
                 prefill's own): their requests fail, nothing is written.
    corrupt:     fetches whose KV failed its checksum (``verify_kv``; counted in ``failed`` too).
    handshake_failures: Mooncake sessions that did not answer their handshake within
                 ``handshake_timeout_s`` (``transfer/handshake.py``); each is refused for a while.
    handshake_refusals: writes refused at once for that (their fetch fails; nothing sent).
    fetch_seconds: decode, per ended fetch that succeeded: from asking the prefill
                 ranks to the last answer. reported_after_seconds: from then to the
                 engine step that reported it (``step_bell``). held_seconds: prefill, per
                 request handed to the senders: until every decode rank was served,
                 released it, or it expired. Each at most ``MAX_OBSERVATIONS`` per
                 snapshot, like ``write_seconds``.
    quarantine_seconds: decode, per quarantine that lifted: from its fetch's end to the lift.
    quarantine_oldest_seconds: decode, each TP rank's oldest quarantine's age now ([0.0] once
                 after its last one lifted; [] when it had none): a stuck one shows growing.
    """

    def __post_init__(self):
        self._lock = threading.Lock()
        if not self.data:
            self.reset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = {"paths": {}, **dict.fromkeys(_COUNTERS, 0), **{k: [] for k in _TIMERS + LEVELS}}

    def record_path(self, cp_rank: int, dcp_rank: int, nbytes: int, descriptors: int, seconds: float,
                    replicated_bytes: int = 0) -> None:
        """Called by the worker when one path of one request completed."""
        with self._lock:
            p = self.data["paths"].setdefault(path_key(cp_rank, dcp_rank), _new_path())
            p["transfers"] += 1
            p["bytes"] += int(nbytes)
            p["replicated_bytes"] += int(replicated_bytes)
            p["descriptors"] += int(descriptors)
            p["seconds"] += float(seconds)
            obs = p["write_seconds"]
            obs.append(float(seconds))
            del obs[:-MAX_OBSERVATIONS]

    def record_fetch(self, seconds: float, reported_after_s: float) -> None:
        """Called by a decode worker when it reports a fetch that succeeded."""
        for k, v in zip(_TIMERS, (seconds, reported_after_s)):
            self._observe(k, v)

    def record_held(self, seconds: float) -> None:
        """Called by a prefill worker when the senders let go of a request's blocks."""
        self._observe("held_seconds", seconds)

    def record_stage(self, timer: str, seconds: float) -> None:
        """One request's stage took ``seconds`` (``timer`` one of ``_TIMERS``): a prefill
        worker's handover, the decode scheduler's admit, resume and first step
        (``DecodeTimeline`` below)."""
        if timer not in _TIMERS:
            raise KeyError(f"stats timer {timer!r}: expected one of {_TIMERS}")
        self._observe(timer, seconds)

    def record_level(self, level: str, value: float) -> None:
        """This rank's ``level`` (one of ``LEVELS``) now."""
        if level not in LEVELS:
            raise KeyError(f"stats level {level!r}: expected one of {LEVELS}")
        with self._lock:
            self.data[level] = [float(value)]

    def _observe(self, timer: str, value: float) -> None:
        with self._lock:
            obs = self.data[timer]
            obs.append(float(value))
            del obs[:-MAX_OBSERVATIONS]

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of ``_COUNTERS``)."""
        if name not in _COUNTERS:
            raise KeyError(f"stats counter {name!r}: expected one of {_COUNTERS}")
        with self._lock:
            self.data[name] += n

    def clone_and_reset(self) -> DCP2DStats:
        """Snapshot for one ``get_kv_connector_stats`` call (worker thread safe)."""
        with self._lock:
            snap = DCP2DStats(data=json.loads(json.dumps(self.data)))
            self.reset()
        return snap

    def is_empty(self) -> bool:
        return not self.data["paths"] and not any(self.data[k] for k in _COUNTERS + _TIMERS + LEVELS)

    def aggregate(self, other: KVConnectorStats) -> DCP2DStats:
        """Fold ``other`` (another TP rank, or a later interval) into ``self``."""
        if not isinstance(other, DCP2DStats):
            raise TypeError(f"cannot aggregate DCP2DStats with {type(other).__name__}")
        with self._lock:
            for key, q in other.data["paths"].items():
                p = self.data["paths"].setdefault(key, _new_path())
                for f in _PATH_FIELDS:
                    p[f] += q[f]
                p["write_seconds"] = (p["write_seconds"] + q["write_seconds"])[-MAX_OBSERVATIONS:]
            for k in _COUNTERS:
                self.data[k] += other.data[k]
            for k in _TIMERS:
                self.data[k] = (self.data[k] + other.data[k])[-MAX_OBSERVATIONS:]
            for k in LEVELS:  # the ranks' and later steps' levels: the front-end keeps the largest of a step
                self.data[k] = (self.data[k] + other.data.get(k, []))[-MAX_OBSERVATIONS:]
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line of the periodic log: totals plus bytes and ms per path."""
        paths = self.data["paths"]
        out: dict[str, int | float] = {
            "transfers": sum(p["transfers"] for p in paths.values()),
            "bytes": sum(p["bytes"] for p in paths.values()),
            "replicated_bytes": sum(p["replicated_bytes"] for p in paths.values()),
            "descriptors": sum(p["descriptors"] for p in paths.values()),
            **{k: self.data[k] for k in _COUNTERS},
        }
        for key in sorted(paths):
            p = paths[key]
            out[f"path({key}) bytes"] = p["bytes"]
            if p["replicated_bytes"]:
                out[f"path({key}) replicated bytes"] = p["replicated_bytes"]
            out[f"path({key}) ms"] = round(1e3 * p["seconds"], 3)
        return out


class StatsFile:
    """Appends one JSON object per line to ``path`` (no-op when ``path`` is empty).

    Lines are written with one ``write`` on an ``O_APPEND`` descriptor, so the
    workers of several instances can share one file.
    """

    def __init__(self, path: str, side: str, engine_id: str):
        self.path, self.side, self.engine_id = path, side, engine_id

    def write(self, **record) -> None:
        if not self.path:
            return
        line = json.dumps({"t": time.time(), "side": self.side, "engine_id": self.engine_id, **record})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------
# A decode request's stages as its scheduler sees them (issue 29, the PD timeline).
#
# From the decode's API server receiving a PD request to its first token, a
# request passes through (who records each, all on this instance):
#
#   admit       received (``request.arrival_time``, vLLM's front end) until blocks are
#               allocated and its fetch recorded (``update_state_after_alloc``):
#               queueing on the decode;
#   fetch       a worker asking every prefill CP rank until the last answer
#               (worker, ``fetch_seconds``; its writes: ``path_write_seconds``);
#   reported    the ended fetch waiting for the step that reports it (worker,
#               ``reported_after_seconds``);
#   resume      ``finished_recving`` reaching the scheduler until the request is
#               scheduled on its KV;
#   first step  that step, until its output (the first token) is back in the
#               scheduler.
#
# ``DecodeTimeline`` keeps admit, resume and first step for the scheduler half: it
# records them into a ``DCP2DStats`` the scheduler returns from
# ``get_kv_connector_stats`` (vLLM merges it with the workers' snapshot of the same
# step), and writes one ``stats_file`` line per request (``event`` "first_step").
#
# A first step is paired with its own output, not counted in steps: the scheduler
# lists the requests in that step's ``DCP2DMetadata.first_run`` and the workers echo
# them in the step's ``DCP2DWorkerMeta.ran``, which vLLM hands back with that step's
# output, however late (async scheduling) and even if it drops other steps' outputs.
# A fetch that failed on any rank (``DCP2DWorkerMeta.failed_fetches``, or vLLM's
# ``failed_recving``) is not timed: its first step is a local prefill.
#
# Clocks: admit compares the API server's ``time.time()`` with the engine core's (a
# negative value, clocks of two hosts, is dropped); the rest is the engine core's
# ``time.monotonic()``.

MAX_TRACKED = 4096  # requests between admission and their first step's output (a backstop)


class DecodeTimeline:
    """Per request: ``key`` (its transfer key) and the times of its stages so far."""

    def __init__(self, stats_file: StatsFile):
        self.stats = DCP2DStats()
        self.stats_file = stats_file
        # request id -> {"key", "admit", "fetched", "scheduled"}. "key" is the one copy of a transfer
        # key outside ``TransferKeys``, on purpose: the stats_file line is written once the first
        # step's output is back, after the fetch ended (``Siblings.fetching`` let it go) and, for
        # a one-token answer, after the request finished (vLLM frees it before it hands the
        # connector that output).
        self._reqs: dict[str, dict] = {}

    def admitted(self, req_id: str, transfer_key: str, arrival_time: float | None) -> None:
        """Blocks allocated and the fetch recorded (``update_state_after_alloc``).
        ``arrival_time``: ``time.time()`` when the API server got it (None: unknown)."""
        admit = time.time() - arrival_time if arrival_time else -1.0
        admit = admit if admit >= 0 else None
        if len(self._reqs) >= MAX_TRACKED:  # outputs that never came back: forget the oldest
            del self._reqs[next(iter(self._reqs))]
        self._reqs[req_id] = {"key": transfer_key, "admit": admit, "fetched": None, "scheduled": None}
        if admit is not None:
            self.stats.record_stage("admit_seconds", admit)

    def failed(self, req_ids) -> None:
        """Their fetch failed on some rank: not timed."""
        for req_id in req_ids:
            self._reqs.pop(req_id, None)

    def fetched(self, req_ids) -> None:
        """``finished_recving`` of one step's output (every rank reported them)."""
        now = time.monotonic()
        for req_id in req_ids:
            r = self._reqs.get(req_id)
            if r is not None and r["fetched"] is None:
                r["fetched"] = now

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (``request_finished``): untracked, unless its first step
        is on its way back (a 1-token answer finishes as that output is processed)."""
        r = self._reqs.get(req_id)
        if r is not None and r["scheduled"] is None:
            del self._reqs[req_id]

    def scheduled(self, req_ids) -> list[str]:
        """One step is scheduled (``build_connector_meta``) with these requests. Returns
        those it runs first on their fetched KV: the step's ``first_run``."""
        now, first = time.monotonic(), []
        for req_id in req_ids:
            r = self._reqs.get(req_id)
            if r is not None and r["fetched"] is not None and r["scheduled"] is None:
                r["scheduled"] = now
                self.stats.record_stage("resume_seconds", now - r["fetched"])
                first.append(req_id)
        return first

    def ran(self, req_ids) -> None:
        """Their first step's output was processed (``DCP2DWorkerMeta.ran``)."""
        now = time.monotonic()
        for req_id in req_ids:
            r = self._reqs.pop(req_id, None)
            if r is None or r["scheduled"] is None:
                continue
            first_step = now - r["scheduled"]
            self.stats.record_stage("first_step_seconds", first_step)
            self.stats_file.write(transfer_key=r["key"], request_id=req_id, event="first_step",
                                  admit_seconds=r["admit"], resume_seconds=r["scheduled"] - r["fetched"],
                                  first_step_seconds=first_step)

    def take_stats(self) -> DCP2DStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
