"""The DCP group's all-gather through one shared-memory segment, for vLLM builds
without shared-memory collectives.

vLLM's AVX2 CPU build (``vllm._C_AVX2``, loaded on x86 hosts without AVX-512) has no
``torch.ops._C.init_shm_manager``, so there a DCP group's all-gathers of ``[O|LSE]``
(two per attention layer and step, ``attention/dcp.py`` and the query gather of
``vllm_compat/cpu_attn.py``) would run over gloo on loopback TCP. The ranks of one
DCP group are processes of one instance on one host; this all-gather moves their
bytes through a ``/dev/shm`` segment instead. Pure torch and the OS.

Segment (one per group, ``2 * N * slot_bytes`` of data plus a header of one 64-byte
line per rank): each rank owns one slot in each of two buffers. A gather of ``B``
bytes per rank runs in ``ceil(B / slot_bytes)`` rounds (at least one); in round ``s``
(counted over the group's life) a rank copies its chunk into its slot of buffer
``s % 2``, writes ``B`` and then ``s`` into its header line, polls until every
rank's ``s`` has come, checks that every rank gathers ``B`` bytes, and copies all
slots of that buffer into the output. Two buffers are enough without any
acknowledgement: a rank starts round ``s + 2`` (reusing buffer ``s % 2``) only
after every rank published ``s + 1``, which each does only after it finished
reading round ``s``. Publishing after the copy relies on x86-64 keeping stores in
order (TSO); the patch uses this gather on x86-64 only (vLLM's other CPU builds
carry their own shared-memory collectives).

Bounds: the segment is ``2 * N * slot_bytes`` (4 MiB for DCP=2 at the default),
reserved at creation (``posix_fallocate``: a full ``/dev/shm`` fails there with an
error, not later with SIGBUS). Every poll has a deadline (``timeout_s``; ``ShmGatherError``
past it, naming the ranks that did not come), and a peer that exited, or closed
its end, is noticed within ``LIVENESS_S``. Set-up is two exchanges over the
group (in vLLM, ``all_gather_object`` over its gloo group, bounded by that group's
timeout, as vLLM's own shared-memory set-up is). Files: rank 0 creates the
segment under a fresh random name and unlinks it as soon as every rank has opened it
(or failed to), so nothing is left in ``/dev/shm`` while the group runs, nor
after a crash; only a rank 0 killed inside set-up can leave one
(``vllm_dcp2d_gather-*``, unlinked by ``local/shm.remove_unheld`` once no process holds it:
the servers of ``local/servers.py`` as they stop, the test suite at start).
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["ShmAllGather", "ShmGatherError", "GatherUnavailable", "open_group", "PREFIX", "SLOT_BYTES",
           "TIMEOUT_S"]

PREFIX = "vllm_dcp2d_gather-"
SLOT_BYTES = 1 << 20  # per rank and buffer; a decode's [O|LSE] fits one round, a 4096-token chunk's takes 17
TIMEOUT_S = 300.0  # a live peer this far behind inside one forward pass is stuck, not slow
LIVENESS_S = 0.1  # how often a rank that polls checks that its peers still run
SPIN_S = 2e-4  # poll without yielding this long (a decode's peer is usually microseconds away)
YIELD_S = 5e-3  # then yield the core between polls this long, then sleep SLEEP_S between them
SLEEP_S = 1e-4

_MAGIC, _VERSION = 0x64637032645F6167, 1  # "dcp2d_ag"
_LINE = 8  # int64 words per header line (64 bytes): line 0 the group's, line 1 + r rank r's
_PID, _START, _SEQ, _TOTAL, _STATE = 0, 1, 2, 3, 5  # rank line words; _TOTAL, _TOTAL + 1: bytes per buffer
_JOINED, _CLOSED = 1, 2


class ShmGatherError(RuntimeError):
    """An all-gather that cannot complete: a peer exited, closed, is late past the
    timeout, or gathers another size. The group is unusable after it."""


class GatherUnavailable(RuntimeError):
    """Set-up failed on some rank (every rank raises it, with the same reason):
    the caller keeps its other transport."""


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a running process ``pid``; None if it
    is gone or a zombie. Pid and start time together name one process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # fields 3 (state) and 22 (starttime)


class ShmAllGather:
    """One rank's end of a group's shared-memory all-gather (made by :func:`open_group`)."""

    def __init__(self, fd: int, name: str, world_size: int, rank: int, slot_bytes: int, timeout_s: float,
                 create: bool):
        self.name, self.world_size, self.rank = name, world_size, rank
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        header = -(-_LINE * 8 * (world_size + 1) // 4096) * 4096
        size = header + 2 * world_size * slot_bytes
        if create:
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size != size:
            raise ValueError(f"segment {name} holds {os.fstat(fd).st_size} bytes, expected {size} for "
                             f"{world_size} ranks of {slot_bytes}-byte slots")
        self._mm = mmap.mmap(fd, size)
        # The header as int64 words (a memoryview: one aligned 8-byte load or store per
        # access, and the cheapest from Python on the per-round path).
        self._w = memoryview(self._mm)[:header].cast("q")
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header,
                                count=2 * world_size * slot_bytes).view(2, world_size, slot_bytes)
        self._bufs = (data[0], data[1])  # [N, slot_bytes] each
        self._mine = (data[0, rank], data[1, rank])
        w = self._w
        group = (_MAGIC, _VERSION, world_size, slot_bytes)
        if create:
            w[0], w[1], w[2], w[3] = group
        elif tuple(w[:4]) != group:
            raise ValueError(f"segment {name} is for {tuple(w[2:4])} (ranks, slot bytes) of version {w[1]}, "
                             f"this rank expects ({world_size}, {slot_bytes}) of {_VERSION}")
        me = _LINE * (1 + rank)
        w[me + _PID], w[me + _START], w[me + _STATE] = os.getpid(), _proc_start(os.getpid()) or 0, _JOINED
        self._my_seq, self._my_total = me + _SEQ, me + _TOTAL
        self._seqs = [_LINE * (1 + r) + _SEQ for r in range(world_size)]  # word of each rank's round
        self._totals = [[_LINE * (1 + r) + _TOTAL + b for r in range(world_size)] for b in (0, 1)]
        self._seq = 0
        self._peers: dict[int, tuple[int, int]] = {}  # rank -> (pid, start) of the peers this rank can watch
        self.broken: str | None = None

    def _word(self, rank: int, word: int) -> int:
        return self._w[_LINE * (1 + rank) + word]

    def _watch_peers(self) -> None:
        """Note the peers whose processes this rank can see (in its pid namespace, by
        pid and start time); the others are bounded by the timeout alone."""
        for r in range(self.world_size):
            pid, start = self._word(r, _PID), self._word(r, _START)
            if r != self.rank and pid > 0 and _proc_start(pid) == start:
                self._peers[r] = (pid, start)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group=None) -> None:
        """``torch.distributed.all_gather_into_tensor`` over the group: ``output`` (contiguous,
        ``[N * T, ...]`` of ``input``'s dtype) gets every rank's ``input`` ``[T, ...]``
        bytes in rank order. Any dtype and shape, the same on every rank (checked by
        size); ``group`` is ignored (vLLM's ``CpuCommunicator`` passes its own)."""
        if self.broken:
            raise ShmGatherError(f"shared-memory all-gather {self.name} is unusable: {self.broken}")
        fits = output.numel() == self.world_size * input.numel()
        if output.dtype != input.dtype or not output.is_contiguous() or not fits:
            raise ValueError(f"all_gather_into_tensor: output {output.dtype} {tuple(output.shape)} "
                             f"(contiguous: {output.is_contiguous()}) cannot hold {self.world_size} x input "
                             f"{input.dtype} {tuple(input.shape)}")
        src = input.reshape(-1).view(torch.uint8)  # a copy only if input is not contiguous
        dst = output.view(-1).view(torch.uint8).view(self.world_size, -1)
        total, slot, w = src.numel(), self.slot_bytes, self._w
        try:
            for lo in range(0, max(total, 1), slot):
                n = min(slot, total - lo)
                self._seq += 1
                seq, buf = self._seq, self._seq & 1
                self._mine[buf][:n].copy_(src[lo:lo + n])
                w[self._my_total + buf] = total
                w[self._my_seq] = seq  # published: the chunk and the total are in place
                for i in self._seqs:
                    if w[i] < seq:
                        self._until_all_published(seq)
                        break
                for i in self._totals[buf]:
                    if w[i] != total:
                        raise ShmGatherError(f"ranks gather different sizes (bytes per rank: "
                                             f"{[w[j] for j in self._totals[buf]]}; rank {self.rank} gathers "
                                             f"{tuple(input.shape)} {input.dtype})")
                dst[:, lo:lo + n].copy_(self._bufs[buf][:, :n])
        except ShmGatherError as e:
            self.broken = str(e)
            raise

    def _late(self, seq: int) -> list[int]:
        return [r for r, i in enumerate(self._seqs) if self._w[i] < seq]

    def _until_all_published(self, seq: int) -> None:
        """Poll until every rank published round ``seq``: spin, then yield, then sleep;
        raise ShmGatherError past ``timeout_s`` or when a peer exited or closed."""
        t0 = time.monotonic()
        check = t0 + LIVENESS_S
        while self._late(seq):
            now = time.monotonic()
            if now - t0 > SPIN_S:
                if now - t0 > YIELD_S:
                    time.sleep(SLEEP_S)
                else:
                    os.sched_yield()
            if now >= check:
                check = now + LIVENESS_S
                self._check_peers(seq)
                if now - t0 > self.timeout_s:
                    raise ShmGatherError(f"rank {self.rank} waited {now - t0:.1f} s (timeout_s={self.timeout_s}) "
                                         f"in all-gather round {seq} of {self.name} for rank(s) {self._late(seq)}: "
                                         f"alive but not gathering")

    def _check_peers(self, seq: int) -> None:
        if not self._peers:
            self._watch_peers()
        for r in self._late(seq):
            if self._word(r, _STATE) == _CLOSED:
                raise ShmGatherError(f"rank {r} closed shared-memory all-gather {self.name} while rank "
                                     f"{self.rank} waited for it in round {seq}")
            pid, start = self._peers.get(r, (0, None))
            if pid and _proc_start(pid) != start:
                raise ShmGatherError(f"rank {r} (pid {pid}) exited while rank {self.rank} waited for it in "
                                     f"all-gather round {seq} of {self.name}")

    def close(self) -> None:
        """Leave the group (peers that poll for this rank fail at once) and unmap."""
        if self._mm.closed:
            return
        self._w[self._my_seq - _SEQ + _STATE] = _CLOSED
        self.broken = self.broken or "closed"
        self._w.release()
        self._bufs = self._mine = None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view of a slot: the mapping goes with it
            pass


def open_group(world_size: int, rank: int, exchange: Callable[[object], list], *, slot_bytes: int = SLOT_BYTES,
               timeout_s: float = TIMEOUT_S, directory: str = "/dev/shm") -> ShmAllGather:
    """Every rank of the group calls this at once; returns its end of the all-gather.

    exchange: an all-gather of one picklable object over the group (``obj -> [obj of
    rank 0, ..., obj of rank N-1]``), such as ``torch.distributed.all_gather_object``;
    it is called twice. Rank 0 creates the segment in ``directory``, the others open
    it (a rank on another host, or in another ``/dev/shm``, cannot); then rank 0
    unlinks it. Raises GatherUnavailable on every rank if any rank failed.
    """
    if not 2 <= world_size or not 0 <= rank < world_size or slot_bytes < 1:
        raise ValueError(f"open_group: world_size={world_size}, rank={rank}, slot_bytes={slot_bytes}")
    gather, path, fd, err = None, None, -1, None
    try:
        if rank == 0:  # the segment is whole before anyone learns its name
            try:
                fresh = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
                fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                path = fresh  # ours to unlink
                gather = ShmAllGather(fd, path, world_size, rank, slot_bytes, timeout_s, create=True)
            except OSError as e:
                err = f"rank 0 could not make a segment in {directory}: {type(e).__name__}: {e}"
        name, err = exchange((path, err))[0]
        if err is None:  # every rank saw rank 0 succeed: every rank takes part in the second exchange
            if rank:
                try:
                    fd = os.open(os.path.join(directory, os.path.basename(name)), os.O_RDWR)
                    gather = ShmAllGather(fd, name, world_size, rank, slot_bytes, timeout_s, create=False)
                except (OSError, ValueError) as e:
                    err = f"rank {rank} could not open {name}: {type(e).__name__}: {e}"
            err = "; ".join(e for e in exchange(err) if e) or None
    finally:
        if fd >= 0:
            os.close(fd)  # the mapping stays
        if path is not None:
            try:
                os.unlink(path)  # every rank has it mapped, or gave up: the name has served
            except FileNotFoundError:
                pass
    if err is not None:
        if gather is not None:
            gather.close()
        raise GatherUnavailable(err)
    gather._watch_peers()
    return gather
