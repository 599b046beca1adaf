"""``vllm_dcp2d.transfer`` stays vLLM-free: no module in it imports ``vllm`` or the connector.

Read from the source (the AST of every file), not from what happens to be imported
at run time, so a lazy import inside a function counts too.
"""

import ast
import pathlib

import vllm_dcp2d.transfer

PACKAGE = pathlib.Path(vllm_dcp2d.transfer.__file__).parent
FORBIDDEN = ("vllm", "vllm_dcp2d.connector")


def imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports hide what is imported"
            names.append(node.module or "")
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_transfer_imports_neither_vllm_nor_connector():
    files = sorted(PACKAGE.glob("**/*.py"))
    assert len(files) > 10
    bad = [f"{f.name}: {name}" for f in files for name in imported(ast.parse(f.read_text()))
           if any(name == p or name.startswith(p + ".") for p in FORBIDDEN)]
    assert not bad, bad


def test_the_rule_catches_a_forbidden_import():
    tree = ast.parse("def f():\n    from vllm_dcp2d.connector import worker\n    import vllm.config\n")
    assert "vllm_dcp2d.connector.worker" in imported(tree) and "vllm.config" in imported(tree)
