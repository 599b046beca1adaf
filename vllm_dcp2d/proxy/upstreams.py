"""Upstream instances of one kind (prefill or decode): least-outstanding-requests
balancing and health state. No I/O here except ``HealthChecker``'s polls.

Each poll of a decode that answers ``/health`` also reads its ``/metrics`` (at most
``capacity.MAX_METRICS_BYTES``, within the same timeout) for what it is and how full
its KV is (``capacity.parse_metrics``); a decode that does not say keeps what it said
last. With health checks off, the decodes are read once when the proxy starts.

An instance is *in rotation* while it is healthy. It leaves rotation when a
``/health`` poll fails (non-200, connection error, or no answer within the
timeout) or when a request could not reach it (``mark_down``, only while health
checks run, since only a poll puts it back); the next successful poll puts it
back. With health checks off (``interval_s <= 0``) every instance stays in
rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from .fit import MAX_METRICS_BYTES, DecodeInfo, parse_metrics

log = logging.getLogger("vllm_dcp2d.proxy")

KINDS = ("prefill", "decode")


class NoHealthyUpstream(Exception):
    """Every instance of ``kind`` is out of rotation (or was tried already)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"no healthy {kind} instance: {detail}")
        self.kind = kind


@dataclass(eq=False)
class Upstream:
    """One ``vllm serve`` instance; ``outstanding`` counts the proxy's calls to it now. A decode's
    ``info`` and ``kv_usage`` are what it said at the last poll (None: not yet);
    ``in_flight_tokens``, the KV tokens the proxy's calls to it now may hold (``routing``),
    ``in_flight_at_poll`` what they were when ``kv_usage`` was read."""

    kind: str
    url: str
    healthy: bool = True
    outstanding: int = 0
    reason: str = ""  # why it is out of rotation ("" while healthy)
    info: DecodeInfo | None = None
    kv_usage: float | None = None
    in_flight_tokens: int = 0
    in_flight_at_poll: int = 0  # in_flight_tokens when kv_usage was read

    def __repr__(self) -> str:
        return f"{self.kind} {self.url}"


class Pool:
    """The instances of one kind. ``pick`` takes the healthy instance with the fewest
    outstanding calls; ties go round-robin (the first tied instance at or after a
    cursor that moves past each pick), so equal load alternates deterministically."""

    def __init__(self, kind: str, urls: list[str]):
        if kind not in KINDS:
            raise ValueError(f"upstream kind must be one of {KINDS}, got {kind!r}")
        if not urls:
            raise ValueError(f"need at least one {kind} URL, got none")
        clean = []
        for u in urls:
            parts = urlsplit(u)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"{kind} URL {u!r} is not an http(s)://host:port base URL")
            clean.append(u.rstrip("/"))
        if len(set(clean)) != len(clean):
            raise ValueError(f"{kind} URLs must be distinct, got {clean}")
        self.kind = kind
        self.upstreams = [Upstream(kind, u) for u in clean]
        self._cursor = 0

    @property
    def urls(self) -> list[str]:
        return [u.url for u in self.upstreams]

    def pick(self, exclude: tuple | list = (), among: list | None = None) -> Upstream:
        """The instance for the next call, of ``among`` (default: all); raises
        ``NoHealthyUpstream`` if none is in rotation outside ``exclude`` (instances a request
        tried already)."""
        ok = [u for u in (self.upstreams if among is None else among) if u.healthy and u not in exclude]
        if not ok:
            down = ", ".join(f"{u.url} ({u.reason or 'tried already'})" for u in self.upstreams)
            raise NoHealthyUpstream(self.kind, down)
        low = min(u.outstanding for u in ok)
        n = len(self.upstreams)
        for i in range(n):
            j = (self._cursor + i) % n
            u = self.upstreams[j]
            if u in ok and u.outstanding == low:
                self._cursor = (j + 1) % n
                return u
        raise AssertionError("unreachable: a least-loaded healthy instance exists")

    @contextlib.contextmanager
    def lease(self, u: Upstream):
        """Count one outstanding call to ``u`` for the duration of the block."""
        u.outstanding += 1
        try:
            yield u
        finally:
            u.outstanding -= 1

    def set_health(self, u: Upstream, healthy: bool, reason: str = "") -> None:
        if healthy != u.healthy:
            if healthy:
                log.info("%r back in rotation", u)
            else:
                log.warning("%r out of rotation: %s", u, reason)
        u.healthy, u.reason = healthy, ("" if healthy else reason or "unhealthy")


