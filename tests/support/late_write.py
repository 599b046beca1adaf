"""Helper of ``test_stalled_write.py`` (no vLLM, loopback), two facts of Mooncake TCP.

``python late_write.py HOLD_S``: does a write that returned -1 after a stall still land?

A target process registers a zeroed buffer; this process warms the session, freezes
the target (SIGSTOP), writes ``NBYTES`` of 0xA1 until the engine gives the write up
(-1 after ``MC_TCP_PROGRESS_TIMEOUT_SEC``), fills its source with 0xC3, waits
``HOLD_S`` more, resumes the target and asks it which byte values its buffer holds.
The target was frozen for the whole attempt, so any non-zero byte arrived after
the -1; 0xC3 bytes were even read from the source after it. Prints one JSON line.

``python late_write.py fence``: does a write still land once the target unregistered
the range? This process is the target; an initiator process writes ``FENCE_BYTES``
and is frozen (SIGSTOP) once the first bytes arrived; the target unregisters, then
the initiator resumes. Prints the bytes landed before and after, and its return code.
"""

import json
import os
import signal
import subprocess
import sys
import time

TARGET = r'''
import sys, numpy as np
from mooncake.engine import TransferEngine
e = TransferEngine(); assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(int(sys.argv[1]), np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(f"127.0.0.1:{e.get_rpc_port()} {buf.ctypes.data}", flush=True)
for _ in sys.stdin:
    print(" ".join(map(str, np.unique(buf).tolist())), flush=True)
'''
NBYTES = 16 << 20
STALL_S = 3  # the engine's minimum that still leaves a clear stall


def main(hold_s: float) -> None:
    os.environ.update(MC_FORCE_TCP="1", MC_TCP_PROGRESS_TIMEOUT_SEC=str(STALL_S), MC_LOG_LEVEL="ERROR",
                      MC_TCP_STATUS_TIMEOUT_SEC=str(STALL_S), MC_TRANSFER_TIMEOUT="5")
    import numpy as np
    from mooncake.engine import TransferEngine

    t = subprocess.Popen([sys.executable, "-c", TARGET, str(NBYTES)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        session, addr = t.stdout.readline().split()
        addr = int(addr)
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.full(NBYTES, 0xA1, np.uint8)
        assert e.register_memory(src.ctypes.data, src.nbytes) == 0
        zero = np.zeros(1, np.uint8)
        assert e.register_memory(zero.ctypes.data, 1) == 0
        assert e.transfer_sync_write(session, zero.ctypes.data, addr, 1) == 0  # the handshake, before the freeze
        os.kill(t.pid, signal.SIGSTOP)
        n = 16
        seg = NBYTES // n
        t0 = time.monotonic()
        rc = e.batch_transfer_sync_write(session, [src.ctypes.data + i * seg for i in range(n)],
                                         [addr + i * seg for i in range(n)], [seg] * n)
        stalled_s = time.monotonic() - t0
        src[:] = 0xC3
        time.sleep(hold_s)
        os.kill(t.pid, signal.SIGCONT)
        time.sleep(2.0)
        t.stdin.write("?\n")
        t.stdin.flush()
        values = [int(v) for v in t.stdout.readline().split()]
        print(json.dumps({"rc": rc, "stalled_s": round(stalled_s, 2), "hold_s": hold_s, "values": values}))
    finally:
        t.kill()
        t.wait(10)


INITIATOR = r'''
import sys, numpy as np
from mooncake.engine import TransferEngine
session, addr, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
e = TransferEngine(); assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = np.full(n, 0xA1, np.uint8); assert e.register_memory(src.ctypes.data, n) == 0
k = 256; seg = n // k
print(e.batch_transfer_sync_write(session, [src.ctypes.data + i * seg for i in range(k)],
                                  [addr + i * seg for i in range(k)], [seg] * k), flush=True)
'''
FENCE_BYTES = 256 << 20


def fence() -> None:
    os.environ.update(MC_FORCE_TCP="1", MC_LOG_LEVEL="ERROR")
    import numpy as np
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(FENCE_BYTES, np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    p = subprocess.Popen([sys.executable, "-c", INITIATOR, f"127.0.0.1:{e.get_rpc_port()}", str(buf.ctypes.data),
                          str(buf.nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not buf[::4096].any():
            assert time.monotonic() < deadline, "the write never started"
            time.sleep(0.001)
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(1.0)  # what is already in the socket buffers lands
        rc_unregister = e.unregister_memory(buf.ctypes.data)
        time.sleep(0.5)
        before = int(np.count_nonzero(buf))
        os.kill(p.pid, signal.SIGCONT)
        rc = int(p.stdout.readline())
        time.sleep(2.0)
        print(json.dumps({"unregister": rc_unregister, "before": before, "after": int(np.count_nonzero(buf)),
                          "total": buf.nbytes, "rc": rc}))
    finally:
        p.kill()
        p.wait(10)


if __name__ == "__main__":
    fence() if sys.argv[1] == "fence" else main(float(sys.argv[1]))
