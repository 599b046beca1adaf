"""One prefill rank and one decode rank on real Mooncake engines, for the transfer tests: the
KV layout they share (2 layers of 8 blocks of 256 B, 16-token pages), ``Side`` (a real
``Sender`` over a ``Gate``d transport and a real ``Receiver``), and the waits the tests force
races with."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from vllm_dcp2d.reshard.regions import KVRegions
from vllm_dcp2d.transfer.bootstrap import BootstrapServer, register_rank
from vllm_dcp2d.transfer.messages import Fingerprint, RegisterRank, TransferRequest
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.transfer.transport import MooncakeTransport

L, PAGE, PAGE_BYTES, BLOCKS = 2, 16, 256, 8
FP = Fingerprint("m", L, PAGE, "uint8", PAGE_BYTES, "test", "cfg")
SRC_IDS = np.array([5, 0, 6, 2])      # producer block of each of the 4 pages
DST_IDS = np.array([7, 1, 4, 3])      # decode DCP=1: page i -> block DST_IDS[i]
TOKENS = 4 * PAGE - 5


def regions(kv: np.ndarray) -> KVRegions:
    return KVRegions.uniform(np.arange(L), kv.ctypes.data + np.arange(L) * kv[0].nbytes, PAGE_BYTES)


def wait_until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def deadline_now(recv: Receiver, key: str) -> None:
    """The fetch of ``key`` reaches its deadline now: a test forces the race it is
    about (the deadline passing while a write is in flight) instead of hoping a
    short timeout falls after the fetch reached the rank on a loaded machine."""
    (f,) = [f for f in recv.ledger.active() if f.transfer_key == key]
    f.deadline = time.monotonic()


class Gate:
    """A transport whose writes wait until ``open()``: a write stalled in flight.
    ``ended``: monotonic times at which real writes returned (reads of the source
    and bytes into the destination happen before that)."""

    def __init__(self, transport):
        self.transport = transport
        self.entered = threading.Event()
        self._open = threading.Event()
        self.ended: list[float] = []

    def open(self):
        self._open.set()

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        self.entered.set()
        assert self._open.wait(60), "gate never opened"
        try:
            return self.transport.write(peer, desc, stalls, not_after_ns)
        finally:
            self.ended.append(time.monotonic())

    def __getattr__(self, name):
        return getattr(self.transport, name)


class Side:
    """One prefill rank (real Sender over a gated Mooncake transport) and one decode
    rank (real Receiver), byte arrays for KV."""

    def __init__(self, stack: contextlib.ExitStack, sender_kw=None, receiver_kw=None, rank_address=None):
        rng = np.random.default_rng(0)
        self.src = rng.integers(1, 255, (L, BLOCKS, PAGE_BYTES), dtype=np.uint8)
        self.dst = np.zeros((L, BLOCKS, PAGE_BYTES), np.uint8)
        tp, td = MooncakeTransport(), MooncakeTransport()
        stack.callback(td.close)
        stack.callback(tp.close)
        tp.register(self.src.ctypes.data, self.src.nbytes)
        self.boot = stack.enter_context(BootstrapServer())
        self.gate = Gate(tp)
        self.sender = Sender(self.gate, regions(self.src), FP, engine_id="P", cp_rank=0, cp_size=1,
                             bootstrap=None if rank_address else self.boot.address, **(sender_kw or {}))
        stack.callback(self.sender.close)
        if rank_address:  # the decode reaches the rank through rank_address(sender.address)
            register_rank(self.boot.address, RegisterRank("P", 0, 1, rank_address(self.sender.address), FP), 5)
        kw = dict(transfer_timeout_s=30.0, cancel_grace_s=0.5) | (receiver_kw or {})
        self.recv = Receiver(td, regions(self.dst), FP, engine_id="D", buffers=[(self.dst.ctypes.data,
                                                                                 self.dst.nbytes)], **kw)
        stack.callback(self.recv.close)

    def expected(self) -> np.ndarray:
        want = np.zeros_like(self.dst)
        want[:, DST_IDS] = self.src[:, SRC_IDS]
        return want


def released_then_unchanged(side: Side, settle_s: float = 0.5) -> None:
    """No byte lands after the caller released the decode blocks."""
    snapshot = side.dst.copy()
    time.sleep(settle_s)
    assert np.array_equal(side.dst, snapshot), "bytes landed after the blocks were released"


class StalledThenRetried:
    """Every write: the first attempt stalls and is given up (its code goes to
    ``stalls``, as ``MooncakeTransport.write`` reports it), the retry succeeds. The
    given-up attempt's descriptors are kept: ``land()`` delivers them late."""

    def __init__(self, real):
        self.real = real
        self.max_batch = real.max_batch
        self.ghosts: list = []

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        stalls.append(-1)
        self.ghosts.append((peer, desc))
        return self.real.write(peer, desc)

    def land(self) -> int:
        """The given-up attempts' bytes arrive now (a real Mooncake write each)."""
        return sum(self.real.write(peer, desc) for peer, desc in self.ghosts)

    def __getattr__(self, name):  # register, registered, ...: the real transport's
        return getattr(self.real, name)


_LEDGER_KV = np.zeros((2, 8, 256), np.uint8)  # where ``request``'s regions point (never written)


def request(key="k", attempt=1, engine="D", rank=0, size=1, tokens=40, wait_s=5.0) -> TransferRequest:
    """A decode's request of 3 blocks for ``SendLedger`` tests (no socket, no write)."""
    regions = KVRegions.uniform([0, 1], _LEDGER_KV.ctypes.data + np.arange(2) * _LEDGER_KV[0].nbytes, 256)
    return TransferRequest.build(
        regions=regions, block_ids=np.arange(3), transfer_key=key,
        attempt_id=attempt, engine_id=engine, consumer_rank=rank, consumer_size=size, dcp_size=1,
        dcp_rank=0, num_tokens=tokens, first_page=0, num_blocks=8, fingerprint=FP, wait_s=wait_s)
