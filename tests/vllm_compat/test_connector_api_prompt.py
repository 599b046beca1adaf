"""``connector_api.prompt_inputs`` on the ``Request`` objects vLLM builds: a prefill's and a
decode's copy of one request hash alike; a request that differs in anything that scopes its
KV (LoRA adapter, ``cache_salt``, prompt embeds, a multimodal item) does not.

Each request travels as vLLM sends it to an engine core (an ``EngineCoreRequest`` through
vLLM's own msgpack encoder and decoder, the prompt embeds as a tensor) and becomes the
scheduler's ``Request`` through ``Request.from_engine_core_request``, once per instance:
what the prefill's and the decode's scheduler sides each hold.
"""

from __future__ import annotations

import array

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from vllm_dcp2d.transfer.messages import prompt_digest  # noqa: E402
from vllm_dcp2d.vllm_compat import connector_api as compat  # noqa: E402

IDS = [(7 * i) % 500 + 3 for i in range(40)]
EMBEDS = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8).to(torch.bfloat16)


def arrive(req_id: str, *, ids=IDS, embeds=None, mask=None, lora=None, salt=None, mm=()) -> Request:
    """The scheduler-side ``Request`` an engine core builds from this prompt."""
    features = [MultiModalFeatureSpec(data=None, modality=m, identifier=h, mm_position=PlaceholderRange(o, n))
                for m, h, o, n in mm] or None
    core = EngineCoreRequest(request_id=req_id, prompt_token_ids=ids, mm_features=features,
                             sampling_params=SamplingParams(max_tokens=1), pooling_params=None, arrival_time=0.0,
                             lora_request=lora, cache_salt=salt, data_parallel_rank=None, prompt_embeds=embeds,
                             prompt_is_token_ids=mask)
    wire = MsgpackEncoder().encode(core)
    return Request.from_engine_core_request(MsgpackDecoder(EngineCoreRequest).decode(wire), None)


def digest(request: Request) -> str:
    return prompt_digest(**compat.prompt_inputs(request))


def test_a_prefill_and_a_decode_of_one_request_agree():
    """Two instances, each with its own request id and its own id and path for the same
    adapter: one digest per request, for every kind of prompt."""
    cases = {
        "plain": {},
        "lora + salt": {"salt": "tenant-1"},
        "embeds": {"ids": None, "embeds": EMBEDS},
        "mixed": {"embeds": EMBEDS, "mask": [i % 3 != 0 for i in range(40)]},
        "multimodal": {"mm": [("image", "9f" * 16, 4, 16)]},
    }
    seen = set()
    for name, kw in cases.items():
        prefill = arrive("cmpl-p-0", lora=LoRARequest("adapter-a", 1, "/prefill/a") if "lora" in name else None,
                         **kw)
        decode = arrive("cmpl-d-7", lora=LoRARequest("adapter-a", 3, "/mnt/decode/a") if "lora" in name else None,
                        **kw)
        assert digest(prefill) == digest(decode) != "", name
        seen.add(digest(prefill))
    assert len(seen) == len(cases)


def test_what_scopes_the_kv_changes_the_digest():
    """Equal token ids, other adapter / salt / embeds (values or dtype) / multimodal item
    or position: another digest each. Main's ``prompt_ids`` gave the first four one digest,
    and every embeds prompt ""."""
    base = digest(arrive("a", lora=LoRARequest("A", 1, "/a"), salt="1"))
    others = [arrive("b", lora=LoRARequest("B", 1, "/a"), salt="2"), arrive("b", lora=LoRARequest("B", 1, "/a"),
                                                                               salt="1"),
              arrive("b", lora=LoRARequest("A", 1, "/a"), salt="2"), arrive("b", salt="1")]
    got = [digest(r) for r in others]
    assert base not in got and len(set(got)) == len(got)
    embeds = [digest(arrive("e", ids=None, embeds=e)) for e in
              (EMBEDS, EMBEDS + 1, EMBEDS.to(torch.float16), EMBEDS.reshape(20, 16))]
    assert len(set(embeds)) == len(embeds) and "" not in embeds
    mm = [digest(arrive("m", mm=m)) for m in ([("image", "h1", 4, 16)], [("image", "h2", 4, 16)],
                                              [("image", "h1", 5, 16)], [("audio", "h1", 4, 16)])]
    assert len(set(mm)) == len(mm)


def test_token_buffer_ids_hash_as_the_list():
    """vLLM 0.34 keeps a request's prompt ids in a ``TokenBuffer`` (an int32 ``array``):
    a 0.34 decode and a 0.32 prefill of one prompt agree."""
    request = arrive("t")
    request.prompt_token_ids = array.array("i", IDS)
    assert digest(request) == digest(arrive("t")) == prompt_digest(IDS)
