"""Parties between two peers: a TCP relay that records what passes (what a party on the
path sees), and an HTTP server that answers what it is told (``Answer``: a bootstrap
address serving what another server said, or something else entirely).

``Wiretap(target)`` listens on a free loopback port (``.address``, the same scheme as
``target``: ``tcp://host:port``) and relays every connection to ``target`` in both
directions, keeping the bytes each way (``.sent``: client to target, ``.received``:
target to client). Threads of its own; ``close()`` ends them.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler


class Wiretap:
    def __init__(self, target: str):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self._srv.getsockname()[1]}"
        self.sent, self.received = bytearray(), bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=5)
            self._socks += [client, upstream]
            for a, b, log in ((client, upstream, self.sent), (upstream, client, self.received)):
                threading.Thread(target=self._pipe, args=(a, b, log), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, log: bytearray) -> None:
        a.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = a.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            with self._lock:
                log += data
            try:
                b.sendall(data)
            except OSError:
                break
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for s in self._socks:
            s.close()


class Answer(BaseHTTPRequestHandler):
    """Answers every ``GET`` with 200 and ``body()`` (a subclass says what)."""

    def body(self) -> bytes:
        raise NotImplementedError

    def do_GET(self):  # noqa: N802 - http.server's name
        data = self.body()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass
