"""A PD cluster of real processes for the end-to-end suites: one prefill ``vllm
serve`` (tiny ``llama-mqa``, TP=2 = 2 layer-split CP ranks) serving two decode
instances, ``decode`` (TP=2, DCP=2) and ``decode1`` (TP=2, DCP=1: the one KV head
is replicated, so both TP ranks fetch all pages; ``kv_load_failure_policy=
"recompute"``), each behind its own proxy, plus a pipelined proxy and ``proxyr``, one
proxy over both decodes (routing by decode group and session, ``proxy/routing.py``). The prefill
instance itself, asked without ``kv_transfer_params``, is the non-disaggregated
reference. ``place(name) -> (host, netns)`` puts each process on a host
(loopback by default; ``test_e2e.py`` uses network namespaces where it can).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from vllm_dcp2d.reshard.plan import plan_request
from vllm_dcp2d.reshard.layout import cdiv
from vllm_dcp2d.reshard.report import synthetic_request
from vllm_dcp2d.local.servers import (Process, fetch_records, free_port, post_json, proxy_server, read_stats,
                                        running, vllm_server)

PAGE = 32
LAYERS = 4                # tiny llama-mqa
# float32: the DCP=2 attention path computes in fp32 and matches the stock kernel
# token for token only when the model runs in fp32 (bf16 rounding differs).
DTYPE = "float32"
PAGE_BYTES = PAGE * 2 * 32 * 4  # 1 KV head x (K+V) x head_dim 32 x fp32, per token per layer
MAX_TOKENS = 12
EXPIRY_S = 4.0
DCP = 2
# Both decodes get the same KV memory per rank, 34 pages of 32 tokens (1,088 tokens): decode1
# (DCP=1) can then be started for at most 1,024-token requests, decode (DCP=2, a page on each
# rank in turn) for 2,048. LONG fits only there (test_e2e.py, the design's capacity win).
DECODE_KV_BYTES = 34 * LAYERS * PAGE_BYTES
DECODE_MAX_LEN = {1: 1024, DCP: 2048}
LONG = 1600


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


def prompts(salt: int = 0) -> dict[str, list[int]]:
    """``salt`` (0 to 49; ``ids`` repeats every 500 seeds) gives another set, for a decode
    instance that has cached the first."""
    s = 10 * salt
    return {
        "short": ids(20, 1 + s),                                 # shorter than a page
        "pages": ids(3 * PAGE + 5, 2 + s),                       # spans 4 pages, last one partial
        "prefix": ids(3 * PAGE + 5, 2 + s)[:2 * PAGE] + ids(40, 3 + s),  # shares 2 pages with "pages"
    }


PROMPTS = prompts()
FIRST_PAGE = {"short": 0, "pages": 0, "prefix": 2}   # pages the decode instance has cached


def complete(url: str, model: str, prompt: list[int], **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    body.update(extra)
    status, out = post_json(url + "/v1/completions", body, timeout_s=300)
    assert status == 200, out
    return out


def tokens(out: dict) -> list[int]:
    choice = out["choices"][0]
    return choice.get("token_ids") or choice["text"]


def expected_bytes(n_tokens: int, dcp: int, first_page: int, page_bytes: int = PAGE_BYTES) -> dict[tuple[int, int], int]:
    """The plan's bytes per (cp_rank, dcp_rank) path for one request."""
    src, src_ids, dst, dst_ids = synthetic_request(LAYERS, 2, dcp, n_tokens, PAGE, page_bytes)
    plans = plan_request(LAYERS, 2, src, src_ids, dst, dst_ids, first_page=first_page)
    return {k: d.nbytes for k, d in plans.items()}


