"""Waiting for one fetch of a ``Receiver`` in a test (serving polls: ``Receiver.poll``)."""

from __future__ import annotations

import time
import weakref

from vllm_dcp2d.transfer.fetch import Fetch
from vllm_dcp2d.transfer.receiver import Receiver

# fetches a wait took off a receiver's poll that were not the one it waited for
_others: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wait_fetch(receiver: Receiver, transfer_key: str, timeout_s: float) -> Fetch:
    """Block until the fetch of ``transfer_key`` ended and return it; the other fetches
    that ended meanwhile stay for a later ``wait_fetch``."""
    others = _others.setdefault(receiver, [])
    deadline = time.monotonic() + timeout_s
    while True:
        others.extend(receiver.poll())
        mine = [f for f in others if f.transfer_key == transfer_key]
        if mine:
            others.remove(mine[0])
            return mine[0]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"fetch of {transfer_key!r} not finished within {timeout_s}s")
        time.sleep(0.005)
