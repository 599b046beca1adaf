"""GB/s of a planned 2D reshard against one contiguous Mooncake write and a local memcpy.

A prefill instance of ``--cp`` processes (each holding its layer range x all
blocks) serves a decode group of ``--dcp`` processes through the real stack
(bootstrap -> TransferRequest -> plan_path -> Mooncake writes -> outcomes),
with shuffled block ids on both sides (nothing merges: one descriptor per page
per layer). Then the same number of bytes goes as one contiguous Mooncake
write between two processes, and as a local ``np.copyto``. Every transfer is
verified byte for byte. Loopback TCP (``MC_FORCE_TCP=1``).

    MC_LOG_LEVEL=ERROR .venv/bin/python bench/transfer.py [--tokens 8192 --layers 8 --cp 2 --dcp 2]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import statistics
import time
import traceback

import numpy as np

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def prefill_kv(layers: int, blocks: int, page_bytes: int) -> np.ndarray:
    """The instance's KV, uint8 ``[layers, blocks, page_bytes]`` (deterministic)."""
    return np.random.default_rng(99).integers(0, 256, (layers, blocks, page_bytes), dtype=np.uint8)


def kv_regions(buf: np.ndarray, layer_ids):
    from vllm_dcp2d.reshard.regions import KVRegions
    base = buf.ctypes.data + np.arange(buf.shape[0], dtype=np.int64) * buf.shape[1] * buf.shape[2]
    return KVRegions.uniform(list(layer_ids), base, buf.shape[2])


def digest(a) -> str:
    """The prompt digest both sides name (the bench's prompt: token ids 0..tokens-1)."""
    from vllm_dcp2d.transfer.messages import prompt_digest
    return prompt_digest(range(a.tokens))


def fingerprint(a):
    from vllm_dcp2d.transfer.messages import Fingerprint
    return Fingerprint("bench", a.layers, a.page, "uint8", a.page * a.bytes_per_token, "bench:[L,blocks,page]", "bench")


class Prefill:
    def __init__(self, a, cp_rank: int, bootstrap: str | None):
        from vllm_dcp2d.transfer.bootstrap import BootstrapServer
        from vllm_dcp2d.transfer.sender import Sender
        from vllm_dcp2d.transfer.transport import MooncakeTransport
        from vllm_dcp2d.reshard.layout import cp_layer_range

        self.a = a

        r = cp_layer_range(a.layers, a.cp, cp_rank)
        full = prefill_kv(a.layers, a.prefill_blocks, a.page * a.bytes_per_token)
        self.kv = np.ascontiguousarray(full[r.start:r.stop])
        self.server = BootstrapServer() if bootstrap is None else None
        self.bootstrap = bootstrap or self.server.address
        self.t = MooncakeTransport()
        self.t.register(self.kv.ctypes.data, self.kv.nbytes)
        self.sender = Sender(self.t, kv_regions(self.kv, r), fingerprint(a), engine_id="bench-prefill",
                             cp_rank=cp_rank, cp_size=a.cp, bootstrap=self.bootstrap)

    def info(self):
        return self.bootstrap

    def add(self, rid, src):
        self.sender.add_request(rid, src, self.a.tokens, prompt_digest=digest(self.a))

    def close(self):
        self.sender.close()
        if self.server:
            self.server.close()
        self.t.close()


