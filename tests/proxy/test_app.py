"""The PD proxy against fake prefill/decode upstreams (no vLLM)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.fake_upstreams import healthy, upstream_apps
from vllm_dcp2d.proxy import Proxy, decode_body, prefill_body

PARAMS = {"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "127.0.0.1:1"}


def fake_upstreams(seen: list, prefill_status=200, decode_status=200, prefill_params=PARAMS):
    async def prefill(request):
        body = await request.json()
        seen.append(("prefill", request.path, body))
        if prefill_status != 200:
            return web.json_response({"error": {"message": "bad prompt"}}, status=prefill_status)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": prefill_params})

    async def decode(request):
        body = await request.json()
        seen.append(("decode", request.path, body))
        if decode_status != 200:
            return web.Response(status=decode_status, text="boom")
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"choices": [{"text": "decoded"}]})

    return upstream_apps(prefill, decode)


async def run_case(body, path="/v1/completions", prefill_urls=None, proxy_kw=None, **kw):
    seen: list = []
    p_app, d_app = fake_upstreams(seen, **kw)
    async with TestServer(p_app) as p, TestServer(d_app) as d:
        proxy = Proxy(prefill_urls or [str(p.make_url(""))], [str(d.make_url(""))], timeout_s=5,
                      **(proxy_kw or {}))
        async with TestServer(proxy.app()) as px, aiohttp.ClientSession() as s:
            async with s.post(px.make_url(path), json=body) as resp:
                return resp.status, await resp.read(), seen


def test_bodies():
    b = {"prompt": "hi", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
    p = prefill_body(b, "tid")
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "tid"}
    assert b["max_tokens"] == 7 and "kv_transfer_params" not in b  # original untouched
    assert decode_body(b, PARAMS)["kv_transfer_params"] == PARAMS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_two_hops(path):
    status, raw, seen = asyncio.run(run_case({"prompt": "hi", "max_tokens": 5}, path))
    assert status == 200 and json.loads(raw) == {"choices": [{"text": "decoded"}]}
    (k1, p1, b1), (k2, p2, b2) = seen
    assert (k1, p1, k2, p2) == ("prefill", path, "decode", path)
    assert b1["max_tokens"] == 1 and b1["kv_transfer_params"]["do_remote_decode"] is True
    assert b2["max_tokens"] == 5 and b2["kv_transfer_params"] == PARAMS


@pytest.mark.timeout(30)
def test_one_request_runs_only_the_walk_and_its_helpers():
    """The proxy's part of docs/connector.md's "Request flow" (the engine's part:
    tests/connector/test_connector.py): while one request goes through the proxy to its two
    hops, every file of the package that ran is a step of the walk or listed under what the
    steps call, and the proxy's steps ran."""
    from tests.support import request_flow

    profiler = request_flow.Profiler()

    async def case():
        seen: list = []
        p_app, d_app = fake_upstreams(seen)
        async with TestServer(p_app) as p, TestServer(d_app) as d:
            proxy = Proxy([str(p.make_url(""))], [str(d.make_url(""))], timeout_s=5)
            async with TestServer(proxy.app()) as px, aiohttp.ClientSession() as s:
                with profiler:
                    async with s.post(px.make_url("/v1/completions"), json={"prompt": "hi", "max_tokens": 5}) as resp:
                        return resp.status, await resp.json(), seen

    status, answer, seen = asyncio.run(case())
    assert status == 200 and answer == {"choices": [{"text": "decoded"}]} and [h for h, *_ in seen] == ["prefill", "decode"]
    steps, helpers = request_flow.steps(), request_flow.helpers()
    name = lambda ps: sorted(str(p.relative_to(request_flow.PACKAGE)) for p in ps)  # noqa: E731
    unlisted = {p for p in profiler.ran if p not in steps and not request_flow.covers(helpers, p)}
    assert not unlisted, f"one request ran {name(unlisted)}: name each as a step or under what the steps call"
    proxy_steps = {p for p in steps if p.parent.name == "proxy"}
    assert proxy_steps and proxy_steps <= profiler.ran, f"steps that did not run: {name(proxy_steps - profiler.ran)}"


@pytest.mark.timeout(30)
def test_streams():
    status, raw, _ = asyncio.run(run_case({"prompt": "hi", "max_tokens": 5, "stream": True}))
    assert status == 200
    assert raw.decode().split("\n\n")[:4] == ['data: {"i": 0}', 'data: {"i": 1}', 'data: {"i": 2}',
                                              "data: [DONE]"]


