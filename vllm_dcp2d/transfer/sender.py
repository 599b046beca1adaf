"""Prefill side of the 2D reshard: one ``Sender`` per prefill CP rank (design §6.3, §6.6).

The rank holds the KV of its own layers (``cp_layer_range``) for every page.
Its owner (the prefill worker) calls ``add_request`` once a request's KV is
complete; decode DCP ranks then send ``TransferRequest`` messages to this
rank's ROUTER socket. For each one the sender checks the fingerprint and the
decode's token count, plans ``plan_path(layers = this rank's layers,
dcp_size/dcp_rank from the request, the heads both ranks hold)`` (the topology
is per request, design §6.7; a request naming none of this rank's KV heads is
refused), writes the descriptors with Mooncake and answers a ``TransferOutcome``.

A request whose id is not known yet (prefill still running) waits for the
request's ``wait_s`` seconds. While it waits, ``layer_ready`` (called by the
prefill worker from ``save_kv_layer``, right after a layer's KV is computed)
writes that layer to it at once: the layer-pipelined transfer. ``add_request``
then writes the layers not written yet and answers; past ``wait_s`` the waiting
request fails with "not ready". ``restart`` voids the early layers of a request
vLLM preempted; ``abort`` / ``drop`` end a request that will never be added.

When blocks may be freed and when each attempt is answered is decided by the
rank's ``SendLedger`` (``send_ledger.py``, with its invariants); this module
moves the bytes: the owner API, the I/O loop and the plan + write workers. Over
~400 lines on purpose: a write's plan, its checksum and its answer read the same
attempt and regions, and split apart they would pass each other that state.

Threads: an I/O thread owns the socket; a writer thread per decode rank writing
(``writers.Writers``) plans and writes, so a frozen decode holds up only its own.
Each message and each job runs in its own guard: one bad input fails only its
attempt, with the reason in the answer. A thread that dies anyway sets
``failed``, which the owner turns into an engine error (never a hang).

The owner's calls: ``add_request``, ``layer_ready``, ``restart``, ``abort`` /
``drop``, ``waiting``, ``pop_finished``, ``failed``, ``close``. What a rank refuses, rejects
or fails goes back to the peer as the answer's reason and into the log (``PeerLog``).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import numpy as np
import zmq

from vllm_dcp2d.transfer import bootstrap as bs
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.auth import NO_AUTH, Auth, AuthError, PeerLog, rank_name
from vllm_dcp2d.transfer.consumers import Consumers, Registration, source_of
from vllm_dcp2d.transfer.messages import (CancelTransfer, Fingerprint, MessageError, RegisterConsumer, RegisterRank,
                                           ReleaseTransfer, Reply, TransferOutcome, TransferRequest, attempt_of,
                                           clip, decode, max_bytes)
from vllm_dcp2d.reshard.plan import block_tables, plan_path
from vllm_dcp2d.reshard.regions import KVRegions, Memory
from vllm_dcp2d.transfer.checksum import KVBytes, checksum
from vllm_dcp2d.transfer.quota import Strikes
from vllm_dcp2d.transfer.send_ledger import Answer, Attempt, Held, SendLedger
from vllm_dcp2d.transfer.staging import StagingPool, write
from vllm_dcp2d.transfer.transport import HandshakeError, MooncakeTransport, TransportError
from vllm_dcp2d.transfer.writers import Writers
from vllm_dcp2d.reshard.layout import cdiv, cp_layer_range

__all__ = ["Sender"]

log = logging.getLogger(__name__)
_TAKES = max_bytes((RegisterConsumer, TransferRequest, CancelTransfer, ReleaseTransfer))  # the longest a rank reads


class Sender:
    """Serves ``TransferRequest``s for one prefill CP rank.

    transport:   the rank's Mooncake transport; the KV memory behind ``regions``
                 must be registered on it by the owner, before the Sender is built.
    regions:     this rank's KV (must hold ``cp_layer_range(num_layers, cp_size, cp_rank)``).
    fingerprint: this side's KV format; requests with another one fail.
    bootstrap:   the instance's ``BootstrapServer`` address to register with (or None).
    layers, heads: the KV layers this rank sends and the KV heads it holds (default:
                 ``cp_layer_range(num_layers, cp_size, cp_rank)`` and every head;
                 ``layout.send_shard`` gives a worker's).
    token:       the instance's registration token (its registration is sealed with it).
    auth:        seals and opens every frame (``auth.py``): what arrives must be sealed for this
                 rank (``auth.rank_name``), each answer is sealed for the decode rank that asked;
                 a frame it refuses is dropped unanswered and counted (``auth.take_refused``).
    Arguments named as a key of ``config.KEYS`` take that key's value: ``local_hostname`` (the
    address the ROUTER socket binds), ``send_timeout_s``, ``claim_timeout_s`` (``SendLedger.add``)
    and ``max_prefill_wait_s``: the longest an attempt may wait for its request (a decode's
    ``wait_s`` is cut to it).
    kv_bytes:    the KV as tensors on the device that holds it (``KVBytes.of_tensors``), which
                 ``TransferRequest.verify``'s checksum reads; None: host memory (``transport``'s).
    staging_bytes: 0, or (KV in host memory) bytes of send staging (``staging.py``; the connector
                 gives ``send_staging_mib`` MiB, 0 for KV on a device): each path's pages
                 are gathered into ``num_workers`` registered slots of ``staging_bytes // num_workers``
                 bytes (a writer that finds none free writes in place), for fewer, larger descriptors.
    """

    def __init__(self, transport: MooncakeTransport, regions: KVRegions, fingerprint: Fingerprint, *,
                 engine_id: str, cp_rank: int, cp_size: int, local_hostname: str = "127.0.0.1",
                 port: int = 0, bootstrap: str | None = None, send_timeout_s: float = 300.0,
                 claim_timeout_s: float = float("inf"),
                 num_workers: int = 4, register_timeout_s: float = 10.0, staging_bytes: int = 0,
                 layers: range | None = None, heads: range | None = None, token: str = "",
                 auth: Auth = NO_AUTH, max_prefill_wait_s: float = 60.0, kv_bytes: KVBytes | None = None):
        self.transport, self.regions, self.fingerprint = transport, regions, fingerprint
        self.engine_id, self.cp_rank, self.cp_size = engine_id, cp_rank, cp_size
        self.layers = cp_layer_range(fingerprint.num_layers, cp_size, cp_rank) if layers is None else layers
        self.heads = range(fingerprint.num_kv_heads) if heads is None else heads
        self.auth, self.max_prefill_wait_s, self._kv_bytes = auth, max_prefill_wait_s, kv_bytes
        self.name = rank_name(engine_id, cp_rank)  # what the frames this rank reads are sealed for
        self._peers = PeerLog(log)
        regions.rows(np.arange(self.layers.start, self.layers.stop), "producer")  # raises if not held
        if not transport.registered():
            raise ValueError("register this rank's KV memory on the transport before building its Sender")
        self._memory = Memory.of(transport.registered().items())  # what any write may read
        # Registered after _memory, which must not hold them.
        self._staging = (StagingPool(transport, staging_bytes // num_workers, num_workers)
                         if staging_bytes > 0 else None)
        self.send_timeout_s, self.claim_timeout_s = send_timeout_s, claim_timeout_s
        self._failed_why = ""
        self.ledger = SendLedger(f"cp rank {cp_rank}", reveal=auth.enabled)
        self.consumers = Consumers(f"cp rank {cp_rank}", transport.sessions, auth.enabled)  # the I/O thread's
        self._handshakes = Strikes("Mooncake sessions that failed their handshake")  # per source
        self._stop = threading.Event()
        self._sock = sockets.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not blocks
        # A consumer that reconnects keeps its routing id: answers reach it again.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.address = sockets.bind(self._sock, local_hostname, port)
        self._waker = sockets.Waker()
        # A write job returns whether it left the ledger an answer; its writer then wakes the I/O thread.
        self._writers = Writers(f"cp rank {cp_rank}", done=self._waker)
        self._threads = [threading.Thread(target=self._guarded, args=(self._io_loop,), name=f"dcp2d-send-io-{cp_rank}",
                                          daemon=True)]
        for t in self._threads:
            t.start()
        if bootstrap is not None:
            try:
                bs.register_rank(bootstrap, RegisterRank(
                    engine_id, cp_rank, cp_size, self.address, fingerprint, self.layers.start,
                    self.layers.stop, self.heads.start, self.heads.stop), register_timeout_s, auth, token)
            except Exception:
                self.close()
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- owner API (any thread) ----

    def add_request(self, transfer_key: str, block_ids, num_tokens: int, prompt_digest: str = "") -> None:
        """The KV of ``transfer_key``'s ``num_tokens`` prompt tokens is complete in
        ``block_ids`` (int ``[P]``, this rank's block of each sequence page,
        ``P >= cdiv(num_tokens, page_size)``; a tuple of them, one per KV cache
        group, when ``regions`` has several); serves attempts already waiting.
        ``prompt_digest``: ``messages.prompt_digest`` of its prompt; an attempt that
        names another is refused before any write."""
        ids, pages = self._blocks(block_ids, num_tokens)
        for a in self.ledger.add(transfer_key, ids, int(num_tokens), pages, self.send_timeout_s,
                                 self.claim_timeout_s, prompt_digest):
            self._writers.submit(a.session, partial(self._answer, a), a.source)
        self._flush()

    def layer_ready(self, transfer_key: str, layer: int, block_ids, num_tokens: int, event=None,
                    prompt_digest: str = "") -> None:
        """Layer ``layer`` of ``transfer_key`` is computed in ``block_ids`` (int ``[P]``)
        for its ``num_tokens`` prompt tokens: write it now to every attempt waiting for it.

        Called by the owner from its forward pass (``save_kv_layer``), so it only
        queues work. ``event``: a ``torch.cuda.Event`` recorded after the layer's
        KV write on the compute stream (None on CPU), waited for before reading.
        A no-op for layers of other CP ranks or requests nobody asked for yet.
        The owner must call ``restart`` before vLLM reuses the blocks of a
        preempted request, and ``abort`` (then wait for ``pop_finished``) before it
        frees the blocks of a request that will not be added.
        """
        if layer not in self.layers:
            return
        waiting = self.ledger.waiting(transfer_key)
        if not waiting:
            return
        ids, _ = self._blocks(block_ids, num_tokens)
        for a, epoch in waiting:
            self._writers.submit(a.session, partial(self._write_layer, a, layer, ids, int(num_tokens), event,
                                                        epoch, prompt_digest), a.source)

    def restart(self, transfer_key: str) -> int:
        """vLLM preempted ``transfer_key`` after its prompt completed (its blocks are
        free now): layers written so far count for nothing, queued layer writes are
        skipped, and every layer is written again after the re-prefill. Returns the
        number of attempts restarted (``SendLedger.restart``)."""
        return self.ledger.restart(transfer_key)

    def abort(self, transfer_key: str) -> None:
        """``transfer_key`` will never be added (its prefill was aborted after its prompt
        completed): its waiting attempts fail, and ``pop_finished`` reports it
        "aborted" once no layer write reading its blocks is in flight."""
        self.ledger.abort(transfer_key)
        self._flush()

    def drop(self, transfer_key: str) -> None:
        """Like ``abort`` for a request whose blocks vLLM did not keep (aborted before
        its prompt completed, or while preempted): its waiting attempts fail now;
        nothing is reported."""
        self.ledger.abort(transfer_key, report=False)
        self._flush()

    def waiting(self, transfer_key: str) -> int:
        """How many attempts of ``transfer_key`` wait for its KV."""
        return len(self.ledger.waiting(transfer_key))

    def pop_finished(self) -> dict[str, str]:
        """Requests the owner may free now: transfer key -> "done" (all consumer ranks
        of an engine served), "released" (every rank of an engine released it, some
        without fetching), "expired" (nobody finished within ``send_timeout_s``), "unclaimed"
        (no decode rank asked for it within ``claim_timeout_s``) or "aborted"; none has a write
        in flight or can start one."""
        return self.ledger.pop_finished()

    @property
    def failed(self) -> str:
        """Why a thread of this rank died ("" while all run)."""
        return self._failed_why or self._writers.failed

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        self._writers.close(timeout_s)
        self._waker.close()
        if self._staging is not None and not any(t.is_alive() for t in self._threads) and not self._writers.alive():
            self._staging.close()

    def _blocks(self, block_ids, num_tokens: int) -> tuple[tuple, int]:
        tables = tuple(t.copy() for t in block_tables("block_ids", block_ids, self.regions.num_groups))
        pages = cdiv(int(num_tokens), self.fingerprint.page_size)
        for ids in tables:
            if not 0 <= pages <= ids.size:
                raise ValueError(f"need block ids >= 0 covering num_tokens={num_tokens} ({pages} pages of "
                                 f"{self.fingerprint.page_size}), got {ids.size} block ids")
        return tables, pages

    def _flush(self) -> None:
        """Wake the I/O thread if the ledger has answers for it to send."""
        if self.ledger.has_answers():
            self._waker.wake()

    def _guarded(self, loop) -> None:
        """Run a thread's loop; if it ever raises, record why: the owner fails the
        engine on it (its role's ``check_alive``, every step) rather than let requests hang."""
        try:
            loop()
        except Exception as e:
            self._failed_why = f"{threading.current_thread().name} died: {type(e).__name__}: {e}"
            log.exception("cp rank %d: %s", self.cp_rank, self._failed_why)

    # ---- I/O thread: owns the ROUTER socket ----

    def _io_loop(self):
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(sockets.POLL_S * 1000)))
                if self._sock in events:
                    self._receive()
                if self._waker.socket in events:
                    self._waker.drain()
                now = time.monotonic()
                self.ledger.expire(now)
                self.consumers.expire(now)
                for answer in self.ledger.take_answers():
                    self._send(answer.attempt.identity, self._outcome(answer))
        finally:
            self._sock.close()

    def _send(self, identity: bytes, msg) -> None:
        try:
            self._sock.send_multipart([identity, self.auth.pack(msg, to=identity)], zmq.NOBLOCK)
        except (zmq.ZMQError, MessageError) as e:  # the consumer went away: nothing to tell it
            self._peers.warn("send", "cp rank %d: reply to a consumer dropped: %s", self.cp_rank, str(e))

    def _receive(self):
        """One message off the socket; whatever it holds, only its own attempt fails."""
        # Not copied out of ZMQ: a frame refused unread costs no copy either (``auth.open``).
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(frames) != 2:
            return
        identity, frame = frames[0].bytes, frames[1]
        peer = frame.get("Peer-Address") or ""  # the connection's remote address (ZMQ, tcp)
        try:
            payload = self.auth.open(frame, me=self.name, limit=_TAKES)
        except AuthError as e:  # not from a peer that holds the secret: nothing to answer
            return self._peers.warn("auth", "cp rank %d: %s", self.cp_rank, str(e))
        try:
            self._handle(identity, payload, peer)
        except Exception as e:  # a bug, not bad input (decode names that): fail the attempt, keep serving
            log.exception("cp rank %d: handling a message failed", self.cp_rank)
            self._reject(identity, payload, f"cp rank {self.cp_rank} could not handle it: {type(e).__name__}: {e}")

    def _handle(self, identity: bytes, payload: bytes, peer: str = "") -> None:
        try:
            req = decode(payload, (RegisterConsumer, TransferRequest, CancelTransfer, ReleaseTransfer))
        except MessageError as e:
            return self._reject(identity, payload, f"cp rank {self.cp_rank} rejected message: {e}")
        if isinstance(req, RegisterConsumer):
            reg = self.consumers.register(identity, req, peer)
            if reg.refused:
                self._peers.warn("register", "%s", reg.refused)
            return None
        if isinstance(req, CancelTransfer):
            why = f"cancelled by the consumer on cp rank {self.cp_rank}"
            known, settled = self.ledger.cancel(identity, req.attempt_id, why)
            if not known:  # nothing of it in flight (e.g. asked whether a stalled write settled): no failure here
                self._send(identity, self._outcome_failed(req, why, settled=settled))
            return self._flush()
        if isinstance(req, ReleaseTransfer):
            if req.prompt_digest or self.auth.enabled:  # freeing a request takes knowing its prompt
                self.ledger.release(req, source_of(peer, req.engine_id, self.auth.enabled), len(payload))
            return self._flush()
        reg = self.consumers.get(identity)
        why = self._refuses(req, reg)
        if why:
            return self._send(identity, self._failed(req, why))
        if max(req.head_start, self.heads.start) >= min(req.head_end, self.heads.stop):  # nothing of ours it holds
            return self._send(identity, self._failed(req, (
                f"KV heads differ: cp rank {self.cp_rank} holds KV heads [{self.heads.start}, {self.heads.stop}) of "
                f"{self.fingerprint.num_kv_heads}, the decode rank [{req.head_start}, {req.head_end}): no head in "
                f"common, so nothing of this rank is for it")))
        try:
            self.fingerprint.check(req.fingerprint, len(self.heads), req.head_end - req.head_start)
        except MessageError as e:
            return self._send(identity, self._failed(req, f"cp rank {self.cp_rank}: {e}"))
        wait_s = min(req.wait_s, self.max_prefill_wait_s)
        # The fence: no write of it starts after the decode's deadline, on the wall clock or
        # counted from now, whichever comes first (or, if it names none, after this rank would
        # have expired it anyway).
        now_ns = time.time_ns()
        not_after = min(req.not_after_ns or now_ns + int((wait_s + self.send_timeout_s) * 1e9),
                        now_ns + req.budget_ns if req.budget_ns else 1 << 63)
        a = Attempt(identity, req, time.monotonic() + wait_s, len(payload), wait_s, source=reg.source,
                    session=reg.session, memory=reg.memory, not_after_ns=not_after)
        how = self.ledger.arrive(a)
        if how == "busy":
            return self._send(identity, self._failed(req, self.ledger.busy_reason(a)))
        if how == "serve":
            self._writers.submit(a.session, partial(self._answer, a), a.source)
        elif how == "unknown":
            self._send(identity, self._failed(req, self.ledger.unknown_reason(req.transfer_key)))
        elif how == "mismatch":
            self._send(identity, self._failed(req, self.ledger.mismatch_reason(a)))

    def _refuses(self, req: TransferRequest, reg: Registration | None) -> str:
        """Why ``req`` (arriving on a connection registered as ``reg``) is refused before it
        becomes an attempt ("" if it is not): writes go only where the connection registered."""
        if reg is None:
            return (f"cp rank {self.cp_rank}: this connection has not registered its Mooncake session "
                    f"(RegisterConsumer first)")
        if reg.refused:
            return reg.refused
        try:
            req.check_inside(reg.memory)
        except MessageError as e:
            return f"cp rank {self.cp_rank}: {e}"
        if not req.prompt_digest and not self.auth.enabled:
            return (f"cp rank {self.cp_rank}: a transfer request must name its prompt's digest (prompt_digest) "
                    f"when the instances share no auth secret")
        if not self.transport.opened(reg.session):  # a new session costs a handshake probe: bounded per source
            why = self._handshakes.refuses(reg.source, time.monotonic())
            if why:
                return f"cp rank {self.cp_rank}: {why}"
        return ""

    def _reject(self, identity: bytes, payload: bytes, reason: str) -> None:
        """Answer a message this rank could not take: for its attempt if the attempt
        id can be read (the consumer fails only that fetch), else a ``Reply``."""
        self._peers.warn("rejected", "%s", reason)
        which = attempt_of(payload)
        if which is None:
            return self._send(identity, Reply(False, reason))
        key, attempt_id = which
        self._send(identity, self._failed(CancelTransfer(key, attempt_id), reason))

    # ---- workers: plan + write ----

    def _reason(self, e: Exception, a: Attempt) -> str:
        if isinstance(e, HandshakeError):  # its source pays: past Strikes.limit, its new sessions are refused
            self._handshakes.strike(a.source, time.monotonic())
        if isinstance(e, ValueError):
            return f"cannot plan on cp rank {self.cp_rank}: {e}"
        if isinstance(e, TransportError):
            return f"cp rank {self.cp_rank}: {e}"
        log.exception("cp rank %d: unexpected error in a write", self.cp_rank)
        return f"cp rank {self.cp_rank}: unexpected {type(e).__name__}: {e}"

    def _plan_write(self, a: Attempt, block_ids, layers, num_pages: int) -> None:
        """Plan and write ``layers`` x pages(the attempt's DCP rank) into ``a``'s totals.
        Raises ValueError (cannot plan, or a write would leave registered memory)
        or TransportError."""
        req = a.req
        if time.time_ns() >= a.not_after_ns:
            raise TransportError(f"the decode's deadline for this attempt passed: cp rank {self.cp_rank} starts no "
                                 f"write of it (the fence)")
        t0 = time.perf_counter()
        dst = req.regions()
        desc = plan_path(self.regions, block_ids, layers, dst, req.tables(),
                         req.dcp_size, req.dcp_rank, req.first_page, num_pages, self.heads, self._their_heads(req))
        # check_inside kept every destination inside what the connection registered; this
        # checks the plan against it, and the source against ours.
        consumer = a.memory
        if not consumer.holds(desc.dst, desc.length).all():
            raise ValueError("a planned write falls outside the memory the consumer registered")
        if not self._memory.holds(desc.src, desc.length).all():
            raise ValueError("a planned read falls outside the memory this rank registered")
        layers = np.asarray(layers, dtype=np.int64)
        replicated = int((~dst.group_sharded[dst.groups_of(layers, "consumer")]).sum()) if layers.size else 0
        t1 = time.perf_counter()
        stalls: list[int] = []
        try:
            nbytes, written, batches = write(self.transport, self._staging, self._memory, a.session, desc,
                                             stalls, consumer, a.not_after_ns)
        finally:
            # A write given up after a stall may still deliver its queued bytes,
            # also when a retry on a fresh engine then succeeded: not settled.
            if stalls:
                self.ledger.mark_unsettled(a)
        a.nbytes += nbytes
        a.replicated_bytes += (replicated * max(0, num_pages - req.first_page) * int(dst.page_bytes.sum())
                               * self._common(req) // (req.head_end - req.head_start))
        a.descriptors += written
        a.batches += batches
        a.plan_s += t1 - t0
        a.write_s += time.perf_counter() - t1

    def _write_layer(self, a: Attempt, layer: int, block_ids, num_tokens: int, event, epoch: int,
                     prompt_digest: str) -> bool:
        """One layer to one waiting attempt (a writer job queued by ``layer_ready``); returns
        whether the ledger holds answers for the I/O thread (``Writers``)."""
        if event is not None:
            event.synchronize()
        with a.lock:
            token = self.ledger.begin_layer(a, layer, num_tokens, epoch, prompt_digest)
            if token is None:
                return self.ledger.has_answers()
            error = ""
            try:
                self._plan_write(a, block_ids, [layer], cdiv(num_tokens, self.fingerprint.page_size))
            except Exception as e:
                error = self._reason(e, a)
            finally:
                self.ledger.end_layer(a, token, layer, epoch, error)
        return self.ledger.has_answers()

    def _answer(self, a: Attempt) -> bool:
        """Write what attempt ``a`` still lacks (all of this rank's layers, or those
        ``layer_ready`` did not write yet) and answer it (a writer job: returns whether the
        ledger holds answers for the I/O thread)."""
        with a.lock:  # after any layer write of a
            begun = self.ledger.begin_answer(a)
            if begun is None:
                return self.ledger.has_answers()
            held, error, sent = begun
            try:
                if not error:
                    todo = [layer for layer in self.layers if layer not in sent]
                    self._plan_write(a, held.block_ids, todo, held.num_pages)
                    if a.req.verify:
                        a.checksum = self._checksum(a, held)
            except Exception as e:
                error = self._reason(e, a)
            finally:
                self.ledger.end_answer(a, held, error)
        return self.ledger.has_answers()

    def _checksum(self, a: Attempt, held: Held) -> str:
        """``checksum.checksum`` of every byte this rank wrote for ``a`` (the whole path,
        early layers included), read from its own KV in the consumer's address order."""
        req = a.req
        desc = plan_path(self.regions, held.block_ids, list(self.layers), req.regions(), req.tables(),
                         req.dcp_size, req.dcp_rank, req.first_page, held.num_pages, self.heads,
                         self._their_heads(req))
        return checksum(self._memory if self._kv_bytes is None else self._kv_bytes, desc.src, desc.length,
                        desc.dst)

    def _their_heads(self, req: TransferRequest) -> range:
        return range(req.head_start, req.head_end)

    def _common(self, req: TransferRequest) -> int:
        """KV heads this rank holds of those the request's rank holds."""
        return len(range(max(req.head_start, self.heads.start), min(req.head_end, self.heads.stop)))

    def _outcome(self, answer: Answer) -> TransferOutcome:
        a, held = answer.attempt, answer.held
        error = answer.error
        if answer.ok:
            try:
                return self._ok(a, held)
            except Exception as e:  # a bug, on the I/O thread: fail this attempt, keep serving
                log.exception("cp rank %d: building an outcome failed", self.cp_rank)
                error = f"cp rank {self.cp_rank} could not build its outcome: {type(e).__name__}: {e}"
        return self._failed(a.req, error, 0 if held is None else held.num_pages, a.settled)

    def _ok(self, a: Attempt, held: Held) -> TransferOutcome:
        naive = (len(self.layers) * max(0, held.num_pages - a.req.first_page) * int(self.regions.page_bytes.sum())
                 * self._common(a.req) // len(self.heads))  # the heads both hold, of every page
        return TransferOutcome(
            transfer_key=a.req.transfer_key, attempt_id=a.req.attempt_id, cp_rank=self.cp_rank,
            cp_size=self.cp_size, ok=True, reason="", layer_start=self.layers.start, layer_end=self.layers.stop,
            num_tokens=held.num_tokens, num_pages=held.num_pages, nbytes=a.nbytes, descriptors=a.descriptors,
            batches=a.batches, naive_bytes=naive, plan_s=a.plan_s, write_s=a.write_s,
            early_layers=len(a.sent), settled=a.settled, replicated_bytes=a.replicated_bytes, checksum=a.checksum)

    def _failed(self, req: TransferRequest | CancelTransfer, reason: str, num_pages: int = 0,
                settled: bool = True) -> TransferOutcome:
        self._peers.warn("failed", "%s", reason)
        return self._outcome_failed(req, reason, num_pages, settled)

    def _outcome_failed(self, req: TransferRequest | CancelTransfer, reason: str, num_pages: int = 0,
                        settled: bool = True) -> TransferOutcome:
        return TransferOutcome(
            transfer_key=req.transfer_key, attempt_id=req.attempt_id, cp_rank=self.cp_rank, cp_size=self.cp_size,
            ok=False, reason=clip(reason), layer_start=self.layers.start, layer_end=self.layers.stop,
            num_tokens=0, num_pages=num_pages, nbytes=0, descriptors=0, batches=0, naive_bytes=0, plan_s=0.0,
            write_s=0.0, early_layers=0, settled=settled)