def check_paths(recs: list[dict], n_tokens: int, dcp: int, tp: int, first_page: int,
                page_bytes: int = PAGE_BYTES) -> None:
    ok = [r for r in recs if r.get("ok")]
    # every decode TP rank got one outcome from each of the 2 CP ranks
    assert len(ok) == 2 * tp, recs
    want = expected_bytes(n_tokens, dcp, first_page, page_bytes)
    for r in ok:
        assert r["dcp_size"] == dcp and r["cp_size"] == 2 and r["pages"] == cdiv(n_tokens, PAGE)
        assert r["bytes"] == want[(r["cp_rank"], r["dcp_rank"])], (r, want)
        assert r["layers"] == [[0, 2], [2, 4]][r["cp_rank"]]  # CP rank r sends only its layers
    got = {}
    for r in ok:
        got[(r["cp_rank"], r["dcp_rank"])] = r["bytes"]
    assert got == want


def bootstrap_addr(c) -> str:
    boot = [a for a in c["prefill"].cmd if "bootstrap_port" in a][0]
    port = json.loads(boot)["kv_connector_extra_config"]["bootstrap_port"]
    return f"tcp://{c['prefill'].host}:{port}"


def loopback(name: str) -> tuple[str, None]:
    return "127.0.0.1", None


@contextlib.contextmanager
def pd_cluster(work, place=loopback, decode_kv_bytes: int = DECODE_KV_BYTES, spawned: tuple[str, ...] = ()):
    """Start the cluster in ``work``; yields a dict of the model path, the stats file
    and the processes by name; always stops them. ``decode_kv_bytes``: KV memory per decode
    rank, the same for both (``bench/routing.py`` gives them more than the tests).
    ``spawned``: the instances that start their workers as vLLM does on CPU
    (``cpu_start_method`` "spawn"); the others as the suite asks (``conftest.py``)."""
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama-mqa", work / "model")
    stats = work / "stats.jsonl"

    def at(name):
        host, netns = place(name)
        return {"host": host, "netns": netns}

    def common(name):
        return {"stats_file": str(stats), **({"cpu_start_method": "spawn"} if name in spawned else {})}

    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, block_size=PAGE,
                          dtype=DTYPE, engine_id="prefill", max_model_len=DECODE_MAX_LEN[DCP], **at("prefill"),
                          extra_config={**common("prefill"), "bootstrap_port": free_port(), "send_timeout_s": 600.0})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=DCP, dtype=DTYPE,
                         block_size=PAGE, kv_cache_bytes=decode_kv_bytes, max_model_len=DECODE_MAX_LEN[DCP],
                         **at("decode"),
                         extra_config={**common("decode"), "transfer_timeout_s": 300.0, "prefill_wait_s": 120.0})
    decode1 = vllm_server("decode1", model, free_port(), work, role="kv_consumer", tp=2, block_size=PAGE,
                          dtype=DTYPE, failure_policy="recompute", kv_cache_bytes=decode_kv_bytes,
                          max_model_len=DECODE_MAX_LEN[1], **at("decode1"),
                          extra_config={**common("decode1"), "transfer_timeout_s": 300.0, "prefill_wait_s": 120.0})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, "proxy", **at("proxy"))
    # least-loaded: a request too long for decode1 must reach it (its refusal and the prefill's
    # release are what test_a_request_too_long_for_one_decode_rank checks); routing would refuse a
    # token-id prompt before the prefill
    proxy1 = proxy_server(free_port(), [prefill.url], [decode1.url], work, "proxy1", **at("proxy"),
                          args=("--routing", "least-loaded"))
    proxyp = proxy_server(free_port(), [prefill.url], [decode.url], work, "proxyp", pipelined=True, **at("proxy"))
    proxyr = proxy_server(free_port(), [prefill.url], [decode.url, decode1.url], work, "proxyr", **at("proxy"),
                          args=("--health-interval", "0.5"))
    with running([prefill, decode, decode1, proxy, proxy1, proxyp, proxyr], 900) as procs:
        yield {"model": model, "stats": stats, **procs}


