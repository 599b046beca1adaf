"""The DSA layers' save_kv_layer (issue 51, item 1; ``vllm_compat/dsa.py``), on vLLM 0.32 here.

On CUDA vLLM serves DeepSeek-V3.2 and GLM-5.x through ``DeepseekV32Attention``, which writes
both caches of a layer in ``fused_norm_rope`` and reaches no connector call;
``dsa.hook_fused_writes`` wraps each such layer's ``_sparse_indexer_and_attn`` in vLLM's own
``maybe_transfer_kv_layer`` (under its ``eager_break_during_capture``). Its kernels need a
GPU, so the layer here is vLLM's class with that one method recording its call instead of
launching them; everything around it is vLLM's: the decorators, the forward context,
``get_attention_context``, the connector registry's checks. (Which classes vLLM loads on
CUDA, and that the method runs after both writes, is read from each version's sources:
``tests/vllm_compat/test_vllm_sources.py``.)
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("vllm")

from vllm.compilation.breakable_cudagraph import eager_break_during_capture  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache  # noqa: E402
from vllm.models.deepseek_v32.attention import DeepseekV32Attention  # noqa: E402

from vllm_dcp2d.vllm_compat import dsa, registry  # noqa: E402

LATENT = "model.layers.{}.self_attn.attn"
events: list = []


class Recorded(DeepseekV32Attention):
    """vLLM's DSA attention whose eager method records its call instead of running GPU kernels."""

    @eager_break_during_capture
    def _sparse_indexer_and_attn(self, positions, q_c, q_nope, q_pe, index_q_fp8, index_k, index_weights_out, kv_c,
                                 k_pe, ql_nope, mqa_q, output):
        events.append(("attention", self.layer_name, int(output.sum())))
        output.add_(1)


class Overridden(MLAAttention):
    def forward(self, *args, **kwargs):  # a class that writes its KV some other way
        raise AssertionError("not called")


def _layer(cls, name: str):
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.layer_name, layer.kv_cache = name, torch.zeros(4, 1, 64, 656, dtype=torch.uint8)
    return layer


def _connector(bound: bool):
    """A V1 connector (vLLM's base class) recording the calls vLLM's decorator makes."""
    cls = type("RecordingConnector", (KVConnectorBase_V1,), {
        **{name: lambda *a, **k: None for name in KVConnectorBase_V1.__abstractmethods__},
        "wait_for_layer_load": lambda self, layer_name: events.append(("wait", layer_name)),
        "save_kv_layer": lambda self, layer_name, kv_layer, attn_metadata, **kw: events.append(
            ("save", layer_name, kv_layer.data_ptr(), attn_metadata))})
    connector = object.__new__(cls)
    connector._connector_metadata = object() if bound else None
    return connector


@pytest.fixture
def model(monkeypatch):
    """Two DSA layers, one indexer cache, one attention class that overrides vLLM's forward,
    in a ``VllmConfig``'s forward context."""
    cfg = VllmConfig()
    ctx = cfg.compilation_config.static_forward_context
    for i in range(2):
        ctx[LATENT.format(i)] = _layer(Recorded, LATENT.format(i))
    indexer = object.__new__(DeepseekV32IndexerCache)
    torch.nn.Module.__init__(indexer)
    ctx["model.layers.0.self_attn.indexer.k_cache"] = indexer
    ctx["model.layers.2.self_attn.attn"] = _layer(Overridden, "model.layers.2.self_attn.attn")
    events.clear()
    yield cfg
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)


def _run(cfg, name: str, metadata):
    layer = cfg.compilation_config.static_forward_context[name]
    args = [torch.zeros(2)] * 11 + [torch.zeros(3)]
    with set_forward_context({name: metadata} if metadata is not None else None, cfg):
        layer._sparse_indexer_and_attn(*args)


def test_save_kv_layer_fires_after_the_fused_write_of_each_dsa_layer(model, monkeypatch):
    hooked, unseen, refused = dsa.hook_fused_writes(model, list(model.compilation_config.static_forward_context))
    assert hooked == [LATENT.format(0), LATENT.format(1)] and refused is None
    assert unseen == {"model.layers.2.self_attn.attn": "Overridden.forward overrides MLAAttention.forward"}
    meta = NS(step=1)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", _connector(bound=True))
    _run(model, LATENT.format(1), meta)
    kv = model.compilation_config.static_forward_context[LATENT.format(1)].kv_cache.data_ptr()
    # vLLM's decorator: wait on entry, the layer's own method, then save with the layer's cache
    assert events == [("wait", LATENT.format(1)), ("attention", LATENT.format(1), 0),
                      ("save", LATENT.format(1), kv, meta)]
    events.clear()
    _run(model, LATENT.format(0), None)  # no attention metadata (a dummy run): vLLM's decorator saves nothing
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", _connector(bound=False))
    _run(model, LATENT.format(0), meta)  # no connector metadata bound (between steps, disabled)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    _run(model, LATENT.format(0), meta)  # no connector at all
    assert events == [("attention", LATENT.format(0), 0)] * 3
    dsa.unhook_fused_writes(model, hooked)
    assert all(dsa.METHOD not in model.compilation_config.static_forward_context[n].__dict__ for n in hooked)


def test_where_the_patch_does_not_fit_nothing_is_hooked_and_the_dsa_layers_are_named(model, monkeypatch):
    """The patch's targets missing on some vLLM: the layers keep vLLM's method, and the
    producer's start-up log names them with the reason (their KV goes after the prompt)."""

    def refuse(name):
        raise RuntimeError(f"patch {name!r} is not installed: gone")

    monkeypatch.setattr(registry, "check", refuse)
    hooked, unseen, refused = dsa.hook_fused_writes(model, list(model.compilation_config.static_forward_context))
    assert hooked == [] and refused == "patch 'dsa_fused_kv_write' is not installed: gone"
    assert unseen[LATENT.format(0)] == "Recorded.forward overrides MLAAttention.forward" and len(unseen) == 3
    assert all(dsa.METHOD not in layer.__dict__ for layer in model.compilation_config.static_forward_context.values())
