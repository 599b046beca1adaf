"""Batched completions and n > 1 through the proxy, against fake prefill/decode
upstreams (no vLLM) that answer per prompt as vLLM does: the split (``batch.split``),
the merge of plain and streamed answers (order, ``index = prompt * n + j``, usage),
one failing prompt, cancellation when a sibling fails or the client goes away,
and the bound on concurrent pairs."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fake_upstreams import upstream_apps
from vllm_dcp2d.proxy import Proxy
from vllm_dcp2d.proxy.batch import StreamMerge, merge_answers, split


def tokens(prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def answer_of(prompt, n: int, cid: str) -> dict:
    """What a vLLM decode answers for one prompt with ``n`` choices (2 tokens each)."""
    usage = {"prompt_tokens": tokens(prompt), "completion_tokens": 2 * n, "total_tokens": tokens(prompt) + 2 * n}
    return {"id": cid, "object": "text_completion", "model": "m",
            "choices": [{"index": j, "text": f"{prompt}/{j}", "finish_reason": "length"} for j in range(n)],
            "usage": usage}


def sse_of(prompt, n: int, cid: str, usage: bool) -> list[bytes]:
    """A vLLM stream for one prompt: per choice two text chunks, then the usage chunk."""
    out = []
    for part in ("a", "b"):
        for j in range(n):
            out.append({"id": cid, "choices": [{"index": j, "text": f"{prompt}/{j}{part}"}]})
    if usage:
        out.append({"id": cid, "choices": [], "usage": answer_of(prompt, n, cid)["usage"]})
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]


def expected(prompts: list, n: int) -> dict:
    return merge_answers([answer_of(p, n, f"cmpl-{i}") for i, p in enumerate(prompts)], n)


class Fakes:
    """Prefill and decode upstreams. The prefill echoes the prompt in its params so
    the decode can check it got the KV of its own prompt. ``fail``: a prompt whose
    prefill answers 400 once ``gate`` is set; ``hang``: a prompt whose decode never
    answers (until cancelled)."""

    def __init__(self, fail=None, hang=None, delay_s=0.0):
        self.seen: list[tuple[str, dict]] = []
        self.fail, self.hang, self.delay_s = fail, hang, delay_s
        self.gate = asyncio.Event()          # set when a hanging decode is in flight
        self.cancelled: list = []            # decode calls the proxy closed
        self.in_flight = self.most_in_flight = 0

    def _enter(self):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

    async def prefill(self, request):
        body = await request.json()
        self.seen.append(("prefill", body))
        self._enter()
        try:
            await asyncio.sleep(random.uniform(0, self.delay_s))
            if body["prompt"] == self.fail:
                await asyncio.wait_for(self.gate.wait(), 10)
                return web.json_response({"error": {"message": f"bad prompt {body['prompt']!r}", "code": 400}},
                                         status=400)
            params = {"do_remote_prefill": True, "transfer_id": body["kv_transfer_params"]["transfer_id"],
                      "prompt": body["prompt"]}
            return web.json_response({"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})
        finally:
            self.in_flight -= 1

    async def decode(self, request):
        body = await request.json()
        self.seen.append(("decode", body))
        prompt, n = body["prompt"], body.get("n", 1)
        assert body["kv_transfer_params"]["prompt"] == prompt  # its own prompt's KV
        cid = f"cmpl-{len(self.seen)}"
        self._enter()
        try:
            if prompt == self.hang:
                self.gate.set()
                try:
                    await asyncio.Event().wait()  # only the proxy closing the call ends it
                except asyncio.CancelledError:
                    self.cancelled.append(prompt)
                    raise
            await asyncio.sleep(random.uniform(0, self.delay_s))
            if not body.get("stream"):
                return web.json_response(answer_of(prompt, n, cid))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            for event in sse_of(prompt, n, cid, usage):
                await resp.write(event)
                await asyncio.sleep(random.uniform(0, self.delay_s))
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    def apps(self):
        return upstream_apps(self.prefill, self.decode)


async def through_proxy(fakes: Fakes, body: dict, path="/v1/completions", concurrency=8, client_timeout_s=15.0):
    """(status, body) of ``body`` sent through a proxy over ``fakes``; (None, b"") if the
    client gave up after ``client_timeout_s``. A hanging decode must have been
    cancelled by the proxy (within 10 s) before this returns: the servers' own
    shutdown would cancel it too, later."""
    p_app, d_app = fakes.apps()
    async with TestServer(p_app) as p, TestServer(d_app) as d:
        proxy = Proxy([str(p.make_url(""))], [str(d.make_url(""))], timeout_s=20, batch_concurrency=concurrency)
        async with TestServer(proxy.app()) as px, aiohttp.ClientSession() as s:
            try:
                async with s.post(px.make_url(path), json=body,
                                  timeout=aiohttp.ClientTimeout(total=client_timeout_s)) as resp:
                    out = resp.status, await resp.read()
            except asyncio.TimeoutError:
                out = None, b""
            for _ in range(200):
                if fakes.hang is None or fakes.cancelled:
                    break
                await asyncio.sleep(0.05)
            return (*out, list(fakes.cancelled))


def events(raw: bytes) -> list:
    out = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert out[-1] == b"[DONE]", raw
    return [json.loads(e) for e in out[:-1]]


def test_split():
    b = {"prompt": ["a b", "c"], "n": 2, "max_tokens": 3}
    assert split("/v1/completions", b) == [{**b, "prompt": "a b"}, {**b, "prompt": "c"}]
    assert split("/v1/completions", {"prompt": [[1, 2], [3]]}) == [{"prompt": [1, 2]}, {"prompt": [3]}]
    assert split("/v1/completions", {"prompt_embeds": ["e1", "e2"]}) == [{"prompt_embeds": "e1"},
                                                                         {"prompt_embeds": "e2"}]
    for one in ({"prompt": [1, 2, 3]}, {"prompt": "a"}, {"prompt": ["a"]}, {"prompt": [[1]]}, {"prompt": []},
                {"prompt": ["a", [1]]}, {"prompt": ["a", "b"], "prompt_embeds": ["e"]}):
        assert split("/v1/completions", one) is None, one
    assert split("/v1/chat/completions", {"prompt": ["a", "b"]}) is None


@given(st.integers(1, 5), st.integers(1, 3), st.randoms(use_true_random=False))
def test_stream_merge(prompts, n, rnd):
    """Any interleaving of the prompts' streams, cut at any byte: each choice's text in
    order under index ``i * n + j``, one id, one summed usage chunk last, then [DONE]."""
    merge = StreamMerge(prompts, n)
    names = [f"p{i} w" for i in range(prompts)]
    pieces = []
    for i, name in enumerate(names):
        raw = b"".join(sse_of(name, n, f"cmpl-{i}", usage=True))
        cuts = sorted(rnd.sample(range(1, len(raw)), k=min(len(raw) - 1, rnd.randint(0, 8))))
        pieces.append([(i, raw[a:b]) for a, b in zip([0, *cuts], [*cuts, len(raw)])])
    out = []
    while any(pieces):
        queue = rnd.choice([q for q in pieces if q])
        i, chunk = queue.pop(0)
        out += merge.feed(i, chunk)
    got = events(b"".join(out + merge.tail()))
    assert len({e["id"] for e in got}) == 1
    texts: dict[int, str] = {}
    for e in got[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i * n + j: f"{names[i]}/{j}a{names[i]}/{j}b" for i in range(prompts) for j in range(n)}
    want = expected(names, n)["usage"]
    assert got[-1]["choices"] == [] and got[-1]["usage"] == want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prompt", [["one", "two words", "three more words"], [[5, 6], [7], [8, 9, 10]]])
@pytest.mark.parametrize("n", [1, 2])
def test_batch(prompt, n):
    """Plain answer: every choice in prompt order with index i * n + j, usage summed;
    each prefill hop one prompt with n=1, each decode hop one prompt with the client's n."""
    fakes = Fakes(delay_s=0.05)
    body = {"model": "m", "prompt": prompt, "n": n, "max_tokens": 2, "temperature": 0.5, "seed": 3}
    status, raw, _ = asyncio.run(through_proxy(fakes, body))
    assert status == 200, raw
    got = json.loads(raw)
    assert got == expected(prompt, n) | {"id": got["id"]}
    assert [c["index"] for c in got["choices"]] == list(range(3 * n))
    hops = {kind: sorted((json.dumps(b["prompt"]), b.get("n")) for k, b in fakes.seen if k == kind)
            for kind in ("prefill", "decode")}
    assert hops["prefill"] == sorted((json.dumps(p), 1) for p in prompt)
    assert hops["decode"] == sorted((json.dumps(p), n) for p in prompt)
    keys = [b["kv_transfer_params"]["transfer_id"] for k, b in fakes.seen if k == "prefill"]
    assert len(set(keys)) == 3  # one transfer key per prompt


