"""Connector metrics without an engine: ``DCP2DStats`` as vLLM moves it (snapshots
per step, ``aggregate`` over TP ranks, JSON/pickle on the way), its conversion to
Prometheus (``connector/prom.py``, read back from a private registry), the
documented table and the Grafana dashboard's PromQL names. The live ``/metrics``
of a real prefill + decode pair is checked in ``test_e2e.py::test_metrics``."""

from __future__ import annotations

import functools
import json
import pickle
import re
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from vllm_dcp2d.connector.prom import (METRICS, WRITE_SECONDS_BUCKETS, DCP2DPromMetrics,  # noqa: E402
                                       exposed_names, markdown_table)
from vllm_dcp2d.connector.stats import _COUNTERS, _TIMERS, MAX_OBSERVATIONS, DCP2DStats, parse_path_key  # noqa: E402

ROOT = Path(__file__).parents[2]

# One recorded event: ("path", cp_rank, dcp_rank, bytes, replicated, descriptors, seconds) or ("count", name, n)
_path_event = st.tuples(st.just("path"), st.integers(0, 3), st.integers(0, 3), st.integers(0, 1 << 40),
                        st.integers(0, 1 << 20), st.integers(0, 10_000),
                        st.sampled_from([0.0, 0.0004, 0.001, 0.003, 0.07, 1.0, 9.99, 10.0, 25.0, 75.0]))
_count_event = st.tuples(st.just("count"), st.sampled_from(_COUNTERS), st.integers(0, 1000))
_seconds = st.sampled_from([0.0, 0.0004, 0.001, 0.003, 0.02, 0.07, 1.0, 25.0, 75.0])
_fetch_event = st.tuples(st.just("fetch"), _seconds, _seconds)
_held_event = st.tuples(st.just("held"), _seconds)
_stage_event = st.tuples(st.just("stage"), st.sampled_from(("handover_seconds", "admit_seconds", "resume_seconds",
                                                            "first_step_seconds")), _seconds)
# steps of (TP rank -> events): what each worker records between two snapshots
_event = st.one_of(_path_event, _count_event, _fetch_event, _held_event, _stage_event)
_steps = st.lists(st.lists(st.lists(_event, max_size=6), min_size=1, max_size=3), min_size=1, max_size=5)


def _apply(stats: DCP2DStats, events) -> None:
    for e in events:
        if e[0] == "path":
            _, r, d, nbytes, repl, desc, s = e
            stats.record_path(r, d, nbytes + repl, desc, s, replicated_bytes=repl)
        elif e[0] == "fetch":
            stats.record_fetch(e[1], e[2])
        elif e[0] == "held":
            stats.record_held(e[1])
        elif e[0] == "stage":
            stats.record_stage(e[1], e[2])
        else:
            stats.count(e[1], e[2])


def _step_payloads(steps) -> list[dict]:
    """What vLLM hands the front-end per step: each TP rank's snapshot, through
    pickle (worker -> engine core), aggregated, then as JSON-able data."""
    workers = [DCP2DStats() for _ in range(max(len(s) for s in steps))]
    out = []
    for step in steps:
        snaps = []
        for rank, events in enumerate(step):
            _apply(workers[rank], events)
            snaps.append(pickle.loads(pickle.dumps(workers[rank].clone_and_reset())))
        agg = snaps[0]
        for s in snaps[1:]:
            agg = agg.aggregate(s)
        data = agg.to_dict()
        assert json.loads(json.dumps(data)) == data  # serializable as plain JSON
        out.append(data)
    return out


def _expected(steps):
    """Totals straight from the events: per path (bytes, replicated, descriptors, [seconds]), counters
    (with the fetch timers' lists of seconds)."""
    paths, counters = {}, {**dict.fromkeys(_COUNTERS, 0), **{k: [] for k in _TIMERS}}
    for step in steps:
        for events in step:
            for e in events:
                if e[0] == "path":
                    _, r, d, nbytes, repl, desc, s = e
                    p = paths.setdefault((r, d), [0, 0, 0, []])
                    p[0] += nbytes + repl
                    p[1] += repl
                    p[2] += desc
                    p[3].append(s)
                elif e[0] == "fetch":
                    counters["fetch_seconds"].append(e[1])
                    counters["reported_after_seconds"].append(e[2])
                elif e[0] == "held":
                    counters["held_seconds"].append(e[1])
                elif e[0] == "stage":
                    counters[e[1]].append(e[2])
                else:
                    counters[e[1]] += e[2]
    return paths, counters


