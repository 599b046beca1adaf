"""bf16 greedy agreement of DCP=2 with DCP=1 (issue 15, item 4), and why they drift.

Three engines (TP=2) on one checkpoint whose weights are bf16 values: bf16 at
DCP=1 (vLLM's stock CPU kernel), bf16 at DCP=2 (this package's DCP path), and
float32 at DCP=1 on the very same weights, the closest thing to exact attention
here. Each greedily decodes ``--tokens`` tokens for the prompts of
``tests/e2e/test_dcp_vllm.py`` with the top-2 logprobs of every step.

Printed per pair of engines: prompts with identical tokens, the share of positions
that agree (up to each prompt's first divergence, then counted as disagreeing), the
largest |logprob difference| of the chosen token while the two still agree, and at
each first divergence the top-1 minus top-2 logprob margin the first engine saw.
A divergence at a margin below the pair's largest logprob difference is a near-tie
decided by rounding, not a wrong attention.

    .venv/bin/python bench/dcp_agreement.py [--tokens 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dcp_decode import BLOCK, build_model  # noqa: E402

ENGINES = [("bf16 DCP=1", "bfloat16", 1), ("bf16 DCP=2", "bfloat16", 2), ("fp32 DCP=1", "float32", 1)]


def _prompts() -> list[list[int]]:
    ids = lambda n, s: [(s * 7 + i * 13) % 500 + 6 for i in range(n)]  # noqa: E731
    return [ids(10, 1), ids(150, 2), ids(70, 3), ids(4 * BLOCK, 4), ids(33, 5), ids(150, 2)[:128] + ids(30, 6),
            ids(300, 7)]


def _engine(model: str, dtype: str, dcp: int, tokens: int, out: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=2, decode_context_parallel_size=dcp, dtype=dtype,
              cp_kv_cache_interleave_size=BLOCK, block_size=BLOCK, distributed_executor_backend="mp",
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=128, enable_prefix_caching=False, seed=0)
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    rows = []
    for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], sp, use_tqdm=False):
        c = o.outputs[0]
        steps = []
        for tok, lp in zip(c.token_ids, c.logprobs):
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            steps.append((tok, lp[tok].logprob, top[0] - top[1] if len(top) > 1 else float("inf")))
        rows.append(steps)
    Path(out).write_text(json.dumps(rows))


def compare(a: list, b: list) -> dict:
    """Two engines' per-prompt ``[(token, logprob, margin)]`` lists -> the pair's figures."""
    same = agree = total = 0
    max_dlp, margins = 0.0, []
    for pa, pb in zip(a, b):
        total += len(pa)
        for i, (sa, sb) in enumerate(zip(pa, pb)):
            if sa[0] != sb[0]:
                margins.append((i, sa[2]))
                break
            agree += 1
            max_dlp = max(max_dlp, abs(sa[1] - sb[1]))
        else:
            same += 1
    return {"same": same, "n": len(a), "agree": agree / total, "max_dlp": max_dlp, "margins": margins}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        _engine(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", "bfloat16", 1024)
        for name, dtype, dcp in ENGINES:
            out = Path(tmp) / f"{dtype}-{dcp}.json"
            env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
            proc = subprocess.run([sys.executable, __file__, "--engine", model, dtype, str(dcp), str(args.tokens),
                                   str(out)], env=env, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode:
                raise RuntimeError(f"{name} engine failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
            runs[name] = json.loads(out.read_text())
            print(f"  done: {name}", file=sys.stderr, flush=True)
    print(f"Greedy agreement, 8 query heads / 1 KV head / head dim 128, 2 layers, TP=2, {len(_prompts())} prompts "
          f"x {args.tokens} tokens")
    print(f"{'pair':>26} {'identical':>10} {'positions agree':>16} {'max |dlogprob|':>15}  first divergences "
          f"(position: top-2 margin of the first engine)")
    for a, b in [("bf16 DCP=2", "bf16 DCP=1"), ("bf16 DCP=1", "fp32 DCP=1"), ("bf16 DCP=2", "fp32 DCP=1")]:
        c = compare(runs[a], runs[b])
        div = ", ".join(f"{i}: {m:.3f}" for i, m in c["margins"]) or "-"
        print(f"{a + ' vs ' + b:>26} {c['same']:>6}/{c['n']:<3} {c['agree']:>16.3f} {c['max_dlp']:>15.4f}  {div}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