class Decode:
    def __init__(self, a, dcp_rank: int):
        from vllm_dcp2d.transfer.receiver import Receiver
        from vllm_dcp2d.transfer.transport import MooncakeTransport

        self.a = a

        self.kv = np.zeros((a.layers, -(-a.pages // a.dcp), a.page * a.bytes_per_token), np.uint8)
        self.t = MooncakeTransport()
        self.r = Receiver(self.t, kv_regions(self.kv, range(a.layers)), fingerprint(a), engine_id="bench-decode",
                          consumer_rank=dcp_rank, consumer_size=a.dcp, dcp_size=a.dcp, dcp_rank=dcp_rank,
                          buffers=[(self.kv.ctypes.data, self.kv.nbytes)], transfer_timeout_s=600)
        self.scratch = None

    def start(self, rid, bootstrap, dst):
        self.kv[:] = 0
        self.r.start(rid, bootstrap, dst, num_tokens=self.a.tokens, prompt_digest=digest(self.a))

    def wait(self, rid):
        deadline = time.monotonic() + 600
        while not (done := [f for f in self.r.poll() if f.transfer_key == rid]):  # one fetch at a time here
            if time.monotonic() >= deadline:
                raise TimeoutError(f"fetch of {rid!r} not finished within 600 s")
            time.sleep(0.005)
        f = done[0]
        if not f.ok:
            raise RuntimeError(str(f.error))
        return {"seconds": f.seconds, "nbytes": f.nbytes, "naive": f.naive_bytes,
                "desc": sum(o.descriptors for o in f.outcomes.values()),
                "write_s": max(o.write_s for o in f.outcomes.values())}

    def dump(self):
        return self.kv.copy()

    def make_scratch(self, nbytes):
        self.scratch = np.zeros(nbytes, np.uint8)
        self.t.register(self.scratch.ctypes.data, nbytes)
        return self.t.session_id, self.scratch.ctypes.data

    def scratch_digest(self):
        d = hashlib.sha256(self.scratch).hexdigest()
        self.scratch[:] = 0
        return d

    def close(self):
        self.r.close()
        self.t.close()


def _serve(conn, cls, args):
    obj = cls(*args)
    conn.send(None)
    while True:
        cmd, params = conn.recv()
        try:
            conn.send((True, getattr(obj, cmd)(*params)))
        except Exception:
            conn.send((False, traceback.format_exc()))
        if cmd == "close":
            return


class Proc:
    def __init__(self, cls, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_serve, args=(child, cls, args), daemon=True)
        self.p.start()
        if not self.conn.poll(120):
            raise TimeoutError(f"{cls.__name__} did not start")
        self.conn.recv()

    def send(self, cmd, *params):
        self.conn.send((cmd, params))

    def result(self, timeout=600):
        if not self.conn.poll(timeout):
            raise TimeoutError("worker gave no answer")
        ok, v = self.conn.recv()
        if not ok:
            raise RuntimeError(v)
        return v

    def call(self, cmd, *params):
        self.send(cmd, *params)
        return self.result()

    def stop(self):
        try:
            self.call("close")
        finally:
            self.p.join(10)
            if self.p.is_alive():
                self.p.kill()


def expected(full, src, dst, dcp, d):
    """Reference decode buffer of DCP rank d: uint8 ``[L, cdiv(P, dcp), page_bytes]``."""
    pages = np.arange(d, src.size, dcp)
    out = np.zeros((full.shape[0], -(-src.size // dcp), full.shape[2]), np.uint8)
    out[:, dst[pages // dcp]] = full[:, src[pages]]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bytes-per-token", type=int, default=576, help="per layer (GLM-5.2 DSA latent, FP8)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    a.pages = -(-a.tokens // a.page)
    a.prefill_blocks = 2 * a.pages
    page_bytes = a.page * a.bytes_per_token
    total = a.pages * a.layers * page_bytes
    rng = np.random.default_rng(0)

    t0 = time.perf_counter()
    prefill = [Proc(Prefill, a, 0, None)]
    boot = prefill[0].call("info")
    prefill += [Proc(Prefill, a, r, boot) for r in range(1, a.cp)]
    decode = [Proc(Decode, a, d) for d in range(a.dcp)]
    print(f"started {a.cp} prefill + {a.dcp} decode processes in {time.perf_counter() - t0:.1f}s")
    full = prefill_kv(a.layers, a.prefill_blocks, page_bytes)
    rows = {}
    try:
        # 1) planned 2D reshard through the whole stack.
        walls, writes, info = [], [], None
        for i in range(a.reps + 1):  # first round warms up connections
            rid = f"bench-{i}"
            src = rng.permutation(a.prefill_blocks)[:a.pages]
            dst = rng.permutation(-(-a.pages // a.dcp))
            for p in prefill:
                p.call("add", rid, src)
            for d, p in enumerate(decode):
                p.send("start", rid, boot, dst)
            for p in decode:
                p.result()
            res = [p.call("wait", rid) for p in decode]
            for d, p in enumerate(decode):
                if not np.array_equal(p.call("dump"), expected(full, src, dst, a.dcp, d)):
                    raise AssertionError(f"round {i}: DCP rank {d} holds wrong bytes")
            if i:
                walls.append(max(r["seconds"] for r in res))
                writes.append(max(r["write_s"] for r in res))
            info = res
        nbytes = sum(r["nbytes"] for r in info)
        naive = sum(r["naive"] for r in info)
        assert nbytes == total, (nbytes, total)
        desc = sum(r["desc"] for r in info)
        rows["2D reshard, fetch (bootstrap+plan+write)"] = (nbytes, desc, walls)
        rows["2D reshard, slowest path's writes"] = (nbytes, desc, writes)

        # 2) one contiguous Mooncake write of the same bytes, process to process.
        from vllm_dcp2d.reshard.plan import Descriptors
        from vllm_dcp2d.transfer.transport import MooncakeTransport
        src_buf = rng.integers(0, 256, total, dtype=np.uint8)
        digest = hashlib.sha256(src_buf).hexdigest()
        session, addr = decode[0].call("make_scratch", total)
        with MooncakeTransport() as t:
            t.register(src_buf.ctypes.data, total)
            one = Descriptors(np.array([src_buf.ctypes.data]), np.array([addr]), np.array([total]))
            secs = []
            for i in range(a.reps + 1):
                t1 = time.perf_counter()
                t.write(session, one)
                if i:
                    secs.append(time.perf_counter() - t1)
                if decode[0].call("scratch_digest") != digest:
                    raise AssertionError("contiguous write landed wrong bytes")
        rows["contiguous Mooncake write, 1 descriptor"] = (total, 1, secs)

        # 3) local memcpy of the same bytes, and the same reshard as a local gather.
        dst_buf = np.empty_like(src_buf)
        secs = []
        for _ in range(a.reps):
            t1 = time.perf_counter()
            np.copyto(dst_buf, src_buf)
            secs.append(time.perf_counter() - t1)
        assert np.array_equal(dst_buf, src_buf)
        rows["local memcpy (np.copyto)"] = (total, 1, secs)
        src = rng.permutation(a.prefill_blocks)[:a.pages]
        dst = rng.permutation(-(-a.pages // a.dcp))
        outs = [np.empty((a.layers, -(-a.pages // a.dcp), page_bytes), np.uint8) for _ in range(a.dcp)]
        secs = []
        for _ in range(a.reps):
            t1 = time.perf_counter()
            for d, out in enumerate(outs):
                pages = np.arange(d, a.pages, a.dcp)
                out[:, dst[pages // a.dcp]] = full[:, src[pages]]
            secs.append(time.perf_counter() - t1)
        assert all(np.array_equal(o, expected(full, src, dst, a.dcp, d)) for d, o in enumerate(outs))
        rows["local reshard gather (numpy fancy index)"] = (total, a.pages * a.layers, secs)
    finally:
        for p in decode + prefill[::-1]:
            p.stop()

    contiguous = statistics.median(rows["contiguous Mooncake write, 1 descriptor"][2])
    memcpy = statistics.median(rows["local memcpy (np.copyto)"][2])
    print(f"\nCP{a.cp} x DCP{a.dcp}: {a.tokens} tokens, {a.layers} layers x {a.bytes_per_token} B/token/layer, "
          f"page {a.page} ({page_bytes} B), {a.pages} pages, shuffled block ids; {a.reps} reps, all verified")
    print(f"KV moved: {total / 1e6:.1f} MB (1.0x); a naive full-sequence send to every DCP rank: "
          f"{naive / 1e6:.1f} MB ({naive / total:.1f}x)\n")
    head = f"{'case':44s} {'MB':>5s} {'descr':>5s} {'med ms':>7s} {'min ms':>7s} {'GB/s':>5s} {'best':>5s} " \
           f"{'x contig':>8s} {'x memcpy':>8s}"
    print(head)
    print("-" * len(head))
    for name, (nb, nd, secs) in rows.items():
        med = statistics.median(secs)
        print(f"{name:44s} {nb / 1e6:5.1f} {nd:5d} {med * 1e3:7.1f} {min(secs) * 1e3:7.1f} {nb / med / 1e9:5.2f} "
              f"{nb / min(secs) / 1e9:5.2f} {contiguous / med:8.2f} {memcpy / med:8.3f}")
    print("\nGB/s = 1e9 B/s from the median, best = from the min; 'x contig' / 'x memcpy' = median speed "
          "relative to those rows.")


if __name__ == "__main__":
    main()
