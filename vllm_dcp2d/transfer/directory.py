"""Where a decode rank's messages go: the rank table of each prefill instance it
talks to and a side channel to each prefill rank, and the releases that wait for a
rank table (``receiver.Receiver`` owns one, on its thread).

A rank table is asked for once per prefill instance (bootstrap address) and kept
while it is in use (``RankTableQuery``, ZMQ or HTTP by the address); a side channel
(``fetch.Rank``) is opened on the first message to a rank. Both are closed once
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

from vllm_dcp2d.reshard.layout import askers
from vllm_dcp2d.reshard.head_split import ShardError, senders_for
from vllm_dcp2d.transfer.auth import Auth, rank_name
from vllm_dcp2d.transfer.bootstrap import RankTableQuery, TableQuery
from vllm_dcp2d.transfer.fetch import Rank
from vllm_dcp2d.transfer.http_bootstrap import HttpTableQuery
from vllm_dcp2d.transfer.messages import Fingerprint, FingerprintMismatch, RankTable, ReleaseTransfer

__all__ = ["Directory", "MAX_QUERIES", "IDLE_S"]

log = logging.getLogger(__name__)
MAX_QUERIES = 256  # prefill instances (bootstrap addresses) one decode rank talks to at once
IDLE_S = 60.0      # a table query or rank link unused this long is closed


class Directory:
    """The rank tables and side channels of one decode rank (see module doc): ``queries``
    (bootstrap -> its ``RankTableQuery``), ``ranks`` (address -> ``Rank``), both with
    their sockets registered on ``poller``, and the releases waiting for a table.

    A release travels as ``(transfer key, bootstrap, num_tokens, deadline,
    remote engine id or None, prompt digest)``.
    """

    def __init__(self, poller: zmq.Poller, identity: bytes, engine_id: str, fingerprint: Fingerprint,
                 heads: range, consumer_rank: int, consumer_size: int, dcp_rank: int, dcp_size: int, auth: Auth):
        self.poller, self.identity, self.engine_id, self.auth = poller, identity, engine_id, auth
        self.fingerprint, self.heads = fingerprint, heads
        self.consumer_rank, self.consumer_size, self.dcp_rank, self.dcp_size = (consumer_rank, consumer_size,
                                                                               dcp_rank, dcp_size)
        self.queries: dict[str, RankTableQuery] = {}
        self.ranks: dict[str, Rank] = {}
        self.unsent: dict[str, list[tuple]] = {}  # bootstrap -> releases waiting for its table

    # ---- rank tables ----

    def full(self, bootstrap: str) -> bool:
        """Whether asking ``bootstrap`` would be one instance too many."""
        return bootstrap not in self.queries and len(self.queries) >= MAX_QUERIES

    def query(self, bootstrap: str) -> RankTableQuery:
        """The query of ``bootstrap``'s rank table, opened on first use. Raises ValueError
        for a malformed address, or one more instance than ``MAX_QUERIES``."""
        q = self.queries.get(bootstrap)
        if q is None:  # each raises on a malformed address
            if len(self.queries) >= MAX_QUERIES:
                raise ValueError(f"this decode rank talks to {len(self.queries)} prefill instances already (at "
                                 f"most {MAX_QUERIES}); {bootstrap!r} is one more")
            kind = HttpTableQuery if bootstrap.startswith("http://") else TableQuery
            q = kind(bootstrap, self.engine_id, self.accept, self.auth)
            self.queries[bootstrap] = q
            for s in (q.sock, q.monitor):
                self.poller.register(s, zmq.POLLIN)
        q.used = time.monotonic()
        return q

    def forget_table(self, bootstrap: str) -> None:
        """Ask ``bootstrap`` again (a rank may have moved)."""
        if bootstrap in self.queries:
            self.queries[bootstrap].forget()

    def forget_tables_with(self, addr: str) -> None:
        """The rank at ``addr`` may come back elsewhere: ask again for every table naming it."""
        for q in self.queries.values():
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

    # ---- side channels ----

    def rank(self, addr: str, table: RankTable, cp_rank: int) -> Rank:
        """The side channel to ``table``'s CP rank ``cp_rank`` at ``addr``, opened on first
        use; what goes there is sealed for that rank (``auth.rank_name``)."""
        rank = self.ranks.get(addr)
        if rank is None:
            rank = self.ranks[addr] = Rank(addr, self.poller, self.identity, self.auth)
        rank.to = rank_name(table.engine_id, cp_rank)
        rank.used = time.monotonic()
        return rank

    def askers(self, table: RankTable, cp_rank: int) -> tuple[int, int]:
        """``(consumer_rank, consumer_size)`` this rank names to ``cp_rank``: its place among
        the decode's TP ranks that fetch from it (those holding its heads), and how many
        they are: the prefill rank frees a request once each of them is served."""
        ranks = askers(self.fingerprint.num_kv_heads, self.consumer_size, table.shard(cp_rank)[1])
        return (ranks.index(self.consumer_rank), len(ranks)) if self.consumer_rank in ranks else (0, 1)

    # ---- releases ----

    def queue_release(self, release: tuple) -> None:
        """Hold ``release`` until its prefill's rank table is known (the caller opened the query)."""
        self.unsent.setdefault(release[1], []).append(release)

    def ask_for_releases(self, now: float) -> None:
        for bootstrap in self.unsent:
            self.queries[bootstrap].ask(now)

    def send_releases(self) -> None:
        """Send the releases whose prefill's rank table is known; drop those whose
        table did not come in time (the prefill's ``send_timeout_s`` frees them)."""
        now = time.monotonic()
        for bootstrap, items in list(self.unsent.items()):
            table = self.queries[bootstrap].table
            keep = []
            for key, _, num_tokens, deadline, engine, digest in items:
                if table is not None:
                    self._release(table, key, num_tokens, engine, digest)
                elif deadline <= now:
                    log.info("release of %r not sent: no rank table from %s (%s)", key, bootstrap,
                             self.queries[bootstrap].last_reason)
                else:
                    keep.append((key, bootstrap, num_tokens, deadline, engine, digest))
            if keep:
                self.unsent[bootstrap] = keep
            else:
                del self.unsent[bootstrap]

    def release_to_refused(self, q: RankTableQuery) -> None:
        """``q``'s table is of another KV format: this rank will never fetch from it, and a
        release moves no KV, so its releases go now (freeing the blocks before the
        prefill's ``claim_timeout_s``)."""
        for key, _, num_tokens, _, engine, digest in self.unsent.pop(q.address, []):
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
            if not self.rank(addr, table, cp_rank).send(msg):
                log.info("release of %r not sent to %s: its queue is full", key, addr)

    # ---- lifetime ----

    def collect(self, in_use: set[str], busy: set[str], idle_s: float | None = None) -> list[str]:
        """Close the table queries and rank links nothing has used for ``idle_s`` (inf:
        none in use now): not the bootstraps ``in_use`` (fetches need them) or with
        releases waiting, nor the rank addresses ``busy`` (attempts in flight or
        quarantined there); ``idle_s`` None: ``IDLE_S``. Returns the bootstraps whose
        query closed."""
        now, closed, idle_s = time.monotonic(), [], IDLE_S if idle_s is None else idle_s
        for bootstrap, q in list(self.queries.items()):
            if bootstrap in in_use or bootstrap in self.unsent or now - q.used < idle_s:
                continue
            for s in (q.sock, q.monitor):
                self.poller.unregister(s)
            q.close()
            del self.queries[bootstrap]
            closed.append(bootstrap)
        for addr, rank in list(self.ranks.items()):
            if addr not in busy and now - rank.used >= idle_s:
                self.close_rank(addr)
        return closed

    def close_rank(self, addr: str) -> None:
        self.ranks.pop(addr).close(self.poller)

    def close(self) -> None:
        for q in self.queries.values():
            q.close()
        for r in self.ranks.values():
            r.close(self.poller)
