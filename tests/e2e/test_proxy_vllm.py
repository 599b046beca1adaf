"""PD fronts in front of 2 prefill and 2 decode ``vllm serve`` instances (tiny
``llama-mqa``, TP=1 each, decode DCP=1: the cheapest real cluster with two of each
kind), started once for the module:

* vLLM's router (``vllm-router``, the vllm-project router) in both PD request
  protocols: ``--kv-connector nixl`` (the decode gets the prefill's
  ``kv_transfer_params`` verbatim) and ``--kv-connector mooncake`` (the router
  asks each prefill's HTTP bootstrap ``GET /query`` and builds the decode's
  parameters with a ``transfer_id``). Plain and streamed: greedy tokens equal the
  non-disaggregated answer, every request's KV fetched (bytes equal the plan), both
  instances of each kind used, KV usage back to 0 everywhere.
* vLLM's router with no instance list (``--vllm-discovery-address``): every instance
  registers itself (``router_discovery_address``), and a decode instance started
  under load joins it and, stopped, leaves it.
* Our proxy on requests its prefill hop used to refuse or could not split
  (``min_tokens`` above 1, a batch of 3 prompts, ``n=2`` seeded): each equal to the
  non-disaggregated answer, every prompt's KV fetched, KV usage back to 0.
* Our proxy (last: it kills a decode): load spreads over both instances of each
  kind, greedy tokens equal the non-disaggregated answer (the prefill instance asked
  without ``kv_transfer_params``), a decode instance killed with SIGKILL while it
  holds a request is survived by a retry on the other one (which fetches the
  prefill's KV itself), the health poller then takes the dead one out of rotation,
  and the proxy's ``/metrics`` serves every documented name.

Three proxies share the cluster: ``proxy`` with health checks every 0.5 s, and
``proxy_nohealth`` and ``proxy_pipelined`` (``--pipelined``) with them off, so
the requests that meet the dead decode are forced (nothing takes it out of
rotation before they reach it). The pipelined retry is the case where the second
decode asks the prefill ranks by the transfer key while the prefill may still run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import itertools
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_dcp2d.proxy.metrics import METRICS, PREFIX
from vllm_dcp2d.local.servers import (Process, bin_path, fetch_records, free_port, kv_cache_usage, post_json,
                                        read_stats, router_server, running, vllm_server, wait_all)
from tests.support.shared import fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

PAGE = 32
MAX_TOKENS = 8


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


PROMPTS = [ids(20 + 5 * i, i + 1) for i in range(11)]  # distinct: no decode has any cached
ROUTER_PROMPTS = {mode: [ids(40 + 7 * i, 100 + 10 * k + i) for i in range(4)]  # none of PROMPTS'
                  for k, mode in enumerate(("nixl", "mooncake", "discovery"))}
LOAD_PROMPTS = [ids(30 + 9 * i, 200 + i) for i in range(6)]  # the membership test's clients
PAGE_BYTES = PAGE * 2 * 32 * 4  # 1 KV head x (K+V) x head_dim 32 x fp32, per token per layer
LAYERS = 4

def body(model: str, prompt: list[int], stream: bool = False) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, **({} if stream else {"return_token_ids": True})}


def stream_text(url: str, b: dict, timeout_s: float = 300) -> tuple[int, str]:
    """POST a streamed completion; (status, the concatenated text of its SSE events)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(b).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        raw = r.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw
    out = [json.loads(e) for e in events[:-1]]
    assert all("error" not in e for e in out), raw
    return r.status, "".join(e["choices"][0]["text"] for e in out)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels) -> float:
    for m in re.finditer(r"^(\w+)(?:\{(.*)\})? (\S+)$", text, re.M):
        if m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == labels:
            return float(m.group(3))
    return 0.0


