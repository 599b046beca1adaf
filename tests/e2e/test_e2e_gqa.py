"""A GQA model (tiny ``llama``: 4 query heads, 2 KV heads) whose KV heads vLLM shards
over TP, through PD on real ``vllm serve`` instances that share a secret (issue 37).

Four instances: prefill at TP=2 (each TP rank holds one KV head and sends every layer
of it: ``layout.send_shard``; started without a ``cp_size``, whose default is what the
model allows) and at TP=1 (both heads), decode at TP=2 (DCP=1, a head per rank) and at
TP=1, every one with the same ``auth_secret_file``; the decodes with ``verify_kv`` and
``kv_load_failure_policy="fail"``. Every prefill x decode shape is sent the same prompts
through the PD protocol and answers the colocated text (issue 39: prefill TP != decode
TP moves a part of each page; on 274ea87 p1 -> d2 and p2 -> d1 were refused, on e478bf4
prefill TP=2 with cp_size=1 -> decode TP=2 answered wrong text with 200), over the
paths of the 3D plan, 1.0x the KV on the wire, KV usage back to 0. Then a stranger without the
secret attacks the side channel: nothing of it is read, each frame is counted.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from tests.support.pd_cluster import ids, tokens, tp_workers
from tests.support.stranger import run as stranger
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.local.servers import (extra_config, free_port, kv_cache_usage, post_json, read_stats, running,
                                        vllm_server)
from tests.support.shared import fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

PAGE = 32
MAX_TOKENS = 8
# (prefill, decode) -> what the shape gets: every one the colocated answer. Prefill TP != decode
# TP moves a part of each page (issue 39: layer x head x page; before, refused naming both).
SHAPES = {("p2", "d2"): "equal", ("p1", "d1"): "equal", ("p1", "d2"): "equal", ("p2", "d1"): "equal"}
# decode TP rank -> prefill ranks it fetches from: the ranks holding any of its heads
PATHS = {("p2", "d2"): {(0, 0), (1, 1)}, ("p1", "d1"): {(0, 0)}, ("p1", "d2"): {(0, 0), (0, 1)},
         ("p2", "d1"): {(0, 0), (1, 0)}}


@contextlib.contextmanager
def _start(work):
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama", work / "model")
    mha = build_tiny_model("llama-mha", work / "mha")  # 4 KV heads for 4 query heads
    secret = work / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    stats = work / "stats.jsonl"
    # fork, whatever the suite's default (test_forked_tp_workers_run_on_their_own_cores)
    common = {"stats_file": str(stats), "auth_secret_file": str(secret), "cpu_start_method": "fork"}
    kw = dict(block_size=PAGE, dtype="float32", max_model_len=512)

    def prefill(name, tp, model=model):
        return vllm_server(name, model, free_port(), work, role="kv_producer", tp=tp, engine_id=name,
                           extra_config={**common, "bootstrap_port": free_port(), "send_timeout_s": 60.0,
                                         "claim_timeout_s": 20.0}, **kw)

    def decode(name, tp, model=model):
        return vllm_server(name, model, free_port(), work, role="kv_consumer", tp=tp, failure_policy="fail",
                           extra_config={**common, "verify_kv": True, "transfer_timeout_s": 30.0}, **kw)

    procs = [prefill("p2", 2), prefill("p1", 1), decode("d2", 2), decode("d1", 1),
             prefill("m1", 1, mha), decode("md2", 2, mha)]
    with running(procs, 900) as p:
        yield {"model": model, "mha": mha, "stats": stats, **p}


shared, cluster = fixtures("gqa", _start)


def bootstrap(c, name: str) -> str:
    return f"tcp://127.0.0.1:{extra_config(c[name])['bootstrap_port']}"


def complete(url: str, model: str, prompt, **extra) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return post_json(url + "/v1/completions", body, timeout_s=300)


def pd(c, prefill: str, decode: str, prompt, model: str = "model") -> tuple[int, dict]:
    """The PD protocol by hand (what the proxy and vLLM's router do): a one-token
    prefill, then the decode with the prefill's kv_transfer_params."""
    status, pre = complete(c[prefill].url, c[model], prompt, max_tokens=1,
                           kv_transfer_params={"do_remote_decode": True})
    assert status == 200, pre
    return complete(c[decode].url, c[model], prompt, kv_transfer_params=pre["kv_transfer_params"])


def usage_back_to_zero(c, names, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for name in names:
        while kv_cache_usage(c[name].url) != 0.0:
            assert time.monotonic() < deadline, f"{name} still holds KV blocks"
            time.sleep(0.2)


@pytest.mark.timeout(1200)
def test_forked_tp_workers_run_on_their_own_cores(cluster):
    """``cpu_start_method="fork"``: the instances' TP workers are forked, and the thread of
    each that runs the model is bound to the core VLLM_CPU_OMP_THREADS_BIND="0|1" gives it,
    as a spawned one binds itself (``vllm_compat/startup.py``: ``bind_forked_worker``;
    unbound, two workers on two cores answered 10x slower; test_e2e.py checks spawned ones)."""
    cores = os.cpu_count() or 1
    for name in ("p2", "d2", "md2"):
        assert "cpu_start_method 'fork'" in cluster[name].log_path.read_text(errors="replace"), name
        assert tp_workers(cluster[name]) == [({0}, False), ({1 % cores}, False)], name


def test_every_shape_answers_the_colocated_text_or_refuses(cluster):
    c = cluster
    sent = {}
    for k, ((p, d), want) in enumerate(SHAPES.items()):
        # prompts of their own per shape: no page is in a decode's prefix cache, so every path
        # moves every page and the bytes compare across shapes
        prompts = {"short": ids(20, 71 + 2 * k), "pages": ids(3 * PAGE + 5, 72 + 2 * k)}
        refs = {}
        for name, prompt in prompts.items():
            status, out = complete(c["p1"].url, c["model"], prompt)
            assert status == 200, out
            refs[name] = tokens(out)
        for name, prompt in prompts.items():
            before = len(read_stats(c["stats"]))
            status, out = pd(c, p, d, prompt)
            recs = [r for r in read_stats(c["stats"])[before:] if r.get("side") == "consumer" and "ok" in r]
            if want == "equal":
                assert status == 200 and tokens(out) == refs[name], (p, d, name, status, out)
                assert recs and all(r["ok"] for r in recs)
                # each decode rank fetched from the prefill ranks holding its heads, one path each
                assert sorted((r["cp_rank"], r["tp_rank"]) for r in recs) == sorted(PATHS[(p, d)]), recs
                # 1.0x the KV on the wire whatever the split: the same bytes in every shape
                sent.setdefault(name, sum(r["bytes"] for r in recs))
                assert sum(r["bytes"] for r in recs) == sent[name], (p, d, name, recs)
            else:
                assert status != 200, (p, d, name, "a shape the plugin cannot serve answered", out)
                assert any("KV heads differ" in r.get("reason", "") for r in recs), recs
    usage_back_to_zero(c, ["p2", "p1", "d2", "d1"])
    # the GQA prefill TP=2 started without a cp_size: the default is what the model allows
    assert "cp_size 1 (2 KV heads sharded over tensor_parallel_size=2" in c["p2"].log_path.read_text()


@pytest.mark.timeout(600)
def test_an_mha_model_from_prefill_tp1_to_decode_tp2(cluster):
    """MHA (4 KV heads for 4 query heads): the prefill's one rank holds every head, each
    decode TP rank two of them, so each decode rank fetches half of every page; the
    colocated answer, the two paths of the plan, 1.0x the KV, KV usage back to 0."""
    c = cluster
    for k, n in enumerate((PAGE - 1, 3 * PAGE + 5)):
        prompt = ids(n, 90 + k)
        status, ref = complete(c["m1"].url, c["mha"], prompt)
        assert status == 200, ref
        before = len(read_stats(c["stats"]))
        status, out = pd(c, "m1", "md2", prompt, model="mha")
        assert status == 200 and tokens(out) == tokens(ref), (n, status, out)
        recs = [r for r in read_stats(c["stats"])[before:] if r.get("side") == "consumer" and "ok" in r]
        assert sorted((r["cp_rank"], r["tp_rank"]) for r in recs) == [(0, 0), (0, 1)] and all(r["ok"] for r in recs)
        # 4 layers x 2 of the 4 heads x K and V x 32 x fp32 per token, per decode rank
        assert [r["bytes"] for r in recs] == [4 * 2 * 2 * 32 * 4 * PAGE * -(-n // PAGE)] * 2, recs
    usage_back_to_zero(c, ["m1", "md2"])


@pytest.mark.timeout(600)
def test_a_stranger_without_the_secret_is_not_read(cluster):
    """The hostile-peer suite with a secret (issue 37, item 7): the stranger's
    registration, over-long message, oversized frame and flood reach a prefill whose
    every frame must be sealed: the bootstrap answers each with a plain refusal and acts
    on none, the ranks are never found (no table for the stranger), and the prefill
    counts what it dropped on /metrics. A request sent straight to a decode naming the
    stranger's own bootstrap fails at once (its rank table is not authenticated, so no
    request, memory map or session goes to the stranger) and frees its blocks."""
    c = cluster
    got = stranger("all", bootstrap(c, "p2"))
    assert got["register"]["reply"].startswith("Reply: refused: an unauthenticated frame")
    assert got["register"]["before"] is None and got["long"]["bootstrap"].startswith("Reply: refused:")
    assert got["big"] == {} and got["flood"] == {"table": None}
    with BootstrapServer() as fake:  # a stranger's own bootstrap, no secret
        params = {"do_remote_prefill": True, "remote_request_id": "x", "remote_bootstrap_addr": fake.address,
                  "remote_engine_id": "stranger"}
        t0 = time.monotonic()
        status, out = complete(c["d2"].url, c["model"], ids(40, 73), kv_transfer_params=params)
        assert status != 200 and time.monotonic() - t0 < 20, (status, out)
    prompt = ids(2 * PAGE, 74)
    _, ref = complete(c["p1"].url, c["model"], prompt)
    status, out = pd(c, "p2", "d2", prompt)
    assert status == 200 and tokens(out) == tokens(ref)
    usage_back_to_zero(c, ["p2", "d2"])
    # connector metrics reach /metrics with the engine's next step (this request's)
    deadline = time.monotonic() + 20
    while (dropped := metric(c["p2"].url, "vllm:dcp2d_unauthenticated_messages_total")) < 2:
        assert time.monotonic() < deadline, f"the prefill counted {dropped} unauthenticated messages"
        time.sleep(0.5)


def metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sum(float(x.rsplit(" ", 1)[1]) for x in r.read().decode().splitlines() if x.startswith(name))
