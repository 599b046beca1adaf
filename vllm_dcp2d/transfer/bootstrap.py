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

Public API
----------
``class BootstrapError(RuntimeError)``: no answer in time, or an error answer.
``BootstrapServer(host="127.0.0.1", port=0, token="", auth=Auth())``: registry thread of one
    prefill instance; registrations must carry ``token``, every frame passes ``auth``.
    ``.address -> str`` ("tcp://host:port"), ``.port -> int``,
    ``.ranks() -> dict[int, str]``, ``.table() -> RankTable | Reply``, ``.close()``; a context manager.
``request(address, msg, expect, timeout_s, auth=Auth()) -> message``: one round trip on a fresh socket.
``register_rank(server, msg: RegisterRank, timeout_s=10.0, auth=Auth()) -> None``: retries until acknowledged.
``query_ranks(server, engine_id, timeout_s=10.0, auth=Auth()) -> RankTable``: retries until all ranks registered.
``socket(kind) -> zmq.Socket``: every side-channel socket: no linger, no handshake deadline,
    inbound messages bounded (``MAXMSGSIZE``, ``RCVHWM``: a peer that sends more is cut off).
``TableQuery(address, engine_id, accept, auth=Auth())``: the non-blocking client a decode rank's poll loop
    uses (``ask(now)``, ``read()``, ``forget()``, ``.table``); ``accept(table)`` raises
    ``FingerprintMismatch`` for a table this rank cannot fetch from.
``Backoff``: the one resend schedule (1, 2, 4, ... s) of every unanswered message.
``Waker``: lets any thread interrupt a poll loop (``wake()``, ``.socket``, ``drain()``, ``close()``).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import threading
import time

import numpy as np
import zmq

from vllm_dcp2d.transfer.auth import Auth, AuthError, PeerLog
from vllm_dcp2d.transfer.messages import (MAX_MESSAGE_BYTES, MessageError, QueryRanks, RankTable, RegisterRank,
                                           Reply, encode)

__all__ = ["BootstrapError", "BootstrapServer", "Backoff", "TableQuery", "Waker", "request", "register_rank",
           "query_ranks", "bind", "send_nowait", "dealer", "socket"]

log = logging.getLogger(__name__)
_ids = itertools.count()
POLL_S = 0.1  # how often background loops check their stop flag
RESEND_S, RESEND_MAX_S = 1.0, 8.0  # an unanswered bootstrap message is sent again after 1, 2, 4, 8, 8, ... s
MAX_FRAME = MAX_MESSAGE_BYTES + 1024  # a message plus its seal (``auth``)
RCV_HWM = 64  # frames queued from one peer before ZMQ stops reading it: at most RCV_HWM x MAX_FRAME held
NO_AUTH = Auth()


class BootstrapError(RuntimeError):
    """A bootstrap exchange failed: timeout, error reply or malformed reply."""


def context() -> zmq.Context:
    return zmq.Context.instance()


def socket(kind: int) -> zmq.Socket:
    s = context().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    # No ZMTP handshake deadline (ZMQ's default is 30 s): on an overloaded host a
    # handshake can take longer, and ZMQ then drops the connection and reports it
    # as lost. Every wait here has its own deadline; a dead peer closes its TCP
    # connection, which the disconnect monitors see.
    s.setsockopt(zmq.HANDSHAKE_IVL, 0)
    # A frame over the wire's limit is not buffered (ZMQ drops the peer), and one peer
    # cannot queue more than RCV_HWM frames: what a peer can make this process hold is
    # bounded before any byte of it is decoded.
    s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    s.setsockopt(zmq.RCVHWM, RCV_HWM)
    return s