@settings(max_examples=60, deadline=None)
@given(_steps)
def test_stats_steps_aggregate_to_the_totals(steps):
    """Snapshots per step and TP rank, aggregated (as vLLM's log interval does), give
    exactly the recorded totals, with every write's seconds in order of the steps."""
    payloads = _step_payloads(steps)
    total = DCP2DStats()
    for data in payloads:
        total.aggregate(DCP2DStats(data=data))
    paths, counters = _expected(steps)
    assert {parse_path_key(k) for k in total.data["paths"]} == set(paths)
    for (r, d), (nbytes, repl, desc, secs) in paths.items():
        p = total.data["paths"][f"{r},{d}"]
        assert (p["transfers"], p["bytes"], p["replicated_bytes"], p["descriptors"]) == (len(secs), nbytes, repl,
                                                                                          desc)
        assert sorted(p["write_seconds"]) == sorted(secs) and p["seconds"] == pytest.approx(sum(secs))
    assert {k: total.data[k] for k in _COUNTERS + _TIMERS} == counters
    r = total.reduce()
    assert r["bytes"] == sum(p[0] for p in paths.values()) and all(r[k] == counters[k] for k in _COUNTERS)


def test_stats_observations_are_bounded():
    a, b = DCP2DStats(), DCP2DStats()
    for i in range(MAX_OBSERVATIONS + 5):
        a.record_path(0, 1, 10, 1, float(i))
    obs = a.data["paths"]["0,1"]["write_seconds"]
    assert obs == [float(i) for i in range(5, MAX_OBSERVATIONS + 5)]  # the newest kept
    b.record_path(0, 1, 10, 1, -1.0)
    a.aggregate(b)
    p = a.data["paths"]["0,1"]
    assert len(p["write_seconds"]) == MAX_OBSERVATIONS and p["write_seconds"][-1] == -1.0
    assert (p["transfers"], p["bytes"]) == (MAX_OBSERVATIONS + 6, 10 * (MAX_OBSERVATIONS + 6))  # sums stay exact


def test_stats_bad_names():
    with pytest.raises(KeyError, match="'stall'.*expected one of"):
        DCP2DStats().count("stall")
    for bad in ("1", "1,2,3", "a,1", "-1,0", ""):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_path_key(bad)


def _prom(dcp_size=2, kv_cache_size_tokens=2176):
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    cfg = NS(kv_transfer_config=None, parallel_config=NS(decode_context_parallel_size=dcp_size),
             cache_config=NS(block_size=32, num_gpu_blocks=34, kv_cache_size_tokens=kv_cache_size_tokens),
             model_config=NS(max_model_len=2048), scheduler_config=NS(max_num_seqs=4))
    engines = {0: ["m", "0"], 1: ["m", "1"]}
    return reg, DCP2DPromMetrics(cfg, types, ["model_name", "engine"], engines)


@pytest.mark.parametrize("dcp_size,tokens,want", [(2, 2176, "2176"), (2, None, str(34 * 32 * 2)),
                                                  (1, None, str(34 * 32))])
def test_instance_info_says_what_a_front_routes_by(dcp_size, tokens, want):
    """``vllm:dcp2d_instance_info`` (what ``vllm-dcp2d proxy`` reads, ``proxy/fit.py``): 1 per
    engine, the DCP size, page, length, KV and sequence limits as labels; the KV capacity is
    vLLM's ``kv_cache_size_tokens`` where set, else blocks x page x DCP size."""
    from vllm_dcp2d.proxy.fit import DecodeInfo, parse_metrics
    from prometheus_client import generate_latest

    reg, _ = _prom(dcp_size, tokens)
    info = {k: v for k, v in _samples(reg).items() if k[0] == "vllm:dcp2d_instance_info"}
    labels = {"dcp_size": str(dcp_size), "block_size": "32", "max_model_len": "2048", "kv_cache_tokens": want,
              "max_num_seqs": "4", "model_name": "m"}
    assert info == {("vllm:dcp2d_instance_info", tuple(sorted({**labels, "engine": e}.items()))): 1.0
                    for e in ("0", "1")}
    assert parse_metrics(generate_latest(reg).decode()) == (DecodeInfo(dcp_size, 32, 2048, int(want), 4), None)


def _samples(reg) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in reg.collect() for s in m.samples}


