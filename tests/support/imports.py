"""What a module imports, read from its source (the AST), not from what happens to be
imported at run time, so a lazy import inside a function counts too: the package
boundary tests (``tests/transfer/test_boundaries.py``, ``tests/reshard/test_boundaries.py``)."""

from __future__ import annotations

import ast
import pathlib


def imported(tree: ast.AST) -> list[str]:
    """Every module an import in ``tree`` names: ``import a.b`` -> "a.b"; ``from a import b``
    -> "a" and "a.b" (b may be a module). A relative import fails the assert: it hides what
    is imported."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports hide what is imported"
            names.append(node.module or "")
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def offending(package: pathlib.Path, forbidden: tuple[str, ...]) -> list[str]:
    """``"file: module"`` for each import in the ``.py`` files under ``package`` that is one of
    ``forbidden`` or inside one."""
    return [f"{f.relative_to(package)}: {name}" for f in sorted(package.glob("**/*.py"))
            for name in imported(ast.parse(f.read_text()))
            if any(name == p or name.startswith(p + ".") for p in forbidden)]