def send_nowait(sock: zmq.Socket, payload: bytes) -> bool:
    """Queue ``payload`` on ``sock`` without blocking: False when its queue is full
    (``SNDHWM`` messages for a peer that does not read). No thread here ever blocks
    on a peer: a dead one fills a queue, and the caller gives up on that message."""
    try:
        sock.send(payload, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def dealer(address: str, options: dict | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to ``address`` (``options``: socket options set first) and its
    disconnect monitor. If ZMQ refuses anything (the address, no file descriptor left
    for the monitor), closes what it opened and raises ValueError naming the address:
    the caller fails only what needed that peer, and no socket leaks."""
    sock, monitor = socket(zmq.DEALER), None
    try:
        for opt, value in (options or {}).items():
            sock.setsockopt(opt, value)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
    except zmq.ZMQError as e:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close()
        sock.close()
        raise ValueError(f"cannot connect to {address!r}: {e}") from None
    return sock, monitor


def bind(sock: zmq.Socket, host: str, port: int = 0) -> str:
    """Bind ``sock`` to ``tcp://host:port`` (0 = a free port); returns the address."""
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


class Waker:
    """An inproc PUSH/PULL pair: ``wake()`` from any thread makes ``.socket`` readable."""

    def __init__(self):
        name = f"inproc://dcp2d-wake-{os.getpid()}-{next(_ids)}"
        self.socket = socket(zmq.PULL)
        self.socket.bind(name)
        self._push = socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 4)
        self._push.connect(name)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already queued

    def drain(self) -> None:
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        with self._lock:
            self._push.close()
        self.socket.close()


def request(address: str, msg, expect, timeout_s: float, auth: Auth = NO_AUTH):
    """Send ``msg`` to the ROUTER at ``address`` and return its decoded reply.

    Raises BootstrapError on timeout or a malformed reply; a fresh DEALER per
    call so a lost reply never desynchronizes a later one.
    """
    sock = socket(zmq.DEALER)
    try:
        sock.connect(address)
        if not send_nowait(sock, auth.pack(msg)):
            raise BootstrapError(f"could not queue {type(msg).__name__} for {address}")
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise BootstrapError(f"no reply from {address} within {timeout_s:.1f}s to {type(msg).__name__}")
        try:
            return auth.unpack(sock.recv(), expect)
        except MessageError as e:
            raise BootstrapError(f"bad reply from {address}: {e}") from None
    finally:
        sock.close()


class Backoff:
    """How long to wait for an answer before asking again: 1, 2, 4, ... ``max_s``.
    With a fixed short wait, a host too loaded to connect and answer within it
    never succeeds; asking ever more rarely keeps a silent peer from being flooded."""

    def __init__(self, max_s: float = RESEND_MAX_S):
        self.max_s = max_s
        self.reset()

    def reset(self) -> None:
        self.wait_s = RESEND_S

    def next(self) -> float:
        """The current wait; the following one is twice as long (capped)."""
        wait, self.wait_s = self.wait_s, min(2 * self.wait_s, self.max_s)
        return wait


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


def register_rank(server: str, msg: RegisterRank, timeout_s: float = 10.0, auth: Auth = NO_AUTH) -> None:
    """Register a prefill CP rank's side-channel address with ``server``; retried
    (the server may start after the rank) until acknowledged or ``timeout_s``."""
    _retry(f"registering cp rank {msg.cp_rank}", server, timeout_s,
           lambda t: request(server, msg, Reply, t, auth))


def query_ranks(server: str, engine_id: str, timeout_s: float = 10.0, auth: Auth = NO_AUTH) -> RankTable:
    """The rank table of the prefill instance behind ``server``; retried until every
    CP rank has registered or ``timeout_s`` passes."""
    return _retry("querying the rank table", server, timeout_s,
                  lambda t: request(server, QueryRanks(engine_id), (RankTable, Reply), t, auth))


class BootstrapServer:
    """Registry of one prefill instance: CP rank -> side-channel address.

    Runs a ROUTER socket in a daemon thread. Answers ``RegisterRank`` with a
    ``Reply`` (a rank may re-register, e.g. after a restart; cp_size and the
    fingerprint must match the ranks already registered) and ``QueryRanks``
    with a ``RankTable`` once all ranks are in, else a ``Reply`` naming the
    missing ranks. Malformed input gets a ``Reply(ok=False)`` and is logged.

    token: what a ``RegisterRank`` must carry (the instance's own ranks have it,
    ``WorkerSide`` hands it out over the TP group): without it nobody else can put
    an address in the table. auth: every frame is opened and sealed with it; a frame
    it refuses gets a plain ``Reply`` saying so (it says only that, to anyone).

    Each message is handled and answered in one guard: nothing a peer sends, however
    long or malformed, stops the thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "", auth: Auth = NO_AUTH):
        self._sock = socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = bind(self._sock, host, port)
        self.port = int(self.address.rsplit(":", 1)[1])
        self.failed = ""  # why the server thread died ("" while it runs)
        self._lock = threading.Lock()
        self._ranks: dict[int, RegisterRank] = {}
        self._token = token
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
        try:
            frame = self._handle(payload)
        except AuthError as e:  # said in the clear, to anyone: only that it was refused
            self._peers.warn("auth", "bootstrap %s: %s", self.address, str(e))
            frame = encode(Reply(False, f"refused: {e}"))
        except Exception as e:  # a bug, not bad input: answer it, keep serving
            log.exception("bootstrap %s: handling a message failed", self.address)
            frame = self._seal(Reply(False, f"bootstrap could not handle the message: {type(e).__name__}: {e}"))
        try:  # ROUTER_MANDATORY: a peer that went away raises instead of blocking
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._peers.warn("send", "bootstrap %s: answer to a peer dropped: %s", self.address, str(e))

    def _seal(self, reply) -> bytes:
        return self.auth.pack(reply)

    def _handle(self, payload: bytes) -> bytes:
        """The sealed answer to one frame; raises ``AuthError`` for a frame ``auth`` refuses."""
        try:
            msg = self.auth.unpack(payload, (RegisterRank, QueryRanks))
        except AuthError:
            raise
        except MessageError as e:
            self._peers.warn("rejected", "bootstrap %s: rejected message: %s", self.address, str(e))
            return self._seal(Reply(False, f"rejected: {e}"))
        try:
            with self._lock:
                answer = self._register(msg) if isinstance(msg, RegisterRank) else self._table(msg)
        except Exception as e:  # a bug, not bad input: answer it, keep serving
            log.exception("bootstrap %s: handling %s failed", self.address, type(msg).__name__)
            answer = Reply(False, f"bootstrap could not handle {type(msg).__name__}: {type(e).__name__}: {e}")
        return self._seal(answer)

    def _register(self, msg: RegisterRank) -> Reply:
        if not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            self._peers.warn("token", "bootstrap %s: a registration of cp rank %d at %s without this instance's "
                             "token was refused", self.address, msg.cp_rank, msg.address)
            return Reply(False, f"registration of cp rank {msg.cp_rank} refused: it does not carry this "
                                f"instance's registration token")
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


class TableQuery:
    """A decode rank's client of one prefill instance's ``BootstrapServer``, for a
    poll loop that owns it (the receiver's thread): a DEALER (``.sock``) and its
    disconnect monitor (``.monitor``) to register with the loop's poller.

    ``ask(now)`` sends ``QueryRanks`` when one is due: at once, again after
    ``Backoff`` waits without an answer (on the same socket: ZMQ reconnects to a
    restarted server by itself), and ``QUERY_RETRY_S`` after a "not every rank
    registered" reply. ``read()`` takes one reply: the ``RankTable`` (also kept
    in ``.table``), or None; raises ``MessageError`` for a malformed reply, or what
    ``accept(table)`` raises (``FingerprintMismatch``: a table of another KV format or
    sharding, kept in ``.refused``). ``forget()`` drops the table (ask again).
    """

    QUERY_RETRY_S = 0.05

    def __init__(self, address: str, engine_id: str, accept, auth: Auth = NO_AUTH):
        self.address, self.engine_id, self.accept, self.auth = address, engine_id, accept, auth
        self.sock, self.monitor = dealer(address)
        self.table: RankTable | None = None
        self.refused: RankTable | None = None  # the last table read, if its fingerprint differs
        self.last_reason = "no answer"
        self._asked = 0.0      # when the unanswered query went out (0: none out)
        self._retry_at = 0.0
        self._backoff = Backoff()

    def ask(self, now: float) -> None:
        if self.table is not None:
            return
        if self._asked and now - self._asked > self._backoff.wait_s:
            self._backoff.next()
            self._asked = 0.0
        if not self._asked and now >= self._retry_at:
            # a full queue (server unreachable for long): asked again after the next wait
            send_nowait(self.sock, self.auth.pack(QueryRanks(self.engine_id)))
            self._asked = now

    def read(self) -> RankTable | None:
        payload = self.sock.recv()
        self._asked = 0.0
        self._backoff.reset()
        msg = self.auth.unpack(payload, (RankTable, Reply))
        if isinstance(msg, Reply):
            self.last_reason = msg.reason
            if msg.reason.startswith(("refused:", "rejected:")):  # will not change by asking again
                raise MessageError(f"the bootstrap server {msg.reason}")
            self._retry_at = time.monotonic() + self.QUERY_RETRY_S  # not every rank registered yet
            return None
        self.refused = msg  # a table of another KV format: its ranks can still be told to free a request
        self.accept(msg)
        self.refused = None
        self.table = msg
        return msg

    def forget(self) -> None:
        self.table, self._asked = None, 0.0

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
