"""End to end, fp8 KV cache (``--kv-cache-dtype fp8``, e4m3): a prefill ``vllm serve``
(tiny ``llama-mqa`` in fp32, TP=2 = 2 layer-split CP ranks) through the proxy to a
decode at TP=2 with DCP=2, both with the same cache dtype; and a decode whose cache
is ``fp8_e5m2`` (the same bytes per element, other values) in front of that prefill.

Checked: the prefill stores its layers split; every prompt shape (shorter than a page,
four pages, a prefix-cache hit on the decode) gives the prefill instance's own greedy
tokens (vLLM's stock CPU kernel over its fp8 pages, scales applied) through PD, and
each (cp_rank, dcp_rank) path moves exactly the plan's bytes at one byte per element;
the e5m2 decode refuses the prefill's KV naming both encodings, and the prefill
gets the blocks of the refused request back.

Skipped on a host without AVX-512 or AMX: vLLM's CPU attention writes fp8 pages
only there.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from tests.support.pd_cluster import DTYPE, LAYERS, PAGE, check_proxy, complete, ids

from vllm_dcp2d.local.servers import free_port, kv_cache_usage, post_json, proxy_server, running, vllm_server
from tests.support.shared import fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc,
              pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                                 reason="vLLM's CPU fp8 KV cache needs x86 with AVX-512 or AMX")]

FP8_PAGE_BYTES = PAGE * 2 * 32 * 1  # 1 KV head x (K+V) x head_dim 32 x 1 byte, per token per layer

shared, cluster = fixtures("e2e_fp8", lambda work: _start(work))


@contextlib.contextmanager
def _start(work):
    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama-mqa", work / "model")
    stats = work / "stats.jsonl"
    common = {"stats_file": str(stats)}
    fp8 = ("--kv-cache-dtype", "fp8")
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, block_size=PAGE,
                          dtype=DTYPE, args=fp8, extra_config={**common, "bootstrap_port": free_port(),
                                                               "send_timeout_s": 600.0, "claim_timeout_s": 120.0})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2, block_size=PAGE,
                         dtype=DTYPE, args=fp8, extra_config={**common, "transfer_timeout_s": 300.0})
    e5m2 = vllm_server("decode_e5m2", model, free_port(), work, role="kv_consumer", block_size=PAGE, dtype=DTYPE,
                       args=("--kv-cache-dtype", "fp8_e5m2"), extra_config={"transfer_timeout_s": 60.0})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, "proxy")
    proxy_e5m2 = proxy_server(free_port(), [prefill.url], [e5m2.url], work, "proxy_e5m2")
    with running([prefill, decode, e5m2, proxy, proxy_e5m2], 900) as procs:
        yield {"model": model, "stats": stats, **procs}


@pytest.mark.timeout(900)
def test_fp8_pd_layer_split_to_dcp2_equals_the_prefills_own_answer(cluster):
    c = cluster
    log = c["prefill"].log_path.read_text()
    assert f"TP rank 0 stores layers [0, {LAYERS // 2}) plus one transient slot" in log, c["prefill"].log_tail(40)
    check_proxy(c, "proxy", tp=2, dcp=2, salt=0, page_bytes=FP8_PAGE_BYTES)


@pytest.mark.timeout(600)
def test_another_fp8_encoding_is_refused_naming_both(cluster):
    c = cluster
    prompt = ids(2 * PAGE + 3, 41)
    body = {"model": c["model"], "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    status, out = post_json(c["proxy_e5m2"].url + "/v1/completions", body, timeout_s=300)
    assert status != 200, out
    log = c["decode_e5m2"].log_path.read_text()
    assert "kv_dtype: ours 'fp8_e5m2', peer 'fp8_e4m3'" in log, c["decode_e5m2"].log_tail(40)
    t0 = time.monotonic()
    while kv_cache_usage(c["prefill"].url) != 0.0:
        assert time.monotonic() - t0 < 15, "the prefill still holds the refused request's blocks (claim_timeout_s=120)"
        time.sleep(0.2)
    print(f"refused: prefill KV usage 0 after {time.monotonic() - t0:.1f}s")
    # and the prefill serves the next request
    assert complete(c["prefill"].url, c["model"], prompt)["choices"][0]["token_ids"]