@pytest.mark.timeout(30)
def test_upstream_errors():
    status, raw, seen = asyncio.run(run_case({"prompt": "hi"}, prefill_status=400))
    assert status == 400 and "bad prompt" in raw.decode() and len(seen) == 1  # no decode call
    status, raw, _ = asyncio.run(run_case({"prompt": "hi"}, decode_status=500))
    assert status == 502 and "decode" in json.loads(raw)["error"]["message"]
    status, raw, _ = asyncio.run(run_case({"prompt": "hi"}, prefill_params=None))
    assert status == 502 and "kv_transfer_params" in json.loads(raw)["error"]["message"]
    # health checks off: the call finds the prefill unreachable
    status, raw, _ = asyncio.run(run_case({"prompt": "hi"}, prefill_urls=["http://127.0.0.1:9"],
                                          proxy_kw={"health_interval_s": 0}))
    assert status == 502 and "unreachable" in json.loads(raw)["error"]["message"]
    # health checks on: the start-up poll took it out of rotation, so no call is made
    status, raw, _ = asyncio.run(run_case({"prompt": "hi"}, prefill_urls=["http://127.0.0.1:9"]))
    msg = json.loads(raw)["error"]["message"]
    assert status == 503 and msg.startswith("no healthy prefill instance: http://127.0.0.1:9 (/health unreachable")


@pytest.mark.timeout(30)
def test_bad_json():
    async def go():
        proxy = Proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
        async with TestServer(proxy.app()) as px, aiohttp.ClientSession() as s:
            async with s.post(px.make_url("/v1/completions"), data=b"{nope") as resp:
                return resp.status
    assert asyncio.run(go()) == 400


async def run_pipelined(bodies, prefill_status=200, prefill_key=None):
    """Several requests through one --pipelined proxy; the fake prefill answers
    like DCP2DConnector (remote_request_id = the request's transfer_id)."""
    seen: list = []
    decode_started = asyncio.Event()

    async def prefill(request):
        body = await request.json()
        seen.append(("prefill", body))
        if seen[0] is not seen[-1]:  # pipelined calls: decode was sent before the prefill answered
            await asyncio.wait_for(decode_started.wait(), 5)
        if prefill_status != 200 and len(seen) > 1:
            return web.json_response({"error": {"message": "bad prompt"}}, status=prefill_status)
        tid = body["kv_transfer_params"]["transfer_id"]
        return web.json_response({"kv_transfer_params": {
            "do_remote_prefill": True, "remote_request_id": prefill_key or tid, "transfer_id": tid,
            "remote_bootstrap_addr": "tcp://127.0.0.1:1", "remote_engine_id": "pe"}})

    async def decode(request):
        body = await request.json()
        seen.append(("decode", body))
        decode_started.set()
        await asyncio.sleep(0.2)
        return web.json_response({"choices": [{"text": "decoded"}]})

    apps = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_get("/health", healthy)
        apps.append(app)
    out = []
    async with TestServer(apps[0]) as p, TestServer(apps[1]) as d:
        proxy = Proxy([str(p.make_url(""))], [str(d.make_url(""))], timeout_s=5, pipelined=True)
        async with TestServer(proxy.app()) as px, aiohttp.ClientSession() as s:
            for body in bodies:
                decode_started.clear()
                async with s.post(px.make_url("/v1/completions"), json=body) as resp:
                    out.append((resp.status, await resp.read()))
    return out, seen


@pytest.mark.timeout(30)
def test_pipelined_sends_decode_with_transfer_id_at_once():
    out, seen = asyncio.run(run_pipelined([{"prompt": "a"}, {"prompt": "b"}]))
    assert [s for s, _ in out] == [200, 200]
    # first request: sequential (learns the route); second: the fake prefill answers only
    # once the decode call arrived, so the decode went out before the prefill finished
    assert [k for k, _ in seen[:2]] == ["prefill", "decode"]
    assert sorted(k for k, _ in seen[2:]) == ["decode", "prefill"]
    second_prefill = [b for k, b in seen[2:] if k == "prefill"][0]
    second_decode = [b for k, b in seen[2:] if k == "decode"][0]
    tid = second_prefill["kv_transfer_params"]["transfer_id"]
    assert second_decode["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": tid, "transfer_id": tid,
        "remote_bootstrap_addr": "tcp://127.0.0.1:1", "remote_engine_id": "pe"}


