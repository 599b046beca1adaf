"""The head axis of the 3D reshard (issue 39), unit by unit: where heads sit in each
backend's page (``page_format.kv_regions``), the default ``cp_size``, the per-head
fingerprint check and what its refusals name, the wire fields of the consumer's head
layout, and ``vllm-dcp2d plan --kv-heads``."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from vllm_dcp2d.cli import main as cli
from vllm_dcp2d.transfer.messages import (Fingerprint, FingerprintMismatch, MessageError, TransferRequest, decode,
                                           encode)
from vllm_dcp2d.reshard.layout import default_cp_size, per_head_layout
from vllm_dcp2d.reshard.page_format import kv_regions, page_format
from vllm_dcp2d.reshard.regions import KVRegions

B = 6  # blocks


def _geometry(t: torch.Tensor):
    regions, _ = kv_regions({"l0": t}, B, {"l0": 0})
    return page_format(t, B), regions.head_count.tolist(), regions.head_runs.tolist(), regions.page_bytes.tolist()


def test_where_heads_sit_in_each_backends_page():
    """vLLM's CPU page and GPU LBHNC (HND): heads outside the tokens, one run per head range;
    LBNHC (NHD): heads inside the tokens, a run per token; one head: the whole page;
    LHBNC: each head its own region (one head per region)."""
    assert _geometry(torch.zeros(B, 2, 16, 64)) == ("H2,N16,C256", [2], [1], [8192])
    assert _geometry(torch.zeros(B, 16, 2, 64).permute(0, 2, 1, 3)) == ("N16,H2,C256", [2], [16], [8192])
    assert _geometry(torch.zeros(B, 1, 16, 64)) == ("N16,C256", [1], [1], [4096])
    assert _geometry(torch.zeros(2, B, 16, 64).permute(1, 0, 2, 3)) == ("H2/N16,C256", [1, 1], [1, 1], [4096, 4096])


@pytest.mark.parametrize("k,tp,want", [(1, 4, 4), (2, 4, 2), (2, 2, 1), (8, 2, 1), (2, 1, 1), (1, 1, 1)])
def test_the_default_cp_size_is_what_the_model_allows(k, tp, want):
    cp, why = default_cp_size(k, tp)
    assert cp == want and why
    if k >= tp > 1:
        assert why.startswith(f"{k} KV heads sharded over tensor_parallel_size={tp}")


def test_per_head_layout_leaves_the_head_axis_out():
    assert per_head_layout("H2,N16,C256:cpu:vec:0a1b") == "N16,C256:cpu:vec:0a1b"
    assert per_head_layout("N16,H2,C256:k|v") == per_head_layout("N16,C256:k|v") == "N16,C256:k|v"
    assert per_head_layout("H8/N16,C512:k|v") == "N16,C512:k|v"
    assert per_head_layout("N64,C656:fp8_ds_mla:kv_c|scales|k_pe + N64,C132:idx_k:fp8|scale:f32") == \
        "N64,C656:fp8_ds_mla:kv_c|scales|k_pe + N64,C132:idx_k:fp8|scale:f32"


FP2 = Fingerprint("m", 4, 32, "float32", 8192, "H2,N32,C256:cpu:vec:ab", "cfg", num_kv_heads=2)
FP1 = dataclasses.replace(FP2, page_bytes=4096, layout="N32,C256:cpu:vec:ab")


def test_fingerprints_of_ranks_holding_different_heads_compare_per_head():
    FP2.check(FP1, 2, 1)
    FP1.check(FP2, 1, 2)
    with pytest.raises(FingerprintMismatch) as e:  # the same head count: pages compared whole, as before
        FP2.check(FP1)
    assert "page_bytes: ours 8192, peer 4096" in str(e.value)


def test_a_head_split_the_plugin_cannot_serve_names_what_differs():
    """Item 4: a per-head difference names the bytes per head and both head counts, not the
    KV cache layout; a layout difference still names VLLM_KV_CACHE_LAYOUT."""
    half = dataclasses.replace(FP1, page_bytes=2048, layout="N32,C128:cpu:vec:ab")
    with pytest.raises(FingerprintMismatch) as e:
        FP2.check(half, 2, 1)
    msg = str(e.value)
    assert "bytes per KV head of a page: ours 4096 (8192 B over 2 heads), peer 2048 (2048 B over 1)" in msg
    assert "start both with the same head_size, block size and KV dtype" in msg
    assert "(KV heads per rank: ours 2, peer 1 of 2)" in msg
    other = dataclasses.replace(FP1, layout="N32,C256:k|v")
    with pytest.raises(FingerprintMismatch, match="layout of one KV head: ours 'N32,C256:cpu:vec:ab', peer "
                                                  "'N32,C256:k|v'.*VLLM_KV_CACHE_LAYOUT"):
        FP2.check(other, 2, 1)


def _request(heads: range, head_count, head_runs):
    regions = KVRegions(np.arange(4), np.arange(4).reshape(4, 1) * (1 << 20) + 4096, [4096], [4096],
                        head_count=head_count, head_runs=head_runs)
    return TransferRequest.build(regions=regions, transfer_key="k", attempt_id=1,
                                 engine_id="d", consumer_rank=0, consumer_size=1,
                                 dcp_size=1, dcp_rank=0, block_ids=[0, 1], num_tokens=40, first_page=0,
                                 num_blocks=8, fingerprint=FP2, wait_s=0.0, head_start=heads.start,
                                 head_end=heads.stop)


def test_the_consumers_head_layout_travels_and_is_bounded():
    req = decode(encode(_request(range(0, 2), [2], [32])))
    assert req.regions().head_count.tolist() == [2] and req.regions().head_runs.tolist() == [32]
    with pytest.raises(MessageError, match=r"head_count \[2\]: a page cannot hold more heads than the rank's \[1, 2\)"):
        encode(_request(range(1, 2), [2], [1]))
    with pytest.raises(MessageError, match=r"head_runs \[64\]: a head cannot be cut into more runs than the page's "
                                           r"page_size=32 tokens"):
        encode(_request(range(0, 2), [2], [64]))


def test_plan_cli_prints_the_3d_paths(capsys):
    assert cli(["plan", "--kv-heads", "2", "--prefill-tp", "1", "--decode-tp", "2", "--num-layers", "4",
                "--tokens", "100", "--page-size", "16", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert [(p["tp_rank"], p["decode_rank"], p["heads"], p["layers"], p["pages"]) for p in m["paths"]] == [
        (0, 0, [0, 1], [0, 4], 7), (0, 1, [1, 2], [0, 4], 7)]
    assert m["total_bytes"] == m["kv_bytes"] == 4 * 7 * 2 * 16 * 512
    assert [p["descriptors"] for p in m["paths"]] == [28, 28]  # one run per (layer, page): heads outside tokens
    assert cli(["plan", "--kv-heads", "2", "--prefill-tp", "1", "--decode-tp", "2", "--num-layers", "4",
                "--tokens", "100", "--page-size", "16", "--layout", "nhd", "--json"]) == 0
    assert [p["descriptors"] for p in json.loads(capsys.readouterr().out)["paths"]] == [28 * 16] * 2  # per token
    with pytest.raises(SystemExit):
        cli(["plan", "--kv-heads", "8", "--prefill-tp", "2", "--decode-tp", "2", "--dcp", "2"])
    assert "DCP needs TP > KV heads" in capsys.readouterr().err
