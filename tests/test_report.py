"""The demo's report of a served request (``report.matrix_from_records``, the demo's
per-path table): any prompt, including one shorter than a page, one shorter than
``dcp_size`` pages (a DCP rank moves nothing) and one exactly on a page boundary.
Records are built as the connector writes them (one per path, the plan's bytes)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from vllm_dcp2d import demo
from vllm_dcp2d.plan import plan_request
from vllm_dcp2d.layout import cdiv, cp_layer_range
from vllm_dcp2d.report import format_matrix, matrix_from_records, reshard_matrix, synthetic_request


def records(layers: int, cp: int, dcp: int, tokens: int, page: int, per_token_layer: int) -> list[dict]:
    src, src_ids, dst, dst_ids = synthetic_request(layers, cp, dcp, tokens, page, page * per_token_layer)
    plans = plan_request(layers, cp, src, src_ids, dst, dst_ids)
    out = []
    for (r, d), desc in plans.items():
        lr = cp_layer_range(layers, cp, r)
        out.append({"side": "consumer", "ok": True, "cp_rank": r, "cp_size": cp, "dcp_rank": d, "dcp_size": dcp,
                    "tp_rank": d, "layers": [lr.start, lr.stop], "pages": cdiv(tokens, page), "page_size": page,
                    "bytes": desc.nbytes, "replicated_bytes": 0, "naive_bytes": desc.nbytes * dcp,
                    "descriptors": len(desc), "seconds": 0.001, "fetch_seconds": 0.002, "early_layers": 0})
    return out


@given(layers=st.integers(1, 8), cp=st.integers(1, 3), dcp=st.integers(1, 4), page=st.sampled_from([16, 32]),
       per=st.integers(1, 600), pages=st.integers(0, 9), extra=st.integers(-1, 1))
def test_any_prompt_gets_the_matrix_of_what_moved(layers, cp, dcp, page, per, pages, extra):
    cp = min(cp, layers)
    tokens = max(1, pages * page + extra)  # exactly on a boundary, or one token either side
    recs = records(layers, cp, dcp, tokens, page, per)
    m = matrix_from_records(recs, tokens)
    assert m == reshard_matrix(layers, cp, dcp, tokens, page, per)
    assert sum(p["bytes"] for p in m["paths"]) == sum(r["bytes"] for r in recs)
    assert format_matrix(m)


def test_short_prompts_named_in_the_issue(capsys):
    """15 tokens at 16-token pages (MLA) and 20 at 32 (MQA) on DCP=2: DCP rank 1 moves
    nothing, which the demo once divided by."""
    for tokens, page, per in ((15, 16, 576 * 4), (20, 32, 2 * 32 * 4), (64, 32, 256)):
        recs = records(4, 2, 2, tokens, page, per)
        assert any(r["bytes"] == 0 for r in recs) == (tokens <= page)
        m = matrix_from_records(recs, tokens)
        assert m["total_bytes"] == m["kv_bytes"] and format_matrix(m)
        demo._print_paths(recs, tokens)
    assert "total" in capsys.readouterr().out


def test_no_figure_without_a_record_that_moved_pages():
    assert matrix_from_records([], 5) is None
    assert matrix_from_records([{"ok": False, "bytes": 0}], 5) is None
    draft = records(4, 2, 1, 40, 32, 8)
    for r in draft:
        r["replicated_bytes"] = 1
    assert matrix_from_records(draft, 40) is None
