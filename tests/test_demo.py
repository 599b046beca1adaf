"""The demo's GPU commands pass vLLM's own validation, checked without a GPU.

Two checks, the narrowest vLLM runs on a CPU build: its CLI parser, ``EngineArgs``
and ``create_engine_config`` on the exact ``vllm serve`` argv of both instances
(flags, TP/DCP, the connector's config), and the attention backend's own
``validate_configuration`` for an H200 (compute capability 9.0) with the block size,
dtype and head size the demo picks, DCP on decode and a KV connector. The CPU build
always adds one reason, that the backend's CUDA kernels were not compiled; only
that one is ignored.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_dcp2d import demo  # noqa: E402
from vllm_dcp2d.local.tiny_models import build_tiny_model  # noqa: E402

H200 = DeviceCapability(9, 0)
# The backends vLLM 0.32 picks on Hopper: FLASH_ATTN for MHA/GQA/MQA; FLASHMLA, else
# TRITON_MLA, for MLA (FLASH_ATTN_MLA does not import on a CPU build).
BACKENDS = {False: ("FLASH_ATTN",), True: ("FLASHMLA", "TRITON_MLA")}


def engine_config(cmd: list[str]):
    """vLLM's engine config for ``vllm serve MODEL ...`` argv ``cmd``, as the CLI builds it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert cmd[1] == "serve"
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    ns.model = cmd[2]
    return AsyncEngineArgs.from_cli_args(ns).create_engine_config()


def reasons(backend: str, head_size: int, dtype: str, block: int, mla: bool, dcp: bool) -> list[str]:
    cls = AttentionBackendEnum[backend].get_class()
    found = cls.validate_configuration(
        head_size=head_size, dtype=getattr(torch, dtype), kv_cache_dtype=None, block_size=block, use_mla=mla,
        has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=H200, attn_type="decoder", use_kv_connector=True, use_dcp=dcp)
    return [r for r in found if "is not available" not in r and "not compiled" not in r]


@pytest.mark.parametrize("kind", ["llama-mqa", "deepseek-v2-mla"])
def test_demo_gpu_commands_pass_vllm_validation(kind, tmp_path):
    """``vllm-dcp2d demo --model PATH --prefill-tp 4 --decode-tp 4 --decode-dcp 2`` (the
    README's command at the TP the tiny models' 4 heads allow) on a GPU host: both
    instances' flags build an engine config, and the block size
    and dtype they get are ones the GPU backend vLLM picks accepts, with DCP on decode."""
    mla = kind == "deepseek-v2-mla"
    model = build_tiny_model(kind, tmp_path / kind)  # MLA: DeepSeek's 512 + 64 latent, like V2/V3
    args = demo.parse(["--model", model, "--prefill-tp", "4", "--decode-tp", "4", "--decode-dcp", "2"])
    prefill, decode = demo.servers(args, model, tmp_path, tmp_path / "stats.jsonl", cpu=False)
    block, dtype = demo.serving_defaults(tiny=False, mla=mla, gpu=True)
    assert block == (64 if mla else None)
    for proc, dcp in ((prefill, 1), (decode, 2)):
        cfg = engine_config(proc.cmd)
        assert cfg.parallel_config.tensor_parallel_size == 4
        assert cfg.parallel_config.decode_context_parallel_size == dcp
        assert cfg.kv_transfer_config.kv_connector == "DCP2DConnector" and cfg.model_config.use_mla == mla
        assert ("--block-size" in proc.cmd) == (block is not None)
        head = 576 if mla else cfg.model_config.get_head_size()
        for backend in BACKENDS[mla]:
            assert reasons(backend, head, "bfloat16", block or 16, mla, dcp > 1) == [], (backend, proc.name)


def test_flashmla_refuses_the_cpu_block_size():
    """The check has teeth: FLASHMLA rejects CPU_MLA's 16-token pages, and TRITON_ATTN
    (fp32-capable) cannot decode with DCP, so the tiny model runs bf16 on FLASH_ATTN."""
    assert "block_size not supported" in reasons("FLASHMLA", 576, "bfloat16", 16, True, True)
    assert "DCP not supported" in reasons("TRITON_ATTN", 32, "bfloat16", 32, False, True)
    block, dtype = demo.serving_defaults(tiny=True, mla=False, gpu=True)
    assert reasons("FLASH_ATTN", 32, dtype, block, False, True) == []
    assert reasons("FLASH_ATTN", 32, "float32", block, False, True) != []
