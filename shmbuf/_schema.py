"""The schema: an example pytree turned into a layout contract.

The example is a dict whose top-level keys are *timescales*; below each key
is any tree of dicts, lists, tuples, namedtuples and ``None`` whose leaves are
numpy arrays. A timescale is

- **buffered** when every leaf shares a leading dim ``N > 1``: its capacity is
  ``N`` and each ``add()`` writes one item, of shape ``leaf.shape[1:]``;
- **single-item** when some leaf is 0-d or every leaf has leading dim 1: its
  capacity is 1, one ``add()`` writes the whole leaf, and a second one before
  ``commit()`` or ``reset()`` raises ``TimescaleFull``.

These are InstaDeep echo's ``TrajectoryAccumulator`` rules, kept to the letter
so that an echo example means the same thing here.

Leaf order is deterministic and is optree's: timescales and dict keys sorted,
sequences in order. The schema round-trips through msgpack with nothing lost
(structure, paths, dtypes, shapes, kinds), so a process that knows only a
segment's name rebuilds every view from it, and never unpickles anything.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import optree

from shmbuf._errors import SchemaError, SegmentError

SCHEMA_MAGIC = "shmbuf.schema"
SCHEMA_VERSION = 1
ALIGN = 64
# Numeric kinds only: bool, signed, unsigned, float, complex. Object, string,
# structured and datetime dtypes have no business in a rollout buffer.
_DTYPE_KINDS = frozenset("biufc")
# A bound on what a schema may declare, so a corrupt header cannot make us
# build millions of views before the size check catches it.
MAX_LEAVES = 65536
MAX_NDIM = 32
# Containers nested deeper than this are refused, in an example and in bytes read from a segment:
# every walk over a tree recurses once per level, and Python's stack ends near 1000 frames.
MAX_DEPTH = 64

PathEntry = str | int
Path = tuple[PathEntry, ...]


def format_path(path: Path) -> str:
    """``('step', 'obs', 0)`` → ``"step/obs/0"``."""
    return "/".join(str(p) for p in path) if path else "<root>"


def _native(dtype: np.dtype) -> np.dtype:
    """Slots hold native byte order; a big-endian example leaf means the same values."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Leaf:
    """One array of a timescale: where it sits in the tree and what it holds.

    ``shape`` is the leaf's full shape in one slot (for a buffered timescale
    it starts with the capacity); ``item_shape`` is what one ``add()`` writes.
    ``nbytes`` is the leaf's size in one slot, ``stride`` that size rounded up
    to 64 bytes: the distance between the same leaf of two adjacent slots.
    """

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    item_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def stride(self) -> int:
        return _align(max(self.nbytes, 1))

    @property
    def name(self) -> str:
        return format_path(self.path)


@dataclass(frozen=True)
class Timescale:
    """A top-level key of the example: buffered (capacity N) or single-item."""

    name: str
    buffered: bool
    capacity: int
    leaves: tuple[Leaf, ...]
    structure: Any  # the msgpack-able encoding of the subtree's nodes
    treespec: optree.PyTreeSpec  # of the subtree, leaves in order

    @property
    def kind(self) -> str:
        return "buffered" if self.buffered else "single-item"


# ---------------------------------------------------------------- structure
# A node encodes as a list whose first element names its type. Leaves carry
# their index in the timescale's leaf order.


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _too_deep(path: Path) -> bool:
    return len(path) > MAX_DEPTH  # a path grows by one entry per level (the timescale is its first)


