"""Fake prefill and decode instances for the proxy's tests: two aiohttp apps serving
both OpenAI routes with the given handlers, and a ``/health`` that is always ok."""

from __future__ import annotations

from aiohttp import web


async def healthy(request):
    return web.json_response({})


def upstream_apps(prefill, decode) -> list[web.Application]:
    apps = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        app.router.add_get("/health", healthy)
        apps.append(app)
    return apps
