"""What a module logged while a test ran: the warnings and errors an operator would read,
which is how a serving process reports what it refused or failed. A handler on the
module's logger itself, so it sees records from every thread and whatever the root
logger's configuration.

Note ``auth.PeerLog``: a sender's warnings about its peers come at most one per kind per
10 s. The first of each kind always comes, so "nothing logged since the object was built"
is exact; a count of them is not."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["logged", "attach", "Recorder"]


class Recorder(logging.Handler):
    """Keeps the message of each record it handles, in order (``messages``)."""

    def __init__(self, level: int):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def attach(name: str, level: int = logging.WARNING) -> Recorder:
    """A ``Recorder`` on logger ``name`` from now on, for the life of the process (a worker
    process of a test: ``tests/support/xfer_procs.py``)."""
    recorder, logger = Recorder(level), logging.getLogger(name)
    logger.addHandler(recorder)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    return recorder


@contextlib.contextmanager
def logged(name: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages logger ``name`` logs at ``level`` or above inside the block."""
    logger = logging.getLogger(name)
    before = logger.level
    recorder = attach(name, level)
    try:
        yield recorder.messages
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(before)
