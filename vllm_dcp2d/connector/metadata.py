"""What crosses the connector's boundaries: a request's ``kv_transfer_params`` on the
way in, checked, and what the connector's two halves tell each other every engine step.

vLLM builds the connector once in the engine core (``scheduler.SchedulerSide``)
and once per worker (``connector.DCP2DConnector`` driving the worker's roles). They
never share memory: the scheduler side hands ``DCP2DMetadata`` to every worker with each step's
``SchedulerOutput``, and every worker hands ``DCP2DWorkerMeta`` back in its
``KVConnectorOutput`` (vLLM aggregates it over the TP ranks). This module is
that contract; neither side imports the other.

The words both sides use (transfer key, fetch, release, quarantine, lifted, preempted)
are docs/connector.md's glossary.

``kv_transfer_params`` come from the client (or a router, or the prefill's answer copied
verbatim), so nothing in them is trusted: the scheduler side turns a consumer request's
into a ``FetchSpec`` here (``fetch_params``), or into the reason it prefills the request
locally instead. Workers only ever see a spec that passed. The limits are the wire's
(``messages``): a key or engine id the wire would refuse is refused here, by name.

The scheduler side's maps of transfer keys live here too, one per key space: a side's
sends (``TransferKeys``) and a decode's fetches with their siblings (``Siblings``).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm_dcp2d.config import DCP2DConfig
from vllm_dcp2d.transfer.messages import MAX_NAME, clip, prompt_digest
from vllm_dcp2d.vllm_compat import connector_api as compat

__all__ = ["SendSpec", "FetchSpec", "ReleaseSpec", "DCP2DMetadata", "DCP2DWorkerMeta",
           "REQUIRED", "KEY_FIELD", "CLIENT_KEY_FIELD", "KEY_FIELDS", "key_field", "key_of", "TransferKeys", "Siblings",
           "bootstrap_addr", "check_bootstrap_addr", "fetch_params", "transfer_timeout_s", "flag"]


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
    transfer_timeout_s: deadline of the fetch (``fetch_params``).
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


# ---- kv_transfer_params, checked at the boundary ----

# The transfer key travels in two kv_transfer_params fields whose names others chose (the
# only places those names appear): "remote_request_id", the prefill's answer (vLLM's NIXL
# convention), copied by our proxy and by vLLM's router; or, failing that, "transfer_id",
# what a Mooncake-style router gives both sides (the prefill keys the request by it too).
REQUIRED = ("remote_bootstrap_addr", "remote_engine_id")
KEY_FIELD = "remote_request_id"
CLIENT_KEY_FIELD = "transfer_id"
KEY_FIELDS = (KEY_FIELD, CLIENT_KEY_FIELD)
_ADDR = re.compile(r"(?P<scheme>tcp|http)://(?P<host>[A-Za-z0-9._\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})/?")


def check_bootstrap_addr(addr) -> str:
    """``addr`` if it is ``tcp://host:port`` (the ZMQ bootstrap, as the prefill answers) or
    ``http://host:port`` (its HTTP bootstrap, as Mooncake-style routers build it), with a
    port in [1, 65535]; raises ValueError naming the value and the forms expected."""
    m = _ADDR.fullmatch(addr) if isinstance(addr, str) else None
    if m is None or not 1 <= int(m["port"]) <= 65535 or (m["scheme"] == "tcp" and addr.endswith("/")):
        raise ValueError(f"remote_bootstrap_addr = {clip(repr(addr), 80)}: expected 'tcp://<host>:<port>' or "
                         f"'http://<host>:<port>' with a port in [1, 65535]")
    return addr.rstrip("/")


def bootstrap_addr(cfg: DCP2DConfig) -> str:
    """The producer's bootstrap address, as it answers it (``remote_bootstrap_addr``) and
    as its ranks register with it."""
    return f"tcp://{cfg.bootstrap_host}:{cfg.bootstrap_port}"


def flag(params: dict, name: str) -> tuple[bool, str]:
    """The boolean field ``name`` of ``params`` (``"do_remote_prefill"``, ``"do_remote_decode"``)
    as ``(asked, refused)``: ``(False, "")`` when absent, null or false, ``(True, "")`` when
    true; any other value asks too, and is refused: ``(True, reason)``, naming the field,
    the value and a JSON boolean. Python's truth is never asked: ``"false"`` is true there."""
    v = params.get(name)
    if v is None or type(v) is bool:
        return bool(v), ""
    return True, (f"kv_transfer_params[{name!r}] = {clip(repr(v), 80)}: expected a JSON boolean (true or false), "
                  f"got {type(v).__name__}")


