"""Prefill side of the 2D reshard: one ``Sender`` per prefill CP rank (seed §6.3, §6.6).

The rank holds the KV of its own layers (``cp_layer_range``) for every page.
Its owner (the prefill worker) calls ``add_request`` once a request's KV is
complete; decode DCP ranks then send ``TransferRequest`` messages to this
rank's ROUTER socket. For each one the sender checks the fingerprint, plans
``plan_path(layers = this rank's layers, dcp_size/dcp_rank from the request)``
(the topology is per request, seed §6.7), writes the descriptors with Mooncake
and answers a ``TransferOutcome``.

A request whose id is not known yet (prefill still running) is held for the
request's ``wait_s`` seconds. While it is held, ``layer_ready`` (called by the
prefill worker from ``save_kv_layer``, right after a layer's KV is computed)
writes that layer to it at once: the layer-pipelined transfer. ``add_request``
then writes the layers not written yet and answers; past ``wait_s`` the held
request fails with "not ready". A request is finished, and reported by
``pop_finished``, when ``consumer_size`` distinct consumer ranks of one
consumer engine got their pages; one nobody completes is dropped after
``expiry_s``. Finished ids are forgotten: a later fetch fails "unknown request".

Threads: an I/O thread owns the socket; ``num_workers`` threads plan and write.
One slow or frozen decode peer therefore holds one worker for up to
``MC_TRANSFER_TIMEOUT``.

Public API
----------
``Sender(transport, regions, fingerprint, *, engine_id, cp_rank, cp_size, host="127.0.0.1",
         port=0, bootstrap=None, expiry_s=300.0, num_workers=2, register_timeout_s=10.0)``
    ``.address -> str``               this rank's side channel ("tcp://host:port").
    ``.layers -> range``              the layers this rank sends.
    ``.layer_ready(request_id, layer, block_ids, num_pages, event=None)``  one layer of it is computed.
    ``.add_request(request_id, block_ids, num_pages=None)``  KV of the request is ready.
    ``.held(request_id) -> int``      fetches of it waiting for its KV.
    ``.pop_finished() -> dict[str, str]``  request id -> "done" | "expired"; the owner frees blocks.
    ``.stats() -> SenderStats``       per-path bytes/descriptors/seconds and failures.
    ``.close()``                      stops threads; leaves the transport to its owner.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import zmq

from vllm_dcp2d.connector import bootstrap as bs
from vllm_dcp2d.connector.messages import (CancelTransfer, Fingerprint, MessageError, RegisterRank, Reply,
                                           TransferOutcome, TransferRequest, decode, encode)
from vllm_dcp2d.connector.plan import KVRegions, plan_path
from vllm_dcp2d.connector.transport import MooncakeTransport, TransportError
from vllm_dcp2d.layout import cp_layer_range

__all__ = ["Sender", "SenderStats", "PathStats"]

log = logging.getLogger(__name__)


@dataclass
class PathStats:
    """Totals of one path (this CP rank -> one consumer DCP rank)."""

    transfers: int = 0
    failures: int = 0
    nbytes: int = 0
    naive_bytes: int = 0
    descriptors: int = 0
    write_s: float = 0.0


@dataclass
class SenderStats:
    """paths: (engine_id, dcp_size, dcp_rank) -> PathStats; errors: last reasons (bounded)."""

    paths: dict = field(default_factory=dict)
    errors: deque = field(default_factory=lambda: deque(maxlen=100))
    malformed: int = 0


@dataclass
class _Held:
    """One decode rank's fetch (a TransferRequest) until it is answered: held while
    the request's KV is not complete, and what was written to it layer by layer."""

    identity: bytes
    req: TransferRequest
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # one write at a time; ordered close
    sent: set = field(default_factory=set)  # layers written
    nbytes: int = 0
    descriptors: int = 0
    plan_s: float = 0.0
    write_s: float = 0.0
    error: str = ""
    closed: bool = False  # answered (or failed): write nothing more
    cancelled: bool = False  # the consumer gave up (CancelTransfer)


@dataclass
class _Request:
    block_ids: np.ndarray
    num_pages: int
    expires: float
    done: dict = field(default_factory=dict)  # engine_id -> set of consumer ranks served


