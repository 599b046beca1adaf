"""Who may speak on the side channel (docs/security.md, "The side channel").

With a shared secret (``auth_secret_file``, or ``$DCP2D_AUTH_SECRET``), every
side-channel frame (bootstrap, transfer requests and their answers, cancels,
releases, the HTTP bootstrap's rank table) is *sealed*: a header with a
timestamp and a random nonce, the encoded message, and an HMAC-SHA256 tag over
both. ``Auth.open`` refuses a frame whose tag is wrong, whose timestamp is more
than ``MAX_SKEW_S`` away from this host's clock, or whose nonce it has seen:
a stranger can neither forge a message nor replay a captured one. The secret
never travels and is never logged.

Without a secret frames are the plain messages (``messages.encode``), and a
sealed frame is refused with a message that names the misconfiguration.

Frame layout (sealed)::

    MAGIC (4) | timestamp ns (8, big-endian) | nonce (12) | message | tag (32)

``MAGIC`` starts with 0xc1, a byte msgpack never uses, so a sealed frame can
never be read as a message nor a message as a sealed frame.

Public API
----------
``class AuthError(MessageError)``: a frame refused; the reason says why.
``Auth(secret: bytes | None = None, max_skew_s=MAX_SKEW_S)``
    ``.enabled -> bool``; ``.seal(body) -> bytes``; ``.open(frame) -> bytes``;
    ``.pack(msg) -> bytes`` (encode, seal); ``.unpack(frame, expect) -> message``
    (open, decode); ``.take_refused() -> int`` (frames refused since the last call).
``NO_AUTH``: an ``Auth()`` without a secret, the default everywhere none is configured.
``load_secret(path: str) -> bytes | None``: the secret a config names, else the
    environment's, else None; raises ``ConfigError`` naming the file and the fix.
``PeerLog(logger, every_s=10.0)``: ``.warn(kind, fmt, *args)`` logs what a peer sent at
    most once per ``every_s`` per kind, peer text clipped: a stranger cannot flood the log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import threading
import time
from collections import deque

from vllm_dcp2d.transfer.messages import MessageError, Reply, clip, decode, encode

__all__ = ["Auth", "AuthError", "PeerLog", "load_secret", "ENV", "MAX_SKEW_S", "MIN_SECRET_BYTES", "NO_AUTH"]

ENV = "DCP2D_AUTH_SECRET"
MAGIC = b"\xc1D2A"
_HEAD = struct.Struct("!4sQ12s")
TAG = 32
MAX_SKEW_S = 60.0        # a frame older or newer than this (by this host's clock) is refused
MAX_NONCES = 1 << 17     # nonces remembered within the window; past it the window shrinks
MIN_SECRET_BYTES = 16


class AuthError(MessageError):
    """A frame this side will not read: unauthenticated, forged, stale or replayed."""


class Auth:
    """Seals and opens side-channel frames (thread-safe). ``secret=None``: no sealing."""

    def __init__(self, secret: bytes | None = None, max_skew_s: float = MAX_SKEW_S):
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"an auth secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._key = secret
        self.max_skew_s = max_skew_s
        self._lock = threading.Lock()
        self._seen: dict[bytes, int] = {}    # nonce -> its frame's timestamp (ns)
        self._order: deque[bytes] = deque()  # nonces, oldest first
        self._floor_ns = 0  # frames stamped at or before this are refused (their nonce may be forgotten)
        self._refused = 0

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def seal(self, body: bytes) -> bytes:
        if self._key is None:
            return body
        head = _HEAD.pack(MAGIC, time.time_ns(), secrets.token_bytes(12))
        return head + body + hmac.digest(self._key, head + body, "sha256")

    def open(self, frame: bytes) -> bytes:
        """The message inside ``frame``; raises ``AuthError`` (counted) if it may not be read."""
        frame = bytes(frame)
        sealed = frame[:4] == MAGIC
        if self._key is None:
            if sealed:
                self._refuse()
                raise AuthError("a sealed (authenticated) frame arrived, but this instance has no auth secret: "
                                f"give both sides the same auth_secret_file (or ${ENV})")
            return frame
        if not sealed or len(frame) < _HEAD.size + TAG:
            self._refuse()
            raise AuthError("an unauthenticated frame was dropped: this instance requires sealed frames "
                            f"(does the peer have the same auth_secret_file or ${ENV}?)")
        body, tag = frame[:-TAG], frame[-TAG:]
        if not hmac.compare_digest(hmac.digest(self._key, body, "sha256"), tag):
            self._refuse()
            raise AuthError("a frame with a wrong authentication tag was dropped (another secret, or forged)")
        _, stamp, nonce = _HEAD.unpack_from(body)
        now = time.time_ns()
        if abs(now - stamp) > self.max_skew_s * 1e9:
            self._refuse()
            raise AuthError(f"a frame stamped {abs(now - stamp) / 1e9:.0f} s away from this host's clock was "
                            f"dropped (limit {self.max_skew_s:.0f} s: replayed, or the hosts' clocks differ)")
        with self._lock:
            self._forget(now)
            if nonce in self._seen or stamp <= self._floor_ns:
                self._refused += 1
                raise AuthError("a replayed frame was dropped")
            self._seen[nonce] = stamp
            self._order.append(nonce)
        return body[_HEAD.size:]

    def pack(self, msg) -> bytes:
        return self.seal(encode(msg))

    def unpack(self, frame: bytes, expect=None):
        """``decode(open(frame))``. An unsealed ``Reply`` that ``open`` refuses (a peer telling
        us it refused ours: no secret there, or another one) is named in the error, as what
        it is: unauthenticated text, for the operator's eyes only."""
        try:
            body = self.open(frame)
        except AuthError as e:
            try:
                said = decode(bytes(frame), Reply).reason
            except MessageError:
                raise e from None
            raise AuthError(f"{e}; the peer said, unauthenticated: {clip(said, 300)}") from None
        return decode(body, expect)

    def take_refused(self) -> int:
        with self._lock:
            n, self._refused = self._refused, 0
        return n

    def _refuse(self) -> None:
        with self._lock:
            self._refused += 1

    def _forget(self, now_ns: int) -> None:
        """Drop nonces older than the window; past ``MAX_NONCES`` drop the oldest and raise
        the floor to its stamp, so a frame whose nonce is forgotten cannot be replayed."""
        limit = now_ns - int(self.max_skew_s * 1e9)
        while self._order and (self._seen[self._order[0]] < limit or len(self._order) >= MAX_NONCES):
            old = self._order.popleft()
            self._floor_ns = max(self._floor_ns, self._seen.pop(old))


