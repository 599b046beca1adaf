"""``SendLedger`` on its own: each invariant of its module doc, forced directly,
and a property test that drives it with drawn sequences of everything its
callers do and checks the invariants after every step."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.transfer import send_ledger
from vllm_dcp2d.transfer.messages import ReleaseTransfer, TransferOutcome
from vllm_dcp2d.transfer.send_ledger import Attempt, SendLedger
from tests.support.pair import request
from tests.support.transfer import writes_in_flight

class Book:
    """A ledger whose answers are recorded: ``answers[attempt key] -> [outcome, ...]``."""

    def __init__(self):
        self._answers: dict[tuple, list[TransferOutcome]] = {}
        self.ledger = SendLedger("cp rank 0")
        self.attempts: dict[int, Attempt] = {}

    @property
    def answers(self) -> dict[tuple, list[TransferOutcome]]:
        """Every answer the ledger decided so far, taken as its owner takes them."""
        for ans in self.ledger.take_answers():
            a = ans.attempt
            outcome = (self._ok(a, ans.held) if ans.ok
                       else self._failed(a.req, ans.error, 0 if ans.held is None else ans.held.num_pages,
                                         a.settled))
            self._answers.setdefault((a.identity, outcome.attempt_id), []).append(outcome)
        return self._answers

    @staticmethod
    def _outcome(req, ok, reason, settled, num_tokens=0):
        return TransferOutcome(transfer_key=req.transfer_key, attempt_id=req.attempt_id, cp_rank=0, cp_size=1, ok=ok,
                               reason=reason, layer_start=0, layer_end=2, num_tokens=num_tokens, num_pages=0,
                               nbytes=0, descriptors=0, batches=0, naive_bytes=0, plan_s=0.0, write_s=0.0,
                               early_layers=0, settled=settled)

    def _failed(self, req, reason, num_pages=0, settled=True):
        return self._outcome(req, False, reason, settled)

    def _ok(self, a, state):
        return self._outcome(a.req, True, "", a.settled, state.num_tokens)

    def arrive(self, attempt=1, **kw) -> tuple[Attempt, str]:
        a = Attempt(b"id", request(attempt=attempt, **kw), deadline=1e18)
        self.attempts[attempt] = a
        return a, self.ledger.arrive(a)

    def add(self, key="k", tokens=40, send_timeout_s=60.0, claim_timeout_s=float("inf")):
        return self.ledger.add(key, (np.arange(3),), tokens, 3, send_timeout_s, claim_timeout_s)

    def answered(self, attempt=1) -> list[TransferOutcome]:
        return self.answers.get((b"id", attempt), [])


def test_invariant_1_no_free_while_a_write_reads():
    b = Book()
    b.add()
    a, how = b.arrive()
    assert how == "serve"
    state, _, _ = b.ledger.begin_answer(a)
    b.ledger.expire(now=1e19)  # expired while the write runs
    assert b.ledger.pop_finished() == {}
    b.ledger.end_answer(a, state, "")
    assert b.ledger.pop_finished() == {"k": "expired"}
    assert [o.ok for o in b.answered()] == [True]


def test_invariant_2_one_answer_after_the_last_write():
    b = Book()
    a, how = b.arrive()
    assert how == "wait"
    token = b.ledger.begin_layer(a, 0, 40, epoch=0)
    assert b.ledger.cancel(b"id", 1, "cancelled") == (True, True)
    assert b.answered() == []  # a write is in flight: not yet
    assert b.ledger.cancel(b"id", 1, "cancelled again") == (True, True)
    b.ledger.end_layer(a, token, 0, 0, "")
    assert [o.reason for o in b.answered()] == ["cancelled"]
    assert b.ledger.begin_layer(a, 1, 40, epoch=0) is None  # closed: no write starts
    b.ledger.expire(now=1e19)
    assert len(b.answered()) == 1


def test_invariant_3_a_preemption_voids_the_layers_written_and_in_flight():
    b = Book()
    a, _ = b.arrive()
    (_, epoch), = b.ledger.waiting("k")
    done = b.ledger.begin_layer(a, 0, 40, epoch)
    b.ledger.end_layer(a, done, 0, epoch, "")
    running = b.ledger.begin_layer(a, 1, 40, epoch)
    assert b.ledger.restart("k") == 1
    b.ledger.end_layer(a, running, 1, epoch, "")  # it read the freed blocks: counts for nothing
    assert b.ledger.begin_layer(a, 0, 40, epoch) is None  # queued before the preemption: skipped
    b.add()
    state, error, sent = b.ledger.begin_answer(a)
    assert sent == frozenset() and error == ""  # the answer writes both layers again
    b.ledger.end_answer(a, state, "")
    assert [o.ok for o in b.answered()] == [True]


def test_invariant_4_a_stalled_write_answers_unsettled(monkeypatch):
    monkeypatch.setattr(send_ledger, "STALL_S", 0.0)
    b = Book()
    b.add()
    a, _ = b.arrive()
    state, _, _ = b.ledger.begin_answer(a)
    b.ledger.mark_unsettled(a)
    b.ledger.end_answer(a, state, "write timed out")
    assert [o.settled for o in b.answered()] == [False]
    known, settled = b.ledger.cancel(b"id", 1, "again")
    assert not known and settled  # STALL_S (0 here) passed


def test_invariant_4_cancels_unsettled_until_stall_s():
    b = Book()
    b.add()
    a, _ = b.arrive()
    state, _, _ = b.ledger.begin_answer(a)
    b.ledger.mark_unsettled(a)
    b.ledger.end_answer(a, state, "")
    assert b.ledger.cancel(b"id", 1, "again") == (False, False)


def test_invariant_5_a_release_waits_for_another_engines_open_attempt():
    b = Book()
    b.add()
    a, _ = b.arrive(attempt=2, engine="other")
    b.ledger.release(ReleaseTransfer("k", "D", 0, 1, 40))
    b.ledger.expire(now=0.0)
    assert b.ledger.pop_finished() == {}  # "other" fetches it
    state, _, _ = b.ledger.begin_answer(a)
    b.ledger.end_answer(a, state, "")
    assert b.ledger.pop_finished() == {"k": "done"}
    b.ledger.release(ReleaseTransfer("k", "D", 0, 1, 41))  # after it finished: ignored
    assert b.ledger.pop_finished() == {}


def test_invariant_6_a_request_nobody_asks_for_is_freed_after_claim_s():
    import time

    b = Book()
    b.add(claim_timeout_s=5.0)
    b.ledger.expire(now=time.monotonic() + 4.0)
    assert b.ledger.pop_finished() == {}
    b.ledger.expire(now=time.monotonic() + 6.0)
    assert b.ledger.pop_finished() == {"k": "unclaimed"}
    a, how = b.arrive()  # a fetch that comes later finds nothing
    assert how == "wait"
    # asked for in time: the full expiry (60 s) applies, whoever asked
    for asked in ("attempt", "release", "waited"):
        b = Book()
        if asked == "waited":
            b.arrive()
        b.add(key="k", claim_timeout_s=5.0)
        if asked == "attempt":
            b.arrive()
        elif asked == "release":
            b.ledger.release(ReleaseTransfer("k", "D", 0, 2, 40))  # one of two consumer ranks
        b.ledger.expire(now=time.monotonic() + 30.0)
        assert b.ledger.pop_finished() == {}, asked
        b.ledger.expire(now=time.monotonic() + 61.0)
        assert b.ledger.pop_finished() == {"k": "expired"}, asked


def test_release_of_another_token_count_is_ignored_and_claims_nothing():
    """vLLM's front end hands a refused request to the connector as a one-token stand-in
    (``notify_kv_transfer_request_rejected``); a release with its count must neither free
    the request nor claim it, which would hold its blocks for the full expiry instead of
    ``claim_timeout_s`` (seen: 600 s on a prefill whose decode refused a too-long prompt)."""
    import time

    for early in (False, True):
        b = Book()
        if early:  # the release comes before the request is added
            b.ledger.release(ReleaseTransfer("k", "D", 0, 1, 1))
        b.add(claim_timeout_s=5.0)
        if not early:
            b.ledger.release(ReleaseTransfer("k", "D", 0, 1, 1))
        assert b.ledger.pop_finished() == {}, early
        b.ledger.expire(now=time.monotonic() + 6.0)
        assert b.ledger.pop_finished() == {"k": "unclaimed"}, early


def test_abort_and_drop():
    b = Book()
    a, _ = b.arrive()
    token = b.ledger.begin_layer(a, 0, 40, 0)
    b.ledger.abort("k")
    assert b.ledger.pop_finished() == {}  # its layer write reads the blocks
    b.ledger.end_layer(a, token, 0, 0, "")
    assert b.ledger.pop_finished() == {"k": "aborted"}
    assert [o.ok for o in b.answered()] == [False]
    a2, _ = b.arrive(attempt=2, key="j")
    b.ledger.abort("j", report=False)
    assert b.ledger.pop_finished() == {} and "aborted" in b.answered(2)[0].reason


# ---- the property: drawn sequences of every caller action ----

OPS = st.lists(st.tuples(st.sampled_from(["arrive", "add", "cancel", "layer", "end_layer", "answer",
                                          "end_answer", "release", "expire", "restart", "abort", "unsettle"]),
                         st.integers(0, 3)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_invariants_hold_under_any_sequence(ops):
    b = Book()
    running: dict[int, list] = {}  # attempt -> writes begun and not ended: (kind, token, layer, epoch)
    added = set()
    n = 0
    for op, x in ops:
        attempts = list(b.attempts.values())
        a = attempts[x % len(attempts)] if attempts else None
        if op == "arrive":
            n += 1
            b.arrive(attempt=n, engine=["D", "E"][x % 2])
        elif op == "add" and "k" not in added:
            added.add("k")
            b.add(claim_timeout_s=[float("inf"), 1.0][x % 2])  # the Sender answers the attempts that waited: "answer"
        elif op == "cancel" and a is not None:
            b.ledger.cancel(b"id", a.req.attempt_id, "cancelled")
        elif op == "layer" and a is not None:
            epoch = a.epoch
            token = b.ledger.begin_layer(a, x % 2, 40, epoch)
            if token is not None:
                running.setdefault(a.req.attempt_id, []).append(("layer", token, x % 2, epoch))
        elif op == "answer" and a is not None and "k" in added:
            begun = b.ledger.begin_answer(a)
            if begun is not None:
                running.setdefault(a.req.attempt_id, []).append(("answer", begun[0], None, None))
        elif op in ("end_layer", "end_answer") and running:
            aid = sorted(running)[x % len(running)]
            kind, token, layer, epoch = running[aid].pop()
            if not running[aid]:
                del running[aid]
            w = b.attempts[aid]
            if kind == "layer":
                b.ledger.end_layer(w, token, layer, epoch, "")
            else:
                b.ledger.end_answer(w, token, "")
        elif op == "release":
            b.ledger.release(ReleaseTransfer("k", ["D", "E"][x % 2], 0, 1, 40))
        elif op == "expire":  # before any deadline, past a claim_timeout_s of 1 s only, past everything
            import time

            b.ledger.expire(now=1e19 if x == 3 else time.monotonic() + 2.0 if x == 2 else 0.0)
        elif op == "restart":
            b.ledger.restart("k")
        elif op == "abort" and "k" not in added:
            b.ledger.abort("k", report=bool(x % 2))
        elif op == "unsettle" and a is not None:
            b.ledger.mark_unsettled(a)
        finished = b.ledger.pop_finished()
        in_flight = sum(len(v) for v in running.values())
        assert writes_in_flight(b.ledger) == in_flight
        if finished:  # invariant 1: nothing freed while a write reads it
            assert not any(kind == "answer" or token[0] is not None
                           for v in running.values() for kind, token, *_ in v), (finished, running)
        for w in b.attempts.values():  # invariant 2
            got = b.answered(w.req.attempt_id)
            assert len(got) <= 1
            if got:
                assert w.req.attempt_id not in running
    for aid in list(running):  # every write returns: each attempt ends with at most one answer
        for kind, token, layer, epoch in running.pop(aid):
            w = b.attempts[aid]
            (b.ledger.end_layer(w, token, layer, epoch, "") if kind == "layer" else b.ledger.end_answer(w, token, ""))
    b.ledger.expire(now=1e19)
    for w in b.attempts.values():  # closed means answered exactly once; open means not yet
        assert len(b.answered(w.req.attempt_id)) == (1 if w.closed else 0), w