class Sender:
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
        self._requests: dict[str, _Request] = {}
        self._pending: dict[str, list[_Held]] = {}  # request id -> fetches held until add_request
        self._fetches: dict[tuple, _Held] = {}  # (consumer identity, transfer id) -> fetch not answered yet
        self._finished: dict[str, str] = {}
        self._stats = SenderStats()
        self._work: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._sock = bs.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not blocks
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

    def add_request(self, request_id: str, block_ids, num_pages: int | None = None) -> None:
        """The KV of ``request_id`` is complete in ``block_ids`` (int ``[P]``, this
        rank's block of each sequence page); serves fetches already waiting."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1).copy()
        n = ids.size if num_pages is None else int(num_pages)
        if not 0 <= n <= ids.size or (ids.size and ids.min() < 0):
            raise ValueError(f"need block ids >= 0 and 0 <= num_pages <= {ids.size}, got num_pages={n}")
        with self._lock:
            self._requests[request_id] = _Request(ids, n, time.monotonic() + self.expiry_s)
            waiting = self._pending.pop(request_id, [])
        for held in waiting:
            self._work.put(partial(self._answer, held))

    def layer_ready(self, request_id: str, layer: int, block_ids, num_pages: int, event=None) -> None:
        """Layer ``layer`` of ``request_id`` is computed in ``block_ids`` (int ``[P]``)
        for its ``num_pages`` pages: write it now to every fetch held for the request.

        Called by the owner from its forward pass (``save_kv_layer``), so it only
        queues work. ``event``: a ``torch.cuda.Event`` recorded after the layer's
        KV write on the compute stream (None on CPU), waited for before reading.
        A no-op for layers of other CP ranks or requests nobody asked for yet.
        """
        if layer not in self.layers:
            return
        with self._lock:
            held = list(self._pending.get(request_id, ()))
        if not held:
            return
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1).copy()
        for h in held:
            self._work.put(partial(self._write_layer, h, layer, ids, int(num_pages), event))

    def held(self, request_id: str) -> int:
        """How many fetches of ``request_id`` are held, waiting for its KV."""
        with self._lock:
            return len(self._pending.get(request_id, ()))

    def pop_finished(self) -> dict[str, str]:
        """Requests the owner may free now: id -> "done" (all consumer ranks served)
        or "expired" (nobody finished within ``expiry_s``)."""
        with self._lock:
            out, self._finished = self._finished, {}
        return out

    def stats(self) -> SenderStats:
        with self._lock:
            return SenderStats({k: PathStats(**vars(v)) for k, v in self._stats.paths.items()},
                               deque(self._stats.errors, maxlen=100), self._stats.malformed)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        self._waker.close()

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
                while not self._out.empty():
                    self._send(*self._out.get())
                self._expire()
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
            req = decode(payload, (TransferRequest, CancelTransfer))
        except MessageError as e:
            with self._lock:
                self._stats.malformed += 1
                self._stats.errors.append(f"rejected message: {e}")
            log.warning("cp rank %d: rejected message: %s", self.cp_rank, e)
            self._send(identity, Reply(False, f"cp rank {self.cp_rank} rejected message: {e}"))
            return
        if isinstance(req, CancelTransfer):  # on a worker: it may wait for a write in flight
            self._work.put(partial(self._cancel, identity, req))
            return
        try:
            self.fingerprint.check(req.fingerprint)
        except MessageError as e:
            self._send(identity, self._failed(req, f"cp rank {self.cp_rank}: {e}"))
            return
        h = _Held(identity, req, time.monotonic() + req.wait_s)
        with self._lock:
            known = req.request_id in self._requests
            if known or req.wait_s > 0:
                self._fetches[(identity, req.transfer_id)] = h
            if not known and req.wait_s > 0:
                self._pending.setdefault(req.request_id, []).append(h)
                return
        if known:
            self._work.put(partial(self._answer, h))
        else:
            self._send(identity, self._failed(req, f"unknown request id {req.request_id!r} on cp rank "
                                                   f"{self.cp_rank} (not added, or already finished/expired)"))

    def _expire(self):
        now = time.monotonic()
        late = []
        with self._lock:
            for rid in [r for r, v in self._requests.items() if v.expires <= now]:
                del self._requests[rid]
                self._finished[rid] = "expired"
            for rid, items in list(self._pending.items()):
                keep = [h for h in items if h.deadline > now]
                late += [h for h in items if h.deadline <= now]
                if keep:
                    self._pending[rid] = keep
                else:
                    del self._pending[rid]
        for h in late:  # on a worker: it may wait for a layer write in flight
            self._work.put(partial(self._give_up, h))

    def _give_up(self, h: _Held) -> None:
        with h.lock:  # after any layer write in flight; none starts after this
            h.closed = True
        with self._lock:
            self._fetches.pop((h.identity, h.req.transfer_id), None)
        self._out.put((h.identity, self._failed(h.req, f"request {h.req.request_id!r} not ready on cp rank "
                                                       f"{self.cp_rank} after waiting {h.req.wait_s:.1f}s")))
        self._waker.wake()

    # ---- workers: plan + write ----

    def _work_loop(self):
        while not self._stop.is_set():
            try:
                job = self._work.get(timeout=bs.POLL_S)
            except queue.Empty:
                continue
            job()

    def _answer(self, h: _Held) -> None:
        outcome = self._serve(h)
        with self._lock:
            self._fetches.pop((h.identity, h.req.transfer_id), None)
        self._out.put((h.identity, outcome))
        self._waker.wake()

    def _cancel(self, identity: bytes, msg: CancelTransfer) -> None:
        """The consumer gave up on a fetch: write nothing more for it, and confirm
        only once no write of it is in flight (it may free the blocks then)."""
        with self._lock:
            h = self._fetches.pop((identity, msg.transfer_id), None)
            if h is not None and h in self._pending.get(h.req.request_id, ()):
                self._pending[h.req.request_id].remove(h)
        if h is not None:
            with h.lock:  # waits for a write in flight
                h.cancelled = h.closed = True
        self._out.put((identity, self._failed(msg, f"cancelled by the consumer on cp rank {self.cp_rank}")))
        self._waker.wake()

    def _plan_write(self, req: TransferRequest, block_ids, layers, num_pages: int):
        """Plan and write ``layers`` x pages(req's DCP rank); returns (bytes, descriptors,
        plan s, write s). Raises ValueError (cannot plan) or TransportError."""
        t0 = time.perf_counter()
        desc = plan_path(self.regions, block_ids, layers, req.regions(), req.block_ids,
                         req.dcp_size, req.dcp_rank, req.first_page, num_pages)
        t1 = time.perf_counter()
        nbytes = self.transport.write(req.session, desc)
        return nbytes, len(desc), t1 - t0, time.perf_counter() - t1

    def _write_layer(self, h: _Held, layer: int, block_ids, num_pages: int, event) -> None:
        """One layer to one held fetch (a worker-thread job queued by ``layer_ready``)."""
        if event is not None:
            event.synchronize()
        with h.lock:
            if h.closed or h.error or layer in h.sent:
                return
            try:
                nbytes, n, plan_s, write_s = self._plan_write(h.req, block_ids, [layer], num_pages)
            except (ValueError, TransportError) as e:
                h.error = f"layer {layer} (written early): {e}"
                return
            h.sent.add(layer)
            h.nbytes += nbytes
            h.descriptors += n
            h.plan_s += plan_s
            h.write_s += write_s

    def _serve(self, h: _Held) -> TransferOutcome:
        """Write what fetch ``h`` still lacks (all of this rank's layers, or those
        ``layer_ready`` did not write yet) and build its answer."""
        req = h.req
        with h.lock:  # waits for a layer write in flight; later ones see `closed`
            if h.cancelled:
                return self._failed(req, f"cancelled by the consumer on cp rank {self.cp_rank}")
            h.closed = True
            with self._lock:
                state = self._requests.get(req.request_id)
            if state is None:
                return self._failed(req, f"request {req.request_id!r} finished or expired on cp rank "
                                         f"{self.cp_rank}")
            key = (req.engine_id, req.dcp_size, req.dcp_rank)
            try:
                if h.error:  # a layer written early failed: the destination is undefined
                    raise TransportError(h.error)
                todo = [layer for layer in self.layers if layer not in h.sent]
                nbytes, n, plan_s, write_s = self._plan_write(req, state.block_ids, todo, state.num_pages)
            except ValueError as e:
                return self._failed(req, f"cannot plan on cp rank {self.cp_rank}: {e}", state.num_pages)
            except TransportError as e:
                with self._lock:
                    self._stats.paths.setdefault(key, PathStats()).failures += 1
                return self._failed(req, f"cp rank {self.cp_rank}: {e}", state.num_pages)
        nbytes, n = nbytes + h.nbytes, n + h.descriptors
        plan_s, write_s = plan_s + h.plan_s, write_s + h.write_s
        naive = len(self.layers) * max(0, state.num_pages - req.first_page) * int(self.regions.page_bytes.sum())
        with self._lock:
            p = self._stats.paths.setdefault(key, PathStats())
            p.transfers += 1
            p.nbytes += nbytes
            p.naive_bytes += naive
            p.descriptors += n
            p.write_s += write_s
            served = state.done.setdefault(req.engine_id, set())
            served.add(req.consumer_rank)
            if len(served) >= req.consumer_size and self._requests.get(req.request_id) is state:
                del self._requests[req.request_id]
                self._finished[req.request_id] = "done"
        return TransferOutcome(req.request_id, req.transfer_id, self.cp_rank, self.cp_size, True, "",
                               self.layers.start, self.layers.stop, state.num_pages, nbytes, n,
                               -(-n // self.transport.max_batch), naive, plan_s, write_s, len(h.sent))

    def _failed(self, req: TransferRequest | CancelTransfer, reason: str, num_pages: int = 0) -> TransferOutcome:
        with self._lock:
            self._stats.errors.append(reason)
        log.warning("%s", reason)
        return TransferOutcome(req.request_id, req.transfer_id, self.cp_rank, self.cp_size, False, reason[:4096],
                               self.layers.start, self.layers.stop, num_pages, 0, 0, 0, 0, 0.0, 0.0)
