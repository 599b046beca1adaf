"""The proxy's HTTP application: routing, retries and error mapping (the flow is
described in the package docstring, ``vllm_dcp2d/proxy/__init__.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import aiohttp
from aiohttp import web

from . import batch
from .errors import UpstreamError, error_response, upstream_status
from .hops import decode_body, prefill_body
from .metrics import ProxyMetrics
from .routing import Plan, Policy, Router, TooLong
from .streams import BatchStream, ClientGone, ClientSink, StreamEnded, gather_or_cancel
from .upstreams import HealthChecker, NoHealthyUpstream, Pool, Upstream

log = logging.getLogger("vllm_dcp2d.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")

# Seconds an idle upstream connection may be reused. vLLM's API server (uvicorn) closes a
# connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default); aiohttp's own default
# (15 s) reuses connections the server is closing, and a request sent as the close crosses
# it fails with "Server disconnected" (the cliff bench lost 2 of 36 prefill calls so, after
# a 5 s lull). Below the server's timeout, the proxy closes first.
KEEPALIVE_S = 2.0


class Proxy:
    """Routes requests over ``Pool``s of prefill and decode instances; one
    ``aiohttp.ClientSession`` for all upstream calls. ``health_interval_s <= 0``
    turns health checks off. ``batch_concurrency``: PD pairs in flight at once for
    the prompts of one batched request (``batch``). ``policy``: how ``routing.Router``
    picks (None: least outstanding calls only, as before decode groups and affinity).
    ``keepalive_s``: how long an idle upstream connection is reused; keep it below the
    upstreams' own keep-alive (``KEEPALIVE_S``)."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 300.0, pipelined: bool = False,
                 health_interval_s: float = 2.0, health_timeout_s: float = 5.0, batch_concurrency: int = 8,
                 policy: Policy | None = Policy(), keepalive_s: float = KEEPALIVE_S):
        if timeout_s <= 0:
            raise ValueError(f"upstream timeout must be > 0 seconds, got {timeout_s}")
        if batch_concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1 PD pair per request, got {batch_concurrency}")
        if keepalive_s <= 0:
            raise ValueError(f"upstream keep-alive must be > 0 seconds, got {keepalive_s}")
        self.keepalive_s = keepalive_s
        self.batch_concurrency = batch_concurrency
        self.prefill_pool, self.decode_pool = Pool("prefill", prefill), Pool("decode", decode)
        self.prefill, self.decode = self.prefill_pool.urls, self.decode_pool.urls
        self.health = HealthChecker([self.prefill_pool, self.decode_pool], health_interval_s, health_timeout_s)
        self.router = Router(self.prefill_pool, self.decode_pool, policy or Policy(affinity_entries=0))
        self.routing = policy is not None
        self.metrics = ProxyMetrics([self.prefill_pool, self.decode_pool], self.router)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.pipelined = pipelined
        self._bootstraps: dict[str, dict] = {}  # prefill URL -> its remote_bootstrap_addr, remote_engine_id

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout,
                                             connector=aiohttp.TCPConnector(keepalive_timeout=self.keepalive_s))
        await self.health.start(self.session)

    async def stop(self, app: web.Application) -> None:
        await self.health.stop()
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health_handler)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def health_handler(self, request: web.Request) -> web.Response:
        """The proxy itself is up (200 always); the body lists each upstream's state."""
        return web.json_response({"status": "ok", "upstreams": [
            {"kind": u.kind, "url": u.url, "healthy": u.healthy, "outstanding": u.outstanding, "reason": u.reason,
             **({"info": vars(u.info), "kv_usage": u.kv_usage} if u.info else {})}
            for p in (self.prefill_pool, self.decode_pool) for u in p.upstreams]})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def models(self, request: web.Request) -> web.Response:
        try:
            url = (await self._pick(self.decode_pool)).url
        except NoHealthyUpstream as e:
            return error_response(503, str(e))
        try:
            async with self.session.get(f"{url}/v1/models") as resp:
                return web.json_response(await resp.json(), status=resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            return error_response(502, f"decode {url} unreachable: {e!r}")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0, route, status = time.monotonic(), request.path, 500
        try:
            try:
                body = await request.json()
            except json.JSONDecodeError as e:
                self.metrics.error("proxy", "bad_request")
                status = 400
                return error_response(400, f"request body is not JSON: {e}")
            if not isinstance(body, dict):
                self.metrics.error("proxy", "bad_request")
                status = 400
                return error_response(400, f"request body must be a JSON object, got {type(body).__name__}")
            resp = await self._serve(request, route, body)
            status = 499 if request.get("dcp2d_client_gone") else resp.status
            if status == 200:
                self.metrics.request.labels(route).observe(time.monotonic() - t0)
            return resp
        except asyncio.CancelledError:  # aiohttp cancels the handler when the client goes away
            self.metrics.error("client", "disconnected")
            status = 499
            raise
        finally:
            self.metrics.requests.labels(route, str(status)).inc()

    async def _serve(self, request: web.Request, route: str, body: dict) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        started: list[web.StreamResponse] = []  # the client response, once its headers went out
        try:
            parts = batch.split(route, body)
            if parts is not None:
                return await self._serve_batch(request, route, body, parts, started)
            plan, prefill = self._plan(route, body), None
            if self.pipelined:
                prefill = await self._pick(self.prefill_pool, plan=plan)
                bootstrap = self._bootstraps.get(prefill.url)
                if bootstrap is not None:
                    return await self._pipelined(request, route, body, plan, prefill, bootstrap, started)
            # sequential (or learning the picked prefill's bootstrap)
            params = await self._prefill_params(route, body, plan, first=prefill)
            return await self._decode(request, route, decode_body(body, params), stream, started, plan)
        except TooLong as e:
            log.warning("%s: %s", route, e)
            self.metrics.error("proxy", "too_long")
            return error_response(400, str(e), "BadRequestError")
        except NoHealthyUpstream as e:
            log.warning("%s: %s", route, e)
            self.metrics.error(e.kind, "no_healthy")
            return error_response(503, str(e))
        except ClientGone:
            # Leaving closes the decode call, so vLLM aborts the request and frees its blocks.
            log.info("%s: client disconnected mid-stream; decode call closed", route)
            self.metrics.error("client", "disconnected")
            request["dcp2d_client_gone"] = True  # requests_total counts it as 499
            return started[0]
        except UpstreamError as e:
            log.warning("%s: %s", route, e)
            if started:  # headers are gone already: end the stream with an SSE error event
                msg = {"error": {"message": str(e), "code": e.status}}
                with contextlib.suppress(ConnectionError):
                    await started[0].write(f"data: {json.dumps(msg)}\n\n".encode())
                    await started[0].write_eof()
                return started[0]
            return web.json_response(e.body, status=e.status)

    async def _serve_batch(self, request: web.Request, route: str, body: dict, parts: list[dict],
                           started: list) -> web.StreamResponse:
        """A batch as one PD pair per prompt (``parts``), ``batch_concurrency`` at a
        time, each pair sequential (also under ``--pipelined``), merged in prompt order.
        Any pair's failure cancels the others (``gather_or_cancel``) and is the answer."""
        n = batch.choices_per_prompt(body)
        limit = asyncio.Semaphore(self.batch_concurrency)
        if not body.get("stream"):
            async def answer(part: dict) -> dict:
                async with limit:
                    plan = self._plan(route, part)
                    params = await self._prefill_params(route, part, plan)
                    return await self._retrying(self.decode_pool,
                                                lambda up: self._decode_json(up, route, decode_body(part, params)),
                                                plan=plan)
            answers = await gather_or_cancel([answer(p) for p in parts])
            return web.json_response(batch.merge_answers(answers, n))
        merged = BatchStream(request, started, len(parts), n)

        async def stream(i: int, part: dict) -> None:
            async with limit:
                plan = self._plan(route, part)
                params = await self._prefill_params(route, part, plan)
                sink, hop = merged.sink(i), decode_body(part, params)
                await self._retrying(self.decode_pool, lambda up: self._stream(up, route, hop, sink), plan=plan)
        try:
            await gather_or_cancel([stream(i, p) for i, p in enumerate(parts)])
        except StreamEnded as e:
            log.warning("%s: %s; the batch's stream ends", route, e)
            self.metrics.error("decode", "mid_stream")
        await merged.finish()
        return started[0]

    async def _prefill_params(self, route: str, body: dict, plan: Plan | None,
                              first: Upstream | None = None) -> dict:
        """The prefill hop of ``body`` under a new transfer key, retried as ``_retrying``
        allows; the ``kv_transfer_params`` for its decode hop."""
        return await self._retrying(self.prefill_pool,
                                    lambda up: self._prefill(up, route, body, uuid.uuid4().hex, plan), first=first,
                                    plan=plan)

    def _plan(self, route: str, body: dict) -> Plan | None:
        """A PD pair's routing plan (None: routing off). A client's token ids are the prompt
        unless vLLM may truncate them (``truncate_prompt_tokens``): then the prefill counts."""
        if not self.routing:
            return None
        prompt = body.get("prompt")
        exact = route == "/v1/completions" and prompt and batch.is_token_ids(prompt) and \
            body.get("truncate_prompt_tokens") is None
        return self.router.plan(body, prompt if exact else None)

    def _choose(self, pool: Pool, tried, plan: Plan | None) -> Upstream:
        if plan is None:
            return pool.pick(tried)
        if pool is self.prefill_pool:
            return self.router.pick_prefill(plan, tried)
        decision = self.router.pick_decode(plan, tried)
        self.metrics.decided(decision)
        return decision.upstream

    async def _pick(self, pool: Pool, tried: list | None = None, plan: Plan | None = None) -> Upstream:
        """The routed pick (``routing.Router``, or ``pool.pick`` with routing off); if none is in
        rotation at all, poll the pool once more first: an instance may have come up since
        the last poll (the proxy started before it)."""
        try:
            return self._choose(pool, tried or (), plan)
        except NoHealthyUpstream:
            if tried:
                raise
            await self.health.recheck(self.session, pool)
            return self._choose(pool, (), plan)

    async def _retrying(self, pool: Pool, call, first: Upstream | None = None, plan: Plan | None = None):
        """``call(upstream)`` on the instance of ``pool`` routing picks (or on ``first``,
        picked already); while it fails retryably, again on another one not tried yet. With
        none left, the last error (or 503 if none was in rotation at all)."""
        tried: list[Upstream] = []
        last: UpstreamError | None = None
        while True:
            try:
                up = first if first is not None and not tried else await self._pick(pool, tried, plan)
            except NoHealthyUpstream:
                if last is None:
                    raise
                raise UpstreamError(last.status, f"{last}; no other healthy {pool.kind} instance to retry on",
                                    stage=last.stage, kind=last.kind) from None
            if tried:
                self.metrics.retries.labels(pool.kind).inc()
                log.warning("retrying on %r after: %s", up, last)
            tried.append(up)
            self.metrics.calls.labels(pool.kind, up.url).inc()
            try:
                return await call(up)
            except UpstreamError as e:
                self.metrics.error(e.stage, e.kind)
                if not e.retryable:
                    raise
                last = e
            finally:
                if plan is not None and pool is self.decode_pool:
                    self.router.release(plan)  # the call's KV reservation

    async def _prefill(self, up: Upstream, route: str, body: dict, transfer_key: str,
                       plan: Plan | None = None) -> dict:
        """Run the prefill on ``up``; returns the ``kv_transfer_params`` for decode, and tells
        ``plan`` the prompt's length and token ids from the answer."""
        url = up.url + route
        t0 = time.monotonic()
        try:
            want_ids = plan is not None and plan.need is None  # a token-id prompt's ids are known already
            data = await self._post_json(self.prefill_pool, up, route, prefill_body(body, transfer_key, want_ids))
        except UpstreamError:
            self._bootstraps.pop(up.url, None)  # it may come back elsewhere: learn again
            raise
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            raise UpstreamError(502, f"prefill {url} returned no kv_transfer_params for decode "
                                     f"(got {params!r}); is it running DCP2DConnector as kv_producer?",
                                stage="prefill", kind="bad_answer")
        if all(isinstance(params.get(k), str) for k in ("remote_bootstrap_addr", "remote_engine_id")):
            self._bootstraps[up.url] = {k: params[k] for k in ("remote_bootstrap_addr", "remote_engine_id")}
        self.metrics.prefill.observe(time.monotonic() - t0)
        if plan is not None:
            self.router.learn_answer(plan, data)
        return params

    async def _pipelined(self, request: web.Request, route: str, body: dict, plan: Plan | None, prefill: Upstream,
                         bootstrap: dict, started: list) -> web.StreamResponse:
        """Prefill and decode at once; the decode fetches by the transfer key, so a
        decode retried on another instance fetches by it too."""
        transfer_key = uuid.uuid4().hex
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": transfer_key,
                  "transfer_id": transfer_key, **bootstrap}
        decode = asyncio.ensure_future(self._decode(request, route, decode_body(body, params),
                                                    bool(body.get("stream")), started, plan))
        try:
            self.metrics.calls.labels("prefill", prefill.url).inc()
            try:
                answer = await self._prefill(prefill, route, body, transfer_key)
            except UpstreamError as e:
                self.metrics.error(e.stage, e.kind)
                raise
            if answer.get("remote_request_id") != transfer_key:
                self.metrics.error("prefill", "bad_answer")
                raise UpstreamError(502, f"prefill {prefill.url} did not take transfer key {transfer_key!r} as the "
                                         f"key it answers with (answered {answer.get('remote_request_id')!r})")
        except BaseException:
            decode.cancel()  # closes the upstream connection: vLLM aborts the decode request
            with contextlib.suppress(asyncio.CancelledError, UpstreamError, NoHealthyUpstream, ClientGone):
                await decode
            raise
        return await decode

    async def _post_json(self, pool: Pool, up: Upstream, route: str, body: dict) -> dict:
        """POST and read a JSON answer. Retryable: a prefill call that never connected
        (no request reached it); a decode call that failed in any way but a timeout
        (nothing has gone to the client yet)."""
        kind, url = pool.kind, up.url + route
        with pool.lease(up):
            try:
                async with self.session.post(url, json=body) as resp:
                    if resp.status != 200:
                        raise upstream_status(kind, url, resp.status, await resp.read())
                    try:
                        return await resp.json(content_type=None)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise UpstreamError(502, f"{kind} {url} answered non-JSON: {e}", stage=kind)
            except asyncio.TimeoutError:
                raise UpstreamError(504, f"{kind} {url} did not answer within {self.timeout.total} s",
                                    stage=kind, kind="timeout")
            except aiohttp.ClientError as e:
                self.health.mark_down(pool, up, repr(e))
                never_sent = isinstance(e, aiohttp.ClientConnectorError)
                raise UpstreamError(502, f"{kind} {url} unreachable: {e!r}", stage=kind, kind="unreachable",
                                    retryable=kind == "decode" or never_sent)

    async def _decode(self, request: web.Request, route: str, body: dict, stream: bool,
                      started: list, plan: Plan | None = None) -> web.StreamResponse:
        if not stream:
            data = await self._retrying(self.decode_pool, lambda up: self._decode_json(up, route, body), plan=plan)
            return web.json_response(data)
        sink = ClientSink(request, started)
        await self._retrying(self.decode_pool, lambda up: self._stream(up, route, body, sink), plan=plan)
        return started[0]

    async def _decode_json(self, up: Upstream, route: str, body: dict) -> dict:
        t0 = time.monotonic()
        data = await self._post_json(self.decode_pool, up, route, body)
        self.metrics.decode.labels("false").observe(time.monotonic() - t0)
        return data

    async def _stream(self, up: Upstream, route: str, body: dict, sink: ClientSink) -> None:
        """One streamed decode call into ``sink`` (``streams``). The sink starts with the
        decode's first body byte, not its headers (vLLM sends those before the KV fetch),
        so a decode that dies before its first token can be retried elsewhere."""
        url = up.url + route
        t0 = time.monotonic()
        with self.decode_pool.lease(up):
            try:
                async with self.session.post(url, json=body) as resp:
                    if resp.status != 200:
                        raise upstream_status("decode", url, resp.status, await resp.read())
                    chunk = await resp.content.readany()
                    if not chunk:  # vLLM's streams always carry data: an empty one is a broken upstream
                        raise UpstreamError(502, f"decode {url} ended its stream before any byte", stage="decode",
                                            kind="http_5xx", retryable=True)
                    t1 = time.monotonic()
                    self.metrics.transfer_wait.observe(t1 - t0)
                    await sink.start(resp.headers.get("Content-Type", "text/event-stream"))
                    while chunk:
                        await sink.write(chunk)
                        chunk = await resp.content.readany()
                    await sink.end()
                    self.metrics.decode.labels("true").observe(time.monotonic() - t1)
            except asyncio.TimeoutError:
                raise UpstreamError(504, f"decode {url} did not finish within {self.timeout.total} s"
                                         f"{' (mid-stream)' if sink.begun else ''}", stage="decode",
                                    kind="mid_stream" if sink.begun else "timeout")
            except aiohttp.ClientError as e:
                self.health.mark_down(self.decode_pool, up, repr(e))
                if sink.begun:  # bytes went on: never retried
                    raise UpstreamError(502, f"decode {url} failed mid-stream: {e!r}", stage="decode",
                                        kind="mid_stream")
                raise UpstreamError(502, f"decode {url} failed before its first byte: {e!r}", stage="decode",
                                    kind="unreachable", retryable=True)
