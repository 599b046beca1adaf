"""What a decode rank's fetch is made of (``receiver.Receiver`` drives it):
``Fetch``, one request's pages from every CP rank of one prefill instance;
``FetchError``, why it failed; ``Rank``, the side channel to one prefill CP rank
with what is outstanding there.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_dcp2d.transfer.auth import NO_AUTH, frame_limit
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.messages import RankTable, Reply, TransferOutcome

__all__ = ["Fetch", "FetchError", "Rank", "link_events", "drain"]

CORRUPT = "KV checksum mismatch"
REGISTER_EVERY_S = 60.0  # a link registers its session again this often (the prefill drops idle ones)
CANCEL_RESEND_MAX_S = 30.0  # a quarantining rank is asked again after 1, 2, 4, ... 30 s
SEND_HWM = 1000  # messages queued to one rank (ZMQ's default); past it a send fails instead of blocking


class FetchError(RuntimeError):
    def __init__(self, transfer_key: str, cp_rank: int | None, reason: str):
        self.transfer_key, self.cp_rank, self.reason = transfer_key, cp_rank, reason
        where = "" if cp_rank is None else f" from prefill cp rank {cp_rank}"
        super().__init__(f"fetch of {transfer_key!r}{where} failed: {reason}")

    @property
    def timed_out(self) -> bool:
        """The fetch hit its deadline (as opposed to an explicit failure)."""
        return self.reason.startswith("timed out")

    @property
    def corrupt(self) -> bool:
        """Every rank answered ok, but the bytes here are not what it sent (``verify_kv``)."""
        return self.reason.startswith(CORRUPT)


@dataclass(eq=False)
class Fetch:
    """One request's pages for this rank, from every CP rank of one prefill instance."""

    transfer_key: str
    bootstrap: str
    remote_engine_id: str | None  # the prefill engine the caller expects (None: any)
    block_ids: tuple  # int64 arrays: this rank's block table of each KV cache group
    num_tokens: int
    first_page: int
    deadline: float   # monotonic; the fence (``TransferRequest.not_after_ns``) is the same instant
    wait_s: float
    prompt_digest: str = ""  # messages.prompt_digest of the prompt here
    started: float = field(default_factory=time.monotonic)
    table: RankTable | None = None
    senders: tuple = ()  # the CP ranks asked (those holding this rank's KV heads)
    inflight: dict = field(default_factory=dict)     # cp_rank -> (rank address, attempt_id); FetchLedger
    outcomes: dict = field(default_factory=dict)     # cp_rank -> TransferOutcome
    error: FetchError | None = None
    seconds: float = 0.0
    failing: FetchError | None = None  # failed, waiting for the ranks still in flight to confirm the cancel
    peer_fault: bool = False
    settle_by: float = 0.0
    quarantined: dict = field(default_factory=dict)  # cp_rank -> why its writes may still land
    unsettled: dict = field(default_factory=dict)    # quarantined cp_rank -> (rank address, attempt_id), until it settles

    @property
    def blocks(self) -> int:
        """Blocks of its block tables: what its quarantine can keep out of use."""
        return sum(int(t.size) for t in self.block_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and self.table is not None and len(self.outcomes) == len(self.senders) > 0

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outcomes.values())

    @property
    def naive_bytes(self) -> int:
        return sum(o.naive_bytes for o in self.outcomes.values())


class Rank:
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
        self.used = time.monotonic()          # last asked or heard from (``Receiver`` closes idle links)
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


def drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
