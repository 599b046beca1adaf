"""What a decode rank's fetches are and the block lifetime they keep, in one place:
``Fetch`` (one request's pages from every CP rank of one prefill instance), ``FetchError``
(why it failed) and ``FetchLedger`` (docs/connector.md, "Block lifetime"), which
decides on every attempt of every fetch.

A ``Receiver`` (one per decode DCP rank) owns the sockets; its ledger owns what
every fetch is waiting for and decides when a fetch ends and when its blocks may
be used again. The receiver's background thread is the only writer; ``poll`` and
``poll_lifted`` may be called from any thread. The methods that can end a fetch or
lift a quarantine say so in what they return; the receiver then tells its owner.
An answer is decided and acted on here in one call (``answered``); what is left for
the receiver is socket work (cancels to send, a link to back off) and the checks of
an answer's content (``Answer``).

Every attempt is known by where it was sent: ``(rank address, attempt_id)``.
An answer is matched by that pair only, never by the CP rank or transfer key
it names, so a process that took over a rank's port cannot settle or end
another process's attempt.

Invariants (each tested directly in ``tests/transfer/test_fetch_ledger.py``)
-------------------------------------------------------------------
1. A fetch ends (``poll``) only once every attempt of it answered or was
   quarantined: no attempt it sent is still in flight, unaccounted for.
2. A quarantined attempt (no answer to its cancel in time, or an answer
   ``settled=False``) keeps the fetch's blocks out of use: the fetch reaches
   ``poll_lifted`` only once each of them settled (answered its cancel settled,
   its rank was seen restarted, or its fence passed: ``settle_fenced``), and never
   before it reached ``poll``.
3. Each fetch is reported by ``poll`` once, and by ``poll_lifted`` at most once.
4. A quarantine ends: every quarantined attempt settles at the latest ``fence_s``
   after its fetch's deadline, when no write of it can still land (no prefill rank
   starts one after the deadline, and one started before it ended by then).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from vllm_dcp2d.transfer.messages import RankTable

__all__ = ["Fetch", "FetchError", "FetchLedger", "Answer"]

log = logging.getLogger(__name__)

CORRUPT = "KV checksum mismatch"


class FetchError(RuntimeError):
    def __init__(self, transfer_key: str, cp_rank: int | None, reason: str):
        self.transfer_key, self.cp_rank, self.reason = transfer_key, cp_rank, reason
        where = "" if cp_rank is None else f" from prefill cp rank {cp_rank}"
        super().__init__(f"fetch of {transfer_key!r}{where} failed: {reason}")

    @property
    def timed_out(self) -> bool:
        """The fetch hit its deadline (as opposed to an explicit failure)."""
        return self.reason.startswith("timed out")

    @property
    def corrupt(self) -> bool:
        """Every rank answered ok, but the bytes here are not what it sent (``verify_kv``)."""
        return self.reason.startswith(CORRUPT)


@dataclass(eq=False)
class Fetch:
    """One request's pages for this rank, from every CP rank of one prefill instance."""

    transfer_key: str
    bootstrap: str
    remote_engine_id: str | None  # the prefill engine the caller expects (None: any)
    block_ids: tuple  # int64 arrays: this rank's block table of each KV cache group
    num_tokens: int
    first_page: int
    deadline: float   # monotonic; the fence (``TransferRequest.not_after_ns``) is the same instant
    prefill_wait_s: float
    prompt_digest: str = ""  # messages.prompt_digest of the prompt here
    tag: object = None  # the caller's (``Receiver.start``): what it knows this fetch by
    started: float = field(default_factory=time.monotonic)
    table: RankTable | None = None
    senders: tuple = ()  # the CP ranks asked (those holding this rank's KV heads)
    inflight: dict = field(default_factory=dict)     # cp_rank -> (rank address, attempt_id); FetchLedger
    outcomes: dict = field(default_factory=dict)     # cp_rank -> TransferOutcome
    error: FetchError | None = None
    seconds: float = 0.0
    failing: FetchError | None = None  # failed, waiting for the ranks still in flight to answer the cancel
    peer_fault: bool = False
    settle_by: float = 0.0
    quarantined: dict = field(default_factory=dict)  # cp_rank -> why its writes may still land
    unsettled: dict = field(default_factory=dict)    # quarantined cp_rank -> (rank address, attempt_id), until it settles

    @property
    def blocks(self) -> int:
        """Blocks of its block tables: what its quarantine can keep out of use."""
        return sum(int(t.size) for t in self.block_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and self.table is not None and len(self.outcomes) == len(self.senders) > 0

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outcomes.values())

    @property
    def naive_bytes(self) -> int:
        return sum(o.naive_bytes for o in self.outcomes.values())



