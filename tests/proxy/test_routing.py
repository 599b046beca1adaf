"""Routing (``proxy/routing.py``): decode groups by DCP size and session affinity, against
fake vLLM instances over real HTTP (``tests/support/fake_upstreams.FakeVllm``: they tokenize,
refuse over-long prompts with vLLM's 400, serve ``vllm:dcp2d_instance_info`` and count the
pages each decode call had to fetch), and the policy alone over drawn decode states."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fake_upstreams import FakeVllm, ProxyCluster, sample
from vllm_dcp2d.proxy.fit import DecodeInfo, Need
from vllm_dcp2d.proxy.metrics import PREFIX
from vllm_dcp2d.proxy.routing import Plan, Policy, Router, TooLong
from vllm_dcp2d.proxy.upstreams import NoHealthyUpstream, Pool

PAGE = 32


class Cluster(ProxyCluster):
    """Fake prefills and decodes (``FakeVllm`` keyword sets) behind a real ``Proxy``."""

    def __init__(self, decodes: list[dict], n_prefill: int = 1, **proxy_kw):
        self.prefill = [FakeVllm("prefill", f"p{i}", max_model_len=1 << 20) for i in range(n_prefill)]
        self.decode = [FakeVllm("decode", f"d{i}", **kw) for i, kw in enumerate(decodes)]
        self.proxy_kw = {"timeout_s": 10, "health_interval_s": 0.05, "health_timeout_s": 1, **proxy_kw}

    async def post(self, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
        async with self.session.post(self.px.make_url(path), json={"model": "m", **body}) as resp:
            return resp.status, json.loads(await resp.read())

    async def served_by(self, body: dict, path: str = "/v1/completions") -> str:
        status, out = await self.post(body, path)
        assert status == 200, out
        return out["choices"][0]["text"]




def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


# the e2e cluster's decodes (tests/support/pd_cluster.py): the same KV per rank, 34 pages
DCP1 = {"dcp": 1, "max_model_len": 1024, "kv_tokens": 1088}
DCP2 = {"dcp": 2, "max_model_len": 2048, "kv_tokens": 2176}


# ---- decode groups ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["ids", "text", "chat"])
def test_a_request_only_dcp2_holds_goes_there_and_short_ones_to_dcp1(form):
    """The issue's cluster: a DCP=1 decode (1,024 tokens) and a DCP=2 one with the same KV per
    rank (2,048). Least-in-flight balancing sent 2 of 3 requests of 1,600 tokens to DCP=1, which
    refused them (400); routed, every one is answered by DCP=2 and every short one by DCP=1
    (the cheaper step), whatever the prompt's form (the length comes from the prefill's answer
    for text and chat)."""
    def req(n: int, seed: int) -> tuple[dict, str]:
        if form == "ids":
            return {"prompt": ids(n, seed), "max_tokens": 12}, "/v1/completions"
        text = "".join(chr(97 + t % 26) for t in ids(n, seed))
        if form == "text":
            return {"prompt": text, "max_tokens": 12}, "/v1/completions"
        return {"messages": [{"role": "user", "content": text}], "max_completion_tokens": 12}, "/v1/chat/completions"

    async def go():
        async with Cluster([DCP1, DCP2]) as c:
            long = [await c.served_by(*req(1600, s)) for s in range(3)]
            short = [await c.served_by(*req(200, 10 + s)) for s in range(3)]
            return c, long, short, await c.metrics()
    c, long, short, m = run(go())
    assert long == ["d1"] * 3 and short == ["d0"] * 3
    # the prefill is asked for the prompt's ids only where the proxy lacks them
    assert [bool(b.get("return_token_ids")) for b in c.prefill[0].calls] == [form != "ids"] * 6
    assert sample(m, PREFIX + "routed_total", dcp_size="2", reason="fits") == 3
    assert sample(m, PREFIX + "routed_total", dcp_size="1", reason="fits") == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["ids", "text"])
def test_a_request_no_decode_admits_gets_400_naming_the_longest(form):
    """3,000 tokens: no decode admits it; the client gets 400 naming 2,048 tokens, the longest
    context served. A token-id prompt is refused by the proxy before the prefill computes
    anything; a text prompt's length comes from the prefill's answer, so it goes to the DCP=2
    decode, whose own 400 names its length (and whose connector frees the prefill's KV at
    once), never to the DCP=1 one."""
    async def go():
        async with Cluster([DCP1, DCP2]) as c:
            prompt = ids(3000, 1) if form == "ids" else "y" * 3000
            status, out = await c.post({"prompt": prompt, "max_tokens": 4})
            return c, status, out, await c.metrics()
    c, status, out, m = run(go())
    msg = out["error"]["message"]
    assert [len(d.calls) for d in c.decode] == [0, 0 if form == "ids" else 1]
    assert len(c.prefill[0].calls) == (0 if form == "ids" else 1)
    if form == "ids":
        assert status == 400 and "longest context served is 2048 tokens (DCP=2" in msg, out
        assert sample(m, PREFIX + "errors_total", stage="proxy", kind="too_long") == 1
    else:
        assert status == 400 and "maximum context length is 2048 tokens" in msg, out
        assert sample(m, PREFIX + "routed_total", dcp_size="2", reason="too_long") == 1


@pytest.mark.timeout(60)
def test_whole_answer_first_then_the_longest_context_that_admits_it():
    """A 900-token prompt with max_tokens 500 fits (whole) only DCP=2; with max_tokens 1,500
    (above both lengths' room) vLLM would clamp it: it goes to the longest context, DCP=2, as
    a colocated instance of that length would answer."""
    async def go():
        async with Cluster([DCP1, DCP2]) as c:
            a = await c.post({"prompt": ids(900, 1), "max_tokens": 500})
            b = await c.post({"prompt": ids(900, 2), "max_tokens": 1500})
            return a, b
    (sa, a), (sb, b) = run(go())
    assert (sa, a["choices"][0]["text"], a["choices"][0]["n_out"]) == (200, "d1", 500)
    assert (sb, b["choices"][0]["text"], b["choices"][0]["n_out"]) == (200, "d1", 2048 - 900)


@pytest.mark.timeout(60)
def test_short_requests_fall_back_to_dcp2_when_dcp1_has_no_room():
    """DCP=1 reports its KV 95 % used: a short request goes to DCP=2 (fallback); with both
    full, to the decode with the most free KV (full). With DCP=1's two sequence slots held by
    calls in flight, the third goes to DCP=2."""
    async def go():
        async with Cluster([{**DCP1, "max_num_seqs": 2}, DCP2]) as c:
            d1, d2 = c.proxy.decode_pool.upstreams
            c.decode[0].usage = 0.95
            await until(lambda: d1.kv_usage == 0.95)
            fallback = await c.served_by({"prompt": ids(200, 1), "max_tokens": 8})
            c.decode[1].usage = 0.99
            await until(lambda: d2.kv_usage == 0.99)
            full = await c.served_by({"prompt": ids(60, 2), "max_tokens": 8})  # 54 free on d0, 22 on d1
            c.decode[0].usage = c.decode[1].usage = 0.0
            await until(lambda: d1.kv_usage == d2.kv_usage == 0.0)
            c.decode[0].hold = asyncio.Event()
            held = [asyncio.ensure_future(c.served_by({"prompt": ids(100, 3 + i), "max_tokens": 8})) for i in (0, 1)]
            await until(lambda: len(c.decode[0].calls) == 3)
            third = await c.served_by({"prompt": ids(100, 9), "max_tokens": 8})
            c.decode[0].hold.set()
            return fallback, full, await asyncio.gather(*held), third, await c.metrics(), c
    fallback, full, held, third, m, c = run(go())
    assert (fallback, full, held, third) == ("d1", "d0", ["d0", "d0"], "d1")
    assert sample(m, PREFIX + "routed_total", dcp_size="2", reason="fallback") == 2
    assert sample(m, PREFIX + "routed_total", dcp_size="1", reason="full") == 1
    assert [u.in_flight_tokens for u in c.proxy.decode_pool.upstreams] == [0, 0]  # every reservation released


@pytest.mark.timeout(60)
def test_pipelined_routes_token_ids_by_length_and_text_to_the_longest_context():
    """``--pipelined`` picks the decode before the prefill answers: a token-id prompt is routed
    by its length as always; a text prompt, whose length is not known yet, goes to the decodes
    of the longest ``max_model_len`` (nothing a decode admits is refused there), by its session
    key only."""
    async def go():
        async with Cluster([DCP1, DCP2], pipelined=True) as c:
            await c.served_by({"prompt": ids(100, 1), "max_tokens": 4})  # learns the prefill's bootstrap
            short_ids = [await c.served_by({"prompt": ids(100, 2 + i), "max_tokens": 4}) for i in range(2)]
            long_ids = await c.served_by({"prompt": ids(1600, 5), "max_tokens": 4})
            text = [await c.served_by({"prompt": "z" * n, "max_tokens": 4}) for n in (100, 1600)]
            pipelined = [b["kv_transfer_params"].get("remote_request_id") is not None for b in c.decode[1].calls]
            return short_ids, long_ids, text, pipelined, await c.metrics()
    short_ids, long_ids, text, pipelined, m = run(go())
    assert (short_ids, long_ids, text) == (["d0", "d0"], "d1", ["d1", "d1"])
    assert pipelined == [True, True, True]  # sent with the prefill, not after it
    assert sample(m, PREFIX + "routed_total", dcp_size="2", reason="unknown") == 2


@pytest.mark.timeout(60)
def test_least_loaded_routing_is_the_old_balancer():
    """``--routing least-loaded`` (policy None): calls alternate whatever they hold, and a long
    request meets the DCP=1 decode's 400 (the issue's symptom, kept as the baseline)."""
    async def go():
        async with Cluster([DCP1, DCP2], policy=None) as c:
            return [await c.post({"prompt": ids(1600, s), "max_tokens": 12}) for s in range(2)]
    out = run(go())
    assert sorted(s for s, _ in out) == [200, 400]


# ---- session affinity ------------------------------------------------------------------------------

def turns(n_turns: int, first: int = 500, more: int = 60, seed: int = 0) -> list[list[int]]:
    """An agent session's prompts: each is the one before, its answer and ``more`` new tokens."""
    prompts = [ids(first, seed)]
    for t in range(1, n_turns):
        prompts.append(prompts[-1] + ids(12 + more, 1000 * seed + t))
    return prompts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["ids", "text"])
