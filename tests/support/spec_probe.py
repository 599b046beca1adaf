"""A vLLM worker extension that lets a test or a benchmark look inside each TP
worker of a speculative-decoding engine, through ``LLM.collective_rpc``:
``LLM(..., worker_extension_cls="tests.support.spec_probe.SpecProbe")``.

Every method runs on every worker and returns plain data:
- ``probe_start(diverge_rank)``: record, per step, each KV cache group's block
  table rows and the tokens this rank commits; on ``diverge_rank`` replace the
  second draft of every request with another token before the step runs, as a
  rank whose drafter went wrong would (vLLM's scheduler hands every rank the
  same drafts, so the test has to inject the difference).
- ``probe_groups()``: each KV cache group's layers, sharding, block table and
  page bytes;
- ``probe_report()``: what was recorded.

It reads vLLM's V1 model runner (0.32, 0.33: the CPU tests); 0.34 has Model Runner V2
only, whose agreement ``tests/spec_decode/test_verify.py`` checks apart from an engine.
"""

from __future__ import annotations

VOCAB = 512  # the tiny models' vocabulary


class SpecProbe:
    def probe_start(self, diverge_rank: int = -1) -> int:
        runner = self.model_runner
        rank = runner.parallel_config.rank
        self._probe = {"rank": rank, "committed": {}, "max_blocks": {}, "diverged_steps": 0}
        probe, cls = self._probe, type(runner)

        def execute_model(scheduler_output, *args, **kwargs):
            spec = scheduler_output.scheduled_spec_decode_tokens
            if rank == diverge_rank and spec:
                scheduler_output.scheduled_spec_decode_tokens = {
                    rid: [t if i != 1 else (t + 1) % VOCAB for i, t in enumerate(toks)]
                    for rid, toks in spec.items()}
                probe["diverged_steps"] += 1
            out = cls.execute_model(runner, scheduler_output, *args, **kwargs)
            for gid, table in enumerate(runner.input_batch.block_table.block_tables):
                n = int(table.num_blocks_per_row.max()) if len(table.num_blocks_per_row) else 0
                probe["max_blocks"][str(gid)] = max(probe["max_blocks"].get(str(gid), 0), n)
            return out

        def _sample(logits, spec_decode_metadata):
            out = cls._sample(runner, logits, spec_decode_metadata)
            ids = out.sampled_token_ids.tolist()
            for req_id, row in zip(runner.input_batch.req_ids, ids):
                probe["committed"].setdefault(req_id, []).extend(t for t in row if t >= 0)
            return out

        runner.execute_model = execute_model
        runner._sample = _sample
        return rank

    def probe_groups(self) -> list[dict]:
        runner = self.model_runner
        groups = runner.kv_cache_config.kv_cache_groups
        tables = runner.input_batch.block_table.block_tables
        draft = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
        return [{"layers": list(g.layer_names), "draft_layers": len(draft & set(g.layer_names)), "dcp_sharded": bool(g.kv_cache_spec.dcp_sharded),
                 "block_size": g.kv_cache_spec.block_size, "table_dcp": t.dcp_world_size,
                 "table_width": t.max_num_blocks_per_req, "page_bytes": g.kv_cache_spec.page_size_bytes}
                for g, t in zip(groups, tables)]

    def probe_report(self) -> dict:
        return self._probe


def committed_equal(reports: list[dict]) -> bool:
    """Whether every rank committed the same tokens for every request."""
    return all(r["committed"] == reports[0]["committed"] for r in reports[1:])


__all__ = ["SpecProbe", "committed_equal"]
