"""Block lifetime on the decode side: how a ``Receiver``'s fetch ends, and when
its blocks may be used again (docs/connector.md, "Block lifetime").

``receiver.py`` holds the ``Receiver`` (public API, the socket loop, dispatch,
reading answers); ``fetch.py`` the state of one fetch and one CP rank's side
channel; this module ``ReceiverLifetime``, the ending half of the class.

A CP rank's answer means none of its writes can still land. A failing fetch
sends ``CancelTransfer`` to the ranks still in flight and waits up to
``cancel_grace_s`` for their answers. Ranks that have not answered by then, or
answered ``settled=False`` (a write timed out), are listed in
``Fetch.quarantined``: the fetch ends, but its blocks must stay out of use
until ``poll_released()`` returns it. That happens when each such rank answers
a cancel (re-sent with ``bootstrap.Backoff``), or when the prefill instance's
new rank table no longer lists the rank's address while its link is down (the
rank restarted, so its old process is gone). A dropped ZMQ link alone proves
nothing (Mooncake writes do not use it); the link reconnects with the same
routing id and the answers arrive. After a timed-out write the rank's Mooncake
engine is renewed (``_renew_target``).
"""

from __future__ import annotations

import logging
import time

from vllm_dcp2d.connector.fetch import Fetch, FetchError
from vllm_dcp2d.connector.messages import CancelTransfer, RankTable
from vllm_dcp2d.connector.transport import STALL_S, TransportError

__all__ = ["ReceiverLifetime"]

log = logging.getLogger(__name__)


class ReceiverLifetime:
    """The fetch-ending methods of ``Receiver`` (a mixin: they use its state).

    Uses the background thread's state (``_active``, ``_ranks``, ``_queries``,
    ``_poller``), the output queues ``_done`` / ``_released``, ``_renewed``,
    ``transport``, ``cancel_grace_s`` and ``dcp_rank``, all set by the
    ``Receiver``; called on its background thread only.
    """

    def _fail(self, f: Fetch, error: FetchError, peer_fault: bool = False):
        """Fail ``f`` once no CP rank can still write into its blocks: the ranks still
        in flight get a ``CancelTransfer``; ``f`` ends when each answered, at the
        latest ``cancel_grace_s`` later with the silent ones quarantined."""
        if not f.inflight:
            return self._finish(f, error, peer_fault=peer_fault)
        f.failing, f.peer_fault = error, peer_fault
        f.settle_by = time.monotonic() + self.cancel_grace_s
        for addr, attempt in f.inflight.values():
            self._ranks[addr].send(CancelTransfer(f.transfer_key, attempt))

    def _quarantine(self, f: Fetch, cp_rank: int, where: tuple[str, int], why: str):
        """CP rank ``cp_rank`` of ``f`` may still write into its blocks."""
        addr, attempt = where
        rank = self._ranks[addr]
        rank.inflight.pop(attempt, None)
        rank.limbo[attempt] = f
        f.inflight.pop(cp_rank, None)
        f.limbo[cp_rank] = where
        f.quarantined[cp_rank] = why
        rank.backoff.reset()
        rank.cancel_at = time.monotonic() + rank.backoff.next()

    def _settle(self, f: Fetch, cp_rank: int, how: str):
        """Quarantined CP rank ``cp_rank`` of ``f`` can no longer write."""
        if f.limbo.pop(cp_rank, None) is None:
            return
        log.info("fetch of %r: quarantined cp rank %d settled (%s)", f.transfer_key, cp_rank, how)
        if not f.limbo and self._active.get(f.transfer_key) is not f:
            self._released.put(f)

    def _forget_restarted(self, bootstrap: str, table: RankTable):
        """Quarantined ranks of ``bootstrap`` whose link is down and whose address the
        instance's new rank table no longer lists were restarted: their old process,
        the only one that could write into those blocks, is gone."""
        for addr, rank in list(self._ranks.items()):
            if not rank.down or addr in table.addresses:
                continue
            for attempt, f in list(rank.limbo.items()):
                if f.bootstrap == bootstrap:
                    del rank.limbo[attempt]
                    cp_rank = next(r for r, where in f.limbo.items() if where == (addr, attempt))
                    self._settle(f, cp_rank, "restarted")
            if not rank.inflight and not rank.limbo:
                rank.close(self._poller)
                del self._ranks[addr]

    def _renew_target(self):
        """A prefill rank's write to us timed out. Seen with Mooncake 0.3.13.post1 TCP:
        fresh initiator engines stalled on the same target too, so the target engine
        was wedged. Later requests name a fresh engine (``TransferRequest.session``);
        the old one stays alive with the KV registered, so a late write into
        quarantined blocks still lands only there. At most once per ``STALL_S``."""
        now = time.monotonic()
        if now - self._renewed < STALL_S:
            return
        self._renewed = now
        old = self.transport.session_id
        try:
            self.transport.renew()
        except TransportError as e:
            log.warning("decode rank %d: renewing Mooncake engine %s failed: %s", self.dcp_rank, old, e)
            return
        log.warning("decode rank %d: a write to Mooncake session %s timed out; new requests name %s",
                    self.dcp_rank, old, self.transport.session_id)

    def _finish(self, f: Fetch, error: FetchError | None, track: bool = True, peer_fault: bool = False):
        if track:
            if self._active.get(f.transfer_key) is not f:
                return
            del self._active[f.transfer_key]
        for addr, attempt in f.inflight.values():
            if addr in self._ranks:
                self._ranks[addr].inflight.pop(attempt, None)
        f.inflight = {}
        if peer_fault and f.bootstrap in self._queries:
            self._queries[f.bootstrap].forget()  # re-query: a rank may have moved
        if f.quarantined and error is None:
            error = FetchError(f.transfer_key, min(f.quarantined), "a write may still land: "
                               + "; ".join(f"cp rank {r}: {w}" for r, w in sorted(f.quarantined.items())))
        f.error, f.seconds = error, time.monotonic() - f.started
        if error is not None:
            log.warning("%s%s", error, f" (blocks quarantined: {f.quarantined})" if f.quarantined else "")
        self._done.put(f)
        if f.quarantined and not f.limbo:  # every quarantined rank settled before the fetch ended
            self._released.put(f)
