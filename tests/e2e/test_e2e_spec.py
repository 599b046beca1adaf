"""End to end with speculative decoding: a prefill ``vllm serve`` (tiny
``llama-mqa``, TP=2 = 2 CP ranks) and a decode (TP=2, DCP=2), both with the
same draft (3 tokens), through the PD proxy. Two drafts, one cluster each:

- ``draft_model``: the target as its own draft. KV layer ids: the target's
  0-3, the draft's 4-7; the decode has 2 KV cache groups (draft replicated,
  target DCP-sharded). CP rank 0 sends target layers, CP rank 1 draft layers.
- ``eagle``: a one-layer EAGLE head (layer id 4). The decode has 5 groups
  (vLLM gives each target layer its own, the same size as the draft's):
  CP rank 1 sends target layer 3 and the draft layer.

The draft's KV for the prompt is transferred, not recomputed (an EAGLE draft
needs the target's hidden states): every DCP rank gets every draft page,
target pages stay filtered per DCP rank. Checked against the plan per path,
target and draft bytes apart, and the greedy tokens against a colocated
instance without speculation or connector.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from tests.support.pd_cluster import stalled

from vllm_dcp2d.reshard.layout import cdiv, cp_layer_range
from vllm_dcp2d.local.servers import (fetch_records, free_port, post_json, proxy_server, read_stats, vllm_server,
                                        wait_all)
from tests.support.shared import SharedCluster

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

PAGE = 32
LAYERS = 4                             # tiny llama-mqa
DRAFT_LAYERS = {"draft_model": 4, "eagle": 1}
PAGE_BYTES = PAGE * 2 * 32 * 4         # 1 KV head x (K+V) x head_dim 32 x fp32
MAX_TOKENS = 12
DCP = 2


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("e2e_spec")
    return {"root": root, "model": build_tiny_model("llama-mqa", root / "model"),
            "eagle": build_tiny_model("llama-mqa-eagle", root / "eagle")}


@pytest.fixture(scope="module")
def plain(work):
    """The colocated reference: no speculation, no connector. Started here, waited for
    with the first cluster (the engines start at once)."""
    p = vllm_server("plain", work["model"], free_port(), work["root"], role="", tp=2, block_size=PAGE,
                    dtype="float32", extra_config={})
    try:
        p.start()
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module", params=["draft_model", "eagle"])
def shared(request, work, plain):
    """One PD cluster per draft kind (``tests/support/shared.py``): checked before each test,
    started again in a fresh directory if a test broke it."""
    starts = iter(range(1, 1000))
    with SharedCluster(lambda: _start(request.param, work, plain, next(starts))) as s:
        yield s


@pytest.fixture
def cluster(shared, plain):
    return {**shared.get(), "plain": plain}


@contextlib.contextmanager
def _start(kind, work, plain, n):
    model, root = work["model"], work["root"] / f"pd-{kind}-{n}"
    root.mkdir()
    stats = root / "stats.jsonl"
    spec = ("--speculative-config", json.dumps({"method": kind, "model": work["eagle"] if kind == "eagle" else model,
                                                 "num_speculative_tokens": 3}))
    prefill = vllm_server("prefill", model, free_port(), root, role="kv_producer", tp=2, block_size=PAGE,
                          dtype="float32", args=spec,
                          extra_config={"stats_file": str(stats), "bootstrap_port": free_port()})
    decode = vllm_server("decode", model, free_port(), root, role="kv_consumer", tp=2, dcp=DCP, block_size=PAGE,
                         dtype="float32", args=spec,
                         extra_config={"stats_file": str(stats), "transfer_timeout_s": 300.0})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], root)
    procs = [prefill, decode, proxy]
    try:
        for p in procs:
            p.start()
        wait_all([plain, *procs], timeout_s=600)
        yield {"kind": kind, "model": model, "stats": stats, "proxy": proxy, "decode": decode}
    finally:
        for p in procs:
            p.stop()


def _complete(url: str, model: str, prompt: list[int]) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    return post_json(url + "/v1/completions", body, timeout_s=300)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("n", [20, 3 * PAGE + 5, 5 * PAGE])
def test_draft_kv_travels_with_the_target(cluster, n):
    c = cluster
    prompt = ids(n, n)
    status, ref = _complete(c["plain"].url, c["model"], prompt)
    assert status == 200, ref
    before = len(read_stats(c["stats"]))
    status, out = _complete(c["proxy"].url, c["model"], prompt)
    recs = fetch_records(read_stats(c["stats"])[before:])
    if stalled(recs):  # a Mooncake TCP stall handled safely (issue 14): no tokens to compare
        assert status in (200, 502), out
        pytest.skip("Mooncake TCP stall (issue 14)")
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    ok = [r for r in recs if r.get("ok")]
    assert len(ok) == 2 * 2, recs  # each decode DCP rank got both CP ranks' layers
    pages = cdiv(n, PAGE)
    num_layers = LAYERS + DRAFT_LAYERS[c["kind"]]
    for r in ok:
        layers = cp_layer_range(num_layers, 2, r["cp_rank"])
        target = len([x for x in layers if x < LAYERS])  # ids >= LAYERS are the draft's
        assert r["layers"] == [layers.start, layers.stop]
        assert r["replicated_bytes"] == (len(layers) - target) * pages * PAGE_BYTES, r   # every page
        assert r["bytes"] - r["replicated_bytes"] == target * len(range(r["dcp_rank"], pages, DCP)) * PAGE_BYTES


@pytest.mark.timeout(600)
def test_a_failed_fetch_fails_the_request_and_the_decode_serves_on(cluster):
    """KV that never arrives: with two KV cache groups vLLM takes no block-level load
    errors, so the fetch's failure is reported per request (kv_load_failure_policy
    "fail": an error answer), and the decode serves the next request."""
    c = cluster
    params = {"do_remote_prefill": True, "remote_request_id": "never-prefilled",
              "remote_bootstrap_addr": "tcp://127.0.0.1:1", "remote_engine_id": "none", "transfer_timeout_s": 4.0}
    body = {"model": c["model"], "prompt": ids(50, 5), "max_tokens": 4, "temperature": 0.0,
            "kv_transfer_params": params}
    status, out = post_json(c["decode"].url + "/v1/completions", body, timeout_s=120)
    assert status >= 400, out
    prompt = ids(2 * PAGE + 3, 9)
    status, ref = _complete(c["plain"].url, c["model"], prompt)
    status2, out = _complete(c["proxy"].url, c["model"], prompt)
    assert status == status2 == 200, out
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]


def _counter(url: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shared", ["draft_model"], indirect=True)  # that cluster only
def test_the_decode_drafts_from_the_transferred_draft_kv(cluster):
    """The target as its own draft accepts nearly every draft only if the draft KV of
    the prompt is right: the decode computes none of it, it all came over the wire
    (measured with the draft layers left out of the transfer: 1 of 33 accepted)."""
    c = cluster
    names = ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total")
    before = [_counter(c["decode"].url, n) for n in names]
    prompt = ids(4 * PAGE + 7, 77)
    status, out = _complete(c["proxy"].url, c["model"], prompt)
    assert status == 200, out
    accepted, drafted = (_counter(c["decode"].url, n) - b for n, b in zip(names, before))
    # 11 tokens on decode in steps of up to 1 + 3: only the last step's surplus drafts go unused.
    assert drafted > 0 and accepted >= 0.6 * drafted, (accepted, drafted)
