"""Small pieces more than one storage module needs: a leaf by its path, a random generator from a setting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shmbuf._errors import UsageError


def leaf_at(tree: Any, path: str, where: str) -> Any:
    """The node at ``"a/b"`` in nested mappings; KeyError saying ``where``, the path, the part that failed and what is there.

    (A KeyError, not a ShmbufError: each caller says which setting named the path and raises its own.)
    """
    node = tree
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            have = sorted(node) if isinstance(node, Mapping) else type(node).__name__
            raise KeyError(f"{where}: no leaf {path!r} (at {part!r}; there is {have})")
        node = node[part]
    return node


def generator(value: Any, setting: str) -> np.random.Generator:
    """``value`` as a numpy Generator (a Generator passes through; else ``np.random.default_rng(value)``), or UsageError."""
    if isinstance(value, np.random.Generator):
        return value
    try:
        return np.random.default_rng(value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{setting}: expected None, an int >= 0, a numpy SeedSequence or Generator, got {value!r:.80} "
                         f"({exc})") from None
