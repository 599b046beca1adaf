"""Send staging: a prefill rank gathers one path's pages before writing them (issue 29).

Why: a decode DCP rank's pages are every N-th page of the prefill's, so no two of
them are adjacent in the prefill's memory and ``plan_path`` yields one descriptor
per page, layer and K/V plane. Over Mooncake TCP each descriptor costs about 10 us
whatever its size (``bench/descriptors.py``: 250 descriptors of 8 KiB take 2.7 ms,
the same 2 MB as one descriptor 0.6 ms), on both engines' threads. On the decode
side the same pages are usually adjacent: DCP rank d keeps page p at local slot
p div N, in blocks vLLM hands out in order. So the sender copies the path's pages
into a registered host buffer (a *slot*) in the decode's address order and writes
every run that is adjacent on the decode side as one descriptor: an 8K-token path
of the test model goes from 250 descriptors to 2. The bytes still land straight
in the decode's layout (nothing to scatter there); the cost is one local copy on
the prefill (0.15 ms at p50 for 2 MB: ``bench/descriptors.py``).

Host-memory KV only: the gather reads the KV through numpy. With KV on a GPU the
worker passes no pool (descriptors are cheap over RDMA, and a device gather is
not written yet).

A slot a write stalled through is never reused: Mooncake may still deliver a
given-up attempt's bytes later (``transport.py``), and they must be the bytes that
attempt gathered. Such a slot is replaced by a fresh one and kept, registered, for
``RETIRED_HOLD_S`` (as long as the transport keeps the replaced engine that may run
it; at most one retirement per writer thread per ``STALL_S``). A write that failed
at once (a dead peer) reads nothing later: its slot is reused.

Public API
----------
``Staged(pages, offset, write)``: one chunk of a staged path.
``stage(desc, slot_bytes, dst_memory=None) -> (list[Staged], Descriptors)``: pure; the
    chunks, and the descriptors to write in place (all of ``desc`` when staging merges
    too little).
``StagingPool(transport, slot_bytes, slots)``
    ``.take() -> Slot | None``             a free slot, or None (then write in place).
    ``.give_back(slot, clean: bool)``      after its writes; ``clean=False`` (a stall) retires it.
    ``.close()``
``Slot.addr``, ``Slot.nbytes``, ``Slot.gather(chunk: Staged, memory: Memory)``.
``write(transport, pool, memory, session, desc, stalls, dst_memory) -> (bytes, descriptors, batches)``: one
    path's write, staged when ``pool`` has a free slot and it merges enough.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from vllm_dcp2d.transfer.hostmem import gather
from vllm_dcp2d.transfer.transport import RETIRED_KEPT, STALL_S
from vllm_dcp2d.reshard.plan import Descriptors
from vllm_dcp2d.reshard.regions import Memory

__all__ = ["Staged", "stage", "Slot", "StagingPool", "write"]

log = logging.getLogger(__name__)
MIN_UNIT = 256      # bytes: below this common divisor of the lengths, the gather is not worth it
MIN_GAIN = 2        # stage only if it cuts a path's descriptors at least this many times
# A slot a write stalled through stays registered as long as the transport keeps the
# engine that may still run that write (RETIRED_KEPT engines, one renewal per STALL_S).
RETIRED_HOLD_S = RETIRED_KEPT * STALL_S


@dataclass(frozen=True)
class Staged:
    """One chunk of a staged path.

    pages:  its descriptors as planned (KV address -> consumer address), in the
            consumer's address order; what goes in place if no slot is free.
    offset: int64 ``[len(pages)]``, where each lands in the slot (consecutive).
    write:  the slot's bytes to the consumer: ``src`` = offset in the slot,
            consumer-adjacent descriptors merged.
    """

    pages: Descriptors
    offset: np.ndarray
    write: Descriptors


def stage(desc: Descriptors, slot_bytes: int, dst_memory: Memory | None = None) -> tuple[list[Staged], Descriptors]:
    """Split ``desc`` into chunks of at most ``slot_bytes`` staged bytes each, laid out
    in the consumer's address order, with consumer-adjacent descriptors merged, but
    never across two of ``dst_memory``'s ranges (the consumer's registered buffers:
    one write must land in one).

    Returns ``(chunks, in_place)``: descriptors longer than a slot go in place, and
    so does all of ``desc`` when staging would not cut its descriptor count by
    ``MIN_GAIN`` or the lengths share no divisor of ``MIN_UNIT`` bytes or more.
    """
    if slot_bytes < MIN_UNIT:
        raise ValueError(f"slot_bytes must be >= {MIN_UNIT}, got {slot_bytes}")
    fits = desc.length <= slot_bytes
    if len(desc) < MIN_GAIN or not fits.any() or int(np.gcd.reduce(desc.length[fits])) < MIN_UNIT:
        return [], desc
    order = np.flatnonzero(fits)
    order = order[np.argsort(desc.dst[order], kind="stable")]
    src, dst, length = desc.src[order], desc.dst[order], desc.length[order]
    end = np.cumsum(length)
    start = end - length
    # Greedy chunks: a loop per slot-full of bytes, not per page.
    firsts = [0]
    while (nxt := int(np.searchsorted(end, start[firsts[-1]] + slot_bytes, side="right"))) < src.size:
        firsts.append(nxt)
    bounds = firsts + [src.size]
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        off = start[a:b] - start[a]
        d, n = dst[a:b], length[a:b]
        brk = d[1:] != d[:-1] + n[:-1]
        if dst_memory is not None:
            buf = np.searchsorted(dst_memory.addr, d, side="right")
            brk |= buf[1:] != buf[:-1]
        run = np.flatnonzero(np.concatenate(([True], brk)))
        run_len = np.diff(np.append(off[run], off[-1] + n[-1]))
        chunks.append(Staged(Descriptors(src[a:b], d, n), off, Descriptors(off[run], d[run], run_len)))
    in_place = Descriptors(desc.src[~fits], desc.dst[~fits], desc.length[~fits])
    if sum(len(c.write) for c in chunks) + len(in_place) > len(desc) / MIN_GAIN:
        return [], desc
    return chunks, in_place


class Slot:
    """One registered host buffer: ``addr``, ``nbytes``."""

    def __init__(self, nbytes: int):
        self.buf = np.empty(nbytes, dtype=np.uint8)
        self.addr, self.nbytes = int(self.buf.ctypes.data), int(nbytes)

    def gather(self, c: Staged, memory: Memory) -> None:
        """Copy each of ``c.pages`` (``length[k]`` bytes at KV address ``src[k]``) to
        offset ``c.offset[k]`` of this slot; every source must lie in one range of
        ``memory`` (host memory)."""
        g = c.pages
        if not len(g):
            return
        off = c.offset
        if off[0] < 0 or off[-1] + g.length[-1] > self.nbytes or (np.diff(off) != g.length[:-1]).any():
            raise ValueError("staged offsets must be consecutive and inside the slot")
        try:
            gather(memory, g.src, g.length, self.buf[off[0]:off[-1] + g.length[-1]])
        except ValueError as e:
            raise ValueError(f"staging: {e}") from None


class StagingPool:
    """``slots`` slots of ``slot_bytes``, registered on ``transport`` (thread-safe)."""

    def __init__(self, transport, slot_bytes: int, slots: int):
        if slot_bytes < MIN_UNIT or slots < 1:
            raise ValueError(f"need slot_bytes >= {MIN_UNIT} and slots >= 1, got {slot_bytes} and {slots}")
        self.transport, self.slot_bytes = transport, int(slot_bytes)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._retired: deque[tuple[float, Slot]] = deque()  # (held until, slot), oldest first
        self._lock = threading.Lock()
        for _ in range(slots):
            self._free.put(self._new())

    def _new(self) -> Slot:
        s = Slot(self.slot_bytes)
        self.transport.register(s.addr, s.nbytes)
        return s

    def take(self) -> Slot | None:
        """A free slot, or None when every slot is in use (the caller writes in place)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def give_back(self, slot: Slot, clean: bool) -> None:
        """Return ``slot`` after its writes. ``clean=False`` (a write through it stalled):
        a late delivery may still read it, so it is kept registered for ``RETIRED_HOLD_S``
        and a fresh slot takes its place. Never raises."""
        if clean:
            return self._free.put(slot)
        now = time.monotonic()
        with self._lock:
            self._retired.append((now + RETIRED_HOLD_S, slot))
            self._evict(now)
        try:
            self._free.put(self._new())
        except Exception as e:  # the pool shrinks; writes go in place when it is empty
            log.warning("send staging: could not replace a retired slot (%s); %d bytes less to stage in", e,
                        self.slot_bytes)

    def _evict(self, now: float) -> None:
        """Unregister (and let go of) retired slots held for their whole time (under ``_lock``)."""
        while self._retired and self._retired[0][0] <= now:
            self._unregister(self._retired.popleft()[1])

    def _unregister(self, slot: Slot) -> None:
        try:
            self.transport.unregister(slot.addr)
        except Exception as e:  # the engine may be closed already; the memory goes with the slot
            log.warning("send staging: unregistering a slot failed: %s", e)

    def close(self) -> None:
        """Unregister every slot (after the writers stopped and the transport's writes ended)."""
        with self._lock:
            slots = [slot for _, slot in self._retired]
            self._retired.clear()
        while True:
            try:
                slots.append(self._free.get_nowait())
            except queue.Empty:
                break
        for s in slots:
            self._unregister(s)


