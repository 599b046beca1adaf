"""Decode side of the 2D reshard: one ``Receiver`` per decode DCP rank (seed §6.7).

``start(key, bootstrap, block_ids, num_tokens=...)`` asks the prefill instance
behind ``bootstrap`` for its rank table (cached per instance), sends one
``TransferRequest`` carrying this rank's ``(dcp_size, dcp_rank)``, block table,
claimed token count and KV regions to every prefill CP rank, and collects their
``TransferOutcome``s. The pages are in place when every CP rank answered ok
for the claimed token count; any failure, length mismatch or deadline fails
the whole fetch, naming the CP rank and the reason (the destination blocks are
then undefined). Nothing blocks the caller: a background thread owns the
sockets, ``poll()`` returns finished fetches.

Block lifetime (docs/connector.md): a CP rank's answer means none of its writes
can still land. A failing fetch sends ``CancelTransfer`` to the ranks still in
flight and waits up to ``cancel_grace_s`` for their answers. Ranks that have not
answered by then, or answered ``settled=False`` (a write timed out), are listed
in ``Fetch.quarantined``: the fetch ends, but its blocks must stay out of use
until ``poll_released()`` returns it. That happens when each such rank answers
a (re-sent) cancel, or when the prefill instance's new rank table no longer has
the rank's address while its link is down (the rank restarted, so its old
process is gone). A dropped ZMQ link alone proves nothing (Mooncake writes do
not use it); the link reconnects with the same routing id and answers arrive.

Public API
----------
``class FetchError(RuntimeError)``: ``.request_id``, ``.cp_rank`` (None if not rank-specific), ``.reason``,
    ``.timed_out`` (the deadline passed).
``Fetch``: ``.request_id``, ``.ok``, ``.error: FetchError | None``, ``.outcomes: dict[int, TransferOutcome]``,
    ``.quarantined: dict[int, str]`` (cp rank -> why its writes may still land), ``.seconds``;
    ``.nbytes`` / ``.naive_bytes`` summed over CP ranks.
``Receiver(transport, regions, fingerprint, *, engine_id, consumer_rank=0, consumer_size=1,
           dcp_size=1, dcp_rank=0, buffers=(), timeout_s=30.0, wait_s=0.0, cancel_grace_s=2.0)``
    ``.start(key, bootstrap, block_ids, first_page=0, timeout_s=None, wait_s=None, *, num_tokens)``
    ``.poll() -> list[Fetch]``        finished fetches since the last call (any thread).
    ``.poll_released() -> list[Fetch]``  quarantined fetches whose ranks all settled since.
    ``.wait(key, timeout_s) -> Fetch``  blocking helper (tests, benches).
    ``.close()``                      fails what is in flight, unregisters ``buffers``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_dcp2d.connector import bootstrap as bs
from vllm_dcp2d.connector.messages import (CancelTransfer, Fingerprint, MessageError, QueryRanks, RankTable,
                                           Reply, TransferOutcome, TransferRequest, decode, encode)
from vllm_dcp2d.connector.plan import KVRegions
from vllm_dcp2d.connector.transport import MooncakeTransport

__all__ = ["Receiver", "Fetch", "FetchError"]

log = logging.getLogger(__name__)
QUERY_RETRY_S = 0.05   # bootstrap said "not all ranks registered yet"
CANCEL_RESEND_MAX_S = 30.0  # a quarantining rank is asked again after 1, 2, 4, ... 30 s


class FetchError(RuntimeError):
    def __init__(self, request_id: str, cp_rank: int | None, reason: str):  # request_id: the transfer key
        self.request_id, self.cp_rank, self.reason = request_id, cp_rank, reason
        where = "" if cp_rank is None else f" from prefill cp rank {cp_rank}"
        super().__init__(f"fetch of {request_id!r}{where} failed: {reason}")

    @property
    def timed_out(self) -> bool:
        """The fetch hit its deadline (as opposed to an explicit failure)."""
        return self.reason.startswith("timed out")


@dataclass
class Fetch:
    request_id: str
    bootstrap: str
    block_ids: np.ndarray
    num_tokens: int
    first_page: int
    deadline: float
    wait_s: float
    started: float = field(default_factory=time.monotonic)
    table: RankTable | None = None
    inflight: dict = field(default_factory=dict)   # cp_rank -> (peer address, transfer_id)
    outcomes: dict = field(default_factory=dict)   # cp_rank -> TransferOutcome
    error: FetchError | None = None
    seconds: float = 0.0
    failing: FetchError | None = None  # failed, waiting for the ranks still in flight to cancel
    peer_fault: bool = False
    settle_by: float = 0.0
    quarantined: dict = field(default_factory=dict)  # cp_rank -> why its writes may still land
    limbo: dict = field(default_factory=dict)  # quarantined cp_rank -> (peer address, transfer_id)

    @property
    def ok(self) -> bool:
        return self.error is None and self.table is not None and len(self.outcomes) == self.table.cp_size

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outcomes.values())

    @property
    def naive_bytes(self) -> int:
        return sum(o.naive_bytes for o in self.outcomes.values())


class _Peer:
    """A DEALER to one ROUTER (bootstrap server or prefill rank) plus its monitor."""

    def __init__(self, address: str, poller: zmq.Poller, is_boot: bool, identity: bytes):
        self.address, self.is_boot = address, is_boot
        self.sock = bs.socket(zmq.DEALER)
        # Same routing id after a reconnect: the rank's answers still reach us.
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self.sock.connect(address)
        self.down = False                        # the link is disconnected now
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self.tids: dict[int, Fetch] = {}         # prefill rank: transfer id -> fetch in flight
        self.limbo: dict[int, Fetch] = {}        # prefill rank: transfer id -> ended fetch it may write into
        self.waiting: list[Fetch] = []           # bootstrap: fetches waiting for the table
        self.table: RankTable | None = None
        self.asked = 0.0                         # bootstrap: when the last query went out (0 = none)
        self.resend_s = bs.RESEND_S              # bootstrap: ask again after this long without an answer
        self.retry_at = 0.0
        self.last_reason = "no answer"
        self.cancel_at = 0.0                     # rank: when quarantined fetches' cancels go out again
        self.cancel_s = bs.RESEND_S

    def close(self, poller: zmq.Poller):
        for s in (self.sock, self.monitor):
            poller.unregister(s)
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


class Receiver:
    """Fetches requests' KV pages for one decode DCP rank.

    transport:   this rank's Mooncake transport (the prefill ranks write into it).
    regions:     this rank's KV regions (all layers); ``buffers``: ``[(addr, nbytes)]``
                 to register on ``transport`` now and unregister on ``close``
                 (leave empty if the owner registers the KV itself).
    dcp_size, dcp_rank: this rank's DCP topology, sent with every request.
    consumer_rank, consumer_size: this worker among the decode instance's workers.
    timeout_s:   default deadline of one fetch; wait_s: default time a prefill rank
                 may hold the request while its prefill is still running.
    """

    def __init__(self, transport: MooncakeTransport, regions: KVRegions, fingerprint: Fingerprint, *,
                 engine_id: str, consumer_rank: int = 0, consumer_size: int = 1, dcp_size: int = 1,
                 dcp_rank: int = 0, buffers=(), timeout_s: float = 30.0, wait_s: float = 0.0,
                 cancel_grace_s: float = 2.0):
        if not 0 <= dcp_rank < dcp_size or not 0 <= consumer_rank < consumer_size:
            raise ValueError(f"need 0 <= dcp_rank < dcp_size and 0 <= consumer_rank < consumer_size, got "
                             f"dcp {dcp_rank}/{dcp_size}, consumer {consumer_rank}/{consumer_size}")
        self.transport, self.regions, self.fingerprint = transport, regions, fingerprint
        self.engine_id, self.consumer_rank, self.consumer_size = engine_id, consumer_rank, consumer_size
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        self.timeout_s, self.wait_s, self.cancel_grace_s = timeout_s, wait_s, cancel_grace_s
        self._buffers = [(int(a), int(n)) for a, n in buffers]
        for a, n in self._buffers:
            transport.register(a, n)
        self._tids = itertools.count(1)
        self._identity = b"dcp2d-" + uuid.uuid4().bytes
        self._new: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._released: queue.Queue = queue.Queue()
        self._active: dict[str, Fetch] = {}
        self._stop = threading.Event()
        self._waker = bs.Waker()
        self._thread = threading.Thread(target=self._loop, name=f"dcp2d-recv-{dcp_rank}", daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, request_id: str, bootstrap: str, block_ids, first_page: int = 0,
              timeout_s: float | None = None, wait_s: float | None = None, *, num_tokens: int) -> None:
        """Begin fetching ``request_id`` (the transfer key) from the prefill instance at ``bootstrap``.

        block_ids:  int ``[n]`` this rank's block table of the request; sequence
                    page ``i`` (with ``i % dcp_size == dcp_rank``) lands in ``block_ids[i // dcp_size]``.
        num_tokens: the prompt tokens this side expects; every CP rank must hold exactly as many.
        """
        if self._stop.is_set():
            raise RuntimeError("receiver is closed")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1).copy()
        t = self.timeout_s if timeout_s is None else timeout_s
        w = self.wait_s if wait_s is None else wait_s
        self._new.put(Fetch(request_id, bootstrap, ids, int(num_tokens), int(first_page), time.monotonic() + t, w))
        self._waker.wake()

    def poll(self) -> list[Fetch]:
        return _drain(self._done)

    def poll_released(self) -> list[Fetch]:
        """Fetches that ended with ``quarantined`` ranks, all of which settled since
        the last call: their blocks may be used again."""
        return _drain(self._released)

    def wait(self, request_id: str, timeout_s: float) -> Fetch:
        """Block until ``request_id`` finishes (other finished fetches stay queued for ``poll``)."""
        deadline = time.monotonic() + timeout_s
        held = []
        try:
            while True:
                try:
                    f = self._done.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"fetch of {request_id!r} not finished within {timeout_s}s") from None
                if f.request_id == request_id:
                    return f
                held.append(f)
        finally:
            for f in held:
                self._done.put(f)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout_s)
            self._waker.close()
        buffers, self._buffers = self._buffers, []
        for a, _ in buffers:
            self.transport.unregister(a)

    # ---- background thread: owns every socket ----

    def _loop(self):
        self._poller = zmq.Poller()
        self._poller.register(self._waker.socket, zmq.POLLIN)
        self._peers: dict[str, _Peer] = {}
        self._boots: dict[str, _Peer] = {}
        try:
            while not self._stop.is_set():
                events = dict(self._poller.poll(int(bs.POLL_S * 1000)))
                if self._waker.socket in events:
                    self._waker.drain()
                while not self._new.empty():
                    self._begin(self._new.get())
                for p in list(self._boots.values()) + list(self._peers.values()):
                    if p.monitor in events:
                        self._link(p)
                    if p.sock in events:
                        self._read(p)
                self._tick()
        finally:
            for f in list(self._active.values()):
                self._finish(f, FetchError(f.request_id, None, "receiver closed"))
            for p in list(self._boots.values()) + list(self._peers.values()):
                p.close(self._poller)

    def _peer(self, addr: str) -> _Peer:
        peer = self._peers.get(addr)
        if peer is None:
            peer = self._peers[addr] = _Peer(addr, self._poller, False, self._identity)
        return peer

    def _begin(self, f: Fetch):
        if f.request_id in self._active:
            self._finish(f, FetchError(f.request_id, None, "a fetch of this request is already running"),
                         track=False)
            return
        self._active[f.request_id] = f
        boot = self._boots.get(f.bootstrap)
        if boot is None:
            boot = self._boots[f.bootstrap] = _Peer(f.bootstrap, self._poller, True, self._identity)
        if boot.table is not None:
            self._dispatch(f, boot.table)
        else:
            boot.waiting.append(f)

    def _dispatch(self, f: Fetch, table: RankTable):
        f.table = table
        for r, addr in enumerate(table.addresses):
            peer = self._peer(addr)
            tid = next(self._tids)
            req = TransferRequest.build(
                regions=self.regions, request_id=f.request_id, transfer_id=tid, engine_id=self.engine_id,
                consumer_rank=self.consumer_rank, consumer_size=self.consumer_size,
                session=self.transport.session_id, dcp_size=self.dcp_size, dcp_rank=self.dcp_rank,
                block_ids=f.block_ids, num_tokens=f.num_tokens, first_page=f.first_page,
                fingerprint=self.fingerprint, wait_s=f.wait_s)
            peer.tids[tid] = f
            f.inflight[r] = (addr, tid)
            peer.sock.send(encode(req))

    def _link(self, p: _Peer):
        """Monitor events of ``p``'s link."""
        lost = False
        while p.monitor.poll(0):
            event = recv_monitor_message(p.monitor)["event"]
            p.down = event == zmq.EVENT_DISCONNECTED
            lost |= p.down
        if lost:
            self._lost(p, "connection lost")

    def _read(self, p: _Peer):
        payload = p.sock.recv()
        if p.is_boot:
            return self._read_table(p, payload)
        try:
            msg = decode(payload, (TransferOutcome, Reply))
        except MessageError as e:
            return self._lost(p, f"malformed reply: {e}")
        if isinstance(msg, Reply):  # the rank rejected one of our messages: we cannot tell which
            return self._lost(p, f"rejected: {msg.reason}")
        f = p.tids.pop(msg.transfer_id, None)
        if f is None or f.request_id != msg.request_id:
            f = p.limbo.get(msg.transfer_id)
            if f is not None and f.request_id == msg.request_id and msg.settled:
                del p.limbo[msg.transfer_id]
                self._settle(f, msg.cp_rank, "answered")
            return  # else a late answer to a fetch that already ended
        f.inflight.pop(msg.cp_rank, None)
        if not msg.settled:
            self._quarantine(f, msg.cp_rank, (p.address, msg.transfer_id), f"a write timed out: {msg.reason}"
                             if not msg.ok else "a write stalled and was retried")
        if f.failing is not None:  # any answer means that rank writes nothing more
            if not f.inflight:
                self._finish(f, f.failing, peer_fault=f.peer_fault)
            return
        if not msg.ok:
            return self._fail(f, FetchError(f.request_id, msg.cp_rank, msg.reason))
        pages = -(-f.num_tokens // self.fingerprint.page_size)
        if (msg.num_tokens, msg.num_pages) != (f.num_tokens, pages):
            return self._fail(f, FetchError(f.request_id, msg.cp_rank, (
                f"length mismatch: this decode expects {f.num_tokens} tokens ({pages} pages), the prefill "
                f"wrote {msg.num_tokens} tokens ({msg.num_pages} pages)")))
        f.outcomes[msg.cp_rank] = msg
        if not f.inflight:
            self._finish(f, None)

    def _read_table(self, boot: _Peer, payload: bytes):
        boot.asked, boot.resend_s = 0.0, bs.RESEND_S
        try:
            msg = decode(payload, (RankTable, Reply))
            if isinstance(msg, RankTable):
                self.fingerprint.check(msg.fingerprint)
        except MessageError as e:
            for f in boot.waiting:
                self._finish(f, FetchError(f.request_id, None, f"bootstrap {boot.address}: {e}"))
            boot.waiting = []
            return
        if isinstance(msg, Reply):  # not every rank registered yet: ask again shortly
            boot.retry_at = time.monotonic() + QUERY_RETRY_S
            boot.last_reason = msg.reason
            return
        boot.table = msg
        self._forget_restarted(boot.address, msg)
        waiting, boot.waiting = boot.waiting, []
        for f in waiting:
            if f.request_id in self._active:
                self._dispatch(f, msg)

    def _forget_restarted(self, bootstrap: str, table: RankTable):
        """Quarantined ranks of ``bootstrap`` whose link is down and whose address the
        instance's new rank table no longer lists were restarted: their old process,
        the only one that could write into those blocks, is gone."""
        for addr, p in list(self._peers.items()):
            if not p.down or addr in table.addresses:
                continue
            for tid, f in list(p.limbo.items()):
                if f.bootstrap == bootstrap:
                    del p.limbo[tid]
                    rank = next(r for r, (a, t) in f.limbo.items() if (a, t) == (addr, tid))
                    self._settle(f, rank, "restarted")
            if not p.tids and not p.limbo:
                p.close(self._poller)
                del self._peers[addr]

    def _tick(self):
        now = time.monotonic()
        for boot in self._boots.values():
            boot.waiting = [f for f in boot.waiting if f.request_id in self._active]
            if not boot.waiting or boot.table is not None:
                continue
            if boot.asked and now - boot.asked > boot.resend_s:
                # No answer yet: ask again on the same socket (ZMQ reconnects to a
                # restarted server by itself), waiting longer each time so that a
                # slow, loaded server is not flooded; extra answers are harmless.
                boot.asked, boot.resend_s = 0.0, min(2 * boot.resend_s, bs.RESEND_MAX_S)
            if not boot.asked and now >= boot.retry_at:
                boot.sock.send(encode(QueryRanks(self.engine_id)))
                boot.asked = now
        for p in self._peers.values():  # ask quarantining ranks again, less and less often
            if p.limbo and now >= p.cancel_at:
                for tid, f in p.limbo.items():
                    p.sock.send(encode(CancelTransfer(f.request_id, tid)))
                p.cancel_at, p.cancel_s = now + p.cancel_s, min(2 * p.cancel_s, CANCEL_RESEND_MAX_S)
        for f in [f for f in self._active.values() if f.failing is not None and f.settle_by <= now]:
            for rank, where in list(f.inflight.items()):
                self._quarantine(f, rank, where, f"no answer to the cancel within {self.cancel_grace_s:.0f}s")
            self._finish(f, f.failing, peer_fault=f.peer_fault)
        for f in [f for f in self._active.values() if f.failing is None and f.deadline <= now]:
            if f.table is None:
                boot = self._boots.get(f.bootstrap)
                rank, why = None, f"no rank table from bootstrap {f.bootstrap} ({boot and boot.last_reason})"
            else:
                pending = sorted(f.inflight)
                rank, why = pending[0], f"no outcome from cp ranks {pending}"
            self._fail(f, FetchError(f.request_id, rank, f"timed out after {now - f.started:.1f}s: {why}"),
                       peer_fault=True)

    def _lost(self, p: _Peer, why: str):
        """Peer ``p``'s link failed or it sent something we cannot read. A bootstrap
        server: fail the fetches waiting for its table. A CP rank: fail the fetches
        in flight to it, which stay in flight (it may still be writing) until it
        answers their cancel, queued until the link is back."""
        if p.is_boot:
            for f in p.waiting:
                self._finish(f, FetchError(f.request_id, None, f"bootstrap {p.address}: {why}"))
            p.waiting, p.table, p.asked = [], None, 0.0
            return
        for boot in self._boots.values():
            if boot.table is not None and p.address in boot.table.addresses:
                boot.table = None  # the rank may come back elsewhere: ask the bootstrap again
        for tid, f in list(p.tids.items()):
            if f.failing is None:
                rank = next((r for r, (a, t) in f.inflight.items() if t == tid), None)
                self._fail(f, FetchError(f.request_id, rank, f"{why} ({p.address})"), peer_fault=True)

    def _fail(self, f: Fetch, error: FetchError, peer_fault: bool = False):
        """Fail ``f`` once no CP rank can still write into its blocks: the ranks still
        in flight get a ``CancelTransfer``; ``f`` ends when each answered, at the
        latest ``cancel_grace_s`` later with the silent ones quarantined."""
        if not f.inflight:
            return self._finish(f, error, peer_fault=peer_fault)
        f.failing, f.peer_fault = error, peer_fault
        f.settle_by = time.monotonic() + self.cancel_grace_s
        for addr, tid in f.inflight.values():
            self._peers[addr].sock.send(encode(CancelTransfer(f.request_id, tid)))

    def _quarantine(self, f: Fetch, rank: int, where: tuple[str, int], why: str):
        """CP rank ``rank`` of ``f`` may still write into its blocks."""
        addr, tid = where
        peer = self._peers[addr]
        peer.tids.pop(tid, None)
        peer.limbo[tid] = f
        f.inflight.pop(rank, None)
        f.limbo[rank] = where
        f.quarantined[rank] = why
        peer.cancel_at, peer.cancel_s = time.monotonic() + bs.RESEND_S, bs.RESEND_S

    def _settle(self, f: Fetch, rank: int, how: str):
        """Quarantined CP rank ``rank`` of ``f`` can no longer write."""
        if f.limbo.pop(rank, None) is None:
            return
        log.info("fetch of %r: quarantined cp rank %d settled (%s)", f.request_id, rank, how)
        if not f.limbo and f.request_id not in self._active:
            self._released.put(f)

    def _finish(self, f: Fetch, error: FetchError | None, track: bool = True, peer_fault: bool = False):
        if track:
            if self._active.get(f.request_id) is not f:
                return
            del self._active[f.request_id]
        for addr, tid in f.inflight.values():
            if addr in self._peers:
                self._peers[addr].tids.pop(tid, None)
        f.inflight = {}
        if peer_fault and f.bootstrap in self._boots:
            self._boots[f.bootstrap].table = None  # re-query: a rank may have moved
        if f.quarantined and error is None:
            error = FetchError(f.request_id, min(f.quarantined), "a write may still land: "
                               + "; ".join(f"cp rank {r}: {w}" for r, w in sorted(f.quarantined.items())))
        f.error, f.seconds = error, time.monotonic() - f.started
        if error is not None:
            log.warning("%s%s", error, f" (blocks quarantined: {f.quarantined})" if f.quarantined else "")
        self._done.put(f)
        if f.quarantined and not f.limbo:  # every quarantined rank settled before the fetch ended
            self._released.put(f)


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
