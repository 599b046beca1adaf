"""OpenAI-compatible prefill/decode proxy for DCP2DConnector, over many instances.

``vllm-dcp2d proxy --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]``

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes twice upstream:

1. to a prefill instance, as a copy with ``max_tokens=1``, no streaming, one
   sequence, every field that would conflict with a one-token prefill set or
   dropped (``hops.PREFILL_HOP``; docs/connector.md "The prefill hop") and
   ``kv_transfer_params={"do_remote_decode": true, "transfer_id": <new key>}``;
   the prefill's DCP2DConnector keeps the request's KV blocks and answers
   with the ``kv_transfer_params`` a decode instance needs to fetch them;
2. to a decode instance, unchanged except for those ``kv_transfer_params``;
   its answer (streamed or not) goes back to the client as is.

**Batches.** A ``/v1/completions`` request with several prompts (strings,
token-id lists or ``prompt_embeds``) goes as one such pair per prompt,
``--batch-concurrency`` pairs at a time (``batch``, ``streams``): vLLM's
answer carries the KV params of one prompt only. The answers are merged as vLLM
numbers them (choice ``j`` of prompt ``i`` is ``i * n + j``, usage summed; a
streamed batch starts once every prompt's decode has, and ends with one usage
chunk). Any pair's error is the answer (no partial one) and cancels the others,
as does the client going away.

**Routing** (``routing``). A decode call goes to the decodes of the smallest DCP
size that fit the request with room (``fit``: what each decode says on its
``/metrics``), or back to the decode that served the prompt's prefix or the
client's session (``affinity``); a request no decode admits gets 400. Among
equals, and for prefill calls, the instance with the fewest calls in flight
from this proxy (prefill calls while they run, decode calls until their stream
ends); ties go round-robin (``upstreams.Pool``). ``--routing least-loaded``
keeps only that last rule.

**Health.** A background task polls every instance's ``/health`` every
``--health-interval`` seconds (default 2; 0 turns checks off), each poll bounded
by ``--health-timeout`` (default 5). A failed poll, or a call that could not
reach the instance, takes it out of rotation; the next successful poll puts it
back. A call never goes to an instance out of rotation; with none of a kind in
rotation the proxy polls that kind once more (concurrent requests share the
poll), then the client gets 503 naming the kind.

**Retries.** A decode call that fails before any byte went to the client
(connection refused, reset or closed, or a 5xx answer) is sent to another decode
instance in rotation, with the same ``kv_transfer_params``. Streamed answers
start to the client with the decode's first body byte (its first token), not its
headers, so a decode that dies during its KV fetch is retried too. Once a byte
went to the client nothing is retried: the stream ends with an SSE error event.
A timeout is not retried. The prefill's KV is still there for the second decode:
the prefill frees a request's blocks only when every rank of *one* decode engine
got its pages (or ``send_timeout_s`` passed), so a decode that died before its
fetch completed leaves them to the next one, which fetches by the same transfer
key (docs/connector.md, "Request flow"). If the dead decode had fetched it all,
the second one's fetch fails ("finished or expired") and its
``kv_load_failure_policy`` applies: ``recompute`` answers correctly after a
local prefill, ``fail`` gives the client an error. A prefill call is retried on
another prefill instance only if it never connected (nothing was computed).

``--pipelined``: both calls go out at once once the proxy knows the prefill
instance's bootstrap address and engine id (learnt from its first answer): the
decode request carries ``"remote_request_id"`` = its ``"transfer_id"``, its ranks ask the
prefill ranks right away, and each prefill rank writes every layer to them as
soon as the layer is computed (layer pipelining). A retried decode asks with the
same key; its attempts wait at the prefill ranks until the prompt is done (up
to ``prefill_wait_s``). If the prefill call fails, the decode call is cancelled
(vLLM aborts the request) and the client gets the prefill's error; pipelined
prefill calls are not retried.

Upstream failures become HTTP errors: an upstream 4xx is passed through with
its body (the client's request is wrong), an unreachable or failing upstream
gives 502, an upstream that does not answer in ``--timeout`` seconds 504, no
instance of a kind in rotation 503. ``GET /metrics`` serves the proxy's
Prometheus metrics (``metrics.METRICS``; docs/metrics.md, "Proxy"), ``GET
/health`` the proxy's own liveness plus each upstream's state.

Modules: ``app`` (HTTP handlers, retries), ``errors`` (upstream failures as the
client's answers), ``hops`` (each hop's body),
``batch`` (split and merge), ``streams`` (where streamed bytes go),
``routing`` (which instance), ``fit`` (what a decode holds, what a request
needs), ``affinity`` (prefix and session memory), ``upstreams`` (balancer,
health), ``metrics``, ``cli``.
"""

from .app import ROUTES, Proxy, UpstreamError
from .hops import PREFILL_HOP, decode_body, prefill_body
from .cli import main, parse_args

__all__ = ["PREFILL_HOP", "ROUTES", "Proxy", "UpstreamError", "decode_body", "prefill_body", "main", "parse_args"]
