"""A producer request that vLLM preempts after its prompt completed, with a fetch
waiting for it (the layer-pipelined order), in a real in-process vLLM engine.

The race, forced step by step: step 1 prefills ``C`` (``C_TOKENS``), step 2
decodes ``C`` and prefills all of ``A`` (so ``A`` is in ``computing`` and its
layers are queued for the waiting fetch, held behind a gate on the sender's
workers), step 3 finds no block for ``C``'s next token and preempts ``A`` (the
last admitted): vLLM frees ``A``'s blocks and hands one to ``C``, whose KV the
step's forward writes into it. Only then does the gate open. ``A`` is then
prefilled again in fresh blocks and finishes.

The decode side is a real ``Receiver`` (real Mooncake, loopback) in this process;
what it received must equal, byte for byte, the prefill's KV of ``A``'s prompt at
the moment ``A`` finished. Without ``handle_preemptions`` the queued layer writes
read ``A``'s old blocks, one of them now holding ``C``'s token, and counted as
sent, so the answer after the re-prefill skipped them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time

import numpy as np
import pytest

from vllm_dcp2d.transfer.messages import prompt_digest
from vllm_dcp2d.local.servers import free_port
from tests.support.transfer import writes_in_flight

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]

PAGE = 32
C_TOKENS = 2 * PAGE - 1  # C's second decode token needs a third block
A_TOKENS = 2 * PAGE      # A's prompt fills two blocks exactly
BLOCKS = 5               # the null block + C's 2 + A's 2: step 3 has none to spare


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()  # restored after the module: later engines pick their own process split
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("MC_FORCE_TCP", os.environ.get("MC_FORCE_TCP", "1"))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from vllm_dcp2d.local.tiny_models import build_tiny_model

    model = build_tiny_model("llama", tmp_path_factory.mktemp("preempt") / "model")
    kv = KVTransferConfig(kv_connector="DCP2DConnector", kv_role="kv_producer",
                          kv_connector_extra_config={"bootstrap_port": free_port(), "send_timeout_s": 60.0})
    gc.collect()  # an earlier module's dead engine: its finalizer must not run during this start
    llm = LLM(model=model, distributed_executor_backend="uni", enforce_eager=True, block_size=PAGE,
              kv_cache_memory_bytes=4 << 20, num_gpu_blocks_override=BLOCKS, max_model_len=(BLOCKS - 1) * PAGE, max_num_seqs=4, max_num_batched_tokens=512,
              enable_prefix_caching=False, kv_transfer_config=kv)
    yield llm
    del llm
    # Collected now, not during the next module's engine: an in-process engine's finalizer
    # tears down vLLM's process-wide TP group, which the next engine has set up by then
    # ("tensor model parallel group is not initialized", seen in a full run).
    gc.collect()
    mp.undo()


class Probe:
    """The in-process engine's parts a test needs: its scheduler, the producer's
    sender, and a snapshot of a request's prompt KV when it finishes."""

    def __init__(self, llm):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.llm = llm.llm_engine
        self.sched = self.llm.engine_core.engine_core.scheduler
        self.sender = get_kv_transfer_group()._producer.sender
        self.final: dict[str, np.ndarray] = {}
        self.computing: dict[str, list[int]] = {}
        side = self.sched.connector._scheduler
        finished, build = side.request_finished, side.build_connector_meta

        def request_finished(request, block_ids):
            if request.request_id in self.computing:
                self.final[request.request_id] = self.read(block_ids[0][:-(-A_TOKENS // PAGE)])
            return finished(request, block_ids)

        def build_connector_meta(out):
            meta = build(out)
            for req_id, spec in meta.computing.items():
                self.computing[req_id] = list(spec.block_ids[0])
            return meta

        side.request_finished, side.build_connector_meta = request_finished, build_connector_meta
        self._undo = lambda: (setattr(side, "request_finished", finished),
                              setattr(side, "build_connector_meta", build))

    def read(self, block_ids) -> np.ndarray:
        """The producer's bytes of ``block_ids``: uint8 ``[L, R, len(block_ids), page_bytes]``."""
        r = self.sender.regions
        out = np.zeros((r.layer_ids.size, r.num_regions, len(block_ids), int(r.page_bytes.max())), np.uint8)
        for k in range(r.layer_ids.size):
            for j in range(r.num_regions):
                for i, b in enumerate(block_ids):
                    addr = int(r.base[k, j] + b * r.page_stride[j])
                    n = int(r.page_bytes[j])
                    out[k, j, i, :n] = np.frombuffer(ctypes.string_at(addr, n), np.uint8)
        return out

    def internal(self, req_id: str) -> str:
        """The scheduler's id of request ``req_id`` (vLLM appends a suffix)."""
        (rid,) = [r for r in self.sched.requests if r.startswith(req_id + "-")]
        return rid

    def request(self, req_id: str):
        return self.sched.requests[self.internal(req_id)]

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(self.internal(req_id))[0])

    def close(self):
        self._undo()


class Decode:
    """A decode DCP rank of one (DCP=1): a real Receiver over real Mooncake, with
    the producer's page format, into a buffer of its own."""

    def __init__(self, stack, sender, port: int):
        from vllm_dcp2d.reshard.regions import KVRegions
        from vllm_dcp2d.transfer.receiver import Receiver
        from vllm_dcp2d.transfer.transport import MooncakeTransport

        src = sender.regions
        self.page_bytes = int(src.page_bytes.sum())
        self.buf = np.zeros((src.layer_ids.size, 8, self.page_bytes), np.uint8)
        offsets = np.concatenate(([0], np.cumsum(src.page_bytes)[:-1]))
        base = (self.buf.ctypes.data + np.arange(src.layer_ids.size)[:, None] * self.buf[0].nbytes
                + offsets[None, :])
        regions = KVRegions(src.layer_ids, base, np.full(src.num_regions, self.page_bytes), src.page_bytes)
        t = MooncakeTransport()
        stack.callback(t.close)
        self.recv = Receiver(t, regions, sender.fingerprint, engine_id="decode",
                             buffers=[(self.buf.ctypes.data, self.buf.nbytes)], transfer_timeout_s=120.0, cancel_grace_s=1.0)
        stack.callback(self.recv.close)
        self.bootstrap = f"tcp://127.0.0.1:{port}"
        self.regions = src

    def received(self, dst_ids) -> np.ndarray:
        """What landed, in ``Probe.read``'s shape."""
        r = self.regions
        out = np.zeros((r.layer_ids.size, r.num_regions, len(dst_ids), int(r.page_bytes.max())), np.uint8)
        offsets = np.concatenate(([0], np.cumsum(r.page_bytes)[:-1]))
        for j in range(r.num_regions):
            n = int(r.page_bytes[j])
            out[:, j, :, :n] = self.buf[:, dst_ids, offsets[j]:offsets[j] + n]
        return out


class Gate:
    """Blocks the sender's writer for the decode rank at ``session`` until ``open()``:
    layer writes queued behind it (that decode's, in order) run only then."""

    def __init__(self, sender, session: str):
        self._open = threading.Event()
        self.entered = threading.Semaphore(0)
        sender._writers.submit(session, self._wait)
        assert self.entered.acquire(timeout=10), "the sender's writer did not reach the gate"

    def _wait(self):
        self.entered.release()
        assert self._open.wait(60), "gate never opened"

    def open(self):
        self._open.set()


def greedy(n: int, params: dict | None = None):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                          extra_args=None if params is None else {"kv_transfer_params": params})


def prompt(n: int, seed: int) -> dict:
    return {"prompt_token_ids": [(seed * 31 + 7 * i) % 400 + 5 for i in range(n)]}


@contextlib.contextmanager
def race(engine, key: str):
    """Run the module doc's steps 1-3 with a fetch of ``key`` waiting; yields
    ``(probe, decode, a_id, A's id in the scheduler, dst_ids)`` right after step 3,
    the gate open."""
    probe = Probe(engine)
    run_until(probe, lambda: probe.free_blocks() == BLOCKS - 1)  # an earlier test's blocks are back
    try:
        with contextlib.ExitStack() as stack:
            kv = engine.llm_engine.vllm_config.kv_transfer_config
            decode = Decode(stack, probe.sender, kv.kv_connector_extra_config["bootstrap_port"])
            dst_ids = np.array([3, 6])
            decode.recv.start(key, decode.bootstrap, dst_ids, num_tokens=A_TOKENS, prefill_wait_s=120.0,
                              remote_engine_id=kv.engine_id,
                              prompt_digest=prompt_digest(prompt(A_TOKENS, 2)["prompt_token_ids"]))
            deadline = time.monotonic() + 20
            while probe.sender.waiting(key) != 1:
                assert time.monotonic() < deadline, "the fetch never reached the prefill rank"
                time.sleep(0.01)
            c_id, a_id = f"C-{key}", f"A-{key}"
            probe.llm.add_request(c_id, prompt(C_TOKENS, 1), greedy(4))
            probe.llm.step()                                   # step 1: C's prefill
            probe.llm.add_request(a_id, prompt(A_TOKENS, 2), greedy(3, {"do_remote_decode": True,
                                                                          "transfer_id": key}))
            gate = Gate(probe.sender, decode.recv.transport.session_id)
            probe.llm.step()                                   # step 2: C decodes, A's whole prompt
            a_internal = probe.internal(a_id)
            old = probe.computing[a_internal]
            assert probe.request(a_id).num_preemptions == 0
            probe.llm.step()                                   # step 3: C needs a block: A preempted
            assert probe.request(a_id).num_preemptions == 1, "the scenario did not preempt A"
            stolen = set(probe.blocks(c_id)) & set(old)
            assert stolen, f"C got none of A's freed blocks {old} (C has {probe.blocks(c_id)})"
            gate.open()
            yield probe, decode, a_id, a_internal, dst_ids
    finally:
        probe.close()


def run_until(probe, cond, timeout_s: float = 60.0):
    """Step the engine until ``cond()`` (it keeps stepping while transfers are open)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        probe.llm.step()
        time.sleep(0.005)


def test_preempted_prefill_sends_the_reprefilled_kv(engine):
    with race(engine, "preempted") as (probe, decode, _, a_internal, dst_ids):
        done = []
        run_until(probe, lambda: done.extend(decode.recv.poll()) or done)
        (f,) = done
        assert f.ok, f.error
        assert a_internal in probe.final, "A never finished"
        np.testing.assert_array_equal(decode.received(dst_ids), probe.final[a_internal])
        assert f.outcomes[0].early_layers == len(probe.sender.layers)  # the re-prefill's layer writes
        run_until(probe, lambda: not probe.llm.has_unfinished_requests())


def test_abort_after_preemption_fails_the_waiting_fetch_at_once(engine):
    with race(engine, "aborted") as (probe, decode, a_id, _, _):
        probe.llm.abort_request([a_id])
        t0 = time.monotonic()
        done = []
        run_until(probe, lambda: done.extend(decode.recv.poll()) or done, timeout_s=20)
        (f,) = done
        assert not f.ok and "aborted" in str(f.error), f.error
        assert time.monotonic() - t0 < 10  # not after the fetch's wait_s (120 s)
        run_until(probe, lambda: not probe.llm.has_unfinished_requests())
        assert writes_in_flight(probe.sender.ledger) == 0
