"""Draft side of spec decode under DCP: dcp_disabled() and the effective DCP size."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from vllm_dcp2d.spec_decode import dcp_disabled, effective_dcp


def test_disabled_nests_and_restores_on_exceptions():
    assert effective_dcp(4) == 4
    with dcp_disabled():
        assert effective_dcp(4) == 1
        with dcp_disabled():
            assert effective_dcp(4) == 1
        assert effective_dcp(4) == 1  # the inner exit leaves the outer block disabled
        with pytest.raises(RuntimeError, match="boom"), dcp_disabled():
            raise RuntimeError("boom")
        assert effective_dcp(4) == 1
    assert effective_dcp(4) == 4


def test_decorator_form_as_in_the_seed():
    @dcp_disabled()
    def forward_draft(world_size):
        return effective_dcp(world_size)

    assert forward_draft(4) == 1 and forward_draft(2) == 1  # reusable: a fresh context per call
    assert effective_dcp(4) == 4

    @dcp_disabled()
    def failing():
        raise KeyError("x")

    with pytest.raises(KeyError):
        failing()
    assert effective_dcp(4) == 4


def test_disabled_is_per_thread():
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def draft_thread():
        with dcp_disabled():
            inside.set()
            seen["draft"] = effective_dcp(4)
            assert release.wait(10)
        seen["after"] = effective_dcp(4)

    t = threading.Thread(target=draft_thread, daemon=True)
    t.start()
    try:
        assert inside.wait(10)
        assert effective_dcp(4) == 4  # the target thread still shards
    finally:
        release.set()
        t.join(10)
    assert not t.is_alive() and seen == {"draft": 1, "after": 4}


def test_disabled_is_per_asyncio_task():
    async def draft(ev):
        with dcp_disabled():
            ev.set()
            await asyncio.sleep(0.01)
            return effective_dcp(2)

    async def target(ev):
        await asyncio.wait_for(ev.wait(), 10)
        return effective_dcp(2)

    async def main():
        ev = asyncio.Event()
        return await asyncio.gather(draft(ev), target(ev))

    assert asyncio.run(main()) == [1, 2]


def test_effective_dcp_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world_size"):
        effective_dcp(0)


def test_spec_package_imports_no_vllm():
    code = ("import sys, vllm_dcp2d.spec_decode, vllm_dcp2d.spec_decode.draft, vllm_dcp2d.spec_decode.verify; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
