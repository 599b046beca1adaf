"""Where a decode rank's messages go: the rank table of each prefill instance it
talks to and a side channel to each prefill rank, and the releases that wait for a
rank table (``receiver.Receiver`` owns one, on its thread).

A rank table is asked for once per prefill instance (bootstrap address) and kept
while it is in use (``RankTableQuery``, ZMQ or HTTP by the address); a side channel
(``Link``: a DEALER to one prefill CP rank, with what is outstanding there) is opened
on the first message to a rank. Both are closed once
nothing used them for ``IDLE_S``: each holds sockets and a reconnect timer, and any
request may name a new address. ``accept`` decides whether this rank can fetch from
a table's ranks at all; a release goes to the ranks of its request's prefill once its
table is known (the ranks holding none of this rank's KV heads never count this rank,
so they are not told).
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_dcp2d.reshard.layout import askers
from vllm_dcp2d.reshard.head_split import ShardError, senders_for
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.auth import NO_AUTH, Auth, frame_limit, rank_name
from vllm_dcp2d.transfer.bootstrap import RankTableQuery, TableQuery
from vllm_dcp2d.transfer.http_bootstrap import HttpTableQuery
from vllm_dcp2d.transfer.messages import (Fingerprint, FingerprintMismatch, RankTable, ReleaseTransfer, Reply,
                                           TransferOutcome)

__all__ = ["Directory", "Link", "link_events", "MAX_QUERIES", "IDLE_S"]

log = logging.getLogger(__name__)
MAX_QUERIES = 256  # prefill instances (bootstrap addresses) one decode rank talks to at once
IDLE_S = 60.0      # a table query or rank link unused this long is closed
REGISTER_EVERY_S = 60.0  # a link registers its session again this often (the prefill drops idle ones)
CANCEL_RESEND_MAX_S = 30.0  # a quarantining rank is asked again after 1, 2, 4, ... 30 s
SEND_HWM = 1000  # messages queued to one rank (ZMQ's default); past it a send fails instead of blocking


class Link:
    """A DEALER to one prefill CP rank's side channel, with its link monitor and
    when the cancels of its quarantined attempts go out again. ``to``: the rank's name
    (``auth.rank_name`` of the engine and CP rank its rank table gives), what every
    message to it is sealed for; the last rank table naming this address sets it."""

    def __init__(self, address: str, poller: zmq.Poller, identity: bytes, auth=None, to: str = ""):
        self.address, self.auth, self.to = address, auth, to
        # Same routing id after a reconnect: the rank's answers still reach us. Nothing it
        # sends is longer than an answer: a longer frame drops the link before it is held.
        self.sock, self.monitor = sockets.dealer(address, {zmq.ROUTING_ID: identity, zmq.SNDHWM: SEND_HWM,
                                                           zmq.MAXMSGSIZE: frame_limit((TransferOutcome, Reply))})
        for s in (self.sock, self.monitor):
            poller.register(s, zmq.POLLIN)
        # Disconnected, and nothing read from the rank since. Only an answer clears it,
        # not ZMQ's reconnect: on loopback a reconnect to a dead port can connect the
        # socket to itself (TCP simultaneous open from the same ephemeral port).
        self.down = False
        self.cancel_at = 0.0                  # when the quarantined attempts' cancels go out again
        self.used = time.monotonic()          # last asked or heard from (``Directory.collect`` closes idle links)
        self.backoff = sockets.Backoff(CANCEL_RESEND_MAX_S)
        self.registered = ""                  # the Mooncake session this link last registered
        self.registered_at = 0.0

    def register(self, msg) -> bool:
        """Send ``msg`` (a ``RegisterConsumer``) unless this link registered its session
        within ``REGISTER_EVERY_S``; False if the link's queue is full."""
        now = time.monotonic()
        if msg.session == self.registered and now - self.registered_at < REGISTER_EVERY_S:
            return True
        if not self.send(msg):
            return False
        self.registered, self.registered_at = msg.session, now
        return True

    def send(self, msg) -> bool:
        """Queue ``msg`` without blocking; False if ``SEND_HWM`` messages already wait
        for a rank that does not read them (unreachable, or gone)."""
        return sockets.send_nowait(self.sock, (self.auth or NO_AUTH).pack(msg, to=self.to))

    def close(self, poller: zmq.Poller) -> None:
        for s in (self.sock, self.monitor):
            poller.unregister(s)
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


def link_events(monitor: zmq.Socket) -> bool:
    """Drain a link monitor: whether the link disconnected since the last call."""
    lost = False
    while monitor.poll(0):
        lost |= recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    return lost


