"""Whether a Mooncake session answers its handshake, asked with a bound before an engine opens it.

Why (security review: one ``TransferRequest`` naming a session that accepts TCP and never
answers held every write of a prefill rank for 60 s). Read from Mooncake's source and
confirmed with the 0.3.13.post1 wheel (``tests/transfer/test_handshake.py``):

- the wheel's ``transfer_submit_write`` (like every transfer call of its Python wrapper)
  opens a session it has not seen *while holding the wrapper's one lock*: the P2P
  handshake (connect, send this engine's segment descriptor, read the peer's). Every other
  submit of that engine, to sessions it knows too, waits on that lock. The GIL is
  released: other Python threads run.
- the handshake's read has a fixed 60 s timeout (``SO_RCVTIMEO`` in
  ``SocketHandShakePlugin::doConnect``, no setting); ``MC_HANDSHAKE_CONNECT_TIMEOUT``
  bounds only the connect (a host that is gone), not a peer that accepts and is silent.
- ``get_first_buffer_address`` opens a session without that lock but holds the GIL: 60 s
  of every Python thread of the process. Never call it with a session a peer named.
- the data plane is per peer: a peer that answered the handshake and then froze costs
  only its own writes (the engine's progress timeout, ``STALL_S``).

So ``Sessions.check`` asks first, on a socket of its own with ``timeout_s`` for the whole
exchange (a peer that drips one byte at a time is cut off too), on the caller's thread
(the session's writer): Mooncake's own metadata request, framed as the engine frames it
(u64 length, host byte order, then a type byte and JSON; a peer ignores the JSON of a
metadata request, ``receivePeerMetadata``). Only a session whose peer answers it in time
with a segment descriptor is handed to the engine. One that failed is refused at once for
``backoff_s`` (``MAX_REMEMBERED`` sessions at most, the oldest forgotten first), so a
decode naming a black hole costs one ``timeout_s`` per back-off, on its own writer.

What this cannot see: a peer that answers this request and not the engine's (or freezes in
between). ``MooncakeTransport`` bounds that window (its ``_open``).

Public API
----------
``probe(session, timeout_s) -> dict``   the peer's segment descriptor; raises ``HandshakeFailed``.
``Sessions(timeout_s, backoff_s)``
    ``.check(session) -> str``          "" if it answered, else why it is refused.
    ``.fail(session, why)``             refuse it for ``backoff_s`` (a failure seen elsewhere).
    ``.take_counts() -> dict``          ``{"handshake_failures", "handshake_refusals"}`` since the last call.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

__all__ = ["HandshakeFailed", "Sessions", "probe", "HANDSHAKE_TIMEOUT_S", "BACKOFF_S", "MAX_REPLY_BYTES",
           "MAX_REMEMBERED"]

HANDSHAKE_TIMEOUT_S = 2.0  # a whole probe (connect, request, answer): 0.05 ms p50, 2.5 ms p90 on a busy 2-core host
BACKOFF_S = 10.0           # a session whose handshake failed is refused this long
MAX_REPLY_BYTES = 1 << 20  # Mooncake's own cap on a handshake message (MC_HANDSHAKE_MAX_LENGTH's default)
MAX_REMEMBERED = 4096      # failed sessions kept; an older one is forgotten (and probed again)
METADATA = 1               # HandShakeRequestType::Metadata, what the engine sends to open a session
_LENGTH = struct.Struct("=Q")  # the engine writes the length as a host-order u64


class HandshakeFailed(Exception):
    """A session did not answer Mooncake's handshake as it should; the message says how."""


def _address(session: str) -> tuple[str, int]:
    host, sep, port = session.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise HandshakeFailed("it is not host:port with a port in [1, 65535]")
    return host, int(port)


