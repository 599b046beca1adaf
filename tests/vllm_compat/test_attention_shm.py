"""Patch 6 of vllm_compat/attention.py: a DCP group's all-gathers run over shared memory,
not gloo, and gather byte-exact results, whichever vLLM build the host loads.

Two real processes build vLLM's ``CpuCommunicator`` for groups named as vLLM names the
DCP group ("dcp:<i>", one per ``DCP2D_DCP_GATHER`` value) and for one it leaves alone
("ep:0"). On this host (vLLM's AVX-512 build, ``vllm._C``, where AVX-512 is present) and
as an AVX2 host (``tests/support/avx2_host``: vLLM's loader takes ``vllm._C_AVX2``, the
build without ``torch.ops._C.init_shm_manager``).
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from tests.support import avx2_host
from tests.support.prefill_group import run_group

from vllm_dcp2d.local import shm

pytest.importorskip("vllm")

LINE = "DCP group dcp:0 (ranks [0, 1]) gathers over shared memory"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("host", ["this host", "AVX2 host"])
def test_dcp_group_gathers_over_shared_memory(host, monkeypatch):
    if host == "AVX2 host" and avx2_host.HOST_LACKS_AVX512:
        pytest.skip("this host has no AVX-512: vLLM loads its AVX2 build here already ('this host')")
    if host == "AVX2 host":
        monkeypatch.setenv("PYTHONPATH", avx2_host.env()["PYTHONPATH"])
    ident = f"test-dcp-shm-{host[:4]}-{id(monkeypatch)}"
    try:
        results = run_group("tests.support.shm_gather_ranks:patch_choices", 2,
                            {"ident": ident, "choices": ["auto", "dcp2d", "gloo"]}, timeout_s=240, gloo_timeout_s=60,
                            start="spawn" if host == "AVX2 host" else "forkserver")  # the build loads at start-up
    finally:  # vLLM never unlinks its communicator's files (local/shm.py)
        shm.remove_unheld({Path(p) for p in glob.glob(f"/dev/shm/vllm_dist_{ident}-*")})
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r.get('traceback', r)}"
        if host == "AVX2 host":
            assert not r["has_op"], "vLLM's loader did not take its AVX2 build"
        auto = "_CPUSHMDistributed" if r["has_op"] else "_ShmGatherDistributed"
        assert r["auto"]["module"] == auto, f"rank {rank}: the DCP group still gathers over gloo: {r['auto']}"
        assert any(line.startswith(f"vllm_dcp2d: {LINE}") for line in r["auto"]["log"]), r["auto"]["log"]
        assert r["dcp2d"]["module"] == "_ShmGatherDistributed", r["dcp2d"]
        assert r["gloo"]["module"] == "module", r["gloo"]  # torch.distributed itself
        assert r["ep:0"] == "module", f"rank {rank}: a group other than DCP was switched too"
        for choice in ("auto", "dcp2d", "gloo"):
            assert all(r[choice]["exact"]), f"rank {rank}, {choice}: gathered tensors differ: {r[choice]['exact']}"


@pytest.mark.timeout(300)
def test_ranks_that_disagree_keep_gloo():
    """``DCP2D_DCP_GATHER`` differs between the ranks: both keep gloo and say why, and
    neither waits for a set-up the other never starts."""
    ident = f"test-dcp-shm-disagree-{id(test_ranks_that_disagree_keep_gloo)}"
    try:
        results = run_group("tests.support.shm_gather_ranks:patch_choices", 2,
                            {"ident": ident, "choices": ["dcp2d", "auto"], "rank1": ["gloo", "dcp2d"]},
                            timeout_s=240, gloo_timeout_s=60)
    finally:
        shm.remove_unheld({Path(p) for p in glob.glob(f"/dev/shm/vllm_dist_{ident}-*")})
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r.get('traceback', r)}"
        for choice in ("dcp2d", "auto"):
            assert r[choice]["module"] == "module", (rank, choice, r[choice])
            assert any("keeps gloo: its ranks disagree" in line for line in r[choice]["log"]), r[choice]["log"]
            assert all(r[choice]["exact"]), (rank, choice, r[choice]["exact"])