@pytest.mark.timeout(60)
@pytest.mark.parametrize("usage", [True, False])
def test_batch_streamed(usage):
    fakes = Fakes(delay_s=0.05)
    prompts = ["a", "b c", "d e f"]
    body = {"model": "m", "prompt": prompts, "n": 2, "max_tokens": 2, "temperature": 1.0, "stream": True,
            **({"stream_options": {"include_usage": True}} if usage else {})}
    status, raw, _ = asyncio.run(through_proxy(fakes, body))
    assert status == 200, raw
    got = events(raw)
    texts: dict[int, str] = {}
    for e in got:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i * 2 + j: f"{p}/{j}a{p}/{j}b" for i, p in enumerate(prompts) for j in range(2)}
    assert len({e["id"] for e in got}) == 1
    usages = [e for e in got if not e["choices"]]
    assert usages == ([got[-1]] if usage else [])
    if usage:
        assert got[-1]["usage"] == expected(prompts, 2)["usage"]
    assert all(b.get("stream") is False and "stream_options" not in b for k, b in fakes.seen if k == "prefill")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_one_prompt_fails(stream):
    """The race, made deterministic: prompt "bad"'s prefill answers 400 only once prompt
    "good"'s decode is in flight. The client gets the prefill's 400 and body (no partial
    answer, stream or not), "good"'s decode call is closed (vLLM would abort it), and
    "bad" never reaches a decode."""
    fakes = Fakes(fail="bad", hang="good")
    body = {"model": "m", "prompt": ["good", "bad"], "max_tokens": 2, "stream": stream}
    status, raw, _ = asyncio.run(through_proxy(fakes, body))
    assert (status, json.loads(raw)) == (400, {"error": {"message": "bad prompt 'bad'", "code": 400}})
    assert fakes.cancelled == ["good"]
    assert [b["prompt"] for k, b in fakes.seen if k == "decode"] == ["good"]


