"""Worker processes of the multi-process transfer tests (no vLLM, loopback only).

A prefill CP rank holds KV for its own layer range x all blocks; a decode DCP
rank holds KV for all layers x its blocks. Both are numpy uint8 buffers
``[layers, blocks, STRIDE]`` registered with Mooncake; each block row holds
two regions (K at offset 0, V at ``V_OFF``) with gaps that must never be
written. The parent drives each worker through a pipe: ``Proc.call(cmd, ...)``
runs the worker object's method ``cmd`` and returns its result.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import numpy as np
from tests.support.logs import attach
from tests.support.transfer import PD, wait_fetch

STRIDE = 1024                  # bytes per block row of one layer
K_BYTES, V_OFF, V_BYTES = 256, 384, 512
PAGE_BYTES = K_BYTES + V_BYTES
PAGE_SIZE = 16
SENTINEL = 0xEE


def fingerprint(**kw):
    from vllm_dcp2d.transfer.messages import Fingerprint
    args = dict(model="test-model", num_layers=5, page_size=PAGE_SIZE, kv_dtype="uint8", page_bytes=PAGE_BYTES,
                layout="test:[layers,blocks,K256|gap|V512|gap]", model_config="sha256:test")
    args.update(kw)
    return Fingerprint(**args)


def full_kv(num_layers: int, num_blocks: int, seed: int = 1234) -> np.ndarray:
    """The prefill instance's whole KV: uint8 ``[num_layers, num_blocks, STRIDE]``."""
    return np.random.default_rng(seed).integers(0, 256, (num_layers, num_blocks, STRIDE), dtype=np.uint8)


def regions(buf: np.ndarray, layer_ids):
    """KVRegions of ``buf`` (uint8 ``[len(layer_ids), blocks, STRIDE]``): K and V planes."""
    from vllm_dcp2d.reshard.regions import KVRegions
    layer_base = buf.ctypes.data + np.arange(len(layer_ids), dtype=np.int64) * buf.shape[1] * STRIDE
    return KVRegions(np.asarray(layer_ids), np.stack([layer_base, layer_base + V_OFF], axis=1),
                     np.array([STRIDE, STRIDE]), np.array([K_BYTES, V_BYTES]))