@dataclass
class Answer:
    """What ``FetchLedger.answered`` left for the receiver to do about one answer.

    fetch:       the running fetch the answer belongs to, for the receiver to check its
                 content (ok, lengths, checksum); None: nothing more (late, already
                 failing, or decided here).
    cp_rank:     the CP rank ``fetch``'s attempt went to (-1 with no ``fetch``).
    cancels:     ``(rank address, attempt_id)`` to cancel: the answer failed fetch ``key``.
    quarantined: the answer quarantined its attempt (a write timed out): back off the link.
    output:      a fetch ended or a quarantine lifted (``poll``/``poll_lifted`` return it).
    requery:     a bootstrap whose rank table is asked again (a rank may have moved), or "".
    """

    fetch: Fetch | None = None
    cp_rank: int = -1
    cancels: list = field(default_factory=list)
    key: str = ""
    quarantined: bool = False
    output: bool = False
    requery: str = ""


class FetchLedger:
    """What one decode rank's fetches wait for (see the module doc)."""

    def __init__(self):
        self._active: dict[str, Fetch] = {}  # transfer key -> fetch not ended
        self._inflight: dict[tuple[str, int], tuple[Fetch, int]] = {}  # (addr, attempt) -> (fetch, cp rank)
        self._unsettled: dict[tuple[str, int], tuple[Fetch, int]] = {}  # quarantined attempts, same keys
        self._out = threading.Lock()
        self._done: list[Fetch] = []
        self._lifted: list[Fetch] = []

    # ---- fetches ----

    def begin(self, f: Fetch) -> bool:
        """Track ``f``; False if a fetch of the same key is running (the caller ends
        ``f`` untracked)."""
        if f.transfer_key in self._active:
            return False
        self._active[f.transfer_key] = f
        return True

    def is_active(self, f: Fetch) -> bool:
        return self._active.get(f.transfer_key) is f

    def active(self) -> list[Fetch]:
        return list(self._active.values())

    def sent(self, f: Fetch, cp_rank: int, addr: str, attempt: int) -> None:
        """Attempt ``attempt`` of ``f`` went to CP rank ``cp_rank`` at ``addr``."""
        self._inflight[(addr, attempt)] = (f, cp_rank)
        f.inflight[cp_rank] = (addr, attempt)

    def fail(self, f: Fetch, error: FetchError, grace_s: float,
             peer_fault: bool = False) -> tuple[list[tuple[str, int]], bool]:
        """``f`` failed. Returns the ``(addr, attempt)`` still in flight, to cancel, and
        whether ``f`` ended now (none was in flight: ``finish``); else ``f`` ends when each
        answered (``answered``), at the latest ``grace_s`` later."""
        if not f.inflight:
            return [], self.finish(f, error, peer_fault=peer_fault)
        if f.failing is None:
            f.failing, f.peer_fault = error, peer_fault
            f.settle_by = time.monotonic() + grace_s
        return list(f.inflight.values()), False

    def finish(self, f: Fetch, error: FetchError | None, track: bool = True, peer_fault: bool = False) -> bool:
        """End ``f`` (invariant 1: the caller quarantined or heard from every attempt).
        Returns whether it ended now (False: it had ended already); ``poll`` returns it
        from then on."""
        if track:
            if self._active.get(f.transfer_key) is not f:
                return False
            del self._active[f.transfer_key]
        for where in f.inflight.values():
            self._inflight.pop(where, None)
        f.inflight = {}
        f.peer_fault = f.peer_fault or peer_fault
        if f.quarantined and error is None:
            error = FetchError(f.transfer_key, min(f.quarantined), "a write may still land: "
                               + "; ".join(f"cp rank {r}: {w}" for r, w in sorted(f.quarantined.items())))
        f.error, f.seconds = error, time.monotonic() - f.started
        if error is not None:
            log.warning("%s%s", error, f" (blocks quarantined: {f.quarantined})" if f.quarantined else "")
        with self._out:
            self._done.append(f)
            if f.quarantined and not f.unsettled:  # every quarantined attempt settled before the fetch ended
                self._lifted.append(f)
        return True

    # ---- attempts ----

    def answered(self, addr: str, outcome, grace_s: float) -> Answer:
        """``outcome`` (a ``TransferOutcome``: ``attempt_id``, ``cp_rank``, ``settled``)
        came from ``addr``; matched by ``(addr, attempt_id)`` only. Decides and acts:

        * late (no such attempt in flight or quarantined): nothing;
        * naming another CP rank than its attempt went to: not that process's answer, it
          proves nothing: an attempt in flight is quarantined and its fetch fails;
        * to a quarantined attempt: settles it if ``settled``;
        * in flight and not ``settled`` (a write may still land): quarantined;
        * the fetch was failing already: it ends once no attempt is in flight;
        * else the fetch is handed back (``Answer.fetch``) for its content to be checked.
        """
        where = (addr, outcome.attempt_id)
        hit = self._inflight.pop(where, None)
        if hit is None:
            hit = self._unsettled.get(where)
            if hit is None or outcome.cp_rank != hit[1] or not outcome.settled:
                return Answer()  # late, or not from the process it went to
            return Answer(output=self.settle(where, "answered"))
        f, cp_rank = hit
        f.inflight.pop(cp_rank, None)
        if outcome.cp_rank != cp_rank:
            why = f"an answer from {addr} names cp rank {outcome.cp_rank}, the attempt went to cp rank {cp_rank}"
            self.quarantine(f, cp_rank, where, why)
            cancels, ended = self.fail(f, FetchError(f.transfer_key, cp_rank, why), grace_s, peer_fault=True)
            return Answer(cancels=cancels, key=f.transfer_key, output=ended)
        answer = Answer()
        if not outcome.settled:
            why = outcome.reason or "a Mooncake write attempt stalled, then its retry succeeded"  # may still land
            self.quarantine(f, cp_rank, where, f"a write timed out: {why}")
            answer.quarantined = True
        if f.failing is not None:  # any answer means that rank writes nothing more
            if not f.inflight:
                answer.output = self.finish(f, f.failing, peer_fault=f.peer_fault)
                answer.requery = f.bootstrap if f.peer_fault else ""
            return answer
        answer.fetch, answer.cp_rank = f, cp_rank
        return answer

    def on_rank(self, addr: str) -> list[tuple[Fetch, int, int]]:
        """``(fetch, cp_rank, attempt)`` in flight to ``addr``."""
        return [(f, r, a) for (ad, a), (f, r) in self._inflight.items() if ad == addr]

    def quarantine(self, f: Fetch, cp_rank: int, where: tuple[str, int], why: str) -> None:
        """Attempt ``where`` of ``f`` (CP rank ``cp_rank``) may still write into its blocks."""
        self._inflight.pop(where, None)
        f.inflight.pop(cp_rank, None)
        self._unsettled[where] = (f, cp_rank)
        f.unsettled[cp_rank] = where
        f.quarantined[cp_rank] = why

    def unsettled_on(self, addr: str) -> list[tuple[int, Fetch]]:
        """``(attempt, fetch)`` quarantined on ``addr`` (their cancels are re-sent)."""
        return [(a, f) for (ad, a), (f, _) in self._unsettled.items() if ad == addr]

    def settle(self, where: tuple[str, int], how: str) -> bool:
        """Quarantined attempt ``where`` can no longer write (invariant 2). Returns whether
        that lifted its fetch's quarantine (``poll_lifted`` returns the fetch from then on)."""
        hit = self._unsettled.pop(where, None)
        if hit is None:
            return False
        f, cp_rank = hit
        f.unsettled.pop(cp_rank, None)
        log.info("fetch of %r: quarantined cp rank %d settled (%s)", f.transfer_key, cp_rank, how)
        if not f.unsettled and self._active.get(f.transfer_key) is not f:
            with self._out:
                self._lifted.append(f)
            return True
        return False

    def settle_rank(self, addr: str, bootstrap: str, how: str) -> bool:
        """Every attempt quarantined on ``addr`` for a prefill at ``bootstrap`` settled
        (that rank's old process is gone). Returns whether a quarantine lifted."""
        lifted = False
        for attempt, f in self.unsettled_on(addr):
            if f.bootstrap == bootstrap:
                lifted = self.settle((addr, attempt), how) or lifted
        return lifted

    def settle_fenced(self, now: float, fence_s: float) -> bool:
        """Settle every quarantined attempt whose fetch's deadline is ``fence_s`` past
        (invariant 4). Returns whether a quarantine lifted."""
        lifted = False
        for where, (f, _) in list(self._unsettled.items()):
            if f.deadline + fence_s <= now:
                lifted = self.settle(where, f"its fence passed ({fence_s:.0f}s after the fetch's deadline)") or lifted
        return lifted

    def quarantined_blocks(self, bootstrap: str | None = None) -> int:
        """Blocks kept quarantined by attempts of fetches from ``bootstrap`` (None: any; each
        fetch once)."""
        fetches = {id(f): f for f, _ in self._unsettled.values() if bootstrap in (None, f.bootstrap)}
        return sum(f.blocks for f in fetches.values())

    def busy(self, addr: str) -> bool:
        """Whether anything is in flight or quarantined on ``addr``."""
        return any(ad == addr for ad, _ in self._inflight) or any(ad == addr for ad, _ in self._unsettled)

    # ---- outputs (any thread) ----

    def poll(self) -> list[Fetch]:
        with self._out:
            out, self._done = self._done, []
        return out

    def poll_lifted(self) -> list[Fetch]:
        with self._out:
            out, self._lifted = self._lifted, []
        return out

    def fail_all(self, reason: str) -> bool:
        """The receiver is closing or its thread died: every fetch ends failed, what
        is still in flight quarantined (nobody will hear its answer). Returns whether
        any ended."""
        ended = False
        for f in self.active():
            for cp_rank, where in list(f.inflight.items()):
                self.quarantine(f, cp_rank, where, reason)
            ended = self.finish(f, FetchError(f.transfer_key, None, reason)) or ended
        return ended
