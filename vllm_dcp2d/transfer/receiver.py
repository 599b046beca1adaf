"""Decode side of the 2D reshard: one ``Receiver`` per decode DCP rank (design §6.7).

``start(transfer_key, bootstrap, block_ids, num_tokens=...)`` gets the rank table
of the prefill instance behind ``bootstrap`` (``directory.Directory``: the rank
tables, cached per instance, the side channels and the releases), sends every prefill CP rank one ``TransferRequest`` carrying this
rank's ``(dcp_size, dcp_rank)``, block table, token count, KV regions and the
memory it registered, and collects their ``TransferOutcome``s. The pages are in
place when every CP rank answered ok for the same token count; any failure,
count mismatch, engine id mismatch or deadline fails the whole fetch, naming
the CP rank and the reason (the destination blocks are then undefined).
Nothing blocks the caller: a background thread owns the sockets, ``poll()``
returns finished fetches.

Block lifetime (docs/connector.md): a failing fetch cancels the CP ranks still
writing and may end with some of them quarantined. The ``FetchLedger``
(``fetch_ledger.py``, with its invariants) records every attempt by the address
it went to and decides when a fetch ends and when its blocks may be used again
(``poll_lifted``), and decides what an answer means for them (``FetchLedger.answered``);
it also holds what one ``Fetch`` is. ``directory.Directory`` owns the rank tables and the
links to the prefill ranks. This module holds the fetch protocol: the public API, the
socket loop, dispatch, checking answers, cancels and deadlines. Over ~400 lines on purpose: those steps are one
state machine on one thread, each acting on the same fetches and ledger.

Failure rule: each fetch, release, answer and timer runs in its own guard, so
one bad input fails only its own fetch, with a reason naming it; no send
blocks (a rank that stopped reading fails the fetches sent to it). A thread
that dies anyway sets ``failed``: every fetch in flight fails, ``start``
raises, and the owner turns it into an engine error.

The owner's calls: ``start`` a fetch (with the owner's ``tag``, which the ended
``Fetch`` carries back), ``fetching`` a key, ``release`` a request this rank will never
fetch, ``poll`` the fetches that ended and ``poll_lifted`` the quarantines that
lifted (any thread), ``failed``, ``close``. What a ``Fetch`` and a ``FetchError``
hold: ``fetch_ledger.py``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid

import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.auth import NO_AUTH, Auth
from vllm_dcp2d.transfer.bootstrap import RankTableQuery
from vllm_dcp2d.transfer.checksum import KVBytes, checksum, path_ranges
from vllm_dcp2d.transfer.directory import Directory, Link, link_events
from vllm_dcp2d.transfer.fetch_ledger import CORRUPT, Answer, Fetch, FetchError, FetchLedger
from vllm_dcp2d.transfer.messages import (CancelTransfer, Fingerprint, FingerprintMismatch, MessageError, RankTable,
                                           RegisterConsumer, Reply, TransferOutcome, TransferRequest)
from vllm_dcp2d.reshard.head_split import senders_for
from vllm_dcp2d.reshard.plan import block_tables
from vllm_dcp2d.reshard.regions import KVRegions, Memory, blocks_within
from vllm_dcp2d.transfer.transport import STALL_S, MooncakeTransport, TransportError

__all__ = ["Receiver", "Fetch", "FetchError"]

log = logging.getLogger(__name__)


def drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


class Receiver:
    """Fetches requests' KV pages for one decode DCP rank.

    transport:   this rank's Mooncake transport (the prefill ranks write into it).
    regions:     this rank's KV regions (all layers); ``buffers``: ``[(addr, nbytes)]``
                 to register on ``transport`` now and unregister on ``close``
                 (leave empty if the owner registered the KV itself). Every region
                 must lie inside what ``transport`` has registered: that memory, and
                 the blocks each region has inside it, travel with every request.
    dcp_size, dcp_rank: this rank's DCP topology, sent with every request.
    heads:       the KV heads this rank holds (default: all of ``fingerprint.num_kv_heads``);
                 it fetches from the CP ranks that hold them (``head_split.senders_for``).
    auth:        seals and opens every frame (``auth.py``).
    verify_kv:   ask every prefill rank for a checksum of what it wrote and check this
                 rank's KV against it before a fetch ends ok (``checksum.py``).
    kv_bytes:    the KV as tensors on the device that holds it (``KVBytes.of_tensors``), which
                 ``verify_kv``'s checksum reads; None: host memory (``transport``'s).
    consumer_rank, consumer_size: this worker among the decode instance's workers.
    transfer_timeout_s: default deadline of one fetch; prefill_wait_s: default time a prefill
                 rank may hold the request while its prefill is still running.
    cancel_grace_s: how long a failing fetch waits for the answers to its cancels.
    (Each setting is named as its config key, ``config.KEYS``.)
    fence_s:     a quarantine lifts at the latest this long after its fetch's deadline: no
                 prefill rank starts a write after the deadline (``TransferRequest.not_after_ns``),
                 and one started before it has ended by then (docs/connector.md, "Block lifetime").
    max_quarantined_blocks: blocks one prefill instance may keep quarantined here; past it
                 its fetches are refused (0: a quarter of this rank's blocks, at least 64); all
                 instances together may keep twice that.
    on_output:  called with no arguments, on this object's thread, right after a
                fetch ended or a quarantine lifted (what ``poll``/``poll_lifted`` return
                next); must not block (the worker rings the step bell: ``step_bell``).
    """

    def __init__(self, transport: MooncakeTransport, regions: KVRegions, fingerprint: Fingerprint, *,
                 engine_id: str, consumer_rank: int = 0, consumer_size: int = 1, dcp_size: int = 1,
                 dcp_rank: int = 0, buffers=(), transfer_timeout_s: float = 30.0, prefill_wait_s: float = 0.0,
                 cancel_grace_s: float = 2.0, on_output=None, heads: range | None = None,
                 auth: Auth = NO_AUTH, verify_kv: bool = False, fence_s: float = 120.0,
                 max_quarantined_blocks: int = 0, kv_bytes: KVBytes | None = None):
        if not 0 <= dcp_rank < dcp_size or not 0 <= consumer_rank < consumer_size:
            raise ValueError(f"need 0 <= dcp_rank < dcp_size and 0 <= consumer_rank < consumer_size, got "
                             f"dcp {dcp_rank}/{dcp_size}, consumer {consumer_rank}/{consumer_size}")
        self.transport, self.regions, self.fingerprint = transport, regions, fingerprint
        self.engine_id, self.consumer_rank, self.consumer_size = engine_id, consumer_rank, consumer_size
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        self.heads = range(fingerprint.num_kv_heads) if heads is None else heads
        self.auth, self.verify_kv, self.kv_bytes = auth, verify_kv, kv_bytes
        self.transfer_timeout_s, self.prefill_wait_s = transfer_timeout_s, prefill_wait_s
        self.cancel_grace_s, self.fence_s = cancel_grace_s, fence_s
        self._buffers = [(int(a), int(n)) for a, n in buffers]
        for a, n in self._buffers:
            transport.register(a, n)
        self.memory = Memory.of(transport.registered().items())
        self.num_blocks = blocks_within(regions, self.memory)
        self.max_quarantined_blocks = max_quarantined_blocks or max(64, self.num_blocks // 4)
        self.failed = ""
        self.on_output = on_output
        self.ledger = FetchLedger()
        self._attempts = itertools.count(1)
        self.identity = b"dcp2d-" + uuid.uuid4().bytes  # this rank's routing id on every link
        self._new: queue.Queue = queue.Queue()
        self._started: dict[str, Fetch] = {}  # transfer key -> its fetch, from ``start`` until ``poll`` returned it
        self._started_lock = threading.Lock()
        self._releases: queue.Queue = queue.Queue()  # (transfer key, bootstrap, num_tokens, deadline) to announce
        self._renewed = 0.0  # when the transport was last renewed after a timed-out write
        self._stop = threading.Event()
        self._waker = sockets.Waker()
        self._thread = threading.Thread(target=self._run, name=f"dcp2d-recv-{dcp_rank}", daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, transfer_key: str, bootstrap: str, block_ids, first_page: int = 0,
              transfer_timeout_s: float | None = None, prefill_wait_s: float | None = None, *, num_tokens: int,
              remote_engine_id: str | None = None, prompt_digest: str = "", tag=None) -> None:
        """Begin fetching ``transfer_key`` from the prefill instance at ``bootstrap``.

        block_ids:  int ``[n]`` this rank's block table of the request; sequence
                    page ``i`` (with ``i % dcp_size == dcp_rank``) lands in ``block_ids[i // dcp_size]``.
                    With several KV cache groups (``regions.group_sharded``), a tuple of
                    tables, one per group; a replicated group gets page ``i`` in ``[i]``.
        num_tokens: the prompt tokens this side expects; every CP rank must hold exactly as many.
        remote_engine_id: the prefill engine expected behind ``bootstrap`` (None: any);
                    a rank table of another engine fails the fetch, naming both.
        prompt_digest: ``messages.prompt_digest`` of the prompt here; a prefill rank whose
                    request has another prompt refuses to write.
        tag:        the caller's, carried by the ``Fetch`` that ``poll`` returns (``Fetch.tag``).
        Raises RuntimeError if the receiver is closed or its thread died.
        """
        if self.failed:
            raise RuntimeError(f"DCP2D receiver of DCP rank {self.dcp_rank} is dead: {self.failed}")
        if self._stop.is_set():
            raise RuntimeError("receiver is closed")
        ids = tuple(t.copy() for t in block_tables("block_ids", block_ids, self.regions.num_groups))
        t = self.transfer_timeout_s if transfer_timeout_s is None else transfer_timeout_s
        w = self.prefill_wait_s if prefill_wait_s is None else prefill_wait_s
        f = Fetch(transfer_key, bootstrap, remote_engine_id, ids, int(num_tokens), int(first_page),
                  time.monotonic() + t, w, prompt_digest, tag)
        with self._started_lock:
            self._started.setdefault(transfer_key, f)
        self._new.put(f)
        self._waker.wake()

    def fetching(self, transfer_key: str) -> Fetch | None:
        """The fetch of ``transfer_key`` started here that ``poll`` has not returned yet (None: none)."""
        with self._started_lock:
            return self._started.get(transfer_key)

    def release(self, transfer_key: str, bootstrap: str, num_tokens: int,
                remote_engine_id: str | None = None, prompt_digest: str = "") -> None:
        """This rank will never fetch ``transfer_key`` (``num_tokens`` prompt tokens)
        from the prefill instance at ``bootstrap``: send every CP rank a
        ``ReleaseTransfer`` so it frees the request now instead of at its
        ``send_timeout_s``. Fire and forget: if the rank table cannot be had within
        ``transfer_timeout_s``, the prefill's timeout frees it; if the instance at ``bootstrap``
        is not ``remote_engine_id`` (restarted, or another one on that address), it is
        not told (None: any). The caller must not release a key it is still fetching."""
        if self._stop.is_set() or self.failed:
            return
        self._releases.put((transfer_key, bootstrap, int(num_tokens), time.monotonic() + self.transfer_timeout_s,
                            remote_engine_id, prompt_digest))
        self._waker.wake()

    def poll(self) -> list[Fetch]:
        """The fetches that ended since the last call, ok or not (``Fetch.error``)."""
        out = self.ledger.poll()
        with self._started_lock:
            for f in out:
                if self._started.get(f.transfer_key) is f:
                    del self._started[f.transfer_key]
        return out

    def poll_lifted(self) -> list[Fetch]:
        """Fetches that ended with ``quarantined`` ranks, all of which settled since
        the last call: their blocks may be used again."""
        return self.ledger.poll_lifted()

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout_s)
            self._waker.close()
        buffers, self._buffers = self._buffers, []
        for a, _ in buffers:
            self.transport.unregister(a)

    # ---- background thread: owns every socket ----

    def _run(self):
        self._poller = zmq.Poller()
        self._poller.register(self._waker.socket, zmq.POLLIN)
        self._dir = Directory(self._poller, self.identity, self.engine_id, self.fingerprint, self.heads,
                              self.consumer_rank, self.consumer_size, self.dcp_rank, self.dcp_size, self.auth)
        self._waiting: dict[str, list[Fetch]] = {}  # bootstrap -> fetches waiting for its table
        self._collect_at = 0.0  # when idle queries and links are next closed
        reason = "receiver closed"
        try:
            self._loop()
        except Exception as e:  # a bug: every fetch fails, and start() raises from now on
            reason = self.failed = f"{threading.current_thread().name} died: {type(e).__name__}: {e}"
            log.exception("decode rank %d: %s", self.dcp_rank, reason)
        finally:
            ended = self.ledger.fail_all(reason)
            for f in drain(self._new):
                ended = self.ledger.finish(f, FetchError(f.transfer_key, None, reason), track=False) or ended
            if ended:
                self._announce()
            self._dir.close()

    def _loop(self):
        while not self._stop.is_set():
            events = dict(self._poller.poll(int(sockets.POLL_S * 1000)))
            if self._waker.socket in events:
                self._waker.drain()
            for f in drain(self._new):
                self._guard(self._begin, f, fetch=f)
            for rel in drain(self._releases):
                self._guard(self._queue_release, rel)
            self._guard(self._dir.send_releases)
            for q in self._dir.tables():
                if q.monitor in events and link_events(q.monitor):
                    self._guard(self._no_table, q, "connection lost")
                if q.sock in events:
                    self._guard(self._read_table, q)
            for link in self._dir.links():
                if link.monitor in events:
                    self._guard(self._link, link)
                if link.sock in events:
                    self._guard(self._read, link)
            self._guard(self._tick)

    def _guard(self, step, *args, fetch: Fetch | None = None) -> None:
        """Run one step; if it raises, fail only ``fetch`` (if given) and go on."""
        try:
            step(*args)
        except Exception as e:
            log.exception("decode rank %d: %s failed", self.dcp_rank, step.__name__)
            if fetch is not None:
                self._fail(fetch, FetchError(fetch.transfer_key, None, f"{type(e).__name__}: {e}"))

    def _begin(self, f: Fetch):
        held, total = self.ledger.quarantined_blocks(f.bootstrap), self.ledger.quarantined_blocks()
        why = ""
        if held >= self.max_quarantined_blocks:
            why = (f"the prefill instance at {f.bootstrap} keeps {held} blocks of this decode rank quarantined (at "
                   f"most {self.max_quarantined_blocks}): its fetches are refused until its ranks settle, at the "
                   f"latest {self.fence_s:.0f}s after each fetch's deadline")
        elif total >= 2 * self.max_quarantined_blocks:  # many instances (or one under many addresses)
            why = (f"{total} blocks of this decode rank are quarantined (at most {2 * self.max_quarantined_blocks} "
                   f"for all prefill instances together): fetches are refused until some settle, at the latest "
                   f"{self.fence_s:.0f}s after each fetch's deadline")
        if why:
            self._announce(self.ledger.finish(f, FetchError(f.transfer_key, None, why), track=False))
            return
        if not self.ledger.begin(f):
            self._announce(self.ledger.finish(f, FetchError(f.transfer_key, None, "a fetch of this request is "
                                                            "already running"), track=False))
            return
        q = self._query(f.bootstrap)
        if q.table is not None:
            self._dispatch(f, q.table)
        else:
            self._waiting.setdefault(f.bootstrap, []).append(f)

    def _query(self, bootstrap: str) -> RankTableQuery:
        if self._dir.full(bootstrap):
            self._collect(float("inf"))
        return self._dir.query(bootstrap)

    def _collect(self, idle_s: float | None = None) -> None:
        """Close the table queries and rank links nothing has used for ``idle_s`` (inf: none
        in use now; None: ``directory.IDLE_S``): no fetch, release or quarantined attempt
        needs them."""
        in_use = {f.bootstrap for f in self.ledger.active()} | {b for b, fs in self._waiting.items() if fs}
        for bootstrap in self._dir.collect(in_use, self.ledger.busy, idle_s):
            self._waiting.pop(bootstrap, None)

    def _queue_release(self, rel: tuple) -> None:
        self._query(rel[1])
        self._dir.queue_release(rel)

    def _dispatch(self, f: Fetch, table: RankTable):
        f.table = table
        if f.remote_engine_id is not None and f.remote_engine_id != table.engine_id:
            return self._fail(f, FetchError(f.transfer_key, None, (
                f"the request names prefill engine {f.remote_engine_id!r}, but {f.bootstrap} serves engine "
                f"{table.engine_id!r} (restarted, or another instance on that address)")))
        fp = self.fingerprint
        f.senders = tuple(int(r) for r in senders_for(table.layers, table.heads, fp.num_layers, fp.num_kv_heads,
                                                      self.heads))
        # The fence: the fetch's deadline on the wall clock and as the time left, which the
        # prefill ranks read.
        budget = int(max(0.0, f.deadline - time.monotonic()) * 1e9)
        not_after = time.time_ns() + budget
        me = RegisterConsumer.of(self.engine_id, self.transport.session_id, self.memory)
        for cp_rank in f.senders:
            addr = table.addresses[cp_rank]
            attempt = next(self._attempts)
            consumer_rank, consumer_size = self._dir.askers(table, cp_rank)
            msg = TransferRequest.build(
                regions=self.regions, transfer_key=f.transfer_key, attempt_id=attempt, engine_id=self.engine_id,
                consumer_rank=consumer_rank, consumer_size=consumer_size, dcp_size=self.dcp_size,
                dcp_rank=self.dcp_rank, block_ids=f.block_ids, num_tokens=f.num_tokens, first_page=f.first_page,
                num_blocks=self.num_blocks, fingerprint=self.fingerprint, wait_s=f.prefill_wait_s,
                head_start=self.heads.start, head_end=self.heads.stop, prompt_digest=f.prompt_digest,
                verify=self.verify_kv, not_after_ns=not_after, budget_ns=budget)
            try:
                link = self._dir.link(addr, table, cp_rank)
                sent = link.register(me) and link.send(msg)  # in order on the link: registered first
            except MessageError as e:  # this request cannot be put on the wire (a key too long, ...)
                return self._fail(f, FetchError(f.transfer_key, cp_rank, f"cannot send the request: {e}"))
            if not sent:
                return self._fail(f, FetchError(f.transfer_key, cp_rank, (
                    f"the side channel to {addr} is full: the rank has not read its last messages")),
                    peer_fault=True)
            self.ledger.sent(f, cp_rank, addr, attempt)

    # ---- the bootstrap server ----

    def _read_table(self, q: RankTableQuery):
        try:
            table = q.read()
        except MessageError as e:
            if isinstance(e, FingerprintMismatch) and q.refused is not None:
                self._dir.release_to_refused(q)
            return self._no_table(q, str(e))
        if table is None:
            return
        self._forget_restarted(q.address, table)
        for f in self._waiting.pop(q.address, []):
            if self.ledger.is_active(f):
                self._guard(self._dispatch, f, table, fetch=f)
        self._dir.send_releases()

    def _no_table(self, q: RankTableQuery, why: str):
        q.forget()
        for f in self._waiting.pop(q.address, []):
            self._finish(f, FetchError(f.transfer_key, None, f"bootstrap {q.address}: {why}"))

    def _forget_restarted(self, bootstrap: str, table: RankTable):
        """Quarantined attempts on ranks of ``bootstrap`` whose link is down and whose
        address the instance's new rank table no longer lists were restarted: their
        old process, the only one that could write into those blocks, is gone."""
        for addr in self._dir.restarted(table):
            self._announce(self.ledger.settle_rank(addr, bootstrap, "restarted"))
            if not self.ledger.busy(addr):
                self._dir.close_link(addr)

    # ---- the CP ranks ----

    def _link(self, link: Link):
        if link_events(link.monitor):
            link.down = True
            link.registered = ""  # a restarted rank knows nothing of it: register again
            self._lost(link, "connection lost")

    def _read(self, link: Link):
        try:
            payload = link.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = self.auth.unpack(payload, (TransferOutcome, Reply), me=self.identity)
        except MessageError as e:  # AuthError included: an answer that is not the rank's is no answer
            return self._lost(link, f"malformed reply: {e}")
        if isinstance(msg, Reply):  # the rank could not read a message of ours at all (its protocol differs)
            return self._lost(link, f"rejected: {msg.reason}")
        link.down, link.used = False, time.monotonic()  # a rank process answers on this link
        answer = self.ledger.answered(link.address, msg, self.cancel_grace_s)
        if answer.quarantined:
            self._backoff(link)
            self._renew_target()
        self._act(answer)
        f, cp_rank = answer.fetch, answer.cp_rank
        if f is None:
            return
        if not msg.ok:
            link.registered = ""  # the rank may have lost or refused it: the next fetch registers again
            return self._fail(f, FetchError(f.transfer_key, cp_rank, msg.reason))
        pages = -(-f.num_tokens // self.fingerprint.page_size)
        if (msg.num_tokens, msg.num_pages) != (f.num_tokens, pages):
            return self._fail(f, FetchError(f.transfer_key, cp_rank, (
                f"length mismatch: this decode expects {f.num_tokens} tokens ({pages} pages), the prefill "
                f"wrote {msg.num_tokens} tokens ({msg.num_pages} pages)")))
        f.outcomes[cp_rank] = msg
        if not f.inflight:
            bad = self._check(f) if self.verify_kv else None
            if bad is not None:
                return self._fail(f, bad)
            self._finish(f, None)

    def _check(self, f: Fetch) -> FetchError | None:
        """``verify_kv``: the first CP rank whose checksum this rank's KV does not match, as
        the fetch's error (None: every path's bytes are what its rank wrote)."""
        pages = -(-f.num_tokens // self.fingerprint.page_size)
        for cp_rank in f.senders:
            try:
                layers, heads = f.table.shard(cp_rank)
                path = path_ranges(self.regions, f.block_ids, list(layers), self.dcp_size,
                                   self.dcp_rank, f.first_page, pages, self.heads, heads)
                kv = self.memory if self.kv_bytes is None else self.kv_bytes
                got, sent = checksum(kv, path.dst, path.length, path.dst), f.outcomes[cp_rank].checksum
            except ValueError as e:
                return FetchError(f.transfer_key, cp_rank, f"{CORRUPT}: cannot read the KV to check it: {e}")
            if got != sent:
                return FetchError(f.transfer_key, cp_rank, (
                    f"{CORRUPT}: the {path.nbytes} bytes cp rank {cp_rank} wrote hash to {got} here, it sent "
                    f"{sent or 'no checksum'}: a page arrived wrong (or not at all)"))
        return None

    def _lost(self, link: Link, why: str):
        """``link`` failed, or its rank sent something we cannot read: fail the fetches
        in flight to it. They stay in flight (it may still be writing) until it
        answers their cancel, which waits in ZMQ's queue until the link is back."""
        self._dir.forget_tables_with(link.address)  # the rank may come back elsewhere
        link.registered = ""  # and know nothing of this link: register again
        for f, cp_rank, _ in self.ledger.on_rank(link.address):
            if f.failing is None:
                self._fail(f, FetchError(f.transfer_key, cp_rank, f"{why} ({link.address})"), peer_fault=True)

    # ---- how a fetch ends ----

    def _fail(self, f: Fetch, error: FetchError, peer_fault: bool = False):
        """Fail ``f`` once no CP rank can still write into its blocks: the attempts still
        in flight get a ``CancelTransfer``; ``f`` ends when each answered, at the
        latest ``cancel_grace_s`` later with the silent ones quarantined."""
        cancels, ended = self.ledger.fail(f, error, self.cancel_grace_s, peer_fault)
        self._act(Answer(cancels=cancels, key=f.transfer_key, output=ended))

    def _act(self, answer: Answer) -> None:
        """Do what the ledger left to do: tell the owner, ask for a table again, send the cancels."""
        self._announce(answer.output)
        if answer.requery:
            self._dir.forget_table(answer.requery)
        for addr, attempt in answer.cancels:
            link = self._dir.link_at(addr)
            if link is not None:  # a full queue: the attempt is quarantined at the grace
                link.send(CancelTransfer(answer.key, attempt))

    def _finish(self, f: Fetch, error: FetchError | None, peer_fault: bool = False):
        self._announce(self.ledger.finish(f, error, peer_fault=peer_fault))
        if peer_fault or f.peer_fault:
            self._dir.forget_table(f.bootstrap)  # re-query: a rank may have moved

    def _announce(self, output: bool = True) -> None:
        """After the ledger ended a fetch or lifted a quarantine (``output``): tell the owner
        (``on_output``), once ``poll``/``poll_lifted`` return it."""
        if not output or self.on_output is None:
            return
        try:
            self.on_output()
        except Exception:  # only a wake-up: whoever polls sees the output at its next poll anyway
            log.exception("decode rank %d: on_output failed", self.dcp_rank)

    def _backoff(self, link: Link) -> None:
        """A new attempt is quarantined on ``link``: ask it again from the first wait."""
        link.backoff.reset()
        link.cancel_at = time.monotonic() + link.backoff.next()

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

    # ---- timers: table queries, cancel re-sends, deadlines ----

    def _tick(self):
        now = time.monotonic()
        if now >= self._collect_at:
            self._collect_at = now + 1.0
            self._collect()
        for bootstrap, waiting in list(self._waiting.items()):
            self._waiting[bootstrap] = [f for f in waiting if self.ledger.is_active(f)]
            if self._waiting[bootstrap]:
                self._dir.ask(bootstrap, now)
        self._dir.ask_for_releases(now)
        self._dir.send_releases()
        for link in self._dir.links():  # ask quarantining ranks again, less and less often
            unsettled = self.ledger.unsettled_on(link.address)
            if unsettled and now >= link.cancel_at:
                for attempt, f in unsettled:
                    if not link.send(CancelTransfer(f.transfer_key, attempt)):
                        break  # its queue is full: nothing more to queue until it reads
                link.cancel_at = now + link.backoff.next()
        for f in [f for f in self.ledger.active() if f.failing is not None and f.settle_by <= now]:
            for cp_rank, where in list(f.inflight.items()):
                self.ledger.quarantine(f, cp_rank, where, f"no answer to the cancel within {self.cancel_grace_s:.0f}s")
                self._backoff(self._dir.link_at(where[0]))
            self._finish(f, f.failing, peer_fault=f.peer_fault)
        self._announce(self.ledger.settle_fenced(now, self.fence_s))
        for f in [f for f in self.ledger.active() if f.failing is None and f.deadline <= now]:
            if f.table is None:
                why = f"no rank table from bootstrap {f.bootstrap} ({self._dir.why_no_table(f.bootstrap)})"
                cp_rank = None
            else:
                pending = sorted(f.inflight)
                cp_rank, why = (pending[0] if pending else None), f"no outcome from cp ranks {pending}"
            self._fail(f, FetchError(f.transfer_key, cp_rank, f"timed out after {now - f.started:.1f}s: {why}"),
                       peer_fault=True)
