"""DCP2DConnector end to end in one in-process engine (``kv_role="kv_both"``).

The engine is its own prefill and decode instance: a request prefilled with
``do_remote_decode`` is fetched back by a second request with the returned
``kv_transfer_params``, through the bootstrap server, the sender, Mooncake
(TCP on loopback) and the receiver, into other blocks of the same KV cache.
~20 s, most of it ``import vllm``.
"""

from __future__ import annotations

import json
import gc
import os

import pytest

from vllm_dcp2d.local.servers import fetch_records, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

PAGE = 32
SEND_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def profiler():
    """Every thread started from here on (the engine's and the connector's) calls it; it records
    only inside ``with profiler:`` (test_one_request_runs_only_the_walk_and_its_helpers)."""
    from tests.support.request_flow import Profiler

    p = Profiler()
    p.install()
    yield p
    p.uninstall()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, profiler):
    mp = pytest.MonkeyPatch()  # restored after the module: later engines pick their own process split
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("MC_FORCE_TCP", os.environ.get("MC_FORCE_TCP", "1"))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from vllm_dcp2d.local.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("inproc")
    model = build_tiny_model("llama", root / "model")
    stats = root / "stats.jsonl"
    kv = KVTransferConfig(kv_connector="DCP2DConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"bootstrap_port": free_port(), "stats_file": str(stats),
                                                     "transfer_timeout_s": 5.0, "prefill_wait_s": 0.5, "verify_kv": True,
                                                     "send_timeout_s": SEND_TIMEOUT_S, "cancel_grace_s": 0.5})
    gc.collect()  # an earlier module's dead engine: its finalizer must not run during this start
    engine = LLM(model=model, distributed_executor_backend="uni", enforce_eager=True, block_size=PAGE,
                 kv_cache_memory_bytes=64 << 20, max_model_len=1024, max_num_seqs=4,
                 enable_prefix_caching=False, enable_prompt_embeds=True, kv_transfer_config=kv)
    yield engine, stats
    del engine
    # Collected now, not during the next module's engine: an in-process engine's finalizer
    # tears down vLLM's process-wide TP group, which the next engine has set up by then
    # ("tensor model parallel group is not initialized", seen in a full run).
    gc.collect()
    mp.undo()


def _pool(engine):
    return engine.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool


def free_blocks(engine) -> int:
    """Free KV blocks of the in-process engine's scheduler."""
    return _pool(engine).get_num_free_blocks()


def idle_free_blocks(engine, timeout_s: float = SEND_TIMEOUT_S + 5.0) -> int:
    """Step the engine until every block is back in the free pool, and return that count.

    An earlier test's producer request can still hold blocks for up to send_timeout_s
    (a release or an expiry lands on a later step): a test that counted its free blocks
    from such a pool saw them come back in the middle of its own check (a clean-clone
    run: 4 blocks expired while 4 were quarantined, so the count did not move)."""
    import time

    pool, deadline = _pool(engine), time.monotonic() + timeout_s
    while pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:  # vLLM keeps one null block
        assert time.monotonic() < deadline, \
            f"{pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()} blocks still held after {timeout_s} s"
        engine.generate({"prompt_token_ids": [5]}, greedy(1), use_tqdm=False)
        time.sleep(0.1)
    return pool.get_num_free_blocks()


def greedy(n, params=None):
    from vllm import SamplingParams
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=extra)


def prompts():
    return {"short": list(range(3, 3 + 20)), "pages": [(7 * i) % 500 + 3 for i in range(3 * PAGE + 5)]}


