"""``FetchLedger`` on its own: each invariant of its module doc, forced directly."""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.transfer.fetch import Fetch, FetchError
from vllm_dcp2d.transfer.fetch_ledger import FetchLedger

A, B = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"


def fetch(key="k", bootstrap="tcp://p:1") -> Fetch:
    return Fetch(key, bootstrap, None, (np.arange(2),), 32, 0, deadline=1e18, wait_s=0.0)


def sent_to_two(ledger: FetchLedger, f: Fetch) -> None:
    assert ledger.begin(f)
    ledger.sent(f, 0, A, 1)
    ledger.sent(f, 1, B, 2)


def test_invariant_1_a_fetch_ends_only_when_every_attempt_is_accounted_for():
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    assert led.answered(A, 1) == ("inflight", f, 0)
    assert f.inflight == {1: (B, 2)}
    assert led.fail(f, FetchError("k", 0, "boom"), grace_s=5.0) == ([(B, 2)], False)  # cancel what is left
    assert led.poll() == []
    led.quarantine(f, 1, (B, 2), "no answer to the cancel")
    led.finish(f, f.failing)
    assert led.poll() == [f] and not led.is_active(f)


def test_answers_are_matched_by_address_and_attempt_only():
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    assert led.answered(B, 1) == ("unknown", None, -1)  # attempt 1 went to A, not B
    assert led.answered(A, 2) == ("unknown", None, -1)
    assert f.inflight == {0: (A, 1), 1: (B, 2)}


def test_invariant_2_quarantine_lifts_only_when_each_attempt_settled_and_after_the_end():
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    led.quarantine(f, 0, (A, 1), "stalled")
    led.quarantine(f, 1, (B, 2), "silent")
    led.settle((A, 1), "answered")
    assert led.poll_lifted() == []  # still active, and B may still write
    led.finish(f, FetchError("k", 0, "timed out"))
    assert led.poll() == [f] and led.poll_lifted() == []
    assert led.answered(B, 2) == ("quarantined", f, 1)
    led.settle((B, 9), "answered")  # another attempt: settles nothing
    assert led.poll_lifted() == []
    led.settle_rank(B, "tcp://other:1", "restarted")  # another prefill's restart: nothing
    assert led.poll_lifted() == []
    led.settle_rank(B, "tcp://p:1", "restarted")
    assert led.poll_lifted() == [f]


def test_invariant_3_reported_once():
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    led.quarantine(f, 0, (A, 1), "stalled")
    led.quarantine(f, 1, (B, 2), "stalled")
    led.settle((A, 1), "answered")
    led.settle((B, 2), "answered")
    led.finish(f, None)
    led.finish(f, None)  # a second end of the same fetch is ignored
    assert led.poll() == [f] and "a write may still land" in str(f.error)
    assert led.poll_lifted() == [f]
    led.settle((A, 1), "answered")
    assert led.poll() == [] and led.poll_lifted() == []


def test_one_fetch_per_key_and_fail_all_quarantines_what_is_in_flight():
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    assert not led.begin(fetch())
    led.fail_all("receiver thread died")
    (g,) = led.poll()
    assert g is f and set(f.quarantined) == {0, 1} and led.poll_lifted() == []
    assert led.busy(A) and led.busy(B)


def test_finish_and_settle_say_what_they_output_once_poll_sees_it():
    """The receiver rings the worker's step bell when ``finish`` or ``settle`` say they
    ended a fetch or lifted a quarantine: by then ``poll`` (or ``poll_lifted``) must
    return it, or the step it wakes sees nothing."""
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    led.answered(A, 1)
    led.answered(B, 2)
    assert led.poll() == []  # answers alone end nothing
    assert led.finish(f, None) is True
    assert (led.poll(), led.poll_lifted()) == ([f], [])
    assert led.finish(f, None) is False  # ended already: nothing new to poll
    g = fetch("g")
    sent_to_two(led, g)
    led.answered(A, 1)
    led.quarantine(g, 1, (B, 2), "silent")
    assert led.finish(g, FetchError("g", 1, "deadline")) is True
    assert (led.poll(), led.poll_lifted()) == ([g], [])  # ended, its blocks still quarantined
    assert led.settle((B, 9), "answered") is False  # no such attempt
    assert led.settle((B, 2), "cancel confirmed") is True
    assert (led.poll(), led.poll_lifted()) == ([], [g])
    h = fetch("h")
    assert led.begin(h)
    assert led.fail(h, FetchError("h", None, "boom"), grace_s=5.0) == ([], True)  # nothing in flight: ends now
    assert led.poll() == [h]
