"""End to end, MLA: a tiny DeepSeek-V2 (MLA) prefill ``vllm serve`` at TP=2 with
layer-split storage, through the proxy to a decode at TP=2 with DCP=2 and to one
at TP=2 with DCP=1, all started with no MLA-specific flag (the plugin picks the
backend, and the DCP interleave follows vLLM's 16-token MLA blocks).

Checked: both decodes give the same greedy tokens; each (cp_rank, dcp_rank)
path moves exactly the plan's bytes; the prefill stores its layers split. And,
asked directly (no PD), the DCP=2 decode gives the same greedy tokens as the
DCP=1 one, with twice the KV capacity.

Not checked: equality with the prefill instance's own answer. vLLM 0.32's CPU
MLA computes a prompt's last token through its prefill path (SDPA over
up-projected K/V) on a colocated instance, but through its decode path
(absorbed latent attention) on a decode instance, which recomputes that token
over the transferred KV. On this random tiny model the two paths differ by up
to ~0.35 in logprob with no connector at all (docs/connector.md, "MLA"), so a
colocated reference would flip near-tied tokens for reasons that are not ours.
"""

from __future__ import annotations

import contextlib

import pytest
from _pd_cluster import stalled

from vllm_dcp2d.plan import plan_request
from vllm_dcp2d.layout import cdiv
from vllm_dcp2d.report import synthetic_request
from vllm_dcp2d.testing.harness import (free_port, kv_capacity, post_json, proxy_server, read_stats, running,
                                        vllm_server)
from vllm_dcp2d.testing.shared import fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.multiproc]

PAGE = 16         # CPU_MLA's only block size, chosen by vLLM
LAYERS = 2
PAGE_BYTES = PAGE * 576 * 4  # one fp32 latent of 576 values per token per layer
MAX_TOKENS = 10


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 13) % 500 + 6 for i in range(n)]


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    return post_json(url + "/v1/completions", body, timeout_s=300)


def _served(c, which: str, prompt: list[int], dcp: int) -> list[int] | None:
    """Tokens of ``prompt`` through proxy ``which`` after checking every path's
    bytes against the plan; None after a safely handled Mooncake stall (issue 14)."""
    before = len(read_stats(c["stats"]))
    status, out = _complete(c[which].url, c["model"], prompt)
    recs = [r for r in read_stats(c["stats"])[before:] if r["side"] == "consumer"]
    if stalled(recs):
        assert status in (200, 502), out
        return None
    assert status == 200, out
    ok = [r for r in recs if r.get("ok")]
    assert len(ok) == 2 * 2, recs  # each decode TP rank got both CP ranks' layers
    src, src_ids, dst, dst_ids = synthetic_request(LAYERS, 2, dcp, len(prompt), PAGE, PAGE_BYTES)
    want = {k: d.nbytes for k, d in plan_request(LAYERS, 2, src, src_ids, dst, dst_ids).items()}
    for r in ok:
        assert (r["page_size"], r["pages"], r["dcp_size"]) == (PAGE, cdiv(len(prompt), PAGE), dcp), r
        assert r["layers"] == [[0, 1], [1, 2]][r["cp_rank"]]
        assert r["bytes"] == want[(r["cp_rank"], r["dcp_rank"])], (r, want)
    return out["choices"][0]["token_ids"]


# one cluster for the module's tests, checked before each and started again if a test broke
# it (testing/shared.py)
shared, cluster = fixtures("e2e_mla", lambda work: _start(work))


@contextlib.contextmanager
def _start(work):
    from vllm_dcp2d.testing.tiny_models import build_tiny_model

    model = build_tiny_model("deepseek-v2-mla", work / "model", dtype="float32")
    stats = work / "stats.jsonl"
    common = {"stats_file": str(stats)}
    prefill = vllm_server("prefill", model, free_port(), work, role="kv_producer", tp=2, dtype="float32",
                          extra_config={**common, "bootstrap_port": free_port()})
    decode = vllm_server("decode", model, free_port(), work, role="kv_consumer", tp=2, dcp=2, dtype="float32",
                         extra_config={**common, "transfer_timeout_s": 300.0})
    decode1 = vllm_server("decode1", model, free_port(), work, role="kv_consumer", tp=2, dtype="float32",
                          extra_config={**common, "transfer_timeout_s": 300.0})
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], work, "proxy")
    proxy1 = proxy_server(free_port(), [prefill.url], [decode1.url], work, "proxy1")
    with running([prefill, decode, decode1, proxy, proxy1], 900) as procs:
        yield {"model": model, "stats": stats, **procs}


@pytest.mark.timeout(1200)
def test_mla_pd_layer_split_to_dcp2_and_dcp1(cluster):
    c = cluster
    log = c["prefill"].log_path.read_text()
    assert "TP rank 0 stores layers [0, 1) plus one transient slot" in log, c["prefill"].log_tail(40)
    # shorter than a page, and 5 pages with the last one partial
    for n, seed in ((10, 1), (70, 2)):
        for attempt in range(2):
            prompt = ids(n, seed + 100 * attempt)
            got2 = _served(c, "proxy", prompt, 2)
            got1 = _served(c, "proxy1", prompt, 1)
            if got2 is not None and got1 is not None:
                break
        else:
            raise AssertionError("Mooncake stalls on two prompts in a row (issue 14)")
        assert got2 == got1, f"{n} tokens: DCP=2 {got2} != DCP=1 {got1}"


@pytest.mark.timeout(600)
def test_mla_dcp2_matches_dcp1_and_doubles_kv_capacity(cluster):
    """MLA under TP=2 + DCP=2 (the plugin's CPU_MLA: its own prefill and decode, no
    connector in the path) gives the same greedy tokens as DCP=1, with twice the KV
    capacity. The two decode instances, asked without ``kv_transfer_params``.

    Prompts go one at a time: in batches, vLLM 0.32's CPU MLA path is not deterministic
    run to run even at DCP=1 (two DCP=1 runs of the same 4-prompt batch gave different
    first tokens, e.g. logprob -3.29 vs -3.26 for the top token of one prompt while two
    other prompts matched to the last bit), so a batched comparison could not tell a DCP
    bug from that noise. vLLM turns chunked prefill and prefix caching off for CPU_MLA
    (its DCP context gather for MLA prefill is CUDA-only)."""
    c = cluster
    # Shorter than a page, spanning pages, not page-aligned, exactly 2 virtual pages.
    for prompt in (ids(10, 1), ids(150, 2), ids(70, 3), ids(2 * 2 * PAGE, 4)):
        got, ref = (_complete(c[name].url, c["model"], prompt, max_tokens=40) for name in ("decode", "decode1"))
        assert got[0] == ref[0] == 200, (got, ref)
        assert got[1]["choices"][0]["token_ids"] == ref[1]["choices"][0]["token_ids"], prompt
    assert kv_capacity(c["decode"]) == 2 * kv_capacity(c["decode1"])