def expect_fetch(before: np.ndarray, full: np.ndarray, src_ids, dst_ids, dcp_size: int, dcp_rank: int,
                 first_page: int, num_pages: int) -> np.ndarray:
    """Reference decode buffer after one fetch, built page by page from the prefill KV.

    before: uint8 ``[L, Bd, STRIDE]`` the rank's buffer before; full: uint8 ``[L, Bp, STRIDE]``.
    """
    out = before.copy()
    for i in range(first_page, num_pages):
        if i % dcp_size == dcp_rank:
            d, s = dst_ids[i // dcp_size], src_ids[i]
            out[:, d, :K_BYTES] = full[:, s, :K_BYTES]
            out[:, d, V_OFF:V_OFF + V_BYTES] = full[:, s, V_OFF:V_OFF + V_BYTES]
    return out


class FailedWrites:
    """A rank's transport, keeping the error of each write that raised (Mooncake's return
    code among it): the reason the sender then answers that attempt with."""

    def __init__(self, real):
        self.real, self.errors = real, []

    def write(self, peer, desc, stalls=None, not_after_ns=0):
        try:
            return self.real.write(peer, desc, stalls, not_after_ns)
        except Exception as e:
            self.errors.append(str(e))
            raise

    def __getattr__(self, name):  # register, registered, opened, sessions, ...: the real transport's
        return getattr(self.real, name)


class PrefillRank:
    def __init__(self, cp_rank: int, cp_size: int, num_layers: int, num_blocks: int, bootstrap: str | None,
                 fp: dict):
        from vllm_dcp2d.transfer.bootstrap import BootstrapServer
        from vllm_dcp2d.transfer.sender import Sender
        from vllm_dcp2d.transfer.transport import MooncakeTransport
        from vllm_dcp2d.reshard.layout import cp_layer_range

        layers = cp_layer_range(num_layers, cp_size, cp_rank)
        self.kv = np.ascontiguousarray(full_kv(num_layers, num_blocks)[layers.start:layers.stop])
        self.server = BootstrapServer() if bootstrap is None else None
        self.bootstrap = bootstrap or self.server.address
        self.transport = MooncakeTransport()
        self.transport.register(self.kv.ctypes.data, self.kv.nbytes)
        # what this rank refused, rejected or failed, as it logs it (from its start: the first
        # of each kind always comes, tests/support/logs.py), and the writes that failed
        self.warned = attach("vllm_dcp2d.transfer.sender").messages
        self.writes = FailedWrites(self.transport)
        self.sender = Sender(self.writes, regions(self.kv, list(layers)), fingerprint(**fp),
                             engine_id="prefill", cp_rank=cp_rank, cp_size=cp_size, bootstrap=self.bootstrap,
                             send_timeout_s=60.0)

    def info(self):
        return {"address": self.sender.address, "bootstrap": self.bootstrap, "pid": os.getpid()}

    def add(self, request_id, block_ids, num_pages=None, send_timeout_s=None):
        if send_timeout_s is not None:
            self.sender.send_timeout_s = send_timeout_s
        self.sender.add_request(request_id, block_ids, PAGE_SIZE * (len(block_ids) if num_pages is None else num_pages), prompt_digest=PD)
        self.sender.send_timeout_s = 60.0

    def finished(self):
        return self.sender.pop_finished()

    def stats(self):
        return {"warned": list(self.warned), "failed_writes": list(self.writes.errors)}

    def registered(self):
        return self.transport.registered()

    def close(self):
        self.sender.close()
        if self.server is not None:
            self.server.close()
        self.transport.close()
        return self.transport.registered()


class DecodeRank:
    def __init__(self, engine_id: str, dcp_size: int, dcp_rank: int, num_layers: int, num_blocks: int, fp: dict):
        from vllm_dcp2d.transfer.receiver import Receiver
        from vllm_dcp2d.transfer.transport import MooncakeTransport

        self.kv = np.full((num_layers, num_blocks, STRIDE), SENTINEL, dtype=np.uint8)
        self.transport = MooncakeTransport()
        self.args = dict(engine_id=engine_id, consumer_rank=dcp_rank, consumer_size=dcp_size, dcp_size=dcp_size,
                         dcp_rank=dcp_rank)
        self.regions = regions(self.kv, range(num_layers))
        self.receiver = Receiver(self.transport, self.regions, fingerprint(**fp),
                                 buffers=[(self.kv.ctypes.data, self.kv.nbytes)], transfer_timeout_s=20.0, **self.args)

    def start(self, request_id, bootstrap, block_ids, first_page=0, timeout_s=None, wait_s=None, num_pages=None):
        """num_pages: of the request (default: every page the block table holds at this DCP size)."""
        n = len(block_ids) * self.args["dcp_size"] if num_pages is None else num_pages
        self.receiver.start(request_id, bootstrap, block_ids, first_page, timeout_s, wait_s,
                            num_tokens=PAGE_SIZE * n, prompt_digest=PD)

    def wait(self, request_id, timeout_s=30.0):
        return _fetch_dict(wait_fetch(self.receiver, request_id, timeout_s))

    def fetch(self, request_id, bootstrap, block_ids, first_page=0, timeout_s=None, wait_s=None, num_pages=None):
        self.start(request_id, bootstrap, block_ids, first_page, timeout_s, wait_s, num_pages)
        return self.wait(request_id)

    def fetch_with_fingerprint(self, fp: dict, request_id, bootstrap, block_ids):
        """Fetch through a second receiver that claims another KV format."""
        from vllm_dcp2d.transfer.receiver import Receiver
        with Receiver(self.transport, self.regions, fingerprint(**fp), transfer_timeout_s=10.0, **self.args) as r:
            r.start(request_id, bootstrap, block_ids, num_tokens=PAGE_SIZE * len(block_ids) * self.args["dcp_size"], prompt_digest=PD)
            return _fetch_dict(wait_fetch(r, request_id, 15.0))

    def lifted(self):
        return [f.transfer_key for f in self.receiver.poll_lifted()]

    def dump(self):
        return self.kv.copy()

    def registered(self):
        return self.transport.registered()

    def close(self):
        self.receiver.close()
        self.transport.close()
        return self.transport.registered()


def _fetch_dict(f):
    return {"ok": f.ok, "error": None if f.error is None else str(f.error), "quarantined": sorted(f.quarantined),
            "cp_rank": None if f.error is None else f.error.cp_rank, "seconds": f.seconds,
            "nbytes": f.nbytes, "naive_bytes": f.naive_bytes,
            "per_rank": {r: (o.nbytes, o.descriptors, o.write_s) for r, o in f.outcomes.items()}}


def _serve(conn, cls, kwargs):
    try:
        obj = cls(**kwargs)
    except Exception:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:  # the parent is gone
            obj.close()
            return
        try:
            conn.send((True, getattr(obj, cmd)(*args)))
        except Exception:
            conn.send((False, traceback.format_exc()))
        if cmd == "close":
            return


class Proc:
    """A worker process (spawned, so no inherited threads) driven over a pipe."""

    def __init__(self, cls, **kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cls, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.result(60.0)  # construction

    def send(self, cmd, *args):
        self.conn.send((cmd, args))

    def result(self, timeout_s: float = 30.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker pid {self.proc.pid} gave no answer within {timeout_s}s")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"worker pid {self.proc.pid} failed:\n{value}")
        return value

    def call(self, cmd, *args, timeout_s: float = 30.0):
        self.send(cmd, *args)
        return self.result(timeout_s)

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def stop(self):
        """Close the worker's objects; returns what is still registered (must be {})."""
        left = None
        if self.proc.is_alive():
            try:
                left = self.call("close", timeout_s=15.0)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
        return left