def key_field(params: dict) -> str:
    """The field of ``params`` that carries the transfer key (the first of ``KEY_FIELDS`` present)."""
    return KEY_FIELD if KEY_FIELD in params else CLIENT_KEY_FIELD


def key_of(params: dict):
    """What ``params`` give as the transfer key (``key_field``), unchecked: None if absent."""
    return params.get(key_field(params))


class TransferKeys:
    """Transfer key <-> request id, for the requests one side moves now; one map per key
    space and process, and no other: the scheduler's sends (``SchedulerSide.keys``) and
    fetches (``Siblings.fetching``; separate, as a kv_both instance may fetch a key it
    sends), a producer worker's sends (``ProducerWorker.keys``); a consumer worker keeps
    none (``Fetch.tag``). A key has at most one owner: ``bind`` moves it, and ``unbind`` of
    a request that no longer owns its key leaves the new owner's binding alone.
    Single-threaded (each owner's thread)."""

    def __init__(self):
        self._key: dict[str, str] = {}    # request id -> transfer key
        self._owner: dict[str, str] = {}  # transfer key -> request id

    def bind(self, req_id: str, key: str) -> None:
        """``req_id`` is moved by ``key`` from now on (and owns it; its former key is let go)."""
        self.unbind(req_id)
        self._key[req_id] = key
        self._owner[key] = req_id

    def key(self, req_id: str, default: str | None = None) -> str | None:
        return self._key.get(req_id, default)

    def owner(self, key: str, default: str | None = None) -> str | None:
        """The request that owns ``key`` now."""
        return self._owner.get(key, default)

    def unbind(self, req_id: str) -> str | None:
        """Forget ``req_id``; returns its key (None: it had none)."""
        key = self._key.pop(req_id, None)
        if key is not None and self._owner.get(key) == req_id:
            del self._owner[key]
        return key

    def __len__(self) -> int:
        return len(self._key)


MAX_ENDED = 4096  # keys remembered after their fetch ended (a sibling may arrive late)
ENDED_TTL_S = 600.0  # ... for this long: siblings arrive within one request's lifetime
MAX_DIGESTS = 65536  # prompt digests of requests not admitted yet (a backstop: the oldest is computed again)


class Siblings:
    """Decode requests that carry one transfer key: which one fetches, and who the others wait for.

    vLLM fans one HTTP request out into several engine requests (``n > 1``, a batch of
    prompts), and each carries the HTTP request's ``kv_transfer_params``: one transfer
    key, the KV of one prompt. Only the first of them to be admitted fetches it; a sibling
    never fetches a key again (the prefill frees a request once it is fetched). A sibling
    with the same prompt waits while the fetch is in flight, then prefills locally, where
    vLLM's prefix cache hands it the fetched pages; a sibling with another prompt (a batch
    whose front sent one answer's params to all) prefills locally at once.

    Runs in the scheduler (``scheduler.SchedulerSide``), so no locks: every call comes from
    the engine-core thread. vLLM asks about a waiting request every step it waits
    (``get_num_new_matched_tokens``), so its prompt's digest is computed once and kept
    until it is admitted or finished.
    """

    def __init__(self, max_ended: int = MAX_ENDED, ttl_s: float = ENDED_TTL_S, clock=time.monotonic):
        self.fetching = TransferKeys()  # request <-> the key it fetches now
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (request, when it ended)
        self._max_ended, self._ttl_s, self._clock = max_ended, ttl_s, clock
        self._digests: dict[str, str] = {}  # request not admitted yet -> its prompt's digest

    def verdict(self, request, params: dict, digest: bool = True) -> bool | None:
        """None: ``request`` (with its ``kv_transfer_params``) may fetch its key. True: a
        sibling with its prompt fetches it now (wait, then reuse its pages through the
        prefix cache). False: prefill locally (the key's fetch ended, or, with ``digest``,
        its KV is another prompt's)."""
        key = key_of(params)
        remote = params.get("remote_prompt_digest")
        if digest and isinstance(remote, str) and remote and remote != self.prompt_digest(request):
            return False  # a batch answered with one prompt's params: the KV is another prompt's
        if not isinstance(key, str):
            return None
        holder = self.fetcher(key)
        if holder is not None and holder != request.request_id:
            return True
        ended = self.ended(key)
        return False if ended is not None and ended != request.request_id else None

    def prompt_digest(self, request) -> str:
        """``messages.prompt_digest`` of ``request``'s prompt, computed once until ``admitted``."""
        digest = self._digests.get(request.request_id)
        if digest is None:
            if len(self._digests) >= MAX_DIGESTS:
                del self._digests[next(iter(self._digests))]
            digest = self._digests[request.request_id] = prompt_digest(**compat.prompt_inputs(request))
        return digest

    def admitted(self, req_id: str) -> None:
        """``req_id`` was admitted (or finished): vLLM asks no more about it."""
        self._digests.pop(req_id, None)

    def fetcher(self, key: str) -> str | None:
        """The request fetching ``key`` now, if any."""
        return self.fetching.owner(key)

    def ended(self, key: str) -> str | None:
        """The request whose fetch of ``key`` ended within ``ttl_s``, if any."""
        self._expire()
        hit = self._ended.get(key)
        return None if hit is None else hit[0]

    def start(self, key: str, req_id: str) -> None:
        """``req_id`` fetches ``key`` (the caller checked that nobody else does)."""
        self.fetching.bind(req_id, key)

    def end(self, req_id: str) -> None:
        """``req_id``'s fetch ended (ok, failed, or the request finished); no-op if it had none."""
        owned = self.fetching.owner(self.fetching.key(req_id, ""))
        key = self.fetching.unbind(req_id)
        if key is None or owned != req_id:
            return
        self._ended[key] = (req_id, self._clock())
        self._ended.move_to_end(key)
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    def _expire(self) -> None:
        now = self._clock()
        while self._ended:
            key, (_, t) = next(iter(self._ended.items()))
            if now - t <= self._ttl_s:
                return
            del self._ended[key]

    def __len__(self) -> int:
        return len(self.fetching) + len(self._ended)