def test_a_sessions_turns_stay_on_one_decode_and_move_only_new_pages(form):
    """Two DCP=1 decodes; two sessions of 7 turns interleaved (500 tokens, +72 per turn). Each
    session's turns go to one decode, the first turn moves the whole prompt and each later one
    only its new pages (the fake decode's count); before, least-in-flight alternated them, so
    each turn moved the history again. Text prompts get their ids from the prefill's answer."""
    def body(p: list[int]) -> dict:
        return {"prompt": p if form == "ids" else "".join(chr(0x100 + t) for t in p), "max_tokens": 12}

    async def go():
        async with Cluster([DCP1, DCP1]) as c:
            sessions = [turns(7, seed=s) for s in (1, 2)]
            where = {0: [], 1: []}
            for t in range(7):
                for s in (0, 1):
                    where[s].append(await c.served_by(body(sessions[s][t])))
            return c, where, await c.metrics()
    c, where, m = run(go())
    assert all(len(set(w)) == 1 for w in where.values()) and where[0][0] != where[1][0], where
    for d in c.decode:
        first, *later = d.moved
        assert first == -(-500 // PAGE) and all(x <= -(-72 // PAGE) + 2 for x in later), d.moved
    assert sample(m, PREFIX + "affinity_total", outcome="miss") == 2
    assert sample(m, PREFIX + "affinity_total", outcome="hit") == 12
    assert sample(m, PREFIX + "affinity_total", outcome="move") == 0


async def until(cond, timeout_s: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "not in time"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_dead_decode_loses_only_its_own_sessions():
    """Four sessions over two decodes; decode 0 dies. Its sessions move once to decode 1 (each
    moves its whole history once) and stay there; decode 1's sessions never move. When decode 0
    comes back nothing moves back (the sessions' history is on decode 1 now)."""
    async def go():
        async with Cluster([DCP1, DCP1]) as c:
            sessions = [turns(6, seed=s) for s in range(4)]
            where = {s: [await c.served_by({"prompt": sessions[s][0], "max_tokens": 12})] for s in range(4)}
            for s in range(4):
                where[s].append(await c.served_by({"prompt": sessions[s][1], "max_tokens": 12}))
            c.decode[0].healthy = False
            await until(lambda: not c.proxy.decode_pool.upstreams[0].healthy)
            for t in (2, 3):
                for s in range(4):
                    where[s].append(await c.served_by({"prompt": sessions[s][t], "max_tokens": 12}))
            c.decode[0].healthy = True
            await until(lambda: c.proxy.decode_pool.upstreams[0].healthy)
            for t in (4, 5):
                for s in range(4):
                    where[s].append(await c.served_by({"prompt": sessions[s][t], "max_tokens": 12}))
            return c, where, await c.metrics()
    c, where, m = run(go())
    on0 = [s for s in range(4) if where[s][0] == "d0"]
    assert len(on0) == 2, where  # ties round-robin: two sessions each
    for s in range(4):
        assert where[s] == [where[s][0]] * 2 + ["d1"] * 4, (s, where[s])
    assert sample(m, PREFIX + "affinity_total", outcome="move") == 2
    assert sample(m, PREFIX + "affinity_total", outcome="hit") == 4 + 6 + 8
    # decode 1 fetched each moved session's whole history once, then new pages only
    assert sorted(c.decode[1].moved)[-2:] == [-(-len(turns(3)[2]) // PAGE)] * 2, c.decode[1].moved


@pytest.mark.timeout(60)
def test_an_overloaded_decode_lets_its_session_move():
    """A session's decode holds ``slack`` + 1 calls more than the other: the next turn moves
    (and the session then stays where it went)."""
    async def go():
        big = {**DCP1, "max_num_seqs": 8, "kv_tokens": 8192}  # KV room is not what moves it here
        async with Cluster([big, big],
                           policy=Policy(slack=1)) as c:
            s = turns(4, seed=3)
            first = await c.served_by({"prompt": s[0], "max_tokens": 12})
            busy = c.decode[int(first[1])]
            busy.hold = asyncio.Event()
            # two branches of the session's first prompt: they go to its decode too, and stay there
            held = [asyncio.ensure_future(c.post({"prompt": s[0] + ids(20, 50 + i), "max_tokens": 4}))
                    for i in range(2)]
            await until(lambda: len(busy.calls) == 3)
            moved = await c.served_by({"prompt": s[1], "max_tokens": 12})
            busy.hold.set()
            await asyncio.gather(*held)
            stays = await c.served_by({"prompt": s[2], "max_tokens": 12})
            return first, moved, stays, await c.metrics()
    first, moved, stays, m = run(go())
    assert moved != first and stays == moved
    assert sample(m, PREFIX + "affinity_total", outcome="move") == 1


@pytest.mark.timeout(60)
def test_session_id_and_user_are_explicit_keys_and_the_prefill_follows():
    """Unrelated prompts with one ``session_id`` (or ``user``) go to one decode and one prefill;
    the keys are known before the prefill hop, so the prefill is the session's too."""
    async def go():
        async with Cluster([DCP1, DCP1], n_prefill=2) as c:
            out = {}
            for key in ({"session_id": "a"}, {"session_id": "b"}, {"user": "u1"}, {"user": "u2"}):
                got = [await c.served_by({"prompt": f"turn {i} of {key}", "max_tokens": 4, **key}) for i in range(4)]
                prefills = [p.name for p in c.prefill for _ in p.calls]
                out[json.dumps(key)] = got
                for p in c.prefill:
                    p.calls.clear()
                out[json.dumps(key) + "prefill"] = prefills
            return out
    out = run(go())
    for k, v in out.items():
        assert len(set(v)) == 1 and len(v) == 4, (k, v)


# ---- the policy alone ---------------------------------------------------------------------------

decode_state = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([512, 1024, 2048]), st.floats(0, 1),
                         st.integers(0, 6), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(decode_state, min_size=1, max_size=5), st.integers(1, 2100), st.one_of(st.none(), st.integers(1, 600)),
       st.integers(1, 3))
def test_the_pick_is_the_smallest_dcp_that_fits_with_room(states, prompt, max_tokens, n):
    """Over drawn decodes (DCP size, length, KV usage, calls in flight, healthy, said what it is):
    a client's token-id prompt no decode admits is ``TooLong`` exactly when every decode said
    what it is; after the prefill, a pick is healthy, admits the request (or, when none does,
    is of the longest context), fits it whole whenever a healthy decode does, and has room
    whenever a healthy fitting decode has, with the smallest DCP size among those; reservations
    come back to 0."""
    router = Router(Pool("prefill", ["http://p:1"]),
                    Pool("decode", [f"http://d{i}:1" for i in range(len(states))]), Policy(affinity_entries=0))
    for u, (dcp, mml, usage, out, healthy, known) in zip(router.decode_pool.upstreams, states):
        u.info = DecodeInfo(dcp, 32, mml, (mml + 64) * dcp, 4) if known else None
        u.kv_usage, u.outstanding, u.healthy = usage, out, healthy
    plan = Plan({"max_tokens": max_tokens, "n": n})
    router.learn(plan, prompt, None)
    need = plan.need
    ups = router.decode_pool.upstreams
    ok = [u for u in ups if u.healthy]
    fitting = [u for u in ok if u.info and need.fits(u.info)]
    roomy = [u for u in fitting if router._room(u, need) >= 0]
    with_ids = Plan({"max_tokens": max_tokens, "n": n})
    try:
        router.learn(with_ids, prompt, None)
        router.check_fits(with_ids)  # what plan() does with a client's token ids, before the prefill
        assert any(u.info is None or need.admitted(u.info) for u in ups)
    except TooLong:
        assert all(u.info is not None and not need.admitted(u.info) for u in ups)
    try:
        d = router.pick_decode(plan)  # after the prefill: never TooLong
    except NoHealthyUpstream:  # none in rotation, or only decodes out of rotation admit it
        assert not ok or (all(u.info is not None and not need.admitted(u.info) for u in ok)
                          and any(u.info is not None and need.admitted(u.info) for u in ups))
        return
    up = d.upstream
    assert up.healthy
    if up.info is None:
        assert not any(u.info and need.admitted(u.info) for u in ok)
    elif d.reason == "too_long":  # no decode admits it: the longest context refuses it itself
        assert not any(u.info is not None and need.admitted(u.info) for u in ups)
        assert up.info.max_model_len == max(u.info.max_model_len for u in ok)
    else:
        assert need.admitted(up.info)
        if fitting:
            assert need.fits(up.info)
            if roomy:
                assert up in roomy and up.info.dcp_size == min(u.info.dcp_size for u in roomy), d
    assert up.in_flight_tokens == plan.reserved
    router.release(plan)
    assert all(u.in_flight_tokens == 0 for u in ups)


def test_a_polled_usage_is_not_the_proxys_own_calls_twice():
    """A session's turn ends and its next one comes before the next poll: the poll still counted
    the previous turn's KV, which the proxy held then and released since; the next turn must find
    room on its decode (it moved away before: the e2e cluster's turn 2 went to DCP=2)."""
    router = Router(Pool("prefill", ["http://p:1"]), Pool("decode", ["http://d0:1", "http://d1:1"]))
    d0, d1 = router.decode_pool.upstreams
    d0.info, d1.info = DecodeInfo(1, 32, 1024, 1088, 4), DecodeInfo(2, 32, 2048, 2176, 4)
    turn1 = router.plan({"max_tokens": 12}, ids(500, 1))
    assert router.pick_decode(turn1).upstream is d0
    d0.kv_usage, d0.in_flight_at_poll = 16 / 34, d0.in_flight_tokens  # polled while turn 1 ran
    router.release(turn1)
    turn2 = router.plan({"max_tokens": 12}, ids(500, 1) + ids(72, 2))
    d = router.pick_decode(turn2)
    assert (d.upstream, d.reason, d.affinity) == (d0, "affinity", "hit")


def test_need_follows_vllms_rules():
    """vLLM 0.32 refuses a prompt of max_model_len tokens or more and max_tokens above it, and
    clamps max_tokens to what is left; a bad max_tokens is the decode's to refuse."""
    info = DecodeInfo(1, 32, 1024, 1088, 4)
    assert Need.of({"max_tokens": 24}, 1000).fits(info) and not Need.of({"max_tokens": 25}, 1000).fits(info)
    assert Need.of({"max_tokens": 500}, 1000).admitted(info) and not Need.of({}, 1024).admitted(info)
    assert not Need.of({"max_tokens": 1025}, 10).admitted(info)
    assert Need.of({"max_tokens": 500, "n": 2}, 1000).kv_tokens(info) == 1000 + 2 * 24
    assert Need.of({}, 100).kv_tokens(info) == 1024
    chat = Need.of({"max_tokens": 7, "max_completion_tokens": 9}, 10)
    assert chat.max_tokens == 9 and Need.of({"max_tokens": -1, "n": True}, 10) == Need(10, None, 1)


# ---- vLLM's router, for its users (issue 50, item 3) -----------------------------------------------

@pytest.mark.timeout(120)
def test_vllm_router_consistent_hash_keeps_named_sessions_but_knows_no_decode_group(tmp_path):
    """What docs/serving.md "Behind vLLM's router" says of vllm-router 0.1.17 (``--decode-policy
    consistent_hash``, NIXL protocol) over the same fakes: a session named in ``user`` or
    ``session_id`` stays on one decode; one not named does not; and a request only the DCP=2
    decode admits is refused whenever its body hashes to the DCP=1 decode."""
    from vllm_dcp2d.local.servers import Process, bin_path, free_port, wait_all

    router_bin = bin_path("vllm-router")
    if not __import__("os").path.exists(router_bin):
        pytest.skip("vllm-router is not installed in this environment")

    async def go():
        insts = [FakeVllm("prefill", "p0", max_model_len=1 << 20), FakeVllm("decode", "d0", **DCP1),
                 FakeVllm("decode", "d1", **DCP2)]
        servers = [TestServer(f.app, host="127.0.0.1") for f in insts]
        for s in servers:
            await s.start_server()
        urls = [str(s.make_url("")).rstrip("/") for s in servers]
        port = free_port()
        router = Process("router", [router_bin, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                                    "--decode-policy", "consistent_hash", "--host", "127.0.0.1", "--port", str(port),
                                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                    "--worker-startup-check-interval", "1", "--prefill", urls[0],
                                    "--decode", urls[1], "--decode", urls[2]], port, tmp_path / "router.log").start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, wait_all, [router], 60)
            async with aiohttp.ClientSession() as s:
                async def served(body):
                    async with s.post(f"{router.url}/v1/completions", json={"model": "m", **body}) as r:
                        return json.loads(await r.read())["choices"][0]["text"] if r.status == 200 else r.status
                long = [await served({"prompt": ids(1600, i), "max_tokens": 12}) for i in range(30)]
                named, unnamed = {}, {}
                for sess in range(6):
                    prompts = turns(4, first=300, seed=sess)
                    named[sess] = {await served({"prompt": p, "max_tokens": 12, "user": f"s{sess}"}) for p in prompts}
                    unnamed[sess] = {await served({"prompt": p, "max_tokens": 12}) for p in
                                     turns(4, first=300, seed=10 + sess)}
                return long, named, unnamed
        finally:
            router.stop()
            for s in servers:
                await s.close()
    long, named, unnamed = asyncio.run(asyncio.wait_for(go(), 100))
    assert set(long) == {400, "d1"}, long  # some refused by DCP=1, the rest answered by DCP=2
    assert all(len(v) == 1 for v in named.values()), named
    assert any(len(v) > 1 for v in unnamed.values()), unnamed
