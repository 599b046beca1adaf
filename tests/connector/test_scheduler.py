"""Scheduler side of DCP2DConnector against fake vLLM objects (no engine)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_dcp2d.config import DCP2DConfig  # noqa: E402
from vllm_dcp2d.transfer.messages import prompt_digest  # noqa: E402
from vllm_dcp2d.connector.scheduler import SchedulerSide  # noqa: E402

PAGE = 32


_SIDES: list[SchedulerSide] = []


@pytest.fixture(autouse=True)
def _shut_down_sides():
    """A consumer side binds a step bell (an ipc socket file): closed after each test."""
    yield
    while _SIDES:
        _SIDES.pop().shutdown()


def side(producer=False, consumer=False, **cfg):
    vc = NS(cache_config=NS(block_size=PAGE))
    s = SchedulerSide(vc, DCP2DConfig(bootstrap_port=4242, **cfg), "eng", producer, consumer)
    s.kv_cache_manager = NS(get_block_ids=lambda rid: ([10, 11, 12, 13, 14],))
    _SIDES.append(s)
    return s


def request(rid="r", n=100, params=None, status=RequestStatus.RUNNING, ids=None):
    """What the scheduler side reads of a vLLM ``Request`` (a plain prompt: no embeds,
    multimodal items, LoRA adapter or cache salt)."""
    return NS(request_id=rid, num_prompt_tokens=n, prompt_token_ids=list(range(n)) if ids is None else ids,
              kv_transfer_params=params, status=status, prompt_embeds=None, prompt_is_token_ids=None,
              mm_features=[], lora_request=None, cache_salt=None)


def sched_out(new=(), cached=(), tokens=None):
    new_reqs = [NS(req_id=r, num_computed_tokens=c) for r, c in new]
    return NS(scheduled_new_reqs=new_reqs,
              scheduled_cached_reqs=NS(req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]),
              num_scheduled_tokens=tokens or {}, total_num_scheduled_tokens=sum((tokens or {}).values()))


REMOTE = {"do_remote_prefill": True, "remote_request_id": "p-1", "remote_bootstrap_addr": "tcp://h:1",
          "remote_engine_id": "pe"}


def test_consumer_claims_uncached_prompt_async():
    s = side(consumer=True)
    req = request(params=dict(REMOTE))
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    assert s.get_num_new_matched_tokens(req, 64) == (36, True)
    assert s.get_num_new_matched_tokens(request(params=None), 0) == (0, False)
    assert side(producer=True).get_num_new_matched_tokens(req, 0) == (0, False)


def test_consumer_load_spec_and_one_shot():
    s = side(consumer=True)
    params = dict(REMOTE)
    req = request(params=params)
    blocks = NS(get_block_ids=lambda: ([7, 3, 9, 1],))
    s.update_state_after_alloc(req, blocks, num_external_tokens=100 - 64)  # 64 tokens cached locally
    meta = s.build_connector_meta(sched_out())
    spec = meta.fetches["r"]
    assert (spec.transfer_key, spec.bootstrap_addr, spec.remote_engine_id) == ("p-1", "tcp://h:1", "pe")
    assert spec.block_ids == ([7, 3, 9, 1],) and spec.first_page == 2 and spec.num_tokens == 100
    assert spec.remote_num_tokens is None
    assert spec.transfer_timeout_s == 60.0
    assert params["do_remote_prefill"] is False          # a preempted request recomputes locally
    assert s.build_connector_meta(sched_out()).fetches == {}  # handed over once


def test_consumer_times_admit_resume_and_first_step_through_the_workers_echo(tmp_path):
    """The decode's timeline (issue 29): the step that first runs a loaded request lists
    it in ``first_run``; the workers echo it (``DCP2DWorkerMeta.ran``) with that step's
    output, which ends its first step; a load failed on any rank is not timed."""
    from vllm_dcp2d.connector.metadata import DCP2DWorkerMeta

    stats = tmp_path / "stats.jsonl"
    s = side(consumer=True, stats_file=str(stats))
    blocks = NS(get_block_ids=lambda: ([7, 3, 9, 1],))
    for rid in ("r", "bad"):
        req = request(rid, params=dict(REMOTE, remote_request_id=f"p-{rid}"))
        req.arrival_time = time.time() - 0.25
        s.update_state_after_alloc(req, blocks, num_external_tokens=100)
    assert s.build_connector_meta(sched_out()).first_run == []  # the step that dispatches the fetches
    out = lambda **kw: NS(finished_sending=None, **{"finished_recving": None, "failed_recving": set(),  # noqa: E731
                                                     "kv_connector_worker_meta": None, **kw})
    s.update_connector_output(out(kv_connector_worker_meta=DCP2DWorkerMeta(failed_fetches={"bad"})))
    s.update_connector_output(out(finished_recving={"r", "bad"}))
    meta = s.build_connector_meta(sched_out(new=[("r", 0), ("bad", 0)], tokens={"r": 1, "bad": 100}))
    assert meta.first_run == ["r"]
    assert s.build_connector_meta(sched_out(cached=[("r", 100)], tokens={"r": 1})).first_run == []
    s.update_connector_output(out(kv_connector_worker_meta=DCP2DWorkerMeta(ran={"r"})))
    d = s.get_stats().data
    assert len(d["admit_seconds"]) == 2 and all(0.25 <= a < 5 for a in d["admit_seconds"])
    assert len(d["resume_seconds"]) == 1 and len(d["first_step_seconds"]) == 1
    assert s.get_stats() is None  # taken
    (line,) = [json.loads(x) for x in stats.read_text().splitlines()]
    assert (line["side"], line["event"], line["transfer_key"], line["request_id"]) == (
        "consumer", "first_step", "p-r", "r")
    assert line["first_step_seconds"] == d["first_step_seconds"][0]


@pytest.mark.parametrize("given,used", [(4, 4.0), (0.5, 0.5), (-1, 60.0), ("5", 60.0), (True, 60.0),
                                        (600, 600.0), (86400, 600.0), (1e12, 600.0)])
def test_consumer_per_request_timeout(given, used):
    s = side(consumer=True)
    s.update_state_after_alloc(request(params=dict(REMOTE, transfer_timeout_s=given)),
                               NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    assert s.build_connector_meta(sched_out()).fetches["r"].transfer_timeout_s == used


def test_consumer_per_request_timeout_cap_is_a_config_key():
    s = side(consumer=True, max_transfer_timeout_s=30.0, transfer_timeout_s=10.0)
    s.update_state_after_alloc(request(params=dict(REMOTE, transfer_timeout_s=3600)),
                               NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    assert s.build_connector_meta(sched_out()).fetches["r"].transfer_timeout_s == 30.0


@pytest.mark.parametrize("params,why", [
    ({"do_remote_prefill": True}, "lack ['remote_request_id or transfer_id', 'remote_bootstrap_addr', "
                                  "'remote_engine_id']"),
    (dict(REMOTE, remote_bootstrap_addr="tcp://127.0.0.1:notaport"), "'tcp://127.0.0.1:notaport': expected"),
    (dict(REMOTE, remote_bootstrap_addr="x"), "remote_bootstrap_addr = 'x'"),
    (dict(REMOTE, remote_bootstrap_addr="tcp://h:70000"), "port in [1, 65535]"),
    (dict(REMOTE, remote_bootstrap_addr=None), "remote_bootstrap_addr = None"),
    (dict(REMOTE, remote_request_id="k" * 513), "1..512 characters (got 513)"),
    (dict(REMOTE, remote_request_id=7), "remote_request_id = 7"),
    (dict(REMOTE, remote_engine_id=""), "remote_engine_id = ''"),
])
def test_consumer_bad_params_fail_the_load(params, why, caplog):
    """Checked at the boundary: the load goes to the workers refused, with the reason,
    and they report it failed in that step (kv_load_failure_policy ends or recomputes
    it); it used to be left waiting for a load that never started (issue 37, item 4).
    The log names the value (a bad address used to kill the receiver thread)."""
    s = side(consumer=True)
    req = request(params=dict(params))
    s.update_state_after_alloc(req, NS(get_block_ids=lambda: ([1],)), 100)
    spec = s.build_connector_meta(sched_out()).fetches["r"]
    assert why in spec.refused and spec.block_ids == ([1],)
    assert why in caplog.text and "its load fails" in caplog.text


@pytest.mark.parametrize("value", ["false", "true", 0, 1, "", [], {}])
def test_a_boolean_field_that_is_not_a_json_boolean_ends_the_load(value, caplog):
    """Round 3, item 8: ``"do_remote_prefill": "false"`` counted as true (Python's truth of a
    non-empty string): the decode waited for a fetch the client did not ask for. A value
    that is not a JSON boolean is refused, naming the field, the value and what is
    expected: the load fails in the next step (``kv_load_failure_policy`` ends the request,
    or prefills it here), never taken as true or false."""
    s = side(consumer=True)
    req = request(params=dict(REMOTE, do_remote_prefill=value))
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    s.update_state_after_alloc(req, NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    spec = s.build_connector_meta(sched_out()).fetches["r"]
    want = f"kv_transfer_params['do_remote_prefill'] = {value!r}: expected a JSON boolean (true or false)"
    assert want in spec.refused and spec.block_ids == ([1, 2, 3, 4],), spec.refused
    assert want in caplog.text and "its load fails" in caplog.text
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one load per request, refused or not


@pytest.mark.parametrize("value", ["false", "true", 1])
def test_a_producer_answers_why_a_boolean_field_was_refused(value):
    """The same on a prefill: ``"do_remote_decode": "false"`` kept the request's blocks for a
    decode. Not a JSON boolean: nothing is held, and the answer's ``kv_transfer_params``
    say why instead of telling a decode where to fetch (a proxy then fails the request
    with that text)."""
    s = side(producer=True)
    req = request(params={"do_remote_decode": value, "transfer_id": "t"})
    s.update_state_after_alloc(req, None, 0)
    assert s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 100})).computing == {}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, ([10, 11, 12, 13],))
    assert delay is False and params == {"error": f"kv_transfer_params refused: kv_transfer_params['do_remote_decode'] "
                                                  f"= {value!r}: expected a JSON boolean (true or false), got "
                                                  f"{type(value).__name__}"}
    assert s.build_connector_meta(sched_out()).ready == {}
    plain = request("q", params={"do_remote_decode": False})  # a JSON false: a plain request, as before
    s.update_state_after_alloc(plain, None, 0)
    plain.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(plain, ([1],)) == (False, None)


def test_producer_holds_blocks_and_answers_params():
    s = side(producer=True)
    req = request(params={"do_remote_decode": True, "transfer_id": "t"})
    s.update_state_after_alloc(req, None, 0)
    # chunked prefill: prompt not complete after the first chunk, complete after the second
    m1 = s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 64}))
    assert m1.computing == {}
    m2 = s.build_connector_meta(sched_out(cached=[("r", 64)], tokens={"r": 36}))
    assert m2.computing["r"].block_ids == ([10, 11, 12, 13],) and m2.computing["r"].num_tokens == 100
    assert m2.computing["r"].transfer_key == "t"  # decode ranks fetch it by the client's transfer_id
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, ([10, 11, 12, 13],))
    assert delay is True
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "t",
                      "remote_bootstrap_addr": "tcp://127.0.0.1:4242", "remote_engine_id": "eng",
                      "remote_num_tokens": 100, "remote_prompt_digest": prompt_digest(range(100)),
                      "transfer_id": "t"}
    meta = s.build_connector_meta(sched_out())
    assert meta.ready["r"].block_ids == ([10, 11, 12, 13],) and meta.ready["r"].transfer_key == "t"


def test_producer_transfer_keys_unique_while_in_flight():
    """A transfer_id in use by a request whose blocks are still held is not reused:
    the second request is fetched by its request id. Freed blocks release the key."""
    s = side(producer=True)
    a = request("a", params={"do_remote_decode": True, "transfer_id": "t"}, status=RequestStatus.FINISHED_STOPPED)
    b = request("b", params={"do_remote_decode": True, "transfer_id": "t"}, status=RequestStatus.FINISHED_STOPPED)
    c = request("c", params={"do_remote_decode": True, "transfer_id": "t"}, status=RequestStatus.FINISHED_STOPPED)
    long = request("d", params={"do_remote_decode": True, "transfer_id": "x" * 513},
                   status=RequestStatus.FINISHED_STOPPED)
    for r in (a, b, long):
        s.update_state_after_alloc(r, None, 0)
    assert s.request_finished(a, ([1],))[1]["remote_request_id"] == "t"
    assert s.request_finished(b, ([2],))[1]["remote_request_id"] == "b"
    assert s.request_finished(long, ([3],))[1]["remote_request_id"] == "d"
    s.update_connector_output(NS(finished_sending={"a"}, kv_connector_worker_meta=None))
    s.update_state_after_alloc(c, None, 0)
    assert s.request_finished(c, ([4],))[1]["remote_request_id"] == "t"


def test_producer_aborted_before_its_prompt_completed_frees_at_once():
    s = side(producer=True)
    req = request(params={"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    s.update_state_after_alloc(req, None, 0)
    s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 64}))  # first chunk only
    assert s.request_finished(req, ([1, 2],)) == (False, None)
    meta = s.build_connector_meta(sched_out())
    assert meta.aborted == {} and meta.ready == {}
    assert meta.dropped == {"r": "r"}  # fetches waiting for it fail now, not after prefill_wait_s


def test_producer_aborted_after_its_prompt_completed_keeps_blocks():
    """Layer writes of held fetches may still read the blocks: vLLM keeps them until
    the workers report the abort in finished_sending."""
    s = side(producer=True)
    req = request(params={"do_remote_decode": True, "transfer_id": "t"}, status=RequestStatus.FINISHED_ABORTED)
    s.update_state_after_alloc(req, None, 0)
    assert "r" in s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 100})).computing
    assert s.request_finished(req, ([10, 11, 12, 13],)) == (True, None)
    assert s.build_connector_meta(sched_out()).aborted == {"r": "t"}


def test_producer_preempted_after_its_prompt_completed_rewrites_every_layer():
    """vLLM preempts a request after the step that completed its prompt: the next
    step lists it in ``preempted`` (the workers void its layer writes before the
    forward), and its re-prefill is listed in ``computing`` again with its new blocks."""
    s = side(producer=True)
    req = request(params={"do_remote_decode": True, "transfer_id": "t"})
    s.update_state_after_alloc(req, None, 0)
    assert s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 100})).computing["r"].transfer_key == "t"
    out = sched_out()
    out.preempted_req_ids = {"r", "other"}
    meta = s.build_connector_meta(out)
    assert meta.preempted == {"r": "t"} and meta.computing == {}
    s.kv_cache_manager = NS(get_block_ids=lambda rid: ([20, 21, 22, 23, 24],))  # re-admitted in new blocks
    again = s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 101}))
    assert again.computing["r"].block_ids == ([20, 21, 22, 23],) and again.preempted == {}
    req.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(req, ([20, 21, 22, 23],))[0] is True


def test_producer_aborted_while_preempted_fails_its_waiting_fetches():
    """Preempted (no blocks kept), then aborted: ``dropped`` tells the workers, and the
    transfer key is only reused once they heard of it."""
    s = side(producer=True)
    req = request(params={"do_remote_decode": True, "transfer_id": "t"})
    s.update_state_after_alloc(req, None, 0)
    s.build_connector_meta(sched_out(new=[("r", 0)], tokens={"r": 100}))
    out = sched_out()
    out.preempted_req_ids = {"r"}
    s.build_connector_meta(out)
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, ([],)) == (False, None)
    other = request("o", params={"do_remote_decode": True, "transfer_id": "t"}, status=RequestStatus.FINISHED_STOPPED)
    s.update_state_after_alloc(other, None, 0)
    assert s.request_finished(other, ([1],))[1]["remote_request_id"] == "o"  # "t" is still r's
    meta = s.build_connector_meta(sched_out())
    assert meta.dropped == {"r": "t"} and meta.aborted == {}
    third = request("p", params={"do_remote_decode": True, "transfer_id": "t"}, status=RequestStatus.FINISHED_STOPPED)
    s.update_state_after_alloc(third, None, 0)
    assert s.request_finished(third, ([2],))[1]["remote_request_id"] == "t"


@pytest.mark.parametrize("remote,want", [(100, 100), (99, 99), ("100", None), (-1, None), (None, None)])
def test_consumer_load_spec_carries_the_producers_token_count(remote, want):
    """The workers fail a load whose remote_num_tokens differs from the prompt here; one
    that is not a count is refused with the load."""
    s = side(consumer=True)
    params = dict(REMOTE) if remote is None else dict(REMOTE, remote_num_tokens=remote)
    s.update_state_after_alloc(request(params=params), NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    spec = s.build_connector_meta(sched_out()).fetches["r"]
    assert (spec.num_tokens, spec.remote_num_tokens) == (100, want)
    assert spec.prompt_digest == ("" if spec.refused else prompt_digest(range(100)))
    assert bool(spec.refused) == (remote is not None and want is None)


def test_consumer_quarantine_holds_blocks_out_of_the_free_queue():
    """Quarantined blocks survive the request's free (vLLM's own BlockPool) and return to
    the free queue only when every rank that quarantined them lifted it."""
    from vllm.v1.core.block_pool import BlockPool

    from vllm_dcp2d.connector.metadata import DCP2DWorkerMeta

    pool = BlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=PAGE)
    s = side(consumer=True)
    s.kv_cache_manager = NS(block_pool=pool)
    blocks = pool.get_new_blocks(4)  # the request's blocks
    ids = [b.block_id for b in blocks]
    free0 = pool.get_num_free_blocks()
    out = lambda **m: NS(finished_sending=None, finished_recving=None, failed_recving=set(),  # noqa: E731
                         kv_connector_worker_meta=DCP2DWorkerMeta(**m))
    assert not s.has_pending_work()
    s.update_connector_output(out(quarantine={("r", 0): ids[1:], ("r", 1): ids[1:]}))
    pool.free_blocks(blocks)  # vLLM frees the failed request
    held = lambda: [pool.blocks[i].ref_cnt for i in ids]  # noqa: E731  (vLLM's own count of each block's holders)
    assert pool.get_num_free_blocks() == free0 + 1 and held() == [0, 2, 2, 2]  # one reference per quarantining rank
    assert s.has_pending_work()  # the engine keeps stepping: only a step brings the lift
    fresh = {b.block_id for b in pool.get_new_blocks(free0 + 1)}  # nothing hands out a quarantined block
    assert not fresh & set(ids[1:])
    pool.free_blocks([pool.blocks[i] for i in fresh])
    s.update_connector_output(out(lifted={("r", 0)}))
    assert pool.get_num_free_blocks() == free0 + 1 and held() == [0, 1, 1, 1]  # rank 1 still quarantines them
    assert s.has_pending_work()
    s.update_connector_output(out(lifted={("r", 1), ("r", 1)}))
    assert pool.get_num_free_blocks() == free0 + 4 and held() == [0, 0, 0, 0]
    assert not s.has_pending_work()


def test_plain_requests_untouched():
    s = side(producer=True, consumer=True)
    req = request(status=RequestStatus.FINISHED_STOPPED)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req, ([1],)) == (False, None)


def test_layer_split_context_blocks_cover_every_earlier_token():
    """Each scheduled request's blocks up to the tokens it computed before the step,
    sorted and without repeats (two requests may share prefix-cache blocks)."""
    s = side(producer=True)
    s.layer_split = True
    tables = {"a": [10, 11, 12, 13], "b": [10, 11, 20], "c": [30, 31], "d": [40]}
    s.kv_cache_manager = NS(get_block_ids=lambda rid: (tables[rid],))
    out = sched_out(new=[("a", 2 * PAGE + 1), ("d", 0)], cached=[("b", PAGE), ("c", 5)],
                    tokens={"a": 5, "b": 1, "c": 1, "d": 3})
    assert s.build_connector_meta(out).context_blocks == [10, 11, 12, 30]
    assert s.build_connector_meta(sched_out(new=[("d", 0)], tokens={"d": 8})).context_blocks == []
    assert side(producer=True).build_connector_meta(out).context_blocks is None  # without layer-split


def test_consumer_keeps_every_groups_block_table():
    """A decode with a speculative draft has two KV cache groups: the draft's
    (replicated, a block per page) and the target's (DCP-sharded)."""
    s = side(consumer=True)
    s.update_state_after_alloc(request(params=dict(REMOTE)), NS(get_block_ids=lambda: ([4, 8, 1, 2], [5, 3])), 36)
    spec = s.build_connector_meta(sched_out()).fetches["r"]
    assert spec.block_ids == ([4, 8, 1, 2], [5, 3]) and spec.first_page == 2


