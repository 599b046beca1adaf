"""Sub-page writes of the 3D reshard (issue 39) through real Mooncake engines: a GQA
model's 2 KV heads split differently on each side. Prefill TP=1 (both heads in each
page) -> two decode ranks holding one head each, and prefill TP=2 (a head per rank) ->
one decode rank holding both, with heads outside the tokens (vLLM's CPU page
``[H, N, C]``, GPU HND) and inside them (NHD ``[N, H, C]``), with and without send
staging, every fetch checked by ``verify_kv``: the decode's KV is byte-exact against a
reference built by slicing the prefill's arrays, and nothing outside its blocks moves."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.messages import Fingerprint, prompt_digest
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.transfer.transport import MooncakeTransport
from vllm_dcp2d.reshard.regions import KVRegions
from tests.support.transfer import wait_fetch

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]

L, K, N, C, BLOCKS = 3, 2, 16, 8, 8      # layers, KV heads, tokens per page, bytes per head and token
SRC_IDS = np.array([5, 0, 6, 2])           # prefill block of each of the 4 pages
DST_IDS = np.array([7, 1, 4, 3])           # decode (DCP=1): page i -> block DST_IDS[i]
TOKENS = 4 * N - 5
DIGEST = prompt_digest(list(range(TOKENS)))


def kv(heads: int, nhd: bool, fill: bool, seed: int = 0) -> np.ndarray:
    """uint8 ``[L, BLOCKS, H, N, C]`` (HND) or ``[L, BLOCKS, N, H, C]`` (NHD)."""
    shape = (L, BLOCKS, N, heads, C) if nhd else (L, BLOCKS, heads, N, C)
    return np.random.default_rng(seed).integers(1, 255, shape, dtype=np.uint8) if fill else np.zeros(shape, np.uint8)


def by_head(a: np.ndarray, nhd: bool) -> np.ndarray:
    """The ``[L, BLOCKS, H, N, C]`` view of either layout."""
    return a.transpose(0, 1, 3, 2, 4) if nhd else a


def regions(a: np.ndarray, heads: int, nhd: bool) -> KVRegions:
    page = heads * N * C
    runs = N if nhd and heads > 1 else 1
    return KVRegions(np.arange(L), a.ctypes.data + np.arange(L) * a[0].nbytes, [page], [page],
                     head_count=[heads], head_runs=[runs])


def fingerprint(heads: int, nhd: bool) -> Fingerprint:
    axes = ("N16,H2,C8" if nhd else "H2,N16,C8") if heads > 1 else "N16,C8"
    return Fingerprint("m", L, N, "uint8", heads * N * C, f"{axes}:k|v", "cfg", num_kv_heads=K)


@contextlib.contextmanager
def prefill(tp: int, nhd: bool, staging: int):
    """``tp`` sending ranks (heads split over them, every layer), one bootstrap."""
    with contextlib.ExitStack() as stack:
        boot = stack.enter_context(BootstrapServer(token="t"))
        heads = K // tp
        srcs = []
        for rank in range(tp):
            src = kv(heads, nhd, True, seed=rank + 1)
            t = MooncakeTransport()
            stack.callback(t.close)
            t.register(src.ctypes.data, src.nbytes)
            s = Sender(t, regions(src, heads, nhd), fingerprint(heads, nhd), engine_id="P", cp_rank=rank,
                       cp_size=tp, bootstrap=boot.address, token="t", layers=range(L),
                       heads=range(rank * heads, (rank + 1) * heads), staging_bytes=staging)
            stack.callback(s.close)
            s.add_request("x", SRC_IDS, TOKENS, DIGEST)
            srcs.append(src)
        # the model's KV by head: [L, BLOCKS, K, N, C] (prefill block ids)
        yield boot.address, np.concatenate([by_head(s, nhd) for s in srcs], axis=2), srcs


def decode(stack, tp: int, nhd: bool):
    out = []
    heads = K // tp
    for rank in range(tp):
        dst = kv(heads, nhd, False)
        t = MooncakeTransport()
        stack.callback(t.close)
        r = Receiver(t, regions(dst, heads, nhd), fingerprint(heads, nhd), engine_id="D", consumer_rank=rank,
                     consumer_size=tp, heads=range(rank * heads, (rank + 1) * heads),
                     buffers=[(dst.ctypes.data, dst.nbytes)], transfer_timeout_s=30.0, verify_kv=True)
        stack.callback(r.close)
        out.append((r, dst))
    return out


@pytest.mark.parametrize("nhd", [False, True], ids=["hnd", "nhd"])
@pytest.mark.parametrize("tp_p,tp_d,staging", [(1, 2, 0), (1, 2, 1 << 20), (2, 1, 0), (2, 1, 1 << 20)],
                         ids=["p1-d2", "p1-d2-staged", "p2-d1", "p2-d1-staged"])
def test_sub_page_writes_land_byte_exact(tp_p, tp_d, staging, nhd):
    with contextlib.ExitStack() as stack:
        addr, model, srcs = stack.enter_context(prefill(tp_p, nhd, staging))
        ranks = decode(stack, tp_d, nhd)
        for r, _ in ranks:
            r.start("x", addr, DST_IDS, num_tokens=TOKENS, prompt_digest=DIGEST)
        heads = K // tp_d
        for rank, (r, dst) in enumerate(ranks):
            f = wait_fetch(r, "x", 30)
            assert f.ok, f.error
            # decode rank `rank` asked every prefill rank holding one of its heads
            assert sorted(f.outcomes) == [p for p in range(tp_p) if {p * (K // tp_p), (p + 1) * (K // tp_p) - 1}
                                          & set(range(rank * heads, (rank + 1) * heads))] or tp_p == 1
            want = np.zeros_like(by_head(dst, nhd))
            want[:, DST_IDS] = model[:, SRC_IDS, rank * heads:(rank + 1) * heads]
            assert np.array_equal(by_head(dst, nhd), want)
            # 1.0x: each rank got its heads x 4 pages x L layers, nothing more
            assert sum(o.nbytes for o in f.outcomes.values()) == L * 4 * heads * N * C
        for src in srcs:  # the prefill's KV untouched
            assert src.any()


def test_a_rank_asked_for_heads_it_does_not_hold_refuses_naming_both(monkeypatch):
    """A request naming none of the rank's heads (a decode's bug, or a stranger) is refused
    before any write, naming both ranges: the decode rank holding head 1 is made to ask
    the prefill rank holding head 0 too."""
    from vllm_dcp2d.transfer import receiver as receiver_mod

    monkeypatch.setattr(receiver_mod, "senders_for", lambda layers, *a: np.arange(layers.size // 2))
    with contextlib.ExitStack() as stack:
        addr, _, _ = stack.enter_context(prefill(2, False, 0))
        (_, _), (r, dst) = decode(stack, 2, False)
        r.start("x", addr, DST_IDS, num_tokens=TOKENS, prompt_digest=DIGEST)
        f = wait_fetch(r, "x", 30)
        assert not f.ok and f.error.cp_rank == 0
        assert "cp rank 0 holds KV heads [0, 1) of 2, the decode rank [1, 2): no head in common" in f.error.reason
