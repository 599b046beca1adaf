"""What a decode says about itself (``proxy/fit.py``) and how the health poller reads it
(``upstreams.HealthChecker.learn``): the parse, hostile answers, the size bound, free KV."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp2d.proxy.fit import MAX_METRICS_BYTES, DecodeInfo, free_tokens, parse_metrics
from vllm_dcp2d.proxy.upstreams import HealthChecker, Pool

INFO = ('vllm:dcp2d_instance_info{model_name="m",engine="0",dcp_size="2",block_size="32",max_model_len="2048",'
        'kv_cache_tokens="2176",max_num_seqs="4"} 1.0\n')


def test_parse_what_a_decode_says():
    text = ("# HELP vllm:kv_cache_usage_perc x\n# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n' + INFO +
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n')
    assert parse_metrics(text) == (DecodeInfo(2, 32, 2048, 2176, 4), 0.5)  # several engines: the fullest
    assert parse_metrics("") == (None, None)


@pytest.mark.parametrize("bad", [
    INFO.replace('dcp_size="2"', 'dcp_size="0"'), INFO.replace('dcp_size="2"', 'dcp_size="-2"'),
    INFO.replace('kv_cache_tokens="2176"', 'kv_cache_tokens="1e9"'), INFO.replace(',max_num_seqs="4"', ''),
    INFO.replace('max_model_len="2048"', f'max_model_len="{1 << 41}"'), INFO.replace("} 1.0", "} 0.0"),
    INFO.replace("vllm:dcp2d_instance_info", "vllm:dcp2d_instance_infox"),
])
def test_a_malformed_info_line_says_nothing(bad):
    assert parse_metrics(bad)[0] is None


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1", "1.5", "x"])
def test_a_usage_outside_0_1_is_not_read(value):
    assert parse_metrics(f"vllm:kv_cache_usage_perc {value}\n") == (None, None)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 20), st.one_of(st.none(), st.floats(0, 1)), st.integers(0, 1 << 21),
       st.integers(0, 1 << 21))
def test_free_tokens(kv, usage, in_flight, at_poll):
    """Capacity less others' use (the reported usage less the proxy's own calls then) and the
    proxy's own calls now; never below 0, never above the capacity."""
    info = DecodeInfo(1, 16, 1024, kv, 4)
    free = free_tokens(info, usage, in_flight, at_poll)
    assert free == max(kv - max(round((usage or 0) * kv) - at_poll, 0) - in_flight, 0)
    assert 0 <= free <= kv
    assert free_tokens(info, usage, in_flight) <= free  # forgetting what the proxy held then: less free


class Instance:
    """A decode's /health and /metrics, answering what the test sets."""

    def __init__(self):
        self.body, self.status, self.delay_s = INFO.encode(), 200, 0.0
        self.app = web.Application()
        self.app.router.add_get("/health", lambda r: web.json_response({}))
        self.app.router.add_get("/metrics", self.metrics)

    async def metrics(self, request):
        await asyncio.sleep(self.delay_s)
        resp = web.StreamResponse(status=self.status)
        await resp.prepare(request)
        for i in range(0, len(self.body), 1 << 20):  # chunked: no Content-Length to trust
            await resp.write(self.body[i:i + 1 << 20])
        await resp.write_eof()
        return resp


@pytest.mark.timeout(60)
def test_the_poller_reads_bounded_and_keeps_what_was_said():
    """The poll learns the info; an answer over ``MAX_METRICS_BYTES``, a non-200, one slower than
    the timeout or a malformed one change nothing (the last info stays, the poll goes on)."""
    async def go():
        inst = Instance()
        server = TestServer(inst.app)
        await server.start_server()
        pool = Pool("decode", [str(server.make_url("")).rstrip("/")])
        (u,) = pool.upstreams
        checker = HealthChecker([pool], interval_s=1, timeout_s=0.5)
        seen = []
        async with aiohttp.ClientSession() as session:
            for body, status, delay in ((INFO.encode(), 200, 0), (b"#" * (MAX_METRICS_BYTES + 10), 200, 0),
                                        (b"", 500, 0), (INFO.replace("2048", "4096").encode(), 200, 1.0),
                                        (b"vllm:kv_cache_usage_perc 0.5\nvllm:dcp2d_instance_info{} 1\n", 200, 0)):
                inst.body, inst.status, inst.delay_s = body, status, delay
                assert await checker.check(session, pool, u)
                seen.append((u.info, u.kv_usage))
        await server.close()
        return seen
    seen = asyncio.run(asyncio.wait_for(go(), 30))
    info = DecodeInfo(2, 32, 2048, 2176, 4)
    assert seen == [(info, None)] * 4 + [(info, 0.5)]
