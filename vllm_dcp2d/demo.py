"""``vllm-dcp2d demo``: prefill (layer-split) -> decode (DCP) on one machine.

With no ``--model`` it builds the tiny local model (``llama-mqa``: one KV
head, so the KV is replicated over TP=2 and each TP rank is a layer-split CP
rank), starts on loopback

  * a prefill instance: TP=2 = 2 layer-split CP ranks, ``kv_role=kv_producer``;
  * a decode instance: TP=2 with DCP=2 (``--decode-dcp``), ``kv_role=kv_consumer``;
  * the PD proxy in front of them,

sends a few requests through the proxy and prints the reshard matrix, the
bytes and time of every (cp_rank, dcp_rank) path, the generated text, and
whether it equals the prefill instance's own (non-disaggregated) answer.
``--model`` points it at a real model, e.g. on a GPU machine.

The servers are started as users start them (``vllm serve``, ``vllm-dcp2d
proxy``) by ``local/servers.py``, which the end-to-end tests and benches use too.
"""

from __future__ import annotations

import signal
from pathlib import Path

from vllm_dcp2d.local.servers import (fetch_records, free_port, post_json, proxy_server, read_stats, vllm_server,
                                      wait_all)

__all__ = ["main", "parse", "servers", "serving_defaults"]


DEMO_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Long-context serving shards KV cache by layer on prefill and by page on decode. " * 4,
    "Prefill decode disaggregation moves the KV cache over the Mooncake transfer engine. " * 8,
]


def parse(argv: list[str]):
    import argparse
    p = argparse.ArgumentParser(prog="vllm-dcp2d demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path or name (default: build the tiny local model)")
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size = layer-split CP size")
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--decode-dcp", type=int, default=2, help="decode DCP size (divides --decode-tp)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV page size (default: 32 for the tiny model, 64 for an MLA model on GPU, else vLLM's choice)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pipelined", action="store_true",
                   help="proxy sends prefill and decode at once (layer-pipelined transfer) after the first request")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 for the tiny model, else the model's)")
    p.add_argument("--kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype for both instances (e.g. fp8)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's --speculative-config for both instances (the prefill computes the draft's KV "
                        "of the prompt too), e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: three built-in)")
    p.add_argument("--workdir", default=None, help="logs, stats and the tiny model (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the servers")
    return p.parse_args(argv)


def _print_paths(records: list[dict], tokens: int) -> None:
    ok = [r for r in records if r.get("ok")]
    if not ok:
        print("  (no transfer recorded)")
        return
    r0 = ok[0]
    for r in sorted(ok, key=lambda r: (r["cp_rank"], r["dcp_rank"], r["tp_rank"])):
        lr = f"[{r['layers'][0]}, {r['layers'][1]})"
        print(f"  path (cp {r['cp_rank']}, dcp {r['dcp_rank']}) -> decode TP rank {r['tp_rank']}: layers {lr:<8} "
              f"{r['bytes']:>8} B "
              f"{r['descriptors']:>5} descriptors  write {1e3 * r['seconds']:7.2f} ms  "
              f"early layers {r.get('early_layers', 0)}  "
              f"(fetch {1e3 * r['fetch_seconds']:.1f} ms)")
    total = sum(r["bytes"] for r in ok)
    naive = sum(r["naive_bytes"] for r in ok)
    print(f"  total {total} B over {len(ok)} paths (a full-sequence send per DCP rank would move {naive} B); "
          f"transfer time {1e3 * max(r['fetch_seconds'] for r in ok):.1f} ms, request of {tokens} tokens, "
          f"{r0['pages']} pages")


