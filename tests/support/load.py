"""Streaming load through the PD proxy with the OpenAI Python client, and the
checks a load-and-fault run must pass (tests/e2e/test_load_faults.py, bench/load_faults.py).

``Load`` runs ``n`` streamed completions at a given concurrency from client
threads; each ends as one ``Outcome``. Every request has a known greedy answer
(``refs``, from a colocated instance), so each outcome is judged exactly:

* ``ok``: the stream finished (``finish_reason == "length"``) with the reference text;
* ``error``: the client got an HTTP error status, or an SSE error event with a
  code and a message, and what it had streamed so far is a prefix of the reference;
* ``disconnected``: the client hung up on purpose mid-stream (prefix checked too);
* ``wrong``: anything else: other text, a stream that ended without finishing and
  without an error, or a connection dropped without an HTTP error (``unclear``).

``check`` turns the outcomes into a list of violations (empty: passed).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

__all__ = ["Outcome", "Load", "check", "latency_summary", "prompt_ids"]


def prompt_ids(i: int, base: int = 40, spread: int = 23, vocab: int = 500) -> list[int]:
    """Prompt ``i`` of a set as token ids: ``base + 37 * (i % spread)`` tokens (1.25 to
    ~28 pages of 32), each set member different, so the decode's prefix cache rarely hits."""
    n = base + 37 * (i % spread)
    return [(i * 131 + k * 13) % vocab + 6 for k in range(n)]


@dataclass
class Outcome:
    """One request: ``prompt`` indexes the prompt set; ``t0``/``t1`` monotonic seconds;
    ``status``: the HTTP status (or the SSE error event's code); ``message``: the error's."""

    prompt: int
    t0: float
    t1: float
    kind: str
    text: str = ""
    status: int | None = None
    message: str = ""

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def _stream_one(client, model: str, ids: list[int], ref: str, max_tokens: int, hang_up_after: int | None,
                idx: int) -> Outcome:
    import openai

    t0, text, finish = time.monotonic(), "", None

    def out(kind: str, status: int | None = None, message: str = "") -> Outcome:
        if kind in ("error", "disconnected") and not ref.startswith(text):
            kind, message = "wrong", f"partial text {text!r} is not a prefix of the reference ({kind}: {message})"
        return Outcome(idx, t0, time.monotonic(), kind, text, status, message)

    try:
        stream = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        for n, chunk in enumerate(stream, 1):
            if chunk.choices:
                text += chunk.choices[0].text or ""
                finish = chunk.choices[0].finish_reason or finish
            if hang_up_after is not None and n >= hang_up_after:
                stream.close()  # drops the TCP connection to the proxy mid-stream
                return out("disconnected")
    except openai.APIStatusError as e:  # an HTTP error status before the stream began
        return out("error", e.status_code, str(e.message))
    except openai.APIConnectionError as e:  # no HTTP answer at all: not a clear error
        return out("wrong", None, f"unclear: connection failed without an HTTP error: {e!r}")
    except openai.APIError as e:  # an SSE error event in a 200 stream (proxy or vLLM)
        body = e.body if isinstance(e.body, dict) else {}
        code = body.get("code")
        return out("error", int(code) if isinstance(code, int) or str(code).isdigit() else None, str(e.message))
    if finish == "length" and text == ref:
        return out("ok")
    return out("wrong", 200, f"stream ended with finish_reason={finish!r} and text {text!r}, "
                             f"expected {ref!r}")


class Load:
    """``n`` streamed requests through ``url`` (the proxy) from ``concurrency`` client
    threads; request ``j`` uses prompt ``j % len(prompts)`` and, when
    ``hang_up_every`` is set, every ``hang_up_every``-th one hangs up after 2 chunks.
    ``timeout_s``: the client's own limit per request (set it above the bound the
    run checks, so an overrun is measured, not cut short). After an error a client
    waits ``backoff_s`` (a dead upstream fails fast; no busy loop)."""

    def __init__(self, url: str, model: str, prompts: list[list[int]], refs: list[str], n: int, *,
                 concurrency: int = 6, max_tokens: int = 16, hang_up_every: int | None = None,
                 timeout_s: float = 120.0, backoff_s: float = 0.5):
        if concurrency < 1 or n < 1 or len(prompts) != len(refs) or not prompts:
            raise ValueError(f"need n >= 1, concurrency >= 1 and one reference per prompt, got n={n}, "
                             f"concurrency={concurrency}, {len(prompts)} prompts, {len(refs)} refs")
        self.url, self.model, self.prompts, self.refs, self.n = url, model, prompts, refs, n
        self.concurrency, self.max_tokens, self.hang_up_every = concurrency, max_tokens, hang_up_every
        self.timeout_s, self.backoff_s = timeout_s, backoff_s
        self.outcomes: list[Outcome] = []
        self._next = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.t0 = self.t1 = 0.0

    def start(self) -> Load:
        self.t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def done_count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def join(self, timeout_s: float) -> list[Outcome]:
        """Wait for every request; raises ``TimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise TimeoutError(f"load on {self.url}: {self.done_count()} of {self.n} requests done "
                                   f"after {timeout_s:.0f} s")
        self.t1 = time.monotonic()
        return sorted(self.outcomes, key=lambda o: o.t0)

    def _client(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=self.timeout_s)
        try:
            while True:
                with self._lock:
                    j, self._next = self._next, self._next + 1
                if j >= self.n:
                    return
                i = j % len(self.prompts)
                hang = 2 if self.hang_up_every and j % self.hang_up_every == self.hang_up_every - 1 else None
                o = _stream_one(client, self.model, self.prompts[i], self.refs[i], self.max_tokens, hang, i)
                with self._lock:
                    self.outcomes.append(o)
                if o.kind == "error":
                    time.sleep(self.backoff_s)
        finally:
            client.close()


def check(outcomes: list[Outcome], bound_s: float) -> list[str]:
    """Violations of the pass criteria: a wrong answer (or an unclear failure), an
    error without a status or message, a request that took longer than ``bound_s``."""
    bad = []
    for o in outcomes:
        if o.kind == "wrong":
            bad.append(f"prompt {o.prompt}: wrong: {o.message}")
        elif o.kind == "error" and (not o.status or not o.message):
            bad.append(f"prompt {o.prompt}: error without a clear status and message: {o.status} {o.message!r}")
        if o.seconds > bound_s:
            bad.append(f"prompt {o.prompt}: took {o.seconds:.1f} s, past the configured bound of {bound_s:.1f} s "
                       f"({o.kind} {o.status} {o.message[:200]!r})")
    return bad


def latency_summary(outcomes: list[Outcome]) -> dict:
    """p50 / p99 / max seconds of the completed (``ok``) requests; zeros if none."""
    s = sorted(o.seconds for o in outcomes if o.kind == "ok")
    if not s:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"p50": statistics.median(s), "p99": p99, "max": s[-1]}
