"""Prefill KV held for nobody: explicit release (``release_unfetched``) on and off.

Per case, starts a prefill (tiny ``llama-mqa`` in float32, TP=2 = 2 layer-split
CP ranks, ``send_timeout_s`` = ``--send-timeout``) and a decode (TP=2, DCP=2,
``--max-num-seqs 1``, ``release_unfetched`` on or off) behind the PD proxy, then
runs ``--rounds`` rounds of repeated prefixes:

* ``prefix``:  a shared 2-page prefix plus a new tail, through the proxy;
* ``repeat``:  the previous round's prompt again (cached on both sides but its tail);
* ``dropped``: a prompt with the shared prefix, prefilled for the decode, whose
  decode call the client gives up on (``--give-up-s``) while the decode is busy with
  a long ``blocker`` request (so it waits for admission): vLLM aborts it before its
  fetch began, the case every proxy time-out and client disconnect hits.

A thread samples the prefill's ``vllm:kv_cache_usage_perc`` every 0.2 s. Printed per
case: samples, p50/p99/max of the usage during the rounds, and seconds from the
last request's end until the usage is back to 0 (capped at send_timeout_s + 20).

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/prefix_release.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from vllm_dcp2d.local.servers import (free_port, kv_cache_usage, post_json, proxy_server, vllm_server,
                                        wait_all)

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

PAGE = 32


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


def post(url: str, body: dict, timeout_s: float) -> int:
    """HTTP status; 0 when the client gave up after ``timeout_s`` (connection closed)."""
    try:
        return post_json(url, body, timeout_s)[0]
    except OSError:
        return 0


class Sampler(threading.Thread):
    def __init__(self, url: str, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.every_s, self.samples = url, every_s, []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), kv_cache_usage(self.url)))
            except OSError:
                pass
            self.stop.wait(self.every_s)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_case(work: Path, model: str, release: bool, args) -> dict:
    common = {"cpu_poll_sleep_us": 500}
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, block_size=PAGE,
                          dtype="float32", extra_config={**common, "bootstrap_port": free_port(),
                                                         "send_timeout_s": args.send_timeout})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2, block_size=PAGE,
                         dtype="float32", failure_policy="recompute", args=("--max-num-seqs", "1"),
                         extra_config={**common, "release_unfetched": release, "transfer_timeout_s": 60.0})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work)
    procs = [prefill, decode, proxy]
    body = {"model": model, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    statuses: dict[str, list[int]] = {"prefix": [], "repeat": [], "dropped": []}
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        prefix = ids(2 * PAGE, 1)
        post(proxy.url + "/v1/completions", {**body, "prompt": prefix + ids(9, 99)}, 300)  # warm-up
        sampler = Sampler(prefill.url)
        sampler.start()
        last = None
        for i in range(args.rounds):
            prompt = prefix + ids(PAGE + 5 + i, 100 + i)
            statuses["prefix"].append(post(proxy.url + "/v1/completions", {**body, "prompt": prompt}, 300))
            if last is not None:
                statuses["repeat"].append(post(proxy.url + "/v1/completions", {**body, "prompt": last}, 300))
            last = prompt
            # dropped: the decode is busy with a long request and admits one at a time
            blocker = threading.Thread(target=post, args=(
                decode.url + "/v1/completions", {**body, "prompt": ids(20, 500 + i), "max_tokens": args.blocker},
                300))
            blocker.start()
            time.sleep(0.5)
            dropped = prefix + ids(PAGE + 3 + i, 200 + i)
            st, pre = post_json(prefill.url + "/v1/completions",
                                {**body, "prompt": dropped, "max_tokens": 1,
                                 "kv_transfer_params": {"do_remote_decode": True}}, 300)
            assert st == 200, pre
            statuses["dropped"].append(post(decode.url + "/v1/completions",
                                            {**body, "prompt": dropped,
                                             "kv_transfer_params": pre["kv_transfer_params"]}, args.give_up_s))
            blocker.join(300)
        end = time.monotonic()
        during = [u for t, u in sampler.samples]
        deadline = end + args.send_timeout + 20
        while time.monotonic() < deadline and not (sampler.samples and sampler.samples[-1][1] == 0.0
                                                   and sampler.samples[-1][0] > end):
            time.sleep(0.2)
        sampler.stop.set()
        sampler.join()
        zero = next((t for t, u in sampler.samples if t > end and u == 0.0), None)
        return {"release": release, "statuses": statuses, "samples": len(during),
                "p50": statistics.median(during), "p99": pct(during, 0.99), "max": max(during),
                "back_to_0_s": None if zero is None else zero - end}
    finally:
        for p in reversed(procs):
            p.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--send-timeout", type=float, default=60.0, help="prefill send_timeout_s")
    ap.add_argument("--give-up-s", type=float, default=1.5, help="client timeout of the dropped decode call")
    ap.add_argument("--blocker", type=int, default=300, help="max_tokens of the request keeping the decode busy")
    ap.add_argument("--cases", nargs="+", choices=["on", "off"], default=["on", "off"])
    args = ap.parse_args()
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="prefix_release_") as tmp:
        work = Path(tmp)
        model = build_tiny_model("llama-mqa", work / "model")
        for case in args.cases:
            d = work / case
            d.mkdir()
            rows.append(run_case(d, model, case == "on", args))
    print(f"\nrounds={args.rounds} send_timeout_s={args.send_timeout:.0f} give_up_s={args.give_up_s} "
          f"(prefill KV usage, fraction of its blocks, sampled every 0.2 s)")
    print(f"{'release_unfetched':>17} {'samples':>7} {'p50':>6} {'p99':>6} {'max':>6} {'back to 0 (s)':>13}  "
          f"HTTP statuses (prefix / repeat / dropped)")
    for r in rows:
        back = "never" if r["back_to_0_s"] is None else f"{r['back_to_0_s']:.1f}"
        s = r["statuses"]
        print(f"{str(r['release']):>17} {r['samples']:>7} {r['p50']:>6.3f} {r['p99']:>6.3f} {r['max']:>6.3f} "
              f"{back:>13}  {s['prefix']} / {s['repeat']} / {s['dropped']}")


if __name__ == "__main__":
    main()