def _encode(node: Any, path: Path, out: list[tuple[Path, Any]]) -> Any:
    if _too_deep(path):
        raise SchemaError(f"at {format_path(path[:4])}/...: containers are nested more than {MAX_DEPTH} deep")
    if isinstance(node, (np.ndarray, np.generic)):
        out.append((path, node))
        return ["leaf", len(out) - 1]
    if node is None:
        return ["none"]
    if isinstance(node, Mapping):
        if not isinstance(node, dict):
            raise SchemaError(
                f"at {format_path(path)}: expected a dict, list, tuple, namedtuple or numpy array, got {type(node).__name__}"
            )
        for k in node:
            if not isinstance(k, str):
                raise SchemaError(f"at {format_path(path)}: dict keys must be str, got {k!r} ({type(k).__name__})")
        ordered = isinstance(node, collections.OrderedDict)
        keys = list(node) if ordered else sorted(node)
        children = [_encode(node[k], (*path, k), out) for k in keys]
        return ["odict" if ordered else "dict", keys, children]
    if _is_namedtuple(node):
        fields = list(type(node)._fields)
        children = [_encode(v, (*path, f), out) for f, v in zip(fields, node)]
        return ["namedtuple", type(node).__name__, fields, children]
    if isinstance(node, (list, tuple)):
        children = [_encode(v, (*path, i), out) for i, v in enumerate(node)]
        return ["list" if isinstance(node, list) else "tuple", children]
    kind = type(node)
    if kind.__module__.split(".")[0] == "torch" and hasattr(node, "numpy"):
        fix = "pass tensor.detach().cpu().numpy() (or np.zeros(shape, dtype)): the example's leaves are numpy arrays"
    else:
        fix = "wrap Python numbers in np.asarray(...) with the dtype you want"
    if len(path) > 1 and isinstance(path[-1], int):  # the parent is a list or tuple
        fix += (f"; a list or tuple is a container of leaves here, not an array: for one leaf, "
                f"pass np.asarray(...) of the whole {format_path(path[:-1])}")
    raise SchemaError(
        f"at {format_path(path)}: expected a numpy array (or a dict, list, tuple, namedtuple of them), "
        f"got {kind.__module__ + '.' if kind.__module__ not in ('builtins', '__main__') else ''}{kind.__name__}; {fix}"
    )


def _describe_node(node: Any) -> str:
    """An encoded node in words, for an error message: its kind and what tells it apart."""
    tag = node[0]
    if tag == "leaf":
        return "an array"
    if tag == "none":
        return "None"
    if tag in ("dict", "odict"):
        return f"{'an OrderedDict' if tag == 'odict' else 'a dict'} with keys {node[1]!r:.200}"
    if tag == "namedtuple":
        return f"a namedtuple {node[1]}({', '.join(node[2])})"
    items = [_describe_node(c).split(" ")[-1] if c[0] in ("leaf", "none") else c[0] for c in node[1][:8]]
    more = ", ..." if len(node[1]) > 8 else ""
    return f"a {tag} of {len(node[1])} ({', '.join(items)}{more})"


def _node_difference(a: Any, b: Any, path: Path) -> str | None:
    """``at <path>: expected <node>, got <node>`` for the first node where two encoded structures differ, or None."""
    same = a[0] == b[0]
    if same and a[0] in ("dict", "odict"):
        same = a[1] == b[1]
    elif same and a[0] in ("list", "tuple"):
        same = len(a[1]) == len(b[1]) and [c[0] for c in a[1]] == [c[0] for c in b[1]]
    elif same and a[0] == "namedtuple":
        same = a[1:3] == b[1:3]
    if not same:
        return f"at {format_path(path)}: expected {_describe_node(a)}, got {_describe_node(b)}"
    if a[0] in ("dict", "odict"):
        pairs = [((*path, k), ca, cb) for k, ca, cb in zip(a[1], a[2], b[2])]
    elif a[0] in ("list", "tuple"):
        pairs = [((*path, i), ca, cb) for i, (ca, cb) in enumerate(zip(a[1], b[1]))]
    elif a[0] == "namedtuple":
        pairs = [((*path, f), ca, cb) for f, ca, cb in zip(a[2], a[3], b[3])]
    else:
        return None
    for where, ca, cb in pairs:
        found = _node_difference(ca, cb, where)
        if found:
            return found
    return None


def _decode(node: Any, leaves: list[Any], where: str, depth: int = 1) -> Any:
    """Rebuild a template tree from its encoding, leaves taken from ``leaves``.

    The encoding may come from shared memory, so its depth is bounded before the recursion could
    be (at MAX_DEPTH, as for an example), and only the node types listed here are built.
    """
    if depth > MAX_DEPTH:
        raise SegmentError(f"schema structure at {where[:120]}: containers are nested more than {MAX_DEPTH} deep")
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise SegmentError(f"schema structure at {where}: malformed node {node!r:.80}")
    tag = node[0]
    try:
        if tag == "leaf":
            return leaves[node[1]]
        if tag == "none":
            return None
        if tag in ("dict", "odict"):
            keys, children = node[1], node[2]
            if len(keys) != len(children) or not all(isinstance(k, str) for k in keys):
                raise SegmentError(f"schema structure at {where}: bad dict node")
            pairs = [(k, _decode(c, leaves, f"{where}/{k}", depth + 1)) for k, c in zip(keys, children)]
            return collections.OrderedDict(pairs) if tag == "odict" else dict(pairs)
        if tag in ("list", "tuple"):
            items = [_decode(c, leaves, f"{where}/{i}", depth + 1) for i, c in enumerate(node[1])]
            return items if tag == "list" else tuple(items)
        if tag == "namedtuple":
            typename, fields, children = node[1], node[2], node[3]
            cls = collections.namedtuple(typename, fields)  # type: ignore[misc]  # rebuilt by name
            return cls(*[_decode(c, leaves, f"{where}/{f}", depth + 1) for f, c in zip(fields, children)])
    except SegmentError:
        raise  # from a deeper node: already names where
    except (IndexError, TypeError, ValueError) as exc:
        raise SegmentError(f"schema structure at {where[:120]}: malformed {tag!r} node ({exc})") from None
    raise SegmentError(f"schema structure at {where}: unknown node type {tag!r}")


