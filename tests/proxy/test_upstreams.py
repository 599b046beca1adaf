"""The proxy over several instances: balancing, health checks, decode retries and
/metrics, against real aiohttp servers as fake upstreams (no vLLM)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fake_upstreams import ProxyCluster, sample
from vllm_dcp2d.proxy.metrics import METRICS, PREFIX, markdown_table
from vllm_dcp2d.proxy.upstreams import NoHealthyUpstream, Pool

PARAMS = {"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "tcp://127.0.0.1:1",
          "remote_engine_id": "pe", "remote_request_id": "t"}


# ---- Pool: least outstanding requests, ties round-robin -------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=6), st.integers(0, 20))
def test_pick_least_outstanding_round_robin(state, rounds):
    pool = Pool("decode", [f"http://h{i}:1" for i in range(len(state))])
    for u, (n, ok) in zip(pool.upstreams, state):
        u.outstanding, u.healthy = n, ok
    ok = [i for i, (_, h) in enumerate(state) if h]
    if not ok:
        with pytest.raises(NoHealthyUpstream, match="no healthy decode instance"):
            pool.pick()
        return
    low = min(state[i][0] for i in ok)
    tied = [i for i in ok if state[i][0] == low]
    picks = [pool.upstreams.index(pool.pick()) for _ in range(rounds + len(tied))]
    # loads unchanged: the picks cycle over the tied least-loaded healthy instances, in order
    assert picks == [tied[k % len(tied)] for k in range(len(picks))]


def test_pick_follows_load_and_exclusions():
    pool = Pool("prefill", ["http://a:1", "http://b:1", "http://c:1"])
    a, b, c = pool.upstreams
    leases = [pool.lease(pool.pick()) for _ in range(3)]
    for lease in leases:
        lease.__enter__()
    assert [u.outstanding for u in pool.upstreams] == [1, 1, 1]
    leases[1].__exit__(None, None, None)           # b finished: it is the least loaded
    assert pool.pick() is b
    assert pool.pick(exclude=[b]) is c             # a, c tie at 1; the cursor is past b
    c.healthy, c.reason = False, "down"
    with pytest.raises(NoHealthyUpstream, match=r"http://c:1 \(down\)"):
        pool.pick(exclude=[a, b])


@pytest.mark.parametrize("urls,match", [([], "at least one"), (["127.0.0.1:8000"], "not an http"),
                                        (["http://a:1", "http://a:1/"], "distinct")])
def test_pool_rejects_bad_urls(urls, match):
    with pytest.raises(ValueError, match=match):
        Pool("decode", urls)


# ---- real servers ----------------------------------------------------------------------------------

class Fake:
    """A fake vLLM instance. ``mode``: "ok", "refuse_5xx" (500), "die_before_body" (headers,
    then the connection closes), "die_after_first" (one chunk, then closes), "slow" (a second chunk 0.5 s after the first); ``hold``:
    an Event decode calls wait for; ``healthy``: what /health answers."""

    def __init__(self, kind: str, name: str):
        self.kind, self.name, self.mode, self.healthy = kind, name, "ok", True
        self.calls: list[dict] = []
        self.hold: asyncio.Event | None = None
        self.app = web.Application()
        for r in ("/v1/completions", "/v1/chat/completions"):
            self.app.router.add_post(r, self.handle)
        self.app.router.add_get("/health", self.health)

    async def health(self, request):
        return web.json_response({}, status=200 if self.healthy else 503)

    async def handle(self, request):
        body = await request.json()
        self.calls.append(body)
        if self.kind == "prefill":  # like DCP2DConnector: the transfer_id becomes the transfer key
            transfer_key = body["kv_transfer_params"]["transfer_id"]
            return web.json_response({"kv_transfer_params": {**PARAMS, "transfer_id": transfer_key, "remote_request_id": transfer_key}})
        if self.hold is not None:
            await self.hold.wait()
        if self.mode == "refuse_5xx":
            return web.Response(status=500, text="engine dead")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if not body.get("stream"):
            if self.mode != "ok":
                request.transport.close()
                return resp
            return web.json_response({"choices": [{"text": self.name}]})
        await resp.prepare(request)
        if self.mode == "die_before_body":
            request.transport.close()
            return resp
        await resp.write(f"data: {json.dumps({'text': self.name})}\n\n".encode())
        if self.mode == "slow":
            await asyncio.sleep(0.5)
            await resp.write(b"data: {}\n\n")
        if self.mode == "die_after_first":
            await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class Cluster(ProxyCluster):
    def __init__(self, n_prefill=2, n_decode=2, **proxy_kw):
        self.prefill = [Fake("prefill", f"p{i}") for i in range(n_prefill)]
        self.decode = [Fake("decode", f"d{i}") for i in range(n_decode)]
        self.proxy_kw = {"timeout_s": 10, "health_interval_s": 0.05, "health_timeout_s": 1, **proxy_kw}

    async def post(self, body, path="/v1/completions"):
        async with self.session.post(self.px.make_url(path), json=body) as resp:
            return resp.status, await resp.read()


async def until(cond, timeout_s: float = 10.0):
    """Wait for the health poller (every 0.05 s) to have acted."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "the health poller did not act in time"
        await asyncio.sleep(0.02)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.timeout(60)
