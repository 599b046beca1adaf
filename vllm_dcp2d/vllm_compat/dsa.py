"""Where a connector hears of a layer's KV write, and the DSA layers it would not hear of
(vLLM 0.32.0, 0.33.0, 0.34.0; patch ``dsa_fused_kv_write`` in ``patches.py``).

vLLM calls a connector's ``save_kv_layer`` from ``maybe_transfer_kv_layer``
(``model_executor/layers/attention/kv_transfer_utils.py``), the decorator of its attention ops
``unified_attention_with_output`` and ``unified_mla_attention_with_output``, which
``Attention.forward`` and ``MLAAttention.forward`` reach after the layer wrote its cache:
layer pipelining (``connector/producer.py``) sends each layer from there.

On CUDA the DSA architectures (``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``,
``DeepseekV32MTPModel``) resolve to ``vllm/models/deepseek_v32/nvidia``
(``models/deepseek_v32/__init__.py``; ``deepseek_v2`` only on CPU and XPU), whose layers are
``DeepseekV32Attention`` (``models/deepseek_v32/attention.py``). Its ``forward`` overrides
``MLAAttention.forward``: the Triton kernel ``fused_norm_rope`` writes both caches of the
layer, the MLA latent and the indexer's keys (``sparse_attn_indexer`` then runs with
``skip_k_cache_insert``), and the attention itself runs in ``_sparse_indexer_and_attn``,
which vLLM marks ``eager_break_during_capture`` and wraps in no connector call. Without
this module no ``save_kv_layer`` fires for a DSA layer, and a pipelined fetch gets its
layers only after the prompt completed.

:func:`hook_fused_writes` gives each such layer what vLLM gives every other attention
layer: its ``_sparse_indexer_and_attn`` becomes, on that layer only, vLLM's own
``maybe_transfer_kv_layer`` around the layer's method under vLLM's own
``eager_break_during_capture``, the order vLLM's attention ops use. So the hook runs where
vLLM's would: eagerly, also inside a breakable CUDA graph (these architectures' default on
CUDA, ``config/vllm.py``), in the eager segment after the captured segment that ran
``fused_norm_rope``; ``save_kv_layer`` records its CUDA event on the stream after both
writes (and after the ones ``_sparse_indexer_and_attn`` itself makes under PCP). Where no
Python runs (a FULL CUDA graph: uniform decode batches; capture, with the connector
disabled) nothing is saved early: the sender writes the layer after the prompt completes,
as for any layer whose write it did not hear of (:func:`unseen_writes`, logged once).
"""

from __future__ import annotations

__all__ = ["METHOD", "hook_fused_writes", "unhook_fused_writes", "fused_writer_classes", "unseen_writes"]

# The method of a fused writer that runs after both of its layer's caches are written.
METHOD = "_sparse_indexer_and_attn"


def fused_writer_classes() -> tuple[type, ...]:
    """The attention classes whose ``forward`` writes the layer's caches itself and then
    calls :data:`METHOD` (the patch table's target, ``patches.PATCHES``)."""
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    return (DeepseekV32Attention,)


def unseen_writes(cls: type, fused: tuple[type, ...]) -> str | None:
    """Why vLLM's connector call does not follow the KV write of a layer of class ``cls``,
    or None: an ``Attention`` / ``MLAAttention`` whose class overrides vLLM's ``forward``
    (the path to the decorated op) and is not one of ``fused`` (hooked here). Other layers
    (a DSA indexer's key cache) hold a plane of a layer whose attention writes it."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    if issubclass(cls, fused):
        return None
    for base in (MLAAttention, Attention):
        if issubclass(cls, base):
            if cls.forward is base.forward:
                return None
            return f"{cls.__qualname__}.forward overrides {base.__name__}.forward"
    return None


def hook_fused_writes(vllm_config, names) -> tuple[list[str], dict[str, str], str | None]:
    """Make ``save_kv_layer`` fire for each of ``names`` (layer names, as ``register_kv_caches``
    gets them) whose attention is a fused writer, after its caches are written (module doc).

    Returns (the layers hooked, {layer: why its writes stay unheard} for the others whose
    writes vLLM's connector call does not follow, and why the patch ``dsa_fused_kv_write``
    does not fit this vLLM or None). Where it does not fit, nothing is hooked and the fused
    writers' layers are among the unheard."""
    from vllm_dcp2d.vllm_compat import registry

    try:
        registry.check("dsa_fused_kv_write")
        fused, refused = fused_writer_classes(), None
    except RuntimeError as e:
        fused, refused = (), str(e)
    ctx = vllm_config.compilation_config.static_forward_context
    hooked, unseen = [], {}
    if fused:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
    for name in names:
        layer = ctx.get(name)
        if layer is None:
            continue
        if not isinstance(layer, fused):
            why = unseen_writes(type(layer), fused)
            if why is not None:
                unseen[name] = why
            continue
        if METHOD in layer.__dict__:  # hooked already (one layer, several of its planes in ``names``)
            hooked.append(name)
            continue
        stock = getattr(layer, METHOD)  # the bound method vLLM's forward calls

        def after_fused_write(layer_name, args, kwargs, _stock=stock):  # layer_name: what vLLM's decorator reads
            return _stock(*args, **kwargs)

        saved = maybe_transfer_kv_layer(after_fused_write)

        def call(*args, _saved=saved, _name=layer.layer_name, **kwargs):
            return _saved(_name, args, kwargs)

        setattr(layer, METHOD, eager_break_during_capture(call))
        hooked.append(name)
    return hooked, unseen, refused


def unhook_fused_writes(vllm_config, names) -> None:
    """Undo :func:`hook_fused_writes` (the class's method again)."""
    ctx = vllm_config.compilation_config.static_forward_context
    for name in names:
        layer = ctx.get(name)
        if layer is not None:
            layer.__dict__.pop(METHOD, None)