def flatten_like(node: Any, data: Any, path: Path, out: list[Any]) -> None:
    """Append ``data``'s leaves to ``out`` in schema order, walking the encoded structure.

    Raises SchemaError naming the first path where ``data`` departs from it.
    Container classes need not be the example's own (a namedtuple rebuilt
    from a schema by name is another class), only of the same kind.
    """
    tag = node[0]
    where = format_path(path)
    if tag == "leaf":
        out.append(data)
    elif tag == "none":
        if data is not None:
            raise SchemaError(f"at {where}: expected None, got {type(data).__name__}")
    elif tag in ("dict", "odict"):
        keys = node[1]
        if not isinstance(data, Mapping):
            raise SchemaError(f"at {where}: expected a dict with keys {keys}, got {type(data).__name__}")
        if set(data) != set(keys):
            missing = [format_path((*path, k)) for k in keys if k not in data]
            extra = [format_path((*path, k)) for k in data if k not in keys]
            parts = (["missing " + ", ".join(missing)] if missing else []) + (
                ["unexpected " + ", ".join(map(str, extra))] if extra else []
            )
            raise SchemaError(f"at {where}: expected keys {keys}, got {sorted(map(str, data))} ({'; '.join(parts)})")
        for k, child in zip(keys, node[2]):
            flatten_like(child, data[k], (*path, k), out)
    else:
        children = node[3] if tag == "namedtuple" else node[1]
        kind = {"list": "list", "tuple": "tuple", "namedtuple": f"namedtuple {node[1]}"}[tag]
        if not isinstance(data, (list, tuple)) or len(data) != len(children):
            got = f"{type(data).__name__} of length {len(data)}" if isinstance(data, (list, tuple)) else type(data).__name__
            raise SchemaError(f"at {where}: expected a {kind} of length {len(children)}, got {got}")
        names = node[2] if tag == "namedtuple" else range(len(children))
        for name, child, item in zip(names, children, data):
            flatten_like(child, item, (*path, name), out)


# ------------------------------------------------------------------- schema