def test_producer_sends_every_groups_pages():
    s = side(producer=True)
    req = request(params={"do_remote_decode": True}, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    s.update_state_after_alloc(req, None, 0)
    assert s.request_finished(req, ([1, 2, 3, 4, 5], [6, 7, 8, 9]))[0] is True
    assert s.build_connector_meta(sched_out()).ready["r"].block_ids == ([1, 2, 3, 4], [6, 7, 8, 9])


def test_consumer_releases_a_fully_cached_request():
    """Nothing left to fetch: the producer is told to free it (no load)."""
    s = side(consumer=True)
    params = dict(REMOTE)
    s.update_state_after_alloc(request(params=params), NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    meta = s.build_connector_meta(sched_out())
    assert meta.fetches == {}
    spec = meta.releases["r"]
    assert (spec.transfer_key, spec.bootstrap_addr, spec.num_tokens, spec.remote_engine_id) == (
        "p-1", "tcp://h:1", 100, "pe")  # the engine: released only to that instance
    assert s.build_connector_meta(sched_out()).releases == {}  # handed over once
    assert s.request_finished(request(params=params, status=RequestStatus.FINISHED_STOPPED), ([1],)) == (False, None)
    assert s.build_connector_meta(sched_out()).releases == {}  # admitted: not released again


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_consumer_releases_a_request_finished_before_admission(status):
    """Aborted while waiting for admission (client gone, proxy gave up): no blocks
    were allocated, no fetch began; the producer frees it now."""
    s = side(consumer=True)
    req = request(params=dict(REMOTE), status=status)
    assert s.request_finished(req, ([],)) == (False, None)
    assert s.build_connector_meta(sched_out()).releases["r"].transfer_key == "p-1"
    s.request_finished(req, ([],))  # a second call (vLLM does not, but harmless)
    assert s.build_connector_meta(sched_out()).releases == {}


def test_a_request_the_front_end_refused_is_released_with_the_producers_count():
    """vLLM's front end refusing a request (longer than max_model_len, say) hands the
    connector a pre-aborted one-token stand-in with the request's ``kv_transfer_params``
    (``notify_kv_transfer_request_rejected``): the release names the prompt length the
    producer gave (``remote_num_tokens``), which is what the producer checks it against;
    without one, the stand-in's own."""
    s = side(consumer=True)
    stand_in = request(n=1, params={**REMOTE, "remote_num_tokens": 1600}, status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(stand_in, ([],)) == (False, None)
    assert s.build_connector_meta(sched_out()).releases["r"].num_tokens == 1600
    for bad in (None, "1600", -3, True):
        params = {**REMOTE, **({} if bad is None else {"remote_num_tokens": bad})}
        s.request_finished(request(n=1, params=params, status=RequestStatus.FINISHED_ABORTED), ([],))
        assert s.build_connector_meta(sched_out()).releases["r"].num_tokens == 1, bad


def test_consumer_does_not_release_what_it_fetches_or_cannot_address():
    s = side(consumer=True)
    s.update_state_after_alloc(request(params=dict(REMOTE)), NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 36)
    s.request_finished(request("q", params={"do_remote_prefill": True}, status=RequestStatus.FINISHED_ABORTED), ([],))
    meta = s.build_connector_meta(sched_out())
    assert set(meta.fetches) == {"r"} and meta.releases == {}


def test_release_can_be_turned_off():
    s = side(consumer=True, release_unfetched=False)
    s.update_state_after_alloc(request(params=dict(REMOTE)), NS(get_block_ids=lambda: ([1],)), 0)
    s.request_finished(request("q", params=dict(REMOTE), status=RequestStatus.FINISHED_ABORTED), ([],))
    assert s.build_connector_meta(sched_out()).releases == {}


def test_consumer_idle_step_ends_when_a_worker_rings(monkeypatch):
    """An idle step (nothing scheduled, nothing to hand over) that follows another one
    sleeps IDLE_POLL_S unless a worker rings the bell named in the metadata (a fetch
    ended); the first idle step after work does not sleep."""
    from vllm_dcp2d.connector import scheduler
    from vllm_dcp2d.connector.step_bell import BellRope
    s = side(consumer=True)
    monkeypatch.setattr(scheduler, "IDLE_POLL_S", 30.0)
    s.build_connector_meta(sched_out(tokens={"r": 5}))
    t0 = time.monotonic()
    s.build_connector_meta(sched_out())  # the first idle step after work: no sleep
    assert time.monotonic() - t0 < 15.0
    monkeypatch.setattr(scheduler, "IDLE_POLL_S", 0.3)
    t0 = time.monotonic()
    meta = s.build_connector_meta(sched_out())
    assert time.monotonic() - t0 >= 0.29 and meta.bell.startswith("ipc://")
    monkeypatch.setattr(scheduler, "IDLE_POLL_S", 30.0)
    rope = BellRope(meta.bell)
    rope.ring()
    t0 = time.monotonic()
    assert s.build_connector_meta(sched_out()).bell == meta.bell
    s.build_connector_meta(sched_out())  # after a ring: not slept (async scheduling reads the rung step later)
    assert time.monotonic() - t0 < 15.0
    monkeypatch.setattr(scheduler, "IDLE_POLL_S", 0.3)
    t0 = time.monotonic()
    s.build_connector_meta(sched_out())  # and then the sleeps resume
    assert time.monotonic() - t0 >= 0.29
    rope.close()
    assert side(producer=True).build_connector_meta(sched_out(tokens={"r": 1})).bell == ""  # only decode waits


@pytest.mark.parametrize("producer", [True, False])
def test_idle_steps_sleep_from_the_second_on(monkeypatch, producer):
    """The polling rate stays bounded (every idle step after the first of a stretch
    sleeps), and a step with work or a hand-over never sleeps."""
    from vllm_dcp2d.connector import scheduler
    s = side(producer=producer, consumer=not producer)
    slept = []
    monkeypatch.setattr(scheduler.time, "sleep", slept.append)
    if s.bell is not None:
        monkeypatch.setattr(s.bell, "sleep", slept.append)
    pattern = [0, 0, 0, 5, 0, 0, 7, 3, 0]  # scheduled tokens per step
    for n in pattern:
        s.build_connector_meta(sched_out(tokens={"r": n} if n else None))
    assert len(slept) == 3 and set(slept) == {scheduler.IDLE_POLL_S}  # steps 2, 3 and 6 (1-based)


# -- siblings: engine requests that carry one transfer key (n > 1, batches) --------------------------

def _ended(*req_ids):
    return NS(finished_sending=None, finished_recving=set(req_ids), failed_recving=set(), kv_connector_worker_meta=None)


@pytest.mark.parametrize("how", ["loaded", "failed", "finished"])
def test_siblings_of_one_key_fetch_once_and_the_others_wait_then_prefill_locally(how):
    """``n=2``: vLLM hands the decode two engine requests with the HTTP request's params.
    The first fetches; the second waits (``None``: vLLM skips it this step) while the fetch
    is in flight, then prefills locally (the prefix cache has the fetched pages), and
    neither fetches again nor releases the key the first one fetches."""
    s = side(consumer=True)
    params = {**REMOTE, "remote_prompt_digest": prompt_digest(list(range(100)))}
    first, second = request("c-0", params=dict(params)), request("c-1", params=dict(params))
    assert s.get_num_new_matched_tokens(first, 0) == s.get_num_new_matched_tokens(second, 0) == (100, True)
    s.update_state_after_alloc(first, NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    assert s.get_num_new_matched_tokens(first, 0) == (0, False)  # one transfer per request, as before
    meta = s.build_connector_meta(sched_out())
    assert set(meta.fetches) == {"c-0"} and meta.releases == {}
    if how == "loaded":
        s.update_connector_output(_ended("c-0"))
    elif how == "failed":
        s.update_connector_output(NS(finished_sending=None, finished_recving=set(), failed_recving={"c-0"},
                                     kv_connector_worker_meta=None))
    else:
        first.status = RequestStatus.FINISHED_ABORTED  # the client went away while it loaded
        s.request_finished(first, ([1, 2, 3, 4],))
    assert s.get_num_new_matched_tokens(second, 0) == (0, False)
    s.update_state_after_alloc(second, NS(get_block_ids=lambda: ([5, 6, 7, 8],)), 0)
    meta = s.build_connector_meta(sched_out())
    assert meta.fetches == {} and meta.releases == {}
    third = request("c-2", params=dict(params))  # a late sibling: not a second fetch of a freed key
    assert s.get_num_new_matched_tokens(third, 0) == (0, False)
    s.request_finished(request("c-3", params=dict(params), status=RequestStatus.FINISHED_ABORTED), ([],))
    assert s.build_connector_meta(sched_out()).releases == {}


def test_a_prompt_whose_digest_is_not_the_params_one_prefills_locally_and_releases_nothing(caplog):
    """A batch of prompts answered with one prefill's params (vLLM's answer carries one
    request's): the other prompts' KV is not in that transfer, so they prefill here; the
    release of the key belongs to the request whose prompt it is."""
    s = side(consumer=True)
    params = {**REMOTE, "remote_prompt_digest": prompt_digest(list(range(100)))}
    other = request("b-1", params=dict(params), ids=list(range(1, 101)))
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)
    with caplog.at_level("INFO"):
        s.update_state_after_alloc(other, NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    assert "another prompt's digest" in caplog.text
    meta = s.build_connector_meta(sched_out())
    assert meta.fetches == {} and meta.releases == {}
    own = request("b-0", params=dict(params))
    assert s.get_num_new_matched_tokens(own, 0) == (100, True)  # the prompt whose KV it is fetches it


def test_siblings_remember_ended_keys_for_a_while_and_within_a_bound():
    from vllm_dcp2d.connector.metadata import Siblings

    now = [0.0]
    sib = Siblings(max_ended=3, ttl_s=10.0, clock=lambda: now[0])
    for i in range(5):
        sib.start(f"k{i}", f"r{i}")
        assert sib.fetcher(f"k{i}") == f"r{i}"
        sib.end(f"r{i}")
        sib.end(f"r{i}")  # twice: no-op
    assert [sib.ended(f"k{i}") for i in range(5)] == [None, None, "r2", "r3", "r4"] and len(sib) == 3
    now[0] = 10.5
    assert sib.ended("k4") is None and len(sib) == 0
    sib.end("never-started")
    assert len(sib) == 0


def test_a_refused_stand_in_is_released_though_its_prompt_is_not_the_producers():
    """vLLM's one-token stand-in for a request its front end refused carries the producer's
    digest of the real prompt: it is still released (with that digest), unless a sibling
    fetches the key."""
    s = side(consumer=True)
    digest = prompt_digest(list(range(1600)))
    params = {**REMOTE, "remote_num_tokens": 1600, "remote_prompt_digest": digest}
    s.request_finished(request(n=1, params=dict(params), status=RequestStatus.FINISHED_ABORTED), ([],))
    spec = s.build_connector_meta(sched_out()).releases["r"]
    assert (spec.num_tokens, spec.prompt_digest) == (1600, digest)
    s.update_state_after_alloc(request("f", n=1600, params=dict(params)), NS(get_block_ids=lambda: ([1],)), 1600)
    s.request_finished(request("g", n=1, params=dict(params), status=RequestStatus.FINISHED_ABORTED), ([],))
    assert s.build_connector_meta(sched_out()).releases == {}


def test_a_waiting_request_s_prompt_is_hashed_once(monkeypatch):
    """vLLM asks ``get_num_new_matched_tokens`` every step a request waits: its prompt
    digest is computed once, kept until it is admitted, and the load carries it."""
    from vllm_dcp2d.connector import metadata

    calls = []
    monkeypatch.setattr(metadata, "prompt_digest", lambda *a, **k: calls.append(a) or prompt_digest(*a, **k))
    s = side(consumer=True)
    req = request(params={**REMOTE, "remote_prompt_digest": prompt_digest(list(range(100)))})
    for _ in range(3):
        assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    s.update_state_after_alloc(req, NS(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    assert len(calls) == 1 and s.siblings._digests == {}
    assert s.build_connector_meta(sched_out()).fetches["r"].prompt_digest == prompt_digest(list(range(100)))
    other = request("o", params={**REMOTE, "remote_prompt_digest": "0" * 32})  # another prompt's KV
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)
    s.request_finished(other, ([],))  # never admitted: its digest goes with it
    assert s.siblings._digests == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abc"), st.sampled_from("xyz")), max_size=30))
def test_transfer_keys_give_each_key_one_owner(ops):
    """``TransferKeys`` against a model: a bind moves the key to its new request, an
    unbind of a request that lost its key leaves the new owner's binding alone."""
    from vllm_dcp2d.connector.metadata import TransferKeys

    keys, key_of, owner = TransferKeys(), {}, {}
    for bind, req, key in ops:
        if bind:
            keys.bind(req, key)
            if owner.get(key_of.get(req)) == req:
                del owner[key_of[req]]
            key_of[req], owner[key] = key, req
        else:
            got = key_of.pop(req, None)
            assert keys.unbind(req) == got
            if got is not None and owner.get(got) == req:
                del owner[got]
        assert len(keys) == len(key_of)
        assert all(keys.key(r) == k for r, k in key_of.items()) and keys.key("none", "d") == "d"
        assert all(keys.owner(k) == owner.get(k) for k in "xyz")
