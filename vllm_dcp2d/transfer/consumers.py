"""Where a prefill rank may write: the decode ranks registered on its side channel
(docs/security.md, "Writes go only where the asking decode registered").

A review found the prefill to be a confused deputy: it wrote into whatever Mooncake
session a ``TransferRequest`` named, at addresses checked only against memory the
requester itself claimed. A stranger holding one valid key (its own request, sent to the
prefill's API) named a victim decode's session and overwrote 2,048 of its bytes, or the
prefill's own session and overwrote another request's source blocks.

Now a decode rank registers once per connection (``RegisterConsumer``: its session and the
memory it registered) and a request uses only its connection's registration. A
registration is taken only if

* the session is not one of this rank's own Mooncake engines (the prefill never writes
  into its own memory for a peer; only a ``kv_both`` worker's own receiver, whose link the
  owner names with ``trust``, may register it), and
* without a secret, its host is the address the connection comes from: a stranger can
  only name sessions on its own host. With a secret the frame is sealed, so it comes
  from an instance that holds the secret.

``Consumers`` keeps them by connection (ZMQ routing identity), bounded per source and in
all (``Quota``: a source past its cap replaces its own least recently used one; when all are
taken, the source holding the most gives up its least recently used one to a source that
holds fewer, so idle floods from many addresses cannot keep a new decode out); an entry
unused for ``IDLE_S`` is dropped (the decode registers again every
``directory.REGISTER_EVERY_S`` while it fetches). Refusals are kept, so that the requests of
that connection fail naming why, in a bounded table of their own (``MAX_REFUSED``, oldest
dropped: such a connection's requests then fail as unregistered). Used on the sender's I/O
thread only.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from vllm_dcp2d.reshard.regions import Memory
from vllm_dcp2d.transfer.messages import RegisterConsumer
from vllm_dcp2d.transfer.quota import Quota

__all__ = ["Registration", "Consumers", "source_of", "IDLE_S"]

IDLE_S = 120.0       # a registration nothing used for this long is dropped (a fetching decode refreshes it every 60 s)
PER_SOURCE = 256     # connections one source may have registered (a host runs a few decode ranks)
TOTAL = 4096
PER_SOURCE_BYTES = 16 << 20  # what its registrations hold (memory ranges: 16 B each)
TOTAL_BYTES = 64 << 20
MAX_REFUSED = 1024   # refused registrations remembered (their reason), oldest dropped


@dataclass(frozen=True, eq=False)
class Registration:
    """One connection's ``RegisterConsumer``, as taken (or why it was refused)."""

    session: str
    memory: Memory | None
    source: str
    refused: str = ""   # why it was refused: every request on the connection fails with it
    nbytes: int = 0


def source_of(peer: str, engine_id: str, sealed: bool) -> str:
    """Whose caps a message counts against: the sealed engine id, else the connection's address."""
    return f"engine {engine_id}" if sealed else f"address {peer or 'unknown'}"


def _same_host(host: str, peer: str) -> bool:
    try:
        return ipaddress.ip_address(host) == ipaddress.ip_address(peer)
    except ValueError:  # a name: resolving it would block this thread on DNS, and proves nothing
        return False


class Consumers:
    """The registrations of one prefill rank's side channel (see the module doc).

    own_sessions: returns this rank's own Mooncake sessions (current and retired engines).
    sealed:       frames are sealed with the shared secret.
    """

    def __init__(self, name: str, own_sessions, sealed: bool):
        self.name, self.own_sessions, self.sealed = name, own_sessions, sealed
        self._by_link: OrderedDict[bytes, tuple[Registration, float]] = OrderedDict()  # oldest use first
        self._refusals: OrderedDict[bytes, Registration] = OrderedDict()  # link -> its refusal, oldest first
        self._trusted: set[bytes] = set()  # links of this process's own receiver (``trust``)
        self._quota = Quota("registered connections", PER_SOURCE, TOTAL, PER_SOURCE_BYTES, TOTAL_BYTES)
        self._refused = 0  # registrations refused since ``take_refused`` (read from another thread)
        self._count = threading.Lock()

    def register(self, link: bytes, msg: RegisterConsumer, peer: str) -> Registration:
        """Take ``msg`` from connection ``link`` (whose address is ``peer``): the new
        registration, or one whose ``refused`` says why (requests on ``link`` then fail with it)."""
        source = source_of(peer, msg.engine_id, self.sealed)
        why = self._check(link, msg, peer)
        self._drop(link)
        size = 16 * int(msg.memory_addr.size) + len(msg.session)
        if not why:
            why = self._quota.take(source, size)
            while why and self._evict(source):  # room from its own least recently used
                why = self._quota.take(source, size)
        if why:
            with self._count:
                self._refused += 1
            reg = Registration(msg.session, None, source, f"{self.name} refused the registration of Mooncake "
                                                          f"session {msg.session!r}: {why}")
            self._refusals[link] = reg
            while len(self._refusals) > MAX_REFUSED:
                self._refusals.popitem(last=False)
            return reg
        reg = Registration(msg.session, msg.memory(), source, nbytes=size)
        self._by_link[link] = (reg, time.monotonic())
        return reg

    def trust(self, link: bytes) -> None:
        """``link`` is this process's own receiver's (a ``kv_both`` worker: the same transport
        prefills and decodes): it may register this rank's own session. Its routing id is
        drawn at random and travels only on its own links, so no other party can claim it."""
        self._trusted.add(link)

    def get(self, link: bytes) -> Registration | None:
        """``link``'s registration, or its refusal (None: it has none); marks it used."""
        hit = self._by_link.get(link)
        if hit is None:
            return self._refusals.get(link)
        self._by_link[link] = (hit[0], time.monotonic())
        self._by_link.move_to_end(link)
        return hit[0]

    def expire(self, now: float) -> None:
        while self._by_link:
            link, (_, used) = next(iter(self._by_link.items()))
            if now - used < IDLE_S:
                return
            self._drop(link)

    def take_refused(self) -> int:
        """Registrations refused since the last call (any thread)."""
        with self._count:
            n, self._refused = self._refused, 0
        return n

    def __len__(self) -> int:
        return len(self._by_link)

    def _check(self, link: bytes, msg: RegisterConsumer, peer: str) -> str:
        if msg.session in self.own_sessions() and link not in self._trusted:
            return "it is this prefill rank's own session (a prefill never writes into its own memory for a peer)"
        if not self.sealed and not _same_host(msg.host(), peer):
            return (f"without an auth secret, a decode's session must be on the host its side channel comes from "
                    f"(this connection comes from {peer or 'an unknown address'}): set the decode's local_hostname "
                    f"to that address, or give both instances the same auth_secret_file")
        return ""

    def _drop(self, link: bytes) -> None:
        self._refusals.pop(link, None)
        hit = self._by_link.pop(link, None)
        if hit is not None:
            self._quota.give(hit[0].source, hit[0].nbytes)

    def _evict(self, source: str) -> bool:
        """Make room for one of ``source``'s: drop its own least recently used registration
        if it is at its cap, else the least recently used one of the source holding the most,
        if that holds more than ``source`` does. False if nothing may be dropped."""
        mine = self._quota.held(source)[0]
        if mine < self._quota.per_source:
            counts: dict[str, int] = {}
            for reg, _ in self._by_link.values():
                counts[reg.source] = counts.get(reg.source, 0) + 1
            biggest = max(counts, key=counts.get, default=None)
            if biggest is None or counts[biggest] <= mine + 1:
                return False
            source = biggest
        for link, (reg, _) in self._by_link.items():
            if reg.source == source:
                self._drop(link)
                return True
        return False
