"""Servers that a test module's tests share, checked before each test (issue 25).

Starting a cluster of vLLM engines costs a minute of CPU on a small machine, so the
tests of one module share one. Sharing must not spread a failure: ``SharedCluster.get``
runs before each test; the first call starts the cluster, later calls check that
every server of it is alive and answers ``/health``, and if one does not (a test
killed it, or an engine died), stop the whole cluster and start it again. The test
that broke it fails alone; the next one gets a healthy cluster. A cluster that fails
to start twice in a row is not tried again for the module's later tests.

    shared, cluster = fixtures("x", my_cluster)  # in the test module; tests take ``cluster``
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from vllm_dcp2d.local.servers import Process, wait_all

__all__ = ["SharedCluster", "fixtures", "processes"]

log = logging.getLogger(__name__)


def processes(value: Any) -> Iterator[Process]:
    """Every ``Process`` in ``value``: itself, or inside its lists, tuples and dict values."""
    if isinstance(value, Process):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from processes(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from processes(v)


class SharedCluster:
    """start: returns a context manager that starts the servers and yields the cluster,
    stopping them on exit. servers: the cluster's ``Process`` objects, checked before
    each test (default ``processes``: those in a dict's values, lists and tuples).
    check_s: how long a live server may take to answer ``/health`` before the
    cluster counts as broken. max_failures: after that many failed starts in a row,
    ``get`` raises at once instead of trying again (a start can take minutes, and a
    cluster that cannot start fails every test the same way). ``starts``: how many
    times it was started; ``failed``: why the starts since the last good one failed."""

    def __init__(self, start: Callable[[], contextlib.AbstractContextManager], check_s: float = 30.0,
                 max_failures: int = 2, servers: Callable[[Any], Iterable[Process]] | None = None):
        self._start, self.check_s, self.max_failures = start, check_s, max_failures
        self._servers = servers or processes
        self.failed: list[str] = []
        self._stack: contextlib.ExitStack | None = None
        self.value: Any = None
        self.starts = 0

    def get(self) -> Any:
        """The cluster, started or restarted as needed (see the module doc)."""
        if self.value is not None:
            why = self.broken()
            if why:
                log.warning("shared cluster broken (%s): stopping it and starting it again", why)
                self.close()
        if self.value is None:
            if len(self.failed) >= self.max_failures:
                raise RuntimeError(f"the shared cluster failed to start {len(self.failed)} times in a row "
                                   f"(not tried again: each try can take minutes); last: {self.failed[-1]}")
            stack = contextlib.ExitStack()
            try:
                self.value = stack.enter_context(self._start())
            except BaseException as e:
                stack.close()
                self.failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                raise
            self._stack = stack
            self.starts += 1
            self.failed = []
        return self.value

    def broken(self) -> str:
        """Why the running cluster is not usable ("" if it is): a server exited, or did not
        answer ``/health`` within ``check_s``."""
        try:
            wait_all(list(self._servers(self.value)), self.check_s)
        except (RuntimeError, TimeoutError) as e:
            return str(e).splitlines()[0]
        return ""

    def close(self) -> None:
        stack, self._stack, self.value = self._stack, None, None
        if stack is not None:
            stack.close()

    def __enter__(self) -> SharedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fixtures(name: str, start: Callable[[Path], contextlib.AbstractContextManager]):
    """The fixtures of a test module whose tests share one cluster: ``shared`` (module
    scope, a ``SharedCluster``) and ``cluster`` (per test, ``shared.get()``).
    ``start(work)`` starts the cluster in ``work``, a fresh temporary directory per start."""
    import pytest

    @pytest.fixture(scope="module")
    def shared(tmp_path_factory):
        with SharedCluster(lambda: start(tmp_path_factory.mktemp(name))) as s:
            yield s

    @pytest.fixture
    def cluster(shared):
        return shared.get()

    return shared, cluster
