"""Acceptance: vLLM on CPU with decode context parallel (DCP=2) through the plugin's
attention backend gives the same greedy tokens as DCP=1, with twice the KV capacity.

Each engine runs in a subprocess (this file with ``--run``): vLLM spawns its TP
workers and needs a ``__main__`` guard. One DCP=2 engine and one DCP=1 reference
engine (both TP=2, mp executor) serve every prompt shape in two generate calls; a second
DCP=2 engine on vLLM's AVX2 build starts beside them and is checked against the same
reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import avx2_host
from tests.support.vllm_engine import Engine, run_engines, unwrap

BLOCK = 32
KV_BYTES = 64 << 20
MAX_TOKENS = 40


def _prompts() -> dict[str, list[list[int]]]:
    ids = lambda n, s: [(s * 7 + i * 13) % 500 + 6 for i in range(n)]  # noqa: E731
    return {
        # One generate call: a mixed-length batch that covers prompts shorter than a
        # page, spanning several pages, not page-aligned, and exactly DCP-aligned;
        # 40 decode steps cross page and rank boundaries for all of them.
        "batch": [ids(10, 1), ids(150, 2), ids(70, 3), ids(2 * 2 * BLOCK, 4), ids(33, 5)],
        # A second call: prefix-cache hits on the 150-token prompt (same first 128
        # tokens) and a long prompt that is prefilled in chunks.
        "second": [ids(150, 2)[:128] + ids(30, 6), ids(300, 7)],
    }


def _run_engine(model: str, dcp: int, out: str, dtype: str = "auto") -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=2, decode_context_parallel_size=dcp,
              cp_kv_cache_interleave_size=BLOCK, block_size=BLOCK, distributed_executor_backend="mp",
              enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=128, enable_prefix_caching=True, enable_chunked_prefill=True,
              seed=0, dtype=dtype)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    result = {}
    for name, prompts in _prompts().items():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outs]
        result[name + "_cached"] = [o.num_cached_tokens for o in outs]
    Path(out).write_text(json.dumps(result))


def _engine(model: str, dcp: int, tmp: Path, dtype: str = "float32", avx2: bool = False) -> Engine:
    tmp.mkdir(exist_ok=True)
    out = tmp / f"dcp{dcp}.json"
    # DCP > 1: the DCP group's all-gathers run over shared memory (vllm_compat patch 6): vLLM's
    # where its build has them, else (its AVX2 build) the plugin's.
    how = "vllm_dcp2d's ShmAllGather" if avx2 or avx2_host.HOST_LACKS_AVX512 else "vLLM's shm_all_gather"
    shm = (f"DCP group dcp:0 (ranks [0, 1]) gathers over shared memory ({how}",) if dcp > 1 else ()
    env = {"PYTHONPATH": avx2_host.env()["PYTHONPATH"]} if avx2 else {}
    return Engine(__file__, [model, str(dcp), str(out), dtype], out, f"DCP={dcp}" + (" (AVX2 build)" if avx2 else ""),
                  expect_in_log=shm, env=env)


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    """The engines of both hosts' checks, started at once (issue 52: one engine fewer): a
    DCP=1 reference and a DCP=2 engine on this host and, where this host has AVX-512, a
    DCP=2 engine on vLLM's AVX2 build (``tests/support/avx2_host``). The AVX2 engine is
    checked against this host's DCP=1 reference: a fp32 DCP=1 engine gives the same
    tokens on both builds (measured, 2026-12-07), so an AVX2 DCP=1 engine of its own
    checked nothing the reference does not. Each entry: ``(json, capacity)`` or the
    engine's failure (raised by the test that reads it)."""
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    tmp = tmp_path_factory.mktemp("dcp")
    model = build_tiny_model("llama-mqa", tmp / "model")
    engines = {"ref": _engine(model, 1, tmp), "this host": _engine(model, 2, tmp)}
    if not avx2_host.HOST_LACKS_AVX512:
        engines["AVX2 host"] = _engine(model, 2, tmp / "avx2", avx2=True)
    return dict(zip(engines, run_engines(*engines.values(), keep_going=True)))


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("host", ["this host", "AVX2 host"])
def test_dcp2_matches_dcp1_and_doubles_kv_capacity(dcp_runs, host):
    """"AVX2 host": the DCP=2 engine runs vLLM's AVX2 build (``tests/support/avx2_host``),
    which has no shared-memory collectives, so the DCP group gathers through the plugin's."""
    if host == "AVX2 host" and avx2_host.HOST_LACKS_AVX512:
        pytest.skip("this host has no AVX-512: vLLM loads its AVX2 build here already ('this host')")
    ref, ref_cap = unwrap(dcp_runs["ref"])
    got, cap = unwrap(dcp_runs[host])
    for name in ("batch", "second"):
        for i, (a, b) in enumerate(zip(got[name], ref[name])):
            assert a == b, f"{name}[{i}]: DCP=2 ({host}) {a} != DCP=1 {b}"
    assert got["second_cached"][0] >= 128 - 2 * BLOCK, got["second_cached"]  # a real prefix hit
    assert cap == 2 * ref_cap, (cap, ref_cap)


def _run_plain(model: str, out: str) -> None:
    """TP=1, in-process engine in the model's own dtype (bf16): the stock-kernel path."""
    from vllm import LLM, SamplingParams

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    llm = LLM(model=model, block_size=BLOCK, distributed_executor_backend="uni", enforce_eager=True,
              kv_cache_memory_bytes=KV_BYTES, max_model_len=1024, max_num_seqs=8, seed=0)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()["batch"]], sp, use_tqdm=False)
    Path(out).write_text(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                     "backend": AttentionBackendEnum.CPU_ATTN.get_path()}))


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_plugin_is_a_no_op_without_dcp(tmp_path):
    """With DCP=1 the overriding backend and slot mapping must change nothing: same
    tokens, bit for bit, as vLLM with general plugins disabled (VLLM_PLUGINS="")."""
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "model")
    procs = {}
    for name, plugins in (("plugin", None), ("stock", "")):  # both engines at once
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.pop("VLLM_PLUGINS", None)
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins
        procs[name] = subprocess.Popen([sys.executable, __file__, "--plain", model, str(tmp_path / f"{name}.json")],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = {}
    try:
        for name, proc in procs.items():
            log, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"{name} engine failed:\n{log[-6000:]}"
            runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert runs["plugin"]["backend"] == "vllm_dcp2d.vllm_compat.cpu_attn.DCPCPUAttentionBackend"
    assert runs["stock"]["backend"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert runs["plugin"]["tokens"] == runs["stock"]["tokens"]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--plain":
    _run_plain(sys.argv[2], sys.argv[3])
if __name__ == "__main__" and len(sys.argv) >= 5 and sys.argv[1] == "--run":
    _run_engine(sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
