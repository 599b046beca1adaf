"""``messages.prompt_digest``: equal digests exactly when what scopes the KV is equal.

Issue "trust boundary, round 3", item 5: the digest left out the LoRA adapter and
``cache_salt`` (adapter A with salt 1 and adapter B with salt 2 hashed alike), and was ""
for prompt embeds, which "" matched: the transfer key alone opened such a request.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dcp2d.transfer.messages import prompt_digest

_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids_ = st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=64)
text = st.text(max_size=12)
mm_item = st.tuples(st.sampled_from(["image", "audio", "video"]), text, st.integers(0, 1 << 20), st.integers(1, 4096))


@st.composite
def embeds_(draw):
    """``(dtype name, shape, bytes)`` of a prompt-embeds tensor, its bytes drawn to fit."""
    dtype = draw(st.sampled_from([("float32", 4), ("bfloat16", 2), ("float16", 2)]))
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 8)))
    data = draw(st.binary(min_size=shape[0] * shape[1] * dtype[1], max_size=shape[0] * shape[1] * dtype[1]))
    return dtype[0], shape, data


@st.composite
def prompts(draw):
    """Keyword arguments of one prompt: token ids and/or embeds, and every scoping input."""
    kind = draw(st.sampled_from(["ids", "embeds", "mixed"]))
    embeds = draw(embeds_()) if kind != "ids" else None
    ids = draw(ids_) if kind != "embeds" else None
    mask = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))) if kind == "mixed" else None
    return {"token_ids": ids, "mm": draw(st.lists(mm_item, max_size=3)), "embeds": embeds, "is_token_ids": mask,
            "lora": draw(text), "cache_salt": draw(st.none() | text)}


def _other(draw, kw: dict, name: str):
    """``kw[name]`` changed (drawn until it differs)."""
    old = kw[name]
    if name == "token_ids":
        return draw(ids_.filter(lambda v: v != old)) if old is not None else None
    if name == "is_token_ids":
        return None if old is None else [not old[0], *old[1:]]
    if name == "embeds":
        if old is None:
            return None
        dtype, shape, data = old
        which = draw(st.sampled_from(["dtype", "shape", "data"]))
        if which == "dtype":
            return {"float32": "int32", "bfloat16": "float16", "float16": "bfloat16"}[dtype], shape, data
        if which == "shape":
            return dtype, (shape[1], shape[0]) if shape[0] != shape[1] else (1, shape[0] * shape[1]), data
        return dtype, shape, draw(st.binary(min_size=len(data), max_size=len(data)).filter(lambda b: b != data))
    if name == "mm":
        return draw(st.lists(mm_item, max_size=3).filter(lambda v: v != old))
    if name == "lora":
        return draw(text.filter(lambda v: v != old))
    return draw((st.none() | text).filter(lambda v: v != old))


@_SETTINGS
@given(st.data(), prompts(), st.sampled_from(["token_ids", "is_token_ids", "embeds", "mm", "lora", "cache_salt"]))
def test_any_changed_input_changes_the_digest(data, kw, name):
    """Equal prompts but one input (adapter, salt, embeds' dtype, shape or bytes, a
    multimodal item, a token id, a mixed prompt's mask): another digest; the same one
    given again: the same digest, never ""."""
    changed = _other(data.draw, kw, name)
    if changed is None or changed == kw[name]:
        return  # the input is absent from this prompt (its kind has none)
    digest = prompt_digest(**kw)
    assert digest == prompt_digest(**kw) and len(digest) == 32
    assert prompt_digest(**{**kw, name: changed}) != digest, name


@_SETTINGS
@given(text, text, text, text)
def test_fields_do_not_run_into_each_other(a, b, c, d):
    """Each input is length-prefixed: moving characters from one field into the next
    ("ab" + "c" against "a" + "bc") changes the digest."""
    if (a, b) == (c, d):
        return
    ids = [1, 2, 3]
    assert prompt_digest(ids, lora=a, cache_salt=b) != prompt_digest(ids, lora=c, cache_salt=d)
    assert (prompt_digest(ids, [("image", a, 0, 1), ("image", b, 1, 1)])
            != prompt_digest(ids, [("image", c, 0, 1), ("image", d, 1, 1)]))
    assert prompt_digest(ids, [("image" + a, b, 0, 1)]) != prompt_digest(ids, [("image" + c, d, 0, 1)])


def test_the_reviewers_cases():
    """Adapter A / salt 1 against adapter B / salt 2 (and the swap of the two); embeds of
    equal length but other values, dtype or shape; token ids against embeds holding the
    same bytes; no salt against an empty one."""
    ids = list(range(100))
    digests = {prompt_digest(ids, lora=lo, cache_salt=s) for lo in ("A", "B", "") for s in ("1", "2", None)}
    assert len(digests) == 9
    e = np.arange(12, dtype=np.float32).reshape(3, 4)
    embeds = [("float32", (3, 4), e.tobytes()), ("float32", (3, 4), (e + 1).tobytes()),
              ("int32", (3, 4), e.tobytes()), ("float32", (4, 3), e.tobytes()), ("float32", (2, 6), e.tobytes())]
    got = [prompt_digest(None, embeds=x) for x in embeds]
    assert len(set(got)) == len(got) and "" not in got
    as_ids = e.view(np.int32).astype(np.int64).tolist()  # the same 48 bytes' values as token ids
    assert prompt_digest(as_ids) not in got
    assert prompt_digest(ids, cache_salt="") != prompt_digest(ids)


def test_a_prompt_of_nothing_is_refused():
    """No token ids and no embeds: nothing to name, so no digest ("" would match "")."""
    with pytest.raises(ValueError, match="token ids or prompt embeds"):
        prompt_digest(None)


def test_the_digest_is_pinned():
    """Prefill and decode must hash alike across releases: this value changes only with
    the protocol version (``messages.PROTOCOL_VERSION``, protocol 9). Token ids in any
    container give it: vLLM 0.32/0.33 hand a list, 0.34 a ``TokenBuffer`` (an int32 ``array``)."""
    kw = {"token_ids": [1, 2, 3], "mm": [("image", "abc", 1, 2)], "lora": "A", "cache_salt": "s",
          "embeds": ("bfloat16", (1, 2), b"\x01\x02\x03\x04"), "is_token_ids": [True, False, True]}
    assert prompt_digest(**kw) == "93fbcf42da45b4a0a9e3814a15ca1eb4"
    for ids in (list(range(100)), range(100), array.array("i", range(100)), np.arange(100, dtype=np.int32)):
        assert prompt_digest(ids) == "ffda55255abf19e3a98427ef339048e0"