@settings(max_examples=40, deadline=None)
@given(_steps)
def test_prom_metrics_equal_the_recorded_figures(steps):
    """Each step's payload observed on engine 1: every path counter, the histogram's
    buckets, sum and count, every instance counter and the quarantine gauge equal
    the totals of what the workers recorded; engine 0 stays at 0."""
    reg, prom = _prom()
    for data in _step_payloads(steps):
        prom.observe(data, engine_idx=1)
    got = _samples(reg)
    paths, counters = _expected(steps)

    def val(name, engine="1", **path):
        labels = {"model_name": "m", "engine": engine, **{k: str(v) for k, v in path.items()}}
        return got[(name, tuple(sorted(labels.items())))]

    path_series = {(dict(k)["cp_rank"], dict(k)["dcp_rank"]) for n, k in got if n == "vllm:dcp2d_path_bytes_total"}
    assert path_series == {(str(r), str(d)) for r, d in paths}
    for (r, d), (nbytes, repl, desc, secs) in paths.items():
        at = {"cp_rank": r, "dcp_rank": d, "dcp_size": 2}
        assert val("vllm:dcp2d_path_bytes_total", **at) == nbytes
        assert val("vllm:dcp2d_path_replicated_bytes_total", **at) == repl
        assert val("vllm:dcp2d_path_descriptors_total", **at) == desc
        assert val("vllm:dcp2d_path_transfers_total", **at) == len(secs)
        assert val("vllm:dcp2d_path_write_seconds_count", **at) == len(secs)
        assert val("vllm:dcp2d_path_write_seconds_sum", **at) == pytest.approx(sum(secs))
        for le in WRITE_SECONDS_BUCKETS:
            assert val("vllm:dcp2d_path_write_seconds_bucket", **at, le=float(le)) == sum(s <= le for s in secs)
        assert val("vllm:dcp2d_path_write_seconds_bucket", **at, le="+Inf") == len(secs)
    for m in METRICS:
        if not m.per_path and m.kind == "counter":
            assert val(m.name + "_total") == counters[m.source], m.name
            assert val(m.name + "_total", engine="0") == 0
    assert val("vllm:dcp2d_blocks_in_quarantine") == counters["quarantined"] - counters["lifted"]
    for m in METRICS:
        if not m.per_path and m.kind == "histogram":
            secs = counters[m.source]
            assert val(m.name + "_count") == len(secs) and val(m.name + "_count", engine="0") == 0, m.name
            assert val(m.name + "_sum") == pytest.approx(sum(secs)), m.name
            for le in WRITE_SECONDS_BUCKETS:
                assert val(m.name + "_bucket", le=float(le)) == sum(s <= le for s in secs), (m.name, le)


def test_prom_metrics_exist_from_start_and_reject_bad_data():
    reg, prom = _prom()
    names = {n for n, _ in _samples(reg)}
    for m in METRICS:  # instance metrics exist at 0 before any transfer; path ones come with a path
        assert m.per_path or set(exposed_names(m)) <= names, m.name
    with pytest.raises(ValueError, match="'0-1'"):
        prom.observe({"paths": {"0-1": {}}, **dict.fromkeys(_COUNTERS, 0)})


def test_docs_hold_the_current_table():
    text = (ROOT / "docs/metrics.md").read_text()
    assert markdown_table() in text, "regenerate the table in docs/metrics.md from connector.prom.markdown_table()"


def _exprs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "query", "definition") and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def test_grafana_dashboard_uses_only_documented_metrics():
    """Well-formed JSON; every ``vllm:dcp2d_*`` name in its PromQL is one /metrics
    exposes (test_e2e.py checks the same list against a live instance), and it
    plots the reshard matrix, the write latency and the failures."""
    board = json.loads((ROOT / "docs/grafana/dcp2d.json").read_text())
    exprs = list(_exprs(board["panels"]))
    known = {n for m in METRICS for n in exposed_names(m)}
    used = {n for e in exprs for n in re.findall(r"vllm:dcp2d_[a-z_]+", e)}
    assert used and used <= known, sorted(used - known)
    for must in ("vllm:dcp2d_path_bytes_total", "vllm:dcp2d_path_write_seconds_bucket",
                 "vllm:dcp2d_failed_fetches_total", "vllm:dcp2d_expired_requests_total", "vllm:dcp2d_stalls_total"):
        assert must in used, must
    assert any("histogram_quantile" in e for e in exprs)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} >= {"DS_PROMETHEUS", "model_name"}
