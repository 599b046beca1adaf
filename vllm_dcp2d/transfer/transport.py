"""Mooncake transfer engine behind a small, typed API (design §6.3).

Facts this wraps (mooncake-transfer-engine 0.3.13, found by running it):
the Python API returns int codes (0 ok, negative error) and never raises; one
batch of more than ~2048 entries to one peer fails part-way (per-peer TCP queue
1024 + 1024 pending), so writes go out in batches of at most ``max_batch``
(1024) entries, one batch in flight per peer; a failed batch leaves the
destination partly written ("content unknown"); the ``protocol`` argument does
not choose the transport, ``MC_FORCE_TCP=1`` does; a frozen peer blocks a call
for ``MC_TRANSFER_TIMEOUT`` seconds (>= 5, read by the engine); 0.3.13.post1's
TCP sessions can stall for minutes (``renew_on_failure``); the first write to a
session opens it (Mooncake's handshake) holding a lock every other write of the
engine needs, for up to 60 s if the peer is silent (``handshake.py``): a session
is probed first, and opened alone on the engine, with a bound (``_enter``).

Every method of ``MooncakeTransport`` is thread-safe; writes to one peer are
serialized (they share the engine's per-peer queue). ``write`` never spins: it
submits each descriptor as a one-entry transfer and sleeps between status polls
(``_write_batch`` says why). Over ~400 lines: the engine's lock and the gate that
keeps writes out of it while a session opens (``_enter``) guard the same calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from vllm_dcp2d.reshard.plan import Descriptors
from vllm_dcp2d.transfer.handshake import BACKOFF_S, HANDSHAKE_TIMEOUT_S, Sessions

__all__ = ["TransportError", "TransferError", "HandshakeError", "MooncakeTransport", "unpinned"]

log = logging.getLogger(__name__)
STALL_S = 10       # renew_on_failure: seconds without progress before a TCP write is given up
STALL_RETRIES = 2  # renew_on_failure: fresh engines tried after stalls, per batch
RETIRED_KEPT = 4   # replaced engines kept alive (>= 40 s: each renewal follows a STALL_S stall)
# A batch still running this long after it started is given up (stalled), however it
# progresses: with the engine's own progress timeout (STALL_S, renew_on_failure) it bounds
# how long after its start a write can land, which the decode's fence_s must exceed.
WRITE_LIMIT_S = 60
POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3  # a write's status polls back off from 20 us to 1 ms


@contextlib.contextmanager
def unpinned():
    """Run the body with the calling thread allowed on every CPU, then restore its affinity.

    ``initialize`` starts the engine's threads (the TCP transport's one asio
    thread serves every session, as initiator and as target), and a new thread
    inherits its creator's CPU affinity. vLLM's CPU worker pins its main thread
    to one core (``VLLM_CPU_OMP_THREADS_BIND``), so without this the engine
    would share that core with the model's forward and every other thread
    pinned there, instead of running wherever the kernel finds a free one. The
    worker starts its sender and receiver (their threads, ZMQ's I/O thread) inside
    it too: pinned there, a decode rank's ZMQ handshake with a prefill rank timed
    out on a loaded 2-core machine.
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    pinned = os.sched_getaffinity(0)  # pid 0: the calling thread
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps it within the cpuset
    except OSError:
        pinned = None
    try:
        yield
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


class TransportError(RuntimeError):
    """The transfer engine could not start or register memory."""


class TransferError(TransportError):
    """A Mooncake write failed; the destination of the whole write is undefined.
    ``entries``: descriptors in the failed batch; ``done_bytes``: bytes of the batches
    that completed before it."""

    def __init__(self, peer: str, entries: int, code: int, done_bytes: int = 0, detail: str = ""):
        self.peer, self.entries, self.code, self.done_bytes = peer, entries, code, done_bytes
        super().__init__(f"Mooncake write to {peer} failed with code {code} on a batch of {entries} "
                         f"descriptors ({done_bytes} bytes written before it){detail}")


class HandshakeError(TransportError):
    """``peer`` did not answer Mooncake's handshake in time, or is refused for a while after
    it failed to (``handshake.Sessions``): nothing of the write was sent."""

    def __init__(self, peer: str, reason: str):
        self.peer = peer
        super().__init__(reason)


class _Use:
    """Who calls into the current engine (``MooncakeTransport._enter``): the sessions it
    opened, the one it is opening now and since when (``overdue`` once that took over the
    bound), and how many writers are submitting to it. A fresh one comes with every engine."""

    def __init__(self):
        self.opened: set[str] = set()
        self.opening: str | None = None
        self.since = 0.0
        self.overdue = False
        self.submitting = 0


class MooncakeTransport:
    """One Mooncake ``TransferEngine`` in P2PHANDSHAKE mode (no metadata server).

    hostname:           address peers reach this engine at (its session is
                        ``hostname:rpc_port``, the port chosen by the engine).
    protocol:           "tcp" sets ``MC_FORCE_TCP=1`` (the engine otherwise picks
                        RDMA whenever it finds a NIC); "rdma" leaves discovery on.
    max_batch:          descriptors per engine call (<= 1024 with the default queues).
    transfer_timeout_s: sets ``MC_TRANSFER_TIMEOUT`` (engine clamps to >= 5 s)
                        before the engine starts; None keeps the environment's.
    renew_on_failure:   a write-only transport gives a TCP write up after ``STALL_S``
                        seconds without progress and retries it on a fresh engine
                        (``renew``), up to ``STALL_RETRIES`` times. Writes that fail
                        at once (dead peer) are not retried. It also bounds what a
                        session that answers the probe and not the engine costs others
                        (``_late``).
    handshake_timeout_s: the longest a session's handshake may take, probe and the
                        engine's own (``handshake.py``); one that failed is refused
                        for ``handshake_backoff_s``.
    """

    def __init__(self, hostname: str = "127.0.0.1", *, protocol: str = "tcp", max_batch: int = 1024,
                 transfer_timeout_s: float | None = None, renew_on_failure: bool = False,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, handshake_backoff_s: float = BACKOFF_S):
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if not 1 <= max_batch <= 65535:
            raise ValueError(f"max_batch must be in [1, 65535], got {max_batch}")
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        if transfer_timeout_s is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(round(transfer_timeout_s))))
        if renew_on_failure:
            # A stalled TCP write is given up after this many seconds without
            # progress (engine default 30) and retried on a fresh engine.
            for var in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
                os.environ.setdefault(var, str(STALL_S))
        self.max_batch = max_batch
        self._sessions = Sessions(handshake_timeout_s, handshake_backoff_s)
        self.hostname, self.protocol, self.renew_on_failure = hostname, protocol, renew_on_failure
        self._engine = self._new_engine()
        self._retired: list = []  # replaced engines, newest last: a write may still run on one
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)  # _use changed: a writer may go on
        self._use = _Use()
        self._regs: dict[int, int] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self._counts = {"stalls": 0, "retries": 0}
        self._closed = False

    def _new_engine(self):
        with unpinned():  # importing the module, the constructor and initialize all start threads
            from mooncake.engine import TransferEngine  # heavy native module: import on use

            engine = TransferEngine()
            rc = engine.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            raise TransportError(f"Mooncake initialize({self.hostname!r}, P2PHANDSHAKE, {self.protocol!r}) "
                                 f"returned {rc}")
        return engine

    def renew(self) -> None:
        """Replace the engine by a fresh one, with every range registered again.

        ``session_id`` changes; the old engine stays alive with every range
        registered (the ``RETIRED_KEPT`` newest ones), so a write still running
        on it, or still arriving at it, completes. Used after a stalled write:
        by an initiator whose sessions to that peer may be wedged (seen with
        0.3.13.post1 TCP: a peer's writes stall for minutes, "no transfer
        progress within 30s", while a fresh engine reaches it at once), and by
        a target whose engine a fresh initiator could not reach either.
        """
        engine = self._new_engine()
        with self._lock:
            self._check_open()
            for addr, nbytes in self._regs.items():
                rc = engine.register_memory(addr, nbytes)
                if rc != 0:
                    raise TransportError(f"register_memory({addr:#x}, {nbytes}) returned {rc} on a renewed engine")
            # Keeps its registrations: a write to another peer may still run on it,
            # or (a target's engine) a late write may still arrive.
            self._retired.append(self._engine)
            for old in self._retired[:-RETIRED_KEPT]:
                for addr in self._regs:
                    old.unregister_memory(addr)
            self._retired = self._retired[-RETIRED_KEPT:]
            self._engine = engine
            self._use = _Use()  # it opened no session yet
            self._gate.notify_all()
            self.session_id = f"{self.hostname}:{engine.get_rpc_port()}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"MooncakeTransport({self.session_id}, {len(self._regs)} regions)"

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``[addr, addr + nbytes)`` as readable/writable by peers.

        Registering the exact same range again is a no-op; an overlapping
        different range raises TransportError.
        """
        addr, nbytes = int(addr), int(nbytes)
        if addr <= 0 or nbytes <= 0:
            raise ValueError(f"need addr > 0 and nbytes > 0, got addr={addr:#x} nbytes={nbytes}")
        with self._lock:
            self._check_open()
            if self._regs.get(addr) == nbytes:
                return
            for a, n in self._regs.items():
                if a < addr + nbytes and addr < a + n:
                    raise TransportError(f"[{addr:#x}, +{nbytes}) overlaps registered [{a:#x}, +{n})")
            rc = self._engine.register_memory(addr, nbytes)
            if rc != 0:
                raise TransportError(f"register_memory({addr:#x}, {nbytes}) returned {rc}")
            self._regs[addr] = nbytes

    def unregister(self, addr: int) -> None:
        """Unregister the range starting at ``addr``; no-op if it is not registered."""
        with self._lock:
            if self._regs.pop(int(addr), None) is None or self._closed:
                return
            rc = self._engine.unregister_memory(int(addr))
            for engine in self._retired:
                engine.unregister_memory(int(addr))
            if rc != 0:
                raise TransportError(f"unregister_memory({int(addr):#x}) returned {rc}")

    def registered(self) -> dict[int, int]:
        with self._lock:
            return dict(self._regs)

    def opened(self, peer: str) -> bool:
        """Whether the current engine has opened ``peer`` (its handshake is behind it)."""
        with self._lock:
            return peer in self._use.opened

    def sessions(self) -> set[str]:
        """This transport's own sessions: its engine's and those of the retired engines
        still alive (a peer must never get us to write into our own memory)."""
        with self._lock:
            return {self.session_id, *(f"{self.hostname}:{e.get_rpc_port()}" for e in self._retired)}

    def write(self, peer: str, desc: Descriptors, stalls: list[int] | None = None, not_after_ns: int = 0) -> int:
        """Write ``desc`` (local ``src`` -> ``peer``'s ``dst``) and wait for completion.

        peer: the target's ``session_id``. desc: int64 ``[n]`` src/dst/length
        (``dst`` inside memory the peer registered). Returns the bytes written.
        Raises TransferError on the first failed batch; later batches are not sent;
        HandshakeError (nothing sent) when the engine has not opened ``peer`` yet
        and it does not answer its handshake (``handshake.py``), or failed to lately.
        stalls: if given, gets the return code of every attempt that stalled
        (no descriptor completed for ``STALL_S``, retried or not). The engine
        may still deliver such an attempt's queued bytes later (0.3.13 returns -1
        while work is still queued), so its destination is not settled.
        not_after_ns: the fence (``TransferRequest.not_after_ns``): no batch, and no retry
        of one, starts once ``time.time_ns()`` passed it (0: none); raises TransferError then.
        """
        with self._lock:
            self._check_open()
            plock = self._peer_locks.setdefault(peer, threading.Lock())
        done = 0
        with plock:
            for b in desc.batches(self.max_batch):
                for attempt in range(STALL_RETRIES + 1):
                    if not_after_ns and time.time_ns() >= not_after_ns:
                        raise TransferError(peer, len(b), -1, done, ": the attempt's deadline passed, so no write "
                                                                    "of it starts any more (the fence)")
                    rc, stalled = self._write_batch(peer, b)
                    if stalled:
                        self._count("stalls")
                        if stalls is not None:
                            stalls.append(rc)
                    # Only a stall earns a fresh engine; a dead or refusing peer fails at
                    # once. Rewriting the same bytes is idempotent.
                    if rc == 0 or not (self.renew_on_failure and stalled) or attempt == STALL_RETRIES:
                        break
                    log.warning("Mooncake write to %s stalled (%d); retrying on a fresh engine", peer, rc)
                    self.renew()
                    self._count("retries")
                if rc != 0:
                    raise TransferError(peer, len(b), rc, done)
                done += b.nbytes
        return done

    def _write_batch(self, peer: str, b: Descriptors) -> tuple[int, bool]:
        """One attempt at ``b`` (<= ``max_batch`` descriptors): ``(rc, stalled)``.

        Each descriptor goes out as its own one-entry transfer and the thread
        sleeps between status polls. The wheel's ``batch_transfer_sync_write``
        (and ``get_batch_transfer_status``) spin on a core until the batch is
        done; on a host with few cores, the prefill's writer threads spinning
        kept the decode's asio thread, which must read those very bytes, off
        the CPU for 10 s at a time (perf sched: 10 s run-queue waits; the
        TCP stall of issue 14). ``rc``: 0 when every descriptor completed,
        else negative. ``stalled``: no descriptor completed for ``STALL_S``, or
        the engine reported a timeout; the attempt's bytes may still land.
        Raises HandshakeError as ``write``.
        """
        src, dst, length = b.src.tolist(), b.dst.tolist(), b.length.tolist()
        pending, rc = [], 0
        engine, use, opening = self._enter(peer)
        try:
            for s, d, n in zip(src, dst, length):
                if opening:  # the first write to peer opens it: Mooncake's handshake
                    opening = False
                    bid, overdue = self._open(engine, use, peer, s, d, n)
                    if overdue:  # given up on; had it got through, that one write may still land
                        rc = -1
                        pending += [bid] if bid else []
                        break
                else:
                    bid = engine.transfer_submit_write(peer, s, d, n)
                if bid == 0:  # not submitted (e.g. no such peer): send no more
                    rc = -1
                    break
                pending.append(bid)
        finally:
            self._leave(use)
        stalled, nap = False, POLL_MIN_S
        progress = started = time.monotonic()
        while pending:
            still, now = [], time.monotonic()
            for bid in pending:
                st = engine.transfer_check_status(bid)  # frees the id once it is done or failed
                if st == 0:
                    still.append(bid)
                elif st < 0:
                    rc = st
                    # -2: timed out in the engine (still queued). A failure after half of
                    # STALL_S without progress is the engine's own progress timeout
                    # (MC_TCP_PROGRESS_TIMEOUT_SEC) dropping a wedged connection.
                    stalled |= st == -2 or now - progress >= STALL_S / 2
            if len(still) < len(pending) and rc == 0:
                progress, nap = now, POLL_MIN_S
            pending = still
            if not pending:
                break
            if now - progress >= STALL_S or now - started >= WRITE_LIMIT_S:
                return -1, True  # the pending ids are abandoned on this engine
            time.sleep(nap)
            nap = min(2 * nap, POLL_MAX_S)
        return rc, stalled

    def _enter(self, peer: str) -> tuple[object, _Use, bool]:
        """``(engine, use, opening)``: the engine to submit ``peer``'s writes to, held
        (``use.submitting``) until ``_leave(use)``; ``opening``: the first submit opens
        ``peer`` (``_open``; it holds the engine alone until then).

        The engine's wrapper opens a session holding a lock every submit takes, so
        nobody submits while a session opens: a writer to an opened session waits for
        the open (what it would wait for inside the engine), at most
        ``handshake_timeout_s`` (``_late``); an opener first waits for the submits in
        flight (each a few microseconds of enqueueing), after probing ``peer`` on this
        thread only (``Sessions.check``, its back-off). Raises HandshakeError when the
        probe fails or the session is refused.
        """
        probed = False
        while True:
            with self._lock:
                self._check_open()
                use = self._use
                late = self._wait_open(use)
                if not late and use is self._use:
                    if peer in use.opened:
                        use.submitting += 1
                        return self._engine, use, False
                    if probed:
                        use.opening, use.since, use.overdue = peer, time.monotonic(), False
                        while use.submitting and use is self._use:
                            self._gate.wait(1.0)  # a submit enqueues and returns: microseconds
                        if use is self._use:
                            return self._engine, use, True
                        use.opening = None
            if late:
                self._late(late)
            elif not probed:
                why = self._sessions.check(peer)  # no lock held: only this writer waits for it
                if why:
                    raise HandshakeError(peer, why)
                probed = True
            # else: a new engine came meanwhile: open peer on it

    def _wait_open(self, use: _Use) -> str:
        """Under the lock: wait while a session opens on ``use``'s engine. "" once none does
        (or the engine changed); else the session whose open this thread found past
        ``handshake_timeout_s`` (marked ``overdue``, for this thread to handle)."""
        while use.opening is not None and use is self._use:
            left = use.since + self._sessions.timeout_s - time.monotonic()
            if left <= 0 and not use.overdue:
                use.overdue = True
                return use.opening
            self._gate.wait(left if left > 0 else 1.0)  # woken at the open's end or at renew
        return ""

    def _leave(self, use: _Use) -> None:
        with self._lock:
            use.submitting -= 1
            if not use.submitting:
                self._gate.notify_all()

    def _open(self, engine, use: _Use, peer: str, s: int, d: int, n: int) -> tuple[int, bool]:
        """The first submit to ``peer`` on ``engine``, which opens it: ``(batch id,
        overdue)``, the id 0 when not submitted. Holds a submit slot of ``use`` after.
        ``overdue``: a writer waiting for it found it past the bound (``_late``); the
        session is refused then, and this write fails."""
        bid = 0
        try:
            bid = engine.transfer_submit_write(peer, s, d, n)
        finally:
            with self._lock:
                overdue = use.overdue
                use.opening = None
                if bid and not overdue:
                    use.opened.add(peer)
                use.submitting += 1
                self._gate.notify_all()
        if not bid and not overdue:
            self._sessions.fail(peer, "the engine's own handshake failed")
        return bid, overdue

    def _late(self, peer: str) -> None:
        """``peer``'s open took over ``handshake_timeout_s`` while others waited for it: it
        answered the probe, not the engine (it froze since, or tells the two apart), and
        the engine's lock stays held until the handshake's read gives up (60 s). ``peer``
        is refused for its back-off; on a ``renew_on_failure`` transport a fresh engine
        takes the other writes now (the opener returns when its handshake ends). Elsewhere
        the others wait for it; the back-off keeps that to once per ``handshake_backoff_s``."""
        why = f"it answered the probe, but not the engine's own handshake within {self._sessions.timeout_s:g} s"
        self._sessions.fail(peer, why)
        if not self.renew_on_failure:
            log.warning("Mooncake session %s: %s; this engine's writes wait for it (at most 60 s)", peer, why)
            return
        log.warning("Mooncake session %s: %s; the other writes go on on a fresh engine", peer, why)
        try:
            self.renew()
        except TransportError as e:
            log.warning("renewing the Mooncake engine failed: %s", e)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def take_counts(self) -> dict[str, int]:
        """``{"stalls", "retries", "handshake_failures", "handshake_refusals"}`` since the
        last call: writes given up after ``STALL_S`` without progress, batches re-sent on
        a fresh engine, sessions that did not answer their handshake in time (each then
        refused for ``handshake_backoff_s``), and writes refused at once for that."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts | self._sessions.take_counts()

    def close(self) -> None:
        """Unregister every registered range; idempotent. The engine itself is
        released when the object is garbage collected (the wheel has no shutdown)."""
        with self._lock:
            if self._closed:
                return
            regs, self._regs = self._regs, {}
            self._closed = True
            bad = [(a, rc) for a in regs if (rc := self._engine.unregister_memory(a)) != 0]
            for old in self._retired:
                for a in regs:
                    old.unregister_memory(a)
        if bad:
            raise TransportError(f"unregister_memory failed for {[(hex(a), rc) for a, rc in bad]}")

    def _check_open(self):
        if self._closed:
            raise TransportError(f"transport {self.session_id} is closed")
