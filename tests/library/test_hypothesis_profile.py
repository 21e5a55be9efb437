"""The property tests reproduce: under the default profile two runs draw the same examples."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") == "explore", reason="the explore profile is random on purpose")
def test_profile_is_derandomized_so_runs_repeat() -> None:
    assert settings.default.derandomize and settings.default.database is None

    def draw_all() -> list:
        drawn = []

        @given(st.lists(st.integers(0, 2**40), max_size=8), st.binary(max_size=16))
        def probe(ints, blob):
            drawn.append((tuple(ints), blob))

        probe()
        return drawn

    first = draw_all()
    assert len(first) == settings.default.max_examples
    assert draw_all() == first