def _name(params: dict, key: str) -> str:
    v = params[key]
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_NAME:
        shown = v if not isinstance(v, str) or len(v) <= 40 else v[:40] + "..."
        raise ValueError(f"{key} = {shown!r}: expected a string of 1..{MAX_NAME} characters"
                         + (f" (got {len(v)})" if isinstance(v, str) else f" (got {type(v).__name__})"))
    return v


def transfer_timeout_s(params: dict, cfg: DCP2DConfig) -> tuple[float, str]:
    """The fetch deadline a request asks for, within ``max_transfer_timeout_s``:
    ``(seconds, warning or "")``."""
    v = params.get("transfer_timeout_s", cfg.transfer_timeout_s)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        return cfg.transfer_timeout_s, (f"kv_transfer_params['transfer_timeout_s'] = {v!r} is not seconds > 0; "
                                        f"using transfer_timeout_s = {cfg.transfer_timeout_s}")
    if v > cfg.max_transfer_timeout_s:
        return cfg.max_transfer_timeout_s, (f"kv_transfer_params['transfer_timeout_s'] = {v!r} exceeds "
                                            f"max_transfer_timeout_s; using {cfg.max_transfer_timeout_s}")
    return float(v), ""


def fetch_params(params: dict, cfg: DCP2DConfig, *, block_ids: tuple[list[int], ...], num_tokens: int,
                first_page: int, prompt_digest: str = "") -> tuple[FetchSpec, str]:
    """A ``FetchSpec`` from a consumer request's ``params`` plus what the scheduler
    allocated, and a warning ("" if none). Raises ValueError naming the first bad
    field: the request is then prefilled locally."""
    missing = ([" or ".join(KEY_FIELDS)] if not set(KEY_FIELDS) & set(params) else []) + [k for k in REQUIRED if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params lack {missing} (got {clip(repr(sorted(map(str, params))), 200)})")
    key = _name(params, key_field(params))
    engine = _name(params, "remote_engine_id")
    addr = check_bootstrap_addr(params["remote_bootstrap_addr"])
    timeout, warning = transfer_timeout_s(params, cfg)
    remote = params.get("remote_num_tokens")
    if remote is not None and (type(remote) is not int or remote < 0):
        raise ValueError(f"remote_num_tokens = {clip(repr(remote), 40)}: expected an int >= 0 (the prefill's "
                         f"prompt length)")
    return FetchSpec(transfer_key=key, bootstrap_addr=addr, remote_engine_id=engine, block_ids=block_ids,
                    first_page=first_page, num_tokens=num_tokens, transfer_timeout_s=timeout, remote_num_tokens=remote,
                    prompt_digest=prompt_digest), warning
