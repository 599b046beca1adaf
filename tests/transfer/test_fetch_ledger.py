"""``FetchLedger`` on its own: each invariant of its module doc, forced directly."""

from __future__ import annotations

import numpy as np

from vllm_dcp2d.transfer.fetch_ledger import Answer, Fetch, FetchError, FetchLedger
from vllm_dcp2d.transfer.messages import TransferOutcome

A, B = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"


def outcome(attempt: int, cp_rank: int, settled: bool = True) -> TransferOutcome:
    """CP rank ``cp_rank`` of 2's ok answer to ``attempt`` (``answered`` reads the attempt,
    the CP rank and ``settled``)."""
    return TransferOutcome(transfer_key="k", attempt_id=attempt, cp_rank=cp_rank, cp_size=2, ok=True,
                           reason="" if settled else "stalled", layer_start=0, layer_end=1, num_tokens=32,
                           num_pages=2, nbytes=0, descriptors=0, batches=0, naive_bytes=0, plan_s=0.0,
                           write_s=0.0, early_layers=0, settled=settled)


def fetch(key="k", bootstrap="tcp://p:1") -> Fetch:
    return Fetch(key, bootstrap, None, (np.arange(2),), 32, 0, deadline=1e18, prefill_wait_s=0.0)


def sent_to_two(ledger: FetchLedger, f: Fetch) -> None:
    assert ledger.begin(f)
    ledger.sent(f, 0, A, 1)
    ledger.sent(f, 1, B, 2)


def test_invariant_1_a_fetch_ends_only_when_every_attempt_is_accounted_for():
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    assert led.answered(A, outcome(1, 0), grace_s=5.0) == Answer(fetch=f, cp_rank=0)
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
    assert led.answered(B, outcome(1, 0), grace_s=5.0) == Answer()  # attempt 1 went to A, not B
    assert led.answered(A, outcome(2, 1), grace_s=5.0) == Answer()
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
    assert led.answered(B, outcome(2, 1, settled=False), grace_s=5.0) == Answer()  # not settled: stays
    assert led.answered(B, outcome(2, 0), grace_s=5.0) == Answer()  # another cp rank's: proves nothing
    assert led.poll_lifted() == []
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
    led.answered(A, outcome(1, 0), grace_s=5.0)
    led.answered(B, outcome(2, 1), grace_s=5.0)
    assert led.poll() == []  # answers alone end nothing
    assert led.finish(f, None) is True
    assert (led.poll(), led.poll_lifted()) == ([f], [])
    assert led.finish(f, None) is False  # ended already: nothing new to poll
    g = fetch("g")
    sent_to_two(led, g)
    led.answered(A, outcome(1, 0), grace_s=5.0)
    led.quarantine(g, 1, (B, 2), "silent")
    assert led.finish(g, FetchError("g", 1, "deadline")) is True
    assert (led.poll(), led.poll_lifted()) == ([g], [])  # ended, its blocks still quarantined
    assert led.settle((B, 9), "answered") is False  # no such attempt
    assert led.settle((B, 2), "cancel answered, settled") is True
    assert (led.poll(), led.poll_lifted()) == ([], [g])
    h = fetch("h")
    assert led.begin(h)
    assert led.fail(h, FetchError("h", None, "boom"), grace_s=5.0) == ([], True)  # nothing in flight: ends now
    assert led.poll() == [h]


def test_answered_decides_and_acts_in_one_call():
    """Each kind of answer, and what ``answered`` did about it before returning: an
    unsettled one quarantines its attempt, one naming another CP rank quarantines it and
    fails the fetch (the other attempt to cancel), the last answer of a failing fetch ends
    it (and asks for the table again after a peer's fault), and a settled answer to a
    quarantined attempt lifts the quarantine once the fetch ended."""
    led = FetchLedger()
    f = fetch()
    sent_to_two(led, f)
    a = led.answered(A, outcome(1, 0, settled=False), grace_s=5.0)
    assert a == Answer(fetch=f, cp_rank=0, quarantined=True) and f.unsettled == {0: (A, 1)}
    a = led.answered(B, outcome(2, 0), grace_s=5.0)  # attempt 2 went to cp rank 1
    assert a.fetch is None and a.cancels == [] and a.output  # nothing else in flight: ended now
    assert led.poll() == [f] and f.peer_fault and set(f.quarantined) == {0, 1}
    assert "names cp rank 0, the attempt went to cp rank 1" in str(f.error)
    assert led.answered(A, outcome(1, 0), grace_s=5.0) == Answer(output=False)  # B still unsettled
    assert led.answered(B, outcome(2, 1), grace_s=5.0) == Answer(output=True)
    assert led.poll_lifted() == [f]

    g = fetch("g")
    sent_to_two(led, g)
    assert led.fail(g, FetchError("g", None, "deadline"), grace_s=5.0, peer_fault=True)[1] is False
    assert led.answered(A, outcome(1, 0), grace_s=5.0) == Answer()  # B still in flight
    assert led.answered(B, outcome(2, 1), grace_s=5.0) == Answer(output=True, requery="tcp://p:1")
    assert led.poll() == [g] and "deadline" in str(g.error)

    h = fetch("h")
    sent_to_two(led, h)
    a = led.answered(A, outcome(1, 1), grace_s=5.0)  # wrong cp rank, B still in flight: cancel it
    assert a == Answer(cancels=[(B, 2)], key="h") and h.failing is not None and led.poll() == []
