"""What a user passes to ``Writer.add``/``send``, checked against the pipeline's leaves and made into arrays.

Every refusal is a :class:`SchemaError` naming the leaf path ("leaf step/obs: expected ..., got ..."),
raised before anything is stored. The rules (numpy's ``same_kind`` casts, the item shape or echo's
leading 1, Python numbers range-checked, ``__array__`` read) are in ``docs/design/writer.md``; this is
the general path, which :mod:`shmbuf._fastpath` leaves every item it cannot take to.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np
import optree

from shmbuf._errors import SchemaError
from shmbuf._schema import Leaf, Timescale, flatten_like

# What dict.get gives for a key the user's dict lacks (None is a value a user may pass).
MISSING = object()


def coerce_into(out: list[Any], spec: Timescale, keys: tuple[str, ...] | None, treespec: Any, data: Any, *,
                whole: bool) -> None:
    """Check every leaf of ``data`` (one item, or with ``whole`` the whole timescale) into ``out``, in schema order.

    ``keys``: the sorted keys of a flat-dict timescale, else None. ``treespec``: the timescale's containers
    as the Writer's example has them. Raises at the first refused leaf; ``out`` then holds a partial result.
    """
    if not whole and keys is not None and type(data) is dict and len(data) == len(out):
        # the fast path's order: leaf by leaf, a missing key where it is reached
        for j, k in enumerate(keys):
            x = data.get(k, MISSING)
            if x is MISSING:
                keys_mismatch(spec.name, keys, data)
            out[j] = coerce(spec.leaves[j], x, spec.buffered, whole=False)
        return
    for j, x in enumerate(leaves_of(spec, keys, treespec, data)):
        out[j] = coerce(spec.leaves[j], x, spec.buffered, whole=whole)


class LeafCoercer:
    """The general path of one leaf of a fast-path timescale, called by its compiled store: a missing key,
    or an item to :func:`coerce`."""

    __slots__ = ("keys", "spec")

    def __init__(self, spec: Timescale, keys: tuple[str, ...]):
        self.spec, self.keys = spec, keys  # not the prepared timescale: no reference cycle through the store's globals

    def __call__(self, j: int, x: Any, data: dict[Any, Any]) -> np.ndarray:
        if x is MISSING:
            keys_mismatch(self.spec.name, self.keys, data)
        return coerce(self.spec.leaves[j], x, True, whole=False)


def leaves_of(spec: Timescale, keys: tuple[str, ...] | None, treespec: Any, data: Any) -> list[Any]:
    """The leaves of ``data`` in schema order, or a SchemaError naming the first mismatch."""
    if keys is not None and isinstance(data, dict):
        if set(data) != set(keys):
            keys_mismatch(spec.name, keys, data)
        return [data[k] for k in keys]
    leaves, got = optree.tree_flatten(data)
    if got != treespec:  # not the example's exact containers: walk and compare
        leaves = []
        flatten_like(spec.structure, data, (spec.name,), leaves)
    return leaves


def keys_mismatch(name: str, keys: tuple[str, ...] | None, data: dict[Any, Any]) -> NoReturn:
    """Raise the SchemaError naming the missing and the unexpected keys of flat timescale ``name``."""
    expected = set(keys or ())
    got = set(data)
    missing = sorted(expected - got, key=str)
    extra = sorted(got - expected, key=str)
    parts = []
    if missing:
        parts.append("missing " + ", ".join(f"{name}/{k}" for k in missing))
    if extra:
        parts.append("unexpected " + ", ".join(f"{name}/{k}" for k in extra))
    raise SchemaError(
        f"timescale '{name}': expected keys {sorted(expected)}, got {sorted(got, key=str)} ({'; '.join(parts)})"
    )


# Which kinds of Python number may go into which kinds of leaf: numpy's own rules for Python scalars
# (a bool goes anywhere; an int into any integer, float or complex leaf if its value fits; a float
# into float or complex; a complex into complex).
_PY_INTO = {bool: "biufc", int: "iufc", float: "fc", complex: "c"}


def coerce(leaf: Leaf, x: Any, buffered: bool, *, whole: bool) -> np.ndarray:
    """Check one incoming value against its leaf; return an array numpy can assign without surprises.

    ``whole``: ``x`` is the whole leaf (``send``), else one item (``add``), which may also come,
    echo-style, with a leading 1 (buffered) or without the leading 1 of a single-item leaf.
    """
    if not isinstance(x, np.ndarray):
        x = _as_array(leaf, x)
    if x.dtype != leaf.dtype and not np.can_cast(x.dtype, leaf.dtype, casting="same_kind"):
        raise SchemaError(
            f"leaf {leaf.name}: expected dtype {leaf.dtype} (or one that casts to it under numpy's 'same_kind' rule), "
            f"got {x.dtype}"
        )
    want = leaf.shape if whole else leaf.item_shape
    if x.shape != want:
        if whole:
            ok = False
        elif buffered:
            ok = x.shape == (1, *want)
        else:
            ok = len(want) >= 1 and want[0] == 1 and x.shape == want[1:]
        if not ok:
            raise SchemaError(f"leaf {leaf.name}: expected shape {want}{'' if whole else ' for one add()'}, got {x.shape}")
        x = x.reshape(want)
    return x


def _as_array(leaf: Leaf, x: Any) -> np.ndarray:
    """A Python number (range-checked, as numpy's assignment does), a numpy scalar, or anything with ``__array__``."""
    kinds = _PY_INTO.get(type(x))
    if kinds is not None:
        if leaf.dtype.kind not in kinds:
            raise SchemaError(f"leaf {leaf.name}: expected dtype {leaf.dtype} (a Python {type(x).__name__} does not cast to it "
                              f"under numpy's 'same_kind' rule), got Python {type(x).__name__} {x!r}")
        try:
            return np.asarray(x, leaf.dtype)
        except OverflowError:
            info = np.iinfo(leaf.dtype)
            raise SchemaError(
                f"leaf {leaf.name}: {x!r} does not fit dtype {leaf.dtype} ({info.min}..{info.max}); "
                "numpy's own assignment refuses it too"
            ) from None
    if isinstance(x, np.generic):
        return np.asarray(x)
    if hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except Exception as exc:  # noqa: BLE001  # whatever __array__ raises (a torch tensor needing grad, on a GPU, ...)
            raise SchemaError(
                f"leaf {leaf.name}: could not read a {type(x).__name__} as a numpy array ({type(exc).__name__}: {exc}); "
                "pass a CPU array (for torch: tensor.detach().cpu())"
            ) from None
    raise SchemaError(
        f"leaf {leaf.name}: expected a numpy array of {leaf.dtype} with shape {leaf.item_shape}, got {type(x).__name__}"
    )
