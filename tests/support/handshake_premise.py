"""The premise of ``transfer/handshake.py`` on the raw Mooncake engine, in a process of its own
(``tests/transfer/test_handshake.py`` runs it): while ``transfer_submit_write`` waits in a silent
session's handshake, a submit to a session the engine knows waits too, until that handshake ends.

Why a process of its own: after the silent peer closes, the 0.3.13 wheel's failed handshake
once left the heap corrupt ("malloc(): unsorted double linked list corrupted", the test worker
aborted later in an unrelated allocation). Serving never submits to a session that failed the
probe; this raw path is only the premise. The child prints one JSON line with what it saw and
leaves with ``os._exit`` before any engine destructor runs."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from tests.support.bad_peers import BadPeer
from vllm_dcp2d.transfer.transport import MooncakeTransport


def main() -> None:
    out: dict = {}
    a, b = MooncakeTransport(handshake_timeout_s=1.0), MooncakeTransport(handshake_timeout_s=1.0)
    src = np.random.default_rng(1).integers(1, 255, 4096, dtype=np.uint8)
    dst = np.zeros(4096, np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    engine = a._engine
    out["known_first"] = engine.transfer_submit_write(b.session_id, src.ctypes.data, dst.ctypes.data, 64)
    with BadPeer("silent") as hole:
        threading.Thread(target=lambda: engine.transfer_submit_write(hole.session, src.ctypes.data, 0x10000, 64),
                         daemon=True).start()
        out["hole_reached"] = hole.first.wait(20)
        ticks, done, stop = [], [], threading.Event()

        def tick():
            while not stop.wait(0.01):
                ticks.append(time.monotonic())

        threading.Thread(target=tick, daemon=True).start()
        known = threading.Thread(target=lambda: done.append(
            engine.transfer_submit_write(b.session_id, src.ctypes.data, dst.ctypes.data, 64)), daemon=True)
        known.start()
        known.join(1.5)
        out["known_waited"] = known.is_alive()
        out["ticks"] = len(ticks)
        out["max_tick_gap_s"] = float(max(np.diff(ticks))) if len(ticks) > 1 else None
        t0 = time.monotonic()
        hole.close()
        known.join(20)
        stop.set()
        out["known_after_close_s"] = time.monotonic() - t0
        out["known_result"] = done[0] if done else None
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
