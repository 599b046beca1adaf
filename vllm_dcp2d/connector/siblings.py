"""Decode requests that carry one transfer key: which one fetches, and who the others wait for.

vLLM fans one HTTP request out into several engine requests (``n > 1``, a batch of
prompts), and each carries the HTTP request's ``kv_transfer_params``: one transfer
key, the KV of one prompt. Only the first of them to be admitted fetches it; a sibling
never fetches a key again (the prefill frees a request once it is fetched). A sibling
with the same prompt waits while the fetch is in flight, then prefills locally, where
vLLM's prefix cache hands it the fetched pages; a sibling with another prompt (a batch
whose front sent one answer's params to all) prefills locally at once.

Runs in the scheduler (``scheduler.SchedulerSide``), so no locks: every call comes from
the engine-core thread. vLLM asks about a waiting request every step it waits
(``get_num_new_matched_tokens``), so its prompt's digest is computed once and kept
until it is admitted or finished.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from vllm_dcp2d.connector.metadata import TransferKeys, key_of
from vllm_dcp2d.transfer.messages import prompt_digest
from vllm_dcp2d.vllm_compat import connector_api as compat

__all__ = ["Siblings"]

MAX_ENDED = 4096  # keys remembered after their fetch ended (a sibling may arrive late)
ENDED_TTL_S = 600.0  # ... for this long: siblings arrive within one request's lifetime
MAX_DIGESTS = 65536  # prompt digests of requests not admitted yet (a backstop: the oldest is computed again)


class Siblings:
    """Transfer keys being fetched on this decode instance, and keys whose fetch ended."""

    def __init__(self, max_ended: int = MAX_ENDED, ttl_s: float = ENDED_TTL_S, clock=time.monotonic):
        self.fetching = TransferKeys()  # request <-> the key it fetches now
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (request, when it ended)
        self._max_ended, self._ttl_s, self._clock = max_ended, ttl_s, clock
        self._digests: dict[str, str] = {}  # request not admitted yet -> its prompt's digest

    def verdict(self, request, params: dict, digest: bool = True) -> bool | None:
        """None: ``request`` (with its ``kv_transfer_params``) may fetch its key. True: a
        sibling with its prompt fetches it now (wait, then reuse its pages through the
        prefix cache). False: prefill locally (the key's fetch ended, or, with ``digest``,
        its KV is another prompt's)."""
        key = key_of(params)
        remote = params.get("remote_prompt_digest")
        if digest and isinstance(remote, str) and remote and remote != self.prompt_digest(request):
            return False  # a batch answered with one prompt's params: the KV is another prompt's
        if not isinstance(key, str):
            return None
        holder = self.fetcher(key)
        if holder is not None and holder != request.request_id:
            return True
        ended = self.ended(key)
        return False if ended is not None and ended != request.request_id else None

    def prompt_digest(self, request) -> str:
        """``messages.prompt_digest`` of ``request``'s prompt, computed once until ``admitted``."""
        digest = self._digests.get(request.request_id)
        if digest is None:
            if len(self._digests) >= MAX_DIGESTS:
                del self._digests[next(iter(self._digests))]
            digest = self._digests[request.request_id] = prompt_digest(**compat.prompt_inputs(request))
        return digest

    def admitted(self, req_id: str) -> None:
        """``req_id`` was admitted (or finished): vLLM asks no more about it."""
        self._digests.pop(req_id, None)

    def fetcher(self, key: str) -> str | None:
        """The request fetching ``key`` now, if any."""
        return self.fetching.owner(key)

    def ended(self, key: str) -> str | None:
        """The request whose fetch of ``key`` ended within ``ttl_s``, if any."""
        self._expire()
        hit = self._ended.get(key)
        return None if hit is None else hit[0]

    def start(self, key: str, req_id: str) -> None:
        """``req_id`` fetches ``key`` (the caller checked that nobody else does)."""
        self.fetching.bind(req_id, key)

    def end(self, req_id: str) -> None:
        """``req_id``'s fetch ended (ok, failed, or the request finished); no-op if it had none."""
        owned = self.fetching.owner(self.fetching.key(req_id, ""))
        key = self.fetching.unbind(req_id)
        if key is None or owned != req_id:
            return
        self._ended[key] = (req_id, self._clock())
        self._ended.move_to_end(key)
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    def _expire(self) -> None:
        now = self._clock()
        while self._ended:
            key, (_, t) = next(iter(self._ended.items()))
            if now - t <= self._ttl_s:
                return
            del self._ended[key]

    def __len__(self) -> int:
        return len(self.fetching) + len(self._ended)