class Schema:
    """The layout contract built from an example pytree.

    Build it with :meth:`from_example`; send it with :meth:`to_msgpack` and
    rebuild it with :meth:`from_msgpack`. Two schemas are equal when their
    fingerprints are.
    """

    __slots__ = ("timescales", "by_name", "fingerprint", "_packed")

    def __init__(self, timescales: list[Timescale]):
        self.timescales: tuple[Timescale, ...] = tuple(timescales)
        self.by_name: dict[str, Timescale] = {ts.name: ts for ts in timescales}
        self._packed = msgpack.packb(self._to_obj(), use_bin_type=True)
        self.fingerprint: str = hashlib.sha256(self._packed).hexdigest()[:16]

    # -- construction -------------------------------------------------------

    @classmethod
    def from_example(cls, example: Any) -> Schema:
        """Validate ``example`` once and record its structure, dtypes and shapes."""
        if not isinstance(example, dict):
            raise SchemaError(
                "the example must be a dict whose keys are timescale names (e.g. 'step', 'episode'), "
                f"got {type(example).__name__}"
            )
        if not example:
            raise SchemaError("the example has no timescales: expected a dict such as {'step': {...}, 'episode': {...}}")
        timescales = []
        for name in sorted(example):
            if not isinstance(name, str):
                raise SchemaError(f"timescale names must be str, got {name!r} ({type(name).__name__})")
            found: list[tuple[Path, Any]] = []
            structure = _encode(example[name], (name,), found)
            if not found:
                raise SchemaError(f"timescale '{name}' has no array leaves")
            arrays = [(p, np.asarray(a)) for p, a in found]
            for p, a in arrays:
                if a.dtype.kind not in _DTYPE_KINDS or a.dtype.fields is not None:
                    raise SchemaError(
                        f"leaf {format_path(p)}: expected a bool, integer, float or complex dtype, got {a.dtype}"
                    )
            timescales.append(cls._timescale(name, structure, arrays))
        schema = cls(timescales)
        if sum(len(ts.leaves) for ts in schema.timescales) > MAX_LEAVES:
            raise SchemaError(f"the example has more than {MAX_LEAVES} leaves")
        return schema

    @staticmethod
    def _timescale(name: str, structure: Any, arrays: list[tuple[Path, np.ndarray]]) -> Timescale:
        shapes = [a.shape for _, a in arrays]
        single = any(len(s) == 0 for s in shapes) or all(s[0] == 1 for s in shapes)
        if single:
            capacity = 1
            leaves = [Leaf(p, _native(a.dtype), a.shape, a.shape) for p, a in arrays]
        else:
            leading = [s[0] for s in shapes]
            if any(n != leading[0] for n in leading):
                detail = ", ".join(f"{format_path(p)}: {a.shape[0]}" for p, a in arrays)
                raise SchemaError(
                    f"all leaves of buffered timescale '{name}' must share the same leading dimension "
                    f"(got {detail}); make any leaf 0-d, or give every leaf a leading 1, "
                    "to mark the timescale single-item instead"
                )
            capacity = leading[0]
            leaves = [Leaf(p, _native(a.dtype), a.shape, a.shape[1:]) for p, a in arrays]
        template = _decode(structure, list(range(len(leaves))), name)
        order, treespec = optree.tree_flatten(template)
        if order != list(range(len(leaves))):  # pragma: no cover - guards our walk against optree's
            raise SchemaError(f"timescale '{name}': leaf order disagrees with optree's ({order})")
        return Timescale(name, not single, capacity, tuple(leaves), structure, treespec)

    # -- msgpack ------------------------------------------------------------

    def _to_obj(self) -> dict[str, Any]:
        return {
            "magic": SCHEMA_MAGIC,
            "version": SCHEMA_VERSION,
            "timescales": [
                {
                    "name": ts.name,
                    "buffered": ts.buffered,
                    "capacity": ts.capacity,
                    "structure": ts.structure,
                    "leaves": [[list(lf.path), lf.dtype.str, list(lf.shape)] for lf in ts.leaves],
                }
                for ts in self.timescales
            ],
        }

    def to_msgpack(self) -> bytes:
        """The schema as msgpack bytes (deterministic: equal schemas, equal bytes)."""
        return self._packed

    @classmethod
    def from_msgpack(cls, data: bytes) -> Schema:
        """Rebuild a schema from :meth:`to_msgpack` bytes; anything malformed is a :class:`SegmentError`."""
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
        except Exception as exc:  # noqa: BLE001  # msgpack raises several unrelated types on garbage
            raise SegmentError(f"the schema is not valid msgpack ({type(exc).__name__}: {exc})") from None
        if not isinstance(obj, dict) or obj.get("magic") != SCHEMA_MAGIC:
            raise SegmentError("the schema does not start with the shmbuf schema magic")
        if obj.get("version") != SCHEMA_VERSION:
            raise SegmentError(f"schema version {obj.get('version')!r} is not supported (expected {SCHEMA_VERSION})")
        raw_ts = obj.get("timescales")
        if not isinstance(raw_ts, list) or not raw_ts:
            raise SegmentError("the schema has no timescales")
        timescales = []
        total = 0
        for i, t in enumerate(raw_ts):
            try:
                name, buffered, capacity = t["name"], t["buffered"], t["capacity"]
                structure, raw_leaves = t["structure"], t["leaves"]
            except (TypeError, KeyError) as exc:
                raise SegmentError(f"schema timescale #{i}: missing field {exc}") from None
            if not isinstance(name, str) or not isinstance(buffered, bool) or not isinstance(capacity, int):
                raise SegmentError(f"schema timescale #{i}: bad name/kind/capacity")
            if not isinstance(raw_leaves, list) or not raw_leaves:
                raise SegmentError(f"schema timescale '{name}': no leaves")
            total += len(raw_leaves)
            if total > MAX_LEAVES:
                raise SegmentError(f"schema declares more than {MAX_LEAVES} leaves")
            arrays = []
            for j, rl in enumerate(raw_leaves):
                if not (isinstance(rl, list) and len(rl) == 3):
                    raise SegmentError(f"schema timescale '{name}' leaf #{j}: malformed")
                path, dstr, shape = rl
                if (
                    not isinstance(path, list)
                    or not all(isinstance(p, (str, int)) for p in path)
                    or not isinstance(dstr, str)
                    or not isinstance(shape, list)
                    or len(shape) > MAX_NDIM
                    or not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)
                ):
                    raise SegmentError(f"schema timescale '{name}' leaf #{j}: malformed path, dtype or shape")
                try:
                    dtype = np.dtype(dstr)
                except Exception:  # noqa: BLE001  # TypeError mostly, but np.dtype parses some strings with ast: SyntaxError
                    raise SegmentError(f"schema leaf {format_path(tuple(path))}: unknown dtype {dstr!r}") from None
                if dtype.kind not in _DTYPE_KINDS or dtype.fields is not None:
                    raise SegmentError(f"schema leaf {format_path(tuple(path))}: dtype {dstr!r} is not allowed")
                arrays.append((tuple(path), _Proto(dtype, tuple(shape))))
            # Rebuild through the same rules, then check the result says what the bytes said.
            try:
                ts = cls._timescale(name, structure, arrays)  # type: ignore[arg-type]  # _Proto: an array's dtype and shape only
            except SchemaError as exc:
                raise SegmentError(f"schema timescale '{name}': {exc}") from None
            if ts.buffered != buffered or ts.capacity != capacity or [lf.path for lf in ts.leaves] != [p for p, _ in arrays]:
                raise SegmentError(f"schema timescale '{name}': kind, capacity or leaf paths are inconsistent")
            timescales.append(ts)
        names = [t.name for t in timescales]
        if names != sorted(names) or len(set(names)) != len(names):
            raise SegmentError("schema timescales are not in sorted order or repeat")
        schema = cls(timescales)
        if schema.to_msgpack() != data:
            raise SegmentError("the schema does not re-encode to the same bytes (not canonical)")
        return schema

    # -- comparison ---------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other._packed == self._packed

    def __hash__(self) -> int:
        return hash(self._packed)

    def __repr__(self) -> str:
        parts = ", ".join(f"{ts.name}: {ts.kind} x{ts.capacity}, {len(ts.leaves)} leaves" for ts in self.timescales)
        return f"Schema({parts}; fingerprint {self.fingerprint})"

    def first_difference(self, other: Schema) -> str | None:
        """A sentence naming the first leaf (or timescale) where two schemas differ, or None."""
        mine, theirs = self.by_name, other.by_name
        if list(mine) != list(theirs):
            return f"timescales: expected {sorted(mine)}, got {sorted(theirs)}"
        for name, ts in mine.items():
            ot = theirs[name]
            for a, b in zip(ts.leaves, ot.leaves):
                if a.path != b.path:
                    if a.name == b.name:  # a dict keyed '0' where the pipeline has a list: the containers say it
                        return _node_difference(ts.structure, ot.structure, (name,)) or (
                            f"timescale '{name}': expected leaf {a.name} under a {type(a.path[-2]).__name__} key, "
                            f"got it under a {type(b.path[-2]).__name__} key")
                    return f"timescale '{name}': expected leaf {a.name}, got leaf {b.name}"
                if a.dtype != b.dtype or a.shape != b.shape:
                    return f"leaf {a.name}: expected {a.dtype} {a.shape}, got {b.dtype} {b.shape}"
            if len(ts.leaves) != len(ot.leaves):
                longer = ts.leaves if len(ts.leaves) > len(ot.leaves) else ot.leaves
                extra = longer[min(len(ts.leaves), len(ot.leaves))]
                side = "missing" if longer is ts.leaves else "extra"
                return f"timescale '{name}': {side} leaf {extra.name}"
            if ts.structure != ot.structure:
                return _node_difference(ts.structure, ot.structure, (name,)) or (
                    f"timescale '{name}': same leaves, different container types")
        return None

    def summary(self) -> str:
        """One line per timescale, for ``shmbuf ls`` and error messages."""
        return "; ".join(
            f"{ts.name}[{ts.kind} x{ts.capacity}]: " + ", ".join(f"{lf.name} {lf.dtype} {lf.shape}" for lf in ts.leaves)
            for ts in self.timescales
        )

    @property
    def leaves(self) -> list[Leaf]:
        """Every leaf, timescale by timescale, in the deterministic order."""
        return [lf for ts in self.timescales for lf in ts.leaves]

    def zeros(self, batch: tuple[int, ...] = ()) -> dict[str, Any]:
        """A tree shaped like the example (with optional leading ``batch`` dims), filled with zeros."""
        return {
            ts.name: optree.tree_unflatten(ts.treespec, [np.zeros(batch + lf.shape, lf.dtype) for lf in ts.leaves])
            for ts in self.timescales
        }


class _Proto:
    """Stands in for an array when a schema is rebuilt from bytes: dtype and shape only."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]):
        self.dtype = dtype
        self.shape = shape
