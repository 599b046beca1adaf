"""How prefill and decode find each other: one ZMQ bootstrap port per prefill
instance (design §6.7).

Each prefill CP rank runs a ``sender.Sender`` with its own ZMQ ROUTER socket
(its side channel) and registers that address with the instance's
``BootstrapServer``. A decode rank asks the server once for the ``RankTable``
(``addresses[cp_rank]``) and then talks to every CP rank directly: ranks are
addressed explicitly and the per-request DCP topology rides in each
``TransferRequest``. Every receive here is a ``zmq.Poller`` wait with a timeout,
sockets have ``linger=0``, so a peer that disappears yields ``BootstrapError``
(or a failed fetch upstream), never a hang.

Here: the server (``BootstrapServer``), a rank's registration with it
(``register_rank``, sealed with the instance's registration token: ``auth``) and a
decode rank's non-blocking client of it for its poll loop (``TableQuery``;
``http_bootstrap.HttpTableQuery`` asks over HTTP), whose answer is sealed for its
query (``QueryRanks.reply_to``); the sockets they all open are ``sockets``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import numpy as np
import zmq

from vllm_dcp2d.transfer.auth import BOOTSTRAP, MAGIC, NO_AUTH, Auth, AuthError, PeerLog, frame_limit, rank_name
from vllm_dcp2d.transfer.messages import MessageError, QueryRanks, RankTable, RegisterRank, Reply, clip, encode
from vllm_dcp2d.transfer.sockets import POLL_S, Backoff, bind, dealer, send_nowait, socket

__all__ = ["BootstrapError", "BootstrapServer", "RankTableQuery", "TableQuery", "request", "register_rank"]

log = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """A bootstrap exchange failed: timeout, error reply or malformed reply."""


def request(address: str, msg, expect, timeout_s: float, auth: Auth = NO_AUTH, *, to: str = BOOTSTRAP,
            me: str | bytes = ""):
    """Send ``msg`` (sealed for ``to``) to the ROUTER at ``address`` and return its decoded
    reply (sealed for ``me``: ``QueryRanks.reply_to``, a registering rank's ``rank_name``).

    Raises BootstrapError on timeout or a malformed reply; a fresh DEALER per
    call so a lost reply never desynchronizes a later one.
    """
    sock = socket(zmq.DEALER)
    try:
        sock.connect(address)
        if not send_nowait(sock, auth.pack(msg, to=to)):
            raise BootstrapError(f"could not queue {type(msg).__name__} for {address}")
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise BootstrapError(f"no reply from {address} within {timeout_s:.1f}s to {type(msg).__name__}")
        try:
            return auth.unpack(sock.recv(), expect, me=me)
        except MessageError as e:
            raise BootstrapError(f"bad reply from {address}: {e}") from None
    finally:
        sock.close()


def _retry(what: str, server: str, timeout_s: float, attempt):
    """Call ``attempt(seconds)`` until it returns a non-error reply, each attempt
    waiting as ``Backoff`` says."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    answer = ""  # the server's last refusal: the reason worth reporting, even if
    # a later attempt, cut short by the deadline, got no reply at all
    backoff = Backoff()
    wait = backoff.next()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f"{answer} (then: {last})" if answer and last != answer else last
            raise BootstrapError(f"{what} via {server} failed within {timeout_s:.1f}s: {why}")
        try:
            reply = attempt(min(left, wait))
        except BootstrapError as e:
            last = str(e)
            wait = backoff.next()
        else:
            if not isinstance(reply, Reply) or reply.ok:
                return reply
            last = answer = reply.reason
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def register_rank(server: str, msg: RegisterRank, timeout_s: float = 10.0, auth: Auth = NO_AUTH,
                  token: str = "") -> None:
    """Register a prefill CP rank's side-channel address with ``server``, sealed with the
    instance's registration ``token`` (``Auth.registration``; it never travels); retried
    (the server may start after the rank) until acknowledged or ``timeout_s``."""
    seal = auth.registration(token)
    _retry(f"registering cp rank {msg.cp_rank}", server, timeout_s,
           lambda t: request(server, msg, Reply, t, seal, me=rank_name(msg.engine_id, msg.cp_rank)))


class BootstrapServer:
    """Registry of one prefill instance: CP rank -> side-channel address.

    Runs a ROUTER socket in a daemon thread. Answers ``RegisterRank`` with a
    ``Reply`` (a rank may re-register, e.g. after a restart; cp_size and the
    fingerprint must match the ranks already registered) and ``QueryRanks``
    with a ``RankTable`` once all ranks are in, else a ``Reply`` naming the
    missing ranks. Malformed input gets a ``Reply(ok=False)`` and is logged.

    token: the key a ``RegisterRank`` must be sealed with (``Auth.registration``; the
    instance's own ranks have it, the connector's worker base hands it out over the TP group): without
    it nobody else can put an address in the table. auth: every other frame is opened
    with it and every answer to a query sealed with it, for the query
    (``QueryRanks.reply_to``); a frame it refuses, or one it cannot read, gets a plain
    ``Reply`` saying so (it says only that, to anyone). Frames past the largest
    ``RegisterRank`` or ``QueryRanks`` are not read (ZMQ's ``MAXMSGSIZE``).

    Each message is handled and answered in one guard: nothing a peer sends, however
    long or malformed, stops the thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "", auth: Auth = NO_AUTH):
        self._sock = socket(zmq.ROUTER, frame_limit((RegisterRank, QueryRanks)))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = bind(self._sock, host, port)
        self.port = int(self.address.rsplit(":", 1)[1])
        self.failed = ""  # why the server thread died ("" while it runs)
        self._lock = threading.Lock()
        self._ranks: dict[int, RegisterRank] = {}
        self._registration = auth.registration(token)
        self.auth = auth
        self._peers = PeerLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"dcp2d-bootstrap-{self.port}", daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def ranks(self) -> dict[int, str]:
        with self._lock:
            return {r: m.address for r, m in sorted(self._ranks.items())}

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self):
        try:
            while not self._stop.is_set():
                if self._sock.poll(int(POLL_S * 1000), zmq.POLLIN):
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    if len(frames) == 2:
                        self._serve(*frames)
        except Exception:
            self.failed = "bootstrap thread died"
            log.exception("bootstrap %s: %s", self.address, self.failed)
        finally:
            self._sock.close()

    def _serve(self, identity: bytes, payload: bytes) -> None:
        """Answer one frame; whatever it holds, the server goes on."""
        frame = self.answer(payload)
        try:  # ROUTER_MANDATORY: a peer that went away raises instead of blocking
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._peers.warn("send", "bootstrap %s: answer to a peer dropped: %s", self.address, str(e))

    def answer(self, payload: bytes) -> bytes:
        """The answer to one frame (a query's, sealed for it; a plain ``Reply`` to what it
        refuses or cannot read). Thread-safe: ``http_bootstrap`` answers from it too."""
        try:
            return self._handle(payload)
        except AuthError as e:  # said in the clear, to anyone: only that it was refused
            self._peers.warn("auth", "bootstrap %s: %s", self.address, str(e))
            return encode(Reply(False, f"refused: {e}"))
        except Exception as e:  # a bug, not bad input: answer it, keep serving
            log.exception("bootstrap %s: handling a message failed", self.address)
            return encode(Reply(False, f"bootstrap could not handle the message: {type(e).__name__}: {e}"))

    def _handle(self, payload: bytes) -> bytes:
        """The answer to one frame, sealed for whoever sent it (a query's ``reply_to``, a
        registering rank), or a plain ``Reply`` to a message it cannot read or will not take;
        raises ``AuthError`` for a frame it refuses unread. A registration is read with the
        registration token's seal, anything else with ``auth``."""
        registering = self._registration.holds(payload)
        try:
            if registering:
                msg = self._registration.unpack(payload, RegisterRank, me=BOOTSTRAP)
            else:
                msg = self.auth.unpack(payload, (RegisterRank, QueryRanks), me=BOOTSTRAP)
        except AuthError as e:
            if not self.auth.enabled and bytes(payload[:4]) == MAGIC and not registering:
                raise AuthError(f"{e}; or it is a registration sealed with another instance's registration "
                                f"token") from None
            raise
        except MessageError as e:  # read, but not a message of ours: whoever sent it gets the reason in the clear
            self._peers.warn("rejected", "bootstrap %s: rejected message: %s", self.address, str(e))
            return encode(Reply(False, f"rejected: {e}"))
        if not registering and isinstance(msg, RegisterRank):
            self._peers.warn("token", "bootstrap %s: a registration of cp rank %d at %s not sealed with this "
                             "instance's registration token was refused", self.address, msg.cp_rank, msg.address)
            return encode(Reply(False, f"refused: the registration of cp rank {msg.cp_rank} is not sealed with "
                                       f"this instance's registration token"))
        try:
            with self._lock:
                answer = self._register(msg) if registering else self._table(msg)
        except Exception as e:  # a bug, not bad input: answer it, keep serving
            log.exception("bootstrap %s: handling %s failed", self.address, type(msg).__name__)
            answer = Reply(False, f"bootstrap could not handle {type(msg).__name__}: {type(e).__name__}: {e}")
        if registering:
            return self._registration.pack(answer, to=rank_name(msg.engine_id, msg.cp_rank))
        return self.auth.pack(answer, to=msg.reply_to)

    def _register(self, msg: RegisterRank) -> Reply:
        for other in self._ranks.values():
            if other.cp_rank == msg.cp_rank:
                continue
            if (other.engine_id, other.cp_size) != (msg.engine_id, msg.cp_size):
                return Reply(False, f"rank {msg.cp_rank} registers engine {msg.engine_id!r} cp_size "
                                    f"{msg.cp_size}, rank {other.cp_rank} has {other.engine_id!r} "
                                    f"cp_size {other.cp_size}")
            try:
                other.fingerprint.check(msg.fingerprint)
            except MessageError as e:
                return Reply(False, f"rank {msg.cp_rank} vs rank {other.cp_rank}: {e}")
        self._ranks[msg.cp_rank] = msg
        return Reply(True, "")

    def table(self) -> RankTable | Reply:
        """What a ``QueryRanks`` gets now: the ``RankTable``, or a ``Reply`` naming the
        missing ranks (``http_bootstrap`` answers from it too)."""
        with self._lock:
            return self._table(None)

    def _table(self, msg: QueryRanks | None):
        if not self._ranks:
            return Reply(False, "no cp rank registered yet")
        first = next(iter(self._ranks.values()))
        missing = [r for r in range(first.cp_size) if r not in self._ranks]
        if missing:
            return Reply(False, f"{len(self._ranks)} of {first.cp_size} cp ranks registered, missing {missing}")
        ranks = [self._ranks[r] for r in range(first.cp_size)]
        return RankTable(first.engine_id, first.cp_size, tuple(m.address for m in ranks), first.fingerprint,
                         np.array([(m.layer_start, m.layer_end) for m in ranks], np.int64).reshape(-1),
                         np.array([(m.head_start, m.head_end) for m in ranks], np.int64).reshape(-1))


class RankTableQuery:
    """What a decode rank's two clients of a prefill instance's bootstrap share
    (``TableQuery`` over ZMQ, ``http_bootstrap.HttpTableQuery`` over HTTP), for a
    poll loop that owns them (the receiver's thread): ``.sock`` and ``.monitor`` to
    register with the loop's poller; ``ask(now)`` sends a query when one is due;
    ``read()`` takes one answer: the ``RankTable`` (also kept in ``.table``), or None;
    it raises ``MessageError`` for a malformed answer or a refusal, or what
    ``accept(table)`` raises (``FingerprintMismatch``: a table of another KV format or
    sharding, kept in ``.refused``). ``forget()`` drops the table (ask again).
    """

    QUERY_RETRY_S = 0.05  # asked again this soon after a "not every rank registered" answer

    def __init__(self, address: str, engine_id: str, accept, auth: Auth = NO_AUTH):
        self.address, self.engine_id, self.accept, self.auth = address, engine_id, accept, auth
        # what the answers are sealed for: this address, asked by this query (QueryRanks.reply_to)
        self.reply_to = f"{clip(address, 900)} query {secrets.token_hex(8)}"
        self.table: RankTable | None = None
        self.refused: RankTable | None = None  # the last table read, if its fingerprint differs
        self.last_reason = "no answer"
        self._asked = 0.0      # when the unanswered query went out (0: none out)
        self._retry_at = 0.0
        self._backoff = Backoff()

    def _take(self, payload: bytes) -> RankTable | None:
        """One sealed answer of the bootstrap: the table, or None (asked again later)."""
        msg = self.auth.unpack(payload, (RankTable, Reply), me=self.reply_to)
        if isinstance(msg, Reply):
            self.last_reason = msg.reason
            if msg.reason.startswith(("refused:", "rejected:")):  # will not change by asking again
                raise MessageError(f"the bootstrap server {msg.reason}")
            self._backoff.reset()
            self._retry_at = time.monotonic() + self.QUERY_RETRY_S  # not every rank registered yet
            return None
        self._backoff.reset()
        self.refused = msg  # a table of another KV format: its ranks can still be told to free a request
        self.accept(msg)
        self.refused = None
        self.table = msg
        return msg

    def forget(self) -> None:
        self.table, self._asked = None, 0.0


class TableQuery(RankTableQuery):
    """``RankTableQuery`` over ZMQ: a DEALER (``.sock``) and its disconnect monitor
    (``.monitor``). ``ask(now)`` sends ``QueryRanks`` at once, again after ``Backoff``
    waits without an answer (on the same socket: ZMQ reconnects to a restarted server
    by itself), and ``QUERY_RETRY_S`` after a "not every rank registered" answer.
    """

    def __init__(self, address: str, engine_id: str, accept, auth: Auth = NO_AUTH):
        super().__init__(address, engine_id, accept, auth)
        self.sock, self.monitor = dealer(address, {zmq.MAXMSGSIZE: frame_limit((RankTable, Reply))})

    def ask(self, now: float) -> None:
        if self.table is not None:
            return
        if self._asked and now - self._asked > self._backoff.wait_s:
            self._backoff.next()
            self._asked = 0.0
        if not self._asked and now >= self._retry_at:
            # a full queue (server unreachable for long): asked again after the next wait
            send_nowait(self.sock, self.auth.pack(QueryRanks(self.engine_id, self.reply_to), to=BOOTSTRAP))
            self._asked = now

    def read(self) -> RankTable | None:
        payload = self.sock.recv()
        self._asked = 0.0
        self._backoff.reset()
        return self._take(payload)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
