"""A decode request's stages as its scheduler sees them (issue 29, the PD timeline).

From the decode's API server receiving a PD request to its first token, a
request passes through (who records each, all on this instance):

  admit       received (``request.arrival_time``, vLLM's front end) until blocks are
              allocated and its fetch recorded (``update_state_after_alloc``):
              queueing on the decode;
  fetch       a worker asking every prefill CP rank until the last answer
              (worker, ``fetch_seconds``; its writes: ``path_write_seconds``);
  reported    the ended fetch waiting for the step that reports it (worker,
              ``reported_after_seconds``);
  resume      ``finished_recving`` reaching the scheduler until the request is
              scheduled on its KV;
  first step  that step, until its output (the first token) is back in the
              scheduler.

This module keeps admit, resume and first step for the scheduler half: it
records them into a ``DCP2DStats`` the scheduler returns from
``get_kv_connector_stats`` (vLLM merges it with the workers' snapshot of the same
step), and writes one ``stats_file`` line per request (``event`` "first_step").

A first step is paired with its own output, not counted in steps: the scheduler
lists the requests in that step's ``DCP2DMetadata.first_run`` and the workers echo
them in the step's ``DCP2DWorkerMeta.ran``, which vLLM hands back with that step's
output, however late (async scheduling) and even if it drops other steps' outputs.
A fetch that failed on any rank (``DCP2DWorkerMeta.failed_fetches``, or vLLM's
``failed_recving``) is not timed: its first step is a local prefill.

Clocks: admit compares the API server's ``time.time()`` with the engine core's (a
negative value, clocks of two hosts, is dropped); the rest is the engine core's
``time.monotonic()``.
"""

from __future__ import annotations

import time

from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile

__all__ = ["DecodeTimeline"]

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
