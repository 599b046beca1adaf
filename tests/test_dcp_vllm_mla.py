"""Acceptance, MLA: a tiny DeepSeek-V2 model under TP=2 + DCP=2 (the plugin's CPU_MLA)
gives the same greedy tokens as DCP=1, with twice the KV capacity.

Settings every DCP MLA run on CPU needs: ``attention_config={"backend": "CPU_MLA"}``
(AMX CPUs otherwise get AMX_MLA, which has no DCP), block size 16 (CPU_MLA's only
one) with ``cp_kv_cache_interleave_size=16``, and no chunked prefill or prefix
caching (vLLM's DCP context gather for MLA prefill is CUDA-only).

Prompts are served one at a time: in batches, vLLM 0.32's CPU MLA path is not
deterministic run to run even at DCP=1 (two DCP=1 runs of the same 4-prompt batch
gave different first tokens, e.g. logprob -3.29 vs -3.26 for the top token of one
prompt while two other prompts matched to the last bit), so a batched comparison
could not tell a DCP bug from that noise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _vllm_engine import Engine, run_engines

BLOCK = 16


def _run_engine(model: str, dcp: int, out: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=2, decode_context_parallel_size=dcp,
              cp_kv_cache_interleave_size=BLOCK, block_size=BLOCK, distributed_executor_backend="mp",
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=1024, enable_prefix_caching=False, enable_chunked_prefill=False,
              attention_config={"backend": "CPU_MLA"}, dtype="float32", seed=0)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = lambda n, s: [(s * 7 + i * 13) % 500 + 6 for i in range(n)]  # noqa: E731
    # Shorter than a page, spanning pages, not page-aligned, exactly 2 virtual pages.
    prompts = [ids(10, 1), ids(150, 2), ids(70, 3), ids(2 * 2 * BLOCK, 4)]
    tokens = [list(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids)
              for p in prompts]
    Path(out).write_text(json.dumps(tokens))


def _engine(model: str, dcp: int, tmp: Path) -> Engine:
    out = tmp / f"mla{dcp}.json"
    return Engine(__file__, [model, str(dcp), str(out)], out, f"DCP={dcp} MLA")


@pytest.mark.vllm
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_mla_dcp2_matches_dcp1_and_doubles_kv_capacity(tmp_path):
    from vllm_dcp2d.testing.tiny_models import build_tiny_model

    model = build_tiny_model("deepseek-v2-mla", tmp_path / "model")
    (ref, ref_cap), (got, cap) = run_engines(_engine(model, 1, tmp_path), _engine(model, 2, tmp_path))
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a == b, f"prompt {i}: DCP=2 {a} != DCP=1 {b}"
    assert cap == 2 * ref_cap, (cap, ref_cap)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--run":
    _run_engine(sys.argv[2], int(sys.argv[3]), sys.argv[4])
