"""DCP decode benchmark on CPU, in one run:

1. TPOT (time per output token) of the tiny MQA Llama served by vLLM with
   TP=2 + DCP=2 against TP=2 + DCP=1, plus the KV capacity vLLM reports;
2. the torch LSE merge of vllm_dcp2d against vLLM's own torch reference
   (``vllm.v1.attention.ops.dcp._lse_weighted_combine``) on the same inputs.

    .venv/bin/python bench/dcp_decode.py [--tokens 64] [--batch 4] [--prompt-len 200]

Each engine runs in a subprocess (vLLM spawns TP workers). TPOT is
``(t(max_tokens=N) - t(max_tokens=1)) / (N - 1)`` for one batch, after a warm-up
call, so the prefill and the first token are excluded. On a 2-core machine
both engines share the cores with anything else running; compare the rows of
one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32


def _engine(model: str, dcp: int, tokens: int, batch: int, prompt_len: int, dtype: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=2, decode_context_parallel_size=dcp,
              cp_kv_cache_interleave_size=BLOCK, block_size=BLOCK, distributed_executor_backend="mp",
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=2048, max_num_seqs=batch,
              enable_prefix_caching=False, dtype=dtype, seed=0)
    prompts = [{"prompt_token_ids": [(7 * s + 13 * i) % 500 + 6 for i in range(prompt_len)]} for s in range(batch)]

    def timed(n: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    timed(4)  # warm-up
    first = min(timed(1) for _ in range(2))
    full = [timed(tokens) for _ in range(2)]
    tpot = (min(full) - first) / (tokens - 1)
    Path(out).write_text(json.dumps({"tpot_s": tpot, "ttft_s": first}))


def run_engines(args) -> list[dict]:
    from vllm_dcp2d.testing.tiny_models import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model("llama-mqa", Path(tmp) / "model")
        for dcp in (1, 2):
            out = str(Path(tmp) / f"dcp{dcp}.json")
            env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
            env.pop("TRITON_INTERPRET", None)
            cmd = [sys.executable, __file__, "--engine", model, str(dcp), str(args.tokens), str(args.batch),
                   str(args.prompt_len), args.dtype, out]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            log = proc.stdout + proc.stderr
            if proc.returncode:
                raise RuntimeError(f"DCP={dcp} engine failed:\n{log[-4000:]}")
            cap = re.findall(r"KV cache size: ([\d,]+) tokens", log)
            rows.append(dict(json.loads(Path(out).read_text()), dcp=dcp,
                             kv_tokens=int(cap[0].replace(",", "")) if cap else -1))
    return rows


def bench_merge(reps: int) -> list[tuple]:
    import torch
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    from vllm_dcp2d.attention.merge import merge_lse_torch

    rows = []
    g = torch.Generator().manual_seed(0)
    for n, t, h, d in [(2, 8, 16, 128), (2, 64, 16, 128), (4, 64, 16, 128), (8, 256, 32, 128)]:
        o = torch.randn(n, t, h, d, generator=g)
        lse = torch.randn(n, t, h, generator=g)
        lse[0, ::3] = float("-inf")  # some empty shards
        ours = merge_lse_torch(o, lse)
        theirs = _lse_weighted_combine(o, lse, return_lse=True)
        err = max((ours[0] - theirs[0]).abs().max().item(), (ours[1] - theirs[1]).abs().max().item())

        # Interleave the two variants rep by rep, so load spikes on this shared
        # machine hit both alike; the min is the steadier figure.
        fa, fb = (lambda: merge_lse_torch(o, lse)), (lambda: _lse_weighted_combine(o, lse, return_lse=True))
        fa(), fb()
        ta, tb = [], []
        for _ in range(reps):
            for fn, ts in ((fa, ta), (fb, tb)):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        a, b = min(ta) * 1e3, min(tb) * 1e3
        rows.append((f"{n}x{t}x{h}x{d}", a, b, err))
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        m, dcp, tok, b, pl, dt, out = sys.argv[2:9]
        _engine(m, int(dcp), int(tok), int(b), int(pl), dt, out)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--batch", type=int, default=4, help="concurrent requests")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=50, help="merge timing repetitions")
    ap.add_argument("--skip-engines", action="store_true")
    args = ap.parse_args()

    print(f"LSE merge, torch, CPU (min of {args.reps} interleaved reps; N x T x H x D, fp32)")
    print(f"{'shape':>16} {'vllm_dcp2d ms':>14} {'vLLM ref ms':>12} {'speedup':>8} {'max |diff|':>11}")
    for shape, a, b, err in bench_merge(args.reps):
        print(f"{shape:>16} {a:14.3f} {b:12.3f} {b / a:8.2f} {err:11.2e}")
    if args.skip_engines:
        return 0
    print(f"\nvLLM decode, tiny llama-mqa, TP=2, {args.dtype}, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.tokens} tokens, block {BLOCK}")
    print(f"{'DCP':>4} {'TPOT ms':>9} {'TTFT ms':>9} {'KV tokens':>10}")
    rows = run_engines(args)
    for r in rows:
        print(f"{r['dcp']:>4} {r['tpot_s'] * 1e3:9.1f} {r['ttft_s'] * 1e3:9.1f} {r['kv_tokens']:>10,}")
    print(f"DCP=2 / DCP=1: TPOT x{rows[1]['tpot_s'] / rows[0]['tpot_s']:.2f}, "
          f"KV capacity x{rows[1]['kv_tokens'] / rows[0]['kv_tokens']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
