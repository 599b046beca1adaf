"""Speculative decoding on a DCP decode instance, in one run (issue 13):

TPOT with and without speculation at TP=2 + DCP=2, the acceptance rate and
mean accepted length (vLLM's spec-decode counters), and the KV bytes per rank
of the longest request: the unsharded draft pool against the target's shard.

    .venv/bin/python bench/spec_decode.py [--tokens 64] [--batch 4] [--prompt-len 400] [--rounds 3]

Rows (tiny MQA Llama, 4 layers, float32, greedy, k = 3 draft tokens):
  none         no speculation;
  draft_model  the target as its own draft (acceptance near 1: the upper bound);
  eagle        a random-weight EAGLE head (acceptance near 0: the overhead).

TPOT of a request is ``(last_token_ts - first_token_ts) / (tokens - 1)`` from
vLLM's own per-request timestamps; p50/p99/max are over every request of every
timed round. Each engine runs in a subprocess (vLLM spawns TP workers). On a
2-core machine compare rows of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BLOCK = 32
K = 3
ROOT = str(Path(__file__).resolve().parents[1])  # vLLM's workers import tests.support.spec_probe from here


def _engine(model: str, eagle: str, dcp: int, spec: str, a: dict, out: str) -> None:
    from vllm import LLM, SamplingParams

    kw = {}
    if spec != "none":
        kw = dict(speculative_config={"method": spec, "model": eagle if spec == "eagle" else model,
                                      "num_speculative_tokens": K},
                  worker_extension_cls="tests.support.spec_probe.SpecProbe")
    llm = LLM(model=model, tensor_parallel_size=2, decode_context_parallel_size=dcp, block_size=BLOCK,
              cp_kv_cache_interleave_size=BLOCK, distributed_executor_backend="mp", enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, max_model_len=2048, max_num_seqs=a["batch"],
              enable_prefix_caching=False, dtype="float32", seed=0, disable_log_stats=False, **kw)
    prompts = [{"prompt_token_ids": [(7 * s + 13 * i) % 500 + 6 for i in range(a["prompt_len"])]}
               for s in range(a["batch"])]
    sp = SamplingParams(max_tokens=a["tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)

    def counters() -> dict:
        m = {x.name: x for x in llm.get_metrics()}
        get = lambda n: m[n].value if n in m else 0  # noqa: E731
        return {k: get(f"vllm:spec_decode_num_{k}") for k in ("drafts", "draft_tokens", "accepted_tokens")}

    before = counters()
    if spec != "none":
        llm.collective_rpc("probe_start")
    tpots = []
    for _ in range(a["rounds"]):
        for o in llm.generate(prompts, sp, use_tqdm=False):
            st = o.metrics
            tpots.append((st.last_token_ts - st.first_token_ts) / (len(o.outputs[0].token_ids) - 1))
    after = counters()
    res = {"tpots": tpots, **{k: after[k] - before[k] for k in after}}
    if spec != "none":
        groups = llm.collective_rpc("probe_groups")[0]
        report = llm.collective_rpc("probe_report")[0]
        # Per group: blocks of the longest request x page bytes, split into draft and target layers.
        res["kv"] = [{"draft": report["max_blocks"][str(i)] * g["page_bytes"] * g["draft_layers"],
                      "target": report["max_blocks"][str(i)] * g["page_bytes"] * (len(g["layers"]) - g["draft_layers"])}
                     for i, g in enumerate(groups)]
    Path(out).write_text(json.dumps(res))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--run", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        model, eagle, dcp, spec, a, out = args.run
        _engine(model, eagle, int(dcp), spec, json.loads(a), out)
        return 0
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    a = {"tokens": args.tokens, "batch": args.batch, "prompt_len": args.prompt_len, "rounds": args.rounds}
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model("llama-mqa", Path(tmp) / "model", "float32")
        eagle = build_tiny_model("llama-mqa-eagle", Path(tmp) / "eagle", "float32")
        for dcp, spec in ((2, "none"), (2, "draft_model"), (2, "eagle"), (1, "none"), (1, "draft_model")):
            out = Path(tmp) / f"{dcp}-{spec}.json"
            proc = subprocess.run([sys.executable, __file__, "--run", model, eagle, str(dcp), spec, json.dumps(a),
                                   str(out)], env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode:
                print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
                return 1
            rows.append((dcp, spec, json.loads(out.read_text())))
    print(f"tiny llama-mqa, TP=2, batch {args.batch}, prompt {args.prompt_len} tokens, {args.tokens} new tokens, "
          f"{args.rounds} rounds, k={K}")
    print(f"{'DCP':>3} {'speculation':<12} {'TPOT p50 ms':>11} {'p99':>7} {'max':>7} {'accept rate':>11} "
          f"{'mean accepted len':>17} {'target KV/rank':>14} {'draft KV/rank':>13}")
    base = {dcp: _pct(r["tpots"], 0.5) for dcp, spec, r in rows if spec == "none"}
    for dcp, spec, r in rows:
        t = [x * 1e3 for x in r["tpots"]]
        rate = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else float("nan")
        mal = 1 + r["accepted_tokens"] / r["drafts"] if r["drafts"] else float("nan")
        kv = r.get("kv", [])
        tgt, dft = sum(g["target"] for g in kv), sum(g["draft"] for g in kv)
        kvs = (f"{tgt / 1024:>11.0f} KiB {dft / 1024:>9.0f} KiB" if kv else f"{'-':>14} {'-':>13}")
        print(f"{dcp:>3} {spec:<12} {_pct(t, 0.5):>11.1f} {_pct(t, 0.99):>7.1f} {max(t):>7.1f} {rate:>11.3f} "
              f"{mal:>17.2f} {kvs}")
    for dcp, spec, r in rows:
        if spec != "none":
            print(f"DCP={dcp} {spec}: TPOT p50 x{_pct(r['tpots'], 0.5) / base[dcp]:.2f} of DCP={dcp} without speculation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
