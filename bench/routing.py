"""Routing by decode group and session against least-in-flight balancing (issue 50, item 4).

Starts the e2e cluster (``tests/support/pd_cluster.py``: tiny ``llama-mqa`` in fp32, prefill
TP=2 = 2 layer-split CP ranks, a DCP=2 decode and a DCP=1 decode, both TP=2 with the same KV
per rank, ``--kv-pages`` pages of 32 tokens, default 136 (the tests' 34 hold one long request
and nothing else: every 2,000-token request would evict every session's history); started
with 2,048 and 1,024 tokens of context, so only DCP=2 admits a long request) and puts fronts
over both decodes: ``routed`` (``vllm-dcp2d proxy``, default routing), ``least-loaded`` (the
same proxy with ``--routing least-loaded``: the balancer before issue 50) and
``router-chash`` (``vllm-router`` 0.1.17, NIXL protocol, ``--decode-policy consistent_hash``:
sessions keyed by the request's ``user`` field, its documented session key). ``dcp1-only`` (a
proxy over the DCP=1 decode alone) serves the short requests alone, the reference for their TPOT.

Per front, one mixed workload, every request streamed (``local/workload.stream``,
``ignore_eos``): ``--sessions`` agent sessions of ``--turns`` turns in lockstep (session ``s``
starts at 400 + 40 s tokens and each turn adds 68: ``workload.session_prompt``, each turn the
previous prompt and more), while ``--clients`` threads send short (200-token) and long
(2,000-token, which only DCP=2 admits) requests, one long per ``--long-every`` requests.
Prompts are fresh per front (no decode has them cached). Printed per front and class:
requests, refusals (not answered in full), TTFT and TPOT p50 / p99 (ms); per front, the agent
turns after the first: KV bytes moved per turn (p50; a DCP=1 TP=2 decode fetches every page to
both ranks, a DCP=2 one each page to one), the share of the turn's whole prompt KV it moved (p50
/ max), the share of turns that moved at most their new pages plus two pages per path, the
share that stayed on their session's decode (from the decodes' ``stats_file`` lines: a
request's fetch is the lines whose page count is its own, written while it ran; a turn two
fetches could match is left out), and the output tokens per second over the front's run.

    PYTHONPATH=$PWD MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR .venv/bin/python bench/routing.py [--sessions 3]
        [--turns 6] [--clients 2] [--requests 16] [--long-every 4] [--fronts routed least-loaded ...]
    .venv/bin/python bench/routing.py --decision-only   # the routing decision's cost per request, first

(``PYTHONPATH``: the servers it starts import this checkout's ``vllm_dcp2d``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support (tests/README.md, "Imports")

from tests.support.pd_cluster import LAYERS, PAGE, PAGE_BYTES, expected_bytes, pd_cluster  # noqa: E402
from vllm_dcp2d.reshard.layout import cdiv  # noqa: E402
from vllm_dcp2d.local.servers import fetch_records, free_port, proxy_server, read_stats, router_server, running  # noqa: E402
from vllm_dcp2d.local.workload import host_cpu, pct, prompt_ids, session_prompt, stream  # noqa: E402

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
SHORT, LONG, OUT, AGENT_OUT, STEP = 200, 2000, 16, 8, 68
WALL = time.time() - time.monotonic()  # monotonic -> wall clock, for the stats_file's times


def workload(url: str, model: str, seed: int, args, session_field: bool) -> dict:
    """One front's mixed run: per class, ``(prompt tokens, session, turn, Stream)``. ``session_field``:
    agent turns carry ``user`` = their session (vLLM's router needs it; the proxy finds a
    session by its prompt's prefix)."""
    out = {"short": [], "long": [], "agent": []}

    def client(k: int) -> None:
        for i in range(k, args.requests, args.clients):
            long = i % args.long_every == args.long_every - 1
            ids = prompt_ids(seed + i, LONG if long else SHORT)
            out["long" if long else "short"].append((len(ids), None, None, stream(url, model, ids, OUT, 300)))

    def session(s: int, barrier: threading.Barrier) -> None:
        for t in range(args.turns):
            barrier.wait(timeout=900)
            ids = session_prompt(seed + s, t, 400 + 40 * s, STEP)
            extra = {"user": f"session-{seed}-{s}"} if session_field else None
            out["agent"].append((len(ids), s, t, stream(url, model, ids, AGENT_OUT, 300, extra=extra)))

    barrier = threading.Barrier(max(args.sessions, 1))
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    threads += [threading.Thread(target=session, args=(s, barrier)) for s in range(args.sessions)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=3600)
    return {**out, "seconds": time.monotonic() - t0}


def attribute(recs: list[dict], n_tokens: int, s) -> list[dict] | None:
    """The decode lines of one request: written while it ran, with its page count; None when
    none match or the lines of two fetches do."""
    pages = cdiv(n_tokens, PAGE)
    mine = [r for r in recs if r["ok"] and r["pages"] == pages and s.t0 + WALL <= r["t"] <= s.t_end + WALL]
    return mine if len({r["transfer_key"] for r in mine}) == 1 else None


def report(name: str, run: dict, stats: Path) -> None:
    for cls in ("short", "long", "agent"):
        if not run[cls]:
            continue
        ok = [s for _, _, _, s in run[cls] if s.ok]
        ttft, tpot = [1e3 * s.ttft for s in ok], [1e3 * s.tpot for s in ok]
        print(f"| {name} | {cls} | {len(run[cls])} | {len(run[cls]) - len(ok)} | {pct(ttft, 50):.0f} / "
              f"{pct(ttft, 99):.0f} | {pct(tpot, 50):.0f} / {pct(tpot, 99):.0f} |")
    recs = fetch_records(read_stats(stats))
    moved, share, within, same, where, prev = [], [], 0, 0, {}, {}
    for n, s, t, st in sorted(run["agent"], key=lambda x: (x[1], x[2])):
        mine = attribute(recs, n, st) if st.ok else None
        if mine is None:
            continue
        engine, dcp = mine[0]["engine_id"], mine[0]["dcp_size"]
        if t > 0 and s in where:
            b = sum(x["bytes"] for x in mine)
            full = expected_bytes(n, dcp, 0)  # the whole prompt's KV, per path
            bound = expected_bytes(n, dcp, max(prev[s] // PAGE - 2, 0))  # its new pages + 2
            moved.append(b)
            share.append(b / sum(full[(x["cp_rank"], x["dcp_rank"])] for x in mine))
            within += all(x["bytes"] <= bound[(x["cp_rank"], x["dcp_rank"])] for x in mine)
            same += where[s] == engine
        where[s], prev[s] = engine, n
    tokens = sum(s.tokens for cls in ("short", "long", "agent") for _, _, _, s in run[cls] if s.ok)
    line = f"|   {name} | output {tokens / run['seconds']:.1f} tok/s |"
    if moved:
        line += (f" later agent turns: {len(moved)} attributed, KV moved p50 {np.median(moved) / 1e3:.0f} kB, "
                 f"{np.median(share):.2f} / {max(share):.2f} of the prompt's (p50 / max), within new pages + 2: "
                 f"{100 * within / len(moved):.0f} %, on their decode: {100 * same / len(moved):.0f} % |")
    print(line)


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
    print(f"routing decision, {host_cpu()}")
    print("| prompt tokens | plan + pick + release, token-id prompt (us) | learn_answer + pick, text prompt (us) "
          "| json of the prefill answer with / without its ids (us) |")
    print("|---|---|---|---|")
    for n in lengths:
        prompt = rng.integers(0, 50000, n).tolist()
        answer = json.dumps({"choices": [{"text": "x", "prompt_token_ids": prompt}], "usage": {"prompt_tokens": n}})
        bare = json.dumps({"choices": [{"text": "x"}], "usage": {"prompt_tokens": n}})
        parsed = json.loads(answer)
        out = []
        for how in ("ids", "text"):
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                if how == "ids":
                    plan = router.plan({"max_tokens": 8}, prompt)
                else:
                    plan = router.plan({"max_tokens": 8}, None)
                    router.learn_answer(plan, parsed)
                router.pick_decode(plan)
                router.release(plan)
                ts.append(time.perf_counter() - t)
            out.append(1e6 * float(np.median(ts)))
        parse = [1e6 * float(np.median([_timed(json.loads, a) for _ in range(reps)])) for a in (answer, bare)]
        print(f"| {n:,} | {out[0]:.0f} | {out[1]:.0f} | {parse[0]:.0f} / {parse[1]:.0f} |")


def _timed(f, *a) -> float:
    t = time.perf_counter()
    f(*a)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--requests", type=int, default=16, help="short and long requests per front")
    p.add_argument("--long-every", type=int, default=4)
    p.add_argument("--kv-pages", type=int, default=136, help="KV pages of 32 tokens per decode rank")
    p.add_argument("--fronts", nargs="+", default=["routed", "least-loaded", "router-chash", "dcp1-only"])
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
                                                   name="router_chash", args=("--decode-policy", "consistent_hash"))}
            with running([v for k, v in extra.items() if k in args.fronts], 600):
                urls = {"routed": c["proxyr"].url, "dcp1-only": c["proxy1"].url, **{k: v.url for k, v in extra.items()}}
                for u in (c["proxy"].url, c["proxy1"].url):  # each decode's first request, not counted
                    stream(u, c["model"], prompt_ids(7, SHORT), 4, 300)
                time.sleep(3)  # the proxies' /metrics polls of the decodes
                print(f"fronts, {host_cpu()}")
                print("| front | class | requests | refused | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |")
                print("|---|---|---|---|---|---|")
                for k, name in enumerate(args.fronts):
                    a = argparse.Namespace(**vars(args))
                    if name == "dcp1-only":  # the short requests alone: their TPOT reference
                        a.long_every, a.sessions, a.turns = 1 << 30, 0, 0
                    report(name, workload(urls[name], c["model"], 10_000 * (k + 1), a, name == "router-chash"),
                           c["stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
