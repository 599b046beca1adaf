"""Regenerate the tables the docs hold from the code that owns them (tests check they match):
the config keys (``config.KEYS``) in docs/config.md and docs/connector.md, the connector's metrics
(``connector.prom.METRICS``) and the proxy's in docs/metrics.md.

    .venv/bin/python scripts/docs_tables.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_dcp2d import config  # noqa: E402
from vllm_dcp2d.connector import prom  # noqa: E402
from vllm_dcp2d.proxy import metrics as proxy_metrics  # noqa: E402


def replace_table(path: Path, header: str, table: str) -> bool:
    """Replace the markdown table that starts with ``header`` in ``path`` by ``table``."""
    text = path.read_text()
    m = re.search(re.escape(header) + r"\n(?:\|[^\n]*\n?)*", text)
    if m is None:
        raise SystemExit(f"{path}: no table starting {header!r}")
    end = "\n" if m.group(0).endswith("\n") else ""
    new = text[:m.start()] + table + end + text[m.end():]
    if new != text:
        path.write_text(new)
    return new != text


def main() -> int:
    changed = []
    for doc in ("docs/config.md", "docs/connector.md"):
        if replace_table(ROOT / doc, "| key | default | side | meaning |", config.markdown_table()):
            changed.append(doc)
    metrics = ROOT / "docs/metrics.md"
    if replace_table(metrics, "| metric | type | labels | recorded by | meaning |", prom.markdown_table()):
        changed.append("docs/metrics.md (connector)")
    proxy_header = proxy_metrics.markdown_table().split("\n", 1)[0]
    if proxy_header != "| metric | type | labels | recorded by | meaning |":
        if replace_table(metrics, proxy_header, proxy_metrics.markdown_table()):
            changed.append("docs/metrics.md (proxy)")
    print("regenerated: " + (", ".join(changed) or "nothing (all current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
