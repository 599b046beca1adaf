"""Batched ``/v1/completions`` requests as one PD pair per prompt.

vLLM fans a request with several prompts out into one engine request per prompt,
but its HTTP answer carries the ``kv_transfer_params`` of the first prompt only
(``serving.py``, ``final_res_batch[0].kv_transfer_params``), so one prefill call
cannot hand a decode the KV of every prompt. The proxy sends each prompt as its
own request (``split``) and merges the answers as vLLM would have numbered them:
choice ``j`` of prompt ``i`` gets index ``i * n + j``, usage is summed, the
streamed answer ends with one usage chunk (``merge_answers``, ``StreamMerge``).
"""

from __future__ import annotations

import json


def is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def split(route: str, body: dict) -> list[dict] | None:
    """One body per prompt of a batched completion, in order; None when the request
    is not a batch of two or more (it goes as it is). A prompt that is one list of
    token ids is one prompt; a list of strings or of token-id lists is a batch, and
    so is a list of ``prompt_embeds``. Anything else goes as it is, for vLLM to judge."""
    if route != "/v1/completions":
        return None  # chat requests have one conversation each
    prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
    if embeds is None and isinstance(prompt, list) and not is_token_ids(prompt):
        if all(isinstance(p, str) for p in prompt) or all(is_token_ids(p) for p in prompt):
            key, items = "prompt", prompt
        else:
            return None
    elif prompt is None and isinstance(embeds, list):
        key, items = "prompt_embeds", embeds
    else:
        return None
    if len(items) < 2:
        return None
    return [{**body, key: item} for item in items]


def choices_per_prompt(body: dict) -> int:
    """vLLM's ``n`` (``None`` counts as 1): the stride of choice indexes per prompt."""
    n = body.get("n")
    return 1 if n is None else n


def _sum_usage(usages: list[dict | None]) -> dict | None:
    """Token counts summed over the prompts; vLLM reports the cached-token count of
    the last prompt (``last_final_res``), so ``prompt_tokens_details`` comes from it."""
    if not usages or any(u is None for u in usages):
        return None
    out = dict(usages[-1])
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        out[k] = sum(u.get(k) or 0 for u in usages)
    return out


def merge_answers(answers: list[dict], n: int) -> dict:
    """One completion answer from the per-prompt ones (in prompt order): the first's
    ``id`` and fields, every choice re-indexed ``prompt * n + index``, usage summed.
    ``metrics`` describe one generation, so vLLM drops them for several prompts."""
    out = dict(answers[0])
    out["choices"] = [{**c, "index": i * n + c["index"]}
                      for i, a in enumerate(answers) for c in sorted(a["choices"], key=lambda c: c["index"])]
    if "usage" in out:
        out["usage"] = _sum_usage([a.get("usage") for a in answers])
    if out.get("metrics") is not None:
        out["metrics"] = None
    return out


class StreamMerge:
    """Merges the SSE streams of a split batch into one stream.

    ``feed(i, chunk)`` takes raw bytes of prompt ``i``'s stream (any framing) and
    returns the events to send now: each ``data:`` event with its choices re-indexed
    and the batch's one ``id``. Each stream's final usage chunk (no choices) and its
    ``[DONE]`` are held back; ``tail()`` gives the one usage chunk, summed, and
    ``[DONE]``. An upstream error event is passed on and ``failed`` is set: the
    caller ends the stream (``tail()`` then gives only ``[DONE]``, as vLLM does)."""

    def __init__(self, prompts: int, n: int):
        self.n = n
        self.id: str | None = None
        self.failed = False
        self._buf = [b""] * prompts
        self._usage: list[dict | None] = [None] * prompts

    def feed(self, i: int, chunk: bytes) -> list[bytes]:
        *events, self._buf[i] = (self._buf[i] + chunk).split(b"\n\n")
        return [out for ev in events if (out := self._event(i, ev)) is not None]

    def _event(self, i: int, event: bytes) -> bytes | None:
        if not event.startswith(b"data: "):
            return None  # blank or an SSE comment
        data = event[len(b"data: "):]
        if data == b"[DONE]":
            return None
        obj = json.loads(data)
        if "error" in obj:
            self.failed = True
            return event + b"\n\n"
        if not obj.get("choices") and obj.get("usage") is not None:
            self._usage[i] = obj
            return None
        self.id = self.id or obj.get("id")
        obj["id"] = self.id
        obj["choices"] = [{**c, "index": i * self.n + c["index"]} for c in obj.get("choices", [])]
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def tail(self) -> list[bytes]:
        out = []
        usage = _sum_usage([u and u["usage"] for u in self._usage])
        if usage is not None and not self.failed:
            last = dict(self._usage[-1], usage=usage, id=self.id or self._usage[-1].get("id"))
            last.pop("metrics", None)  # one generation's metrics: vLLM drops them for several prompts
            out.append(b"data: " + json.dumps(last).encode() + b"\n\n")
        return out + [b"data: [DONE]\n\n"]
