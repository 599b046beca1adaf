"""docs/security.md names, for each claim, the tests that check it: every one must exist, so a
claim cannot outlive its test (issue 48, item 8)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"


def _claims() -> list[tuple[str, list[str]]]:
    """``(claim number, [path::test, ...])`` of each row of the claims table."""
    text = DOC.read_text()
    table = text[text.index("## What holds, with and without a secret"):]
    table = table[:table.index("\n## ", 1)]
    rows = [r for r in table.splitlines() if re.match(r"\| \d+ \|", r)]
    return [(r.split("|")[1].strip(), re.findall(r"`(tests/[\w/]+\.py::\w+)`", r.split("|")[-2])) for r in rows]


def _tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_claim_names_tests_that_exist():
    claims = _claims()
    assert len(claims) >= 13, "the claims table of docs/security.md was not found whole"
    for number, refs in claims:
        assert refs, f"claim {number} of docs/security.md names no test"
        for ref in refs:
            path, name = ref.split("::")
            assert (ROOT / path).is_file(), f"claim {number}: {path} does not exist"
            assert name in _tests(ROOT / path), f"claim {number}: {ref} does not exist"
