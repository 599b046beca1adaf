"""Where a streamed decode's bytes go (``ClientSink``: straight to the client;
``BatchStream``: merged with the other prompts of a split batch), and
``gather_or_cancel``, which runs a batch's PD pairs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web

from .batch import StreamMerge


class ClientGone(Exception):
    """The client closed its connection while the proxy was writing to it."""


class StreamEnded(Exception):
    """An upstream sent an error event: the batch's stream ends after it."""


async def to_client(write):
    """Await a write to the client; its connection closing becomes ``ClientGone`` (aiohttp's
    reset error is also a ``ClientError``, which would read as the upstream failing)."""
    try:
        return await write
    except ConnectionError as e:
        raise ClientGone(repr(e)) from None


class ClientSink:
    """One decode's stream to the client, whose headers go out with the decode's first
    byte (``start``); the response is appended to ``started`` then."""

    def __init__(self, request: web.Request, started: list):
        self.request, self.started = request, started

    @property
    def begun(self) -> bool:
        return bool(self.started)

    async def start(self, content_type: str) -> None:
        out = web.StreamResponse(status=200, headers={"Content-Type": content_type})
        self.started.append(out)
        await to_client(out.prepare(self.request))

    async def write(self, chunk: bytes) -> None:
        await to_client(self.started[0].write(chunk))

    async def end(self) -> None:
        await to_client(self.started[0].write_eof())


class PromptSink:
    """Prompt ``i``'s decode stream into its ``BatchStream``."""

    def __init__(self, batch: BatchStream, i: int):
        self.batch, self.i, self.begun = batch, i, False

    async def start(self, content_type: str) -> None:
        self.begun = True
        await self.batch.begin(content_type)

    async def write(self, chunk: bytes) -> None:
        await self.batch.write(self.i, chunk)

    async def end(self) -> None:
        """The batch's stream ends once every prompt's has (``BatchStream.finish``)."""


class BatchStream:
    """The client's stream of a split batch. Its headers go out once every prompt's
    decode sent its first byte: vLLM checks a whole batch before it streams, so a hop
    that refuses any prompt is answered with that hop's status, not mid-stream. Until
    then events wait here (with fewer concurrent pairs than prompts, whole answers of
    the first prompts do). One lock orders the writes of the prompts' tasks."""

    def __init__(self, request: web.Request, started: list, prompts: int, n: int):
        self.request, self.started = request, started
        self.merge = StreamMerge(prompts, n)
        self._waiting, self._pending, self._content_type = prompts, [], "text/event-stream"
        self._lock = asyncio.Lock()

    def sink(self, i: int) -> PromptSink:
        return PromptSink(self, i)

    async def begin(self, content_type: str) -> None:
        self._waiting -= 1
        self._content_type = content_type
        if self._waiting == 0:
            await self._open()

    async def _open(self) -> None:
        async with self._lock:
            if not self.started:
                out = web.StreamResponse(status=200, headers={"Content-Type": self._content_type})
                self.started.append(out)
                await to_client(out.prepare(self.request))
        await self._flush()

    async def _flush(self) -> None:
        """Events go out in the order they were fed (``_pending`` is FIFO, appended to
        without an await in between), once the headers have."""
        async with self._lock:
            while self.started and self._pending:
                await to_client(self.started[0].write(self._pending.pop(0)))

    async def write(self, i: int, chunk: bytes) -> None:
        self._pending.extend(self.merge.feed(i, chunk))
        if self.merge.failed:  # the error goes to the client now, whoever else is waiting
            await self._open()
            raise StreamEnded(f"prompt {i}'s decode sent an error event")
        await self._flush()

    async def finish(self) -> None:
        """Every prompt's stream ended (or one sent an error): the summed usage chunk
        (unless an error ended it), ``[DONE]``, end of stream."""
        self._pending.extend(self.merge.tail())
        await self._open()
        async with self._lock:
            await to_client(self.started[0].write_eof())


async def gather_or_cancel(calls: list[Awaitable]) -> list:
    """Every call's result, in order; at the first failure the others are cancelled
    (which closes their upstream connections: vLLM aborts those requests) and awaited,
    then that failure is raised. Cancelling the caller (the client went away) cancels
    them all the same way."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
