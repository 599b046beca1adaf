"""Routing by decode group and session against least-in-flight balancing (issue 50, item 4).

Starts the e2e cluster (``tests/support/pd_cluster.py``: tiny ``llama-mqa`` in fp32, prefill
TP=2 = 2 layer-split CP ranks, a DCP=2 decode and a DCP=1 decode, both TP=2 with the same KV
per rank, ``--kv-pages`` pages of 32 tokens, default 136 (the tests' 34 hold one long request
and nothing else: every 2,000-token request would evict every session's history); started
with 2,048 and 1,024 tokens of context, so only DCP=2 admits a long request) and puts fronts over both
decodes: ``routed`` (``vllm-dcp2d proxy``, default routing), ``least-loaded`` (the same proxy
with ``--routing least-loaded``: the balancer before issue 50) and ``router-chash``
(``vllm-router`` 0.1.17, NIXL protocol, ``--decode-policy consistent_hash``: sessions keyed by
the request's ``user`` field, its documented session key). ``dcp1-only`` (a proxy over the
DCP=1 decode alone) serves the short requests alone, the reference for their TPOT.

Per front, one mixed workload, every request streamed (``ignore_eos``): ``--sessions`` agent
sessions of ``--turns`` turns in lockstep (session ``s`` starts at 400 + 40 s tokens; each turn
is the previous prompt, its answer and 60 new tokens; ``user`` = the session's name), while
``--clients`` threads send short (200-token) and long (2,000-token, which only DCP=2 holds)
requests, one long per ``--long-every`` requests. Prompts are fresh per front (no decode has
them cached). Printed per front and class: requests, refusals (non-200 or an error event), TTFT
and TPOT p50 / p99 (ms; TPOT from the first to the last token event), output tokens/s over the
front's run; per front, the agent turns after the first: KV bytes moved per turn (p50; a DCP=1
TP=2 decode fetches every page to both ranks, a DCP=2 one each page to one), the share of the
turn's whole prompt KV it moved (p50 / max), the share of turns that moved at most their new
pages plus two pages per path, and the share that stayed on
their session's decode (from the decodes' ``stats_file`` lines: a request's fetch is the lines
whose page count is its own, written while it ran; a turn two lines could belong to is left out).

    MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/routing.py [--sessions 3] [--turns 5]
        [--clients 2] [--requests 12] [--long-every 4] [--fronts routed least-loaded router-chash dcp1-only]
    .venv/bin/python bench/routing.py --decision-only   # the routing decision's cost per request, first
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support (tests/README.md, "Imports")

from tests.support.pd_cluster import LAYERS, PAGE, PAGE_BYTES, expected_bytes, ids, pd_cluster  # noqa: E402
from vllm_dcp2d.layout import cdiv  # noqa: E402
from vllm_dcp2d.local.servers import (fetch_records, free_port, proxy_server, read_stats, router_server,  # noqa: E402
                                      running)

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
SHORT, LONG, OUT, AGENT_OUT, NEW = 200, 2000, 16, 8, 60


def stream(url: str, body: dict, timeout_s: float = 300) -> dict:
    """One streamed completion: status, token event times, the token ids it answered (vLLM's
    ``return_token_ids`` on a stream), sent/answered wall times, and the error if any."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {**body, "stream": True, "return_token_ids": True}).encode(), headers={"Content-Type": "application/json"})
    t0, wall0, times, answer, err = time.monotonic(), time.time(), [], [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev["error"]
                    continue
                for ch in ev.get("choices", []):
                    if ch.get("token_ids"):
                        times.append(time.monotonic())
                        answer += ch["token_ids"]
        status = 200 if err is None else 500
    except urllib.error.HTTPError as e:
        status, err = e.code, e.read()[:200].decode(errors="replace")
    except OSError as e:
        status, err = 0, repr(e)
    return {"status": status, "err": err, "t0": t0, "times": times, "answer": answer, "sent": wall0,
            "done": time.time()}


def timings(results: list[dict]) -> tuple[list[float], list[float]]:
    ok = [r for r in results if r["status"] == 200 and r["times"]]
    ttft = [1e3 * (r["times"][0] - r["t0"]) for r in ok]
    tpot = [1e3 * (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in ok if len(r["times"]) > 1]
    return ttft, tpot


def pct(xs: list[float], q: float) -> str:
    return f"{np.percentile(xs, q):.0f}" if xs else "-"


def attribute(recs: list[dict], run: dict, n_tokens: int) -> list[dict] | None:
    """The decode lines of one request: written while it ran, with its page count; None when
    the lines of two fetches match (ambiguous) or none do."""
    pages = cdiv(n_tokens, PAGE)
    mine = [r for r in recs if r.get("ok") and r["pages"] == pages and run["sent"] <= r["t"] <= run["done"]]
    return mine if len({r["transfer_key"] for r in mine}) == 1 else None


def workload(url: str, model: str, seed: int, args, session_field: bool) -> dict:
    """One front's mixed run; returns per-class results and the agent turns. ``session_field``:
    agent turns carry ``user`` = their session (vLLM's router needs it; our proxy finds the
    session by its prompt's prefix)."""
    out = {"short": [], "long": [], "agent": []}
    turns = []  # (session, turn, prompt tokens, previous prompt tokens, result)
    stop = threading.Event()

    def client(k: int) -> None:
        for i in range(k, args.requests, args.clients):
            if stop.is_set():
                return
            long = i % args.long_every == args.long_every - 1
            n = LONG if long else SHORT
            body = {"model": model, "prompt": ids(n, seed + 100 + i), "max_tokens": OUT, "temperature": 0.0,
                    "ignore_eos": True}
            out["long" if long else "short"].append(stream(url, body))

    def session(s: int, barrier: threading.Barrier) -> None:
        prompt, prev = ids(400 + 40 * s, seed + 50 + s), 0
        for t in range(args.turns):
            barrier.wait(timeout=600)
            body = {"model": model, "prompt": prompt, "max_tokens": AGENT_OUT, "temperature": 0.0,
                    "ignore_eos": True, **({"user": f"session-{seed}-{s}"} if session_field else {})}
            r = stream(url, body)
            out["agent"].append(r)
            turns.append((s, t, len(prompt), prev, r))
            if r["status"] != 200:
                return
            prev, prompt = len(prompt), prompt + r["answer"] + ids(NEW, seed + 1000 * (s + 1) + t)

    barrier = threading.Barrier(args.sessions)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    threads += [threading.Thread(target=session, args=(s, barrier)) for s in range(args.sessions)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=1800)
    stop.set()
    return {**out, "turns": turns, "seconds": time.monotonic() - t0}


def report(name: str, run: dict, stats: Path) -> None:
    recs = [r for r in fetch_records(read_stats(stats))]
    for cls in ("short", "long", "agent"):
        res = run[cls]
        if not res:
            continue
        ttft, tpot = timings(res)
        refused = sum(r["status"] != 200 for r in res)
        print(f"| {name} | {cls} | {len(res)} | {refused} | {pct(ttft, 50)} / {pct(ttft, 99)} | "
              f"{pct(tpot, 50)} / {pct(tpot, 99)} |")
    tokens = sum(len(r["times"]) for cls in ("short", "long", "agent") for r in run[cls])
    moved, share, within, same, seen = [], [], 0, 0, 0
    where: dict[int, str] = {}
    for s, t, n, prev, r in sorted(run["turns"], key=lambda x: (x[0], x[1])):
        if r["status"] != 200:
            continue
        mine = attribute(recs, r, n)
        if mine is None:
            continue
        engine = mine[0]["engine_id"]
        if t > 0 and s in where:
            seen += 1
            b = sum(x["bytes"] for x in mine)
            moved.append(b)
            dcp = mine[0]["dcp_size"]
            full = expected_bytes(n, dcp, 0)  # the whole prompt's KV, per path
            share.append(b / sum(full[(x["cp_rank"], x["dcp_rank"])] for x in mine))
            bound = expected_bytes(n, dcp, max(prev // PAGE - 2, 0))
            within += all(x["bytes"] <= bound[(x["cp_rank"], x["dcp_rank"])] for x in mine)
            same += where[s] == engine
        where[s] = engine
    if seen:
        print(f"|   {name}: later agent turns | {seen} attributed | KV moved p50 {np.median(moved) / 1e3:.0f} kB, "
              f"{np.median(share):.2f} / {max(share):.2f} of the prompt's (p50 / max) | "
              f"within new pages + 2: {100 * within / seen:.0f} % | on their decode: {100 * same / seen:.0f} % | "
              f"output {tokens / run['seconds']:.1f} tok/s |")
    else:
        print(f"|   {name}: no later agent turn attributed | output {tokens / run['seconds']:.1f} tok/s |")


def decision_latency(lengths=(1000, 8000, 32000, 128000), n_decodes=4, reps=50) -> None:
    """The routing decision's cost per request, no cluster: ``Router.plan`` (a token-id prompt:
    its keys hashed), ``learn_answer`` (a text prompt: the prefill answer's ids), the decode
    pick with the affinity map full (65,536 entries) and the release; beside it, what
    ``return_token_ids`` adds to reading the prefill's answer (json of the ids)."""
    from vllm_dcp2d.proxy.fit import DecodeInfo
    from vllm_dcp2d.proxy.routing import Router
    from vllm_dcp2d.proxy.upstreams import Pool

    router = Router(Pool("prefill", ["http://p:1"]), Pool("decode", [f"http://d{i}:1" for i in range(n_decodes)]))
    for i, u in enumerate(router.decode_pool.upstreams):
        u.info, u.kv_usage = DecodeInfo(1 + i % 2, 32, 1 << 18, 1 << 19, 256), 0.1
    rng = np.random.default_rng(0)
    while len(router.affinity) < router.affinity.capacity:  # a full map: other sessions' prefixes
        p = router.plan({"max_tokens": 8}, rng.integers(0, 50000, 4000).tolist())
        router.pick_decode(p)
        router.release(p)
    print("| prompt tokens | plan + pick + release, token-id prompt (us) | learn_answer + pick, text prompt (us) "
          "| json of the prefill answer with / without its ids (us) |")
    print("|---|---|---|---|")
    for n in lengths:
        prompt = rng.integers(0, 50000, n).tolist()
        answer = json.dumps({"choices": [{"text": "x", "prompt_token_ids": prompt}], "usage": {"prompt_tokens": n}})
        bare = json.dumps({"choices": [{"text": "x"}], "usage": {"prompt_tokens": n}})
        out = []
        for how in ("ids", "text"):
            ts = []
            for r in range(reps):
                body = {"max_tokens": 8}
                t = time.perf_counter()
                if how == "ids":
                    plan = router.plan(body, prompt)
                else:
                    plan = router.plan(body, None)
                    router.learn_answer(plan, json.loads(answer))
                router.pick_decode(plan)
                router.release(plan)
                ts.append(time.perf_counter() - t)
            out.append(1e6 * float(np.median(ts)))
        out[1] -= 1e6 * float(np.median([_timed(json.loads, answer) for _ in range(reps)]))  # the pick's share
        parse = [1e6 * float(np.median([_timed(json.loads, a) for _ in range(reps)])) for a in (answer, bare)]
        print(f"| {n:,} | {out[0]:.0f} | {out[1]:.0f} | {parse[0]:.0f} / {parse[1]:.0f} |")


def _timed(f, *a) -> float:
    t = time.perf_counter()
    f(*a)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--requests", type=int, default=12, help="short and long requests per front")
    p.add_argument("--long-every", type=int, default=4)
    p.add_argument("--fronts", nargs="+", default=["routed", "least-loaded", "router-chash", "dcp1-only"])
    p.add_argument("--kv-pages", type=int, default=136, help="KV pages of 32 tokens per decode rank")
    p.add_argument("--decision-only", action="store_true", help="only the routing decision's cost (no cluster)")
    args = p.parse_args()
    decision_latency()
    if args.decision_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="dcp2d-routing-") as tmp:
        work = Path(tmp)
        with pd_cluster(work, decode_kv_bytes=args.kv_pages * LAYERS * PAGE_BYTES) as c:
            both = [c["prefill"].url], [c["decode"].url, c["decode1"].url]
            extra = {"least-loaded": proxy_server(free_port(), *both, work, "proxy_ll",
                                                  args=("--routing", "least-loaded")),
                     "router-chash": router_server(free_port(), [c["prefill"]], [c["decode"], c["decode1"]], work,
                                                   name="router_chash",
                                                   args=("--decode-policy", "consistent_hash"))}
            with running([v for k, v in extra.items() if k in args.fronts], 600):
                urls = {"routed": c["proxyr"].url, "dcp1-only": c["proxy1"].url,
                        **{k: v.url for k, v in extra.items()}}
                for u in (c["proxy"].url, c["proxy1"].url):  # each decode's first request, not counted
                    stream(u, {"model": c["model"], "prompt": ids(SHORT, 7), "max_tokens": 4})
                time.sleep(3)  # the proxies' /metrics polls of the decodes
                print("| front | class | requests | refused | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |")
                print("|---|---|---|---|---|---|")
                for k, name in enumerate(args.fronts):
                    a = argparse.Namespace(**vars(args))
                    if name == "dcp1-only":  # the short requests alone: their TPOT reference
                        a.long_every, a.sessions, a.turns = 1 << 30, 1, 0
                    run = workload(urls[name], c["model"], 1000 * (k + 1), a, name == "router-chash")
                    report(name, run, c["stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