def test_load_spreads_by_outstanding_requests():
    """4 concurrent held requests: 2 on each decode; the balancer's gauge shows it."""
    async def go():
        async with Cluster() as c:
            hold = asyncio.Event()
            for d in c.decode:
                d.hold = hold
            tasks = [asyncio.ensure_future(c.post({"prompt": "x", "stream": s})) for s in (False, True) * 2]
            while sum(len(d.calls) for d in c.decode) < 4:
                await asyncio.sleep(0.01)
            text = await c.metrics()
            hold.set()
            out = await asyncio.gather(*tasks)
            return c, text, out
    c, text, out = run(go())
    assert [s for s, _ in out] == [200] * 4
    assert [len(d.calls) for d in c.decode] == [2, 2] and [len(p.calls) for p in c.prefill] == [2, 2]
    for u in c.proxy.decode:
        assert sample(text, PREFIX + "outstanding_requests", kind="decode", upstream=u) == 2
        assert sample(text, PREFIX + "upstream_calls_total", kind="decode", upstream=u) == 2
        assert sample(text, PREFIX + "upstream_healthy", kind="decode", upstream=u) == 1


@pytest.mark.timeout(60)
def test_health_takes_out_and_puts_back():
    async def go():
        async with Cluster() as c:
            u0, u1 = c.proxy.decode_pool.upstreams
            c.decode[0].healthy = False
            await until(lambda: not u0.healthy)
            down = await c.metrics()
            out = [await c.post({"prompt": "x"}) for _ in range(4)]
            c.decode[1].healthy = False
            await until(lambda: not u1.healthy)
            none = await c.post({"prompt": "x"})
            c.decode[0].healthy = c.decode[1].healthy = True
            await until(lambda: u0.healthy and u1.healthy)
            back = [await c.post({"prompt": "x"}) for _ in range(4)]
            return c, down, out, none, back, await c.metrics()
    c, down, out, none, back, text = run(go())
    d0, d1 = c.proxy.decode
    assert sample(down, PREFIX + "upstream_healthy", kind="decode", upstream=d0) == 0
    assert sample(down, PREFIX + "upstream_healthy", kind="decode", upstream=d1) == 1
    assert [json.loads(b)["choices"][0]["text"] for _, b in out] == ["d1"] * 4   # never the dead one
    status, raw = none
    msg = json.loads(raw)["error"]["message"]
    assert status == 503 and msg.startswith("no healthy decode instance:") and "/health answered 503" in msg
    assert sorted(json.loads(b)["choices"][0]["text"] for _, b in back) == ["d0", "d0", "d1", "d1"]
    assert sample(text, PREFIX + "errors_total", stage="decode", kind="no_healthy") == 1
    assert sample(text, PREFIX + "requests_total", route="/v1/completions", status="503") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,stream", [("refuse_5xx", True), ("die_before_body", True),
                                         ("die_before_body", False), ("refused", True)])
