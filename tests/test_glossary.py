"""docs/connector.md's glossary against the code: every code name it gives exists in
``vllm_dcp2d/``, and no retired word is left there (code, comments, log strings)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_dcp2d"
# The wire field names others chose may appear only quoted, as the field itself
# ("remote_request_id", 'transfer_id'); every other mention is a retired name.
WIRE_FIELDS = ("remote_request_id", "transfer_id")
# Constructor arguments named otherwise than their config keys (issue 52): send_timeout_s,
# claim_timeout_s and max_prefill_wait_s.
# Names a round of renames retired (issue 52): each must stay gone from the package.
RETIRED = ("limbo", "tid", "expiry_s", "claim_s", "max_wait_s",
           "LoadSpec", "start_loads", "load_params", "failed_loads", "_loading", "_key_owner", "_key_of",
           "_check_threads", "close_rank", "WorkerSide", "confirm", "confirms", "Confirm") + WIRE_FIELDS
# ... and phrases a word boundary cannot find.
RETIRED_PHRASES = ("seed §",)
MAX_WALK_FILES = 15  # the files "Request flow" may name: one request's walk (issue 52)


def glossary() -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / "connector.md").read_text()
    section = text.split("## Glossary\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    return [(term.strip(), re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", names)) for term, _, names in rows[2:]]


def sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.glob("**/*.py"))}


def test_glossary_lists_terms_with_code_names():
    rows = glossary()
    assert len(rows) >= 10
    for term, names in rows:
        assert names, f"glossary term {term!r} names no code"


def test_every_glossary_code_name_exists_in_the_package():
    code = "\n".join(sources().values())
    missing = [(term, n) for term, names in glossary() for n in names if not re.search(rf"\b{n}\b", code)]
    assert not missing, missing


def test_no_retired_word_in_the_package():
    found = []
    for path, text in sources().items():
        for field in WIRE_FIELDS:
            text = re.sub(rf"([\"']){field}\1", "", text)
        for n, line in enumerate(text.splitlines(), 1):
            for word in RETIRED:
                if re.search(rf"\b{word}\b", line):
                    found.append(f"{path}:{n}: {word}")
            for phrase in RETIRED_PHRASES:
                if phrase in line:
                    found.append(f"{path}:{n}: {phrase}")
    assert not found, found


def test_the_request_flow_names_files_and_methods_that_exist():
    """docs/connector.md "Request flow" walks one request through the files: each file it
    names is in the package, its steps name at most ``MAX_WALK_FILES``, what the steps call is
    listed apart (``request_flow.helpers``, each a file or folder of the package; the test that
    runs a request checks both lists against what ran), and each ``Class.name`` is a method or
    field defined in the file of that class."""
    from tests.support import request_flow

    walk, helpers = request_flow.steps(), request_flow.helpers()
    assert len(walk) >= 10 and len(helpers) >= 10, (walk, helpers)
    assert len(walk) <= MAX_WALK_FILES, f"the walk names {len(walk)} files: {sorted(str(p.relative_to(PACKAGE)) for p in walk)}"
    both = [str(p.relative_to(PACKAGE)) for p in walk if request_flow.covers(helpers, p)]
    assert not both, f"a step's file is listed as a helper too: {both}"
    section = request_flow.section()
    classes = {m.group(1): path for path, text in sources().items()
               for m in re.finditer(r"^class (\w+)", text, re.M)}
    methods = re.findall(r"`([A-Z]\w+)\.(\w+)`", section)
    assert len(methods) >= 10, methods
    absent = [f"{c}.{m}" for c, m in methods
              if c not in classes or not re.search(rf"def {m}\b|^\s+{m}\s*[:=]", sources()[classes[c]], re.M)]
    assert not absent, absent
