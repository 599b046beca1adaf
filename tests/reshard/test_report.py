"""The demo's report of a served request (``report.matrix_from_records``, the demo's
per-path table): any prompt, including one shorter than a page, one shorter than
``dcp_size`` pages (a DCP rank moves nothing) and one exactly on a page boundary.
Records are built as the connector writes them (one per path, the plan's bytes)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from vllm_dcp2d import demo
from vllm_dcp2d.reshard.plan import plan_request
from vllm_dcp2d.reshard.layout import cdiv, cp_layer_range
from vllm_dcp2d.reshard.report import format_matrix, matrix_from_records, reshard_matrix, synthetic_request


def records(layers: int, cp: int, dcp: int, tokens: int, page: int, per_token_layer: int,
            draft: int = 0) -> list[dict]:
    """As the connector writes them: the last ``draft`` layers are a draft's, whose pages
    all go to every DCP rank (``replicated_bytes``)."""
    src, src_ids, dst, dst_ids = synthetic_request(layers, cp, dcp, tokens, page, page * per_token_layer,
                                                   draft_layers=draft)
    plans = plan_request(layers, cp, src, src_ids, dst, dst_ids)
    pages = cdiv(tokens, page)
    out = []
    for (r, d), desc in plans.items():
        lr = cp_layer_range(layers, cp, r)
        replicated = len([x for x in lr if x >= layers - draft]) * pages * page * per_token_layer
        out.append({"side": "consumer", "ok": True, "cp_rank": r, "cp_size": cp, "dcp_rank": d, "dcp_size": dcp,
                    "tp_rank": d, "layers": [lr.start, lr.stop], "pages": pages, "page_size": page,
                    "bytes": desc.nbytes, "replicated_bytes": replicated, "draft_layers": draft,
                    "naive_bytes": desc.nbytes * dcp, "descriptors": len(desc), "seconds": 0.001,
                    "fetch_seconds": 0.002, "early_layers": 0})
    return out


@given(layers=st.integers(1, 8), cp=st.integers(1, 3), dcp=st.integers(1, 4), page=st.sampled_from([16, 32]),
       per=st.integers(1, 600), pages=st.integers(0, 9), extra=st.integers(-1, 1), draft=st.integers(0, 3))
def test_any_prompt_gets_the_matrix_of_what_moved(layers, cp, dcp, page, per, pages, extra, draft):
    """Also with a draft (an MTP layer, an EAGLE head: the last ``draft`` layers, sent
    whole to every DCP rank): the matrix is what the records say moved, byte for byte."""
    cp, draft = min(cp, layers), min(draft, layers)
    tokens = max(1, pages * page + extra)  # exactly on a boundary, or one token either side
    recs = records(layers, cp, dcp, tokens, page, per, draft)
    m = matrix_from_records(recs, tokens)
    assert m == reshard_matrix(layers, cp, dcp, tokens, page, per, draft_layers=draft)
    assert sum(p["bytes"] for p in m["paths"]) == sum(r["bytes"] for r in recs)
    # the target's pages once over all DCP ranks, the draft's once per DCP rank
    assert m["total_bytes"] == m["kv_bytes"] + (dcp - 1) * m["draft_kv_bytes"]
    assert ("not sharded on decode" in format_matrix(m)) == (draft > 0)


def test_the_mtp_demo_request(capsys):
    """The demo's first request on the tiny MLA model with its MTP draft (5 tokens, one
    16-token page; DCP rank 1 gets no target page but the MTP layer's page): what
    ``vllm-dcp2d demo --speculative-config '{"method": "mtp", ...}'`` printed."""
    recs = records(3, 2, 2, 5, 16, 576 * 2, draft=1)
    assert [r["bytes"] for r in sorted(recs, key=lambda r: (r["cp_rank"], r["dcp_rank"]))] == [
        36864, 0, 18432, 18432]
    m = matrix_from_records(recs, 5)
    assert (m["total_bytes"], m["kv_bytes"], m["draft_kv_bytes"]) == (73728, 55296, 18432)
    assert "the draft's 1 (not sharded on decode): 36.86 KB = 2.00x their KV" in format_matrix(m)


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
    odd = records(4, 2, 2, 40, 32, 8)
    for r in odd:  # not whole pages of one size: no figure rather than a wrong one
        r["bytes"] -= 1
    assert matrix_from_records(odd, 40) is None
    # a record written before draft_layers was: its replicated bytes cannot be placed
    old = records(4, 2, 2, 100, 32, 8, draft=1)
    for r in old:
        del r["draft_layers"]
    assert matrix_from_records(old, 100) is None


@given(layers=st.integers(1, 6), cp=st.integers(1, 3), dcp=st.integers(1, 4), page=st.sampled_from([16, 64]),
       planes=st.lists(st.integers(1, 700), min_size=1, max_size=3), pages=st.integers(0, 9), seed=st.integers(0, 9))
def test_layers_with_several_caches_move_each_once(layers, cp, dcp, page, planes, pages, seed):
    """Every layer holding several caches (sparse MLA: latent and indexer), each its own
    region and page size: every path moves its layers' pages of every cache, and the wire
    carries the KV once, however the block ids are shuffled."""
    cp, tokens = min(cp, layers), pages * page
    caches = [(f"c{i}", b) for i, b in enumerate(planes)]
    m = reshard_matrix(layers, cp, dcp, tokens, page, 0, seed, caches=caches)
    assert m["total_bytes"] == m["kv_bytes"] == layers * pages * page * sum(planes)
    for path in m["paths"]:
        held = path["layers"][1] - path["layers"][0]
        assert path["bytes"] == held * path["pages"] * page * sum(planes)
    assert [c["kv_bytes"] for c in m.get("caches", [{"kv_bytes": m["kv_bytes"]}])] == \
        [layers * pages * page * b for b in planes]
