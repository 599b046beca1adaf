"""What landed is what was sent: a checksum of one path's bytes, computed on both sides
(``verify_kv``; docs/security.md, "What lands is what was asked for").

A prefill rank hashes the bytes it wrote for a decode rank (read from its own KV),
the decode rank hashes the same byte ranges of its own KV once every answer is in;
any difference (a page corrupted on the way, a write that did not happen, a page
written to the wrong place, a peer that answered ok without writing) fails the fetch
before the blocks are used or cached. Both hash the path's destination ranges in address
order: each side can list them (the decode from its own block tables, without the
prefill's), and the order does not depend on how a plan merged its runs.

One algorithm wherever the KV is, computed with torch on the device that holds it (a GPU's
KV never leaves the GPU, a host's never leaves host memory): a CPU-KV prefill and a GPU-KV
decode compare the same value. The stream ``S`` is the path's bytes in that order,
zero-padded to whole blocks of ``BLOCK`` = 4096 bytes; block ``b`` is read as int8
``x[b, 0:4096]``. With fixed coefficients (``R``: int8 ``[4096, 16]``; ``T``: ``[256, 16]``
in ``[0, 2^28)``; ``G``: ``[16]`` in ``[2, P)``; ``P = 2^31 - 1``), per lane ``l`` of 16:

    I[b, l] = sum_j x[b, j] R[j, l]                       (an int8 GEMM, exact in int32: |I| <= 2^26)
    H[g, l] = sum_k I[256 g + k, l] T[k, l]   mod P       (blocks in groups of 256 = 1 MiB)
    A[l]    = sum_g H[g, l] G[l]^g            mod P
    checksum = blake2b-128(ALGORITHM, len(S) before padding, A)

Every step is exact integer arithmetic: any device, reduction order or chunking gives the
same digits. What it catches: two streams of one length that differ in a way that does not
depend on the coefficients (corrupted, lost or misplaced pages) agree in one lane with
probability at most 2^-8 + 2^-28 + groups / 2^31 (one differing byte: one value of its
``R`` entry in 256 cancels it; then one ``T`` value; then a root of a polynomial in ``G``),
in all 16 independent lanes about 2^-128 (for paths up to GiBs); different lengths differ in
the length. Not an attacker: the coefficients are public, so a hostile writer can forge
it, as it could any unkeyed checksum (xxh3 included); keeping hostile writers off the
control plane is the secret's job (``auth.py``).

Why this one (BENCHMARKS.md, "The trust boundary's cost"): the inner sum is an int8 GEMM,
which the project's CPU runs on AMX and a GPU on its int8 tensor cores, so the check costs
about what gathering the path's pages costs: on one thread of this project's CPU as fast as or
faster than the xxh3-128 of host memory it replaced (which no GPU runs), so one algorithm
serves both kinds of KV and nothing is negotiated. A device whose int8 GEMM is missing or
fails a known-answer check computes the same integers in float64 (exact below 2^53).

Public API
----------
``checksum(memory, src, length, order, chunk_bytes=None) -> str``: 32 hex digits over
    ``length[k]`` bytes at ``src[k]`` taken in the order ``order`` (int64 ``[n]`` each);
    ``memory``: a ``Memory`` of host ranges, or a ``KVBytes`` (any device).
``KVBytes``: registered KV as uint8 tensors by address (``of_memory``, ``of_tensors``).
``path_ranges(regions, block_ids, layers, dcp_size, dcp_rank, first_page, num_pages, heads=None,
    sender_heads=None) -> Descriptors``: the destination ranges of a path on the consumer
    (``dst``, ``length``), of the KV heads both ranks hold.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib

import numpy as np
import torch

from vllm_dcp2d.transfer.hostmem import bytes_at
from vllm_dcp2d.reshard.plan import Descriptors, plan_path
from vllm_dcp2d.reshard.regions import KVRegions, Memory

__all__ = ["checksum", "path_ranges", "KVBytes", "ALGORITHM", "BLOCK", "GROUP_BYTES", "LANES", "P", "CHUNK_BYTES"]

ALGORITHM = b"dcp2d-kv-lin16-v1"
BLOCK, GROUP, LANES = 4096, 256, 16     # bytes per block, blocks per group, lanes
GROUP_BYTES = BLOCK * GROUP
P = (1 << 31) - 1
CHUNK_BYTES = {"cpu": 4 << 20}          # gathered at once (whole groups): near cache-sized on a CPU
DEVICE_CHUNK_BYTES = 32 << 20           # ... elsewhere: what a checksum holds besides the KV

_SEED = hashlib.shake_128(ALGORITHM).digest(BLOCK * LANES + GROUP * LANES * 4 + LANES * 8)
_R = np.frombuffer(_SEED, np.int8, BLOCK * LANES).reshape(BLOCK, LANES)
_T = (np.frombuffer(_SEED, "<u4", GROUP * LANES, BLOCK * LANES) & ((1 << 28) - 1)).astype(np.int64).reshape(GROUP, LANES)
_G = (np.frombuffer(_SEED, "<u8", LANES, BLOCK * LANES + GROUP * LANES * 4) % (P - 2) + 2).astype(np.int64)
_INT8_GEMM: dict[str, bool] = {}         # device -> its int8 GEMM is there and exact


class KVBytes:
    """Registered KV memory as uint8 tensors, one per range, all on one device: what a
    checksum reads. ``addr``: int64 ``[m]`` sorted range starts; ``tensors[k]``: uint8
    ``[nbytes[k]]`` over ``[addr[k], addr[k] + nbytes[k])``."""

    def __init__(self, addr, tensors: list[torch.Tensor]):
        order = np.argsort(np.asarray(addr, dtype=np.int64), kind="stable")
        self.tensors = [tensors[i] for i in order]
        if {t.device for t in self.tensors} != {self.tensors[0].device} or any(
                t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() for t in self.tensors):
            raise ValueError("KVBytes takes contiguous 1-D uint8 tensors on one device")
        self.device = self.tensors[0].device
        self.memory = Memory(np.asarray(addr, dtype=np.int64)[order], [t.numel() for t in self.tensors])

    @classmethod
    def of_memory(cls, memory: Memory) -> KVBytes:
        """Host ranges (``memory``), viewed without a copy."""
        return cls(memory.addr, [torch.frombuffer(bytes_at(int(a), int(n)), dtype=torch.uint8)
                                 for a, n in zip(memory.addr, memory.nbytes)])

    @classmethod
    def of_tensors(cls, tensors) -> KVBytes:
        """The storages behind KV tensors (any layout; one device), each once: the ranges
        ``page_format.kv_regions`` registers."""
        views = {}
        for t in tensors:
            s = t.untyped_storage()
            views.setdefault(s.data_ptr(), torch.empty(0, dtype=torch.uint8, device=t.device).set_(s))
        return cls(list(views), list(views.values()))

    def gather(self, at: np.ndarray, unit: int, out: torch.Tensor) -> None:
        """``out`` (uint8 ``[len(at) * unit]``, this device) <- the ``unit`` bytes at each
        address ``at`` (int64), in order: one indexed copy per registered range."""
        rows = out.view(-1, unit)
        where = np.searchsorted(self.memory.addr, at, side="right") - 1
        for r in np.unique(where):  # one per registered range (a handful), not per page
            t = self.tensors[r]
            view = torch.as_strided(t, (t.numel() - unit + 1, unit), (1, 1))
            sel = np.flatnonzero(where == r)
            idx = torch.from_numpy(at[sel] - int(self.memory.addr[r])).to(self.device)
            if sel[-1] - sel[0] + 1 == sel.size:  # one run of the output (a plane of the path): in place
                torch.index_select(view, 0, idx, out=rows[sel[0]:sel[-1] + 1])
            else:
                rows[torch.from_numpy(sel).to(self.device)] = view.index_select(0, idx)


def checksum(memory: Memory | KVBytes, src: np.ndarray, length: np.ndarray, order: np.ndarray,
             chunk_bytes: int | None = None) -> str:
    """The module's checksum of the bytes ``[src[k], src[k] + length[k])`` (in ``memory``),
    concatenated in the order ``np.argsort(order)``: pass each range's destination address
    as ``order``. ``chunk_bytes`` (a multiple of ``GROUP_BYTES``): bytes gathered at once,
    which changes the time, never the value. Raises ValueError for a range outside ``memory``."""
    kv = memory if isinstance(memory, KVBytes) else KVBytes.of_memory(memory)
    idx = np.argsort(order, kind="stable")
    src, length = np.asarray(src, dtype=np.int64)[idx], np.asarray(length, dtype=np.int64)[idx]
    if not kv.memory.holds(src, length).all():
        raise ValueError("a checksum read falls outside the memory this rank registered")
    chunk = chunk_bytes or CHUNK_BYTES.get(kv.device.type, DEVICE_CHUNK_BYTES)
    if chunk <= 0 or chunk % GROUP_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {GROUP_BYTES}, got {chunk}")
    total = int(length.sum())
    unit = int(np.gcd.reduce(np.append(length, chunk)))  # divides every range and every chunk boundary
    count = length // unit
    ends = np.cumsum(count)
    with _one_host_thread(kv.device):
        lanes = _Lanes(kv.device, chunk // GROUP_BYTES)
        buf = torch.empty(chunk, dtype=torch.uint8, device=kv.device)
        for start in range(0, total, chunk):  # a loop per chunk, not per range
            u = np.arange(start // unit, min(total, start + chunk) // unit, dtype=np.int64)
            k = np.searchsorted(ends, u, side="right")
            used = u.size * unit
            kv.gather(src[k] + (u - ends[k] + count[k]) * unit, unit, buf[:used])
            whole = -(-used // GROUP_BYTES) * GROUP_BYTES
            buf[used:whole].zero_()
            lanes.add(buf[:whole])
        return lanes.digest(total)


@contextlib.contextmanager
def _one_host_thread(device: torch.device):
    """On a host, run the checksum's torch ops on the calling thread alone. It runs beside the
    forward (a sender's writer, the receiver's thread): a team of the worker's thread count
    would contend with the forward's for the same cores (here, with the other core busy, a
    2-thread int8 GEMM took 20 times the 1-thread time), while one thread reads the KV faster
    than the xxh3 path it replaced did. The calling thread's OpenMP setting, restored after:
    ``torch.set_num_threads`` would change the process's (and clear oneDNN's primitive cache)."""
    omp = _OMP if device.type == "cpu" else None
    if omp is None:
        yield
        return
    torch.get_num_threads()  # torch's first call on a thread sets its OpenMP team: before ours, not over it
    before = omp.omp_get_max_threads()
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(before)


def _openmp():
    """The process's OpenMP runtime (torch's), or None where its symbols are not global."""
    lib = ctypes.CDLL(None)
    return lib if hasattr(lib, "omp_set_num_threads") and hasattr(lib, "omp_get_max_threads") else None


_OMP = _openmp()


class _Lanes:
    """The 16 lane sums ``A`` of one checksum, on its device (int64 ``[16]``), folded in
    group by group from the first."""

    def __init__(self, device: torch.device, max_groups: int):
        self.device = device
        self.r = torch.from_numpy(_R.copy()).to(device)
        self.t = torch.from_numpy(_T).to(device)
        step = np.ones((max_groups, LANES), dtype=np.int64)  # G ** i mod P, i < max_groups
        for i in range(1, max_groups):
            step[i] = step[i - 1] * _G % P
        self.step = torch.from_numpy(step).to(device)
        self.g_max = _G_pow(max_groups)
        self.next = np.ones(LANES, dtype=np.int64)  # G ** (groups folded so far) mod P
        self.acc = torch.zeros(LANES, dtype=torch.int64, device=device)

    def add(self, data: torch.Tensor) -> None:
        """Fold in ``data`` (uint8, whole groups, at most ``max_groups``): the next groups."""
        inner = _inner(data.view(torch.int8).view(-1, BLOCK), self.r)                  # [blocks, 16] int32
        h = (inner.view(-1, GROUP, LANES).to(torch.int64) * self.t).sum(1) % P       # [groups, 16]; < 2^62 before
        m = h.shape[0]
        powers = self.step[:m] * torch.from_numpy(self.next).to(self.device) % P    # G ** (first + i)
        self.acc += (h * powers % P).sum(0)  # < 2^31 per group: no overflow before digest()
        self.next = self.next * (self.g_max if m == self.step.shape[0] else _G_pow(m)) % P

    def digest(self, total: int) -> str:
        lanes = (self.acc % P).cpu().numpy().astype("<i8")  # 16 numbers: the only bytes that leave the device
        return hashlib.blake2b(ALGORITHM + total.to_bytes(8, "little") + lanes.tobytes(), digest_size=16).hexdigest()


def _G_pow(e: int) -> np.ndarray:
    """int64 ``[16]``: ``G ** e mod P``."""
    return np.array([pow(int(g), e, P) for g in _G], dtype=np.int64)


def _inner(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """int32 ``[blocks, 16]`` = ``x`` (int8 ``[blocks, 4096]``, blocks a multiple of 256) @ ``r``,
    exactly: int8 GEMM where the device's passes a known-answer check, float64 otherwise."""
    if _int8_gemm_exact(x.device, r):
        return torch._int_mm(x, r)
    return _inner_f64(x, r)


