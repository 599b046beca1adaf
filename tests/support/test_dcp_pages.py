"""The interleave reference (``tests/support/dcp_pages.py``) the DCP tests build on."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.dcp_pages import dcp_local_slot, dcp_page_owner


@given(st.lists(st.integers(0, 10_000), max_size=200), st.integers(1, 9))
def test_owner_and_slot_invert(pages, dcp_size):
    kv = np.array(pages, dtype=np.int64)
    assert (dcp_page_owner(kv, dcp_size) < dcp_size).all()
    assert (dcp_local_slot(kv, dcp_size) * dcp_size + dcp_page_owner(kv, dcp_size) == kv).all()  # p == slot * N + owner


def test_scalars_stay_scalars():
    assert dcp_page_owner(13, 4) == 1 and dcp_local_slot(13, 4) == 3
    assert isinstance(dcp_page_owner(13, 4), int)


@pytest.mark.parametrize("call, match", [
    (lambda: dcp_page_owner([1, -2], 2), "pages must be >= 0, got min -2"),
    (lambda: dcp_local_slot([1.5], 2), "pages must hold integers"),
    (lambda: dcp_page_owner(3, 0), "dcp_size must be >= 1, got 0"),
])
def test_invalid_input_names_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()
