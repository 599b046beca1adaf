"""Mooncake sessions that do not answer as a Mooncake engine does, for the handshake tests:
real TCP listeners on 127.0.0.1 whose ``session`` ("host:port") a test names where a decode's
Mooncake session goes.

``BadPeer(kind)``, ``kind`` one of:
  "silent"     accepts and never answers (a frozen decode does the same: its kernel accepts)
  "garbage"    answers bytes that are not a Mooncake frame: a length of 1000, then 7 bytes, and
               keeps the connection open (Mooncake's reader waits for the rest)
  "drip"       answers a well-framed reply one byte every 0.2 s
  "wrong_type" answers at once a well-framed reply of another message type
  "huge"       answers at once a length of 2**40
  "two_faced"  answers its first connection as the Mooncake engine at ``real`` would (bytes relayed
               both ways), every later one as "silent"
``.accepted``: connections taken so far; ``.first``: set at the first. ``.close()`` ends every
connection (a handshake waiting on one then fails at once).
``closed_session()``: a session on which nothing listens.
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = ["BadPeer", "closed_session", "KINDS"]

KINDS = ("silent", "garbage", "drip", "wrong_type", "huge", "two_faced")


def closed_session() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connect is refused
    return f"127.0.0.1:{port}"


def _frame(kind: int, body: bytes) -> bytes:
    return struct.pack("=Q", 1 + len(body)) + bytes([kind]) + body


class BadPeer:
    def __init__(self, kind: str, real: str = ""):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "two_faced" and not real:
            raise ValueError("a two_faced peer needs the session of a real engine to relay its first connection to")
        self.kind, self.real = kind, real
        self.accepted = 0
        self.first = threading.Event()
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._srv = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.session = f"127.0.0.1:{self._srv.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            self._conns.append(conn)
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn, self.accepted), daemon=True).start()
            self.first.set()

    def _serve(self, conn: socket.socket, n: int) -> None:
        try:
            if self.kind == "garbage":
                conn.sendall(struct.pack("=Q", 1000) + b"garbage")
            elif self.kind == "wrong_type":
                conn.sendall(_frame(3, b'{"status":"success"}\n'))
            elif self.kind == "huge":
                conn.sendall(struct.pack("=Q", 1 << 40))
            elif self.kind == "drip":
                for b in _frame(1, b'{"protocol":"tcp","name":"x"}\n'):
                    if self._stop.wait(0.2):
                        return
                    conn.sendall(bytes([b]))
            elif self.kind == "two_faced" and n == 1:
                self._relay(conn)
        except OSError:
            pass  # the peer went away, or close()

    def _relay(self, conn: socket.socket) -> None:
        host, port = self.real.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as up:
            conn.settimeout(10)
            length = conn.recv(8, socket.MSG_WAITALL)
            (n,) = struct.unpack("=Q", length)
            up.sendall(length + conn.recv(n, socket.MSG_WAITALL))
            head = up.recv(8, socket.MSG_WAITALL)
            (m,) = struct.unpack("=Q", head)
            conn.sendall(head + up.recv(m, socket.MSG_WAITALL))

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
