"""Block lifetime on the prefill side: what a ``Sender`` knows about its requests
and fetches, and when it answers and frees them (docs/connector.md, "Block lifetime").

``sender.py`` holds the ``Sender`` (owner API, I/O loop, plan + write workers);
this module holds its state records (``Held``: one fetch; ``Request``: one added
request) and ``SenderLifetime``, the bookkeeping half of the class: exactly one
answer per fetch, write counting, releases and consumer coverage, expiry.

Releases: a request is freed by releases only once some consumer engine is
*covered* (each of its ``consumer_size`` ranks served or released) and no fetch
of another engine is open (held or being written): a decode group with another
DCP size that is fetching the same request keeps it. A release is idempotent;
one for a request this rank does not hold is remembered for ``RELEASE_MEMORY_S``
(the decode may drop a request before ``add_request`` ran here) unless the key
finished recently, and ignored if the decode's ``num_tokens`` differs from the
request's (a reused key).

Safety: every write is counted while it runs, per request and per fetch.
  * ``pop_finished`` reports a request (its owner then frees the blocks) only
    once no write reading them is in flight and none can start.
  * A fetch gets exactly one answer, sent only once none of its writes is in
    flight and none can start. A ``CancelTransfer`` is handled on the I/O
    thread, so it overtakes queued work; if a write is in flight, the thread
    that ends it sends the answer.
  * ``TransferOutcome.settled`` is False when an attempt of one of its writes was
    given up after a stall (``STALL_S`` without progress), whether the write then
    failed or a retry on a fresh engine succeeded: Mooncake may still send the
    given-up attempt's queued bytes, so the decode keeps those blocks out of use
    (an ok answer included) and asks again; cancels are answered ``settled=True``
    ``STALL_S`` after the answer.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from vllm_dcp2d.connector.messages import ReleaseTransfer, TransferOutcome, TransferRequest
from vllm_dcp2d.connector.transport import STALL_S

__all__ = ["Held", "Request", "SenderLifetime", "RELEASE_MEMORY_S", "MAX_EARLY_RELEASES"]

log = logging.getLogger(__name__)

RELEASE_MEMORY_S = 30.0  # how long a release for a request not added yet (or just finished) is remembered
MAX_EARLY_RELEASES = 4096  # releases remembered for requests not added yet (oldest dropped)


@dataclass(eq=False)
class Held:
    """One decode rank's fetch (a TransferRequest) from arrival to its one answer.

    Fields below ``lock`` are guarded by ``Sender._lock``.
    """

    identity: bytes
    req: TransferRequest
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # one write of this fetch at a time
    sent: set = field(default_factory=set)  # layers written
    nbytes: int = 0
    replicated_bytes: int = 0  # the part of nbytes written to the consumer's replicated groups
    descriptors: int = 0
    plan_s: float = 0.0
    write_s: float = 0.0
    error: str = ""      # a layer written early failed: the destination is undefined
    writes: int = 0      # writes of this fetch in flight
    closed: str = ""     # why no write may start any more ("" = open)
    answered: bool = False
    settled: bool = True  # False once an attempt stalled, retried or not (bytes may still land)


@dataclass(eq=False)
class Request:
    """A request added on this rank (``Sender.add_request``): its blocks and who
    finished with them. Guarded by ``Sender._lock``."""

    block_ids: tuple  # int64 arrays, one per KV cache group of this rank
    num_tokens: int
    num_pages: int
    expires: float
    done: dict = field(default_factory=dict)  # engine_id -> set of consumer ranks served
    released: dict = field(default_factory=dict)  # engine_id -> set of consumer ranks that will not fetch
    sizes: dict = field(default_factory=dict)  # engine_id -> its consumer_size
    writes: int = 0     # writes reading block_ids in flight
    closing: str = ""   # "done" | "released" | "expired": reported by pop_finished once writes == 0


class SenderLifetime:
    """The bookkeeping methods of ``Sender`` (a mixin: they use its state).

    Uses ``_lock`` and the state it guards (``_requests``, ``_pending``,
    ``_fetches``, ``_finished``, ``_aborting``, ``_unsettled``, ``_early``,
    ``_gone``, ``_releasing``, ``_writes``), ``_out`` / ``_waker`` (answers for
    the I/O thread), ``_failed`` (a failed outcome) and ``cp_rank``; all set by
    ``Sender.__init__``. Methods marked "under ``_lock``" expect it held.
    """

    # ---- answers: exactly one per fetch, only once none of its writes can run ----

    def _close(self, h: Held, why: str) -> None:
        """Under ``_lock``: no write of ``h`` may start any more. Answers ``h``
        with ``why`` now if none is in flight, else the last one's ``_end`` does."""
        if h.closed:
            return
        h.closed = why
        if h.writes == 0:
            self._reply(h, self._failed(h.req, why, settled=h.settled))

    def _unsettled_until(self, h: Held) -> None:
        """Under ``_lock``: ``h`` failed after a write timed out. Mooncake drops a
        connection that made no progress for its progress timeout (``STALL_S``), so
        until then re-sent cancels are answered ``settled=False``."""
        self._unsettled[(h.identity, h.req.attempt_id)] = time.monotonic() + STALL_S

    def _reply(self, h: Held, outcome: TransferOutcome) -> None:
        """Under ``_lock``: queue ``h``'s one answer for the I/O thread."""
        if not h.answered:
            h.answered = True
            self._fetches.pop((h.identity, h.req.attempt_id), None)  # known until answered
            if not outcome.settled:
                self._unsettled_until(h)
            self._out.put((h.identity, outcome))

    def _flush(self) -> None:
        if not self._out.empty():
            self._waker.wake()

    def _begin(self, h: Held, state: Request | None = None) -> bool:
        """Under ``_lock``: count a write of ``h`` (reading ``state``'s blocks) if one may start."""
        if h.closed or (state is not None and state.closing):
            return False
        h.writes += 1
        self._writes += 1
        if state is not None:
            state.writes += 1
        return True

    def _end(self, h: Held, state: Request | None, key: str) -> None:
        """Under ``_lock``: a write counted by ``_begin`` returned."""
        h.writes -= 1
        self._writes -= 1
        if h.closed and h.writes == 0 and not h.answered:
            self._reply(h, self._failed(h.req, h.closed, settled=h.settled))
        held = self._aborting.get(key)
        if held is not None and not any(x.writes for x in held):
            del self._aborting[key]
            self._finished[key] = "aborted"
        if state is not None:
            state.writes -= 1
            if state.closing and state.writes == 0:
                self._finished[key] = state.closing

    # ---- releases: a consumer rank will never fetch a request ----

    def _release(self, state: Request, key: str, msg: ReleaseTransfer) -> None:
        """Under ``_lock``: count ``msg`` for ``state`` (the request of ``key``)."""
        if msg.num_tokens != state.num_tokens:
            log.debug("cp rank %d: release of %r for %d tokens ignored: the request has %d (key reused?)",
                      self.cp_rank, key, msg.num_tokens, state.num_tokens)
            return
        state.released.setdefault(msg.engine_id, set()).add(msg.consumer_rank)
        state.sizes[msg.engine_id] = msg.consumer_size
        self._try_close(key, state)

    def _try_close(self, key: str, state: Request) -> None:
        """Under ``_lock``: stop serving ``state`` once some consumer engine is covered
        (each of its ranks served or released) and no other engine has a fetch of it
        open; it is reported finished once no write reads its blocks."""
        if self._requests.get(key) is not state:
            return
        engines = state.done.keys() | state.released.keys()
        covered = {e for e in engines
                   if len(state.done.get(e, set()) | state.released.get(e, set())) >= state.sizes[e]}
        if not covered:
            return
        if any(h.req.transfer_key == key and h.req.engine_id not in covered for h in self._fetches.values()):
            self._releasing.add(key)  # another decode group is fetching it: it keeps the blocks
            return
        self._releasing.discard(key)
        del self._requests[key]
        served = any(len(state.done.get(e, ())) >= state.sizes[e] for e in covered)
        state.closing = "done" if served else "released"
        self._gone[key] = time.monotonic() + RELEASE_MEMORY_S
        if state.writes == 0:
            self._finished[key] = state.closing

    def _on_release(self, msg: ReleaseTransfer) -> None:
        """I/O thread: a decode rank will never fetch ``msg.transfer_key``."""
        key = msg.transfer_key
        with self._lock:
            state = self._requests.get(key)
            if state is not None:
                return self._release(state, key, msg)
            if key in self._gone:
                log.debug("cp rank %d: release of %r ignored: already finished", self.cp_rank, key)
                return
            log.debug("cp rank %d: release of unknown %r remembered for %.0fs", self.cp_rank, key,
                      RELEASE_MEMORY_S)
            _, msgs = self._early.pop(key, (0.0, []))
            self._early[key] = (time.monotonic() + RELEASE_MEMORY_S, [*msgs[-255:], msg])
            while len(self._early) > MAX_EARLY_RELEASES:
                del self._early[next(iter(self._early))]

    # ---- expiry (called by the I/O thread on every poll) ----

    def _expire(self):
        now = time.monotonic()
        with self._lock:
            for k in [k for k, t in self._unsettled.items() if t <= now]:
                del self._unsettled[k]
            for k in [k for k, until in self._gone.items() if until <= now]:
                del self._gone[k]
            for k in [k for k, (until, _) in self._early.items() if until <= now]:
                del self._early[k]
            for key in list(self._releasing):
                state = self._requests.get(key)
                if state is None:
                    self._releasing.discard(key)
                else:
                    self._try_close(key, state)
            for key in [k for k, v in self._requests.items() if v.expires <= now]:
                state = self._requests.pop(key)
                self._releasing.discard(key)
                self._gone[key] = now + RELEASE_MEMORY_S
                state.closing = "expired"
                if state.writes == 0:
                    self._finished[key] = "expired"
            for key, items in list(self._pending.items()):
                late = [h for h in items if h.deadline <= now]
                for h in late:
                    items.remove(h)
                    self._close(h, f"request {key!r} not ready on cp rank {self.cp_rank} after waiting "
                                   f"{h.req.wait_s:.1f}s")
                if not items:
                    del self._pending[key]
