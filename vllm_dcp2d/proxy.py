"""OpenAI-compatible prefill/decode proxy for DCP2DConnector.

``vllm-dcp2d proxy --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]``

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes twice
upstream, round-robin over the instances of each kind:

1. to a prefill instance, as a copy with ``max_tokens=1``, no streaming and
   ``kv_transfer_params={"do_remote_decode": true, "transfer_id": <new id>}``;
   the prefill's DCP2DConnector keeps the request's KV blocks and answers
   with the ``kv_transfer_params`` a decode instance needs to fetch them;
2. to a decode instance, unchanged except for those ``kv_transfer_params``;
   its answer (streamed or not) goes back to the client as is.

With ``--pipelined`` both calls go out at once once the proxy knows the
prefill instance's bootstrap address and engine id (learnt from its first
answer): the decode request carries ``remote_request_id = transfer_id``, its
ranks ask the prefill ranks right away, and each prefill rank writes every
layer to them as soon as the layer is computed (layer pipelining), instead of
the whole request after the prefill answered. If the prefill call fails, the
decode call is cancelled (vLLM aborts the request) and the client gets the
prefill's error.

Upstream failures become HTTP errors: an upstream 4xx is passed through with
its body (the client's request is wrong), an unreachable or failing upstream
gives 502, an upstream that does not answer in ``--timeout`` seconds 504.
A client that hangs up mid-stream is not an upstream failure: the proxy
closes the decode call, so vLLM aborts the request and frees its blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import logging
import uuid

import aiohttp
from aiohttp import web

log = logging.getLogger("vllm_dcp2d.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


class UpstreamError(Exception):
    """An upstream call that failed; ``status`` is what the client gets."""

    def __init__(self, status: int, message: str, body: dict | None = None):
        super().__init__(message)
        self.status = status
        self.body = body or {"error": {"message": message, "type": "upstream_error", "code": status}}


def prefill_body(body: dict, transfer_id: str) -> dict:
    """The prefill copy of a client request: one token, no stream, remote decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "transfer_id": transfer_id}
    return out


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = kv_transfer_params
    return out


