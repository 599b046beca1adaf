"""A finished request goes to the sender only after its KV writes are done (issue 51, item 3).

On a GPU a speculative draft's KV writes for the prompt are queued after the sampler, and
vLLM 0.34's Model Runner V2 lets the engine core see the sampled token (and finish the
request) before they ran (``AsyncOutput`` records its copy event before the drafter):
``ProducerWorker.hand_over`` records a CUDA event on the compute stream and hands the
request to the sender, whose threads read its blocks, once that event completed. No GPU
here: the event is a gate the test opens, standing where ``compat.stream_event`` records
the real one; the sender records what it is given.
"""

from __future__ import annotations

import pytest

from vllm_dcp2d.connector import producer as producer_mod
from vllm_dcp2d.connector.metadata import DCP2DMetadata, SendSpec
from vllm_dcp2d.connector.metadata import TransferKeys
from vllm_dcp2d.connector.producer import ProducerWorker
from vllm_dcp2d.connector.stats import DCP2DStats, StatsFile


class Gate:
    """A CUDA event's ``query()``: False until the queued kernels before it ran."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class Sender:
    def __init__(self):
        self.added = []

    def add_request(self, key, block_ids, num_tokens, prompt_digest):
        self.added.append(key)


def _producer(on_gpu: bool) -> ProducerWorker:
    p = ProducerWorker.__new__(ProducerWorker)  # the hand-over's state only: no vLLM config, no transport
    p.sender, p.stats, p.stats_file, p._one_host, p._on_gpu = Sender(), DCP2DStats(), StatsFile("", "producer", "e"), \
        True, on_gpu
    p.keys, p._handed, p._finished, p._unwritten = TransferKeys(), {}, set(), []
    return p


def _ready(*keys: str) -> DCP2DMetadata:
    return DCP2DMetadata(ready={f"req-{k}": SendSpec(([0, 1],), 40, k) for k in keys})


@pytest.mark.parametrize("on_gpu", [True, False])
def test_a_request_reaches_the_sender_after_the_event_of_its_step(monkeypatch, on_gpu):
    gates = []

    def stream_event(gpu):
        if not gpu:
            return None
        gates.append(Gate())
        return gates[-1]

    monkeypatch.setattr(producer_mod.compat, "stream_event", stream_event)
    p = _producer(on_gpu)
    assert p.hands_over_at_bind is (not on_gpu)  # the connector's choice of hook follows where the KV is
    p.hand_over(_ready("a", "b"))  # both finished in one step: one event after that step's kernels
    if not on_gpu:  # on CPU every write ran before the hand-over
        assert p.sender.added == ["a", "b"]
        return
    assert p.sender.added == [] and len(gates) == 1
    p.hand_over(_ready("c"))  # the next step's requests, behind their own event
    p.hand_over(DCP2DMetadata())  # a step with nothing new: the drafter of "a"/"b" still running
    assert p.sender.added == [] and len(gates) == 2
    gates[0].done = True
    p.hand_over(DCP2DMetadata())
    assert p.sender.added == ["a", "b"] and set(p._handed) == {"a", "b"}
    gates[1].done = True
    p.hand_over(DCP2DMetadata())
    assert p.sender.added == ["a", "b", "c"] and [p.keys.owner(k) for k in "abc"] == ["req-a", "req-b", "req-c"]


class Producer:
    """A producer role that records when the connector hands a step's metadata over."""

    def __init__(self, on_gpu: bool, log: list):
        self.hands_over_at_bind, self.log = not on_gpu, log

    def bind(self, meta) -> None:
        pass

    def hand_over(self, meta) -> None:
        self.log.append(("hand_over", meta))


@pytest.mark.parametrize("on_gpu", [True, False])
def test_the_connector_hands_over_before_the_forward_on_cpu_and_after_its_launch_on_gpu(on_gpu):
    """On CPU the step's finished prefills go to the sender when vLLM binds the step's
    metadata, before the forward (which on CPU is the whole step: a request waited one more
    prefill step for its fetch); on a GPU at ``start_load_kv``, after the forward's launch,
    so the event covers that step's queued work. Once per step's metadata either way."""
    from vllm_dcp2d.connector.connector import DCP2DConnector

    log = []
    c = DCP2DConnector.__new__(DCP2DConnector)  # the worker half's hooks only: no vLLM config
    c._scheduler, c._base, c._consumer, c._handed_meta = None, None, None, None
    c._producer = Producer(on_gpu, log)
    for step in range(2):
        meta = _ready(f"s{step}")
        c.bind_connector_metadata(meta)
        log.append(("forward", step))
        c.start_load_kv(None)
        c.start_load_kv(None)  # a second call with the same metadata hands nothing over again
        c.clear_connector_metadata()
        first, second = ("hand_over", meta), ("forward", step)
        assert log == ([second, first] if on_gpu else [first, second]), log
        log.clear()