@pytest.mark.timeout(30)
def test_pipelined_prefill_failure_cancels_decode():
    out, _ = asyncio.run(run_pipelined([{"prompt": "a"}, {"prompt": "b"}], prefill_status=400))
    assert out[0][0] == 200
    assert out[1][0] == 400 and b"bad prompt" in out[1][1]
    out, _ = asyncio.run(run_pipelined([{"prompt": "a"}, {"prompt": "b"}], prefill_key="other"))
    assert out[1][0] == 502 and b"transfer key" in out[1][1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("decode_ends", [False, True])
def test_client_hang_up_mid_stream_aborts_decode(caplog, decode_ends):
    """A client leaving mid-stream is not a decode failure: the proxy closes the decode
    call (vLLM aborts the request) without blaming the decode or erroring on the dead
    client, whether its next write is a chunk or the end of the stream (``decode_ends``:
    the decode finishes after the client left). tests/e2e/test_load_faults.py hangs clients
    up against real vLLM."""
    closed, client_left = asyncio.Event(), asyncio.Event()

    async def decode(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(b"data: {}\n\n")
            if decode_ends:
                await client_left.wait()
                await asyncio.sleep(0.3)  # the proxy has seen its client go
                return resp
            for i in range(200):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                await asyncio.sleep(0.02)
        except (ConnectionResetError, asyncio.CancelledError):  # the proxy closed the call
            closed.set()
            raise
        return resp

    async def go():
        p_app = fake_upstreams([])[0]
        d_app = web.Application()
        d_app.router.add_post("/v1/completions", decode)
        d_app.router.add_get("/health", healthy)
        async with TestServer(p_app) as p, TestServer(d_app) as d:
            proxy = Proxy([str(p.make_url(""))], [str(d.make_url(""))], timeout_s=10)
            # as ``web.run_app`` serves it: no handler cancellation (TestServer turns it on)
            runner = web.AppRunner(proxy.app(), handler_cancellation=False)
            await runner.setup()
            sock = socket.create_server(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
            try:
                async with aiohttp.ClientSession() as s:
                    resp = await s.post(url, json={"prompt": "hi", "stream": True})
                    assert resp.status == 200 and (await resp.content.readline()).startswith(b"data: ")
                    resp.close()  # drops the connection to the proxy
                    client_left.set()
                    if not decode_ends:
                        await asyncio.wait_for(closed.wait(), 10)
                    await asyncio.sleep(0.6)  # the proxy's handler has finished
            finally:
                await runner.cleanup()

    with caplog.at_level("INFO"):
        asyncio.run(go())
    errors = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert errors == [], errors
    assert any("client disconnected mid-stream" in r.getMessage() for r in caplog.records)


def closing_idle_connections(idle_s: float, seen: list):
    """A prefill that, like uvicorn at its keep-alive timeout, drops a connection that was idle
    ``idle_s`` when a request arrives on it: the close crossing a reused connection's request,
    made deterministic. ``seen`` gets, per request, whether it came on a reused connection."""
    last_done: dict[int, float] = {}

    async def prefill(request):
        conn, now = id(request.transport), asyncio.get_running_loop().time()
        reused = conn in last_done
        seen.append(reused)
        if reused and now - last_done[conn] >= idle_s:
            request.transport.close()
            raise ConnectionResetError("closed at its keep-alive timeout")
        await request.read()
        last_done[conn] = asyncio.get_running_loop().time()
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    async def decode(request):
        await request.read()
        return web.json_response({"choices": [{"text": "decoded"}]})

    return upstream_apps(prefill, decode)


async def two_requests_apart(gap_s: float, upstream_idle_s: float, keepalive_s: float | None):
    seen: list = []
    p_app, d_app = closing_idle_connections(upstream_idle_s, seen)
    async with TestServer(p_app) as p, TestServer(d_app) as d:
        proxy = Proxy([str(p.make_url(""))], [str(d.make_url(""))], timeout_s=5, health_interval_s=0,
                      **({} if keepalive_s is None else {"keepalive_s": keepalive_s}))
        if keepalive_s is None:  # what the proxy did before: aiohttp's own keep-alive (15 s)
            proxy.keepalive_s = 15.0
        statuses = []
        async with TestServer(proxy.app()) as px, aiohttp.ClientSession() as s:
            for i in range(2):
                if i:
                    await asyncio.sleep(gap_s)
                async with s.post(px.make_url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}) as resp:
                    statuses.append((resp.status, await resp.text()))
        return statuses, seen


@pytest.mark.timeout(30)
def test_an_upstream_connection_is_not_reused_past_the_proxys_keep_alive():
    """An upstream closes idle connections after 0.4 s; the proxy's keep-alive (0.2 s) is below
    it, so a request 0.6 s after the last one opens a new connection and is answered. With
    aiohttp's default (15 s, the proxy before) it went on the closing connection: 502."""
    statuses, reused = asyncio.run(two_requests_apart(0.6, 0.4, 0.2))
    assert [s for s, _ in statuses] == [200, 200] and reused == [False, False], (statuses, reused)
    statuses, reused = asyncio.run(two_requests_apart(0.6, 0.4, None))
    assert reused == [False, True] and statuses[1][0] == 502, (statuses, reused)
    assert "Server disconnected" in statuses[1][1]


def test_the_default_keep_alive_is_below_vllms():
    from vllm_dcp2d.proxy.app import KEEPALIVE_S

    vllm_envs = pytest.importorskip("vllm.envs")
    assert KEEPALIVE_S < vllm_envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, (KEEPALIVE_S, vllm_envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
    with pytest.raises(ValueError, match="keep-alive must be > 0 seconds, got 0"):
        Proxy(["http://p"], ["http://d"], keepalive_s=0)
