"""``ConsumerWorker`` driven directly, as the connector drives it each step: a real
``WorkerBase`` (its Mooncake transport), a real ``Receiver`` under it, and a fake prefill
rank behind a real bootstrap server (ZMQ; one process)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.support.fake_rank import FakeRank, outcome
from tests.support.pair import BLOCKS, FP, PAGE, PAGE_BYTES, TOKENS, regions, wait_until
from tests.support.transfer import PD

from vllm_dcp2d.config import parse_extra_config
from vllm_dcp2d.connector.consumer import ConsumerWorker
from vllm_dcp2d.connector.metadata import DCP2DMetadata, FetchSpec, ReleaseSpec
from vllm_dcp2d.connector.worker import KVCaches, WorkerBase
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.messages import ReleaseTransfer, TransferRequest

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]
BLOCK_IDS = [7, 1, 4, 3]  # the request's 4 pages here (DCP 1)


@pytest.fixture
def consumer(tmp_path):
    """A started consumer role of TP rank 0 (DCP 1), its stats going to ``tmp_path/stats``."""
    cfg = parse_extra_config({"transfer_timeout_s": 30.0, "stats_file": str(tmp_path / "stats")})
    base = WorkerBase(cfg, "D", False, True, num_kv_heads=FP.num_kv_heads, page_size=PAGE, num_blocks=BLOCKS)
    kv = np.zeros((FP.num_layers, BLOCKS, PAGE_BYTES), np.uint8)
    caches = KVCaches({}, {}, regions(kv), [(kv.ctypes.data, kv.nbytes)], FP, FP.num_layers, None, 0)
    c = ConsumerWorker(base)
    base.open_transport(caches)
    c.start(caches)
    yield c
    c.close()
    base.close()
    assert c.receiver is None and base.transport is None


@pytest.fixture
def prefill():
    """A bootstrap server with one fake CP rank of engine "P", answering as ``rank.reply`` says
    (None: silent)."""
    with BootstrapServer() as server:
        rank = FakeRank(server.address, FP)
        yield server, rank
        rank.close()


def spec(bootstrap: str, key: str = "k", **kw) -> FetchSpec:
    return FetchSpec(**{"transfer_key": key, "bootstrap_addr": bootstrap, "remote_engine_id": "P",
                        "block_ids": (list(BLOCK_IDS),), "first_page": 0, "num_tokens": TOKENS,
                        "remote_num_tokens": None, "transfer_timeout_s": 30.0, "prompt_digest": PD, **kw})


def finished(c: ConsumerWorker, timeout_s: float = 20.0) -> tuple[set, set]:
    """``pop_finished`` until some request is reported: ``(recving, failed)``."""
    got = []
    wait_until(lambda: got.append(c.pop_finished()) or got[-1][0], timeout_s)
    return got[-1]


def reasons(tmp_path) -> list[str]:
    path = tmp_path / "stats"
    return [r.get("reason", "") for r in map(json.loads, path.read_text().splitlines())] if path.exists() else []


def test_a_fetch_comes_back_as_its_request(consumer, prefill):
    """The receiver carries the request id (``Fetch.tag``): the consumer keeps no copy of
    its fetches, and the one that ended is reported by the request that started it."""
    server, rank = prefill
    rank.reply = lambda m: outcome(m, True, num_tokens=m.num_tokens, layers=FP.num_layers)
    consumer.start_fetches(DCP2DMetadata(fetches={"req-1": spec(server.address)}))
    assert consumer.receiver.fetching("k").tag == "req-1"
    assert finished(consumer) == ({"req-1"}, set())
    assert consumer.pop_load_errors() == set() and consumer.receiver.fetching("k") is None
    (asked,) = [m for m in rank.seen if isinstance(m, TransferRequest)]
    assert (asked.transfer_key, asked.num_tokens, asked.block_ids.tolist()) == ("k", TOKENS, BLOCK_IDS)


def test_a_key_in_flight_is_not_fetched_or_released_for_another_request(consumer, prefill, tmp_path):
    """A second request naming the key being fetched fails at once, naming the first; it
    releases nothing (the running fetch still needs the prefill's blocks). Once the first
    fetch failed too, its release goes out."""
    server, rank = prefill  # silent: the first fetch stays in flight until it is failed here
    consumer.start_fetches(DCP2DMetadata(fetches={"req-1": spec(server.address)}))
    wait_until(lambda: any(isinstance(m, TransferRequest) for m in rank.seen))
    consumer.start_fetches(DCP2DMetadata(fetches={"req-2": spec(server.address, block_ids=([2, 5, 6, 0],))}))
    assert finished(consumer) == ({"req-2"}, set())
    assert consumer.pop_load_errors() == {2, 5, 6, 0}
    assert reasons(tmp_path) == ["transfer key 'k' is already being fetched by request req-1 on this decode "
                                 "instance; each request needs its own (kv_transfer_params['remote_request_id'])"]
    consumer.start_fetches(DCP2DMetadata(releases={"req-3": ReleaseSpec("k", server.address, TOKENS, "P", PD)}))
    rank.answer_cancels = True
    (f,) = [f for f in consumer.receiver.ledger.active() if f.transfer_key == "k"]
    f.deadline = 0.0  # the first fetch times out now
    assert finished(consumer) == ({"req-1"}, set())
    assert consumer.pop_load_errors() == set(BLOCK_IDS)
    wait_until(lambda: any(isinstance(m, ReleaseTransfer) for m in rank.seen))
    assert [m.transfer_key for m in rank.seen if isinstance(m, ReleaseTransfer)] == ["k"]


@pytest.mark.parametrize("how", ["refused", "count"])
def test_a_fetch_refused_before_it_starts_fails_in_that_step(consumer, prefill, tmp_path, how):
    """Params the scheduler refused, or a prefill count that is not this prompt's: nothing
    is asked of the prefill, the request is reported with its blocks from the first page
    fetched on as load errors, and the prefill is told to free it."""
    server, rank = prefill
    kw = {"refused": "kv_transfer_params refused: bad"} if how == "refused" else {"remote_num_tokens": TOKENS + 1}
    consumer.start_fetches(DCP2DMetadata(fetches={"req-1": spec(server.address, first_page=2, **kw)}))
    assert consumer.pop_finished() == ({"req-1"}, set())
    assert consumer.pop_load_errors() == {4, 3}
    why = ("kv_transfer_params refused: bad" if how == "refused" else
           f"length mismatch: the prefill computed remote_num_tokens={TOKENS + 1} prompt tokens, this decode has "
           f"{TOKENS}")
    assert reasons(tmp_path) == [why]
    if how == "count":  # the refused one names no engine it could be told about
        wait_until(lambda: any(isinstance(m, ReleaseTransfer) for m in rank.seen))
    assert not any(isinstance(m, TransferRequest) for m in rank.seen)


def test_a_dead_receiver_fails_the_step(consumer):
    consumer.check_alive()
    consumer.receiver.failed = "dcp2d-recv-0 died: boom"
    with pytest.raises(RuntimeError, match="DCP2D Receiver of TP rank 0 stopped: dcp2d-recv-0 died: boom"):
        consumer.check_alive()
    consumer.receiver.failed = ""
