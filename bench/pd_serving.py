"""Prefill -> decode serving: DCP2DConnector through the PD proxy beside vLLM's built-in MooncakeConnector.

Starts, per ``cpu_poll_sleep_us`` setting, the demo's cluster on loopback (tiny
``llama-mqa`` in float32: prefill TP=2 = 2 layer-split CP ranks, decode TP=2
DCP=2) with a sequential and a ``--pipelined`` proxy, and sends ``--requests``
prompts through each proxy one after another. Then, in the same run, the same
prompts go to vLLM's built-in ``MooncakeConnector`` (prefill TP=2 -> decode
TP=2, DCP=1, TCP; the bench routes each request itself: prefill with
``do_remote_decode``, then decode with ``do_remote_prefill``).

Printed per case: requests answered, end-to-end p50/p99/max, stalls (path
writes that took over 2 s, from ``stats_file``), fresh-engine retries (prefill
log), median fetch and write time, layers written early (pipelining), bytes on
the wire per request, the CPU cores the servers kept busy, and for the
built-in connector how many answers equal DCP2D's sequential ones. Then, per DCP2D
case, the instances' API-server latency while it ran (``GET /v1/models`` every 100 ms
on the prefill and the decode: an engine loop that polls too eagerly starves it).
``cpu_poll_sleep_us=0`` is vLLM's own spinning shared-memory queues (see
docs/connector.md, "Known limitations").

The built-in connector does not start on CPU as shipped (vLLM 0.32 calls
``torch.accelerator.current_device_index()``, which raises without an
accelerator). Only the processes this bench launches for it load the
bench-only shim ``bench/builtin_cpu_shim/sitecustomize.py``; the plugin never
does. ``--no-builtin`` skips that case; if it cannot start, the bench prints why.

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/pd_serving.py [--requests 6] [--sleep-us 500 0]
    # the stall target (issue 14): 0 stalls in 300 requests, p99 <= 2x p50; the API servers' latency meanwhile
    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/pd_serving.py --requests 300 --sleep-us 500
    # the same, with the built-in connector on the first 60 prompts
    ... bench/pd_serving.py --requests 300 --builtin-requests 60 --timeout 40
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from vllm_dcp2d.proxy import decode_body, prefill_body
from vllm_dcp2d.local.servers import free_port, post_json, proxy_server, read_stats, vllm_server, wait_all
from vllm_dcp2d.local.workload import session_stats

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
STALL_S = 2.0  # a path write slower than this counts as a stall (tiny model: writes take 1-100 ms)
SHIM = Path(__file__).resolve().parent / "builtin_cpu_shim"


def session_cpu_s(sids: set[int]) -> float:
    """CPU seconds (user + system) of every live process in the sessions ``sids``."""
    return sum(session_stats(sid)["cpu_s"] for sid in sids)


def post(url: str, body: dict, timeout_s: float) -> tuple[int, str | None]:
    """HTTP status and completion text of one request; (0, None) if no answer in ``timeout_s``."""
    try:
        status, data = post_json(url, body, timeout_s)
    except OSError:  # socket timeout, connection refused/reset
        return 0, None
    choices = data.get("choices") or [{}]
    return status, choices[0].get("text")


def prompt(i: int) -> list[int]:
    """70..773 tokens, random content seeded by ``i``: no prefix-cache hits between requests
    (the earlier ``(i * 131 + k * 13) % 500`` repeated every 500 requests, so the pipelined
    case's prompts ``1000 + r`` were the sequential case's, cached on decode)."""
    n = 70 + 37 * (i % 20)
    return np.random.default_rng(i).integers(6, 506, n).tolist()


def body(model: str, ids: list[int]) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def latency_row(lat: list[float]) -> dict:
    a = 1e3 * np.asarray(lat)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


class ApiProbe:
    """While a case runs: ``GET /v1/models`` on each instance every 100 ms, timed. The
    API server shares the host's cores with the engine loop and its workers; an engine
    that polls for transfers too eagerly starves it (issue 14: requests waited ~10 s),
    and the step bell (issue 29) must not bring that back."""

    def __init__(self, urls: list[str]):
        self.urls, self.lat, self.failed = urls, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for url in self.urls:
                t = time.monotonic()
                try:
                    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                        r.read()
                    self.lat.append(time.monotonic() - t)
                except OSError:
                    self.failed += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)


def count_lines(path: Path, pattern: str) -> int:
    try:
        return len(re.findall(pattern, path.read_text(errors="replace")))
    except OSError:
        return 0


def run_case(work: Path, model: str, sleep_us: int, requests: int, timeout_s: float) -> tuple[list[dict], list]:
    """DCP2D cases; returns the rows and the sequential proxy's answers (for the built-in comparison)."""
    stats = work / "stats.jsonl"
    common = {"stats_file": str(stats), "cpu_poll_sleep_us": sleep_us}
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, block_size=32,
                          dtype="float32", extra_config={**common, "bootstrap_port": free_port()})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2, block_size=32,
                         dtype="float32", extra_config={**common, "transfer_timeout_s": timeout_s})
    proxies = {"sequential": proxy_server(free_port(), [prefill.url], [decode.url], work, "proxy"),
               "pipelined": proxy_server(free_port(), [prefill.url], [decode.url], work, "proxyp", pipelined=True)}
    procs = [prefill, decode, *proxies.values()]
    rows, texts = [], []
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        sids = {p.proc.pid for p in (prefill, decode)}
        for i, (mode, proxy) in enumerate(proxies.items()):
            # one warm-up request per proxy (first Mooncake connections; the pipelined
            # proxy learns the prefill's bootstrap address from it), not counted
            post(proxy.url + "/v1/completions", body(model, [(7 * k + i) % 500 + 6 for k in range(40)]), timeout_s)
            before, cpu0, t0 = len(read_stats(stats)), session_cpu_s(sids), time.monotonic()
            retries0 = count_lines(prefill.log_path, "retrying on a fresh engine")
            lat, ok, answers = [], 0, []
            with ApiProbe([prefill.url, decode.url]) as api:
                for r in range(requests):
                    t = time.monotonic()
                    status, text = post(proxy.url + "/v1/completions", body(model, prompt(1000 * i + r)), timeout_s)
                    lat.append(time.monotonic() - t)
                    ok += status == 200
                    answers.append(text if status == 200 else None)
            wall = time.monotonic() - t0
            recs = [x for x in read_stats(stats)[before:] if x.get("side") == "consumer" and x.get("ok")]
            rows.append({"case": f"DCP2D {mode}", "sleep_us": sleep_us, "ok": ok, "n": requests, **latency_row(lat),
                         "stalls": sum(x["seconds"] > STALL_S for x in recs),
                         "retries": count_lines(prefill.log_path, "retrying on a fresh engine") - retries0,
                         "fetch_ms": 1e3 * statistics.median([x["fetch_seconds"] for x in recs]) if recs else None,
                         "write_ms": 1e3 * statistics.median([x["seconds"] for x in recs]) if recs else None,
                         "early": statistics.mean([x["early_layers"] for x in recs]) if recs else None,
                         "bytes": sum(x["bytes"] for x in recs) / max(ok, 1),
                         "cores": (session_cpu_s(sids) - cpu0) / wall,
                         "api": latency_row(api.lat) if api.lat else None, "n_api": len(api.lat),
                         "api_failed": api.failed})
            if mode == "sequential":
                texts = answers
    finally:
        for p in reversed(procs):
            p.stop()
    return rows, texts


