"""``Writer.add``'s fast path: everything about a timescale that does not change between steps, made once.

Per timescale, when the Writer starts: a :class:`PreparedTimescale` (its leaves, keys, capacity, a
scratch list) and, for a buffered flat dict of at most :data:`MAX_FAST_LEAVES` leaves, an
:class:`ItemStore`, a function compiled for it that checks every leaf of a step and then stores them.
Per slot, on its first use: :func:`slot_views`, each leaf's array view and flat memoryview. An ``add``
then allocates nothing. What each store costs, and why, is in ``docs/design/writer.md`` ("The hot path").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shmbuf._coerce import MISSING, LeafCoercer
from shmbuf._errors import SchemaError
from shmbuf._schema import Schema, Timescale

# Compiling a timescale's ItemStore costs about 0.3 ms per leaf, once per Writer; a timescale with more
# leaves than this takes the general path instead.
MAX_FAST_LEAVES = 256
_F32_MAX = float(np.finfo(np.float32).max)


class PreparedTimescale:
    """A timescale as the writer's hot path wants it: everything precomputed, nothing to look up.

    ``keys``: the sorted keys of a flat-dict timescale (else None); ``treespec``: its containers as the
    Writer's example has them (``slot()`` rebuilds them, and a tree of other containers is walked to
    compare); ``store``: its :class:`ItemStore`, or None for the general path; ``scratch``: one entry per
    leaf, where the general path keeps checked items until every leaf has passed.
    """

    __slots__ = ("buffered", "capacity", "index", "keys", "leaves", "scratch", "spec", "store", "treespec")

    def __init__(self, index: int, spec: Timescale, treespec: Any):
        self.index = index
        self.spec = spec
        self.treespec = treespec
        self.leaves = spec.leaves
        self.capacity = spec.capacity
        self.buffered = spec.buffered
        st = spec.structure
        flat = st[0] == "dict" and all(c[0] == "leaf" for c in st[2])
        self.keys: tuple[str, ...] | None = tuple(st[1]) if flat else None
        # A buffered flat dict (the common case) gets add()'s fast path, a function made for it (ItemStore).
        fast = flat and spec.buffered and len(spec.leaves) <= MAX_FAST_LEAVES
        self.store = ItemStore(self) if fast else None
        self.scratch: list[Any] = [None] * len(spec.leaves)


def prepare_timescales(schema: Schema, example: Any, where: str) -> dict[str, PreparedTimescale]:
    """Each timescale of ``schema`` prepared, by name; with the treespecs (container types) of ``example`` where it
    is given, after checking that it describes exactly ``schema`` (a SchemaError naming the first differing leaf)."""
    treespecs = {ts.name: ts.treespec for ts in schema.timescales}
    if example is not None:
        mine = Schema.from_example(example)
        if mine != schema:
            diff = schema.first_difference(mine) or "same leaves, different encoding"
            raise SchemaError(f"the example does not match {where}: {diff}")
        treespecs = {ts.name: ts.treespec for ts in mine.timescales}
    return {ts.name: PreparedTimescale(i, ts, treespecs[ts.name]) for i, ts in enumerate(schema.timescales)}


def leaf_views(timescales: list[PreparedTimescale], leaf_view: Any) -> list[list[np.ndarray]]:
    """Per timescale, each leaf's view of every slot (``leaf_view(k)``: the segment's view of leaf k; the schema
    lists leaves timescale by timescale)."""
    out, first = [], 0
    for ts in timescales:
        n = len(ts.spec.leaves)
        out.append([leaf_view(first + j) for j in range(n)])
        first += n
    return out


def slot_views(timescales: list[PreparedTimescale], leaf_views: list[list[np.ndarray]],
               slot: int) -> tuple[list[list[np.ndarray]], list[list[memoryview | None]]]:
    """One slot's views, per timescale and leaf: the array (``leaf_views[t][j][slot]``), and for a timescale
    with an ItemStore its flat memoryview (None where a memoryview cannot store the leaf's items)."""
    arrays = [[leaf[slot, ...] for leaf in leaves] for leaves in leaf_views]
    mvs = [[_flat_memoryview(a) if ts.store is not None else None for a in leaves] for ts, leaves in zip(timescales, arrays)]
    return arrays, mvs


def _item_format_ok(dtype: np.dtype) -> bool:
    """Can a memoryview store this dtype's items (bool, integers, float32, float64; native order)?"""
    return dtype.kind in "biu" or (dtype.kind == "f" and dtype.itemsize in (4, 8))


def _flat_memoryview(a: np.ndarray) -> memoryview | None:
    """A 1-d memoryview of a slot's (C-contiguous) leaf in numpy's own format, for item and row stores."""
    if not _item_format_ok(a.dtype) or a.nbytes == 0:
        return None
    m = a.data  # memoryview(a), as typed for Python 3.11 (ndarray is a Buffer in numpy's stubs from 3.12 only)
    return m.cast("B").cast(m.format)  # type: ignore[call-overload]  # the leaf's format, known at run time only


class ItemStore:
    """add()'s fast path for one buffered flat-dict timescale: check every leaf of a step, then store them.

    Python's per-bytecode cost, not numpy's copy, dominates an add of small items, so the check
    is one straight-line function made for the timescale when the Writer starts (like the
    ``__init__`` that ``dataclasses`` writes): per leaf a chain of identity tests on the item's type,
    each with the store that type gets, then the stores. No user text goes into its source: keys,
    dtypes and bounds are passed in by name. ``source`` keeps the text, for reading. ``fn(data, i,
    arrs, mvs)`` stores step ``data`` at index ``i`` of the slot whose views :func:`slot_views` made.

    The routes, per leaf (all give the same bits as numpy's assignment of the same item; the costs
    are per store on a 2-core machine, from the design page):

    - a numpy integer or bool scalar of the leaf's own type, or a Python bool: an item store
      through the slot's memoryview (``mv[i] = x``, 30-60 ns against numpy's 50-110), no numpy call;
    - a Python int within the leaf's range (integer leaves), or within +-2**53 (float leaves), and a
      Python float within float32's finite range (float32 leaves; any, for float64): the same item
      store. Outside these ranges the general path decides (its range error, numpy's overflow);
    - a numpy float scalar of the leaf's own type: numpy's own store (through a C double, a
      memoryview store would quiet a signalling NaN);
    - an ndarray of the leaf's exact dtype and item shape: for a 1-d item of a memoryview-able
      dtype, a row store through the memoryview (``mv[a:b] = x``, a plain copy, ~100 ns against
      numpy's ~210); otherwise numpy's ``arr[i] = x``;
    - anything else (other dtypes, a leading 1, Python numbers out of range, ``__array__``
      objects, a missing key): the general path, :class:`shmbuf._coerce.LeafCoercer`, then numpy's
      store; it raises before anything is stored if the item is refused.
    """

    __slots__ = ("fn", "source")

    def __init__(self, ts: PreparedTimescale):
        spec = ts.spec
        ns: dict[str, Any] = {"ndarray": np.ndarray, "MISSING": MISSING, "slow": LeafCoercer(spec, ts.keys or ())}
        checks, stores = [], []
        for j, (key, leaf) in enumerate(zip(ts.keys or (), spec.leaves)):
            dt, mv = leaf.dtype, _item_format_ok(leaf.dtype) and leaf.nbytes > 0
            ns[f"K{j}"], ns[f"DT{j}"], ns[f"SH{j}"] = key, dt, leaf.item_shape
            x, item, general = f"x{j}", f"d{j} = mvs[{j}]; k{j} = i", f"d{j} = arrs[{j}]; k{j} = i"
            lines = [f"{x} = data.get(K{j}, MISSING)"]
            if leaf.item_shape == ():
                ns[f"NT{j}"] = dt.type
                lines.append(f"t = type({x})")
                lines.append(f"if t is NT{j}: {item if mv and dt.kind in 'biu' else general}")
                if mv:
                    lines.append(f"elif t is bool: {item}")
                    if dt.kind in "iu":
                        ns[f"IL{j}"], ns[f"IH{j}"] = int(np.iinfo(dt).min), int(np.iinfo(dt).max)
                    elif dt.kind == "f":  # ints a double holds exactly: then one rounding, as numpy's
                        ns[f"IL{j}"], ns[f"IH{j}"] = -(2**53), 2**53
                        lim = _F32_MAX if dt.itemsize == 4 else math.inf
                        ns[f"FL{j}"], ns[f"FH{j}"] = -lim, lim
                        lines.append(f"elif t is float and FL{j} <= {x} <= FH{j}: {item}")
                    if dt.kind in "iuf":
                        lines.append(f"elif t is int and IL{j} <= {x} <= IH{j}: {item}")
                lines.append(f"elif t is ndarray and {x}.dtype is DT{j} and {x}.shape == (): {general}")
            else:
                exact = f"type({x}) is ndarray and {x}.dtype is DT{j} and {x}.shape == SH{j}"
                if mv and len(leaf.item_shape) == 1:
                    n = leaf.item_shape[0]
                    ns[f"ROWS{j}"] = tuple(slice(r * n, r * n + n) for r in range(spec.capacity))
                    lines.append(f"if {exact}: d{j} = mvs[{j}]; k{j} = ROWS{j}[i]")
                else:
                    lines.append(f"if {exact}: {general}")
            lines.append(f"else: {x} = slow({j}, {x}, data); {general}")
            checks += lines
            stores.append(f"d{j}[k{j}] = {x}")
        body = "\n".join("    " + ln for ln in checks + stores)
        self.source = f"def store(data, i, arrs, mvs):\n{body}\n"
        # exec of our own text: no user input in it (the timescale's name goes only into the file name)
        exec(compile(self.source, f"<shmbuf add() of timescale {spec.name!r}>", "exec"), ns)  # noqa: S102  # our text (above)
        self.fn = ns["store"]
