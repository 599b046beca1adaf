"""The benches' load and observation (``local/workload.py``) against real HTTP servers and real
processes: a streamed completion timed and judged (finished, an SSE error, a short stream, a hang-up,
an HTTP error, no answer), ``/metrics`` read and histograms differenced, a session's processes
counted, agent prompts growing by a prefix."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_dcp2d.local.workload import Sampler, hist_delta, scrape, session_prompt, session_stats, stream

METRICS = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"} 4.0
vllm:request_queue_time_seconds_bucket{engine="0",le="1.0"} 9.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf"} 10.0
vllm:request_queue_time_seconds_count{engine="0"} 10.0
vllm:request_queue_time_seconds_sum{engine="0"} 6.5
"""


class Server:
    """A real HTTP server on loopback answering ``/v1/completions`` by ``mode`` and ``/metrics``."""

    def __init__(self, mode: str):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = METRICS.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.seen.append(req)
                if outer.mode == "503":
                    self.send_response(503)
                    body = b'{"error": "no decode"}'
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if outer.mode == "silent":
                    self.connection.close()  # no status line at all
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                events = [{"choices": [{"text": t}]} for t in ("a", "b", "c")]
                if outer.mode == "sse_error":
                    events[1] = {"error": {"message": "fetch failed", "code": 502}}
                n = 2 if outer.mode == "short" else 3
                events.append({"choices": [], "usage": {"completion_tokens": n}})
                for e in events:
                    self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.02)
                self.wfile.write(b"data: [DONE]\n\n")

        self.mode, self.seen = mode, []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("mode, ok, error, hung_up", [
    ("ok", True, "", False),
    ("sse_error", False, "fetch failed", False),
    ("short", False, "2 completion tokens, expected 3", False),
    ("hang_up", False, "", True),
    ("503", False, "no decode", False),
    ("silent", False, "RemoteDisconnected", False),
])
def test_stream_times_and_judges_each_ending(mode, ok, error, hung_up):
    srv = Server(mode)
    try:
        s = stream(srv.url, "m", [7, 8, 9], 3, timeout_s=10, hang_up_after=1 if mode == "hang_up" else None)
    finally:
        srv.close()
    assert srv.seen[0]["prompt"] == [7, 8, 9] and srv.seen[0]["stream"] is True
    assert srv.seen[0]["stream_options"] == {"include_usage": True} and srv.seen[0]["temperature"] == 0.0
    assert (s.ok, s.hung_up) == (ok, hung_up)
    assert error in s.error if error else s.error == ""
    assert s.status == {"503": 503, "silent": 0}.get(mode, 200)
    if ok:
        assert s.text == "abc" and s.tokens == 3
        assert s.t0 < s.t_first < s.t_end
        assert s.tpot == pytest.approx((s.t_end - s.t_first) / 2) and s.tpot >= 0.02  # the server's gap


def test_scrape_and_hist_delta():
    srv = Server("ok")
    try:
        got = scrape(srv.url)
        with Sampler({"x": (srv.url, None)}, ("vllm:num_requests_running",), 0.05) as s:
            time.sleep(0.3)
    finally:
        srv.close()
    assert got["vllm:num_requests_running"] == 5.0  # summed over the two engines
    assert got["vllm:request_queue_time_seconds_bucket{le=+Inf}"] == 10.0
    before = {"vllm:request_queue_time_seconds_count": 2.0, "vllm:request_queue_time_seconds_sum": 0.5,
              **{f"vllm:request_queue_time_seconds_bucket{{le={le}}}": 2.0 for le in ("0.3", "1.0", "+Inf")}}
    # 8 new observations, sum 6.0: mean 0.75; of them 2 within 0.3 s, 7 within 1 s, 8 in all
    assert hist_delta(before, got, "vllm:request_queue_time_seconds", 50) == (0.75, 1.0)
    assert hist_delta(before, got, "vllm:request_queue_time_seconds", 99) == (0.75, float("inf"))
    assert all(math.isnan(v) for v in hist_delta(got, got, "vllm:request_queue_time_seconds", 99))  # none new
    assert len(s.series("x", "vllm:num_requests_running")) >= 2 and s.peak("x", "vllm:num_requests_running") == 5.0


def test_session_stats_counts_a_sessions_processes():
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        for _ in range(50):  # until the exec has happened
            st = session_stats(p.pid)
            if st["processes"] == 1 and st["rss_bytes"] > 0:
                break
            time.sleep(0.05)
        assert st["processes"] == 1 and st["threads"] == 1 and st["fds"] >= 3 and st["rss_bytes"] > 0
        assert st["rss_bytes/sleep"] == st["rss_bytes"]  # per process name
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    assert session_stats(p.pid)["processes"] == 0


@given(session=st.integers(0, 10**6), base=st.integers(1, 3000), step=st.integers(1, 500), turn=st.integers(0, 8))
def test_each_turn_is_the_previous_prompt_and_step_more(session, base, step, turn):
    a, b = session_prompt(session, turn, base, step), session_prompt(session, turn + 1, base, step)
    assert len(a) == base + step * turn and b[: len(a)] == a and len(b) == len(a) + step
    if len(a) >= 16:  # another session shares no page with it (a 1-token prompt may repeat: 500 ids)
        assert session_prompt(session + 1, turn, base, step)[:16] != a[:16]