class HealthChecker:
    """Polls ``GET {url}/health`` of every instance of ``pools`` every ``interval_s``,
    each poll bounded by ``timeout_s``; 200 puts an instance in rotation, anything
    else takes it out. ``interval_s <= 0`` disables polling (and ``mark_down``)."""

    def __init__(self, pools: list[Pool], interval_s: float, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"health check timeout must be > 0 seconds, got {timeout_s}")
        self.pools, self.interval_s = pools, interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task | None = None
        self._rechecks: dict[str, asyncio.Future] = {}  # pool kind -> the recheck running now

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def mark_down(self, pool: Pool, u: Upstream, reason: str) -> None:
        """A request could not reach ``u``: out of rotation until a poll finds it healthy."""
        if self.enabled:
            pool.set_health(u, False, reason)

    async def check(self, session: aiohttp.ClientSession, pool: Pool, u: Upstream) -> bool:
        try:
            async with session.get(u.url + "/health", timeout=self.timeout) as resp:
                ok, reason = resp.status == 200, f"/health answered {resp.status}"
        except asyncio.TimeoutError:
            ok, reason = False, f"/health did not answer within {self.timeout.total} s"
        except aiohttp.ClientError as e:
            ok, reason = False, f"/health unreachable: {e!r}"
        pool.set_health(u, ok, reason)
        if ok and pool.kind == "decode":
            await self.learn(session, u)
        return ok

    async def learn(self, session: aiohttp.ClientSession, u: Upstream) -> None:
        """Read decode ``u``'s ``/metrics``: its info and KV usage (each kept if absent)."""
        try:
            async with session.get(u.url + "/metrics", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MAX_METRICS_BYTES:
                        log.warning("%r: /metrics over %d bytes, not read", u, MAX_METRICS_BYTES)
                        return
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            log.debug("%r: /metrics unread: %r", u, e)
            return
        info, usage = parse_metrics(raw.decode(errors="replace"))
        if info is not None and info != u.info:
            log.info("%r: DCP=%d, %d-token pages, max_model_len %d, KV %d tokens, %d sequences", u, info.dcp_size,
                     info.block_size, info.max_model_len, info.kv_tokens, info.max_num_seqs)
        u.info = info or u.info
        if usage is not None:
            u.kv_usage, u.in_flight_at_poll = usage, u.in_flight_tokens

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, p, u) for p in self.pools for u in p.upstreams))

    async def recheck(self, session: aiohttp.ClientSession, pool: Pool) -> None:
        """Poll ``pool`` now (callers that find none of it in rotation, so an instance that
        came up since the last poll serves at once); concurrent callers share one poll."""
        if not self.enabled:
            return
        fut = self._rechecks.get(pool.kind)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.gather(*(self.check(session, pool, u) for u in pool.upstreams)))
            self._rechecks[pool.kind] = fut
            fut.add_done_callback(lambda _: self._rechecks.pop(pool.kind, None))
        await asyncio.shield(fut)

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Poll once (so the proxy serves knowing who is up), then every ``interval_s``.
        Off: read the decodes' ``/metrics`` once, health unchanged."""
        if self.enabled:
            await self.poll_once(session)
            self._task = asyncio.get_running_loop().create_task(self._run(session))
        else:
            await asyncio.gather(*(self.learn(session, u) for p in self.pools if p.kind == "decode"
                                   for u in p.upstreams))

    async def _run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once(session)
            except Exception:  # never let the poller die: a dead poller freezes rotation
                log.exception("health poll failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
