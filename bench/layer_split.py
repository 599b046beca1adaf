"""Layer-split storage on a prefill instance: capacity gained, throughput paid.

For each tiny model, four vLLM engines (TP=2, ``kv_producer``s of
DCP2DConnector) with ``layer_split`` "off", "on", "on", "off", in one run:

* capacity: the tokens vLLM's own "KV cache size" line reports for the same
  ``kv_cache_memory_bytes`` (expected gain ``L / (max owned + 1)``);
* prefill cost: ``--requests`` prompts of each length per engine, one at a time, each
  generating 1 token, under chunked prefill with ``max_num_batched_tokens``
  256 (MLA: vLLM turns chunked prefill off on CPU, so one step per prompt and
  no broadcast). Every chunk after the first has the owners broadcast the
  prompt's earlier blocks for every non-owned layer; that is the price.

    .venv/bin/python bench/layer_split.py [--requests 8]
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

MODELS = [("llama-mqa-8", "float32", 8), ("deepseek-v2-mla", "bfloat16", 2)]
LENGTHS = (256, 2048)
KV_BYTES = 64 << 20


def _engine(model: str, mode: str, dtype: str, requests: int, out: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_dcp2d.local.servers import free_port

    mla = "mla" in model
    llm = LLM(model=model, tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=True,
              kv_cache_memory_bytes=KV_BYTES, max_model_len=4096, max_num_seqs=4, dtype=dtype, seed=0,
              block_size=None if mla else 32, max_num_batched_tokens=4096 if mla else 256,
              enable_chunked_prefill=not mla, enable_prefix_caching=False,
              kv_transfer_config={"kv_connector": "DCP2DConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"layer_split": mode, "bootstrap_port": free_port()}})
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    ids = lambda n, s: [(s * 7 + i * 13) % 500 + 6 for i in range(n)]  # noqa: E731
    llm.generate([{"prompt_token_ids": ids(64, 999)}], sp, use_tqdm=False)  # warm-up
    result = {}
    for n in LENGTHS:
        times = []
        for r in range(requests):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids(n, 1000 * n + r)}], sp, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        result[str(n)] = times
    Path(out).write_text(json.dumps(result))


def _run(kind: str, dtype: str, mode: str, requests: int, work: Path) -> tuple[dict, int]:
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model(kind, work / kind, dtype=dtype)
    out = work / f"{kind}-{mode}.json"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", MC_FORCE_TCP="1")
    proc = subprocess.run([sys.executable, __file__, "--engine", model, mode, dtype, str(requests), str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{kind} layer_split={mode} failed:\n{log[-4000:]}")
    cap = int(re.findall(r"KV cache size: ([\d,]+) tokens", log)[0].replace(",", ""))
    return json.loads(out.read_text()), cap


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="prompts per length and mode")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-layer-split-"))
    print(f"TP=2 = 2 CP ranks, kv_cache_memory_bytes = {KV_BYTES >> 20} MiB, {2 * args.requests} prompts per row "
          f"(two engines per mode, ABBA), one at a time")
    print(f"{'model':<17}{'L':>3}{'split':>6}{'KV tokens':>11}{'gain':>7}  {'prompt':>6}"
          f"{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'tok/s p50':>11}{'cost':>7}")
    for kind, dtype, layers in MODELS:
        # ABBA order, samples pooled per mode: a drift of the machine over the run
        # (thermal, page cache) weighs on both modes alike.
        runs: dict[str, tuple[dict, int]] = {}
        for mode in ("off", "on", "on", "off"):
            times, cap = _run(kind, dtype, mode, args.requests, work)
            if mode in runs:
                assert runs[mode][1] == cap, (mode, cap, runs[mode][1])
                times = {n: runs[mode][0][n] + t for n, t in times.items()}
            runs[mode] = (times, cap)
        base_cap = runs["off"][1]
        for mode, (times, cap) in runs.items():
            for n in LENGTHS:
                t = times[str(n)]
                p50 = _pct(t, 0.5)
                cost = p50 / _pct(runs["off"][0][str(n)], 0.5)
                print(f"{kind:<17}{layers:>3}{mode:>6}{cap:>11,}{cap / base_cap:>6.2f}x  {n:>6}"
                      f"{1e3 * p50:>9.1f}{1e3 * _pct(t, 0.99):>9.1f}{1e3 * max(t):>9.1f}{n / p50:>11.0f}"
                      f"{cost:>6.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--engine":
        _engine(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else:
        main()
