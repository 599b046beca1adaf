"""End to end on CPU: prefill and decode ``vllm serve`` instances with the PD proxy.

One prefill instance (tiny ``llama-mqa``, TP=2 = 2 layer-split CP ranks) serves
two decode instances at once: ``decode`` (TP=2, DCP=2) and
``decode1`` (TP=2, DCP=1: the one KV head is replicated, so both TP ranks fetch
all pages; ``kv_load_failure_policy="recompute"``), each behind
its own proxy. The prefill instance itself, asked without ``kv_transfer_params``,
is the non-disaggregated reference. All on loopback, started once per module
(~1 min on 2 cores) and always killed.
"""

from __future__ import annotations

import json
import time

import pytest

from vllm_dcp2d.connector.plan import plan_request
from vllm_dcp2d.demo import free_port, post_json, proxy_server, read_stats, vllm_server, wait_all
from vllm_dcp2d.layout import cdiv
from vllm_dcp2d.report import synthetic_request

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

PAGE = 32
LAYERS = 4                # tiny llama-mqa
# float32: the DCP=2 attention path computes in fp32 and matches the stock kernel
# token for token only when the model runs in fp32 (bf16 rounding differs).
DTYPE = "float32"
PAGE_BYTES = PAGE * 2 * 32 * 4  # 1 KV head x (K+V) x head_dim 32 x fp32, per token per layer
MAX_TOKENS = 12
EXPIRY_S = 4.0
DCP = 2


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


def prompts(salt: int = 0) -> dict[str, list[int]]:
    """``salt`` gives another set, for a decode instance that has cached the first."""
    s = 10 * salt
    return {
        "short": ids(20, 1 + s),                                 # shorter than a page
        "pages": ids(3 * PAGE + 5, 2 + s),                       # spans 4 pages, last one partial
        "prefix": ids(3 * PAGE + 5, 2 + s)[:2 * PAGE] + ids(40, 3 + s),  # shares 2 pages with "pages"
    }


PROMPTS = prompts()
FIRST_PAGE = {"short": 0, "pages": 0, "prefix": 2}   # pages the decode instance has cached


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from vllm_dcp2d.testing.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model("llama-mqa", work / "model")
    stats = work / "stats.jsonl"
    common = {"stats_file": str(stats)}
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, block_size=PAGE, dtype=DTYPE,
                          extra_config={**common, "bootstrap_port": free_port(), "send_timeout_s": 600.0})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=DCP, dtype=DTYPE,
                         block_size=PAGE, extra_config={**common, "transfer_timeout_s": 300.0,
                                                        "prefill_wait_s": 120.0})
    decode1 = vllm_server("decode1", model, free_port(), work, role="kv_consumer", tp=2, block_size=PAGE, dtype=DTYPE,
                          failure_policy="recompute",
                          extra_config={**common, "transfer_timeout_s": 300.0, "prefill_wait_s": 120.0})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, "proxy")
    proxy1 = proxy_server(free_port(), [prefill.url], [decode1.url], work, "proxy1")
    proxyp = proxy_server(free_port(), [prefill.url], [decode.url], work, "proxyp", pipelined=True)
    procs = [prefill, decode, decode1, proxy, proxy1, proxyp]
    try:
        for p in procs:
            p.start()
        wait_all(procs, 900)
        yield {"model": model, "stats": stats, "prefill": prefill, "decode": decode, "decode1": decode1,
               "proxy": proxy, "proxy1": proxy1, "proxyp": proxyp}
    finally:
        for p in reversed(procs):
            p.stop()


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


def expected_bytes(n_tokens: int, dcp: int, first_page: int) -> dict[tuple[int, int], int]:
    """The plan's bytes per (cp_rank, dcp_rank) path for one request."""
    src, src_ids, dst, dst_ids = synthetic_request(LAYERS, 2, dcp, n_tokens, PAGE, PAGE_BYTES)
    plans = plan_request(LAYERS, 2, src, src_ids, dst, dst_ids, first_page=first_page)
    return {k: d.nbytes for k, d in plans.items()}