def _inner_f64(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float64) @ r.to(torch.float64)).to(torch.int32)  # every partial sum < 2^53: exact


def _int8_gemm_exact(device: torch.device, r: torch.Tensor) -> bool:
    """Whether ``torch._int_mm`` exists on ``device`` and gives the exact product of one
    group of extreme and mixed values (some CUDA releases' int8 GEMM returned wrong sums,
    pytorch#107671): asked once per device."""
    key = str(device)
    if key not in _INT8_GEMM:
        x = torch.from_numpy(np.resize(_R[::-1].reshape(-1), GROUP * BLOCK).reshape(GROUP, BLOCK).copy())
        x[0], x[1] = -128, 127
        x = x.to(device)
        try:
            _INT8_GEMM[key] = bool(torch.equal(torch._int_mm(x, r), _inner_f64(x, r)))
        except (RuntimeError, NotImplementedError):
            _INT8_GEMM[key] = False
    return _INT8_GEMM[key]


def path_ranges(regions: KVRegions, block_ids, layers, dcp_size: int, dcp_rank: int, first_page: int,
                num_pages: int, heads: range | None = None, sender_heads: range | None = None) -> Descriptors:
    """Where ``layers`` x heads x pages(``dcp_rank``) of a request land in a consumer's KV
    (``regions``, its block tables ``block_ids``): ``dst`` and ``length`` (``src`` is
    meaningless). The plan of the same path with the consumer standing in for the
    producer (no page contiguous at the stand-in source, so nothing merges). ``heads``:
    the consumer rank's KV heads, ``sender_heads``: the producer rank's (default: the
    same); where they differ only ``heads & sender_heads`` of each page."""
    stand_in = tuple(np.zeros(num_pages, dtype=np.int64) for _ in range(regions.num_groups))
    if heads is None or sender_heads is None or heads == sender_heads:
        return plan_path(regions, stand_in, layers, regions, block_ids, dcp_size, dcp_rank, first_page, num_pages)
    common = range(max(heads.start, sender_heads.start), min(heads.stop, sender_heads.stop))
    return plan_path(regions.with_heads(len(common)), stand_in, layers, regions, block_ids, dcp_size, dcp_rank,
                     first_page, num_pages, common, heads)
