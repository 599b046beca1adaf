"""Prefill side of the 2D reshard: one ``Sender`` per prefill CP rank (design §6.3, §6.6).

The rank holds the KV of its own layers (``cp_layer_range``) for every page.
Its owner (the prefill worker) calls ``add_request`` once a request's KV is
complete; decode DCP ranks then send ``TransferRequest`` messages to this
rank's ROUTER socket. For each one the sender checks the fingerprint and the
decode's token count, plans ``plan_path(layers = this rank's layers,
dcp_size/dcp_rank from the request)`` (the topology is per request, seed
§6.7), writes the descriptors with Mooncake and answers a ``TransferOutcome``.

A request whose id is not known yet (prefill still running) is held for the
request's ``wait_s`` seconds. While it is held, ``layer_ready`` (called by the
prefill worker from ``save_kv_layer``, right after a layer's KV is computed)
writes that layer to it at once: the layer-pipelined transfer. ``add_request``
then writes the layers not written yet and answers; past ``wait_s`` the held
request fails with "not ready". A request is finished when ``consumer_size``
distinct consumer ranks of one consumer engine got their pages or released it
(``ReleaseTransfer``: that rank will never fetch it), or after ``expiry_s`` (the
backstop for a decode that vanished); ``abort`` ends a request that will never
be added.

Block lifetime (docs/connector.md): ``sender_lifetime`` holds the fetch and
request records and the bookkeeping half of this class (``SenderLifetime``):
one answer per fetch, write counting, releases and consumer coverage, expiry.
This module holds the owner API, the I/O loop and the plan + write workers.

Threads: an I/O thread owns the socket; ``num_workers`` threads plan and write.
One slow or frozen decode peer therefore holds one worker for up to
``MC_TRANSFER_TIMEOUT``.

Public API
----------
``Sender(transport, regions, fingerprint, *, engine_id, cp_rank, cp_size, host="127.0.0.1",
         port=0, bootstrap=None, expiry_s=300.0, num_workers=2, register_timeout_s=10.0)``
    ``.address -> str``               this rank's side channel ("tcp://host:port").
    ``.layers -> range``              the layers this rank sends.
    ``.layer_ready(key, layer, block_ids, num_tokens, event=None)``  one layer of it is computed.
    ``.add_request(key, block_ids, num_tokens)``  KV of the request is ready.
    ``.abort(key)``                   the request will not be added; fail its held fetches.
    ``.held(key) -> int``             fetches of it waiting for its KV.
    ``.pop_finished() -> dict[str, str]``  key -> "done" | "expired" | "aborted"; the owner frees blocks.
    ``.writes_in_flight() -> int``    writes running now (all requests).
    ``.errors -> deque[str]``         the last 100 failure reasons; ``.malformed``: messages rejected.
    ``.close()``                      stops threads; leaves the transport to its owner.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from functools import partial

import numpy as np
import zmq

from vllm_dcp2d.connector import bootstrap as bs
from vllm_dcp2d.connector.messages import (CancelTransfer, Fingerprint, MessageError, RegisterRank,
                                           ReleaseTransfer, Reply, TransferOutcome, TransferRequest, decode,
                                           encode)
from vllm_dcp2d.connector.plan import KVRegions, block_tables, plan_path
from vllm_dcp2d.connector.sender_lifetime import Held, Request, SenderLifetime
from vllm_dcp2d.connector.transport import MooncakeTransport, TransportError
from vllm_dcp2d.layout import cdiv, cp_layer_range

__all__ = ["Sender"]

log = logging.getLogger(__name__)


class Sender(SenderLifetime):
    """Serves ``TransferRequest``s for one prefill CP rank.

    transport:   the rank's Mooncake transport; the KV memory behind ``regions``
                 must be registered on it by the owner.
    regions:     this rank's KV (must hold ``cp_layer_range(num_layers, cp_size, cp_rank)``).
    fingerprint: this side's KV format; requests with another one fail.
    bootstrap:   the instance's ``BootstrapServer`` address to register with (or None).
    """

    def __init__(self, transport: MooncakeTransport, regions: KVRegions, fingerprint: Fingerprint, *,
                 engine_id: str, cp_rank: int, cp_size: int, host: str = "127.0.0.1", port: int = 0,
                 bootstrap: str | None = None, expiry_s: float = 300.0, num_workers: int = 2,
                 register_timeout_s: float = 10.0):
        self.transport, self.regions, self.fingerprint = transport, regions, fingerprint
        self.engine_id, self.cp_rank, self.cp_size = engine_id, cp_rank, cp_size
        self.layers = cp_layer_range(fingerprint.num_layers, cp_size, cp_rank)
        regions.rows(np.arange(self.layers.start, self.layers.stop), "producer")  # raises if not held
        self.expiry_s = expiry_s
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._pending: dict[str, list[Held]] = {}  # key -> fetches held until add_request
        self._fetches: dict[tuple, Held] = {}  # (consumer identity, attempt id) -> fetch not answered yet
        self._finished: dict[str, str] = {}
        self._aborting: dict[str, list[Held]] = {}  # key -> its fetches with a layer write in flight
        self._unsettled: dict[tuple, float] = {}  # (identity, attempt id) -> when its stalled write is dropped
        self._early: dict[str, tuple[float, list[ReleaseTransfer]]] = {}  # key not added yet -> releases for it
        self._gone: dict[str, float] = {}  # key -> until when releases for it are ignored (just finished)
        self._releasing: set[str] = set()  # covered keys waiting for another engine's open fetches
        self._writes = 0
        self.errors: deque[str] = deque(maxlen=100)
        self.malformed = 0
        self._work: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._sock = bs.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not blocks
        # A consumer that reconnects keeps its routing id: answers reach it again.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.address = bs.bind(self._sock, host, port)
        self._waker = bs.Waker()
        self._threads = [threading.Thread(target=self._io_loop, name=f"dcp2d-send-io-{cp_rank}", daemon=True)]
        self._threads += [threading.Thread(target=self._work_loop, name=f"dcp2d-send-{cp_rank}.{i}", daemon=True)
                          for i in range(num_workers)]
        for t in self._threads:
            t.start()
        if bootstrap is not None:
            try:
                bs.register_rank(bootstrap, RegisterRank(engine_id, cp_rank, cp_size, self.address, fingerprint),
                                 register_timeout_s)
            except Exception:
                self.close()
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- owner API (any thread) ----

    def add_request(self, transfer_key: str, block_ids, num_tokens: int) -> None:
        """The KV of ``transfer_key``'s ``num_tokens`` prompt tokens is complete in
        ``block_ids`` (int ``[P]``, this rank's block of each sequence page,
        ``P >= cdiv(num_tokens, page_size)``; a tuple of them, one per KV cache
        group, when ``regions`` has several); serves fetches already waiting."""
        ids, pages = self._blocks(block_ids, num_tokens)
        with self._lock:
            state = self._requests[transfer_key] = Request(ids, int(num_tokens), pages,
                                                            time.monotonic() + self.expiry_s)
            waiting = self._pending.pop(transfer_key, [])
            self._gone.pop(transfer_key, None)
            for msg in self._early.pop(transfer_key, (0.0, []))[1]:  # the decode dropped it before we had it
                self._release(state, transfer_key, msg)
        for held in waiting:
            self._work.put(partial(self._answer, held))

    def layer_ready(self, transfer_key: str, layer: int, block_ids, num_tokens: int, event=None) -> None:
        """Layer ``layer`` of ``transfer_key`` is computed in ``block_ids`` (int ``[P]``)
        for its ``num_tokens`` prompt tokens: write it now to every fetch held for it.

        Called by the owner from its forward pass (``save_kv_layer``), so it only
        queues work. ``event``: a ``torch.cuda.Event`` recorded after the layer's
        KV write on the compute stream (None on CPU), waited for before reading.
        A no-op for layers of other CP ranks or requests nobody asked for yet.
        The owner must call ``abort`` (and wait for ``pop_finished``) before it
        frees the blocks of a request that is not added.
        """
        if layer not in self.layers:
            return
        with self._lock:
            held = list(self._pending.get(transfer_key, ()))
        if not held:
            return
        ids, _ = self._blocks(block_ids, num_tokens)
        for h in held:
            self._work.put(partial(self._write_layer, h, layer, ids, int(num_tokens), event))

    def abort(self, transfer_key: str) -> None:
        """``transfer_key`` will never be added (its prefill was aborted): its held fetches
        fail, and ``pop_finished`` reports it "aborted" once no layer write reading
        its blocks is in flight."""
        with self._lock:
            held = self._pending.pop(transfer_key, [])
            for h in held:
                self._close(h, f"request {transfer_key!r} was aborted on the prefill (cp rank {self.cp_rank})")
            if any(h.writes for h in held):
                self._aborting[transfer_key] = held
            else:
                self._finished[transfer_key] = "aborted"
        self._flush()

    def held(self, transfer_key: str) -> int:
        """How many fetches of ``transfer_key`` are held, waiting for its KV."""
        with self._lock:
            return len(self._pending.get(transfer_key, ()))

    def pop_finished(self) -> dict[str, str]:
        """Requests the owner may free now: transfer key -> "done" (all consumer ranks
        of an engine served), "released" (every rank of an engine released it, some
        without fetching), "expired" (nobody finished within ``expiry_s``) or
        "aborted"; none has a write in flight or can start one."""
        with self._lock:
            out, self._finished = self._finished, {}
        return out

    def writes_in_flight(self) -> int:
        with self._lock:
            return self._writes

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        self._waker.close()

    def _blocks(self, block_ids, num_tokens: int) -> tuple[tuple, int]:
        tables = tuple(t.copy() for t in block_tables("block_ids", block_ids, self.regions.num_groups))
        pages = cdiv(int(num_tokens), self.fingerprint.page_size)
        for ids in tables:
            if not 0 <= pages <= ids.size:
                raise ValueError(f"need block ids >= 0 covering num_tokens={num_tokens} ({pages} pages of "
                                 f"{self.fingerprint.page_size}), got {ids.size} block ids")
        return tables, pages

    # ---- I/O thread: owns the ROUTER socket ----

    def _io_loop(self):
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(bs.POLL_S * 1000)))
                if self._sock in events:
                    self._receive()
                if self._waker.socket in events:
                    self._waker.drain()
                self._expire()
                while not self._out.empty():
                    self._send(*self._out.get())
        finally:
            self._sock.close()

    def _send(self, identity: bytes, msg) -> None:
        try:
            self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the consumer went away: nothing to tell it
            log.warning("cp rank %d: reply to a vanished consumer dropped: %s", self.cp_rank, e)

    def _receive(self):
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            return
        identity, payload = frames
        try:
            req = decode(payload, (TransferRequest, CancelTransfer, ReleaseTransfer))
        except MessageError as e:
            self.malformed += 1
            self.errors.append(f"rejected message: {e}")
            log.warning("cp rank %d: rejected message: %s", self.cp_rank, e)
            self._send(identity, Reply(False, f"cp rank {self.cp_rank} rejected message: {e}"))
            return
        if isinstance(req, CancelTransfer):
            return self._cancel(identity, req)
        if isinstance(req, ReleaseTransfer):
            self._on_release(req)
            return self._flush()
        try:
            self.fingerprint.check(req.fingerprint)
        except MessageError as e:
            self._send(identity, self._failed(req, f"cp rank {self.cp_rank}: {e}"))
            return
        h = Held(identity, req, time.monotonic() + req.wait_s)
        with self._lock:
            known = req.transfer_key in self._requests
            if known or req.wait_s > 0:
                self._fetches[(identity, req.attempt_id)] = h
            if not known and req.wait_s > 0:
                self._pending.setdefault(req.transfer_key, []).append(h)
                return
        if known:
            self._work.put(partial(self._answer, h))
        else:
            self._send(identity, self._failed(req, f"unknown request id {req.transfer_key!r} on cp rank "
                                                   f"{self.cp_rank} (not added, or already finished/expired)"))

    def _cancel(self, identity: bytes, msg: CancelTransfer) -> None:
        """The consumer gave up on a fetch. Handled here, ahead of queued work: no
        write of it starts any more, and it is answered once none is in flight. A
        fetch this rank does not know has nothing in flight: answered at once."""
        why = f"cancelled by the consumer on cp rank {self.cp_rank}"
        with self._lock:
            h = self._fetches.get((identity, msg.attempt_id))
            if h is not None:
                items = self._pending.get(h.req.transfer_key, [])
                if h in items:
                    items.remove(h)
                self._close(h, why)
            settled = self._unsettled.get((identity, msg.attempt_id), 0.0) <= time.monotonic()
        if h is None:
            self._send(identity, self._failed(msg, why, settled=settled))

    # ---- workers: plan + write ----

    def _work_loop(self):
        while not self._stop.is_set():
            try:
                job = self._work.get(timeout=bs.POLL_S)
            except queue.Empty:
                continue
            job()
            self._flush()

    def _plan_write(self, h: Held, block_ids, layers, num_pages: int) -> None:
        """Plan and write ``layers`` x pages(the fetch's DCP rank) into ``h``'s totals.
        Raises ValueError (cannot plan) or TransportError."""
        req = h.req
        t0 = time.perf_counter()
        dst = req.regions()
        desc = plan_path(self.regions, block_ids, layers, dst, req.tables(),
                         req.dcp_size, req.dcp_rank, req.first_page, num_pages)
        layers = np.asarray(layers, dtype=np.int64)
        replicated = int((~dst.group_sharded[dst.groups_of(layers, "consumer")]).sum()) if layers.size else 0
        t1 = time.perf_counter()
        stalls: list[int] = []
        try:
            nbytes = self.transport.write(req.session, desc, stalls)
        finally:
            # An attempt given up after a stall may still deliver its queued bytes,
            # also when a retry on a fresh engine then succeeded: not settled.
            if stalls:
                h.settled = False
        h.nbytes += nbytes
        h.replicated_bytes += replicated * max(0, num_pages - req.first_page) * int(dst.page_bytes.sum())
        h.descriptors += len(desc)
        h.plan_s += t1 - t0
        h.write_s += time.perf_counter() - t1

    def _write_layer(self, h: Held, layer: int, block_ids, num_tokens: int, event) -> None:
        """One layer to one held fetch (a worker-thread job queued by ``layer_ready``)."""
        if event is not None:
            event.synchronize()
        with h.lock:
            with self._lock:
                # Once the request was added, its blocks stay with vLLM only while a write is
                # counted on it too: expiry or release must not free blocks this write reads.
                state = self._requests.get(h.req.transfer_key)
                if layer in h.sent or h.error or h.req.num_tokens != num_tokens or not self._begin(h, state):
                    return
            try:
                self._plan_write(h, block_ids, [layer], cdiv(num_tokens, self.fingerprint.page_size))
                h.sent.add(layer)
            except (ValueError, TransportError) as e:
                h.error = f"layer {layer} (written early): {e}"
            finally:
                with self._lock:
                    self._end(h, state, h.req.transfer_key)

    def _answer(self, h: Held) -> None:
        """Write what fetch ``h`` still lacks (all of this rank's layers, or those
        ``layer_ready`` did not write yet) and answer it."""
        req, key = h.req, h.req.transfer_key
        with h.lock:  # after any layer write of h
            with self._lock:
                state = self._requests.get(key)
                if state is None:
                    return self._close(h, f"request {key!r} finished or expired on cp rank {self.cp_rank}")
                if req.num_tokens != state.num_tokens:
                    return self._close(h, f"length mismatch on cp rank {self.cp_rank}: the decode claims "
                                          f"{req.num_tokens} prompt tokens, the prefill has {state.num_tokens}")
                if not self._begin(h, state):
                    return
            error = h.error
            try:
                if not error:
                    todo = [layer for layer in self.layers if layer not in h.sent]
                    self._plan_write(h, state.block_ids, todo, state.num_pages)
            except ValueError as e:
                error = f"cannot plan on cp rank {self.cp_rank}: {e}"
            except TransportError as e:
                error = f"cp rank {self.cp_rank}: {e}"
            with self._lock:
                if not h.closed:
                    h.closed = "answered"
                    if error:
                        self._reply(h, self._failed(req, error, state.num_pages, h.settled))
                    else:
                        self._reply(h, self._ok(h, state))
                        state.done.setdefault(req.engine_id, set()).add(req.consumer_rank)
                        state.sizes[req.engine_id] = req.consumer_size
                if not state.closing:
                    self._try_close(key, state)
                self._end(h, state, key)

    def _ok(self, h: Held, state: Request) -> TransferOutcome:
        n = h.descriptors
        naive = len(self.layers) * max(0, state.num_pages - h.req.first_page) * int(self.regions.page_bytes.sum())
        return TransferOutcome(
            transfer_key=h.req.transfer_key, attempt_id=h.req.attempt_id, cp_rank=self.cp_rank,
            cp_size=self.cp_size, ok=True, reason="", layer_start=self.layers.start, layer_end=self.layers.stop,
            num_tokens=state.num_tokens, num_pages=state.num_pages, nbytes=h.nbytes, descriptors=n,
            batches=-(-n // self.transport.max_batch), naive_bytes=naive, plan_s=h.plan_s, write_s=h.write_s,
            early_layers=len(h.sent), settled=h.settled, replicated_bytes=h.replicated_bytes)

    def _failed(self, req: TransferRequest | CancelTransfer, reason: str, num_pages: int = 0,
                settled: bool = True) -> TransferOutcome:
        self.errors.append(reason)
        log.warning("%s", reason)
        return TransferOutcome(
            transfer_key=req.transfer_key, attempt_id=req.attempt_id, cp_rank=self.cp_rank, cp_size=self.cp_size,
            ok=False, reason=reason[:4096], layer_start=self.layers.start, layer_end=self.layers.stop,
            num_tokens=0, num_pages=num_pages, nbytes=0, descriptors=0, batches=0, naive_bytes=0, plan_s=0.0,
            write_s=0.0, early_layers=0, settled=settled)