def write(transport, pool: StagingPool | None, memory: Memory, session: str, desc: Descriptors,
          stalls: list[int], dst_memory: Memory | None = None, not_after_ns: int = 0) -> tuple[int, int, int]:
    """Write ``desc`` (KV -> ``session``'s memory) on ``transport``, through a slot of
    ``pool`` when one is free and staging merges enough. ``memory``: the KV ranges
    any source must lie in; ``dst_memory``: the consumer's registered ranges (runs
    merge within one). ``stalls`` and ``not_after_ns`` as ``MooncakeTransport.write``. Returns
    ``(bytes, descriptors, batches)`` written; raises what the transport raises.
    A slot goes back clean unless a write through it stalled (then a late delivery
    may read it); a write that failed at once read nothing more."""
    slot = pool.take() if pool is not None else None
    chunks, in_place = stage(desc, slot.nbytes, dst_memory) if slot is not None else ([], desc)
    nbytes, written, batches = 0, 0, 0

    def send(d: Descriptors) -> None:
        nonlocal nbytes, written, batches
        nbytes += transport.write(session, d, stalls, not_after_ns)
        written += len(d)
        batches += -(-len(d) // transport.max_batch)

    try:
        for c in chunks:
            if slot is None:  # the slot was retired and no other is free: the rest in place
                send(c.pages)
                continue
            slot.gather(c, memory)
            seen = len(stalls)
            try:
                send(Descriptors(c.write.src + slot.addr, c.write.dst, c.write.length))
            finally:
                if len(stalls) > seen:  # a late delivery may still read this slot
                    retired, slot = slot, None
                    pool.give_back(retired, clean=False)
            if slot is None:
                slot = pool.take()
        if len(in_place):
            send(in_place)
    finally:
        if slot is not None:
            pool.give_back(slot, clean=True)
    return nbytes, written, batches
