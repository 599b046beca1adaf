"""DCP decode benchmark on CPU, in one run:

1. TPOT (time per output token) of a model where attention matters (8 query
   heads, 1 KV head, head dim 128, 2 layers) served by vLLM with TP=2 + DCP=2
   against TP=2 + DCP=1, at several context lengths, batch 4, both engines
   given the same KV memory (sized for DCP=1's batch); plus the KV capacity
   vLLM reports and the peak RSS of the decode workers;
2. the torch LSE merge of vllm_dcp2d against vLLM's own torch reference
   (``vllm.v1.attention.ops.dcp._lse_weighted_combine``) on the same inputs.

    .venv/bin/python bench/dcp_decode.py [--contexts 1024,8192,32768] [--batch 4] [--tokens 32]
                                         [--gathers auto,gloo,vllm,dcp2d] [--avx2-host]

``--gathers`` runs a DCP>1 engine once per transport of its DCP group's all-gathers
(``DCP2D_DCP_GATHER``, vllm_compat/attention.py patch 6: gloo, vLLM's shared-memory
collectives, the plugin's ``ShmAllGather``; "auto" picks as a deployment does); the
table names what each engine's log says it used. ``--avx2-host`` runs every engine as
on an AVX2 host (``tests/support/avx2_host``: vLLM's AVX2 build, no shared-memory
collectives, so "vllm" is refused there).

Each engine runs in a subprocess (vLLM spawns TP workers). TPOT is the time of
one engine step while every request of the batch decodes, taken from
``LLMEngine.step()`` (the intervals between steps that produced tokens, after
the last request's prefill and before the first request finished): with chunked
prefill the first requests would otherwise be timed while the others' prefill
chunks ran in the same steps. The table gives p50, p99 and max over ``--tokens``
steps. Peak RSS is ``VmHWM`` of each worker process (the max over the TP ranks).
On a 2-core machine both engines share the cores with anything else running;
compare the rows of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BLOCK = 32
MAX_BATCHED = 4096  # tokens per scheduler step (chunked prefill)
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 1, 128, 2
ROOT = str(Path(__file__).resolve().parents[1])


def build_model(path: Path, dtype: str, max_len: int) -> str:
    """8 query heads on 1 KV head, head dim 128, 2 layers, random weights; the
    tokenizer of the tiny test models (prompts are token ids anyway)."""
    import torch
    import transformers

    from vllm_dcp2d.local.tiny_models import build_tiny_model

    tok = build_tiny_model("llama", path.parent / "tokenizer")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=512,
                                   num_hidden_layers=LAYERS, max_position_embeddings=max_len,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, architectures=["LlamaForCausalLM"], rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for f in Path(tok).iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return str(path)


def kv_bytes(batch: int, context: int, tokens: int, dtype: str) -> int:
    """KV memory per rank that holds ``batch`` sequences at DCP=1 (KV heads are
    replicated over TP when there are fewer of them than ranks), plus 10%."""
    elem = 2 if dtype == "bfloat16" else 4
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * elem
    return int(batch * (context + tokens + 2 * BLOCK) * per_token * 1.1)


def _worker_peak_rss() -> int:
    """Largest ``VmHWM`` (bytes) among this process's descendants (the TP workers)."""
    import psutil

    peak = 0
    for child in psutil.Process().children(recursive=True):
        try:
            for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return peak


