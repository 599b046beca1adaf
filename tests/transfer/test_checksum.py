"""``checksum.checksum``, the ``verify_kv`` checksum: the value its definition gives (a numpy
reference, byte for byte), the same wherever and however it is computed (host ``Memory`` or
torch tensors, any chunking, int8 or float64 GEMM), and any changed byte, swapped page pair
or missing page changes it.

Issue "trust boundary, round 3", item 7: ``verify_kv`` hashed host memory only (xxh3-128 of
numpy views), so it was refused for GPU KV. The checksum is torch code now; this machine has
no GPU, so these tests run it on CPU tensors, the code a GPU runs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dcp2d.reshard.plan import plan_path
from vllm_dcp2d.reshard.regions import KVRegions, Memory
from vllm_dcp2d.transfer import checksum as cs
from vllm_dcp2d.transfer.checksum import GROUP_BYTES, KVBytes, checksum, path_ranges

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(stream: bytes) -> str:
    """The module docstring's definition in numpy int64 and Python ints, one block at a time."""
    n = len(stream)
    x = np.zeros(-(-n // cs.BLOCK) * cs.BLOCK, np.int8)
    x[:n] = np.frombuffer(stream, np.int8)
    inner = x.reshape(-1, cs.BLOCK).astype(np.int64) @ cs._R.astype(np.int64)
    groups = -(-inner.shape[0] // cs.GROUP)
    inner = np.vstack([inner, np.zeros((groups * cs.GROUP - inner.shape[0], cs.LANES), np.int64)])
    h = (inner.reshape(groups, cs.GROUP, cs.LANES) * cs._T).sum(1) % cs.P
    lanes = [sum(int(h[g, lane]) * pow(int(cs._G[lane]), g, cs.P) for g in range(groups)) % cs.P
             for lane in range(cs.LANES)]
    return hashlib.blake2b(cs.ALGORITHM + n.to_bytes(8, "little") + np.array(lanes, "<i8").tobytes(),
                           digest_size=16).hexdigest()


@st.composite
def paths(draw):
    """A host buffer and a path over it: ranges of one unit multiple (as a plan's pages and
    head runs are), at distinct places, taken in a drawn order; the stream they make."""
    unit = draw(st.sampled_from([1, 64, 256, 4096]))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=24))
    length = np.array(lengths, dtype=np.int64) * unit * draw(st.sampled_from([1, 3]))
    slots = int(length.max())
    buf = np.random.default_rng(draw(st.integers(0, 1 << 30))).integers(0, 256, slots * len(lengths) + 64,
                                                                       dtype=np.uint8)
    place = np.array(draw(st.permutations(range(len(lengths)))), dtype=np.int64)
    src = buf.ctypes.data + place * slots
    order = np.array(draw(st.permutations(range(len(lengths)))), dtype=np.int64)
    stream = b"".join(buf[s - buf.ctypes.data:s - buf.ctypes.data + n].tobytes()
                      for s, n in zip(src[np.argsort(order)], length[np.argsort(order)]))
    return buf, src, length, order, stream


@_SETTINGS
@given(paths(), st.sampled_from([GROUP_BYTES, 2 * GROUP_BYTES, 4 * GROUP_BYTES]))
def test_the_value_is_the_definitions(path, chunk):
    """Byte-exact against the numpy reference, for any ranges, order and chunking, from host
    ``Memory`` and from torch tensors over the same bytes."""
    buf, src, length, order, stream = path
    want = reference(stream)
    memory = Memory.of([(buf.ctypes.data, buf.nbytes)])
    assert checksum(memory, src, length, order, chunk) == want
    tensors = KVBytes([buf.ctypes.data], [torch.from_numpy(buf)])
    assert checksum(tensors, src, length, order) == want


def test_a_multi_mib_stream_over_several_storages():
    """Ranges spread over three storages, interleaved in stream order (a prefill's source
    pages in its decode's order), across chunk boundaries, by the int8 GEMM and by float64."""
    rng = np.random.default_rng(3)
    storages = [torch.from_numpy(rng.integers(0, 256, 3 << 20, dtype=np.uint8)) for _ in range(3)]
    kv = KVBytes.of_tensors(t[16:].view(-1, 16)[:, 3:] for t in storages)  # views: the whole storage counts
    page = 41984  # GLM-5.2's latent page
    pages = [(k % 3, (k * 7919) % ((3 << 20) // page - 1)) for k in range(150)]
    src = np.array([storages[s].data_ptr() + p * page for s, p in pages], dtype=np.int64)
    length = np.full(len(pages), page, dtype=np.int64)
    stream = b"".join(storages[s][p * page:(p + 1) * page].numpy().tobytes() for s, p in pages)
    want = reference(stream)
    order = np.arange(len(pages))
    assert checksum(kv, src, length, order) == want
    assert checksum(kv, src, length, order, 3 * GROUP_BYTES) == want
    saved = dict(cs._INT8_GEMM)
    try:
        cs._INT8_GEMM["cpu"] = False  # a device without an exact int8 GEMM: float64, the same integers
        assert checksum(kv, src, length, order) == want
    finally:
        cs._INT8_GEMM.clear()
        cs._INT8_GEMM.update(saved)


def test_the_checksum_is_pinned():
    """Prefill and decode of two releases must agree: this value changes only with the
    protocol version (``messages.PROTOCOL_VERSION``, protocol 9)."""
    buf = np.frombuffer(hashlib.shake_128(b"pin").digest(3 << 20), dtype=np.uint8).copy()
    src = buf.ctypes.data + np.array([1 << 20, 0, 2 << 20], dtype=np.int64)
    got = checksum(Memory.of([(buf.ctypes.data, buf.nbytes)]), src, np.full(3, (1 << 20) - 5), np.arange(3))
    assert got == reference(b"".join(buf[s - buf.ctypes.data:][:(1 << 20) - 5].tobytes() for s in src))
    assert got == "69c23217a7dff0f485e9deb2845e377c"


def _page_path(pages: int, page: int, seed: int):
    """A decode's path of ``pages`` pages at shuffled blocks of a host buffer."""
    buf = np.random.default_rng(seed).integers(0, 256, (pages + 2) * page, dtype=np.uint8)
    dst = buf.ctypes.data + np.random.default_rng(seed + 1).permutation(pages + 2)[:pages].astype(np.int64) * page
    return buf, dst, np.full(pages, page, dtype=np.int64)


@_SETTINGS
@given(st.integers(1, 40), st.sampled_from([256, 8448, 41984]), st.integers(0, 1 << 30), st.data())
def test_a_changed_byte_a_swapped_pair_or_a_missing_page_is_caught(pages, page, seed, data):
    """One byte changed anywhere (any new value); two pages swapped; one page never written
    (left as it was: zeros, or another page's stale bytes): each gives another checksum."""
    buf, dst, length = _page_path(pages, page, seed)
    memory = Memory.of([(buf.ctypes.data, buf.nbytes)])
    good = checksum(memory, dst, length, dst)
    k = data.draw(st.integers(0, pages - 1))
    at = int(dst[k] - buf.ctypes.data) + data.draw(st.integers(0, page - 1))
    old = int(buf[at])
    buf[at] = (old + data.draw(st.integers(1, 255))) % 256
    assert checksum(memory, dst, length, dst) != good, "changed byte"
    buf[at] = old
    if pages > 1:
        j = data.draw(st.integers(0, pages - 2))
        j += j >= k
        a, b = (slice(int(x - buf.ctypes.data), int(x - buf.ctypes.data) + page) for x in (dst[k], dst[j]))
        if not np.array_equal(buf[a], buf[b]):
            buf[a], buf[b] = buf[b].copy(), buf[a].copy()
            assert checksum(memory, dst, length, dst) != good, "swapped pair"
            buf[a], buf[b] = buf[b].copy(), buf[a].copy()
    sl = slice(int(dst[k] - buf.ctypes.data), int(dst[k] - buf.ctypes.data) + page)
    kept = buf[sl].copy()
    buf[sl] = 0
    assert checksum(memory, dst, length, dst) != good, "page left zero"
    stale = data.draw(st.integers(0, pages + 1)) * page  # what another request left in that block
    buf[sl] = buf[stale:stale + page].copy()
    if not np.array_equal(buf[sl], kept):
        assert checksum(memory, dst, length, dst) != good, "page left stale"
    buf[sl] = kept
    assert checksum(memory, dst, length, dst) == good


def test_prefill_and_decode_orders_agree():
    """A prefill's plan (source pages of its own blocks, runs merged where both sides are
    contiguous) and the decode's ``path_ranges`` of the same path hash alike once the bytes
    landed; the checksum depends on the destination order only."""
    layers, pages, page, dcp = 3, 21, 4096 + 512, 2
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (layers, pages + 1, page), dtype=np.uint8)
    dst = np.zeros((layers, -(-pages // dcp) + 3, page), dtype=np.uint8)
    sr = KVRegions.uniform(np.arange(layers), src.ctypes.data + np.arange(layers) * src[0].nbytes, page)
    dr = KVRegions.uniform(np.arange(layers), dst.ctypes.data + np.arange(layers) * dst[0].nbytes, page)
    src_ids = np.arange(pages) // 2 + np.arange(pages) % 2 * (pages // 2 + 1)  # rank 1's pages adjacent
    dst_ids = np.arange(-(-pages // dcp)) + 1  # contiguous too: the plan merges runs
    desc = plan_path(sr, src_ids, range(layers), dr, dst_ids, dcp, 1, 0, pages)
    assert (desc.length > page).any()
    for s, d, n in zip(desc.src, desc.dst, desc.length):
        dst.reshape(-1)[d - dst.ctypes.data:d - dst.ctypes.data + n] = src.reshape(-1)[s - src.ctypes.data:
                                                                                      s - src.ctypes.data + n]
    ranges = path_ranges(dr, (dst_ids,), range(layers), dcp, 1, 0, pages)
    sent = checksum(Memory.of([(src.ctypes.data, src.nbytes)]), desc.src, desc.length, desc.dst)
    assert checksum(Memory.of([(dst.ctypes.data, dst.nbytes)]), ranges.dst, ranges.length, ranges.dst) == sent


def test_a_read_outside_the_memory_is_refused():
    buf = np.zeros(1 << 12, dtype=np.uint8)
    memory = Memory.of([(buf.ctypes.data, buf.nbytes)])
    with pytest.raises(ValueError, match="outside the memory"):
        checksum(memory, np.array([buf.ctypes.data + 4000]), np.array([200]), np.array([0]))
    with pytest.raises(ValueError, match="multiple of"):
        checksum(memory, np.array([buf.ctypes.data]), np.array([200]), np.array([0]), 1000)


@pytest.mark.skipif(cs._OMP is None, reason="this process's OpenMP runtime has no global symbols")
def test_on_a_host_it_runs_on_its_own_thread_and_leaves_the_thread_count(monkeypatch):
    """A checksum beside the forward: its torch ops run on the calling thread alone (no
    OpenMP team contending with the forward's for the cores), and the thread's torch
    thread count is what it was, also after an error."""
    seen = []
    real = cs._inner_f64
    monkeypatch.setattr(cs, "_inner_f64", lambda x, r: seen.append(torch.get_num_threads()) or real(x, r))
    monkeypatch.setitem(cs._INT8_GEMM, "cpu", False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        buf = np.ones(1 << 16, dtype=np.uint8)
        memory = Memory.of([(buf.ctypes.data, buf.nbytes)])
        checksum(memory, np.array([buf.ctypes.data]), np.array([buf.nbytes]), np.array([0]))
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(cs, "_inner_f64", lambda x, r: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            checksum(memory, np.array([buf.ctypes.data]), np.array([buf.nbytes]), np.array([0]))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
