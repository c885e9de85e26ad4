"""One replay row's contract: its schema (the row's tree, every leaf with a leading 1) and the checks of a batch
of rows against it. See docs/design/replay.md."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

from shmbuf._errors import SchemaError
from shmbuf._schema import Schema, Timescale, flatten_like, format_path

ROW = "row"  # the schema's single timescale: one row, every leaf with a leading 1


def row_schema(example_row: Any) -> Schema:
    """The schema of one row: the row's tree with a leading 1 on every leaf (so always single-item)."""
    paths, leaves, _ = optree.tree_flatten_with_path(example_row)
    if not leaves:
        raise SchemaError("ReplayBuffer: the example row has no array leaves: expected a pytree of numpy arrays, e.g. "
                          "{'obs': np.zeros(64, np.float32), 'reward': np.zeros((), np.float32)}")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, (np.ndarray, np.generic)):
            raise SchemaError(
                f"ReplayBuffer: example row leaf {format_path(path)}: expected a numpy array, got {type(leaf).__name__}; "
                "wrap Python numbers in np.asarray(..., dtype)"
            )
    batch_of_one = optree.tree_map(lambda a: np.asarray(a)[None], example_row)
    return Schema.from_example({ROW: batch_of_one})


class Row:
    """What :meth:`ReplayBuffer.insert` checks a batch against, precomputed from the row's timescale once."""

    def __init__(self, ts: Timescale):
        self.treespec = ts.treespec
        self.structure = ts.structure
        self.shapes = tuple(lf.shape[1:] for lf in ts.leaves)  # one row's leaf shapes (the leading 1 dropped)
        self.names = tuple(format_path(lf.path[1:]) for lf in ts.leaves)
        self.out_specs = tuple((lf.dtype, lf.shape[1:]) for lf in ts.leaves)
        self.checks = tuple((lf.dtype, lf.shape[1:], 1 + len(lf.shape[1:])) for lf in ts.leaves)

    def check_batch(self, batch: Any) -> tuple[list[np.ndarray], int]:
        """The batch's leaves in schema order, as arrays, and its row count; SchemaError naming the first bad leaf."""
        got, spec = optree.tree_flatten(batch)
        if spec != self.treespec:  # not the example's exact containers: walk and compare (names what differs)
            got = []
            try:
                flatten_like(self.structure, batch, (), got)
            except SchemaError as exc:
                raise SchemaError(f"insert: the batch is not shaped like the row: {exc}") from None
        n = -1
        for i, (x, (dtype, shape, ndim)) in enumerate(zip(got, self.checks)):
            if type(x) is not np.ndarray:
                got[i] = x = self._as_array(i, x)
            xs = x.shape
            if len(xs) != ndim or xs[1:] != shape or (x.dtype is not dtype and x.dtype != dtype):
                self._refuse(i, x)
            if n != xs[0]:
                if n >= 0:
                    raise SchemaError(f"insert: leaf {self.names[i]}: batch dim {xs[0]}, but leaf {self.names[0]} has {n}; "
                                      "every leaf of a batch must have the same leading dim")
                n = xs[0]
        return got, n

    def _as_array(self, i: int, x: Any) -> np.ndarray:
        try:
            return np.asarray(x)
        except Exception as exc:  # noqa: BLE001  # a torch tensor that requires grad or lives on a GPU, ...
            raise SchemaError(f"insert: leaf {self.names[i]}: could not read a {type(x).__name__} as an array ({exc}); "
                              "pass CPU arrays (for torch: tensor.detach().cpu())") from None

    def _refuse(self, i: int, x: np.ndarray) -> None:
        """Raise SchemaError for leaf ``i`` unless only its dtype differs and casts under 'same_kind' (then return)."""
        dtype, shape, ndim = self.checks[i]
        name = self.names[i]
        if x.ndim != ndim or x.shape[1:] != shape:
            want = "(" + ", ".join(["n", *map(str, shape)]) + ("," if not shape else "") + ")"
            raise SchemaError(f"insert: leaf {name}: expected shape {want} (a leading batch dim n, then the row's "
                              f"{shape}), got {x.shape}")
        if not np.can_cast(x.dtype, dtype, casting="same_kind"):
            raise SchemaError(f"insert: leaf {name}: expected dtype {dtype} (or one that casts to it under numpy's "
                              f"'same_kind' rule), got {x.dtype}")