class Proxy:
    """Routes requests; one ``aiohttp.ClientSession`` for all upstream calls."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 300.0, pipelined: bool = False):
        if not prefill or not decode:
            raise ValueError(f"need at least one prefill and one decode URL, got prefill={prefill} "
                             f"decode={decode}")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.pipelined = pipelined
        self._routes: dict[str, dict] = {}  # prefill URL -> its remote_bootstrap_addr, remote_engine_id

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        try:
            async with self.session.get(f"{self.decode[0]}/v1/models") as resp:
                return web.json_response(await resp.json(), status=resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode {self.decode[0]} unreachable: {e!r}")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, f"request body must be a JSON object, got {type(body).__name__}")
        path, stream = request.path, bool(body.get("stream"))
        prefill = next(self._next_prefill)
        started: list[web.StreamResponse] = []  # the client response, once its headers went out
        try:
            route = self._routes.get(prefill) if self.pipelined else None
            if route is not None:
                return await self._pipelined(request, path, body, prefill, route, started)
            params = await self._prefill(prefill, path, body, uuid.uuid4().hex)
            return await self._decode(request, path, decode_body(body, params), stream, started)
        except UpstreamError as e:
            log.warning("%s: %s", path, e)
            if started:  # headers are gone already: end the stream with an SSE error event
                msg = {"error": {"message": str(e), "code": e.status}}
                await started[0].write(f"data: {json.dumps(msg)}\n\n".encode())
                await started[0].write_eof()
                return started[0]
            return web.json_response(e.body, status=e.status)

    async def _prefill(self, prefill: str, path: str, body: dict, transfer_id: str) -> dict:
        """Run the prefill; returns the ``kv_transfer_params`` for decode."""
        url = prefill + path
        try:
            data = await self._post_json(url, prefill_body(body, transfer_id), "prefill")
        except UpstreamError:
            self._routes.pop(prefill, None)  # it may come back elsewhere: learn again
            raise
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise UpstreamError(502, f"prefill {url} returned no kv_transfer_params for decode "
                                     f"(got {params!r}); is it running DCP2DConnector as kv_producer?")
        if all(isinstance(params.get(k), str) for k in ("remote_bootstrap_addr", "remote_engine_id")):
            self._routes[prefill] = {k: params[k] for k in ("remote_bootstrap_addr", "remote_engine_id")}
        return params

    async def _pipelined(self, request: web.Request, path: str, body: dict, prefill: str, route: dict,
                         started: list) -> web.StreamResponse:
        """Prefill and decode at once; the decode fetches by ``transfer_id``."""
        tid = uuid.uuid4().hex
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": tid,
                  "transfer_id": tid, **route}
        decode = asyncio.ensure_future(self._decode(request, path, decode_body(body, params),
                                                    bool(body.get("stream")), started))
        try:
            answer = await self._prefill(prefill, path, body, tid)
            if answer.get("remote_request_id") != tid:
                raise UpstreamError(502, f"prefill {prefill} did not take transfer_id {tid!r} as the "
                                         f"transfer key (answered {answer.get('remote_request_id')!r})")
        except BaseException:
            decode.cancel()  # closes the upstream connection: vLLM aborts the decode request
            with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                await decode
            raise
        return await decode

    async def _post_json(self, url: str, body: dict, kind: str) -> dict:
        try:
            async with self.session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise _upstream_status(kind, url, resp.status, await resp.read())
                return await resp.json()
        except asyncio.TimeoutError:
            raise UpstreamError(504, f"{kind} {url} did not answer within {self.timeout.total} s")
        except aiohttp.ClientError as e:
            raise UpstreamError(502, f"{kind} {url} unreachable: {e!r}")

    async def _decode(self, request: web.Request, path: str, body: dict, stream: bool,
                      started: list) -> web.StreamResponse:
        url = next(self._next_decode) + path
        if not stream:
            return web.json_response(await self._post_json(url, body, "decode"))
        try:
            async with self.session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise _upstream_status("decode", url, resp.status, await resp.read())
                out = web.StreamResponse(status=200, headers={
                    "Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
                await out.prepare(request)
                started.append(out)
                try:
                    async for chunk in resp.content.iter_any():
                        await _to_client(out.write(chunk))
                    await _to_client(out.write_eof())
                except ClientGone:
                    # Not a decode failure. Leaving this block closes the upstream
                    # connection, so vLLM aborts the request and frees its blocks.
                    log.info("%s: client disconnected mid-stream; decode %s aborted", path, url)
                return out
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            # after the headers went out, ``handle`` ends the stream with an SSE error event
            raise UpstreamError(504 if isinstance(e, asyncio.TimeoutError) else 502,
                                f"decode {url} failed{' mid-stream' if started else ''}: {e!r}")


class ClientGone(Exception):
    """The client's connection closed while the proxy was writing to it."""


async def _to_client(write) -> None:
    """Await a write to the client; its connection being gone raises ``ClientGone``
    (aiohttp raises a ``ClientConnectionResetError``, which is also an aiohttp client
    error and would otherwise read as a failing upstream)."""
    try:
        await write
    except ConnectionResetError as e:
        raise ClientGone() from e


def _upstream_status(kind: str, url: str, status: int, raw: bytes) -> UpstreamError:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    text = raw[:500].decode(errors="replace")
    if 400 <= status < 500:
        return UpstreamError(status, f"{kind} {url} rejected the request ({status}): {text}",
                             body if isinstance(body, dict) else None)
    return UpstreamError(502, f"{kind} {url} failed ({status}): {text}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}},
                             status=status)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-dcp2d proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="prefill instance base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="decode instance base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per upstream call")
    p.add_argument("--pipelined", action="store_true",
                   help="send prefill and decode at once (layer-pipelined transfer); see the module doc")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, args.timeout, args.pipelined)
    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, proxy.prefill, proxy.decode)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0