def kv_capacity(server: Process) -> int:
    """A ``vllm serve`` instance's KV capacity in tokens, from vLLM's "KV cache size"
    start-up line (with DCP, the whole group's)."""
    cap = re.findall(r"KV cache size: ([\d,]+) tokens", server.log_path.read_text(errors="replace"))
    if not cap:
        raise AssertionError(f"no KV capacity line in {server.log_path}")
    return int(cap[0].replace(",", ""))


def tp_workers(server: Process) -> list[tuple[set[int], bool]]:
    """Each TP worker process of a running ``vllm serve`` instance (its ``VLLM::Worker*``
    processes), in process-id order: the cores its main thread may run on (the thread that
    runs the model and leads its OpenMP threads; threads a worker started before vLLM bound
    it, ZMQ's and others that wait on I/O, keep every core, spawned or forked), and whether
    it was spawned: a spawned worker was exec'd with the OpenMP variables vLLM set for it in
    its environment (``/proc/PID/environ``), a forked one shows the front end's."""
    def cores(text: str) -> set[int]:
        out = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out

    found, todo, seen = [], [server.proc.pid], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for t in Path(f"/proc/{pid}/task").iterdir():
                try:
                    todo += [int(c) for c in (t / "children").read_text().split()]
                except OSError:  # a thread that ended meanwhile
                    continue
            if not Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                continue
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # a process that ended meanwhile
            continue
        line = next(x for x in status if x.startswith("Cpus_allowed_list"))
        spawned = any(v.startswith((b"GOMP_CPU_AFFINITY=", b"OMP_PLACES=", b"KMP_AFFINITY=")) for v in env)
        found.append((pid, cores(line.split(":", 1)[1].strip()), spawned))
    return [(c, sp) for _, c, sp in sorted(found, key=lambda f: f[0])]


def stalled(recs: list[dict]) -> list[dict]:
    """Consumer records of fetches that failed on a Mooncake TCP stall (issue 14:
    0.3.13.post1 sessions stall in vLLM processes): a write attempt was given up
    after a stall, whether the write then failed or a retry on a fresh engine
    succeeded, so the blocks were quarantined (``settled=False``)."""
    return [r for r in recs if not r.get("ok") and r.get("quarantined") and "Mooncake write" in r["reason"]]


def check_proxy(c, which: str, tp: int, dcp: int, salt: int, page_bytes: int = PAGE_BYTES) -> None:
    """Every prompt through proxy ``which``: the bytes of every (cp_rank, dcp_rank) path
    equal the plan's, and the greedy tokens equal the non-disaggregated instance's.

    A fetch that hits the known Mooncake stall must have been handled safely (its
    blocks quarantined; a clear error, or the right tokens by recompute); then the
    whole prompt set is sent again with new prompts (the recompute left the old
    ones in the decode's prefix cache, which changes the pages fetched), and that
    set must pass every check. Stalls in both sets, or any other failure, fail."""
    for retry in range(2):
        # ids() repeats every 500 seeds (10 per salt): salt + 50 would send the same prompts again
        if _check_prompts(c, which, tp, dcp, salt + 17 * retry, page_bytes):
            return
    raise AssertionError(f"{which}: Mooncake stalls in two prompt sets in a row (issue 14)")


def _check_prompts(c, which: str, tp: int, dcp: int, salt: int, page_bytes: int) -> bool:
    """False if a fetch stalled (after checking it was handled safely), else True."""
    for name, prompt in prompts(salt).items():
        ref = complete(c["prefill"].url, c["model"], prompt)
        before = len(read_stats(c["stats"]))
        body = {"model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        status, out = post_json(c[which].url + "/v1/completions", body, timeout_s=300)
        recs = fetch_records(read_stats(c["stats"])[before:])
        if stalled(recs):
            assert status in (200, 502) and (status != 200 or tokens(out) == tokens(ref)), (status, out)
            print(f"{which} {name}: Mooncake stall (issue 14), handled safely: {stalled(recs)[0]}")
            return False
        assert status == 200, out
        check_paths(recs, len(prompt), dcp, tp, FIRST_PAGE[name], page_bytes)
        assert tokens(out) == tokens(ref), name
    return True
