"""Fake prefill and decode instances for the proxy's tests: two aiohttp apps serving
both OpenAI routes with the given handlers, and a ``/health`` that is always ok."""

from __future__ import annotations

import re

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer


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


def tokens_of(body: dict) -> list[int]:
    """The fake tokenizer: a token-id prompt as is; text (a prompt, or chat messages joined by
    newlines) one token per character, its code point."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return prompt
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in body.get("messages", []))
    return [ord(ch) for ch in text]


class FakeVllm:
    """A fake ``vllm serve`` instance that does what routing depends on, over real HTTP:

    * prefill (``kind="prefill"``): answers ``kv_transfer_params`` (the transfer id as the key),
      ``usage.prompt_tokens`` and, when asked (``return_token_ids``), ``prompt_token_ids`` (in
      the choice; top-level for chat), as vLLM 0.32 does;
    * decode: refuses a prompt of ``max_model_len`` tokens or more with vLLM's 400 and message,
      clamps ``max_tokens``, and keeps a prefix cache of page-aligned prompt prefixes: each
      answer's ``moved_pages`` is the pages it did not have (what a real decode fetches);
    * ``/metrics``: ``vllm:dcp2d_instance_info`` from its settings and
      ``vllm:kv_cache_usage_perc`` = ``usage``; ``/health``: 200 while ``healthy``.

    ``hold``: an Event decode calls wait for. ``calls``: the bodies it got."""

    def __init__(self, kind: str, name: str, dcp: int = 1, max_model_len: int = 1024, kv_tokens: int = 1088,
                 block_size: int = 32, max_num_seqs: int = 4):
        self.kind, self.name, self.dcp, self.max_model_len = kind, name, dcp, max_model_len
        self.kv_tokens, self.block_size, self.max_num_seqs = kv_tokens, block_size, max_num_seqs
        self.usage, self.healthy, self.hold = 0.0, True, None
        self.calls: list[dict] = []
        self.moved: list[int] = []  # pages fetched per decode call
        self._cached: set[tuple] = set()
        self.app = web.Application()
        for r in ("/v1/completions", "/v1/chat/completions"):
            self.app.router.add_post(r, self.handle)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)

    async def health(self, request):
        return web.json_response({}, status=200 if self.healthy else 503)

    async def metrics(self, request):
        return web.Response(text=(
            f'vllm:dcp2d_instance_info{{model_name="m",engine="0",dcp_size="{self.dcp}",'
            f'block_size="{self.block_size}",max_model_len="{self.max_model_len}",'
            f'kv_cache_tokens="{self.kv_tokens}",max_num_seqs="{self.max_num_seqs}"}} 1.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} {self.usage}\n'))

    async def handle(self, request):
        body = await request.json()
        self.calls.append(body)
        ids = tokens_of(body)
        if len(ids) >= self.max_model_len:
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"prompt contains {len(ids)} input tokens", "type": "BadRequestError", "code": 400}},
                status=400)
        chat = request.path.endswith("/chat/completions")
        if self.kind == "prefill":
            key = (body.get("kv_transfer_params") or {}).get("transfer_id") or "router-key"
            out = {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": key, "remote_request_id": key,
                                          "remote_bootstrap_addr": "tcp://127.0.0.1:1", "remote_engine_id": self.name},
                   "usage": {"prompt_tokens": len(ids)}, "choices": [{"text": "x"}]}
            if body.get("return_token_ids"):
                (out if chat else out["choices"][0])["prompt_token_ids"] = ids
            return web.json_response(out)
        if self.hold is not None:
            await self.hold.wait()
        pages = [tuple(ids[:k * self.block_size]) for k in range(1, len(ids) // self.block_size + 1)]
        self.moved.append(sum(p not in self._cached for p in pages) + (len(ids) % self.block_size > 0))
        self._cached.update(pages)
        asked = body.get("max_tokens")
        n_out = min(asked if asked is not None else 1 << 30, self.max_model_len - len(ids))
        return web.json_response({"choices": [{"text": self.name, "n_out": n_out}],
                                  "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out}})


class ProxyCluster:
    """Fake prefills and decodes (``self.prefill``, ``self.decode``: objects with ``.app`` and
    ``.name``, set by a subclass) on real HTTP servers behind a real ``Proxy`` built with
    ``self.proxy_kw``; ``url`` maps a fake's name to its base URL. ``async with`` runs it."""

    prefill: list
    decode: list
    proxy_kw: dict

    async def __aenter__(self):
        from vllm_dcp2d.proxy import Proxy

        self.servers = [TestServer(f.app) for f in self.prefill + self.decode]
        for s in self.servers:
            await s.start_server()
        urls = [str(s.make_url("")).rstrip("/") for s in self.servers]
        self.url = dict(zip([f.name for f in self.prefill + self.decode], urls))
        self.proxy = Proxy(urls[:len(self.prefill)], urls[len(self.prefill):], **self.proxy_kw)
        self.px = TestServer(self.proxy.app())
        await self.px.start_server()
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.px.close()
        for s in self.servers:
            await s.close()

    async def metrics(self) -> str:
        async with self.session.get(self.px.make_url("/metrics")) as resp:
            assert resp.status == 200
            return (await resp.read()).decode()


def sample(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (labels in any order), 0 if absent."""
    for m in re.finditer(r"^(\w+)(?:\{(.*)\})? (\S+)$", text, re.M):
        if m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == labels:
            return float(m.group(3))
    return 0.0
