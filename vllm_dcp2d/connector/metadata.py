"""What the connector's two halves tell each other every engine step.

vLLM builds the connector once in the engine core (``scheduler.SchedulerSide``)
and once per worker (``connector.DCP2DConnector`` driving the worker's roles). They
never share memory: the scheduler side hands ``DCP2DMetadata`` to every worker with each step's
``SchedulerOutput``, and every worker hands ``DCP2DWorkerMeta`` back in its
``KVConnectorOutput`` (vLLM aggregates it over the TP ranks). This module is
that contract; neither side imports the other.

The words both sides use (transfer key, fetch, release, quarantine, lifted, preempted)
are docs/connector.md's glossary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_dcp2d.vllm_compat import connector_api as compat

__all__ = ["SendSpec", "FetchSpec", "ReleaseSpec", "DCP2DMetadata", "DCP2DWorkerMeta"]


@dataclass
class SendSpec:
    """A producer request's KV: ``block_ids``, one list per KV cache group, each
    int ``[cdiv(num_tokens, page_size)]``.

    transfer_key: the id decode ranks fetch it by (``kv_transfer_params["remote_request_id"]``): the client's
    ``"transfer_id"`` when it gave one, so a router can send the decode request
    before the prefill finished (layer pipelining), else vLLM's request id.
    finished_at: ``time.monotonic()`` of ``request_finished`` in the engine core (0: not
    finished yet); workers on the same host time the handover from it.
    prompt_digest: ``messages.prompt_digest`` of its prompt: decode ranks must name it.
    """

    block_ids: tuple[list[int], ...]
    num_tokens: int
    transfer_key: str
    finished_at: float = 0.0
    prompt_digest: str = ""


@dataclass
class FetchSpec:
    """What a consumer worker fetches for one request (a **fetch**, docs/connector.md).

    transfer_key:      what the producer knows the request by (``kv_transfer_params["remote_request_id"]``).
    bootstrap_addr:    producer's bootstrap server, "tcp://host:port".
    remote_engine_id:  producer's engine id; the fetch fails if the bootstrap's rank
                       table names another (the prefill restarted on that address).
    block_ids:         the request's block tables on this instance, one list per KV
                       cache group (in a DCP-sharded group one block per ``dcp_size``
                       pages, in a replicated one a block per page).
    first_page:        first page to fetch (earlier ones are cached locally).
    num_tokens:        prompt tokens of the request here; each prefill rank must hold as many.
    remote_num_tokens: what the producer said it computed (``kv_transfer_params``), None if absent.
    transfer_timeout_s: deadline of the fetch (``params.fetch_params``).
    prompt_digest:     ``messages.prompt_digest`` of the prompt here; the producer refuses another.
    refused:           why the request's ``kv_transfer_params`` were refused ("" if they were
                       not): the worker reports the fetch failed, so ``kv_load_failure_policy``
                       ends or recomputes the request at once.
    """

    transfer_key: str
    bootstrap_addr: str
    remote_engine_id: str
    block_ids: tuple[list[int], ...]
    first_page: int
    num_tokens: int
    remote_num_tokens: int | None
    transfer_timeout_s: float
    prompt_digest: str = ""
    refused: str = ""


@dataclass
class ReleaseSpec:
    """A producer request this consumer will never fetch: ``transfer_key``
    (``kv_transfer_params["remote_request_id"]``) of ``num_tokens`` prompt tokens at ``bootstrap_addr``, of
    the producer ``remote_engine_id`` (None: the params named none; the release then
    goes to whichever instance serves that address); ``prompt_digest`` of its prompt
    (the producer ignores a release that does not name it)."""

    transfer_key: str
    bootstrap_addr: str
    num_tokens: int
    remote_engine_id: str | None = None
    prompt_digest: str = ""


@dataclass
class DCP2DMetadata(compat.KVConnectorMetadata):
    """Scheduler -> workers, once per step (request id -> spec in every dict).

    fetches:   consumer requests to fetch.
    releases:  consumer requests that will never be fetched (tell the producer).
    computing: producer requests whose prompt completes in this step: each layer
               goes to the fetches already waiting right after it is computed.
    ready:     producer requests that finished: serve them to every decode rank.
    aborted:   transfer key of producer requests aborted after their prompt
               completed; their blocks are kept until no layer write reads them.
    dropped:   transfer key of producer requests that ended without blocks to
               keep (aborted before their prompt completed, or while preempted):
               fail the fetches waiting for them now.
    preempted: transfer key of producer requests vLLM preempted after their prompt
               completed (``handle_preemptions``, before this step's forward).
    context_blocks: sorted ids of the blocks that hold the scheduled requests' tokens
               computed before this step (producer with layer-split storage: the
               owners broadcast them; else None).
    bell:      consumer: the scheduler's ``StepBell`` address; workers ring it when
               a fetch ends, to end an idle step's sleep (``step_bell``). "" = none.
    first_run: consumer requests this step runs for the first time on their fetched
               KV; workers echo them back with the step's output (``timeline``).
    """

    fetches: dict[str, FetchSpec] = field(default_factory=dict)
    releases: dict[str, ReleaseSpec] = field(default_factory=dict)
    computing: dict[str, SendSpec] = field(default_factory=dict)
    ready: dict[str, SendSpec] = field(default_factory=dict)
    aborted: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    preempted: dict[str, str] = field(default_factory=dict)
    context_blocks: list[int] | None = None
    bell: str = ""
    first_run: list[str] = field(default_factory=list)


@dataclass
class DCP2DWorkerMeta(compat.KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step (vLLM aggregates it over TP ranks).

    quarantine: ``(request id, tp rank) -> block ids`` to keep out of the free queue.
    lifted:     ``(request id, tp rank)`` quarantines that ended.
    ran:        the step's ``DCP2DMetadata.first_run``, echoed: their first step is done.
    failed_fetches: requests whose fetch failed on this rank (block-level load errors
                included), whichever step their last rank reports them in.
    """

    quarantine: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    lifted: set[tuple[str, int]] = field(default_factory=set)
    ran: set[str] = field(default_factory=set)
    failed_fetches: set[str] = field(default_factory=set)

    def aggregate(self, other: DCP2DWorkerMeta) -> DCP2DWorkerMeta:
        return DCP2DWorkerMeta({**self.quarantine, **other.quarantine}, self.lifted | other.lifted,
                               self.ran | other.ran, self.failed_fetches | other.failed_fetches)
