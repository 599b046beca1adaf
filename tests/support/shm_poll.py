"""Child of vllm_compat/test_connector_api.test_shm_polls_sleep: one vLLM MessageQueue per
case, reader in a thread; prints, per case, how often the reader polled and its CPU
and wall seconds while it waited 0.6 s idle for the second message. The cases:
vLLM's own spin first, then with ``cpu_poll_sleep_us`` = argv[1] installed (one
interpreter: the nap is installed after the spin was measured)."""

import json
import sys
import threading
import time

from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from vllm_dcp2d.vllm_compat import connector_api as compat


def measure(installed: bool) -> dict:
    writer = MessageQueue(1, 1)
    handle = writer.export_handle()
    out = {"installed": installed}
    polls = [0]
    poll = shm_broadcast.sched_yield  # vLLM's, or the nap installed before

    def counted() -> None:
        polls[0] += 1
        poll()

    shm_broadcast.sched_yield = counted

    def reader():
        r = MessageQueue.create_from_handle(handle, 0)
        r.wait_until_ready()
        out["first"] = r.dequeue(timeout=30)
        polls[0] = 0
        t0, w0 = time.thread_time(), time.monotonic()
        out["second"] = r.dequeue(timeout=30)
        out["cpu_s"], out["wall_s"], out["polls"] = time.thread_time() - t0, time.monotonic() - w0, polls[0]

    t = threading.Thread(target=reader)
    t.start()
    writer.wait_until_ready()
    writer.enqueue("first")
    time.sleep(0.6)  # within the reader's 1 s busy window: vLLM spins here
    writer.enqueue({"second": [2]})
    t.join(60)
    shm_broadcast.sched_yield = poll
    return out


spin = measure(False)
nap = measure(compat.sleep_between_shm_polls(int(sys.argv[1])))
print(json.dumps([spin, nap]))
