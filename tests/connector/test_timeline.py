"""The decode scheduler's per-request stages (``connector/stats.py``, ``DecodeTimeline``): admit,
resume and first step, the first step paired with its own output through the
workers' echo (``first_run`` -> ``ran``) however late vLLM processes it, and
written to ``stats_file``."""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.connector import stats as tl
from vllm_dcp2d.connector.stats import StatsFile
from vllm_dcp2d.connector.stats import DecodeTimeline


class Clock:
    """``time.monotonic`` the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(tl.time, "monotonic", c)
    return c


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@settings(max_examples=60, deadline=None)
@given(lag=st.integers(0, 2), resume_steps=st.integers(0, 3), tokens_one=st.booleans(),
       lost=st.sets(st.integers(0, 6), max_size=2))
def test_first_step_is_paired_with_its_own_output(lag, resume_steps, tokens_one, lost, tmp_path_factory):
    """vLLM processes each step's output ``lag`` steps after scheduling it (0:
    synchronous, 1: async scheduling) and may drop the outputs of steps in ``lost``
    (0.33's fault-tolerance drain). Request r's KV arrives; ``resume_steps`` steps
    later it runs first, a step of 7 s on this clock (others 1 s). With
    ``tokens_one`` it finishes as that step's output is processed."""
    path = tmp_path_factory.mktemp("t") / "stats.jsonl"
    t = DecodeTimeline(StatsFile(str(path), "consumer", "D"))
    clock = Clock()
    k = resume_steps
    sched_at, done_at, pending = [], {}, []  # pending: (step, duration, its echo)

    def process():
        step, took, echo = pending.pop(0)
        clock.now += took
        done_at[step] = clock.now
        if step in lost:
            return
        if tokens_one and step == k:
            t.forget("r")
        t.ran(echo)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl.time, "monotonic", clock)
        t.admitted("r", "key-r", time.time() - 2.0)
        loaded_at = clock.now
        t.fetched({"r"})
        for i, reqs in enumerate([[]] * k + [["r", "other"]] + [["r"]] * 3):
            clock.now += 0.5  # scheduling
            sched_at.append(clock.now)
            pending.append((i, 7.0 if i == k else 1.0, t.scheduled(reqs)))
            if len(pending) > lag:
                process()
        while pending:
            process()
    s = t.take_stats().data
    assert s["admit_seconds"] == [pytest.approx(2.0, abs=0.5)]
    assert s["resume_seconds"] == [sched_at[k] - loaded_at]
    if k in lost:  # its first step's output never came back: not timed
        assert s["first_step_seconds"] == [] and lines(path) == []
        return
    assert s["first_step_seconds"] == [done_at[k] - sched_at[k]]
    assert lag or s["first_step_seconds"] == [7.0]
    (line,) = lines(path)
    assert (line["event"], line["transfer_key"], line["request_id"]) == ("first_step", "key-r", "r")
    assert [line[f] for f in ("admit_seconds", "resume_seconds", "first_step_seconds")] == [
        s[f][0] for f in ("admit_seconds", "resume_seconds", "first_step_seconds")]


def test_only_the_first_step_on_loaded_kv_is_listed(clock, tmp_path):
    t = DecodeTimeline(StatsFile(str(tmp_path / "s"), "consumer", "D"))
    t.admitted("r", "k", None)
    assert t.scheduled(["r"]) == []   # not loaded yet (vLLM would not schedule it; nothing to time)
    t.fetched({"r"})
    clock.now += 2
    assert t.scheduled(["r", "x"]) == ["r"]
    assert t.scheduled(["r"]) == []   # its later steps
    clock.now += 3
    t.ran(["r", "x"])
    d = t.take_stats().data
    assert (d["admit_seconds"], d["resume_seconds"], d["first_step_seconds"]) == ([], [2.0], [3.0])


def test_failed_and_unloaded_requests_are_not_timed(clock, tmp_path):
    """A rank's fetch failed in an earlier step than the last rank reported the
    request; another request was aborted while its KV was on the way."""
    t = DecodeTimeline(StatsFile(str(tmp_path / "s"), "consumer", "D"))
    for r in ("failed", "finished_early", "never_loaded"):
        t.admitted(r, r, time.time() + 5)  # an API server's clock ahead of this one: no admit
    t.failed({"failed"})
    t.fetched({"failed", "unknown"})
    t.forget("finished_early")
    assert t.scheduled(["failed", "finished_early", "never_loaded"]) == []
    t.ran(["failed", "finished_early", "never_loaded"])
    assert t.take_stats() is None
    assert not (tmp_path / "s").exists()
