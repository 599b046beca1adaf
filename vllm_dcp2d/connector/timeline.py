"""A decode request's stages as its scheduler sees them (issue 29, the PD timeline).

From the decode's API server receiving a PD request to its first token, a
request passes through (who records each, all on this instance):

  admit       received (``request.arrival_time``, vLLM's front end) until blocks are
              allocated and its load recorded (``update_state_after_alloc``):
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

vLLM calls ``update_from_output`` (and so ``step_done``) once per scheduled step,
in order; with async scheduling one step later than ``build_connector_meta``.
A FIFO of the steps' requests pairs them, so a first step is timed to its own
output in both modes. A load that failed or fell back is forgotten: its first
step is a local prefill, not a PD stage.
"""

from __future__ import annotations

import time
from collections import deque

from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile

__all__ = ["DecodeTimeline"]


class DecodeTimeline:
    """Per request: ``key`` (its transfer key) and the times of its stages so far."""

    def __init__(self, stats_file: StatsFile):
        self.stats = DCP2DStats()
        self.stats_file = stats_file
        self._reqs: dict[str, dict] = {}   # request id -> {"key", "admit", "loaded", "scheduled"}
        # Per step not yet back: the requests it first ran on their KV. Bounded: vLLM takes
        # stats after every step it schedules, so this holds one or two steps.
        self._steps: deque[list[str]] = deque(maxlen=1024)

    def admitted(self, req_id: str, transfer_key: str, arrival_time: float | None) -> None:
        """Blocks allocated and the load recorded (``update_state_after_alloc``).
        ``arrival_time``: ``time.time()`` when the API server got it (None: unknown)."""
        admit = max(0.0, time.time() - arrival_time) if arrival_time else None
        self._reqs[req_id] = {"key": transfer_key, "admit": admit, "loaded": None, "scheduled": None}
        if admit is not None:
            self.stats.record_stage("admit_seconds", admit)

    def loaded(self, finished: set[str], failed: set[str]) -> None:
        """``finished_recving`` of one step's output; ``failed``: those recomputed."""
        now = time.monotonic()
        for req_id in finished:
            r = self._reqs.get(req_id)
            if r is None:
                continue
            if req_id in failed:
                del self._reqs[req_id]
            elif r["loaded"] is None:
                r["loaded"] = now

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (``request_finished``): untracked unless a step running it
        on its KV is on its way back (``step_done`` times that one, a 1-token answer)."""
        r = self._reqs.get(req_id)
        if r is not None and r["scheduled"] is None:
            del self._reqs[req_id]

    def scheduled(self, req_ids) -> None:
        """One step was scheduled (``build_connector_meta``) with these requests."""
        now, first = time.monotonic(), []
        for req_id in req_ids:
            r = self._reqs.get(req_id)
            if r is not None and r["loaded"] is not None and r["scheduled"] is None:
                r["scheduled"] = now
                self.stats.record_stage("resume_seconds", now - r["loaded"])
                first.append(req_id)
        self._steps.append(first)

    def step_done(self) -> None:
        """The oldest scheduled step's output was processed (``get_kv_connector_stats``)."""
        if not self._steps:
            return
        now = time.monotonic()
        for req_id in self._steps.popleft():
            r = self._reqs.pop(req_id, None)
            if r is None:
                continue
            first_step = now - r["scheduled"]
            self.stats.record_stage("first_step_seconds", first_step)
            self.stats_file.write(transfer_key=r["key"], request_id=req_id, event="first_step",
                                  admit_seconds=r["admit"], resume_seconds=r["scheduled"] - r["loaded"],
                                  first_step_seconds=first_step)

    def take_stats(self) -> DCP2DStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