class Directory:
    """The rank tables and side channels of one decode rank (see module doc): the table
    queries (bootstrap -> its ``RankTableQuery``) and the links (address -> ``Link``), both
    with their sockets registered on ``poller``, and the releases waiting for a table.
    Only this object holds them; its owner's poll loop asks through the methods below.

    A release travels as ``(transfer key, bootstrap, num_tokens, deadline,
    remote engine id or None, prompt digest)``.
    """

    def __init__(self, poller: zmq.Poller, identity: bytes, engine_id: str, fingerprint: Fingerprint,
                 heads: range, consumer_rank: int, consumer_size: int, dcp_rank: int, dcp_size: int, auth: Auth):
        self.poller, self.identity, self.engine_id, self.auth = poller, identity, engine_id, auth
        self.fingerprint, self.heads = fingerprint, heads
        self.consumer_rank, self.consumer_size, self.dcp_rank, self.dcp_size = (consumer_rank, consumer_size,
                                                                               dcp_rank, dcp_size)
        self._queries: dict[str, RankTableQuery] = {}
        self._links: dict[str, Link] = {}
        self._unsent: dict[str, list[tuple]] = {}  # bootstrap -> releases waiting for its table

    # ---- rank tables ----

    def full(self, bootstrap: str) -> bool:
        """Whether asking ``bootstrap`` would be one instance too many."""
        return bootstrap not in self._queries and len(self._queries) >= MAX_QUERIES

    def query(self, bootstrap: str) -> RankTableQuery:
        """The query of ``bootstrap``'s rank table, opened on first use. Raises ValueError
        for a malformed address, or one more instance than ``MAX_QUERIES``."""
        q = self._queries.get(bootstrap)
        if q is None:  # each raises on a malformed address
            if len(self._queries) >= MAX_QUERIES:
                raise ValueError(f"this decode rank talks to {len(self._queries)} prefill instances already (at "
                                 f"most {MAX_QUERIES}); {bootstrap!r} is one more")
            kind = HttpTableQuery if bootstrap.startswith("http://") else TableQuery
            q = kind(bootstrap, self.engine_id, self.accept, self.auth)
            self._queries[bootstrap] = q
            for s in (q.sock, q.monitor):
                self.poller.register(s, zmq.POLLIN)
        q.used = time.monotonic()
        return q

    def forget_table(self, bootstrap: str) -> None:
        """Ask ``bootstrap`` again (a rank may have moved)."""
        if bootstrap in self._queries:
            self._queries[bootstrap].forget()

    def forget_tables_with(self, addr: str) -> None:
        """The rank at ``addr`` may come back elsewhere: ask again for every table naming it."""
        for q in self._queries.values():
            if q.table is not None and addr in q.table.addresses:
                q.forget()

    def accept(self, table: RankTable) -> None:
        """Raise ``FingerprintMismatch`` unless this rank can fetch its KV from ``table``'s
        ranks: the same model shape first (the shard check needs it), then each of this
        rank's KV heads and layers held by exactly one of them, then the page format
        (a page format that differs only because the heads do is named as the heads)."""
        mine, theirs = self.fingerprint, table.fingerprint
        if (mine.num_layers, mine.num_kv_heads) == (theirs.num_layers, theirs.num_kv_heads):
            try:
                senders_for(table.layers, table.heads, mine.num_layers, mine.num_kv_heads, self.heads)
            except ShardError as e:
                raise FingerprintMismatch(f"{e} (this decode: TP rank {self.consumer_rank} of "
                                          f"{self.consumer_size}, DCP rank {self.dcp_rank} of {self.dcp_size})") from None
        theirs_heads = int(table.heads[1] - table.heads[0])  # every rank of a prefill holds as many
        try:
            mine.check(theirs, len(self.heads), theirs_heads)
        except FingerprintMismatch as e:  # name both sides' shape: what differs may be the TP split
            raise FingerprintMismatch(
                f"{e}. Prefill {table.engine_id!r}: {table.cp_size} sending rank(s), each holding {theirs_heads} of "
                f"{theirs.num_kv_heads} KV heads; this decode: TP rank {self.consumer_rank} of {self.consumer_size} "
                f"holding {len(self.heads)}, DCP {self.dcp_size}") from None

    def ask(self, bootstrap: str, now: float) -> None:
        """Ask ``bootstrap`` for its rank table again if its last ask is due (``RankTableQuery.ask``)."""
        self._queries[bootstrap].ask(now)

    def why_no_table(self, bootstrap: str) -> str | None:
        """Why ``bootstrap`` gave no rank table so far (None: it was never asked, or its query closed)."""
        q = self._queries.get(bootstrap)
        return q and q.last_reason

    def tables(self) -> list[RankTableQuery]:
        """The open table queries (the poll loop reads each whose socket has input)."""
        return list(self._queries.values())

    # ---- side channels ----

    def link(self, addr: str, table: RankTable, cp_rank: int) -> Link:
        """The side channel to ``table``'s CP rank ``cp_rank`` at ``addr``, opened on first
        use; what goes there is sealed for that rank (``auth.rank_name``)."""
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = Link(addr, self.poller, self.identity, self.auth)
        link.to = rank_name(table.engine_id, cp_rank)
        link.used = time.monotonic()
        return link

    def link_at(self, addr: str) -> Link | None:
        """The open side channel to ``addr``, if any (None: closed, or never opened)."""
        return self._links.get(addr)

    def links(self) -> list[Link]:
        """The open side channels (the poll loop reads each whose socket has input)."""
        return list(self._links.values())

    def restarted(self, table: RankTable) -> list[str]:
        """Addresses of links that are down and that ``table`` (a new rank table of their
        instance) no longer lists: their rank came back elsewhere."""
        return [addr for addr, link in self._links.items() if link.down and addr not in table.addresses]

    def askers(self, table: RankTable, cp_rank: int) -> tuple[int, int]:
        """``(consumer_rank, consumer_size)`` this rank names to ``cp_rank``: its place among
        the decode's TP ranks that fetch from it (those holding its heads), and how many
        they are: the prefill rank frees a request once each of them is served."""
        ranks = askers(self.fingerprint.num_kv_heads, self.consumer_size, table.shard(cp_rank)[1])
        return (ranks.index(self.consumer_rank), len(ranks)) if self.consumer_rank in ranks else (0, 1)

    # ---- releases ----

    def queue_release(self, release: tuple) -> None:
        """Hold ``release`` until its prefill's rank table is known (the caller opened the query)."""
        self._unsent.setdefault(release[1], []).append(release)

    def ask_for_releases(self, now: float) -> None:
        for bootstrap in self._unsent:
            self._queries[bootstrap].ask(now)

    def send_releases(self) -> None:
        """Send the releases whose prefill's rank table is known; drop those whose
        table did not come in time (the prefill's ``send_timeout_s`` frees them)."""
        now = time.monotonic()
        for bootstrap, items in list(self._unsent.items()):
            table = self._queries[bootstrap].table
            keep = []
            for key, _, num_tokens, deadline, engine, digest in items:
                if table is not None:
                    self._release(table, key, num_tokens, engine, digest)
                elif deadline <= now:
                    log.info("release of %r not sent: no rank table from %s (%s)", key, bootstrap,
                             self._queries[bootstrap].last_reason)
                else:
                    keep.append((key, bootstrap, num_tokens, deadline, engine, digest))
            if keep:
                self._unsent[bootstrap] = keep
            else:
                del self._unsent[bootstrap]

    def release_to_refused(self, q: RankTableQuery) -> None:
        """``q``'s table is of another KV format: this rank will never fetch from it, and a
        release moves no KV, so its releases go now (freeing the blocks before the
        prefill's ``claim_timeout_s``)."""
        for key, _, num_tokens, _, engine, digest in self._unsent.pop(q.address, []):
            self._release(q.refused, key, num_tokens, engine, digest)

    def _release(self, table: RankTable, key: str, num_tokens: int, engine: str | None, digest: str) -> None:
        if engine is not None and engine != table.engine_id:
            log.info("release of %r not sent: %s serves engine %r, the request named %r", key,
                     ",".join(table.addresses), table.engine_id, engine)
            return
        for cp_rank, addr in enumerate(table.addresses):
            if not set(table.shard(cp_rank)[1]) & set(self.heads):
                continue  # that rank holds none of this rank's heads: it never counts this rank
            msg = ReleaseTransfer(key, self.engine_id, *self.askers(table, cp_rank), num_tokens, digest)
            if not self.link(addr, table, cp_rank).send(msg):
                log.info("release of %r not sent to %s: its queue is full", key, addr)

    # ---- lifetime ----

    def collect(self, in_use: set[str], busy, idle_s: float | None = None) -> list[str]:
        """Close the table queries and rank links nothing has used for ``idle_s`` (inf:
        none in use now): not the bootstraps ``in_use`` (fetches need them) or with
        releases waiting, nor the rank addresses for which ``busy(address)`` is true
        (attempts in flight or quarantined there: ``FetchLedger.busy``); ``idle_s`` None:
        ``IDLE_S``. Returns the bootstraps whose query closed."""
        now, closed, idle_s = time.monotonic(), [], IDLE_S if idle_s is None else idle_s
        for bootstrap, q in list(self._queries.items()):
            if bootstrap in in_use or bootstrap in self._unsent or now - q.used < idle_s:
                continue
            for s in (q.sock, q.monitor):
                self.poller.unregister(s)
            q.close()
            del self._queries[bootstrap]
            closed.append(bootstrap)
        for addr, link in list(self._links.items()):
            if now - link.used >= idle_s and not busy(addr):
                self.close_link(addr)
        return closed

    def close_link(self, addr: str) -> None:
        self._links.pop(addr).close(self.poller)

    def close(self) -> None:
        for q in self._queries.values():
            q.close()
        for link in self._links.values():
            link.close(self.poller)
