"""The decode scheduler's per-request stages (``connector/timeline.py``): admit,
resume and first step, each timed to its own step also when vLLM processes a step's
output one step late (async scheduling), and written to ``stats_file``."""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.connector import timeline as tl
from vllm_dcp2d.connector.stats import StatsFile
from vllm_dcp2d.connector.timeline import DecodeTimeline


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


@settings(max_examples=40, deadline=None)
@given(lag=st.integers(0, 2), resume_steps=st.integers(0, 3), tokens_one=st.booleans())
def test_first_step_is_timed_to_its_own_output_however_late_vllm_reads_it(lag, resume_steps, tokens_one,
                                                                          tmp_path_factory):
    """vLLM processes each step's output ``lag`` steps after scheduling it (0:
    synchronous, 1: async scheduling). The request's KV arrives; ``resume_steps``
    steps later it is scheduled; its first step takes 7 s on this clock, the others
    1 s. With ``tokens_one`` it finishes as that step's output is processed."""
    path = tmp_path_factory.mktemp("t") / "stats.jsonl"
    t = DecodeTimeline(StatsFile(str(path), "consumer", "D"))
    clock = Clock()
    sched_at, done_at, pending = [], [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl.time, "monotonic", clock)
        t.admitted("r", "key-r", time.time() - 2.0)
        loaded_at = clock.now
        t.loaded({"r"}, set())
        k = resume_steps
        for i, reqs in enumerate([[]] * k + [["r", "other"]] + [["r"]] * 3):
            clock.now += 0.5  # scheduling
            sched_at.append(clock.now)
            t.scheduled(reqs)
            pending.append(7.0 if "other" in reqs else 1.0)
            if len(pending) > lag:
                clock.now += pending.pop(0)
                if tokens_one and i - lag == k:
                    t.forget("r")
                done_at.append(clock.now)
                t.step_done()
        while pending:
            clock.now += pending.pop(0)
            done_at.append(clock.now)
            t.step_done()
    s = t.take_stats().data
    assert s["admit_seconds"] == [pytest.approx(2.0, abs=0.5)]
    assert s["resume_seconds"] == [sched_at[k] - loaded_at]
    assert s["first_step_seconds"] == [done_at[k] - sched_at[k]]
    assert lag or s["first_step_seconds"] == [7.0]
    (line,) = lines(path)
    assert (line["event"], line["transfer_key"], line["request_id"]) == ("first_step", "key-r", "r")
    assert [line[f] for f in ("admit_seconds", "resume_seconds", "first_step_seconds")] == [
        s[f][0] for f in ("admit_seconds", "resume_seconds", "first_step_seconds")]


def test_async_order_pairs_each_step_with_its_output(clock, tmp_path):
    """Async scheduling: step 2 is scheduled before step 1's output is read. The
    request first runs in step 2; step 1's output must not end its first step."""
    t = DecodeTimeline(StatsFile(str(tmp_path / "s"), "consumer", "D"))
    t.admitted("r", "k", None)
    t.loaded({"r"}, set())
    t.scheduled([])          # step 1: without r
    clock.now += 1
    t.scheduled(["r"])       # step 2: r on its KV
    clock.now += 3
    t.step_done()            # step 1's output
    assert t.stats.data["first_step_seconds"] == []
    clock.now += 5
    t.step_done()            # step 2's output
    assert t.take_stats().data["first_step_seconds"] == [8.0]


def test_failed_and_unloaded_requests_are_not_timed(clock, tmp_path):
    t = DecodeTimeline(StatsFile(str(tmp_path / "s"), "consumer", "D"))
    for r in ("failed", "finished_early", "never_loaded"):
        t.admitted(r, r, None)
    t.loaded({"failed", "unknown"}, {"failed"})  # a recomputed fetch; an id it never admitted
    t.forget("finished_early")                  # aborted while its KV was on the way
    t.scheduled(["failed", "finished_early", "never_loaded"])
    t.step_done()
    t.step_done()  # more outputs than steps: nothing to pair
    assert t.take_stats() is None
    assert not (tmp_path / "s").exists()
