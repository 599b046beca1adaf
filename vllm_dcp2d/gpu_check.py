"""``scripts/gpu-check.sh``: every GPU path of vllm_dcp2d one GPU can run, one PASS/FAIL table.

Rows (each runs in its own process under a timeout, so a crash or hang is a FAIL
row, not a lost run), each printed with what it proves and what it cannot on one GPU
(``SCOPE``):

* ``mooncake``: KV allocated on the GPU by vLLM's own allocator in two layouts with
  equal page formats, the plan of a CP=2 x DCP=2 reshard, each path written by the
  project's Mooncake transport over TCP between two engines (GPU -> GPU), a CPU MLA
  prefill into GPU pages (CPU -> GPU), and sparse MLA (fp8_ds_mla latent and indexer
  keys per layer, GPU -> GPU); every decode page compared byte for byte.
* ``vllm-pd``: ``vllm serve`` prefill (kv_producer) and decode (kv_consumer) on the
  one GPU with DCP2DConnector, the PD proxy in front, for the tiny Llama (MQA, fp32)
  and the tiny DeepSeek MLA (576, bf16, 64-token pages, FLASHMLA): every request
  answered, KV moved over the connector, and the Llama's greedy tokens through PD
  equal the prefill instance's own (MLA's count is reported: bf16 and a different
  kernel path for the last prompt token on decode, docs/connector.md "MLA"). The
  servers start one after another, each with a fixed KV cache (``--kv-cache-memory-bytes``),
  so none sizes its KV from free memory another one is still taking.
* ``vllm-layer-split``, ``vllm-dcp``: SKIP: layer-split prefill (TP>=2) and DCP>1 run
  one rank per GPU (vLLM's device groups refuse two ranks on one device); run the demo
  with ``--prefill-tp 2`` or ``--decode-dcp 2`` on a 2-GPU host.

Usage: ``python -m vllm_dcp2d.gpu_check [--rows a,b] [--budget S]``; exit 0
iff no row failed. Without a CUDA device it prints one FAIL row and exits 2 at once.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = ("mooncake", "vllm-pd", "vllm-layer-split", "vllm-dcp")
DEVICE_ROWS = ("mooncake",)  # take the device (--device cpu: CPU memory stands in for the GPU's)
ROW_S = {"mooncake": 120.0}  # vllm-pd: what is left
# Per row: what a PASS proves, and what it cannot on one GPU (docs/gpu.md says the same).
SCOPE = {
    "mooncake": ("byte-exact Mooncake writes of every CP2 x DCP2 path between KV that vLLM allocated on this GPU: "
                 "dense pages in two layouts, MLA pages CPU -> GPU, sparse MLA's latent and indexer planes",
                 "RDMA and two hosts (TCP on one host), a copy between two GPUs"),
    "vllm-pd": ("PD at DCP=1 through the connector on this vLLM's GPU model runner (Model Runner V2 on 0.34): KV "
                "moved, the tiny Llama's greedy tokens equal the prefill's own, the tiny DeepSeek MLA (FLASHMLA) "
                "answered",
                "DCP > 1, layer-split CP > 1 and TP > 1 (one rank per GPU), sparse MLA (DSA) serving, speculative "
                "decoding, the interleave's cost"),
    "vllm-layer-split": ("nothing (SKIP)", "layer-split prefill: TP >= 2, one GPU per rank"),
    "vllm-dcp": ("nothing (SKIP)", "DCP > 1: one GPU per DCP rank"),
}
KV_BYTES = 256 << 20  # each vllm-pd server's KV cache: fixed, not a share of free memory


def check_mooncake(device: str = "cuda") -> str:
    import numpy as np
    import torch

    from vllm_dcp2d.reshard.plan import plan_request
    from vllm_dcp2d.transfer.transport import MooncakeTransport
    from vllm_dcp2d.reshard.layout import cp_layer_range
    from vllm_dcp2d.vllm_compat.connector_api import kv_regions, layer_index, page_layout
    from vllm_dcp2d.vllm_compat.kv_alloc import allocate_kv, allocate_sparse_mla, kv_cache_layouts, logical_pages

    def run(src_dev, dst_dev, src_layout, dst_layout, alloc):
        """alloc(layout, blocks, device) -> {layer name: KV view}, every layer the same caches."""
        cp, dcp, layers, nsrc, ndst = 2, 2, 4, 40, 24
        src = [alloc(src_layout, nsrc, src_dev) for _ in range(cp)]
        dst = [alloc(dst_layout, ndst, dst_dev) for _ in range(dcp)]
        f = {tuple(page_layout(t, n) for t in kv.values()) for kv, n in ((src[0], nsrc), (dst[0], ndst))}
        if len(f) != 1:
            raise AssertionError(f"page formats differ: {f}")
        for kv in src:
            for t in kv.values():
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
        rng = np.random.default_rng(0)
        pages = 37
        src_ids, dst_ids = rng.permutation(nsrc)[:pages], rng.permutation(ndst)[:-(-pages // dcp)]
        engines = [MooncakeTransport() for _ in range(cp + dcp)]
        try:
            regs = []
            for eng, (kv, n) in zip(engines, [(kv, nsrc) for kv in src] + [(kv, ndst) for kv in dst]):
                reg, mem = kv_regions(kv, n)
                for addr, nbytes in mem:
                    eng.register(addr, nbytes)
                regs.append(reg)
            plans = plan_request(layers, cp, regs[:cp], src_ids, regs[cp:], dst_ids)
            if device == "cuda":
                torch.cuda.synchronize()
            t0, moved = time.perf_counter(), 0
            for (r, d), desc in plans.items():
                moved += engines[r].write(engines[cp + d].session_id, desc)
            dt = time.perf_counter() - t0
        finally:
            for e in engines:
                e.close()
        for (r, d) in plans:
            held = cp_layer_range(layers, cp, r)
            for name in (n for n in dst[d] if layer_index(n) in held):  # every cache of those layers
                got = logical_pages(dst[d][name], ndst)[torch.as_tensor(dst_ids[np.arange(d, pages, dcp) // dcp])]
                want = logical_pages(src[r][name], nsrc)[torch.as_tensor(src_ids[d::dcp])]
                if not torch.equal(got.cpu(), want.cpu()):
                    raise AssertionError(f"{src_dev}->{dst_dev} {src_layout.name}->{dst_layout.name}: {name}, "
                                         f"DCP rank {d} pages differ")
        return f"{moved >> 20} MiB in {dt * 1e3:.0f} ms"

    def dense(mla, heads, head):
        return lambda layout, blocks, dev: allocate_kv(layout, mla, 4, blocks, 16, heads, head, torch.bfloat16, dev)

    KVCacheLayout = kv_cache_layouts()
    a = run(device, device, KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, dense(False, 8, 128))
    b = run("cpu", device, KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, dense(True, 1, 576))
    # Sparse MLA as GLM-5.x / DeepSeek-V3.2 run it: fp8_ds_mla latent + indexer keys per layer.
    c = run(device, device, KVCacheLayout.LBNHC, KVCacheLayout.BLNHC,
            lambda layout, blocks, dev: allocate_sparse_mla(layout, 4, blocks, device=dev))
    return f"{device}->{device} {a}; cpu(MLA)->{device} {b}; sparse MLA {device}->{device} {c}"


def check_vllm_pd() -> str:
    from vllm_dcp2d.demo import DEMO_PROMPTS, serving_defaults
    from vllm_dcp2d.local.servers import (fetch_records, free_port, post_json, proxy_server, read_stats,
                                          vllm_server, wait_all)
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="dcp2d-gpu-check-"))
    # A fixed KV cache per server, started one after another: none sizes its KV from free memory
    # that another is taking. The utilization only passes vLLM's start-up check that so much is
    # free (0.32, 0.33; 0.34's extensible KV cache skips it): 4 servers of tiny models stay below it.
    gpu = ("--kv-cache-memory-bytes", str(KV_BYTES), "--gpu-memory-utilization", "0.1", "--enforce-eager",
           "--max-num-seqs", "4")
    pairs, procs = [], []
    for kind in ("llama-mqa", "deepseek-v2-mla"):
        model = build_tiny_model(kind, work / kind)
        mla = kind == "deepseek-v2-mla"
        block, _ = serving_defaults(tiny=not mla, mla=mla, gpu=True)
        # Llama in fp32 (vLLM then picks TRITON_ATTN; DCP=1 here): the decode runs the last
        # prompt token through its decode path, which only fp32 keeps token-exact. MLA has
        # no fp32 GPU backend: bf16, its equality reported, not required (docs/connector.md, "MLA").
        dtype = "bfloat16" if mla else "float32"
        stats = work / f"{kind}.jsonl"
        p = vllm_server(f"{kind}-prefill", model, free_port(), work, role="kv_producer", block_size=block, cpu=False,
                        dtype=dtype, extra_config={"bootstrap_port": free_port(), "stats_file": str(stats)}, args=gpu)
        d = vllm_server(f"{kind}-decode", model, free_port(), work, role="kv_consumer", block_size=block, cpu=False,
                        dtype=dtype, extra_config={"stats_file": str(stats)}, args=gpu)
        x = proxy_server(free_port(), [p.url], [d.url], work, name=f"{kind}-proxy")
        pairs.append((kind, model, p, x, stats))
        procs += [p, d, x]
    try:
        deadline = time.monotonic() + 360
        for proc in procs:  # one after another (module doc)
            proc.start()
            wait_all([proc], max(1.0, deadline - time.monotonic()))
        notes = []
        for kind, model, p, x, stats in pairs:
            equal = 0
            for prompt in DEMO_PROMPTS:
                body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
                status, out = post_json(x.url + "/v1/completions", body)
                if status != 200:
                    raise AssertionError(f"{kind}: PD request HTTP {status}: {out}")
                _, ref = post_json(p.url + "/v1/completions", body)
                same = out["choices"][0]["text"] == ref["choices"][0]["text"]
                equal += same
                if not same and kind == "llama-mqa":
                    raise AssertionError(f"{kind}: PD {out['choices'][0]['text']!r} != prefill's own "
                                         f"{ref['choices'][0]['text']!r}")
            ok = [r for r in fetch_records(read_stats(stats)) if r["ok"]]
            if len(ok) < len(DEMO_PROMPTS):
                raise AssertionError(f"{kind}: {len(ok)} transfers recorded for {len(DEMO_PROMPTS)} requests")
            notes.append(f"{kind}: {equal}/{len(DEMO_PROMPTS)} equal, {sum(r['bytes'] for r in ok)} B")
        return "; ".join(notes) + f" (logs {work})"
    finally:
        for proc in reversed(procs):
            proc.stop()


CHECKS = {"mooncake": check_mooncake, "vllm-pd": check_vllm_pd}
SKIPS = {"vllm-layer-split": "layer-split prefill needs TP>=2, one GPU per TP rank; run `vllm-dcp2d demo --model "
                             "PATH --prefill-tp 2` on 2 GPUs",
         "vllm-dcp": "DCP>1 needs one GPU per DCP rank; run `vllm-dcp2d demo --model PATH --decode-tp 2 "
                     "--decode-dcp 2` on 2 GPUs"}


def _row(name: str, timeout: float, device: str) -> tuple[str, float, str]:
    if name in SKIPS:
        return "SKIP", 0.0, SKIPS[name]
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "vllm_dcp2d.gpu_check", "--one", name, "--device", device],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL", time.monotonic() - t0, f"timed out after {timeout:.0f} s"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return "FAIL", time.monotonic() - t0, f"rc={p.returncode}: " + " | ".join(tail)
    r = json.loads(lines[-1])
    return ("PASS" if r["ok"] else "FAIL"), time.monotonic() - t0, r["detail"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for all rows together")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: self-test of the mooncake row's code on CPU memory (tests); the other rows need cuda")
    args = ap.parse_args(argv)
    if args.one:
        try:
            check = CHECKS[args.one]
            detail, ok = (check(args.device) if args.one in DEVICE_ROWS else check()), True
        except AssertionError as e:
            detail, ok = str(e), False
        print(json.dumps({"ok": ok, "detail": detail}))
        return 0
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{'check':<14} {'result':<6} detail\n{'gpu':<14} {'FAIL':<6} no CUDA device "
              f"(torch {torch.__version__}, cuda {torch.version.cuda}); this script needs one GPU")
        return 2
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (--device cpu)"
    print(f"GPU: {gpu}, torch {torch.__version__}", flush=True)
    results, deadline = [], time.monotonic() + args.budget
    for name in rows:
        left = deadline - time.monotonic()
        if left < 10:
            results.append((name, "FAIL", 0.0, "not run: the budget is spent"))
            continue
        results.append((name, *_row(name, min(left, ROW_S.get(name, left)), args.device)))
        print(f"  {name}: {results[-1][1]} ({results[-1][2]:.0f} s)", flush=True)
    print(f"\n{'check':<14} {'result':<6} {'seconds':>7}  detail")
    for name, res, sec, detail in results:
        print(f"{name:<14} {res:<6} {sec:7.0f}  {detail}")
    print("\nwhat each row proves, and what it cannot on one GPU:")
    for name, *_ in results:
        proves, cannot = SCOPE[name]
        print(f"  {name}: proves {proves}; cannot: {cannot}")
    return 1 if any(r[1] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
