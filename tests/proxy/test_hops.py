"""The proxy's two hops against vLLM's own request validation (no engine): for any
request the colocated instance takes, the prefill hop passes vLLM's protocol
models and ``SamplingParams`` checks as one token of one sequence, every field
``PREFILL_HOP`` does not name goes untouched, and the decode hop is the client's
request plus the prefill's ``kv_transfer_params``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_dcp2d.proxy import PREFILL_HOP, decode_body, prefill_body
from vllm_dcp2d.proxy.hops import DROP

pytest.importorskip("vllm")
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

PARAMS = {"do_remote_prefill": True, "transfer_id": "k", "remote_bootstrap_addr": "127.0.0.1:1"}
CHANGED = {r.field for r in PREFILL_HOP}
MAX_MODEL_LEN = 4096


def sampling_params(path: str, body: dict):
    """What vLLM's server builds from ``body`` (``serving.py``: the pydantic model, then
    ``to_sampling_params`` with ``get_max_tokens``'s value for a short prompt, or the
    beam-search params); raises vLLM's own error where it would refuse."""
    cls = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    req = cls.model_validate(body)
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    max_tokens = min(MAX_MODEL_LEN - 8, asked if asked is not None else MAX_MODEL_LEN)
    if req.use_beam_search:
        return req.to_beam_search_params(max_tokens, {})
    return req.to_sampling_params(max_tokens, {})


texts = st.text(alphabet="abcxyz .", min_size=1, max_size=4)
token_ids = st.lists(st.integers(0, 500), max_size=4)


@st.composite
def client_requests(draw):
    """(path, body): a request vLLM 0.32 takes colocated, over every field the table
    names and the sampling fields it leaves alone."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    chat = path != "/v1/completions"
    body: dict = {"model": draw(st.sampled_from(["base", "lora-a"]))}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(texts)}]
    else:
        body["prompt"] = draw(st.one_of(texts, token_ids.filter(bool)))
    max_tokens = draw(st.integers(1, 64))
    body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = max_tokens
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, max_tokens))
    n = draw(st.integers(1, 4))
    if n > 1 or draw(st.booleans()):
        body["n"] = n
    # greedy sampling refuses n > 1
    body["temperature"] = draw(st.floats(0.1, 2.0)) if n > 1 else draw(st.sampled_from([0.0, 0.7, 1.3]))
    if draw(st.booleans()):
        body["best_of"] = draw(st.integers(n, n + 2))
    stream = draw(st.booleans())
    body["stream"] = stream
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans()),
                                  "continuous_usage_stats": draw(st.booleans())}
    if chat:
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 5))
    elif draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    body["echo"] = draw(st.booleans())
    if not stream and draw(st.booleans()):  # vLLM refuses prompt_logprobs on a stream
        body["prompt_logprobs"] = draw(st.integers(0, 5))
    optional = {
        "ignore_eos": st.booleans(), "stop": st.one_of(texts, st.lists(texts, max_size=3)),
        "stop_token_ids": token_ids, "include_stop_str_in_output": st.booleans(),
        "min_p": st.floats(0.0, 1.0), "top_p": st.floats(0.05, 1.0), "top_k": st.integers(-1, 50),
        "seed": st.integers(-(2 ** 31), 2 ** 31), "bad_words": st.lists(texts, max_size=2),
        "logit_bias": st.dictionaries(st.integers(0, 500).map(str), st.floats(-100, 100), max_size=3),
        "allowed_token_ids": token_ids.filter(bool), "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0), "repetition_penalty": st.floats(0.1, 2.0),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        body[name] = draw(optional[name])
    grammar = draw(st.sampled_from([None, ("structured_outputs", {"regex": "[a-z]+"}),
                                    ("response_format", {"type": "json_object"}),
                                    ("guided_regex", "[0-9]+")]))
    if grammar is not None:
        body[grammar[0]] = grammar[1]
    # beam search: not streamed, not with echo + logprobs (vLLM refuses both)
    if not stream and not (body["echo"] and "logprobs" in body) and draw(st.booleans()):
        body["use_beam_search"] = True
    return path, body


@given(client_requests())
def test_prefill_hop_passes_vllm_validation(case):
    path, client = case
    sampling_params(path, client)  # the drawn request is one the colocated instance takes
    hop = prefill_body(client, "k")
    sp = sampling_params(path, hop)
    assert (sp.max_tokens, sp.n, sp.min_tokens, sp.structured_outputs, sp.prompt_logprobs) == (1, 1, 0, None, None)
    assert sp.extra_args == {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                    "transfer_id": "k"}}
    # every field the table does not name goes as the client sent it
    assert {k: v for k, v in hop.items() if k not in CHANGED and k != "kv_transfer_params"} == \
           {k: v for k, v in client.items() if k not in CHANGED}
    assert decode_body(client, PARAMS) == {**client, "kv_transfer_params": PARAMS}
    assert "kv_transfer_params" not in client  # the client's body is not changed


def test_min_tokens_above_one():
    """The issue's case: min_tokens=4 made the prefill hop refuse (max_tokens=1)."""
    client = {"model": "m", "prompt": "hi", "max_tokens": 8, "min_tokens": 4}
    with pytest.raises(VLLMValidationError, match="min_tokens must be less than or equal to max_tokens=1"):
        sampling_params("/v1/completions", {**client, "max_tokens": 1})
    assert prefill_body(client, "k")["min_tokens"] == 0
    assert sampling_params("/v1/completions", prefill_body(client, "k")).max_tokens == 1


def test_table_in_docs():
    """docs/connector.md "The prefill hop" has one row per rule, with its value."""
    text = (Path(__file__).parents[2] / "docs" / "connector.md").read_text()
    section = text.split("## The prefill hop", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+)\|", section, re.M)}
    for rule in PREFILL_HOP:
        want = "dropped" if rule.value is DROP else f"`{json.dumps(rule.value)}`"
        assert rows.get(rule.field, "").startswith(want), (rule.field, rows.get(rule.field))
