"""Helper of ``test_stalled_write.py``: does a Mooncake write that returned -1 after
a stall still land? Run as ``python _late_write.py HOLD_S`` (no vLLM, loopback).

A target process registers a zeroed buffer; this process warms the session, freezes
the target (SIGSTOP), writes ``NBYTES`` of 0xA1 until the engine gives the write up
(-1 after ``MC_TCP_PROGRESS_TIMEOUT_SEC``), fills its source with 0xC3, waits
``HOLD_S`` more, resumes the target and asks it which byte values its buffer holds.
The target was frozen for the whole attempt, so any non-zero byte arrived after
the -1; 0xC3 bytes were even read from the source after it. Prints one JSON line.
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


if __name__ == "__main__":
    main(float(sys.argv[1]))