def builtin_bytes(log: Path) -> float | None:
    """Bytes the built-in connector moved, from vLLM's periodic "KV Transfer metrics" log lines."""
    total, seen = 0.0, False
    for line in log.read_text(errors="replace").splitlines():
        n = re.search(r"'Num successful transfers': (\d+)", line)
        mb = re.search(r"'Avg MB per transfer': ([0-9.]+)", line)
        if n and mb:
            total += int(n.group(1)) * float(mb.group(1)) * 2**20
            seen = True
    return total if seen else None


def run_builtin(work: Path, model: str, sleep_us: int, requests: int, timeout_s: float,
                reference: list) -> dict:
    """The same prompts through vLLM's MooncakeConnector: prefill TP=2 -> decode TP=2 (DCP=1)."""
    boot, engine_id = free_port(), f"bench-prefill-{uuid.uuid4().hex[:8]}"
    env = {"PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
           "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)}

    def server(name: str, role: str, eid: str | None) -> object:
        kv = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_load_failure_policy": "fail",
              "kv_connector_extra_config": {"mooncake_protocol": "tcp"}, **({"engine_id": eid} if eid else {})}
        p = vllm_server(name, model, free_port(), work, role="", tp=2, block_size=32, dtype="float32",
                        extra_config={}, args=("--kv-transfer-config", json.dumps(kv)))
        p.env.update(env)
        return p

    prefill, decode = server("builtin-prefill", "kv_producer", engine_id), server("builtin-decode", "kv_consumer", None)
    row = {"case": "built-in Mooncake", "sleep_us": sleep_us, "n": requests}
    procs = [prefill, decode]
    try:
        for p in procs:
            p.start()
        try:
            wait_all(procs, 900)
        except (RuntimeError, TimeoutError) as e:
            return {**row, "error": str(e).splitlines()[0] + " (see the log for the traceback)"}
        sids = {p.proc.pid for p in procs}

        def one(ids: list[int]) -> tuple[int, str | None]:
            tid = uuid.uuid4().hex
            status, _ = post(prefill.url + "/v1/completions", prefill_body(body(model, ids), tid), timeout_s)
            if status != 200:
                return status, None
            params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                      "remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{boot}"}
            return post(decode.url + "/v1/completions", decode_body(body(model, ids), params), timeout_s)

        one([(7 * k) % 500 + 6 for k in range(40)])  # warm-up, not counted
        cpu0, t0 = session_cpu_s(sids), time.monotonic()
        lat, ok, same = [], 0, 0
        for r in range(requests):
            t = time.monotonic()
            status, text = one(prompt(r))
            lat.append(time.monotonic() - t)
            ok += status == 200
            same += status == 200 and r < len(reference) and text == reference[r]
        wall = time.monotonic() - t0
    finally:
        for p in reversed(procs):
            p.stop()
    moved = builtin_bytes(decode.log_path)
    return {**row, "ok": ok, **latency_row(lat), "same": same, "cores": (session_cpu_s(sids) - cpu0) / wall,
            "bytes": None if moved is None else moved / max(ok + 1, 1)}  # + 1: the warm-up is in the log


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="requests per case (the stall target: 300)")
    ap.add_argument("--sleep-us", type=int, nargs="+", default=[500])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request and per fetch")
    ap.add_argument("--no-builtin", action="store_true", help="skip vLLM's built-in MooncakeConnector")
    ap.add_argument("--builtin-requests", type=int, default=None,
                    help="the first N of the same prompts for the built-in connector (default: --requests); "
                         "each of its stalled writes waits the engine's 30 s")
    a = ap.parse_args()
    if a.requests < 1:
        ap.error(f"--requests must be >= 1, got {a.requests}")
    n_builtin = a.requests if a.builtin_requests is None else a.builtin_requests
    if not 1 <= n_builtin <= a.requests:
        ap.error(f"--builtin-requests must be in [1, --requests={a.requests}], got {n_builtin}")
    work = Path(tempfile.mkdtemp(prefix="dcp2d-bench-pd-"))
    model = build_tiny_model("llama-mqa", work / "model")
    rows = []
    for us in a.sleep_us:
        case_rows, texts = run_case(work / f"sleep{us}", model, us, a.requests, a.timeout)
        rows += case_rows
        if not a.no_builtin and us == a.sleep_us[0]:
            rows.append(run_builtin(work / "builtin", model, us, n_builtin, a.timeout, texts[:n_builtin]))
    longest = max(len(prompt(i)) for i in range(a.requests))
    print(f"\nprefill TP=2 -> decode TP=2, tiny llama-mqa fp32, {a.requests} requests of 70-{longest} prompt "
          f"tokens + 8 output tokens per case, one at a time; logs in {work}\n")
    print(f"{'case':>20} {'sleep us':>8} {'ok':>7} {'p50 ms':>7} {'p99 ms':>8} {'max ms':>8} {'stalls':>6} "
          f"{'retries':>7} {'fetch ms':>8} {'write ms':>8} {'early':>5} {'KB/req':>7} {'cores':>5} {'same':>5}")
    print("-" * 124)
    for r in rows:
        if "error" in r:
            print(f"{r['case']:>20} {r['sleep_us']:>8}  did not start: {r['error']}")
            continue
        print(f"{r['case']:>20} {r['sleep_us']:>8} {r['ok']:>3}/{r['n']:<3} {r['p50']:>7.0f} {r['p99']:>8.0f} "
              f"{r['max']:>8.0f} {fmt(r.get('stalls'), '6d')} {fmt(r.get('retries'), '7d')} "
              f"{fmt(r.get('fetch_ms'), '8.1f')} {fmt(r.get('write_ms'), '8.2f')} {fmt(r.get('early'), '5.2f')} "
              f"{fmt(None if r.get('bytes') is None else r['bytes'] / 1e3, '7.1f')} {r['cores']:>5.2f} "
              f"{fmt(r.get('same'), '5d')}")
    api = [r for r in rows if r.get("api")]
    if api:
        print("\nthe instances' API servers meanwhile (GET /v1/models every 100 ms on the prefill and the decode):\n")
        print(f"{'case':>20} {'sleep us':>8} {'probes':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'failed':>6}")
        for r in api:
            a = r["api"]
            print(f"{r['case']:>20} {r['sleep_us']:>8} {r['n_api']:>6} {a['p50']:>7.1f} {a['p99']:>7.1f} "
                  f"{a['max']:>7.1f} {r['api_failed']:>6}")
    print(f"\nend-to-end latency per request; stalls = path writes over {STALL_S:.0f} s; retries = writes re-sent on a"
          "\nfresh Mooncake engine; fetch/write = medians of a decode rank's whole fetch and of one path's writes;"
          "\nearly = mean layers per path written before the prefill ended (of 2); KB/req = KV bytes on the wire"
          "\nper request (built-in: from vLLM's KV transfer metrics log); cores = CPU seconds of the prefill and"
          "\ndecode servers per second of the case; same = built-in answers equal to DCP2D's sequential ones.")


if __name__ == "__main__":
    main()