def test_decode_retried_before_first_byte(mode, stream):
    """The first decode fails before any byte reached the client: the second serves the
    request with the same kv_transfer_params, and the first leaves rotation if it is gone."""
    async def go():
        async with Cluster(n_prefill=1, health_interval_s=60) as c:  # only the start-up poll: no race
            bad = c.decode[0]
            if mode == "refused":
                await c.servers[1].close()  # connection refused, and /health with it
                bad.healthy = True
            else:
                bad.mode = mode
            status, raw = await c.post({"prompt": "x", "stream": stream})
            return c, status, raw, await c.metrics()
    c, status, raw, text = run(go())
    assert status == 200
    assert (b'data: {"text": "d1"}' in raw) if stream else json.loads(raw)["choices"][0]["text"] == "d1"
    if mode != "refused":
        assert len(c.decode[0].calls) == 1
        transfer_key = c.prefill[0].calls[0]["kv_transfer_params"]["transfer_id"]
        assert c.decode[0].calls[0]["kv_transfer_params"] == c.decode[1].calls[0]["kv_transfer_params"] == {
            **PARAMS, "transfer_id": transfer_key, "remote_request_id": transfer_key}
    assert len(c.decode[1].calls) == 1
    assert sample(text, PREFIX + "retries_total", stage="decode") == 1
    kind = "http_5xx" if mode == "refuse_5xx" else "unreachable"
    assert sample(text, PREFIX + "errors_total", stage="decode", kind=kind) == 1
    # a 5xx answer does not prove the instance dead (the poll decides); a lost connection does
    healthy = sample(text, PREFIX + "upstream_healthy", kind="decode", upstream=c.proxy.decode[0])
    assert healthy == (1 if mode == "refuse_5xx" else 0)


@pytest.mark.timeout(60)
def test_no_retry_after_first_byte():
    async def go():
        async with Cluster(n_prefill=1) as c:
            c.decode[0].mode = "die_after_first"
            status, raw = await c.post({"prompt": "x", "stream": True})
            return c, status, raw, await c.metrics()
    c, status, raw, text = run(go())
    events = raw.decode().split("\n\n")
    assert status == 200 and events[0] == 'data: {"text": "d0"}'
    assert json.loads(events[1].removeprefix("data: "))["error"]["message"].startswith(
        f"decode {c.proxy.decode[0]}/v1/completions failed mid-stream")
    assert c.decode[1].calls == []
    assert sample(text, PREFIX + "retries_total", stage="decode") == 0
    assert sample(text, PREFIX + "errors_total", stage="decode", kind="mid_stream") == 1


@pytest.mark.timeout(60)
def test_every_decode_failing_gives_the_last_error():
    async def go():
        async with Cluster(n_prefill=1) as c:
            for d in c.decode:
                d.mode = "refuse_5xx"
            return await c.post({"prompt": "x", "stream": True})
    status, raw = run(go())
    msg = json.loads(raw)["error"]["message"]
    assert status == 502 and "failed (500): engine dead" in msg and "no other healthy decode instance" in msg


@pytest.mark.timeout(60)
def test_prefill_retried_only_if_never_connected():
    async def go():
        async with Cluster(health_interval_s=0) as c:
            await c.servers[0].close()
            out = [await c.post({"prompt": "x"}) for _ in range(2)]
            return c, out, await c.metrics()
    c, out, text = run(go())
    assert [s for s, _ in out] == [200, 200] and len(c.prefill[1].calls) == 2
    # health checks off: nothing takes p0 out of rotation, so the tie-break hits it each time
    assert sample(text, PREFIX + "retries_total", stage="prefill") == 2
    assert sample(text, PREFIX + "errors_total", stage="prefill", kind="unreachable") == 2


