"""``vllm_dcp2d.transfer`` stays vLLM-free: no module in it imports ``vllm`` or the connector.

Read from the source (the AST of every file, ``tests/support/imports.py``), not from what
happens to be imported at run time, so a lazy import inside a function counts too.
"""

import ast
import pathlib

import vllm_dcp2d.transfer
from tests.support.imports import imported, offending

PACKAGE = pathlib.Path(vllm_dcp2d.transfer.__file__).parent
FORBIDDEN = ("vllm", "vllm_dcp2d.connector")


def test_transfer_imports_neither_vllm_nor_connector():
    assert len(sorted(PACKAGE.glob("**/*.py"))) > 10
    bad = offending(PACKAGE, FORBIDDEN)
    assert not bad, bad


def test_the_rule_catches_a_forbidden_import():
    tree = ast.parse("def f():\n    from vllm_dcp2d.connector import worker\n    import vllm.config\n")
    assert "vllm_dcp2d.connector.worker" in imported(tree) and "vllm.config" in imported(tree)
