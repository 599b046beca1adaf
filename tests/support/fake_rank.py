"""A fake prefill CP rank: a ROUTER side channel registered with a bootstrap
server, answering as the test says (threads, one process)."""

from __future__ import annotations

import threading

import zmq

from vllm_dcp2d.transfer import sockets
from vllm_dcp2d.transfer.bootstrap import register_rank
from vllm_dcp2d.transfer.messages import (CancelTransfer, Fingerprint, RegisterConsumer, RegisterRank,
                                           ReleaseTransfer, TransferOutcome, TransferRequest, decode, encode)


def outcome(msg, ok: bool, settled: bool = True, num_tokens: int = 0, page_size: int = 16,
            layers: int = 1) -> TransferOutcome:
    """CP rank 0 of 1's answer to ``msg`` (a TransferRequest or CancelTransfer)."""
    return TransferOutcome(transfer_key=msg.transfer_key, attempt_id=msg.attempt_id, cp_rank=0, cp_size=1, ok=ok,
                           reason="" if ok else "cancelled", layer_start=0, layer_end=layers,
                           num_tokens=num_tokens, num_pages=-(-num_tokens // page_size), nbytes=0, descriptors=0,
                           batches=0, naive_bytes=0, plan_s=0.0, write_s=0.0, early_layers=0, settled=settled)


class FakeRank:
    """CP rank 0 of 1 of engine "P". ``reply(request)`` gives the answer to a
    TransferRequest (bytes or a message; None: silent). Cancels are answered
    (ok=False, ``settled``) only while ``answer_cancels`` is set. ``seen``: every
    message received."""

    def __init__(self, bootstrap: str, fingerprint: Fingerprint, reply=None, engine_id: str = "P"):
        self.sock = sockets.socket(zmq.ROUTER)
        self.address = sockets.bind(self.sock, "127.0.0.1")
        register_rank(bootstrap, RegisterRank(engine_id, 0, 1, self.address, fingerprint), 5)
        self.reply, self.answer_cancels, self.settled = reply, False, True
        self.layers = fingerprint.num_layers
        self.seen: list = []
        self.registered: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, payload = self.sock.recv_multipart()
            msg = decode(payload, (RegisterConsumer, TransferRequest, CancelTransfer, ReleaseTransfer))
            if isinstance(msg, RegisterConsumer):
                self.registered.append(msg)
                continue
            self.seen.append(msg)
            out = None
            if isinstance(msg, TransferRequest) and self.reply is not None:
                out = self.reply(msg)
            elif isinstance(msg, CancelTransfer) and self.answer_cancels:
                out = outcome(msg, ok=False, settled=self.settled, layers=self.layers)
            if out is not None:
                self.sock.send_multipart([ident, out if isinstance(out, bytes) else encode(out)])
        self.sock.close()

    def cancels(self) -> int:
        return sum(isinstance(m, CancelTransfer) for m in self.seen)

    def close(self):
        self.stop.set()
        self.thread.join(5)
