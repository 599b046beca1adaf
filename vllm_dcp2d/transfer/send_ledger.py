"""The prefill side's block lifetime, in one object: ``SendLedger`` (docs/connector.md,
"Block lifetime").

A ``Sender`` (one per prefill CP rank) moves bytes; its ledger decides when.
Every decision that can free a block or answer a decode rank is made here,
under the ledger's one lock, and no other object holds that state. Over ~400
lines on purpose: the invariants below hold across all of it, under that one lock.

Records
-------
``Attempt``: one decode rank's ``TransferRequest`` to this CP rank, from arrival
to its one answer (keyed by the decode's socket identity and ``attempt_id``).
``Held``: a request whose KV is complete on this rank (``add``), until it is
freed.

Invariants (each tested directly in ``tests/transfer/test_send_ledger.py``)
------------------------------------------------------------------
1. ``pop_finished`` reports a request (its owner then frees the blocks) only once
   no write reading them is in flight, and none can start after that.
2. An attempt gets exactly one answer, queued only once none of its writes is
   in flight and none can start.
3. A layer written before the request was added (layer pipelining) counts only
   if the request was not preempted since (``restart``): a write of the old
   blocks never marks a layer as sent, so the answer rewrites it from the new ones.
4. An answer is ``settled=False`` once a write of the attempt was given up after
   a stall (its bytes may still land); cancels of it are answered unsettled
   until ``STALL_S`` after the answer.
5. Releases free a request only once some consumer engine is *covered* (each of
   its ``consumer_size`` ranks served or released) and no attempt of another
   engine is open; a release naming another token count or prompt digest is
   ignored (a reused key, or a peer that does not know the prompt), and does not
   claim the request either.
7. No write reads a request's blocks for an attempt whose prompt (token count and
   ``prompt_digest``) is not the request's: a reused key or a prompt tokenized
   otherwise fails before any byte moves, and does not claim the request. Without an
   authenticated peer (``reveal`` False) such an attempt is treated exactly as one for
   an unknown key: the same answer, at the same time (it waits as one would), so
   neither the request's length nor its existence is told.
8. What sources hold is bounded per source (the decode's address, or its engine id
   when sealed: ``quota.py``) and in all: open attempts (waiting or being served, not
   answered), at most ``MAX_OPEN_PER_SOURCE`` per source and ``MAX_OPEN`` in all, and
   their encoded bytes with the releases remembered for requests not added yet, at most
   ``MAX_SOURCE_BYTES`` per source and ``MAX_OPEN_BYTES`` in all; the last eighth of
   each is kept for sources that hold little. Past that an attempt is refused at
   arrival and a release is dropped.
6. A request no decode rank has asked for (no attempt, no release) within
   ``claim_timeout_s`` of its ``add`` is freed then ("unclaimed"), like an expiry: no write
   can read its blocks, since none was ever asked for; the first attempt or counted
   release gives it the full ``send_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm_dcp2d.transfer.messages import ReleaseTransfer, TransferRequest
from vllm_dcp2d.transfer.quota import Quota
from vllm_dcp2d.transfer.transport import STALL_S

__all__ = ["Attempt", "Held", "Answer", "SendLedger", "RELEASE_MEMORY_S", "MAX_EARLY_RELEASES"]

log = logging.getLogger(__name__)

RELEASE_MEMORY_S = 30.0  # how long a release for a request not added yet (or just finished) is remembered
MAX_EARLY_RELEASES = 4096  # releases remembered for requests not added yet, in all (invariant 8)
MAX_EARLY_PER_SOURCE = 512  # ... from one source
MAX_OPEN_PER_SOURCE = 1024  # attempts open at once from one source: its hosts' decode ranks (invariant 8)
MAX_OPEN = 4096             # ... from all of them
MAX_SOURCE_BYTES = 64 << 20  # encoded bytes of one source's open attempts and remembered releases
MAX_OPEN_BYTES = 256 << 20   # ... of all sources


@dataclass(eq=False)
class Attempt:
    """One decode rank's ``TransferRequest``. ``lock`` serializes its writes (held by
    the writer for the whole write); the fields below it belong to the ledger."""

    identity: bytes
    req: TransferRequest
    deadline: float  # when waiting for the request's prefill ends
    size: int = 0    # bytes of its encoded request (what it holds while open)
    waited_s: float = float("inf")  # how long it may wait: its wait_s, cut to the rank's limit
    source: str = ""  # whose quota it counts against (``quota.py``)
    session: str = ""  # the Mooncake session its writes go to (its connection's registration)
    memory: object = None  # ``Memory`` the connection registered: no write lands outside it
    not_after_ns: int = 0  # the fence: no write of it starts after this (wall clock, ns)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: set = field(default_factory=set)  # layers written (of the current epoch)
    epoch: int = 0       # bumped by a preemption: writes of an older epoch count for nothing
    nbytes: int = 0
    replicated_bytes: int = 0  # the part of nbytes written to the consumer's replicated groups
    descriptors: int = 0
    batches: int = 0     # Mooncake write calls' batches (staging writes a path in chunks)
    plan_s: float = 0.0
    write_s: float = 0.0
    error: str = ""      # a layer written early failed: the destination is undefined
    writes: int = 0      # writes of this attempt in flight
    closed: str = ""     # why no write may start any more ("" = open)
    result: tuple | None = None  # (request, error) of its final write: the answer once no write runs
    answered: bool = False
    settled: bool = True  # False once a write stalled, retried or not (bytes may still land)
    checksum: str = ""    # of what was written, when the consumer asked (``TransferRequest.verify``)

    @property
    def key(self) -> tuple[bytes, int]:
        return self.identity, self.req.attempt_id


@dataclass(eq=False)
class Held:
    """A request this rank holds (``add``, the glossary's "hold"): its blocks and who finished
    with them."""

    block_ids: tuple  # int64 arrays, one per KV cache group of this rank
    num_tokens: int
    num_pages: int
    expires: float      # when it is freed unless finished first
    expires_if_claimed: float | None = None  # set while no decode rank asked for it (invariant 6)
    done: dict = field(default_factory=dict)  # engine_id -> set of consumer ranks served
    released: dict = field(default_factory=dict)  # engine_id -> set of consumer ranks that will not fetch
    sizes: dict = field(default_factory=dict)  # engine_id -> its consumer_size
    writes: int = 0     # writes reading block_ids in flight
    closing: str = ""   # "done" | "released" | "expired" | "unclaimed": reported by pop_finished once writes == 0
    prompt_digest: str = ""  # messages.prompt_digest of its prompt ("" unknown: only "" matches)

    def claim(self) -> None:
        """A decode rank asked for it (an attempt or a release): the full expiry applies."""
        if self.expires_if_claimed is not None:
            self.expires, self.expires_if_claimed = self.expires_if_claimed, None


class Answer(NamedTuple):
    """An attempt's one answer: ok if ``request`` (what its final write read) is set and
    ``error`` is "", else failed with ``error``."""

    attempt: Attempt
    held: Held | None
    error: str

    @property
    def ok(self) -> bool:
        return self.held is not None and not self.error


class SendLedger:
    """Block lifetime of one prefill CP rank (see the module doc for the invariants).

    Each attempt's one answer is decided here and queued; the owner takes them
    (``take_answers``), builds each ``TransferOutcome`` and sends it.

    name:   how log lines name this rank ("cp rank 1").
    reveal: whether answers may name the request's own prompt length (peers are
            authenticated); it is always logged here.
    """

    def __init__(self, name: str, reveal: bool = False):
        self.name, self.reveal = name, reveal
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._waiting: dict[str, list[Attempt]] = {}  # key -> attempts waiting for add()
        self._open: dict[tuple, Attempt] = {}  # attempt key -> attempt not answered yet
        self._finished: dict[str, str] = {}
        self._aborting: dict[str, list[Attempt]] = {}  # key -> its attempts with a layer write in flight
        self._unsettled: dict[tuple, float] = {}  # attempt key -> until when cancels are answered unsettled
        # key not added yet -> (until, [(release, source, bytes)]), oldest first
        self._early: dict[str, tuple[float, list[tuple[ReleaseTransfer, str, int]]]] = {}
        self._gone: dict[str, float] = {}  # key -> until when releases for it are ignored (just finished)
        self._releasing: set[str] = set()  # covered keys waiting for another engine's open attempts
        # Invariant 8: open attempts and their bytes, and the bytes of remembered releases
        # (items=0: they have a count of their own, ``_early_quota``).
        self._quota = Quota("open transfer requests", MAX_OPEN_PER_SOURCE, MAX_OPEN, MAX_SOURCE_BYTES, MAX_OPEN_BYTES)
        self._early_quota = Quota("remembered releases", MAX_EARLY_PER_SOURCE, MAX_EARLY_RELEASES, 1, 1)
        self._answers: list[Answer] = []  # decided, not taken by the owner yet

    # ---- requests: the owner's side ----

    def add(self, key: str, block_ids: tuple, num_tokens: int, num_pages: int, send_timeout_s: float,
            claim_timeout_s: float = float("inf"), prompt_digest: str = "") -> list[Attempt]:
        """The KV of ``key`` is complete in ``block_ids``; returns the attempts that
        waited for it (the caller serves them). Freed after ``send_timeout_s``, or after
        ``claim_timeout_s`` if no decode rank asks for it by then (invariant 6)."""
        with self._lock:
            now = time.monotonic()
            held = self._held[key] = Held(block_ids, num_tokens, num_pages,
                                          now + min(send_timeout_s, claim_timeout_s),
                                          now + send_timeout_s if claim_timeout_s < send_timeout_s else None,
                                          prompt_digest=prompt_digest)
            waiting, other = [], []
            for a in self._waiting.pop(key, []):
                (waiting if self._matches(a.req, held) else other).append(a)
            for a in other:  # another prompt under this key (invariant 7)
                if self.reveal:
                    self._close(a, self._mismatch(key, a.req, held))
                else:  # as if the key were unknown: it waits out its deadline
                    self._waiting.setdefault(key, []).append(a)
            self._gone.pop(key, None)
            early = self._pop_early(key)
            if waiting:
                held.claim()
            for msg in early:  # the decode dropped it before we had it
                self._count_release(held, key, msg)
            return waiting

    def abort(self, key: str, report: bool = True) -> None:
        """``key`` will never be added: its waiting attempts fail. ``report``: the
        owner keeps its blocks, so ``pop_finished`` reports it "aborted" once no layer
        write reading them is in flight (False: the owner kept none)."""
        with self._lock:
            waiting = self._waiting.pop(key, [])
            for a in waiting:
                self._close(a, f"request {key!r} was aborted on the prefill ({self.name})")
            if not report:
                return
            if any(a.writes for a in waiting):
                self._aborting[key] = waiting
            else:
                self._finished[key] = "aborted"

    def restart(self, key: str) -> int:
        """vLLM preempted ``key`` after its prompt completed and freed its blocks: the
        layers written so far (or being written) read blocks that may now hold
        another request's KV. Every waiting attempt starts over (invariant 3): its
        layers are written again after the re-prefill, each write ordered after the
        old one by the attempt's lock. Returns how many attempts restarted."""
        with self._lock:
            waiting = self._waiting.get(key, [])
            for a in waiting:
                a.epoch += 1
                a.sent.clear()
                a.error = ""
            return len(waiting)

    def waiting(self, key: str) -> list[tuple[Attempt, int]]:
        """Attempts waiting for ``key``, each with its epoch (a layer write queued now
        carries it)."""
        with self._lock:
            return [(a, a.epoch) for a in self._waiting.get(key, ())]

    def pop_finished(self) -> dict[str, str]:
        """Keys the owner may free now: "done" | "released" | "expired" | "unclaimed" | "aborted"."""
        with self._lock:
            out, self._finished = self._finished, {}
            return out

    def take_answers(self) -> list[Answer]:
        """The answers decided since the last call, each attempt's once (invariant 2),
        in the order decided: the owner sends them."""
        with self._lock:
            out, self._answers = self._answers, []
            return out

    def has_answers(self) -> bool:
        return bool(self._answers)  # a hint for waking the owner's I/O thread: take_answers decides

    def busy_reason(self, a: Attempt) -> str:
        """Why ``arrive`` refused ``a`` ("busy")."""
        with self._lock:
            if a.key in self._open:
                return f"{self.name} refuses the transfer request: its attempt id is already open"
            return f"{self.name} refuses the transfer request: {self._quota.refuses(a.source, a.size)}"

    def unknown_reason(self, key: str) -> str:
        """The one answer to an attempt this rank will not serve at once: its key is
        unknown, finished, or names another prompt (invariant 7: the same words for each)."""
        return (f"no request {key!r} for this prompt on {self.name} (not added yet, finished, expired, or "
                f"another prompt)")

    # ---- attempts: the decode's side ----

    def arrive(self, a: Attempt) -> str:
        """A ``TransferRequest`` came in: "serve" (its request is added, for its prompt),
        "wait" (it waits for the prefill), "unknown" (another prompt, unless ``reveal``:
        then "mismatch"; or not added and not waiting) or "busy" (the caller answers it
        failed; ``unknown_reason``, ``busy_reason`` and ``mismatch_reason`` say why)."""
        with self._lock:
            if a.key in self._open or self._quota.refuses(a.source, a.size):
                return "busy"
            key = a.req.transfer_key
            held = self._held.get(key)
            match = held is not None and self._matches(a.req, held)
            if held is not None and not match and self.reveal:
                return "mismatch"
            if not match and a.req.wait_s <= 0:
                return "unknown"
            self._open[a.key] = a
            self._quota.take(a.source, a.size)
            if match:
                held.claim()  # only a request for its prompt claims it (invariant 7)
                return "serve"
            self._waiting.setdefault(key, []).append(a)  # not added yet, or (unrevealed) another prompt
            return "wait"

    def mismatch_reason(self, a: Attempt) -> str:
        """Why ``arrive`` refused ``a`` ("mismatch": another prompt, told only to authenticated peers)."""
        with self._lock:
            held = self._held.get(a.req.transfer_key)
            return self.unknown_reason(a.req.transfer_key) if held is None else self._mismatch(
                a.req.transfer_key, a.req, held)

    def cancel(self, identity: bytes, attempt_id: int, why: str) -> tuple[bool, bool]:
        """The consumer gave up on an attempt: no write of it starts any more, and it is
        answered once none is in flight. Returns ``(known, settled)``: an attempt the
        ledger does not know is the caller's to answer, ``settled`` as given."""
        with self._lock:
            a = self._open.get((identity, attempt_id))
            if a is not None:
                items = self._waiting.get(a.req.transfer_key, [])
                if a in items:
                    items.remove(a)
                self._close(a, why)
                return True, True
            return False, self._unsettled.get((identity, attempt_id), 0.0) <= time.monotonic()

    # ---- writes: the workers' side ----

    def begin_layer(self, a: Attempt, layer: int, num_tokens: int, epoch: int,
                    prompt_digest: str = "") -> tuple[Held | None] | None:
        """Count an early write of ``layer`` for ``a`` if it is still wanted; returns
        ``(request or None,)`` to pass to ``end_layer``, or None (skip it)."""
        with self._lock:
            held = self._held.get(a.req.transfer_key)
            # Once added, a request's blocks stay with vLLM only while a write is counted
            # on it too: expiry or a release must not free blocks this write reads.
            if (epoch != a.epoch or layer in a.sent or a.error or a.req.num_tokens != num_tokens
                    or a.req.prompt_digest != prompt_digest or not self._begin(a, held)):
                return None
            return (held,)

    def end_layer(self, a: Attempt, token: tuple[Held | None], layer: int, epoch: int, error: str) -> None:
        """An early write counted by ``begin_layer`` returned (``error``: "" if ok)."""
        with self._lock:
            if epoch == a.epoch:  # else preempted meanwhile: it read freed blocks, and counts for nothing
                if error:
                    a.error = f"layer {layer} (written early): {error}"
                else:
                    a.sent.add(layer)
            self._end(a, token[0], a.req.transfer_key)

    def begin_answer(self, a: Attempt) -> tuple[Held, str, frozenset] | None:
        """Count the final write of ``a`` (what it still lacks); returns ``(request,
        error so far, layers already sent)``, or None when it was answered instead
        (its request is gone, the token counts differ, or it was closed)."""
        key = a.req.transfer_key
        with self._lock:
            held = self._held.get(key)
            if held is None:
                self._close(a, f"request {key!r} finished or expired on {self.name}")
                return None
            if not self._matches(a.req, held):  # the key was added again, for another prompt
                self._close(a, self._mismatch(key, a.req, held))
                return None
            if not self._begin(a, held):
                return None
            return held, a.error, frozenset(a.sent)

    @staticmethod
    def _matches(req: TransferRequest, held: Held) -> bool:
        return (req.num_tokens, req.prompt_digest) == (held.num_tokens, held.prompt_digest)

    def _mismatch(self, key: str, req: TransferRequest, held: Held) -> str:
        """Another prompt under ``key``: logged here in full; told to the peer only if
        authenticated (``reveal``), else the unknown key's words (invariant 7)."""
        what = "length" if req.num_tokens != held.num_tokens else "prompt"
        log.warning("%s: %s mismatch for %r: the decode asks for %d prompt tokens (digest %s), the prefill holds %d "
                    "(digest %s)", self.name, what, key[:80], req.num_tokens, req.prompt_digest[:12] or "none",
                    held.num_tokens, held.prompt_digest[:12] or "none")
        if not self.reveal:
            return self.unknown_reason(key)
        return (f"{what} mismatch on {self.name}: the decode asks for {req.num_tokens} prompt tokens"
                + (f" with prompt digest {req.prompt_digest[:12] or 'none'}" if what == "prompt" else "")
                + f", the prefill has {held.num_tokens}")

    def end_answer(self, a: Attempt, held: Held, error: str) -> None:
        """The final write of ``a`` returned: answer it (ok counts its consumer rank
        served), then maybe close the request."""
        key, req = a.req.transfer_key, a.req
        with self._lock:
            if not a.closed:
                a.closed, a.result = "answered", (held, error)
                if not error:
                    held.done.setdefault(req.engine_id, set()).add(req.consumer_rank)
                    held.sizes[req.engine_id] = req.consumer_size
            if not held.closing:
                self._try_close(key, held)
            self._end(a, held, key)  # answers it, unless another write of it is still in flight

    def mark_unsettled(self, a: Attempt) -> None:
        """A write of ``a`` was given up after a stall: its bytes may still land."""
        with self._lock:
            a.settled = False

    # ---- releases and expiry ----

    def release(self, msg: ReleaseTransfer, source: str = "", size: int = 0) -> None:
        """A decode rank will never fetch ``msg.transfer_key``. ``source`` and ``size``: who
        sent it and its encoded bytes, which a release for a request not added yet holds
        while it is remembered (invariant 8; past its source's share it is dropped)."""
        key = msg.transfer_key
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                return self._count_release(held, key, msg)
            if key in self._gone:
                log.debug("%s: release of %r ignored: already finished", self.name, key)
                return
            why = self._early_quota.refuses(source) or self._quota.refuses(source, size, items=0)
            if why:
                log.debug("%s: release of unknown %r dropped: %s", self.name, key[:80], why)
                return
            self._early_quota.take(source)
            self._quota.take(source, size, items=0)
            log.debug("%s: release of unknown %r remembered for %.0fs", self.name, key, RELEASE_MEMORY_S)
            _, msgs = self._early.pop(key, (0.0, []))
            self._early[key] = (time.monotonic() + RELEASE_MEMORY_S, [*msgs, (msg, source, size)])

    def expire(self, now: float) -> None:
        """Called on every poll: requests past their expiry, attempts waiting too long."""
        with self._lock:
            for table in (self._unsettled, self._gone):
                for k in [k for k, t in table.items() if t <= now]:
                    del table[k]
            for k in [k for k, (until, _) in self._early.items() if until <= now]:
                self._pop_early(k)
            for key in list(self._releasing):
                held = self._held.get(key)
                if held is None:
                    self._releasing.discard(key)
                else:
                    self._try_close(key, held)
            for key in [k for k, v in self._held.items() if v.expires <= now]:
                held = self._held.pop(key)
                self._releasing.discard(key)
                self._gone[key] = now + RELEASE_MEMORY_S
                held.closing = "expired" if held.expires_if_claimed is None else "unclaimed"
                if held.writes == 0:
                    self._finished[key] = held.closing
            for key, items in list(self._waiting.items()):
                for a in [a for a in items if a.deadline <= now]:
                    items.remove(a)
                    self._close(a, f"request {key!r} not ready on {self.name} after waiting "
                                   f"{min(a.req.wait_s, a.waited_s):.1f}s")
                if not items:
                    del self._waiting[key]

    # ---- internals, all under _lock ----

    def _close(self, a: Attempt, why: str) -> None:
        """No write of ``a`` may start any more. Answers it now if none is in flight,
        else the last one's ``_end`` does (invariant 2)."""
        if a.closed:
            return
        a.closed = why
        if a.writes == 0:
            self._answer(a)

    def _answer(self, a: Attempt) -> None:
        """The one answer of closed attempt ``a``, none of whose writes is in flight."""
        if a.answered:
            return
        a.answered = True
        if self._open.pop(a.key, None) is a:  # known until answered
            self._quota.give(a.source, a.size)
        if not a.settled:
            self._unsettled[a.key] = time.monotonic() + STALL_S
        held, error = a.result if a.result is not None else (None, a.closed)
        self._answers.append(Answer(a, held, error))

    def _pop_early(self, key: str) -> list[ReleaseTransfer]:
        """Forget the releases remembered for ``key``, giving back what they held."""
        out = []
        for msg, source, size in self._early.pop(key, (0.0, []))[1]:
            self._early_quota.give(source)
            self._quota.give(source, size, items=0)
            out.append(msg)
        return out

    def _begin(self, a: Attempt, held: Held | None) -> bool:
        if a.closed or (held is not None and held.closing):
            return False
        a.writes += 1
        if held is not None:
            held.writes += 1
        return True

    def _end(self, a: Attempt, held: Held | None, key: str) -> None:
        a.writes -= 1
        if a.closed and a.writes == 0 and not a.answered:
            self._answer(a)
        aborting = self._aborting.get(key)
        if aborting is not None and not any(x.writes for x in aborting):
            del self._aborting[key]
            self._finished[key] = "aborted"
        if held is not None:
            held.writes -= 1
            if held.closing and held.writes == 0:
                self._finished[key] = held.closing

    def _count_release(self, held: Held, key: str, msg: ReleaseTransfer) -> None:
        if (msg.num_tokens, msg.prompt_digest) != (held.num_tokens, held.prompt_digest):
            # nor does it claim: claim_timeout_s still frees the request
            log.debug("%s: release of %r for %d tokens ignored: the request has %d, or another prompt "
                      "(key reused?)", self.name, key[:80], msg.num_tokens, held.num_tokens)
            return
        held.claim()
        held.released.setdefault(msg.engine_id, set()).add(msg.consumer_rank)
        held.sizes[msg.engine_id] = msg.consumer_size
        self._try_close(key, held)

    def _try_close(self, key: str, held: Held) -> None:
        """Stop serving ``held`` once some consumer engine is covered and no other
        engine has an attempt open (invariant 5); reported once no write reads it."""
        if self._held.get(key) is not held:
            return
        engines = held.done.keys() | held.released.keys()
        covered = {e for e in engines
                   if len(held.done.get(e, set()) | held.released.get(e, set())) >= held.sizes[e]}
        if not covered:
            return
        if any(a.req.transfer_key == key and a.req.engine_id not in covered for a in self._open.values()):
            self._releasing.add(key)  # another decode group is fetching it: it keeps the blocks
            return
        self._releasing.discard(key)
        del self._held[key]
        served = any(len(held.done.get(e, ())) >= held.sizes[e] for e in covered)
        held.closing = "done" if served else "released"
        self._gone[key] = time.monotonic() + RELEASE_MEMORY_S
        if held.writes == 0:
            self._finished[key] = held.closing
