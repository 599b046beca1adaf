"""End to end on CPU: prefill and decode ``vllm serve`` instances with the PD proxy.

One prefill instance (tiny ``llama-mqa``, TP=2 = 2 layer-split CP ranks) serves
two decode instances at once: ``decode`` (TP=2, DCP=2) and
``decode1`` (TP=2, DCP=1: the one KV head is replicated, so both TP ranks fetch
all pages; ``kv_load_failure_policy="recompute"``), each behind
its own proxy. The prefill instance itself, asked without ``kv_transfer_params``,
is the non-disaggregated reference (``support/pd_cluster.py``). Started once per module
(~1 min on 2 cores) and always killed.

Every instance runs on its own host where network namespaces can be made (root,
``ip``; ``tests/support/netns.py``), in a /24 of 198.18.0.0/15 no interface
uses: prefill at .10, decode (DCP=2) at .11, decode1 (DCP=1) at .12, the proxies at
.13, joined by a bridge; the test talks to them from the bridge, .1. Nothing is reachable over another host's
loopback, so every address that travels (``remote_bootstrap_addr`` in
``kv_transfer_params``, the CP ranks' side channels in the rank table, Mooncake
session ids) must be the host's own. Elsewhere the cluster runs on loopback and the
multi-host checks (``test_*_across_hosts``, ``test_addresses_are_the_hosts``) skip
with the reason. Loopback stays covered by the other cluster suites (load and
faults, the proxy over four instances, speculative decoding, MLA).
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from tests.support.pd_cluster import (DCP, EXPIRY_S, LONG, MAX_TOKENS, PAGE, PROMPTS, bootstrap_addr, check_paths, check_proxy,
                         complete, expected_bytes, ids, kv_capacity, pd_cluster, prompts, stalled, tokens,
                         tp_workers)

from tests.support.stranger import run as stranger
from vllm_dcp2d.transfer import bootstrap as bs
from vllm_dcp2d.transfer.messages import QueryRanks, RankTable
from vllm_dcp2d.local.servers import START_METHOD_ENV, fetch_records, kv_cache_usage, post_json, read_stats
from tests.support.netns import Hosts, unavailable
from tests.support.shared import fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

WHY_NOT_HOSTS = unavailable()  # None where network namespaces can be made
HOSTS = ["prefill", "decode", "decode1", "proxy"]
SPAWNED = ("prefill", "decode")


@contextlib.contextmanager
def _start(work):
    # The prefill and the DCP=2 decode start their workers as vLLM does on CPU, spawned, the
    # connector's default (cpu_start_method); decode1 and the suite's other clusters fork them
    # (conftest.py), one vLLM import fewer per worker.
    if WHY_NOT_HOSTS:
        with pd_cluster(work, spawned=SPAWNED) as c:
            yield c
        return
    with Hosts(HOSTS) as hosts:
        def place(name):
            return hosts[name].addr, hosts[name].netns

        with pd_cluster(work, place, spawned=SPAWNED) as c:
            yield {**c, "hosts": hosts}


# one cluster for the module's tests, checked before each and started again if a test broke
# it (tests/support/shared.py)
shared, cluster = fixtures("e2e", lambda work: _start(work))


@pytest.fixture
def across_hosts(cluster):
    """The cluster, for a check that needs every instance on its own host."""
    if WHY_NOT_HOSTS:
        pytest.skip(f"multi-host checks need network namespaces: {WHY_NOT_HOSTS}")
    return cluster


@pytest.mark.timeout(1200)
def test_each_tp_worker_runs_on_its_own_core(cluster):
    """VLLM_CPU_OMP_THREADS_BIND="0|1" (``local/servers.py``): the thread of each TP worker of a
    TP=2 instance that runs the model, on its own core. The prefill's and the decode's workers
    are spawned, as vLLM does on CPU; decode1's are forked where the suite forks
    (``cpu_start_method``; test_e2e_gqa.py checks the same of a forked cluster)."""
    cores = os.cpu_count() or 1
    for name in SPAWNED:
        assert "cpu_start_method 'fork'" not in cluster[name].log_path.read_text(errors="replace")
        assert tp_workers(cluster[name]) == [({0}, True), ({1 % cores}, True)], name
    if os.environ.get(START_METHOD_ENV) == "fork":  # decode1 as the suite asks (conftest.py)
        assert tp_workers(cluster["decode1"]) == [({0}, False), ({1 % cores}, False)]


@pytest.mark.parametrize("which,tp,dcp,salt", [("proxy", 2, DCP, 0), ("proxy1", 2, 1, 0), ("proxyp", 2, DCP, 1)])
def test_proxy(cluster, which, tp, dcp, salt):
    """Every prompt through the proxy: the bytes of every (cp_rank, dcp_rank) path equal
    the plan's, and the greedy tokens equal the non-disaggregated instance's. ``proxyp``
    is ``--pipelined``: after the first request it sends prefill and decode at once."""
    check_proxy(cluster, which, tp, dcp, salt)


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
def test_a_request_too_long_for_one_decode_rank(cluster):
    """The capacity win the design exists for. Both decodes have the same KV memory per rank
    (``DECODE_KV_BYTES``): a request of ``LONG`` tokens does not fit decode1 (DCP=1), which
    refuses it (vLLM cannot start it for requests longer than its memory holds), and fits
    decode (DCP=2, half its pages on each rank), which answers it through PD with the
    colocated answer, every path moving the plan's bytes. The refused request's prefill
    blocks are released at once, well before ``claim_timeout_s`` (30 s): vLLM's front end
    hands decode1's connector a one-token stand-in of the refused request, whose release
    names the prefill's count (it used to be ignored as a reused key and to hold the
    blocks for ``send_timeout_s``, 600 s here)."""
    c = cluster
    prompt = ids(LONG, 41)
    assert kv_capacity(c["decode1"]) < LONG + MAX_TOKENS <= kv_capacity(c["decode"]), \
        (kv_capacity(c["decode1"]), kv_capacity(c["decode"]))
    ref = complete(c["prefill"].url, c["model"], prompt)
    status, out = post_json(c["proxy1"].url + "/v1/completions",
                            {"model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0},
                            timeout_s=300)
    assert status == 400 and "maximum context length is 1024" in str(out), (status, out)
    refused = time.monotonic()
    while kv_cache_usage(c["prefill"].url) != 0.0:
        assert time.monotonic() - refused < 15, "the prefill still holds the refused request's blocks"
        time.sleep(0.2)
    before = len(read_stats(c["stats"]))
    got = complete(c["proxy"].url, c["model"], prompt)
    assert tokens(got) == tokens(ref)
    recs = fetch_records(read_stats(c["stats"])[before:])
    check_paths(recs, LONG, DCP, 2, 0)


def proxy_health(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.timeout(900)
def test_one_proxy_routes_by_decode_group_and_session(cluster):
    """``proxyr``, one proxy over both decodes (routing, ``proxy/routing.py``), learns each one's
    DCP size and lengths from its ``/metrics``. A request of ``LONG`` tokens, which only the DCP=2
    decode holds, is answered there (least-in-flight balancing sent every other one to decode1,
    which answered 400); a short one goes to decode1 (DCP=1, the cheaper step); one no decode
    admits gets the proxy's 400 naming 2,048 tokens. An agent session's 3 turns (500 tokens, each
    turn adding the answer and 60 new tokens) all go to one decode, and each later turn moves at
    most its new pages plus two pages per path (the decode's prefix cache holds the rest).
    Every answer equals the prefill's own."""
    c = cluster
    url = c["proxyr"].url
    deadline = time.monotonic() + 60
    while not all("info" in u for u in proxy_health(url)["upstreams"] if u["kind"] == "decode"):
        assert time.monotonic() < deadline, proxy_health(url)
        time.sleep(0.2)

    def through(prompt: list[int]) -> tuple[dict, list[dict]]:
        ref = complete(c["prefill"].url, c["model"], prompt)
        before = len(read_stats(c["stats"]))
        out = complete(url, c["model"], prompt)
        assert tokens(out) == tokens(ref)
        return out, [r for r in fetch_records(read_stats(c["stats"])[before:]) if r["ok"]]

    _, recs = through(ids(LONG, 467))
    assert {r["dcp_size"] for r in recs} == {DCP}
    check_paths(recs, LONG, DCP, 2, 0)
    _, recs = through(ids(200, 477))
    assert {r["dcp_size"] for r in recs} == {1}
    status, out = post_json(url + "/v1/completions", {"model": c["model"], "prompt": ids(2100, 487),
                                                      "max_tokens": MAX_TOKENS}, timeout_s=60)
    assert status == 400 and "longest context served is 2048 tokens" in out["error"]["message"], out

    prompt, moved = ids(500, 457), []
    for turn in range(3):
        out, recs = through(prompt)
        dcp = {r["dcp_size"] for r in recs}
        assert len(dcp) == 1 and len(recs) == 4, recs  # 2 CP ranks x 2 decode TP ranks, one decode
        moved.append((dcp.pop(), len(prompt), sum(r["bytes"] for r in recs)))
        assert moved[-1][0] == moved[0][0], moved  # the session's decode
        if turn == 0:
            check_paths(recs, len(prompt), moved[0][0], 2, 0)
        else:
            bound = expected_bytes(len(prompt), moved[-1][0], max(moved[-2][1] // PAGE - 2, 0))
            assert all(r["bytes"] <= bound[(r["cp_rank"], r["dcp_rank"])] for r in recs), (recs, bound)
        prompt = prompt + tokens(out) + ids(60, 458 + turn)
    print("session turns (DCP size, prompt tokens, bytes moved):", moved)
    assert len({d for d, _, _ in moved}) == 1 and all(b < moved[0][2] for _, _, b in moved[1:]), moved


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
              "remote_bootstrap_addr": bootstrap_addr(c), "remote_engine_id": "prefill",
              "transfer_timeout_s": EXPIRY_S}
    t0 = time.monotonic()
    out = complete(c["decode1"].url, c["model"], prompt, kv_transfer_params=params)
    elapsed = time.monotonic() - t0
    assert tokens(out) == tokens(ref)
    assert elapsed >= EXPIRY_S
    recs = [r for r in fetch_records(read_stats(c["stats"])) if r.get("transfer_key") == "never-prefilled"]
    assert recs and recs[-1]["ok"] is False and recs[-1]["expired"] is True
    # the instance keeps serving, blocks were freed: a normal request still works
    out = complete(c["proxy1"].url, c["model"], PROMPTS["short"])
    assert tokens(out) == tokens(complete(c["prefill"].url, c["model"], PROMPTS["short"]))


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
    transfer_key = "pipelined-e2e"
    params = {"do_remote_prefill": True, "remote_request_id": transfer_key, "transfer_id": transfer_key,
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
                   kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_key})
    assert pre["kv_transfer_params"]["remote_request_id"] == transfer_key
    t.join(300)
    assert tokens(got["out"]) == tokens(ref)
    recs = [r for r in fetch_records(read_stats(c["stats"])) if r.get("transfer_key") == transfer_key]
    check_paths(recs, len(prompt), DCP, 2, 0)
    assert [r["early_layers"] for r in recs] == [2] * 4, recs  # every layer of every path, early


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` of ``url``: (sample name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def path_deltas(before: dict, after: dict, name: str) -> dict[tuple[str, str, str], float]:
    """Growth of per-path sample ``name``: (cp_rank, dcp_rank, dcp_size) -> delta, where it grew."""
    out = {}
    for (n, labels), v in after.items():
        if n == name and (d := v - before.get((n, labels), 0.0)):
            lab = dict(labels)
            out[(lab["cp_rank"], lab["dcp_rank"], lab["dcp_size"])] = d
    return out


@pytest.mark.timeout(1200)  # run alone, it pays the cluster's start-up (minutes on a loaded machine)
def test_metrics(cluster):
    """Both instances' live ``/metrics`` carry the documented metrics (``prom.METRICS``):
    after one request through the proxy, the decode's (DCP=2) per-path figures grew on
    exactly the plan's (cp_rank, dcp_rank) paths, each by the plan's bytes, one
    transfer and one write observation whose seconds equal the stats file's. vLLM feeds
    Prometheus after each engine step (not per log interval): wait with a timeout."""
    from vllm_dcp2d.connector.prom import METRICS, exposed_names

    c = cluster
    for salt in (70, 71):  # a second prompt if the first hit the known Mooncake stall (issue 14)
        prompt = ids(3 * PAGE + 5, salt)  # not cached by the decode: every page is fetched
        before, n_recs = scrape(c["decode"].url), len(read_stats(c["stats"]))
        p_before, t_sent = scrape(c["prefill"].url), time.monotonic()
        body = {"model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        status, out = post_json(c["proxy"].url + "/v1/completions", body, timeout_s=300)
        recs = [r for r in read_stats(c["stats"])[n_recs:] if r["side"] == "consumer" and r.get("ok")]
        if not stalled(read_stats(c["stats"])[n_recs:]):
            break
    assert status == 200, out
    want = {(str(r), str(d), str(DCP)): b for (r, d), b in expected_bytes(len(prompt), DCP, 0).items()}
    assert len(want) == 4 and len(recs) == 4
    deadline = time.monotonic() + 30
    while path_deltas(before, after := scrape(c["decode"].url), "vllm:dcp2d_path_transfers_total") != \
            dict.fromkeys(want, 1.0):
        assert time.monotonic() < deadline, path_deltas(before, after, "vllm:dcp2d_path_transfers_total")
        time.sleep(0.5)
    assert path_deltas(before, after, "vllm:dcp2d_path_bytes_total") == want
    assert path_deltas(before, after, "vllm:dcp2d_path_write_seconds_count") == dict.fromkeys(want, 1.0)
    assert path_deltas(before, after, "vllm:dcp2d_path_replicated_bytes_total") == {}  # no draft
    assert set(path_deltas(before, after, "vllm:dcp2d_path_descriptors_total")) == set(want)
    secs = {(str(r["cp_rank"]), str(r["dcp_rank"]), str(DCP)): r["seconds"] for r in recs}
    got = path_deltas(before, after, "vllm:dcp2d_path_write_seconds_sum")
    assert set(got) <= set(want) and all(got.get(k, 0.0) == pytest.approx(s) for k, s in secs.items())
    # the stage histograms (issue 29): one fetch per decode rank, the stats file's seconds
    inst = tuple(sorted({"engine": "0", "model_name": c["model"]}.items()))
    per_rank = {r["dcp_rank"]: (r["fetch_seconds"], r["reported_after_seconds"]) for r in recs}
    assert len(per_rank) == DCP
    for i, name in enumerate(("vllm:dcp2d_fetch_seconds", "vllm:dcp2d_fetch_reported_after_seconds")):
        assert after[(name + "_count", inst)] - before[(name + "_count", inst)] == DCP, name
        assert after[(name + "_sum", inst)] - before[(name + "_sum", inst)] == \
            pytest.approx(sum(v[i] for v in per_rank.values()), abs=1e-9), name
    # the prefill's hold (issue 29): each of its 2 CP ranks observes the request once the decode
    # was served, for at most the time since it was sent
    held = ("vllm:dcp2d_send_held_seconds_count", inst)
    while (p_after := scrape(c["prefill"].url))[held] - p_before[held] < 2:
        assert time.monotonic() < deadline + 30, "the prefill never observed how long it held the request"
        time.sleep(0.5)
    held_s = p_after[("vllm:dcp2d_send_held_seconds_sum", inst)] - p_before[("vllm:dcp2d_send_held_seconds_sum", inst)]
    # (more than 2 only if a first prompt stalled: its hold may end after this prompt's start)
    assert p_after[held] - p_before[held] >= 2 and held_s > 0, held_s
    assert p_after[held] - p_before[held] > 2 or held_s <= 2 * (time.monotonic() - t_sent), held_s
    # and the prefill's per-request line in the stats file: one per CP rank, served ("done")
    key = recs[0]["transfer_key"]
    mine = [r for r in read_stats(c["stats"]) if r["side"] == "producer" and r.get("transfer_key") == key]
    assert sorted((r["cp_rank"], r["event"]) for r in mine) == [(0, "done"), (1, "done")], mine
    assert all(0 < r["held_seconds"] <= time.monotonic() - t_sent for r in mine), mine
    # each CP rank's handover (request_finished -> its senders), in the histogram and the lines
    assert all(0 <= r["handover_seconds"] < r["held_seconds"] + 1 for r in mine), mine
    hand = ("vllm:dcp2d_send_handover_seconds_count", inst)
    assert p_after[hand] - p_before[hand] >= 2
    # the decode scheduler's stages: admit, resume, first step, once for the request, as its line says
    while not (first := [r for r in read_stats(c["stats"]) if r.get("event") == "first_step"
                         and r.get("transfer_key") == key]):
        assert time.monotonic() < deadline + 30, "the decode scheduler wrote no first_step line"
        time.sleep(0.5)
    (first,) = first
    stages = ("admit", "resume", "first_step")
    while (d_after := scrape(c["decode"].url))[("vllm:dcp2d_decode_first_step_seconds_count", inst)] == \
            before[("vllm:dcp2d_decode_first_step_seconds_count", inst)]:
        assert time.monotonic() < deadline + 30, "the decode's first step never reached /metrics"
        time.sleep(0.5)
    for stage in stages:
        name = f"vllm:dcp2d_decode_{stage}_seconds"
        assert d_after[(name + "_count", inst)] - before[(name + "_count", inst)] == 1, name
        assert d_after[(name + "_sum", inst)] - before[(name + "_sum", inst)] == \
            pytest.approx(first[f"{stage}_seconds"], abs=1e-9), name
        assert 0 <= first[f"{stage}_seconds"] <= time.monotonic() - t_sent, first
    for name in ("failed_fetches", "expired_requests", "quarantined_blocks"):  # a clean fetch failed nothing
        key = (f"vllm:dcp2d_{name}_total", tuple(sorted({"engine": "0", "model_name": c["model"]}.items())))
        assert after[key] == before[key], name
    # every path series of this DCP=2 instance lies in the 2 x 2 matrix
    assert {k for k in path_deltas({}, after, "vllm:dcp2d_path_bytes_total")} == set(want)

    model = {("engine", "0"), ("model_name", c["model"])}
    for name, url in (("decode", c["decode"].url), ("prefill", c["prefill"].url)):
        got = scrape(url) if name == "prefill" else after
        names = {n for n, labels in got if n.startswith("vllm:dcp2d_") and model <= set(labels)}
        for m in METRICS:
            present = set(exposed_names(m)) <= names
            # the paths are recorded where KV arrives: the decode (docs/metrics.md)
            assert present == (not m.per_path or name == "decode"), (name, m.name, sorted(names))
        value = {n: v for (n, labels), v in got.items() if set(labels) == model}
        assert all(v >= 0 for n, v in value.items() if n.startswith("vllm:dcp2d_")), value
        assert value["vllm:dcp2d_blocks_in_quarantine"] == \
            value["vllm:dcp2d_quarantined_blocks_total"] - value["vllm:dcp2d_lifted_blocks_total"]


def seconds_until(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s}s"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.timeout(600)
def test_prefill_frees_blocks_the_decode_will_not_fetch(cluster):
    """The prefill (send_timeout_s=600) holds a finished request's blocks for the
    decode. A repeated prompt (cached on decode1 but for its tail) and a request
    decode1 refuses to fetch (the producer's token count does not match) both give
    them back within seconds: the first once served, the second by the decode's
    ReleaseTransfer, with the right tokens either way (decode1 recomputes)."""
    c = cluster
    url = c["prefill"].url
    seconds_until(lambda: kv_cache_usage(url) == 0.0, 60, "prefill KV usage back to 0 before the test")
    prompt = ids(3 * PAGE + 5, 21)
    ref = complete(url, c["model"], prompt)
    for _ in range(2):  # the second time decode1 has the prompt cached
        assert tokens(complete(c["proxy1"].url, c["model"], prompt)) == tokens(ref)
        print(f"repeated prompt: prefill KV usage 0 after "
              f"{seconds_until(lambda: kv_cache_usage(url) == 0.0, 10, 'prefill KV usage 0'):.2f}s")
    prompt = ids(2 * PAGE + 7, 22)
    ref = complete(url, c["model"], prompt)
    pre = complete(url, c["model"], prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    seconds_until(lambda: kv_cache_usage(url) > 0.0, 10, "prefill holding the request's blocks")
    params = dict(pre["kv_transfer_params"], remote_num_tokens=len(prompt) + 1)
    out = complete(c["decode1"].url, c["model"], prompt, kv_transfer_params=params)
    assert tokens(out) == tokens(ref)  # refused, recomputed on decode1
    freed = seconds_until(lambda: kv_cache_usage(url) == 0.0, 10, "prefill KV usage 0 after the release")
    print(f"refused fetch: prefill KV usage 0 after {freed:.2f}s (send_timeout_s=600)")


# Refused kv_transfer_params (issue 37, finding 4): each sent straight to a decode. On
# e478bf4 such a request waited for a load that never started, with no end.
REFUSED = {
    "malformed address": {"remote_bootstrap_addr": "tcp://127.0.0.1:notaport"},
    "no key": {"remote_request_id": None},
    "engine id not a string": {"remote_engine_id": 7},
    "key too long": {"remote_request_id": "k" * 513},
    "prompt length not a count": {"remote_num_tokens": "12"},
    "a boolean field not a JSON boolean": {"do_remote_prefill": "false"},  # "false" was true (round 3, item 8)
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", ["decode", "decode1"])
def test_refused_kv_transfer_params_end_the_request_at_once(cluster, which):
    """Every field a decode refuses ends the request within seconds: an error on
    ``decode`` (kv_load_failure_policy "fail"), the colocated answer on ``decode1``
    ("recompute"); its blocks are freed."""
    c = cluster
    prompt = ids(2 * PAGE + 3, 51 if which == "decode" else 52)
    ref = complete(c["prefill"].url, c["model"], prompt)
    for name, edit in REFUSED.items():
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": f"refused-{name}",
                  "remote_bootstrap_addr": bootstrap_addr(c), "remote_engine_id": "prefill", **edit}
        params = {k: v for k, v in params.items() if v is not None}
        body = {"model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params}
        t0 = time.monotonic()
        status, out = post_json(c[which].url + "/v1/completions", body, timeout_s=120)
        took = time.monotonic() - t0
        if which == "decode1":
            assert status == 200 and tokens(out) == tokens(ref), (name, status, out)
        else:
            assert status >= 400, (name, status, out)
        assert took < 10, f"{name}: the request took {took:.1f} s"
    seconds_until(lambda: kv_cache_usage(c[which].url) == 0.0, 10, f"{which} KV usage back to 0")


@pytest.mark.timeout(600)
def test_a_stranger_on_the_side_channel_takes_nothing_and_stops_nothing(cluster):
    """The hostile-peer suite without a secret (issue 37, item 7): a stranger process
    tries, against the live prefill, to register itself as cp rank 0 (finding 1), to
    send one over-long message to the bootstrap and to every rank (finding 2: it
    killed the engine), a frame past the wire's limit, and 300 requests asking to wait
    an hour (finding 6; held, within this host's share). Each is refused or harmless; then both decodes answer through
    the proxies with the colocated answer, and every KV usage goes back to 0."""
    c = cluster
    got = stranger("all", bootstrap_addr(c))
    assert "registration token" in got["register"]["reply"] and got["register"]["before"] == got["register"]["after"]
    assert got["long"]["bootstrap"].startswith("Reply: rejected:")
    assert all(v.startswith("TransferOutcome:") for k, v in got["long"].items() if k != "bootstrap"), got["long"]
    assert all(v == "silence" for v in got["big"].values()), got["big"]
    # 300 waiting attempts from this host: within its share (1,024: issue 48 caps per source), all held
    assert all(v == {"answered": 0, "busy": 0, "held": 300} for v in got["flood"].values()), got["flood"]
    for which, salt in (("proxy", 61), ("proxy1", 62)):
        prompt = ids(3 * PAGE + 5, salt)
        assert tokens(complete(c[which].url, c["model"], prompt)) == tokens(complete(c["prefill"].url, c["model"],
                                                                                     prompt))
    for name in ("prefill", "decode", "decode1"):
        seconds_until(lambda: kv_cache_usage(c[name].url) == 0.0, 30, f"{name} KV usage back to 0")


# Multi-host checks: prompts test_e2e's other tests do not send (seeds 31-34, and
# 201-203 on a stall retry), so the decodes' prefix caches hold none of them.
HOSTS_SALT = 3


@pytest.mark.timeout(600)
def test_addresses_are_the_hosts(across_hosts):
    """What a decode host is told: the prefill host's bootstrap address, and CP rank
    side channels on the prefill host, not loopback; a decode host fetches through it."""
    c = across_hosts
    prefill = c["hosts"]["prefill"].addr
    prompt = ids(20, 10 * HOSTS_SALT + 4)
    out = complete(c["prefill"].url, c["model"], prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert out["kv_transfer_params"]["remote_bootstrap_addr"] == bootstrap_addr(c)
    assert bootstrap_addr(c).startswith(f"tcp://{prefill}:")
    table = bs.request(bootstrap_addr(c), QueryRanks("test", "test"), RankTable, 30.0)
    assert table.cp_size == 2 and all(a.startswith(f"tcp://{prefill}:") for a in table.addresses), table
    got = complete(c["decode1"].url, c["model"], prompt, kv_transfer_params=out["kv_transfer_params"])
    assert tokens(got) == tokens(complete(c["prefill"].url, c["model"], prompt))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which,tp,dcp", [("proxy", 2, DCP), ("proxy1", 2, 1)])
def test_proxy_across_hosts(across_hosts, which, tp, dcp):
    """Greedy tokens equal the non-disaggregated answer and the bytes of every
    (cp_rank, dcp_rank) path equal the plan, with prefill, decode and proxy on
    different hosts."""
    check_proxy(across_hosts, which, tp, dcp, salt=HOSTS_SALT)


@pytest.mark.timeout(600)
def test_pipelined_across_hosts(across_hosts):
    """The pipelined proxy (decode asks first) across hosts: same tokens."""
    c = across_hosts
    for prompt in prompts(HOSTS_SALT).values():
        assert tokens(complete(c["proxyp"].url, c["model"], prompt)) == \
            tokens(complete(c["prefill"].url, c["model"], prompt))
