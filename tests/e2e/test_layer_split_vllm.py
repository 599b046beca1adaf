"""Layer-split storage inside vLLM (prefill, TP=2 = 2 CP ranks): the same greedy
tokens as a producer without it and as a plain instance, less memory per token.

Each engine runs in a subprocess (this file with ``--run``): a ``kv_producer``
with ``layer_split`` "on" or "off", or no connector at all. Prompts cover a
prompt shorter than a page, a long prompt prefilled in 64-token chunks (each
chunk's earlier tokens are broadcast by the owners), a prefix-cache hit, and a
mixed batch (prefills next to decodes). Every run also reports, from each
worker, the data pointers of its layers' KV tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests.support.vllm_engine import Engine, run_engines

BLOCK = 32
MAX_TOKENS = 12


def _prompts() -> dict[str, list[list[int]]]:
    ids = lambda n, s: [(s * 7 + i * 13) % 500 + 6 for i in range(n)]  # noqa: E731
    return {
        "short": [ids(10, 1)],
        "chunked": [ids(300, 2)],
        "prefix": [ids(300, 2)[:192] + ids(40, 3)],  # 6 cached pages of "chunked"
        "mixed": [ids(10, 4), ids(150, 5), ids(70, 6), ids(33, 7)],
    }


def _kv_pointers(worker) -> dict:
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return {n: l.kv_cache.data_ptr() for n, l in ctx.items() if hasattr(l, "kv_cache") and hasattr(l.kv_cache, "data_ptr")}


def _run_engine(model: str, mode: str, out: str, dtype: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_dcp2d.local.servers import free_port

    kw = {}
    if mode != "plain":
        kw["kv_transfer_config"] = {"kv_connector": "DCP2DConnector", "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"layer_split": mode, "bootstrap_port": free_port()}}
    mla = "mla" in model
    if mla and mode == "plain":
        # the control runs the same kernel: on an AMX CPU vLLM alone would pick AMX_MLA
        # (other rounding), where the connector picks CPU_MLA (vllm_compat/startup.py)
        kw["attention_config"] = {"backend": "CPU_MLA"}
    llm = LLM(model=model, tensor_parallel_size=2, block_size=None if mla else BLOCK,
              distributed_executor_backend="mp", enforce_eager=True, kv_cache_memory_bytes=32 << 20,
              max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=None if mla else 64,
              enable_prefix_caching=not mla, enable_chunked_prefill=not mla, seed=0, dtype=dtype, **kw)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    result = {}
    for name, prompts in _prompts().items():
        if mla:  # CPU MLA is not batch-deterministic (test_e2e_mla.py): one prompt at a time
            outs = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outs]
        result[name + "_cached"] = [o.num_cached_tokens for o in outs]
    result["pointers"] = llm.collective_rpc(_kv_pointers)
    Path(out).write_text(json.dumps(result))


def _engine(model: str, mode: str, tmp: Path, dtype: str) -> Engine:
    out = tmp / f"{mode}.json"
    return Engine(__file__, [model, mode, str(out), dtype], out, f"layer_split={mode}",
                  env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "MC_FORCE_TCP": "1"})


def _check(model: str, layers: int, tmp: Path, dtype: str) -> None:
    from vllm_dcp2d.reshard.layout import cp_layer_owner

    (split, cap), (full, full_cap), (plain, plain_cap) = run_engines(
        *(_engine(model, mode, tmp, dtype) for mode in ("on", "off", "plain")))
    for name in _prompts():
        assert split[name] == full[name], f"{name}: layer-split {split[name]} != without {full[name]}"
        assert split[name] == plain[name], f"{name}: layer-split {split[name]} != plain {plain[name]}"
    if "mla" not in model:
        assert split["prefix_cached"][0] >= 192, split["prefix_cached"]  # the prefix case hit the cache
    # Capacity: L / (max owned + 1) within one block (of BLOCK tokens).
    slots = -(-layers // 2) + 1
    assert full_cap == plain_cap
    assert abs(cap - full_cap * layers / slots) <= 32, (cap, full_cap, layers, slots)
    # Storage: each rank's owned layers have their own regions, the others share one.
    for rank, ptrs in enumerate(split["pointers"]):
        owned = {n: p for n, p in ptrs.items() if cp_layer_owner(_index(n), layers, 2) == rank}
        others = {p for n, p in ptrs.items() if n not in owned}
        assert len(others) == 1 and len(set(owned.values())) == len(owned) and not others & set(owned.values()), ptrs
    for ptrs in full["pointers"]:
        assert len(set(ptrs.values())) == layers


def _index(name: str) -> int:
    return int(next(p for p in name.split(".") if p.isdigit()))


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
# 4 layers only: the 8-layer model checked the same mechanism at a larger ratio (1.6x against
# 1.33x) for ~110 s of the suite's 20-minute budget (BENCHMARKS.md "Test suite", 2026-12-05).
@pytest.mark.parametrize("kind,layers", [("llama-mqa", 4)])
def test_layer_split_same_tokens_more_capacity(kind, layers, tmp_path):
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    _check(build_tiny_model(kind, tmp_path / "model"), layers, tmp_path, "float32")


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_layer_split_mla_same_tokens(tmp_path):
    """MLA in its own dtype (bf16). With 2 layers each rank stores 1 + 1 slots, so
    the capacity stays 1.0x; what this checks is the fill of the latent cache
    during the decode steps."""
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    _check(build_tiny_model("deepseek-v2-mla", tmp_path / "model"), 2, tmp_path, "bfloat16")


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--run":
    _run_engine(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
