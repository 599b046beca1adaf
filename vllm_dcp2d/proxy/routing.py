"""Which decode (and prefill) serves a PD pair: decode groups by DCP size, session
affinity, load (no I/O; ``app`` calls it, ``upstreams`` keeps what it reads).

**Decode groups.** Decodes with the same DCP size form a group (learnt from each
instance: ``capacity.DecodeInfo``). A request goes to the group of the smallest DCP
size that fits it with room (``fit``: admitted there, a free sequence slot,
its KV under ``kv_fraction`` of the free KV): a DCP=1 step is the cheapest (no
all-gather, no merge), a larger DCP size holds longer requests. Within the group,
the decode with the fewest calls in flight, ties round-robin (``upstreams.Pool``).
If no decode of that group has room, a larger group that has (``fallback``); if
none has, the fitting decode with the most free KV (``full``: vLLM queues it
there). A request whose whole answer fits no decode goes to the decodes of the
longest ``max_model_len`` that admit it (``fit``: vLLM clamps its
``max_tokens`` there, as a colocated instance of that length would). A request no
decode admits: with the client's token ids, ``TooLong`` before the prefill computes
anything (the client's 400, naming the longest context served); once the prefill
has run (a text prompt's length comes from its answer), the decode of the longest
context (``too_long``), whose own 400 names that length and whose connector
releases the prefill's blocks at once (a 400 from the proxy would leave them
held until ``claim_timeout_s``). ``NoHealthyUpstream`` when only decodes out of
rotation admit it. Decodes that did not say what they are (no
``vllm:dcp2d_instance_info`` yet) take a request no known decode admits, or one
whose length is unknown.

**Affinity** (``affinity``): a request whose prompt starts with one the proxy sent
somewhere goes to the same decode when that decode is in rotation, fits it with
room, and has at most ``slack`` calls in flight more than the least loaded decode
that fits it with room (``hit``); otherwise where the rules above say (``move``,
and the new place is remembered). No remembered prefix: ``miss``. A decode that
dies thus loses only its own sessions: each moves once, and sticks to its new
decode. The prefill of the remembered place is preferred the same way (its prefix
cache spares the history's recompute) when the keys are known before the prefill
hop: a token-id prompt, or the client's ``session_id``/``user``.

**Unknown length.** ``--pipelined`` sends the decode call before the prefill
answers, so a text prompt's length is not known: it goes to the decodes with the
longest ``max_model_len`` (nothing another decode admits is refused there), least
loaded, by its session key only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .affinity import Affinity, Keys, Place, PrefixHasher, session_key
from .fit import Need, free_tokens
from .upstreams import NoHealthyUpstream, Pool, Upstream

DEFAULT_PAGE = 16  # affinity page before any decode said its page size (vLLM's default block size)
REASONS = ("fits", "fallback", "full", "affinity", "unknown", "too_long")


class TooLong(Exception):
    """No decode fits the request (the client gets 400)."""


@dataclass(frozen=True)
class Policy:
    """``kv_fraction``: share of a decode's free KV a request may take and still count as
    fitting with room. ``affinity_entries``: LRU capacity (0 turns affinity off).
    ``affinity_match``: share of the prompt a remembered prefix must cover. ``slack``:
    calls in flight an affine decode (or prefill) may have above the least loaded one."""

    kv_fraction: float = 0.9
    affinity_entries: int = 65536
    affinity_match: float = 0.5
    slack: int = 4

    def __post_init__(self):
        if not 0.0 < self.kv_fraction <= 1.0:
            raise ValueError(f"kv fraction must be in (0, 1], got {self.kv_fraction}")
        if self.affinity_entries < 0:
            raise ValueError(f"affinity entries must be >= 0, got {self.affinity_entries}")
        if self.slack < 0:
            raise ValueError(f"affinity slack must be >= 0 calls, got {self.slack}")


@dataclass
class Plan:
    """One PD pair's routing state, filled in as the pair goes: the client ``body``, its
    ``need`` and affinity ``keys`` once known, the prefill and decode picked, the KV tokens
    reserved on the decode while its call runs."""

    body: dict
    need: Need | None = None
    keys: Keys | None = None
    prefill: Upstream | None = None
    decode: Upstream | None = None
    session: int | None = None
    reserved: int = 0
    ids: list | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Decision:
    """A decode pick: ``upstream``, the routing ``reason`` (one of ``REASONS``), the affinity
    outcome (``hit``, ``move``, ``miss``; None: affinity off or no keys)."""

    upstream: Upstream
    reason: str
    affinity: str | None


class Router:
    def __init__(self, prefill: Pool, decode: Pool, policy: Policy = Policy()):
        self.prefill_pool, self.decode_pool, self.policy = prefill, decode, policy
        self.affinity = Affinity(policy.affinity_entries, policy.affinity_match) if policy.affinity_entries else None
        self._hasher: PrefixHasher | None = None

    # ---- what a request is -------------------------------------------------------------------

    @property
    def hasher(self) -> PrefixHasher:
        """Pages of the decodes' size (the smallest said), fixed at first use: keys hashed under
        another page size would never match."""
        if self._hasher is None:
            pages = [u.info.block_size for u in self.decode_pool.upstreams if u.info is not None]
            self._hasher = PrefixHasher(min(pages) if pages else DEFAULT_PAGE)
        return self._hasher

    def plan(self, body: dict, client_ids: list | None) -> Plan:
        """A new pair's plan; with the client's token ids its need and keys are known now, and
        a prompt no decode fits is refused before the prefill computes it (``TooLong``)."""
        plan = Plan(body, session=session_key(body) if self.affinity is not None else None)
        if client_ids is not None:
            self.learn(plan, len(client_ids), client_ids)
            self.check_fits(plan)
        elif plan.session is not None:
            plan.keys = Keys(plan.session, [], 1, 0)
        return plan

    def learn(self, plan: Plan, prompt_tokens: int, ids: list | None) -> None:
        """The prompt's exact length (and token ids, if known) for ``plan``."""
        plan.need = Need.of(plan.body, prompt_tokens)
        if self.affinity is None:
            return
        try:
            prefix = self.hasher.keys(ids) if ids is not None else []
        except (ValueError, TypeError, OverflowError):  # not integer ids: no prefix keys
            prefix = []
        plan.keys = Keys(plan.session, prefix, self.hasher.page, prompt_tokens)

    def learn_answer(self, plan: Plan, answer: dict) -> None:
        """The prompt's length and token ids from the prefill's answer (``usage.prompt_tokens``;
        ``prompt_token_ids``, top-level in chat answers, in the choice in completions: the
        prefill hop asks for them, ``hops.PREFILL_HOP``). Ids that disagree with the count are
        not used; no count at all leaves the length unknown."""
        if plan.need is not None or not isinstance(answer, dict):
            return  # known from the client's own token ids
        usage = answer.get("usage")
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        ids = answer.get("prompt_token_ids")
        choices = answer.get("choices")
        if ids is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
        ids = ids if isinstance(ids, list) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            n = len(ids) if ids is not None else None
        if n is None:
            return
        self.learn(plan, n, ids if ids is not None and len(ids) == n else None)

    def check_fits(self, plan: Plan) -> None:
        """``TooLong`` if every decode said what it is and none admits ``plan.need``."""
        ups = self.decode_pool.upstreams
        if plan.need is None or any(u.info is None for u in ups) or any(plan.need.admitted(u.info) for u in ups):
            return
        longest = max(ups, key=lambda u: u.info.max_model_len)
        n = plan.need
        raise TooLong(f"no decode admits this request: its prompt is {n.prompt} tokens (max_tokens "
                      f"{n.max_tokens}); the longest context served is {longest.info.max_model_len} tokens "
                      f"(DCP={longest.info.dcp_size}, {longest.url})")

    # ---- picks -------------------------------------------------------------------------------

    def pick_prefill(self, plan: Plan, exclude=()) -> Upstream:
        """The remembered prefill of ``plan``'s keys (known before the prefill hop only for a
        token-id prompt or a named session) if in rotation and within ``slack`` calls of the
        least loaded, else the least loaded."""
        pool = self.prefill_pool
        place = self._remembered(plan)
        ok = [u for u in pool.upstreams if u.healthy and u not in exclude]
        if place is not None and place.prefill is not None and ok:
            least = min(u.outstanding for u in ok)
            for u in ok:
                if u.url == place.prefill and u.outstanding <= least + self.policy.slack:
                    plan.prefill = u
                    return u
        plan.prefill = pool.pick(exclude)
        return plan.prefill

    def pick_decode(self, plan: Plan, exclude=()) -> Decision:
        """The decode for ``plan`` (see the module doc); remembers it for the plan's keys."""
        pool, need = self.decode_pool, plan.need
        ok = [u for u in pool.upstreams if u.healthy and u not in exclude]
        if not ok:
            pool.pick(exclude)  # raises NoHealthyUpstream naming every instance's state
        place = self._remembered(plan)
        if need is None:
            known = [u for u in ok if u.info is not None]
            longest = max((u.info.max_model_len for u in known), default=None)
            among = [u for u in ok if u.info is None or u.info.max_model_len == longest]
            up = self._affine(place, among, among) or pool.pick(exclude, among)
            return self._decided(plan, up, "affinity" if up.url == getattr(place, "decode", None) else "unknown",
                                 place)
        fitting = [u for u in ok if u.info is not None and need.fits(u.info)]
        if not fitting:  # the decodes of the longest max_model_len that admit it (clamped there)
            admitted = [u for u in ok if u.info is not None and need.admitted(u.info)]
            longest = max((u.info.max_model_len for u in admitted), default=None)
            fitting = [u for u in admitted if u.info.max_model_len == longest]
        if not fitting:
            unknown = [u for u in ok if u.info is None]
            if unknown:
                return self._decided(plan, pool.pick(exclude, unknown), "unknown", place)
            if any(u.info is not None and need.admitted(u.info) for u in pool.upstreams):
                raise NoHealthyUpstream("decode", f"none in rotation admits a {need.prompt}-token prompt; "
                                        + ", ".join(f"{u.url} ({u.reason or 'tried already'})"
                                                    for u in pool.upstreams if u.info and need.admitted(u.info)))
            longest = max(u.info.max_model_len for u in ok)  # its 400 names it; it releases the prefill's KV
            return self._decided(plan, pool.pick(exclude, [u for u in ok if u.info.max_model_len == longest]),
                                 "too_long", place)
        roomy = [u for u in fitting if self._room(u, need) >= 0]
        up = self._affine(place, fitting, roomy)
        if up is not None:
            return self._decided(plan, up, "affinity", place)
        if roomy:
            dcp = min(u.info.dcp_size for u in roomy)
            group = [u for u in roomy if u.info.dcp_size == dcp]
            reason = "fits" if dcp == min(u.info.dcp_size for u in fitting) else "fallback"
            return self._decided(plan, pool.pick(exclude, group), reason, place)
        most = max(self._room(u, need) for u in fitting)
        return self._decided(plan, pool.pick(exclude, [u for u in fitting if self._room(u, need) == most]),
                             "full", place)

    def release(self, plan: Plan) -> None:
        """The plan's decode call ended: its KV reservation goes."""
        if plan.decode is not None:
            plan.decode.in_flight_tokens -= plan.reserved
            plan.decode, plan.reserved = None, 0

    # ---- internals -------------------------------------------------------------------------------

    def _remembered(self, plan: Plan) -> Place | None:
        if self.affinity is None or plan.keys is None:
            return None
        return self.affinity.lookup(plan.keys)

    def _room(self, u: Upstream, need: Need) -> float:
        """KV tokens left after ``need`` within ``kv_fraction`` of ``u``'s free KV; -1 without a
        free sequence slot."""
        if u.outstanding >= u.info.max_num_seqs:
            return -1.0
        free = free_tokens(u.info, u.kv_usage, u.in_flight_tokens, u.in_flight_at_poll)
        return self.policy.kv_fraction * free - need.kv_tokens(u.info)

    def _affine(self, place: Place | None, candidates: list[Upstream], roomy: list[Upstream]) -> Upstream | None:
        """The remembered decode if it is among ``candidates`` (healthy, fits), has room (or no
        candidate has) and is not more than ``slack`` calls above the least loaded with room."""
        if place is None:
            return None
        up = next((u for u in candidates if u.url == place.decode), None)
        if up is None or (roomy and up not in roomy):
            return None
        least = min(u.outstanding for u in (roomy or candidates))
        return up if up.outstanding <= least + self.policy.slack else None

    def _decided(self, plan: Plan, up: Upstream, reason: str, place: Place | None) -> Decision:
        self.release(plan)  # a retry's earlier pick
        plan.decode = up
        if plan.need is not None and up.info is not None:
            plan.reserved = plan.need.kv_tokens(up.info)
            up.in_flight_tokens += plan.reserved
        outcome = None
        if self.affinity is not None and plan.keys is not None:
            outcome = "miss" if place is None else "hit" if place.decode == up.url else "move"
            prefill = plan.prefill.url if plan.prefill is not None else getattr(place, "prefill", None)
            self.affinity.record(plan.keys, Place(up.url, prefill))
        return Decision(up, reason, outcome)