def check_paths(recs: list[dict], n_tokens: int, dcp: int, tp: int, first_page: int) -> None:
    ok = [r for r in recs if r.get("ok")]
    # every decode TP rank got one outcome from each of the 2 CP ranks
    assert len(ok) == 2 * tp, recs
    want = expected_bytes(n_tokens, dcp, first_page)
    for r in ok:
        assert r["dcp_size"] == dcp and r["cp_size"] == 2 and r["pages"] == cdiv(n_tokens, PAGE)
        assert r["bytes"] == want[(r["cp_rank"], r["dcp_rank"])], (r, want)
        assert r["layers"] == [[0, 2], [2, 4]][r["cp_rank"]]  # CP rank r sends only its layers
    got = {}
    for r in ok:
        got[(r["cp_rank"], r["dcp_rank"])] = r["bytes"]
    assert got == want


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("which,tp,dcp,salt", [("proxy", 2, DCP, 0), ("proxy1", 2, 1, 0), ("proxyp", 2, DCP, 1)])
def test_proxy(cluster, which, tp, dcp, salt):
    """Every prompt through the proxy: the bytes of every (cp_rank, dcp_rank) path equal
    the plan's, and the greedy tokens equal the non-disaggregated instance's. ``proxyp``
    is ``--pipelined``: after the first request it sends prefill and decode at once."""
    c = cluster
    for name, prompt in prompts(salt).items():
        ref = complete(c["prefill"].url, c["model"], prompt)
        before = len(read_stats(c["stats"]))
        out = complete(c[which].url, c["model"], prompt)
        recs = [r for r in read_stats(c["stats"])[before:] if r["side"] == "consumer"]
        check_paths(recs, len(prompt), dcp, tp, FIRST_PAGE[name])
        assert tokens(out) == tokens(ref), name


@pytest.mark.timeout(600)
def test_streaming(cluster):
    import json
    import urllib.request

    c = cluster
    prompt = PROMPTS["pages"]
    ref = complete(c["prefill"].url, c["model"], prompt)
    body = {"model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(c["proxy1"].url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == ref["choices"][0]["text"]


@pytest.mark.timeout(600)
def test_decode_expiry_recomputes(cluster):
    """KV that never arrives: after its transfer_timeout_s the fetch expires, its blocks
    are reported as load errors and decode1 (policy "recompute") prefills locally."""
    c = cluster
    prompt = ids(2 * PAGE + 3, 9)
    ref = complete(c["prefill"].url, c["model"], prompt)
    # the producer holds an unknown request for prefill_wait_s (120 s): only the
    # request's own transfer_timeout_s can end this fetch
    params = {"do_remote_prefill": True, "remote_request_id": "never-prefilled",
              "remote_bootstrap_addr": bootstrap_addr(c), "remote_engine_id": "none",
              "transfer_timeout_s": EXPIRY_S}
    t0 = time.monotonic()
    out = complete(c["decode1"].url, c["model"], prompt, kv_transfer_params=params)
    elapsed = time.monotonic() - t0
    assert tokens(out) == tokens(ref)
    assert elapsed >= EXPIRY_S
    recs = [r for r in read_stats(c["stats"]) if r.get("request_id") == "never-prefilled"]
    assert recs and recs[-1]["ok"] is False and recs[-1]["expired"] is True
    # the instance keeps serving, blocks were freed: a normal request still works
    out = complete(c["proxy1"].url, c["model"], PROMPTS["short"])
    assert tokens(out) == tokens(complete(c["prefill"].url, c["model"], PROMPTS["short"]))


def bootstrap_addr(c) -> str:
    boot = [a for a in c["prefill"].cmd if "bootstrap_port" in a][0]
    port = json.loads(boot)["kv_connector_extra_config"]["bootstrap_port"]
    return f"tcp://127.0.0.1:{port}"


def waiting_requests(url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_waiting"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(600)
def test_layers_sent_while_prefill_runs(cluster):
    """Layer pipelining: the decode instance asks first (by transfer_id); each prefill
    CP rank then writes every one of its layers from save_kv_layer, while the prefill's
    forward runs, and the answer after it adds nothing. Same tokens, same bytes."""
    import threading

    c = cluster
    prompt = ids(2 * PAGE + 9, 11)
    ref = complete(c["prefill"].url, c["model"], prompt)
    tid = "pipelined-e2e"
    params = {"do_remote_prefill": True, "remote_request_id": tid, "transfer_id": tid,
              "remote_bootstrap_addr": bootstrap_addr(c), "remote_engine_id": "prefill"}
    got = {}
    t = threading.Thread(target=lambda: got.update(out=complete(c["decode"].url, c["model"], prompt,
                                                                kv_transfer_params=params)))
    t.start()
    deadline = time.monotonic() + 60
    while waiting_requests(c["decode"].url) < 1:  # admitted, its fetch on the way
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.2)
    time.sleep(2.0)  # the fetch reaches the prefill ranks (milliseconds on loopback)
    pre = complete(c["prefill"].url, c["model"], prompt, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    assert pre["kv_transfer_params"]["remote_request_id"] == tid
    t.join(300)
    assert tokens(got["out"]) == tokens(ref)
    recs = [r for r in read_stats(c["stats"]) if r.get("request_id") == tid and r["side"] == "consumer"]
    check_paths(recs, len(prompt), DCP, 2, 0)
    assert [r["early_layers"] for r in recs] == [2] * 4, recs  # every layer of every path, early