def _recv(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """Exactly ``n`` bytes of ``what`` by ``deadline`` (time.monotonic), else HandshakeFailed
    (TimeoutError when none came in time)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(min(n - len(buf), 1 << 16))
        except TimeoutError:
            if buf or what != "its length":
                raise HandshakeFailed(f"only {len(buf)} of the {n} bytes of {what} came in time") from None
            raise
        if not chunk:
            raise HandshakeFailed(f"it closed the connection after {len(buf)} of the {n} bytes of {what}")
        buf += chunk
    return bytes(buf)


def probe(session: str, timeout_s: float) -> dict:
    """Send ``session`` (``host:rpc_port``) the metadata request an engine opens it with and
    return the segment descriptor it answers (a JSON object with ``protocol``). Raises
    ``HandshakeFailed`` saying why when the peer is not ``host:port``, refuses, does not
    answer within ``timeout_s`` (all of it, connect to last byte) or answers something else.
    A host name is resolved outside the bound, and each address it resolves to gets a
    connect of ``timeout_s`` (a session is one address in practice)."""
    try:
        host, port = _address(session)
        deadline = time.monotonic() + timeout_s
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            body = bytes([METADATA]) + b"{}"
            sock.sendall(_LENGTH.pack(len(body)) + body)
            (n,) = _LENGTH.unpack(_recv(sock, _LENGTH.size, deadline, "its length"))
            if not 2 <= n <= MAX_REPLY_BYTES:
                raise HandshakeFailed(f"it answered a length of {n} bytes, expected 2 to {MAX_REPLY_BYTES}")
            reply = _recv(sock, n, deadline, "its answer")
    except TimeoutError:
        raise HandshakeFailed(f"no answer within {timeout_s:g} s") from None
    except OSError as e:
        raise HandshakeFailed(f"{type(e).__name__}: {e}") from None
    if reply[0] != METADATA:
        raise HandshakeFailed(f"it answered message type {reply[0]}, expected {METADATA} (metadata)")
    try:
        desc = json.loads(reply[1:])
    except (UnicodeDecodeError, ValueError) as e:
        raise HandshakeFailed(f"its answer is not JSON ({e})") from None
    if not isinstance(desc, dict) or not isinstance(desc.get("protocol"), str):
        raise HandshakeFailed("its answer is not a segment descriptor (a JSON object with a 'protocol')")
    return desc


class Sessions:
    """Which sessions answered (see the module doc); thread-safe. ``check`` costs one
    probe per call for a session not refused: the caller calls it once per engine open."""

    def __init__(self, timeout_s: float = HANDSHAKE_TIMEOUT_S, backoff_s: float = BACKOFF_S):
        if not timeout_s > 0 or not backoff_s >= 0:
            raise ValueError(f"need timeout_s > 0 and backoff_s >= 0, got {timeout_s}, {backoff_s}")
        self.timeout_s, self.backoff_s = timeout_s, backoff_s
        self._lock = threading.Lock()
        self._failed: dict[str, tuple[float, float, str]] = {}  # session -> (when, until, why), oldest first
        self._counts = {"handshake_failures": 0, "handshake_refusals": 0}

    def check(self, session: str) -> str:
        """"" if ``session`` answered a probe now; else why it is refused: it failed one
        within ``backoff_s`` (no probe then: at once), or failed this one (remembered)."""
        now = time.monotonic()
        with self._lock:
            when, until, why = self._failed.get(session, (0.0, 0.0, ""))
            if now < until:
                self._counts["handshake_refusals"] += 1
                return (f"Mooncake session {session!r} is refused for another {until - now:.1f} s: its "
                        f"handshake failed {now - when:.1f} s ago ({why})")
        try:
            probe(session, self.timeout_s)
        except HandshakeFailed as e:
            self.fail(session, str(e))
            return (f"Mooncake session {session!r} did not answer its handshake: {e} (refused for the next "
                    f"{self.backoff_s:g} s)")
        return ""

    def fail(self, session: str, why: str) -> None:
        """Refuse ``session`` for ``backoff_s`` from now, for ``why``."""
        now = time.monotonic()
        with self._lock:
            self._counts["handshake_failures"] += 1
            self._failed.pop(session, None)
            if len(self._failed) >= MAX_REMEMBERED:
                self._failed = {s: v for s, v in self._failed.items() if v[1] > now}
                while len(self._failed) >= MAX_REMEMBERED:
                    del self._failed[next(iter(self._failed))]
            self._failed[session] = (now, now + self.backoff_s, why[:200])

    def take_counts(self) -> dict[str, int]:
        """Probes failed (each refuses its session for ``backoff_s``) and writes refused
        at once by a back-off, since the last call."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts
