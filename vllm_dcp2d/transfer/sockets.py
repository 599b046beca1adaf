"""The side channels' ZMQ sockets, as every part of the transfer opens them: one
context, sockets that never linger and bound what a peer can queue, sends that
never block, binding, the one resend schedule (``Backoff``) and the wake-up of a
poll loop (``Waker``). What travels on them is ``messages``; who talks to whom,
``bootstrap``, ``sender`` and ``receiver``.
"""

from __future__ import annotations

import itertools
import os
import threading

import zmq

from vllm_dcp2d.transfer.auth import SEAL_BYTES
from vllm_dcp2d.transfer.messages import MAX_MESSAGE_BYTES

__all__ = ["Backoff", "Waker", "bind", "context", "dealer", "send_nowait", "socket", "POLL_S", "MAX_FRAME"]

_ids = itertools.count()
POLL_S = 0.1  # how often background loops check their stop flag
RESEND_S, RESEND_MAX_S = 1.0, 8.0  # an unanswered message is sent again after 1, 2, 4, 8, 8, ... s
MAX_FRAME = MAX_MESSAGE_BYTES + SEAL_BYTES  # a message plus its seal (``auth``)
RCV_HWM = 64  # frames queued from one peer before ZMQ stops reading it: at most RCV_HWM x MAX_FRAME held


def context() -> zmq.Context:
    return zmq.Context.instance()


def socket(kind: int, max_frame: int = MAX_FRAME) -> zmq.Socket:
    """A socket of ``kind`` that reads frames of at most ``max_frame`` bytes (a socket that
    takes only small messages is given ``auth.frame_limit`` of them)."""
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
    s.setsockopt(zmq.MAXMSGSIZE, max_frame)
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
