"""Size-broadcast of a layer's prefix KV (layer-split storage) across real
processes (gloo, loopback). Every rank's collectives are bounded by a gloo
timeout and the group by a join deadline."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.prefill_group import run_group

pytestmark = pytest.mark.multiproc


@st.composite
def _cases(draw, cp_size: int):
    out = []
    for _ in range(draw(st.integers(1, 4))):
        num_blocks = draw(st.integers(1, 12))
        page = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        blocks = sorted(draw(st.sets(st.integers(0, num_blocks - 1), max_size=num_blocks)))
        layers = draw(st.lists(st.integers(0, cp_size - 1), min_size=1, max_size=4))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
        out.append(dict(num_blocks=num_blocks, page=page, blocks=blocks, layers=layers, dtype=dtype))
    return out


@pytest.mark.timeout(300)
@settings(max_examples=4)
@given(data=st.data())
def test_transient_slot_gets_the_owners_blocks_bit_for_bit(data):
    """Any owner per layer, any block list (empty included), any page shape and
    dtype, through one reused scratch buffer or fresh ones: a non-owner's transient slot holds the owner's blocks exactly, every
    other block keeps its content, and the owner's region is never written."""
    cp_size = data.draw(st.integers(2, 3), label="cp_size")
    cases = data.draw(_cases(cp_size), label="cases")
    scratch_max = data.draw(st.sampled_from([None, 0, 48, 1 << 20]), label="scratch_max")
    results = run_group("tests.support.prefill_workers:cases", cp_size, dict(cases=cases, scratch_max=scratch_max),
                        timeout_s=120, gloo_timeout_s=20)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    for rank, r in enumerate(results):
        assert r["bad"] == [], (rank, r["bad"][:5])


@pytest.mark.timeout(90)
def test_mismatched_block_lists_raise_on_the_rank_that_differs_and_do_not_hang():
    results = run_group("tests.support.prefill_workers:mismatch", 2, {}, timeout_s=60, gloo_timeout_s=5)
    errors = [r["error"] for r in results]
    assert errors[0] == "", errors
    assert "CP rank 1 has 3 blocks" in errors[1] and "CP rank 0, has 2" in errors[1], errors[1]
    assert all(r["untouched"] for r in results)
    assert all(r["follow"] for r in results)  # the group still works


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(["float32", "bfloat16", "uint8"])),
                      min_size=1, max_size=8),
       max_bytes=st.sampled_from([0, 1000, 1 << 20, 4 << 20]))
def test_scratch_reuses_one_buffer_and_never_holds_more_than_its_cap(sizes, max_bytes):
    """Each take is the shape and dtype asked for; a take that fits what it holds uses
    the same memory (no new buffer per layer: the soak's creeping RSS), it grows only
    for a larger one, and it never keeps more than ``max_bytes``."""
    import torch

    from vllm_dcp2d.prefill.broadcast import Scratch

    scratch = Scratch(torch.device("cpu"), max_bytes=max_bytes)
    for n, name in sizes:
        dtype = getattr(torch, name)
        held = scratch.nbytes
        t = scratch.take((n, 3), dtype)
        nbytes = n * 3 * t.element_size()
        assert t.shape == (n, 3) and t.dtype == dtype and t.is_contiguous()
        assert scratch.nbytes <= max_bytes
        if nbytes <= held:
            assert scratch.nbytes == held
            if nbytes:
                assert t.untyped_storage().data_ptr() == scratch._buf.untyped_storage().data_ptr()
        if nbytes > max_bytes:
            assert t.untyped_storage().data_ptr() != scratch._buf.untyped_storage().data_ptr()
