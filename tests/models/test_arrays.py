"""has_duplicates against the naive definition (a set of the values)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tokencache_models.arrays import has_duplicates


@given(st.lists(st.integers(-5, 40), max_size=30), st.booleans())
def test_has_duplicates_is_a_set_comparison(values: list[int], sort: bool) -> None:
    a = np.array(sorted(values) if sort else values, dtype=np.int64)
    assert has_duplicates(a) == (len(set(values)) != len(values))


def test_has_duplicates_edges() -> None:
    assert not has_duplicates(np.zeros(0, np.int64))
    assert not has_duplicates(np.array([7]))
    assert has_duplicates(np.array([1, 1]))  # sorted, not strictly increasing
    assert has_duplicates(np.array([2, 0, 2]))  # unsorted
    assert not has_duplicates(np.array([3, 1, 2]))