def load_secret(path: str) -> bytes | None:
    """The shared secret: the contents of ``path`` (stripped of surrounding whitespace) if
    given, else ``$DCP2D_AUTH_SECRET``, else None. Raises ``ConfigError`` for a file that
    cannot be read, that other users may read, or a secret shorter than
    ``MIN_SECRET_BYTES``; the message names the file, never the secret."""
    from vllm_dcp2d.config import ConfigError

    if path:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                secret = f.read(4096).strip()
        except OSError as e:
            raise ConfigError(f"kv_connector_extra_config['auth_secret_file'] = {path!r}: cannot read it "
                              f"({e.strerror})") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"kv_connector_extra_config['auth_secret_file'] = {path!r}: mode "
                              f"{stat.S_IMODE(st.st_mode):04o} lets other users read the secret; expected "
                              f"0600 or 0400 (chmod 600 {path})")
        where = f"the file {path!r}"
    else:
        env = os.environ.get(ENV, "")
        if not env:
            return None
        secret, where = env.strip().encode(), f"${ENV}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the auth secret in {where} has {len(secret)} bytes; expected at least "
                          f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return hashlib.sha256(b"dcp2d-auth-v1" + secret).digest()


NO_AUTH = Auth()  # frames go unsealed: the default where no secret is configured


class PeerLog:
    """Warnings about what peers sent, at most one per ``every_s`` seconds per ``kind``;
    the next one says how many were left out. Arguments are clipped to 300 characters."""

    def __init__(self, logger, every_s: float = 10.0):
        self.logger, self.every_s = logger, every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, kind: str, fmt: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e18) < self.every_s:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        more = f" ({skipped} more like it in the last {self.every_s:.0f} s not logged)" if skipped else ""
        self.logger.warning(fmt + "%s", *(clip(a, 300) if isinstance(a, str) else a for a in args), more)