def wait_for(what: str, cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        time.sleep(0.2)


def fetched(stats_path) -> list[dict]:
    """A decode instance's consumer records of completed fetches."""
    return [r for r in fetch_records(read_stats(stats_path)) if r["ok"]]


# one cluster for the module's tests, checked before each and started again if a test broke
# it (the kill test breaks it on purpose, and runs last) (tests/support/shared.py)
shared, cluster = fixtures("proxy_vllm", lambda work: _start(work))


@contextlib.contextmanager
def _start(tmp_path):
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama-mqa", tmp_path / "model")
    common = {"dtype": "float32", "block_size": PAGE, "tp": 1}
    disc = f"127.0.0.1:{free_port()}"  # every instance also registers with the discovery router

    def joins(port: int) -> dict:
        return {"router_discovery_address": disc, "router_http_address": f"127.0.0.1:{port}"}

    ports = [free_port() for _ in range(4)]
    prefill = [vllm_server(f"prefill{i}", model, ports[i], tmp_path, role="kv_producer", **common,
                           extra_config={"bootstrap_port": free_port(), "stats_file": str(tmp_path / f"p{i}.jsonl"),
                                         **joins(ports[i])})
               for i in range(2)]
    decode = [vllm_server(f"decode{i}", model, ports[2 + i], tmp_path, role="kv_consumer",
                          failure_policy="recompute", **common,
                          extra_config={"transfer_timeout_s": 120.0, "stats_file": str(tmp_path / f"d{i}.jsonl"),
                                        **joins(ports[2 + i])})
              for i in range(2)]

    def proxy(name: str, *flags: str) -> Process:
        port = free_port()
        cmd = [bin_path("vllm-dcp2d"), "proxy", "--port", str(port), *flags]
        for p in prefill:
            cmd += ["--prefill", p.url]
        for d in decode:
            cmd += ["--decode", d.url]
        return Process(name, cmd, port, tmp_path / f"{name}.log")

    px = proxy("proxy", "--health-interval", "0.5", "--health-timeout", "2")
    px_nohealth = proxy("proxy_nohealth", "--health-interval", "0")
    px_pipe = proxy("proxy_pipelined", "--health-interval", "0", "--pipelined")
    px_features = proxy("proxy_features", "--health-interval", "0")  # its own: px's call counts stay exact
    routers = {mode: router_server(free_port(), prefill, decode, tmp_path, mode, name=f"router_{mode}")
               for mode in ("nixl", "mooncake")}
    # no instance list: it serves once the instances registered (its /health answers 503 before)
    routers["discovery"] = router_server(free_port(), [], [], tmp_path, name="router_discovery", discovery=disc)
    # the proxies and routers start beside the instances, as users start them: a proxy serves an
    # instance that came up after it (it polls a kind again when it finds none in rotation); the
    # router in Mooncake mode asks each prefill's /query until it answers
    with running([*prefill, *decode, px, px_nohealth, px_pipe, px_features, *routers.values()], 840):
        yield {"tmp": tmp_path, "model": model, "prefill": prefill, "decode": decode, "px": px,
               "px_nohealth": px_nohealth, "px_pipe": px_pipe, "px_features": px_features, "routers": routers,
               "joins": joins}


def reference(c, prompt: list[int]) -> dict:
    """The non-disaggregated answer: the prefill instance asked without ``kv_transfer_params``."""
    status, out = post_json(c["prefill"][0].url + "/v1/completions", body(c["model"], prompt), timeout_s=300)
    assert status == 200, out
    return out["choices"][0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["nixl", "mooncake", "discovery"])
def test_vllm_router(cluster, mode):
    """vLLM's router in front, unchanged: the connector speaks both of its PD protocols, and
    the instances join a router that has no list of them (``router_discovery_address``)."""
    from vllm_dcp2d.reshard.plan import plan_request
    from vllm_dcp2d.reshard.report import synthetic_request

    c = cluster
    url = c["routers"][mode].url
    prompts = ROUTER_PROMPTS[mode]
    refs = [reference(c, p) for p in prompts]
    before = {i: len(read_stats(c["tmp"] / f"d{i}.jsonl")) for i in (0, 1)}
    for i, prompt in enumerate(prompts[:3]):
        status, out = post_json(url + "/v1/completions", body(c["model"], prompt), timeout_s=300)
        assert status == 200 and out["choices"][0]["token_ids"] == refs[i]["token_ids"], (mode, i, out)
    status, text = stream_text(url, body(c["model"], prompts[3], stream=True))
    assert status == 200 and text == refs[3]["text"], mode
    # every request's KV was fetched from a prefill (none recomputed), on both decodes, and each
    # fetch moved the plan's bytes
    per_decode = [fetch_records(read_stats(c["tmp"] / f"d{i}.jsonl")[before[i]:]) for i in (0, 1)]
    new = per_decode[0] + per_decode[1]
    assert len(new) == 4 and all(r["ok"] for r in new) and all(per_decode), per_decode
    for r in new:
        n = next(len(p) for p in prompts if -(-len(p) // PAGE) == r["pages"])
        src, src_ids, dst, dst_ids = synthetic_request(LAYERS, 1, 1, n, PAGE, PAGE_BYTES)
        assert r["bytes"] == plan_request(LAYERS, 1, src, src_ids, dst, dst_ids)[(0, 0)].nbytes, r
    if mode == "mooncake":  # the decode was given the router's transfer_id and the HTTP bootstrap
        assert all(r["transfer_key"].startswith("xfer-") for r in new), new
    # no instance holds KV for these requests any more
    for p in (*c["prefill"], *c["decode"]):
        wait_for(f"{p.name} KV usage back to 0", lambda p=p: kv_cache_usage(p.url) == 0.0, 30)


SIBLING_PROMPTS = {mode: [ids(50 + 9 * i, 300 + 10 * k + i) for i in range(3)] for k, mode in enumerate(("nixl", "mooncake"))}


@pytest.mark.timeout(900)
def test_n_and_batched_prompts_through_the_router_equal_the_colocated_answers(cluster):
    """One HTTP request that vLLM fans out into several engine requests carrying one set of
    ``kv_transfer_params``: ``n=2`` with a seed, and a batch of 3 prompts (the prefill's answer
    carries the first prompt's params only). Through vLLM's router in both PD protocols each
    answer equals the colocated one, no fetch fails (the decodes run ``recompute``, so a failed
    fetch would hide behind an equal answer), and no instance keeps KV (the prefill frees the
    batch's unasked requests at ``claim_timeout_s``)."""
    c = cluster
    before = {i: len(read_stats(c["tmp"] / f"d{i}.jsonl")) for i in (0, 1)}
    for mode, prompts in SIBLING_PROMPTS.items():
        url = c["routers"][mode].url + "/v1/completions"
        sampled = {**body(c["model"], prompts[0]), "n": 2, "temperature": 1.0, "seed": 7}
        status, ref = post_json(c["prefill"][0].url + "/v1/completions", sampled, timeout_s=300)
        assert status == 200, ref
        status, out = post_json(url, sampled, timeout_s=300)
        assert status == 200, (mode, out)
        got = sorted((ch["index"], ch["token_ids"]) for ch in out["choices"])
        assert got == sorted((ch["index"], ch["token_ids"]) for ch in ref["choices"]), (mode, got)
        refs = [reference(c, p)["token_ids"] for p in prompts]
        status, out = post_json(url, {**body(c["model"], prompts[0]), "prompt": prompts}, timeout_s=300)
        assert status == 200, (mode, out)
        assert [ch["token_ids"] for ch in sorted(out["choices"], key=lambda ch: ch["index"])] == refs, mode
    new = [r for i in (0, 1) for r in fetch_records(read_stats(c["tmp"] / f"d{i}.jsonl")[before[i]:])]
    assert new and all(r["ok"] for r in new), new  # siblings never fetched a key twice
    for p in (*c["prefill"], *c["decode"]):
        wait_for(f"{p.name} KV usage back to 0", lambda p=p: kv_cache_usage(p.url) == 0.0, 60)


def verdict(status: int, out: dict, ref: list[int]) -> str:
    """"right": 200 with the reference tokens; "aborted": 200 that vLLM ended early and says
    so (``finish_reason`` "abort"), every token it gave right; else "wrong"."""
    if status != 200:
        return "wrong"
    got = out["choices"][0]
    if got["token_ids"] == ref:
        return "right"
    aborted = got["finish_reason"] == "abort" and got["token_ids"] == ref[:len(got["token_ids"])]
    return "aborted" if aborted else "wrong"


@pytest.mark.timeout(900)
def test_router_discovery_membership_under_load(cluster):
    """A decode instance joins vLLM's router while two clients keep sending, then is
    stopped (SIGTERM) and leaves. No request fails while it joins (it registers only
    once its /health answers), it fetches KV once it is in, and after it stops only
    requests the router sent it before dropping it (at most 5 s after its last
    registration; the router does not retry) may fail, each with an HTTP error or, for a
    request decode2 held at SIGTERM, as vLLM ends it: 200 with ``finish_reason`` "abort"
    and a prefix of the answer. Every other 200 is the non-disaggregated answer."""
    c = cluster
    url = c["routers"]["discovery"].url
    refs = [reference(c, p)["token_ids"] for p in LOAD_PROMPTS]
    port = free_port()
    added = vllm_server("decode2", c["model"], port, c["tmp"], role="kv_consumer", failure_policy="recompute",
                        dtype="float32", block_size=PAGE, tp=1,
                        extra_config={"transfer_timeout_s": 120.0, "stats_file": str(c["tmp"] / "d2.jsonl"),
                                      **c["joins"](port)})
    results = []  # (sent at, answered at, status, verdict: "right", "aborted" or "wrong")
    stop = threading.Event()

    def client(k: int) -> None:
        for n in itertools.count(k, 2):
            if stop.is_set():
                return
            i = n % len(LOAD_PROMPTS)
            t = time.monotonic()
            try:
                status, out = post_json(url + "/v1/completions", body(c["model"], LOAD_PROMPTS[i]), timeout_s=120)
            except OSError as e:  # the router itself must answer every request
                results.append((t, time.monotonic(), f"no answer: {e}", "wrong"))
                continue
            results.append((t, time.monotonic(), status, verdict(status, out, refs[i])))

    with ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(client, k) for k in (0, 1)]
        try:
            added.start()
            wait_all([added], 600)
            wait_for("decode2 fetching", lambda: len(fetched(c["tmp"] / "d2.jsonl")) >= 2, 120)
            t_stop = time.monotonic()
            # SIGTERM; vLLM's HTTP server then waits for its open requests, whose engine it
            # has already stopped: SIGKILL after 3 s
            added.stop(timeout_s=3)
            t_gone = time.monotonic() + 6  # dropped 5 s after its last registration at the latest
            wait_for("requests after decode2 left", lambda: sum(t > t_gone for t, *_ in results) >= 4, 120)
        finally:
            stop.set()
            added.stop()
        for f in clients:
            f.result(timeout=300)
    wrong = [r for r in results if r[2] == 200 and r[3] == "wrong"]
    assert not wrong, f"200 with a wrong answer: {wrong}"
    before = [r for r in results if r[1] < t_stop]                 # answered before the stop
    after = [r for r in results if r[0] >= t_gone]                 # sent once the router had dropped it
    window = [r for r in results if r[1] >= t_stop and r[0] < t_gone]  # around the stop: the rest
    assert before and all(v == "right" for *_, v in before), f"failed while decode2 joined: {before}"
    # SIGTERM makes vLLM end the requests its engine holds: 200, finish_reason "abort"
    assert all(v == "aborted" if s == 200 else isinstance(s, int) and s >= 400 for _, _, s, v in window
               if v != "right"), window
    assert after and all(v == "right" for *_, v in after), f"failed after decode2 left: {after}"
    failed = [r for r in window if r[3] != "right"]
    aborted = sum(r[3] == "aborted" for r in failed)
    last = max((r[0] - t_stop for r in failed), default=0)
    print(f"membership under load: {len(before)} answered while decode2 joined and served, {len(window)} around "
          f"its stop ({len(failed)} failed, {aborted} of them 200 'abort', the last sent {last:.1f} s after the "
          f"stop), {len(after)} after; decode2 fetched {len(fetched(c['tmp'] / 'd2.jsonl'))}")
    for p in c["decode"]:
        wait_for(f"{p.name} KV usage back to 0", lambda p=p: kv_cache_usage(p.url) == 0.0, 30)


FEATURES = {  # what the proxy's prefill hop used to refuse, a batch, n > 1 (issue 39)
    "min_tokens": {"prompt": ids(40, 300), "max_tokens": MAX_TOKENS, "min_tokens": 4, "temperature": 0.0},
    "batch": {"prompt": [ids(30, 301), ids(45, 302), ids(50, 303)], "max_tokens": MAX_TOKENS, "temperature": 0.0,
              "ignore_eos": True},
    "n2": {"prompt": ids(37, 304), "n": 2, "seed": 7, "temperature": 0.8, "max_tokens": MAX_TOKENS,
           "ignore_eos": True},
}


def choices(out: dict) -> list[tuple]:
    return [(c["index"], c["token_ids"], c["text"], c["finish_reason"]) for c in out["choices"]]


@pytest.mark.timeout(900)
# min_tokens and n=2 through this proxy are rows of test_openai_parity_matrix; the batch stays
# here for its streamed form and its one fetch per prompt.
@pytest.mark.parametrize("case", ["batch"])
def test_request_features(cluster, case):
    """Through ``vllm-dcp2d proxy``, equal to the colocated answer (the prefill instance
    asked directly): ``min_tokens`` above 1, a batch of 3 prompts (plain and streamed;
    split into one PD pair per prompt), ``n=2`` seeded. Every prompt's KV fetched
    from a prefill (no fetch failed or refused: a sibling refused its shared key and
    recomputed would still answer right under ``recompute``), KV usage back to 0."""
    c = cluster
    url, b = c["px_features"].url, {"model": c["model"], "return_token_ids": True, **FEATURES[case]}
    status, ref = post_json(c["prefill"][0].url + "/v1/completions", b, timeout_s=300)
    assert status == 200, ref
    before = {i: len(read_stats(c["tmp"] / f"d{i}.jsonl")) for i in (0, 1)}
    t0 = time.monotonic()
    status, out = post_json(url + "/v1/completions", b, timeout_s=300)
    took = time.monotonic() - t0
    assert status == 200, out
    assert sorted(choices(out)) == sorted(choices(ref)), (out, ref)
    assert {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: ref["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    prompts = b["prompt"] if case == "batch" else [b["prompt"]]
    if case == "batch":
        # streamed: the prompts' chunks merged, each choice's text under its index, one usage chunk
        sb = {**b, "stream": True, "stream_options": {"include_usage": True}}
        sb.pop("return_token_ids")
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(sb).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            events = [json.loads(e.removeprefix("data: ")) for e in r.read().decode().split("\n\n")
                      if e.startswith("data: {")]
        texts: dict[int, str] = {}
        for e in events:
            for ch in e["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        assert texts == {ch["index"]: ch["text"] for ch in ref["choices"]}
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # a stream's chunk omits null details
        assert events[-1]["choices"] == []
        assert [events[-1]["usage"][k] for k in counts] == [out["usage"][k] for k in counts]
        prompts = prompts * 2
        t1 = time.monotonic()
        post_json(url + "/v1/completions", {**b, "prompt": ids(45, 305)}, timeout_s=300)
        print(f"through the proxy: a batch of 3 prompts {took:.2f} s, one prompt {time.monotonic() - t1:.2f} s")
    recs = [r for i in (0, 1) for r in fetch_records(read_stats(c["tmp"] / f"d{i}.jsonl")[before[i]:])]
    assert [r for r in recs if not r["ok"]] == [], recs
    assert len({r["transfer_key"] for r in recs}) == len(prompts) + (case == "batch"), recs
    for p in (*c["prefill"], *c["decode"]):
        wait_for(f"{p.name} KV usage back to 0", lambda p=p: kv_cache_usage(p.url) == 0.0, 30)


# What a client's OpenAI call may carry (issue 39, "what passes" and "what breaks"): each case
# through each front equals the colocated answer. Prompt lengths sit on page boundaries (and a
# DCP=2 page's, 64 tokens; the DCP cluster's own boundaries are tests/e2e/test_e2e.py's).
P = {n: ids(n, 400 + n) for n in (31, 32, 33, 63, 64, 65)}
PARITY = {
    "greedy": {"prompt": P[33], "temperature": 0.0},
    "seeded": {"prompt": P[31], "temperature": 0.9, "top_p": 0.9, "seed": 11},
    "logprobs": {"prompt": P[32], "temperature": 0.0, "logprobs": 3},
    "echo_logprobs": {"prompt": P[63], "temperature": 0.0, "echo": True, "logprobs": 2},
    "prompt_logprobs": {"prompt": P[64], "temperature": 0.0, "prompt_logprobs": 2},
    "logit_bias": {"prompt": P[65], "temperature": 0.0, "logit_bias": {"100": 8.0, "200": -100.0}},
    "penalties": {"prompt": P[33], "temperature": 0.0, "presence_penalty": 0.6, "frequency_penalty": 0.4,
                  "repetition_penalty": 1.3},
    "min_tokens": {"prompt": P[64], "temperature": 0.0, "min_tokens": 4},
    "regex": {"prompt": P[32], "temperature": 0.0, "structured_outputs": {"regex": "[a-d]{2,6}"}},
    "json_object": {"prompt": P[31], "temperature": 0.0, "response_format": {"type": "json_object"}},
    "stop": {"prompt": P[63], "temperature": 0.0, "stop_token_ids": [7, 9], "ignore_eos": False},
    "stream_usage": {"prompt": P[65], "temperature": 0.0, "stream": True,
                     "stream_options": {"include_usage": True}},
    "chat": {"messages": [{"role": "user", "content": "abc def"}], "temperature": 0.0},
    "chat_stream_logprobs": {"messages": [{"role": "user", "content": "ghi"}], "temperature": 0.0, "stream": True,
                             "logprobs": True, "top_logprobs": 2},
    "n2": {"prompt": P[33], "n": 2, "temperature": 0.8, "seed": 5},
    "batch": {"prompt": [P[31], P[32], P[33]], "temperature": 0.0},
    "bad_max_tokens": {"prompt": P[31], "max_tokens": -1},
}


def _answer(url: str, body: dict) -> tuple[int, object]:
    """``(status, the answer)``: the JSON, or for a stream the events' choices merged by index
    (text, token count, logprobs) and the last usage."""
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body.get("stream"):
        return post_json(url + route, body, timeout_s=300)
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    merged: dict[int, dict] = {}
    usage = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for e in r.read().decode().split("\n\n"):
            if not e.startswith("data: {"):
                continue
            ev = json.loads(e.removeprefix("data: "))
            usage = ev.get("usage") or usage
            for ch in ev["choices"]:
                m = merged.setdefault(ch["index"], {"text": "", "logprobs": []})
                m["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if ch.get("logprobs"):
                    m["logprobs"].append(ch["logprobs"])
                m["finish_reason"] = ch.get("finish_reason") or m.get("finish_reason")
    return 200, {"choices": [{"index": i, **m} for i, m in sorted(merged.items())], "usage": usage}


def _same(a, b, path="") -> None:
    """Equal, floats within 2e-3 (a logprob computed over fetched KV rather than in the
    prompt's own forward pass may differ in the last bits); token choices exactly."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 2e-3, (path, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


VOLATILE = {"id", "created", "system_fingerprint", "kv_transfer_params", "service_tier"}


def _comparable(out):
    if not isinstance(out, dict):
        return out
    return {k: v for k, v in out.items() if k not in VOLATILE}


@pytest.mark.timeout(900)
def test_openai_parity_matrix(cluster):
    """Every field of the matrix above through ``vllm-dcp2d proxy`` and vLLM's router (NIXL
    protocol): the same status and answer as the colocated instance (the prefill asked
    directly), no fetch failed, KV usage back to 0. Where the router differs for a reason of
    its own, the case asserts what the connector guarantees and names the reason."""
    c = cluster
    fronts = {"proxy": c["px_features"].url, "router_nixl": c["routers"]["nixl"].url}
    before = {i: len(read_stats(c["tmp"] / f"d{i}.jsonl")) for i in (0, 1)}
    for case, fields in PARITY.items():
        b = {"model": c["model"], "max_tokens": MAX_TOKENS, **fields}
        if "messages" not in b and not b.get("stream"):
            b["return_token_ids"] = True
        ref_status, ref = _answer(c["prefill"][0].url, b)
        assert (ref_status == 200) == (case != "bad_max_tokens"), (case, ref_status, ref)
        for front, url in fronts.items():
            status, out = _answer(url, b)
            if ref_status != 200 and front == "router_nixl":
                # the router answers any prefill error with 500 and the upstream's text
                assert status >= 400 and "max_tokens" in json.dumps(out), (case, front, status, out)
                continue
            assert status == ref_status, (case, front, status, out)
            if front == "router_nixl" and b.get("echo"):
                # vllm-router echoes the prompt twice (its prefill hop's echo, then the decode's):
                # the answer ends with the colocated one, token for token
                got, want = out["choices"][0], ref["choices"][0]
                assert got["text"].endswith(want["text"]), (case, got["text"], want["text"])
                n = len(want["logprobs"]["tokens"])
                tail = {k: v[-n:] for k, v in got["logprobs"].items() if k != "text_offset"}
                _same({k: v for k, v in want["logprobs"].items() if k != "text_offset"}, tail, f"{case}/{front}")
                continue
            _same(_comparable(ref), _comparable(out), f"{case}/{front}")
    recs = [r for i in (0, 1) for r in fetch_records(read_stats(c["tmp"] / f"d{i}.jsonl")[before[i]:])]
    assert recs and [r for r in recs if not r["ok"]] == [], recs
    for p in (*c["prefill"], *c["decode"]):
        wait_for(f"{p.name} KV usage back to 0", lambda p=p: kv_cache_usage(p.url) == 0.0, 60)


@pytest.mark.timeout(1200)
def test_two_prefill_two_decode(cluster):
    """Our proxy; runs last: it kills decode0."""
    c = cluster
    tmp_path, model, prefill, decode = c["tmp"], c["model"], c["prefill"], c["decode"]
    px, px_nohealth, px_pipe = c["px"], c["px_nohealth"], c["px_pipe"]
    seen = {i: len(fetched(tmp_path / f"d{i}.jsonl")) for i in (0, 1)}  # what the routers' requests fetched
    failed = {i: len([r for r in fetch_records(read_stats(tmp_path / f"d{i}.jsonl")) if not r["ok"]]) for i in (0, 1)}
    ref = [reference(c, prompt) for prompt in PROMPTS]

    def check(url: str, i: int) -> None:
        status, out = post_json(url + "/v1/completions", body(model, PROMPTS[i]), timeout_s=300)
        assert status == 200 and out["choices"][0]["token_ids"] == ref[i]["token_ids"], (i, out)

    # 1. load spreads over both instances of each kind; greedy tokens equal the reference
    for i in range(4):
        check(px.url, i)
    status, text = stream_text(px.url, body(model, PROMPTS[4], stream=True))
    assert text == ref[4]["text"]
    m = scrape(px.url)
    for kind, ps in (("prefill", prefill), ("decode", decode)):  # 5 sequential calls, ties round-robin
        assert [sample(m, PREFIX + "upstream_calls_total", kind=kind, upstream=p.url) for p in ps] == [3, 2]
    assert sample(m, PREFIX + "retries_total", stage="decode") == 0
    for i in (5, 6):  # the pipelined proxy learns both prefill routes (prefill0/decode0, prefill1/decode1)
        check(px_pipe.url, i)
    # each decode instance fetched its requests' KV from a prefill (none recomputed)
    assert len(fetched(tmp_path / "d0.jsonl")) - seen[0] == 4 and len(fetched(tmp_path / "d1.jsonl")) - seen[1] == 3
    assert [len([r for r in fetch_records(read_stats(tmp_path / f"d{i}.jsonl")) if not r["ok"]]) for i in (0, 1)] == \
        [failed[0], failed[1]]

    # 2. the decode holding a request dies before its first byte: the request is retried on
    # the other, which fetches the prompt's KV itself, by the same transfer key. decode0 is
    # frozen first so the requests wait in its socket: the sequential proxy's first decode
    # call, and the pipelined proxy's third (sent with the prefill call, pipelined) go to it.
    os.killpg(decode[0].proc.pid, signal.SIGSTOP)
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(stream_text, u, body(model, PROMPTS[i], stream=True))
                for u, i in ((px_nohealth.url, 7), (px_pipe.url, 8))]
        for u in (px_nohealth.url, px_pipe.url):
            wait_for(f"{u}'s decode call to decode0", lambda: sample(
                scrape(u), PREFIX + "outstanding_requests", kind="decode", upstream=decode[0].url) == 1, 120)
        time.sleep(0.5)  # the calls' bytes reach decode0's socket
        os.killpg(decode[0].proc.pid, signal.SIGKILL)
        for f, i in zip(futs, (7, 8)):
            status, text = f.result(timeout=300)
            assert status == 200 and text == ref[i]["text"], i
    for u in (px_nohealth.url, px_pipe.url):
        m = scrape(u)
        assert sample(m, PREFIX + "retries_total", stage="decode") == 1, u
        assert sample(m, PREFIX + "errors_total", stage="decode", kind="unreachable") == 1, u
    assert len(fetched(tmp_path / "d1.jsonl")) - seen[1] == 5  # decode1 fetched both retried requests' KV

    # 3. the health poller takes decode0 out of rotation: every request goes to decode1
    wait_for("decode0 out of rotation", lambda: sample(
        scrape(px.url), PREFIX + "upstream_healthy", kind="decode", upstream=decode[0].url) == 0, 30)
    for i in (9, 10):
        check(px.url, i)
    m = scrape(px.url)
    assert sample(m, PREFIX + "upstream_calls_total", kind="decode", upstream=decode[0].url) == 3
    assert sample(m, PREFIX + "upstream_calls_total", kind="decode", upstream=decode[1].url) == 4
    assert sample(m, PREFIX + "retries_total", stage="decode") == 0

    # 4. every documented metric is served
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", m, re.M))
    assert {PREFIX + n: t for n, t, _, _ in METRICS}.items() <= types.items(), types
    assert sample(m, PREFIX + "transfer_wait_seconds_count") == 1
    assert sample(m, PREFIX + "requests_total", route="/v1/completions", status="200") == 7
