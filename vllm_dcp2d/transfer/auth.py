"""Who may speak on the side channel, and to whom (docs/security.md, "The side channel").

With a shared secret (``auth_secret_file``, or ``$DCP2D_AUTH_SECRET``), every
side-channel frame (bootstrap, transfer requests and their answers, cancels,
releases, the HTTP bootstrap's rank table) is *sealed* for one recipient: a head
with a timestamp, a random nonce and the recipient's name, the encoded message, a
tag of the head and an HMAC-SHA256 tag over head and message. ``Auth.open(frame,
me=, limit=)`` refuses a frame longer than ``limit`` (the largest message the socket
takes, ``messages.max_bytes``) before it hashes a byte, then one whose head tag is
wrong, that is sealed for another recipient than ``me``, whose timestamp is more than
``MAX_SKEW_S`` away from this host's clock, or whose nonce it has seen, and only then
hashes the message: a stranger can neither forge a message, nor replay a captured one
(to its recipient or to any other party), nor make a rank hash more than a frame's
head. The secret never travels and is never logged.

The names frames are sealed for: a prefill CP rank is ``rank_name(engine id, cp
rank)`` (what a decode rank asks it, ``TransferRequest``, ``CancelTransfer``,
``ReleaseTransfer``); a decode rank is its routing id (the prefill rank's answers go
back to the rank that sent the attempt); a bootstrap is ``BOOTSTRAP`` (it answers
anyone's query); a rank table is ``QueryRanks.reply_to`` (the address the decode rank
asked and its query's id: a table of another instance, or the answer to another
query, is refused); a registration's answer, the rank that registered.

Without a secret frames are the plain messages (``messages.encode``), still refused
past ``limit``, and a sealed frame is refused with a message that names the
misconfiguration. A prefill's registrations are sealed all the same, with a key made
from the instance's registration token (and the secret, if any:
``Auth.registration``): the token never travels, so nobody who reads the bootstrap's
traffic can register a rank.

Frame layout (sealed; protocol 9)::

    MAGIC (4) | timestamp ns (8, big-endian) | nonce (12) | n (2, big-endian) | recipient (n)
      | message | head tag (16) | tag (32)

head = everything before the message; head tag = HMAC-SHA256(K_head, head)[:16]; tag =
HMAC-SHA256(K_body, head | message); K_head and K_body are HMAC-SHA256 of the key and
their label. ``MAGIC`` starts with 0xc1, a byte msgpack never uses, so a sealed frame
can never be read as a message nor a message as a sealed frame. A head whose tag is
right spends its nonce before the message is hashed: a frame changed in flight makes
the rank hash its message once at most.

Public API
----------
``class AuthError(MessageError)``: a frame refused; the reason says why.
``Auth(secret: bytes | None = None, max_skew_s=MAX_SKEW_S)``
    ``.enabled -> bool``; ``.seal(body, to=) -> bytes``; ``.open(frame, me=, limit=) -> bytes``;
    ``.pack(msg, to=) -> bytes`` (encode, seal); ``.unpack(frame, expect, me=) -> message``
    (open within ``messages.max_bytes(expect)``, decode); ``.registration(token) -> Auth``;
    ``.holds(frame) -> bool`` (its head is sealed with this key); ``.take_refused() -> int``
    (frames refused since the last call).
``NO_AUTH``: an ``Auth()`` without a secret, the default everywhere none is configured.
``rank_name(engine_id, cp_rank)``, ``BOOTSTRAP``: the names frames are sealed for.
``frame_limit(expect) -> int``: the longest frame carrying one of ``expect``, seal included.
``load_secret(path: str) -> bytes | None``: the secret a config names, else the
    environment's, else None; raises ``ConfigError`` naming the file and the fix.
``exposed(enabled, hosts) -> str``: the start-up warning for an instance without a secret
    that listens beyond loopback ("" if none).
``PeerLog(logger, every_s=10.0)``: ``.warn(kind, fmt, *args)`` logs what a peer sent at
    most once per ``every_s`` per kind, peer text clipped: a stranger cannot flood the log.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import struct
import threading
import time
from collections import deque
from typing import NoReturn

from vllm_dcp2d.transfer.messages import MessageError, Reply, clip, decode, encode, max_bytes

__all__ = ["Auth", "AuthError", "PeerLog", "load_secret", "exposed", "frame_limit", "rank_name", "BOOTSTRAP", "ENV",
           "MAX_SKEW_S", "MIN_SECRET_BYTES", "NO_AUTH", "SEAL_BYTES"]

ENV = "DCP2D_AUTH_SECRET"
MAGIC = b"\xc1D2A"
_HEAD = struct.Struct("!4sQ12sH")  # magic, timestamp ns, nonce, recipient length
HEAD_TAG, TAG = 16, 32
MAX_RECIPIENT = 4096     # bytes of a recipient's name (an engine id is at most 512 characters)
SEAL_BYTES = _HEAD.size + MAX_RECIPIENT + HEAD_TAG + TAG  # the most a seal adds to a message
MAX_SKEW_S = 60.0        # a frame older or newer than this (by this host's clock) is refused
MAX_NONCES = 1 << 17     # nonces remembered within the window; past it the window shrinks
MIN_SECRET_BYTES = 16
BOOTSTRAP = "bootstrap"  # what a registration or a query is sealed for


def rank_name(engine_id: str, cp_rank: int) -> str:
    """The name a prefill CP rank's frames are sealed for."""
    return f"{engine_id} cp rank {cp_rank}"