def records(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_transfer_equals_local(llm):
    engine, stats = llm
    free = idle_free_blocks(engine)
    for name, ids in prompts().items():
        (local,) = engine.generate({"prompt_token_ids": ids}, greedy(8), use_tqdm=False)
        (pre,) = engine.generate({"prompt_token_ids": ids},
                                 greedy(1, {"do_remote_decode": True, "transfer_id": name}), use_tqdm=False)
        params = pre.kv_transfer_params
        assert params and params["do_remote_prefill"] and params["remote_num_tokens"] == len(ids)
        before = len(records(stats))
        (dec,) = engine.generate({"prompt_token_ids": ids}, greedy(8, params), use_tqdm=False)
        assert dec.outputs[0].token_ids == local.outputs[0].token_ids, name
        new = [r for r in records(stats)[before:] if r.get("ok")]
        assert len(new) == 1 and new[0]["transfer_key"] == params["remote_request_id"]
        pages = -(-len(ids) // PAGE)
        assert new[0]["pages"] == pages and new[0]["layers"] == [0, 4]
        # 4 layers x pages x [2 KV heads, 32 tokens, 2*32] bf16
        assert new[0]["bytes"] == new[0]["naive_bytes"] == 4 * pages * 2 * PAGE * 64 * 2
    engine.generate({"prompt_token_ids": [5]}, greedy(1), use_tqdm=False)  # one more step: frees land
    assert free_blocks(engine) == free  # producer freed after the fetch, consumer after decoding


@pytest.mark.timeout(120)
def test_one_request_runs_only_the_walk_and_its_helpers(llm, profiler):
    """One PD round (prefill, fetch, decode, the prefill's blocks freed) with every thread of
    the engine profiled: each file of the package that ran is a step of docs/connector.md's
    "Request flow" or listed there under what the steps call, and each step of the engine ran
    (the proxy's run in its own process). The round before warms what happens once: the
    decode asks the prefill's rank table once per instance and keeps it."""
    from tests.support import request_flow

    engine, _ = llm
    ids = prompts()["pages"]
    for key in ("walk-warm", "walk"):
        with profiler:
            (pre,) = engine.generate({"prompt_token_ids": ids}, greedy(1, {"do_remote_decode": True, "transfer_id": key}),
                                     use_tqdm=False)
            (dec,) = engine.generate({"prompt_token_ids": ids}, greedy(4, pre.kv_transfer_params), use_tqdm=False)
            idle_free_blocks(engine)  # the prefill's blocks freed: step 9
    assert len(dec.outputs[0].token_ids) == 4
    steps, helpers = request_flow.steps(), request_flow.helpers()
    name = lambda ps: sorted(str(p.relative_to(request_flow.PACKAGE)) for p in ps)  # noqa: E731
    unlisted = {p for p in profiler.ran if p not in steps and not request_flow.covers(helpers, p)}
    assert not unlisted, f"one request ran {name(unlisted)}: name each as a step or under what the steps call"
    engine_steps = {p for p in steps if p.parent.name != "proxy"}
    assert engine_steps <= profiler.ran, f"steps that did not run: {name(engine_steps - profiler.ran)}"


@pytest.mark.timeout(120)
def test_loaded_kv_is_used_and_only_for_its_own_prompt(llm, monkeypatch):
    """Decode prompt B with the params of prompt A's prefill (same length): the prefill
    refuses to write A's KV for B (prompt digests differ; issue 37, finding 8) and the
    decode computes B itself, so its answer is B's own. With the digest check forced
    to pass (both sides' digests made equal), the output follows A's KV: what is
    loaded is what the decode attends over."""
    import vllm_dcp2d.connector.scheduler as scheduler
    import vllm_dcp2d.connector.metadata as metadata

    engine, _ = llm
    a = prompts()["pages"]
    b = [t + 1 for t in a]
    (local_b,) = engine.generate({"prompt_token_ids": b}, greedy(8), use_tqdm=False)
    (pre,) = engine.generate({"prompt_token_ids": a}, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    (dec,) = engine.generate({"prompt_token_ids": b}, greedy(8, pre.kv_transfer_params), use_tqdm=False)
    assert dec.outputs[0].token_ids == local_b.outputs[0].token_ids
    monkeypatch.setattr(scheduler, "prompt_digest", lambda *a, **k: "same")  # the prefill's
    monkeypatch.setattr(metadata, "prompt_digest", lambda *a, **k: "same")  # the decode's
    (pre,) = engine.generate({"prompt_token_ids": a}, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    (dec,) = engine.generate({"prompt_token_ids": b}, greedy(8, pre.kv_transfer_params), use_tqdm=False)
    assert dec.outputs[0].token_ids != local_b.outputs[0].token_ids


@pytest.mark.timeout(180)
def test_kv_is_fetched_only_by_a_request_of_the_same_salt_or_embeds(llm):
    """Issue "trust boundary, round 3", item 5, through the engine's own requests: a prompt
    prefilled with ``cache_salt`` "a" (or with prompt embeds E) is fetched by its decode
    (one ok fetch; the tokens are the local ones), and not by a decode of the same tokens
    with salt "b" (or of other embeds of its length): that one prefills here, and answers
    as its own prompt does locally. Before, the digest left the salt out and was "" for
    every embeds prompt, so both fetched the other request's KV."""
    import torch

    engine, stats = llm
    ids = prompts()["pages"]
    hidden = engine.llm_engine.vllm_config.model_config.get_hidden_size()
    gen = torch.Generator().manual_seed(5)
    mine, other = (torch.randn(len(ids), hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
    cases = [({"prompt_token_ids": ids, "cache_salt": "a"}, {"prompt_token_ids": ids, "cache_salt": "b"}),
             ({"prompt_embeds": mine}, {"prompt_embeds": other})]
    for own, foreign in cases:
        (local_own,) = engine.generate(own, greedy(6), use_tqdm=False)
        (local_foreign,) = engine.generate(foreign, greedy(6), use_tqdm=False)
        for prompt, local, fetched in ((foreign, local_foreign, 0), (own, local_own, 1)):
            (pre,) = engine.generate(own, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
            key, before = pre.kv_transfer_params["remote_request_id"], len(records(stats))
            (dec,) = engine.generate(prompt, greedy(6, dict(pre.kv_transfer_params)), use_tqdm=False)
            assert dec.outputs[0].token_ids == local.outputs[0].token_ids, sorted(prompt)
            loads = [r for r in fetch_records(records(stats)[before:]) if r.get("transfer_key") == key]
            assert len(loads) == fetched and all(r["ok"] for r in loads), (sorted(prompt), loads)
    idle_free_blocks(engine)  # the foreign decodes left their prefill's KV to its expiry


@pytest.mark.timeout(120)
def test_producer_expiry_frees_blocks(llm):
    """A prefill nobody fetches holds its blocks for send_timeout_s, then frees them."""
    import time

    engine, stats = llm
    free = idle_free_blocks(engine)
    engine.generate({"prompt_token_ids": prompts()["pages"]}, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    # Offline, the engine steps only inside generate(): this step hands the held blocks to the sender.
    engine.generate({"prompt_token_ids": [5]}, greedy(1), use_tqdm=False)
    assert free_blocks(engine) == free - 4
    time.sleep(SEND_TIMEOUT_S + 0.5)
    engine.generate({"prompt_token_ids": [5]}, greedy(2), use_tqdm=False)  # steps the engine
    assert free_blocks(engine) == free
    assert records(stats)[-1]["event"] == "expired"


@pytest.mark.timeout(120)
def test_expiry_recomputes(llm):
    """KV that never arrives: the fetch times out, vLLM recomputes, same tokens."""
    engine, stats = llm
    ids = prompts()["pages"]
    (local,) = engine.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)
    kv = engine.llm_engine.vllm_config.kv_transfer_config
    params = {"do_remote_prefill": True, "remote_request_id": "never-prefilled",
              "remote_bootstrap_addr": f"tcp://127.0.0.1:{kv.kv_connector_extra_config['bootstrap_port']}",
              "remote_engine_id": kv.engine_id}
    free = idle_free_blocks(engine)
    (dec,) = engine.generate({"prompt_token_ids": ids}, greedy(4, params), use_tqdm=False)
    assert dec.outputs[0].token_ids == local.outputs[0].token_ids
    assert free_blocks(engine) == free
    fails = [r for r in records(stats) if r.get("transfer_key") == "never-prefilled"]
    assert fails and not fails[-1]["ok"]  # "not ready" from the producer after prefill_wait_s


def bootstrap_addr(engine) -> str:
    port = engine.llm_engine.vllm_config.kv_transfer_config.kv_connector_extra_config["bootstrap_port"]
    return f"tcp://127.0.0.1:{port}"


@pytest.mark.timeout(120)
def test_two_requests_with_one_key_fetch_it_once(llm):
    """Two decode requests name the same remote_request_id (``n=2``, or a client reusing
    params): one fetches, the other waits for that fetch and prefills locally (never a
    second fetch of a key the prefill frees once fetched, never a failed load). Both
    answer correctly, and the producer's blocks are freed."""
    engine, stats = llm
    ids = prompts()["pages"]
    (local,) = engine.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)
    free = idle_free_blocks(engine)
    (pre,) = engine.generate({"prompt_token_ids": ids}, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    key = pre.kv_transfer_params["remote_request_id"]
    before = len(records(stats))
    outs = engine.generate([{"prompt_token_ids": ids}] * 2,
                           [greedy(4, dict(pre.kv_transfer_params)) for _ in range(2)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [local.outputs[0].token_ids] * 2
    new = [r for r in fetch_records(records(stats)[before:]) if r.get("transfer_key") == key]
    assert len(new) == 1 and new[0]["ok"] and new[0]["bytes"] > 0, new  # one fetch, of every page
    assert free_blocks(engine) == free  # the producer's blocks too: its one consumer was served


@pytest.mark.timeout(120)
@pytest.mark.parametrize("digest", [True, False])
def test_remote_token_count_mismatch_recomputes(llm, digest):
    """The decode's prompt is longer than what the prefill computed (remote_num_tokens):
    never KV with unwritten positions. With the prefill's prompt digest in the params the
    decode sees at once that the KV is another prompt's and prefills locally (no fetch);
    without it (a Mooncake-style router builds the params), a load error names both
    counts and the request is recomputed."""
    engine, stats = llm
    ids = prompts()["pages"]
    longer = ids + [11, 12, 13, 14, 15]
    (local,) = engine.generate({"prompt_token_ids": longer}, greedy(4), use_tqdm=False)
    (pre,) = engine.generate({"prompt_token_ids": ids}, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    assert pre.kv_transfer_params["remote_num_tokens"] == len(ids)
    params = dict(pre.kv_transfer_params)
    if not digest:
        del params["remote_prompt_digest"]
    before = len(records(stats))
    (dec,) = engine.generate({"prompt_token_ids": longer}, greedy(4, params), use_tqdm=False)
    assert dec.outputs[0].token_ids == local.outputs[0].token_ids
    fails = [r for r in fetch_records(records(stats)[before:]) if r.get("transfer_key") == params["remote_request_id"]]
    if digest:
        assert fails == []
        # the key was left for the prompt it holds (a batch's sibling): that one still loads it
        (own,) = engine.generate({"prompt_token_ids": ids}, greedy(4, dict(pre.kv_transfer_params)), use_tqdm=False)
        loaded = [r for r in fetch_records(records(stats)[before:]) if r.get("transfer_key") == params["remote_request_id"]]
        assert len(loaded) == 1 and loaded[0]["ok"], loaded
    else:
        assert len(fails) == 1 and not fails[0]["ok"], fails
        assert f"remote_num_tokens={len(ids)} prompt tokens, this decode has {len(longer)}" in fails[0]["reason"]


@pytest.mark.timeout(120)
def test_quarantined_blocks_stay_out_of_use_until_the_rank_settles(llm, tmp_path):
    """A prefill rank that never confirms the cancel (frozen): vLLM recomputes the
    request in fresh blocks at once, its old blocks leave the free pool until the
    rank answers, then come back."""
    import time

    from tests.support.fake_rank import FakeRank

    from vllm_dcp2d.transfer import bootstrap as bs
    from vllm_dcp2d.transfer.bootstrap import BootstrapServer
    from vllm_dcp2d.transfer.messages import QueryRanks, RankTable

    engine, stats = llm
    table = bs.request(bootstrap_addr(engine), QueryRanks("test", "test"), RankTable, 10.0)
    ids = prompts()["pages"]  # 101 tokens: 4 blocks
    (local,) = engine.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)
    with BootstrapServer() as boot:
        rank = FakeRank(boot.address, table.fingerprint)  # the engine's own KV format; silent
        try:
            params = {"do_remote_prefill": True, "remote_request_id": "frozen", "remote_bootstrap_addr":
                      boot.address, "remote_engine_id": "P", "transfer_timeout_s": 0.5}
            free = idle_free_blocks(engine)
            t0 = time.monotonic()
            (dec,) = engine.generate({"prompt_token_ids": ids}, greedy(4, params), use_tqdm=False)
            assert dec.outputs[0].token_ids == local.outputs[0].token_ids
            assert time.monotonic() - t0 < 10  # deadline + cancel grace, not an unbounded wait
            assert free_blocks(engine) == free - 4  # recomputed elsewhere; the 4 blocks are held
            rec = [r for r in records(stats) if r.get("transfer_key") == "frozen"][-1]
            assert not rec["ok"] and rec["quarantined"] == 4
            for _ in range(3):  # still silent: still held
                engine.generate({"prompt_token_ids": [5]}, greedy(1), use_tqdm=False)
            assert free_blocks(engine) == free - 4
            rank.answer_cancels = True
            deadline = time.monotonic() + 20
            while free_blocks(engine) != free:
                assert time.monotonic() < deadline, "quarantined blocks never released"
                engine.generate({"prompt_token_ids": [5]}, greedy(1), use_tqdm=False)
                time.sleep(0.2)
        finally:
            rank.close()



@pytest.mark.timeout(120)
def test_verify_kv_hashes_the_kv_tensors_on_both_sides(llm, monkeypatch):
    """The engine runs with ``verify_kv``: a fetch's prefill and decode ranks checksum the
    KV through ``KVBytes`` of the KV tensors, the code a GPU's KV takes (item 7: verify_kv
    was refused for device KV), and the fetch ends ok with the local tokens."""
    import vllm_dcp2d.transfer.receiver as receiver
    import vllm_dcp2d.transfer.sender as sender

    calls = []

    def counted(side, f):
        return lambda memory, *a, **k: calls.append((side, type(memory).__name__)) or f(memory, *a, **k)

    monkeypatch.setattr(sender, "checksum", counted("prefill", sender.checksum))
    monkeypatch.setattr(receiver, "checksum", counted("decode", receiver.checksum))
    engine, stats = llm
    ids = prompts()["pages"]
    (local,) = engine.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)
    (pre,) = engine.generate({"prompt_token_ids": ids}, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    before = len(records(stats))
    (dec,) = engine.generate({"prompt_token_ids": ids}, greedy(4, pre.kv_transfer_params), use_tqdm=False)
    assert dec.outputs[0].token_ids == local.outputs[0].token_ids
    assert calls == [("prefill", "KVBytes"), ("decode", "KVBytes")]
    (load,) = fetch_records(records(stats)[before:])
    assert load["ok"], load
