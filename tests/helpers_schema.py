"""Random example pytrees for hypothesis (tests/test_schema.py, tests/test_transfer.py): nested dicts, lists and
tuples of every dtype the schema takes, each timescale obeying echo's rules (buffered: every leaf leads with N > 1;
or single-item). Not in tests/helpers.py, which spawned children import: they need not import hypothesis.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "float16", "float32", "float64", "complex64"]


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def leaf_strategy() -> st.SearchStrategy:
    return st.builds(lambda d, s: np.zeros(s, d), st.sampled_from(DTYPES), shapes)


def subtree(depth: int = 2) -> st.SearchStrategy:
    keys = st.text("abcdefgh_", min_size=1, max_size=5)
    return st.recursive(
        leaf_strategy(),
        lambda inner: st.one_of(
            st.dictionaries(keys, inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
        ),
        max_leaves=6,
    )


def timescale() -> st.SearchStrategy:
    """A subtree that obeys echo's rules: either all leaves lead with N > 1, or single-item."""

    def make(tree: object, lead: int) -> object:
        import optree

        leaves = optree.tree_leaves(tree)
        if lead > 1:
            return optree.tree_map(lambda a: np.zeros((lead, *a.shape), a.dtype), tree)
        if not any(a.ndim == 0 for a in leaves) and not all(a.shape[0] == 1 for a in leaves):
            return optree.tree_map(lambda a: np.zeros((1, *a.shape), a.dtype), tree)
        return tree

    return st.builds(make, subtree(), st.sampled_from([0, 1, 2, 5]))


examples = st.dictionaries(st.text("stepisod", min_size=1, max_size=6), timescale(), min_size=1, max_size=3)