def frame_limit(expect) -> int:
    """The longest frame that carries one of ``expect`` (message classes), seal included:
    a socket that takes only those is given it as ZMQ's ``MAXMSGSIZE``."""
    return max_bytes(expect) + SEAL_BYTES


def _name(who: str | bytes) -> bytes:
    return who if isinstance(who, bytes) else who.encode()


class AuthError(MessageError):
    """A frame this side will not read: unauthenticated, forged, stale, replayed, sealed
    for another party, or longer than what it could carry."""


class Auth:
    """Seals and opens side-channel frames (thread-safe). ``secret=None``: no sealing."""

    def __init__(self, secret: bytes | None = None, max_skew_s: float = MAX_SKEW_S, *, _key: bytes | None = None):
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"an auth secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._key = secret if _key is None else _key
        if self._key is not None:  # one key per tag: a head tag is never a valid tag of a whole frame
            self._k_head = hmac.digest(self._key, b"dcp2d head tag", "sha256")
            self._k_body = hmac.digest(self._key, b"dcp2d frame tag", "sha256")
        self.max_skew_s = max_skew_s
        self._lock = threading.Lock()
        self._seen: dict[bytes, int] = {}    # nonce -> its frame's timestamp (ns)
        self._order: deque[bytes] = deque()  # nonces, oldest first
        self._floor_ns = 0  # frames stamped at or before this are refused (their nonce may be forgotten)
        self._refused = 0

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def registration(self, token: str) -> Auth:
        """The seal of this instance's registrations: a key made from ``token`` (and the
        secret, if any), so a registration can be neither read for the token nor forged
        without it, with or without a secret."""
        key = hmac.digest(self._key or b"", b"dcp2d registration " + token.encode(), "sha256")
        return Auth(max_skew_s=self.max_skew_s, _key=key)

    def seal(self, body: bytes, *, to: str | bytes) -> bytes:
        """``body`` sealed for the party named ``to`` (unchanged without a secret)."""
        if self._key is None:
            return body
        to = _name(to)
        if len(to) > MAX_RECIPIENT:
            raise ValueError(f"a recipient's name has at most {MAX_RECIPIENT} bytes, got {len(to)}")
        head = _HEAD.pack(MAGIC, time.time_ns(), secrets.token_bytes(12), len(to)) + to
        frame = head + body
        return frame + hmac.digest(self._k_head, head, "sha256")[:HEAD_TAG] + hmac.digest(self._k_body, frame, "sha256")

    def holds(self, frame) -> bool:
        """Whether ``frame``'s head is sealed with this key (its head tag only: ``open``
        may still refuse it)."""
        view = memoryview(frame)
        if self._key is None or view.nbytes < _HEAD.size + HEAD_TAG + TAG or view[:4] != MAGIC:
            return False
        end = _HEAD.size + _HEAD.unpack_from(view)[3]
        if end > view.nbytes - HEAD_TAG - TAG:
            return False
        return hmac.compare_digest(hmac.digest(self._k_head, view[:end], "sha256")[:HEAD_TAG],
                                   view[-HEAD_TAG - TAG:-TAG])

    def open(self, frame, *, me: str | bytes, limit: int) -> bytes:
        """The message inside ``frame``, sealed for ``me`` and at most ``limit`` bytes long;
        raises ``AuthError`` (counted) if it may not be read. Costs a hash of the head
        only, until the frame is known to be from a secret holder, for ``me``, fresh and new."""
        view = memoryview(frame)  # bytes, or a ZMQ frame received without a copy
        n = view.nbytes
        sealed = view[:4] == MAGIC
        if self._key is None:
            if sealed:
                self._refuse("a sealed (authenticated) frame arrived, but this instance has no auth secret: "
                             f"give both sides the same auth_secret_file (or ${ENV})")
            if n > limit:
                self._refuse(f"a frame of {n} bytes was dropped unread: what arrives here is at most {limit}")
            return bytes(view)
        if not sealed or n < _HEAD.size + HEAD_TAG + TAG:
            self._refuse("an unauthenticated frame was dropped: this instance requires sealed frames "
                         f"(does the peer have the same auth_secret_file or ${ENV}?)")
        if n > limit + SEAL_BYTES:
            self._refuse(f"a sealed frame of {n} bytes was dropped unread: what arrives here is at most {limit} "
                         f"bytes and its seal")
        _, stamp, nonce, size = _HEAD.unpack_from(view)
        end = _HEAD.size + size  # the head
        if end > n - HEAD_TAG - TAG or not hmac.compare_digest(
                hmac.digest(self._k_head, view[:end], "sha256")[:HEAD_TAG], view[n - HEAD_TAG - TAG:n - TAG]):
            self._refuse("a frame with a wrong authentication tag was dropped (another secret, or forged)")
        to, mine = bytes(view[_HEAD.size:end]), _name(me)
        if to != mine:
            self._refuse(f"a frame sealed for {clip(repr(to), 120)} was dropped by {clip(repr(mine), 120)} "
                         f"(replayed to another party, or sent to the wrong address)")
        if n - end - HEAD_TAG - TAG > limit:
            self._refuse(f"a sealed frame of {n} bytes was dropped unread: what arrives here is at most {limit} "
                         f"bytes and its seal")
        now = time.time_ns()
        if abs(now - stamp) > self.max_skew_s * 1e9:
            self._refuse(f"a frame stamped {abs(now - stamp) / 1e9:.0f} s away from this host's clock was "
                         f"dropped (limit {self.max_skew_s:.0f} s: replayed, or the hosts' clocks differ)")
        with self._lock:  # the nonce is spent here, before the message is hashed (see module doc)
            self._forget(now)
            if nonce in self._seen or stamp <= self._floor_ns:
                self._refused += 1
                raise AuthError("a replayed frame was dropped")
            self._seen[nonce] = stamp
            self._order.append(nonce)
        if not hmac.compare_digest(hmac.digest(self._k_body, view[:n - HEAD_TAG - TAG], "sha256"), view[n - TAG:]):
            self._refuse("a frame with a wrong authentication tag was dropped (another secret, or forged)")
        return bytes(view[end:n - HEAD_TAG - TAG])

    def pack(self, msg, *, to: str | bytes) -> bytes:
        return self.seal(encode(msg), to=to)

    def unpack(self, frame: bytes, expect, *, me: str | bytes):
        """``decode(open(frame, me=me, limit=max_bytes(expect)), expect)``. An unsealed
        ``Reply`` that ``open`` refuses (a peer telling us it refused ours: no secret
        there, or another one) is named in the error, as what it is: unauthenticated
        text, for the operator's eyes only."""
        try:
            body = self.open(frame, me=me, limit=max_bytes(expect))
        except AuthError as e:
            try:
                said = decode(bytes(frame), Reply).reason if len(frame) <= max_bytes(Reply) else None
            except MessageError:
                said = None
            if said is None:
                raise e from None
            raise AuthError(f"{e}; the peer said, unauthenticated: {clip(said, 300)}") from None
        return decode(body, expect)

    def take_refused(self) -> int:
        with self._lock:
            n, self._refused = self._refused, 0
        return n

    def _refuse(self, why: str) -> NoReturn:
        """Count a refused frame and raise ``AuthError(why)``."""
        with self._lock:
            self._refused += 1
        raise AuthError(why)

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


def exposed(enabled: bool, hosts: dict[str, str]) -> str:
    """The one-line start-up warning for an instance without a secret whose ``hosts``
    (config key -> host it listens on) are not all loopback; "" when there is nothing to
    say. A host name other than ``localhost`` counts as reachable (it is not resolved)."""
    if enabled:
        return ""
    out = {k: h for k, h in hosts.items() if not _loopback(h)}
    if not out:
        return ""
    where = ", ".join(f"{k}={h!r}" for k, h in out.items())
    return (f"DCP2D: no auth secret (auth_secret_file or ${ENV}) on a non-loopback address ({where}): anyone "
            "who reaches this instance's side-channel ports is read and answered unauthenticated (docs/security.md)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
