"""The ``[num_envs, T+1]`` buffer's layout: its fields (:class:`Field`: trailing shape, dtype, kind), their settings,
the pipeline's example made from them and read back from a schema (:class:`Layout`), and the check of an array
written into a field. Public through :mod:`shmbuf.storage.buffer`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import shmbuf
from shmbuf._errors import SchemaError, UsageError
from shmbuf._validate import int_setting

OBSERVATION = "observation"
TRANSITION = "transition"
KINDS = (OBSERVATION, TRANSITION)


@dataclass(frozen=True)
class Field:
    """One field of the rollout: its trailing ``shape`` (after ``[num_envs, T+1]``), dtype and kind."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str

    def full_shape(self, num_envs: int, rollout_len: int) -> tuple[int, ...]:
        return (num_envs, rollout_len + 1, *self.shape)

    def describe(self) -> str:
        trail = "".join(f", {d}" for d in self.shape)
        return f"field '{self.name}' ({self.kind}-aligned, [num_envs, T+1{trail}] {self.dtype})"


def dim_setting(value: Any, setting: str) -> tuple[int, ...]:
    """An int >= 1 or a tuple of ints >= 0 (a trailing shape); else UsageError naming the setting."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 1:
            raise UsageError(f"{setting}: expected an int >= 1 or a shape tuple, got {value!r}")
        return (int(value),)
    if isinstance(value, (tuple, list)) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                                                 for d in value):
        return tuple(int(d) for d in value)
    raise UsageError(f"{setting}: expected an int >= 1 or a tuple of ints >= 0, got {value!r}")


def dtype_setting(value: Any, setting: str) -> np.dtype:
    """A numpy bool, integer, float or complex dtype; else UsageError naming the setting."""
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "biufc" or dt.fields is not None:
        raise UsageError(f"{setting}: expected a numpy bool, integer, float or complex dtype, got {value!r}")
    return dt


def merge_fields(base: dict[str, Field], extra: Mapping[str, Any] | None, where: str) -> dict[str, Field]:
    """``fields=``: name -> (shape, dtype), (shape, dtype, kind) or a :class:`Field` adds or overrides; name -> None
    removes (``where``: the constructor, for messages)."""
    out = dict(base)
    if extra is None:
        return out
    if not isinstance(extra, Mapping):
        raise UsageError(f"{where}(fields=...): expected a dict of name -> (shape, dtype[, kind]), "
                         f"got {type(extra).__name__}")
    for name, spec in extra.items():
        at = f"{where}(fields={{{name!r}: ...}})"
        if not isinstance(name, str) or not name or name.startswith("_") or "/" in name:
            raise UsageError(f"{at}: a field name must be a non-empty str not starting with '_' and without '/'")
        if spec is None:
            out.pop(name, None)
            continue
        if isinstance(spec, Field):
            out[name] = Field(name, dim_setting(spec.shape, at), dtype_setting(spec.dtype, at), spec.kind)
            if spec.kind not in KINDS:
                raise UsageError(f"{at}: kind must be one of {KINDS}, got {spec.kind!r}")
            continue
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise UsageError(f"{at}: expected (shape, dtype) or (shape, dtype, kind), or None to remove it, got {spec!r}")
        old = out.get(name)
        kind = spec[2] if len(spec) == 3 else (old.kind if old is not None else TRANSITION)
        if kind not in KINDS:
            raise UsageError(f"{at}: kind must be one of {KINDS}, got {kind!r}")
        shape = spec[0] if isinstance(spec[0], (tuple, list)) else dim_setting(spec[0], at)
        out[name] = Field(name, dim_setting(tuple(shape), at), dtype_setting(spec[1], at), kind)
    return out


class Layout:
    """The fields of a rollout and its sizes; builds the pipeline's example, or reads it back from a schema."""

    def __init__(self, num_envs: int, rollout_len: int, fields: dict[str, Field], where: str = "SlotBuffer"):
        for setting, v in (("num_envs", num_envs), ("rollout_len", rollout_len)):
            int_setting(f"{where}({setting}=...)", v, 1)
        if not fields:
            raise UsageError(f"{where}: no fields left (fields= removed them all)")
        for f in fields.values():
            if f.kind == OBSERVATION and f"next_{f.name}" in fields:
                raise UsageError(f"{where}: field 'next_{f.name}' clashes with the next_{f.name} that "
                                 f"transition_view makes of observation-aligned field '{f.name}'; rename it")
        self.num_envs, self.rollout_len = int(num_envs), int(rollout_len)
        self.fields = dict(sorted(fields.items()))
        self.obs_fields = tuple(n for n, f in self.fields.items() if f.kind == OBSERVATION)

    def example(self) -> dict[str, Any]:
        """The pipeline's example: zero-stride arrays (only their shape and dtype are read)."""
        out: dict[str, Any] = {}
        for f in self.fields.values():
            shape = f.full_shape(self.num_envs, self.rollout_len)
            out.setdefault(f.kind, {})[f.name] = np.broadcast_to(np.zeros((), f.dtype), shape)
        return out

    @classmethod
    def from_schema(cls, schema: shmbuf.Schema, name: str) -> Layout:
        """The layout of a pipeline made by a SlotBuffer (a RolloutBuffer is one); SchemaError if it is not one."""
        fields: dict[str, Field] = {}
        sizes = set()
        for leaf in schema.leaves:
            ok = len(leaf.path) == 2 and leaf.path[0] in KINDS and isinstance(leaf.path[1], str) and len(leaf.shape) >= 2
            if not ok:
                raise SchemaError(f"pipeline {name} is not a RolloutBuffer's or SlotBuffer's: leaf {leaf.name} of shape "
                                  f"{leaf.shape} is not '{OBSERVATION}/<field>' or '{TRANSITION}/<field>' of shape "
                                  "[num_envs, T+1, ...]")
            kind, key = leaf.path
            assert isinstance(kind, str) and isinstance(key, str)  # `ok` checked both (KINDS are strs)
            sizes.add(leaf.shape[:2])
            fields[key] = Field(key, tuple(leaf.shape[2:]), leaf.dtype, kind)
        if len(sizes) != 1:
            raise SchemaError(f"pipeline {name} is not a RolloutBuffer's or SlotBuffer's: its leaves disagree on "
                              f"[num_envs, T+1]: {sorted(sizes)}")
        (n, t1), = sizes
        return cls(n, t1 - 1, fields)


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is ``a`` seen through another array object (same memory, shape, strides and dtype)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def checked_array(f: Field, x: Any, shapes: tuple[tuple[int, ...], ...], what: str) -> np.ndarray:
    """``x`` as an array that may be assigned to ``f``: one of ``shapes``, a dtype that casts 'same_kind'."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as exc:  # noqa: BLE001  # anything __array__ raises (a torch tensor needing grad, on a GPU)
            raise SchemaError(f"{f.describe()}: {what}: could not read a {type(x).__name__} as a numpy array "
                              f"({type(exc).__name__}: {exc}); pass a CPU array") from None
    if x.dtype.kind not in "biufc" or not np.can_cast(x.dtype, f.dtype, casting="same_kind"):
        raise SchemaError(f"{f.describe()}: {what}: expected dtype {f.dtype} (or one that casts to it under numpy's "
                          f"'same_kind' rule), got {x.dtype}")
    if x.shape not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise SchemaError(f"{f.describe()}: {what}: expected shape {want}, got {x.shape}")
    return x
