"""The bodies of a PD pair's two hops, built from the client's request.

The decode hop is the client's request untouched but for ``kv_transfer_params``:
it answers the client. The prefill hop only has to leave the prompt's KV on the
prefill instance; its answer (one token) is thrown away. ``PREFILL_HOP`` lists
every field that hop changes, one rule each with its reason; every other field
(``model`` and its LoRA adapter, the prompt or messages and what renders them,
sampling and penalty fields, ``seed``, ``logit_bias``, stop conditions,
``logprobs``) goes as the client sent it, so the prefill renders the same prompt
under the same adapter (the KV depends on both) and refuses bad input the way the
colocated instance would. The fields' table, with vLLM 0.32's rule behind each row,
is docs/connector.md "The prefill hop".
"""

from __future__ import annotations

from typing import NamedTuple


class Drop:
    """The field is removed from the prefill hop."""

    def __repr__(self) -> str:
        return "DROP"


DROP = Drop()


class Rule(NamedTuple):
    field: str
    value: object        # what the prefill hop gets, or DROP
    if_present: bool     # apply only when the client sent the field
    why: str


# Structured-output fields: the prompt's KV does not depend on a grammar, and a
# grammar on the prefill hop costs its compilation (the request waits for it) and
# could refuse there first. The guided_* fields are vLLM's removed spellings.
_GRAMMAR = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
            "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern")

PREFILL_HOP: tuple[Rule, ...] = (
    Rule("max_tokens", 1, False, "one token: the prefill computes the prompt's KV, the decode generates"),
    Rule("max_completion_tokens", 1, True, "chat's max_tokens; vLLM takes it over max_tokens when set"),
    Rule("min_tokens", 0, True, "vLLM refuses min_tokens > max_tokens, and max_tokens is 1 here"),
    Rule("n", 1, True, "one sequence, one KV: the decode's n siblings share the prompt's KV"),
    Rule("best_of", DROP, False, "vLLM (where it still exists) refuses best_of < n; n is 1 here"),
    Rule("use_beam_search", False, True, "beam search runs its own requests, which carry no kv_transfer_params"),
    Rule("stream", False, False, "the proxy reads kv_transfer_params from one JSON answer"),
    Rule("stream_options", DROP, False, "vLLM refuses stream_options without stream"),
    Rule("echo", DROP, False, "answer-only; with logprobs it turns on prompt logprobs (a pass over the prompt's "
                              "logits and no prefix-cache reads); the decode answers the echo"),
    Rule("prompt_logprobs", DROP, False, "answer-only, and costs the prefill as echo does; the decode answers them"),
    Rule("return_token_ids", True, False, "the proxy routes by the prompt's token ids (proxy/routing.py: prefix "
                                          "affinity); the answer is thrown away. Not set when the proxy has them: "
                                          "a token-id prompt, or routing off"),
    *(Rule(f, DROP, False, "the KV does not depend on a grammar; compiling one delays the prefill")
      for f in _GRAMMAR),
)


def prefill_body(body: dict, transfer_key: str, want_ids: bool = True) -> dict:
    """The prefill hop of a client request: ``PREFILL_HOP`` applied (``return_token_ids``
    only if ``want_ids``), and the ``kv_transfer_params`` that make the prefill keep the KV
    under ``transfer_key``.

    Shallow: only top-level keys are replaced, so the client's values (an 8K-token
    prompt list, messages) are shared, not copied (a deep copy of 8K token ids took
    ~2 ms, on the request's critical path twice)."""
    out = dict(body)
    for rule in PREFILL_HOP:
        if (rule.if_present and rule.field not in out) or (rule.field == "return_token_ids" and not want_ids):
            continue
        if rule.value is DROP:
            out.pop(rule.field, None)
        else:
            out[rule.field] = rule.value
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "transfer_id": transfer_key}
    return out


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The decode hop: the client's request with the prefill's params (shallow)."""
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    return out
