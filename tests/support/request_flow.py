"""docs/connector.md "Request flow", read: the files its steps name (one request's walk) and
the files listed under "What the steps call" (helpers), and a profiler that records which of
the package's files run. Used by ``tests/test_glossary.py`` (the walk as written) and
``tests/connector/test_connector.py`` and ``tests/proxy/test_app.py`` (the walk as one request runs
it, in the engine and in the proxy)."""

from __future__ import annotations

import pathlib
import re
import sys
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_dcp2d"
HELPERS_HEADING = "### What the steps call\n"


def section() -> str:
    text = (ROOT / "docs" / "connector.md").read_text()
    return text.split("## Request flow\n", 1)[1].split("\n## ", 1)[0]


def _resolve(name: str) -> pathlib.Path:
    """A file as the doc names it: a path under the package, or a bare name unique in it."""
    if (PACKAGE / name).exists():
        return PACKAGE / name
    found = list(PACKAGE.glob(f"**/{name}"))
    assert len(found) == 1, f"docs/connector.md names {name!r}: expected one file of the package, found {found}"
    return found[0]


def steps() -> set[pathlib.Path]:
    """The files the numbered steps name."""
    walk = section().split(HELPERS_HEADING, 1)[0]
    return {_resolve(n) for n in re.findall(r"`((?:[a-z_]+/)?[a-z_]+\.py)`", walk)}


def helpers() -> set[pathlib.Path]:
    """The files (or whole folders: ``vllm_compat/``) listed as what the steps call."""
    listed = section().split(HELPERS_HEADING, 1)[1]
    names = [n for line in listed.splitlines() if line.startswith("- ")
             for n in re.findall(r"`([a-z_]+/(?:[a-z_]+\.py)?)`", line.split(": ", 1)[0])]
    out = set()
    for n in names:
        assert (PACKAGE / n).exists(), f"docs/connector.md lists {n!r} under what the steps call: no such file"
        out.add(PACKAGE / n)
    return out


def covers(listed: set[pathlib.Path], path: pathlib.Path) -> bool:
    return path in listed or any(p.is_dir() and p in path.parents for p in listed)


class Profiler:
    """Records the package's files whose functions are called while ``on`` is set, on every
    thread started after ``install`` and on the thread that sets ``on``."""

    def __init__(self):
        self.on = False
        self.ran: set[pathlib.Path] = set()
        self._prefix = str(PACKAGE) + "/"

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(self._prefix):
                self.ran.add(pathlib.Path(f))

    def install(self) -> None:
        threading.setprofile(self)

    def uninstall(self) -> None:
        threading.setprofile(None)

    def __enter__(self):
        self.ran.clear()
        self.on = True
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        self.on = False