def _engine(model: str, dcp: int, context: int, tokens: int, batch: int, dtype: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    steps_prefill = -(-batch * context // MAX_BATCHED) + 3
    llm = LLM(model=model, tensor_parallel_size=2, decode_context_parallel_size=dcp,
              cp_kv_cache_interleave_size=BLOCK, block_size=BLOCK, distributed_executor_backend="mp",
              enforce_eager=True, kv_cache_memory_bytes=kv_bytes(batch, context, tokens + steps_prefill, dtype),
              max_model_len=context + tokens + steps_prefill + 2 * BLOCK, max_num_seqs=batch,
              max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=False, dtype=dtype, seed=0,
              disable_log_stats=False)
    prompts = [{"prompt_token_ids": [(7 * s + 13 * i) % 500 + 6 for i in range(context)]} for s in range(batch)]
    # Chunked prefill lets the first requests decode while the last ones still
    # prefill; every request gets enough extra tokens that `tokens` steps run with
    # the whole batch decoding, and only those steps are timed.
    sp = SamplingParams(max_tokens=tokens + steps_prefill, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    counts, ids, stamps = {}, {}, []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        grew = False
        for o in outs:
            n = len(o.outputs[0].token_ids)
            grew |= n > counts.get(o.request_id, 0)
            counts[o.request_id], ids[o.request_id] = n, list(o.outputs[0].token_ids)
        all_decoding = len(counts) == batch and min(counts.values()) >= 1 and max(counts.values()) < sp.max_tokens
        if grew and all_decoding:
            stamps.append(now)
    wall = time.perf_counter() - t0
    steps = [b - a for a, b in zip(stamps, stamps[1:])][:tokens]
    if len(steps) < tokens:
        raise RuntimeError(f"only {len(steps)} steps ran with all {batch} requests decoding, expected {tokens}")
    Path(out).write_text(json.dumps({"tpot_s": steps, "wall_s": wall, "rss": _worker_peak_rss(),
                                     "tokens": [ids[str(i)] for i in range(batch)]}))


def run_engines(args) -> list[dict]:
    import re

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        max_len = max(args.contexts) + args.tokens + 4 * BLOCK
        model = build_model(Path(tmp) / "model", args.dtype, max_len)
        # The engines import this checkout's vllm_dcp2d (and, for --avx2-host, tests.support).
        base_env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
                        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        if args.avx2_host:
            sys.path.insert(0, ROOT)
            from tests.support import avx2_host

            base_env = avx2_host.env(base_env)
        for context in args.contexts:
            for dcp, gather in [(d, g) for d in args.dcps for g in (args.gathers if d > 1 else ["-"])]:
                out = str(Path(tmp) / f"c{context}-dcp{dcp}-{gather}.json")
                env = dict(base_env, DCP2D_DCP_GATHER=gather) if dcp > 1 else base_env
                cmd = [sys.executable, __file__, "--engine", model, str(dcp), str(context), str(args.tokens),
                       str(args.batch), args.dtype, out]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                log = proc.stdout + proc.stderr
                if proc.returncode:
                    raise RuntimeError(f"context {context}, DCP={dcp} ({gather}) engine failed:\n{log[-4000:]}")
                cap = re.findall(r"KV cache size: ([\d,]+) tokens", log)
                used = re.findall(r"DCP group dcp:0 \(ranks [^)]*\) (gathers over shared memory \((?:vLLM's|"
                                  r"vllm_dcp2d's) \w+|keeps gloo)", log)
                rows.append(dict(json.loads(Path(out).read_text()), dcp=dcp, context=context, gather=gather,
                                 used=used[0].split("(")[-1] if used else ("gloo" if dcp > 1 else "-"),
                                 kv_tokens=int(cap[0].replace(",", "")) if cap else -1))
                print(f"  done: context {context}, DCP={dcp} ({gather})", file=sys.stderr, flush=True)
    return rows


def bench_merge(reps: int) -> list[tuple]:
    import torch
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    from vllm_dcp2d.attention.merge import merge_lse

    rows = []
    g = torch.Generator().manual_seed(0)
    for n, t, h, d in [(2, 8, 16, 128), (2, 64, 16, 128), (4, 64, 16, 128), (8, 256, 32, 128)]:
        o = torch.randn(n, t, h, d, generator=g)
        lse = torch.randn(n, t, h, generator=g)
        lse[0, ::3] = float("-inf")  # some empty shards
        ours = merge_lse(o, lse)
        theirs = _lse_weighted_combine(o, lse, return_lse=True)
        err = max((ours[0] - theirs[0]).abs().max().item(), (ours[1] - theirs[1]).abs().max().item())

        # Interleave the two variants rep by rep, so load spikes on this shared
        # machine hit both alike; the min is the steadier figure.
        fa, fb = (lambda: merge_lse(o, lse)), (lambda: _lse_weighted_combine(o, lse, return_lse=True))
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


def bench_local_attention(reps: int) -> list[tuple]:
    """One DCP rank's attention over its local pages, one thread, fp32, vLLM's ``vec``
    page layout (K column-major), 8 query heads on 1 KV head, head dim 128, pages of
    32: the online softmax over page chunks against the flash route (``attention/flash.py``),
    each forced on every request by moving ``flash.LONG_QUERY``."""
    import torch

    from vllm_dcp2d.attention import flash, gather, paged

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    d, h, bs, local = HEAD_DIM, HEADS, BLOCK, 4096
    layout_k = torch.arange(bs * d).view(d, bs).t().contiguous()
    layout_v = gather.plain_layout(bs, d)
    rows, stock = [], flash.LONG_QUERY
    cases = [("decode 4 x 1 query", [1, 1, 1, 1], False), ("prefill 1 x 2048", [2048], False),
             ("mixed 2048 + 3 x 1", [2048, 1, 1, 1], False), ("causal new 1 x 2048", [2048], True)]
    for name, q_lens, causal in cases:
        r, t = len(q_lens), sum(q_lens)
        pages = r * local // bs
        cache = torch.randn(pages, KV_HEADS, 2 * bs * d, generator=g)
        table = torch.randperm(pages, generator=g).view(r, -1)
        q = torch.randn(t, h, d, generator=g)
        kn, vn = torch.randn(t, KV_HEADS, d, generator=g), torch.randn(t, KV_HEADS, d, generator=g)
        qsl = torch.tensor([0, *np.cumsum(q_lens)])
        lens = torch.full((r,), local)
        if causal:
            run = lambda: paged.varlen_attention_lse(q, kn, vn, qsl, d ** -0.5)  # noqa: E731
        else:
            run = lambda: paged.paged_attention_lse(q, cache[..., :bs * d], cache[..., bs * d:],  # noqa: E731
                                                    layout_k, layout_v, table, lens, qsl, d ** -0.5)
        times, outs = {"online": [], "flash": []}, {}
        try:
            for _ in range(reps):
                for route, limit in (("online", 1 << 30), ("flash", 0)):
                    flash.LONG_QUERY = limit
                    t0 = time.perf_counter()
                    outs[route] = run()
                    times[route].append(time.perf_counter() - t0)
        finally:
            flash.LONG_QUERY = stock
        err = max((outs["online"][i] - outs["flash"][i]).abs().max().item() for i in (0, 1))
        rows.append((name, min(times["online"]) * 1e3, min(times["flash"]) * 1e3, err))
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        m, dcp, ctx, tok, b, dt, out = sys.argv[2:9]
        _engine(m, int(dcp), int(ctx), int(tok), int(b), dt, out)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,8192,32768", help="prompt lengths, comma-separated")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--batch", type=int, default=4, help="concurrent requests")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=50, help="merge timing repetitions")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine")
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--dcps", default="1,2", help="DCP sizes to run (the table needs 1)")
    ap.add_argument("--gathers", default="auto", help="DCP2D_DCP_GATHER values for DCP>1 engines, comma-separated")
    ap.add_argument("--avx2-host", action="store_true", help="engines see an AVX2 host (vLLM's AVX2 build)")
    args = ap.parse_args()
    args.gathers = args.gathers.split(",")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.dcps = [int(d) for d in args.dcps.split(",")]

    print(f"LSE merge, torch, CPU (min of {args.reps} interleaved reps; N x T x H x D, fp32)")
    print(f"{'shape':>16} {'vllm_dcp2d ms':>14} {'vLLM ref ms':>12} {'speedup':>8} {'max |diff|':>11}")
    for shape, a, b, err in bench_merge(args.reps):
        print(f"{shape:>16} {a:14.3f} {b:12.3f} {b / a:8.2f} {err:11.2e}")
    print(f"\nLocal attention of one DCP rank, {HEADS} query heads / {KV_HEADS} KV head / head dim {HEAD_DIM}, "
          f"4096 local tokens per request, fp32, one thread (min of {max(3, args.reps // 10)} interleaved reps)")
    print(f"{'case':>20} {'online ms':>10} {'flash ms':>9} {'flash/online':>13} {'max |diff|':>11}")
    for name, a, b, err in bench_local_attention(max(3, args.reps // 10)):
        print(f"{name:>20} {a:10.1f} {b:9.1f} {b / a:13.2f} {err:11.2e}")
    if args.skip_engines:
        return 0
    print(f"\nvLLM decode, {HEADS} query heads / {KV_HEADS} KV head / head dim {HEAD_DIM}, {LAYERS} layers, "
          f"TP=2, {args.dtype}, batch {args.batch}, {args.tokens} tokens, block {BLOCK}, same KV memory")
    rows = run_engines(args)
    print(f"{'context':>8} {'DCP':>4} {'DCP gather (used)':>34} {'steps':>6} {'TPOT p50 ms':>12} {'p99 ms':>8} "
          f"{'max ms':>8} {'x DCP=1':>8} {'KV tokens':>10} {'worker RSS MiB':>15} {'same tokens':>12}")
    by = {(r["context"], r["dcp"], r["gather"]): r for r in rows}
    for (context, dcp, gather), r in by.items():
        base = by.get((context, 1, "-"), r)
        p50, p99 = np.percentile(r["tpot_s"], [50, 99])
        ratio = p50 / np.percentile(base["tpot_s"], 50)
        same = "-" if dcp == 1 else str(r["tokens"] == base["tokens"])
        label = "-" if dcp == 1 else f"{gather} ({r['used']})"
        print(f"{context:>8} {dcp:>4} {label:>34} {len(r['tpot_s']):>6} {p50 * 1e3:12.1f} {p99 * 1e3:8.1f} "
              f"{max(r['tpot_s']) * 1e3:8.1f} {ratio:8.2f} {r['kv_tokens']:>10,} {r['rss'] / 2**20:15.0f} {same:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
