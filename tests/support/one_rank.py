"""One-rank prefill and decode instances on real Mooncake engines, for the trust-boundary
tests: a prefill (a ``BootstrapServer`` with a registration token and a ``Sender``) and a
decode (a ``Receiver``) over the KV layout of ``pair.py``, and one raw attempt as a stranger
sends it."""

from __future__ import annotations

import time

import numpy as np
import zmq

from tests.support.pair import DST_IDS, FP, L, PAGE_BYTES, SRC_IDS, TOKENS, regions
from tests.support.transfer import wait_fetch
from vllm_dcp2d.reshard.regions import Memory
from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.auth import NO_AUTH, Auth
from vllm_dcp2d.transfer.bootstrap import BootstrapServer
from vllm_dcp2d.transfer.messages import RegisterConsumer, TransferRequest, encode, prompt_digest
from vllm_dcp2d.transfer.receiver import Receiver
from vllm_dcp2d.transfer.sender import Sender
from vllm_dcp2d.transfer.transport import MooncakeTransport

PROMPT = list(range(TOKENS))
DIGEST = prompt_digest(PROMPT)
SECRET = b"k" * 32


class Prefill:
    """One prefill instance of one CP rank: bootstrap with a registration token, a Sender."""

    def __init__(self, stack, auth: Auth = NO_AUTH, token: str = "t0k3n", transport=None,
                 handshake_timeout_s: float | None = None, **kw):
        rng = np.random.default_rng(5)
        self.src = rng.integers(1, 255, (L, 8, PAGE_BYTES), dtype=np.uint8)
        self.transport = (MooncakeTransport() if handshake_timeout_s is None
                          else MooncakeTransport(handshake_timeout_s=handshake_timeout_s))
        stack.callback(self.transport.close)
        self.transport.register(self.src.ctypes.data, self.src.nbytes)
        self.boot = stack.enter_context(BootstrapServer(token=token, auth=auth))
        self.sender = Sender(transport(self.transport) if transport else self.transport, regions(self.src), FP,
                             engine_id="P", cp_rank=0, cp_size=1, bootstrap=self.boot.address, token=token,
                             auth=auth, **kw)
        stack.callback(self.sender.close)

    def add(self, key: str = "x", digest: str = DIGEST) -> None:
        self.sender.add_request(key, SRC_IDS, TOKENS, digest)


class Decode:
    def __init__(self, stack, auth: Auth = NO_AUTH, **kw):
        self.dst = np.zeros((L, 8, PAGE_BYTES), np.uint8)
        self.transport = MooncakeTransport()
        stack.callback(self.transport.close)
        kw = {"transfer_timeout_s": 20.0, "cancel_grace_s": 0.5} | kw
        self.recv = Receiver(self.transport, regions(self.dst), FP, engine_id="D", auth=auth,
                             buffers=[(self.dst.ctypes.data, self.dst.nbytes)], **kw)
        stack.callback(self.recv.close)

    def fetch(self, bootstrap: str, key: str = "x", digest: str = DIGEST, timeout_s: float = 20.0):
        self.recv.start(key, bootstrap, DST_IDS, num_tokens=TOKENS, prompt_digest=digest, remote_engine_id="P")
        return wait_fetch(self.recv, key, timeout_s)

    def expected(self, src) -> np.ndarray:
        want = np.zeros_like(self.dst)
        want[:, DST_IDS] = src[:, SRC_IDS]
        return want


def attempt(p: Prefill, key: str, tokens: int, digest: str, wait_s: float, attempt: int,
             session: str = "127.0.0.1:9") -> tuple[bytes, float]:
    """One attempt on a fresh link registered as ``session`` (of this host): the raw answer
    and how long it took (the stranger's view of a refusal)."""
    kv = np.zeros((L, 8, PAGE_BYTES), np.uint8)
    sock = sockets.socket(zmq.DEALER)
    try:
        sock.connect(p.sender.address)
        sock.send(encode(RegisterConsumer.of("D", session, Memory([kv.ctypes.data], [kv.nbytes]))))
        req = TransferRequest.build(regions=regions(kv), block_ids=DST_IDS, transfer_key=key, attempt_id=attempt,
                                    engine_id="D", consumer_rank=0, consumer_size=1, dcp_size=1, dcp_rank=0,
                                    num_tokens=tokens, first_page=0, num_blocks=8, fingerprint=FP, wait_s=wait_s,
                                    prompt_digest=digest)
        t0 = time.monotonic()
        sock.send(encode(req))
        assert sock.poll(10_000), "no answer"
        return sock.recv(), time.monotonic() - t0
    finally:
        sock.close()
