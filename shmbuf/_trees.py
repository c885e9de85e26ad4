"""Trees shaped like the example, built around leaf views: new containers every time, the leaves shared.

A rollout's ``data`` and a batch's are made here. Containers are never shared between two of them
(see "Containers are never shared" in docs/design/reader.md): a learner that changes a dict it was
given changes only its own, never what the next rollout on that slot or the next batch reads.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import optree

from shmbuf._schema import Schema


class Trees:
    """:meth:`unflatten` puts a list of leaves (every leaf of every timescale, in the schema's order) into
    new containers shaped like the example."""

    __slots__ = ("_shapes",)

    def __init__(self, schema: Schema):
        # per timescale: (name, treespec, first leaf, (key, leaf index) pairs for a plain dict)
        self._shapes: list[tuple[str, Any, int, tuple[tuple[str, int], ...] | None]] = []
        first = 0
        for ts in schema.timescales:
            n = len(ts.leaves)
            template = optree.tree_unflatten(ts.treespec, list(range(first, first + n)))
            plain = type(template) is dict and all(type(v) is int for v in template.values())
            pairs = tuple(cast("dict[str, int]", template).items()) if plain else None
            self._shapes.append((ts.name, ts.treespec, first, pairs))
            first += n

    def unflatten(self, leaves: list[np.ndarray]) -> dict[str, Any]:
        """New containers, shaped like the example, around ``leaves``."""
        out: dict[str, Any] = {}
        for name, spec, first, keys in self._shapes:
            if keys is not None:  # a plain dict of leaves: its keys, in the example's order, and their leaves
                out[name] = {key: leaves[i] for key, i in keys}
            else:
                out[name] = optree.tree_unflatten(spec, leaves[first : first + spec.num_leaves])
        return out
