"""What a decode rank's fetch is made of (``receiver.Receiver`` drives it):
``Fetch``, one request's pages from every CP rank of one prefill instance;
``FetchError``, why it failed. The side channel to one prefill CP rank is
``directory.Link``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_dcp2d.transfer.messages import RankTable

__all__ = ["Fetch", "FetchError"]

CORRUPT = "KV checksum mismatch"


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
    prefill_wait_s: float
    prompt_digest: str = ""  # messages.prompt_digest of the prompt here
    tag: object = None  # the caller's (``Receiver.start``): what it knows this fetch by
    started: float = field(default_factory=time.monotonic)
    table: RankTable | None = None
    senders: tuple = ()  # the CP ranks asked (those holding this rank's KV heads)
    inflight: dict = field(default_factory=dict)     # cp_rank -> (rank address, attempt_id); FetchLedger
    outcomes: dict = field(default_factory=dict)     # cp_rank -> TransferOutcome
    error: FetchError | None = None
    seconds: float = 0.0
    failing: FetchError | None = None  # failed, waiting for the ranks still in flight to answer the cancel
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