@pytest.mark.timeout(60)
def test_client_gone_cancels_pairs():
    fakes = Fakes(hang="a")
    body = {"model": "m", "prompt": ["a", "b"], "max_tokens": 2}
    status, _, cancelled = asyncio.run(through_proxy(fakes, body, client_timeout_s=1.0))
    assert status is None and cancelled == ["a"]


@pytest.mark.timeout(60)
def test_concurrency_bound():
    fakes = Fakes(delay_s=0.05)
    prompts = [f"p{i}" for i in range(7)]
    status, raw, _ = asyncio.run(through_proxy(fakes, {"model": "m", "prompt": prompts, "max_tokens": 2},
                                               concurrency=2))
    assert status == 200 and json.loads(raw)["choices"] == expected(prompts, 1)["choices"]
    assert fakes.most_in_flight == 2  # each pair's hops run one after the other


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "m", "prompt": "one", "n": 3, "temperature": 0.8, "seed": 1, "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "m", "prompt": "one", "n": 2, "best_of": 2, "max_completion_tokens": 2,
                              "min_tokens": 2}),
])
def test_n_one_pair(path, body):
    """n > 1 (and chat) is one pair: the prefill hop one sequence, the decode the client's."""
    fakes = Fakes()
    status, raw, _ = asyncio.run(through_proxy(fakes, body, path))
    assert status == 200
    assert json.loads(raw)["choices"] == answer_of("one", body["n"], "")["choices"]
    (_, pre), (_, dec) = fakes.seen
    assert pre["n"] == 1 and "best_of" not in pre and pre.get("min_tokens", 0) == 0
    assert dec == {**body, "kv_transfer_params": dec["kv_transfer_params"]}


def test_stream_merge_error_event():
    """An upstream's in-band error (vLLM's generation error) is passed on at once, and
    the stream then ends with [DONE] alone: no usage chunk for a failed batch."""
    merge = StreamMerge(2, 1)
    ok = sse_of("a", 1, "cmpl-0", usage=True)
    assert merge.feed(0, b"".join(ok[:1])) == [b'data: {"id": "cmpl-0", "choices": [{"index": 0, "text": "a/0a"}]}\n\n']
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    assert merge.feed(1, error) == [error] and merge.failed
    assert merge.tail() == [b"data: [DONE]\n\n"]
