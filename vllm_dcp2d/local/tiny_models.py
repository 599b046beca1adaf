"""Tiny random-weight models built locally (no model hub is reachable).

``build_tiny_model(kind, path)`` writes a Hugging Face model directory
(config, safetensors weights, tokenizer with a chat template) that vLLM can
serve. Weights come from a fixed seed, so the same kind gives the same files
and the same greedy tokens on every machine. A directory that already holds
the same build is reused.

Kinds (all: vocab 512, hidden 128, 4 attention heads, head_dim 32 or MLA 576):
  llama            LlamaForCausalLM, 4 layers, 2 KV heads.
  llama-mqa        LlamaForCausalLM, 4 layers, 1 KV head: the KV is replicated
                   over TP=2 ranks, so each TP rank can act as a layer-split CP
                   rank, and DCP=2 is valid with TP=2 (vLLM needs TP > KV heads).
  llama-mqa-8      llama-mqa with 8 layers (layer-split storage at CP=2: 8 / 5 = 1.6x).
  deepseek-v2-mla  DeepseekV2ForCausalLM, 2 layers, MLA with kv_lora_rank 512 and
                   qk_rope_head_dim 64 (the only MLA shape vLLM's CPU backend runs).
  deepseek-v3-mtp  DeepseekV3ForCausalLM, 2 dense MLA layers (the shape above) and one
                   MTP layer (``num_nextn_predict_layers: 1``) stored as layer 2, as
                   DeepSeek-V3 checkpoints hold it: its decoder block plus ``enorm``,
                   ``hnorm``, ``eh_proj`` and ``shared_head``. Serve its draft with
                   ``speculative_config={"method": "mtp", "num_speculative_tokens": k}``.
  llama-mqa-eagle  an EAGLE draft head for llama-mqa (vLLM's EagleLlamaForCausalLM):
                   one decoder layer without its input norm, and ``fc`` [128, 256]
                   over [embedding | target hidden state]; it shares the target's
                   embedding and LM head. Serve it with
                   ``speculative_config={"method": "eagle", "model": path}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

KINDS = ("llama", "llama-mqa", "llama-mqa-8", "deepseek-v2-mla", "deepseek-v3-mtp", "llama-mqa-eagle")
_VERSION = 1  # bump when the recipe changes, so cached builds are rebuilt
_VOCAB = 512
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Deterministic training text for the byte-level BPE tokenizer.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Long-context serving shards KV cache by layer on prefill and by page on decode. " * 4,
    "Prefill decode disaggregation moves the KV cache over the Mooncake transfer engine. " * 4,
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 " * 4,
]


def _config(kind: str, dtype: str) -> dict:
    common = dict(vocab_size=_VOCAB, hidden_size=128, num_attention_heads=4, intermediate_size=256,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, dtype=dtype,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind in ("llama", "llama-mha", "llama-mqa", "llama-mqa-8", "llama-mqa-eagle"):
        layers = {"llama-mqa-8": 8, "llama-mqa-eagle": 1}.get(kind, 4)
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                    num_hidden_layers=layers,
                    num_key_value_heads={"llama": 2, "llama-mha": 4}.get(kind, 1), head_dim=32, hidden_act="silu",
                    rope_theta=10000.0)
    if kind == "deepseek-v2-mla":
        return dict(common, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                    num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                    qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, hidden_act="silu",
                    moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                    num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False,
                    scoring_func="softmax", rope_theta=10000.0, rope_scaling=None, aux_loss_alpha=0.0)
    if kind == "deepseek-v3-mtp":
        # Every layer dense (first_k_dense_replace past the MTP layer): MoE adds nothing here.
        # Built with 3 layers, the last saved as the MTP layer (_save_mtp_model).
        v2 = _config("deepseek-v2-mla", dtype)
        return dict(v2, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=3,
                    first_k_dense_replace=3, topk_method="noaux_tc", scoring_func="sigmoid",
                    norm_topk_prob=True, rope_interleave=True)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_tiny_model(kind: str, path: str | os.PathLike, dtype: str = "bfloat16") -> str:
    """Write tiny model ``kind`` to directory ``path`` and return it as a str.

    Reuses ``path`` when it already holds the same build (kind, dtype, recipe version).
    """
    import torch
    import transformers

    path = Path(path)
    stamp = {"kind": kind, "dtype": dtype, "version": _VERSION}
    stamp_file = path / "dcp2d_tiny.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return str(path)
    cfg_dict = _config(kind, dtype)
    path.mkdir(parents=True, exist_ok=True)
    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"]).__class__
    config = cfg_cls(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        # Larger-than-default init spreads the logits, so greedy decoding has no
        # near-ties that rounding differences between kernels could flip.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    if kind == "llama-mqa-eagle":
        _save_eagle_head(model, path)
    elif kind == "deepseek-v3-mtp":
        _save_mtp_model(model, path)
    else:
        model.save_pretrained(path, safe_serialization=True)
    _build_tokenizer(path)
    stamp_file.write_text(json.dumps(stamp))
    return str(path)


def _save_eagle_head(model, path: Path) -> None:
    """Save a one-layer Llama as an EAGLE head in the checkpoint names vLLM's
    ``EagleLlamaForCausalLM.load_weights`` reads (``fc.weight``, ``layers.0.*``)."""
    import torch
    from safetensors.torch import save_file

    hidden = model.config.hidden_size
    weights = {name.removeprefix("model."): w.contiguous() for name, w in model.state_dict().items()
               if name.startswith("model.layers.") and "input_layernorm" not in name}
    fc = torch.empty(hidden, 2 * hidden, dtype=model.dtype)
    with torch.no_grad():
        fc.normal_(0.0, 0.08)
    weights["fc.weight"] = fc
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)


def _save_mtp_model(model, path: Path) -> None:
    """Save a 3-layer DeepSeek-V3 as 2 layers plus an MTP layer 2, in the checkpoint names
    vLLM's ``DeepSeekMTP.load_weights`` reads; the target's loader skips layer 2."""
    import torch
    from safetensors.torch import save_file

    cfg = model.config
    hidden, mtp = cfg.hidden_size, cfg.num_hidden_layers - 1
    weights = {name: w.contiguous() for name, w in model.state_dict().items()}
    # A random MTP layer would almost never be accepted, leaving verification's accept paths
    # untested. This one mostly predicts "the next token repeats the last one", which the
    # target then often does: eh_proj passes the token's embedding (not the hidden state),
    # the block adds a damped attention and MLP (its KV is still written and read), and the
    # head (vLLM gives the MTP layer the target's) is the embedding matrix, whose rows score
    # highest against themselves.
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    eh_proj = torch.zeros(hidden, 2 * hidden)
    eh_proj[:, :hidden] = torch.eye(hidden)
    for name in (f"model.layers.{mtp}.self_attn.o_proj.weight", f"model.layers.{mtp}.mlp.down_proj.weight"):
        weights[name] = weights[name] * 0.25
    extra = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
             "shared_head.norm.weight": torch.ones(hidden), "eh_proj.weight": eh_proj,
             "shared_head.head.weight": weights["lm_head.weight"].clone()}
    weights.update({f"model.layers.{mtp}.{k}": v.to(model.dtype) for k, v in extra.items()})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.num_hidden_layers, cfg.num_nextn_predict_layers = mtp, 1
    cfg.save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Build a tiny random-weight model directory.")
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("path")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    print(build_tiny_model(args.kind, args.path, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