@pytest.mark.timeout(60)
def test_metrics_names_match_the_docs():
    """Every documented proxy metric is on a live /metrics, and the docs list exactly ``METRICS``."""
    async def go():
        async with Cluster() as c:
            await c.post({"prompt": "x", "stream": True})
            await c.post({"prompt": "x"})
            return await c.metrics()
    text = run(go())
    live = set(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind, _, _ in METRICS:
        assert (PREFIX + name, kind) in live, (name, sorted(live))
    assert sample(text, PREFIX + "transfer_wait_seconds_count") == 1
    assert sample(text, PREFIX + "decode_seconds_count", stream="true") == 1
    assert sample(text, PREFIX + "decode_seconds_count", stream="false") == 1
    assert sample(text, PREFIX + "prefill_seconds_count") == 2
    assert sample(text, PREFIX + "requests_total", route="/v1/completions", status="200") == 2
    doc = Path(__file__).parents[2].joinpath("docs", "metrics.md").read_text()
    section = doc.split("## Proxy", 1)[1].split("\n## ", 1)[0]
    assert markdown_table() in section, "regenerate docs/metrics.md's Proxy table from proxy.metrics.markdown_table()"
    documented = set(re.findall(r"^\| `(vllm_dcp2d_proxy_\w+)`", section, re.M))
    assert documented == {PREFIX + m[0] for m in METRICS}  # and no stale rows


@pytest.mark.timeout(60)
def test_pipelined_decode_retried_with_the_same_transfer_key():
    """--pipelined: the decode call goes out with remote_request_id = transfer_id before the
    prefill answered; retried, it asks the second decode instance for the same key."""
    async def go():
        async with Cluster(n_prefill=1, pipelined=True) as c:
            assert (await c.post({"prompt": "x"}))[0] == 200  # learns the prefill's route
            c.decode[1].mode = "die_before_body"                # the cursor is on d1 now
            status, raw = await c.post({"prompt": "y", "stream": True})
            return c, status, raw
    c, status, raw = run(go())
    assert status == 200 and b'data: {"text": "d0"}' in raw
    transfer_key = c.prefill[0].calls[1]["kv_transfer_params"]["transfer_id"]
    want = {**PARAMS, "do_remote_decode": False, "transfer_id": transfer_key, "remote_request_id": transfer_key}
    assert c.decode[1].calls[0]["kv_transfer_params"] == c.decode[0].calls[1]["kv_transfer_params"] == want


@pytest.mark.timeout(60)
def test_client_leaving_mid_stream_is_counted_and_frees_the_slot():
    async def go():
        async with Cluster(n_prefill=1) as c:
            c.decode[0].mode = "slow"
            async with c.session.post(c.px.make_url("/v1/completions"), json={"prompt": "x", "stream": True}) as r:
                assert await r.content.readany()
                r.close()
            await until(lambda: c.proxy.decode_pool.upstreams[0].outstanding == 0)
            return c, await c.metrics()
    c, text = run(go())
    assert sample(text, PREFIX + "errors_total", stage="client", kind="disconnected") == 1
    assert sample(text, PREFIX + "outstanding_requests", kind="decode", upstream=c.proxy.decode[0]) == 0
    assert sample(text, PREFIX + "requests_total", route="/v1/completions", status="499") == 1


@pytest.mark.timeout(60)
def test_pipelined_spreads_while_learning_bootstraps():
    """--pipelined: the first call to each prefill instance learns its bootstrap (sequential), and
    that learning call is the picked instance's, so the round-robin is not skewed."""
    async def go():
        async with Cluster(pipelined=True) as c:
            out = [await c.post({"prompt": str(i)}) for i in range(4)]
            return c, out
    c, out = run(go())
    assert [s for s, _ in out] == [200] * 4
    assert [len(p.calls) for p in c.prefill] == [2, 2] and [len(d.calls) for d in c.decode] == [2, 2]
    assert set(c.proxy._bootstraps) == set(c.proxy.prefill)


@pytest.mark.timeout(60)
def test_instance_up_after_the_proxy_serves_at_once():
    """An instance that was down at the last poll and is up now serves the next request:
    finding none of a kind in rotation, the proxy polls that kind again before answering 503."""
    async def go():
        async with Cluster(n_prefill=1, n_decode=1, health_interval_s=60) as c:
            c.decode[0].healthy = False
            await c.proxy.health.poll_once(c.proxy.session)
            down = await c.post({"prompt": "x"})
            c.decode[0].healthy = True                # no poll until the request finds none
            up = await c.post({"prompt": "x"})
            return down, up
    (s1, raw1), (s2, _) = run(go())
    assert s1 == 503 and "no healthy decode instance" in json.loads(raw1)["error"]["message"]
    assert s2 == 200