def main(argv: list[str]) -> int:
    import tempfile

    from vllm_dcp2d.reshard.report import format_matrix, matrix_from_records

    args = parse(argv)
    if args.decode_tp % args.decode_dcp:
        raise SystemExit(f"--decode-dcp {args.decode_dcp} must divide --decode-tp {args.decode_tp}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dcp2d-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    cpu = args.model is None or not _has_gpu()  # the tiny model runs on CPU anywhere
    if args.model is None:
        from vllm_dcp2d.local.tiny_models import build_tiny_model
        model = build_tiny_model("llama-mqa", work / "tiny-llama-mqa")
        print(f"built the tiny model in {model}")
    else:
        model = args.model
    mla = _is_mla(model)
    stats = work / "stats.jsonl"
    prefill, decode = servers(args, model, work, stats, cpu)
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, pipelined=args.pipelined)
    procs = [prefill, decode, proxy]
    # SIGTERM (timeout, CI cancel) unwinds like Ctrl-C, so the servers are stopped below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        print(f"starting prefill (TP={args.prefill_tp}, layer-split CP={args.prefill_tp}) and decode "
              f"(TP={args.decode_tp}, DCP={args.decode_dcp}); logs in {work}")
        for p in procs:
            p.start()
        wait_all(procs, args.timeout)
        print(f"ready: prefill {prefill.url}, decode {decode.url}, proxy {proxy.url}\n")
        failures = 0
        for i, prompt in enumerate(args.prompt or DEMO_PROMPTS):
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
            before = len(read_stats(stats))
            status, out = post_json(proxy.url + "/v1/completions", body)
            if status != 200:
                print(f"request {i}: HTTP {status}: {out}")
                failures += 1
                continue
            _, ref = post_json(prefill.url + "/v1/completions", body)
            text, ref_text = out["choices"][0]["text"], ref["choices"][0]["text"]
            tokens = out["usage"]["prompt_tokens"]
            recs = fetch_records(read_stats(stats)[before:])  # the decode's fetch lines
            print(f"request {i}: {tokens} prompt tokens -> {text!r}")
            print(f"  equals the prefill instance's own (non-disaggregated, TP={args.prefill_tp}) answer: "
                  f"{text == ref_text}")
            if text != ref_text and mla:
                print("  (MLA: vLLM's CPU MLA runs the last prompt token through its prefill path there and "
                      "through its decode path here; docs/connector.md, \"MLA\")")
            m = matrix_from_records(recs, tokens) if i == 0 else None
            if m is not None:
                print("\n" + "\n".join("  " + line for line in format_matrix(m).splitlines()) + "\n")
            _print_paths(recs, tokens)
        return 1 if failures else 0
    finally:
        for p in reversed(procs):
            p.stop()


def servers(args, model: str, work: Path, stats: Path, cpu: bool):
    """The prefill and decode ``vllm serve`` processes (not started) the demo runs
    for parsed ``args``, with :func:`serving_defaults` where the user left them."""
    block, dtype = serving_defaults(tiny=args.model is None, mla=_is_mla(model), gpu=not cpu)
    block, dtype = args.block_size or block, args.dtype or dtype
    flags = ((("--kv-cache-dtype", args.kv_cache_dtype) if args.kv_cache_dtype else ())
             + (("--speculative-config", args.speculative_config) if args.speculative_config else ()))
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=args.prefill_tp,
                          block_size=block, cpu=cpu, dtype=dtype, args=flags,
                          extra_config={"bootstrap_port": free_port(), "stats_file": str(stats)})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=args.decode_tp,
                         dcp=args.decode_dcp, block_size=block, cpu=cpu, dtype=dtype, args=flags,
                         extra_config={"stats_file": str(stats)})
    return prefill, decode


def serving_defaults(tiny: bool, mla: bool, gpu: bool) -> tuple[int | None, str | None]:
    """(block size, dtype) both instances start with unless the user picks them.

    The tiny model: 32-token pages (CPU_ATTN takes multiples of 32, FLASH_ATTN of
    16); fp32 on CPU, where DCP attention computes in fp32 and matches the stock
    kernel token for token only then, bf16 on GPU (FLASH_ATTN has no fp32).
    MLA on GPU: 64, the one size FLASHMLA takes (TRITON_MLA and FLASH_ATTN_MLA take
    any multiple of 16); on CPU vLLM's choice (CPU_MLA takes 16 only). Other models:
    vLLM's choice and the model's dtype. The DCP interleave follows the block size
    by itself (vllm_compat/startup.py). ``tests/test_demo.py`` checks these
    against vLLM's own backend validation for an H200.
    """
    if tiny:
        return 32, ("bfloat16" if gpu else "float32")
    return (64 if mla and gpu else None), None


def _is_mla(model: str) -> bool:
    """Whether ``model`` is a local directory whose config has an MLA latent."""
    import json

    cfg = Path(model) / "config.json"
    return cfg.is_file() and "kv_lora_rank" in json.loads(cfg.read_text())


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False
