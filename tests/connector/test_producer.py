"""``ProducerWorker`` driven directly, as the connector drives it each step: a real
``WorkerBase`` (its Mooncake transport), the real bootstrap server and ``Sender`` it
starts, and a real ``Receiver`` on another Mooncake engine fetching from it (one process)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from tests.support.pair import BLOCKS, FP, L, PAGE, PAGE_BYTES, SRC_IDS, DST_IDS, TOKENS, regions, wait_until
from tests.support.transfer import PD, wait_fetch

from vllm_dcp2d.config import parse_extra_config
from vllm_dcp2d.connector.metadata import DCP2DMetadata, SendSpec
from vllm_dcp2d.connector.producer import ProducerWorker
from vllm_dcp2d.connector.worker import KVCaches, WorkerBase
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.transfer.transport import MooncakeTransport

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]
PAGES = -(-TOKENS // PAGE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def producer():
    """A started producer role of TP rank 0 of 1 (CP rank 0 of 1: every layer), its KV
    filled with one byte value per (layer, block)."""
    cfg = parse_extra_config({"bootstrap_port": free_port(), "http_bootstrap_port": 0, "send_timeout_s": 60.0})
    base = WorkerBase(cfg, "P", True, False, num_kv_heads=FP.num_kv_heads, page_size=PAGE, num_blocks=BLOCKS)
    kv = np.zeros((L, BLOCKS, PAGE_BYTES), np.uint8)
    kv[:] = (np.arange(L)[:, None, None] * 16 + np.arange(BLOCKS)[None, :, None] + 1).astype(np.uint8)
    caches = KVCaches({}, {}, regions(kv), [(kv.ctypes.data, kv.nbytes)], FP, L, None, 0)
    p = ProducerWorker(base)
    base.open_transport(caches)
    p.start(caches, "t0k3n")
    p.kv = kv
    yield p
    p.close()
    base.close()
    assert (p.sender, p.bootstrap, base.transport) == (None, None, None)


@pytest.fixture
def decode():
    t = MooncakeTransport()
    dst = np.zeros((L, BLOCKS, PAGE_BYTES), np.uint8)
    r = Receiver(t, regions(dst), FP, engine_id="D", buffers=[(dst.ctypes.data, dst.nbytes)],
                 transfer_timeout_s=30.0, prefill_wait_s=20.0)
    r.dst = dst
    yield r
    r.close()
    t.close()


def ready(req_id: str, key: str) -> DCP2DMetadata:
    return DCP2DMetadata(ready={req_id: SendSpec((SRC_IDS.tolist(),), TOKENS, key, 0.0, PD)})


def sending(p: ProducerWorker, timeout_s: float = 20.0) -> set[str]:
    got: set[str] = set()
    wait_until(lambda: got.update(p.pop_finished()) or got, timeout_s)
    return got


def test_a_finished_request_is_served_byte_exact_then_freed_by_its_request_id(producer, decode):
    producer.hand_over(ready("req-1", "key-1"))
    assert producer.keys.owner("key-1") == "req-1"
    decode.start("key-1", producer.bootstrap.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    f = wait_fetch(decode, "key-1", 30)
    assert f.ok, f.error
    for layer in range(L):
        assert np.array_equal(decode.dst[layer, DST_IDS[:PAGES]], producer.kv[layer, SRC_IDS[:PAGES]])
    assert sending(producer) == {"req-1"}  # the one decode rank has it: vLLM may free its blocks
    assert producer.keys.owner("key-1") is None and len(producer.keys) == 0
    assert producer.stats.data["held_seconds"]


def test_a_dropped_request_fails_the_fetch_waiting_for_it(producer, decode):
    """Aborted before its prompt completed: the fetch that came early and waits for it
    fails in the step that drops it, naming why; nothing is held."""
    decode.start("early", producer.bootstrap.address, DST_IDS, num_tokens=TOKENS, prompt_digest=PD)
    wait_until(lambda: producer.sender.waiting("early"))
    producer.hand_over(DCP2DMetadata(dropped={"req-2": "early"}))
    f = wait_fetch(decode, "early", 30)
    assert not f.ok and f.error is not None
    assert producer.pop_finished() == set() and not decode.dst.any()


def test_an_aborted_request_is_freed_once_no_write_reads_it(producer):
    producer.hand_over(DCP2DMetadata(aborted={"req-3": "key-3"}))
    assert sending(producer) == {"req-3"}


def test_a_dead_sender_fails_the_step(producer, monkeypatch):
    producer.check_alive()
    monkeypatch.setattr(Sender, "failed", property(lambda self: "dcp2d-send-io-0 died: boom"))
    with pytest.raises(RuntimeError, match="DCP2D Sender of TP rank 0 stopped: dcp2d-send-io-0 died: boom"):
        producer.check_alive()
