"""The [num_envs, T+1] rollout buffer (embodichain's ``RolloutBuffer``), living in a shmbuf pipeline.

Every field shares the batch shape ``[num_envs, T+1]``. *Observation-aligned* fields (``obs``,
``value``) use all T+1 rows: row T is the bootstrap observation and its value. *Transition-only*
fields (``action``, ``sample_log_prob``, ``reward``, ``done``, ``terminated``, ``truncated``) hold T
valid rows; row T is padding, zeroed by ``start_rollout()``. :func:`transition_view` drops the
padding and exposes ``obs[:, :T]`` and ``next_obs = obs[:, 1:]`` (likewise ``value``/``next_value``),
all views.

Each rollout is a slot of a shmbuf pipeline: ``start_rollout()`` returns that slot's shared memory
as a :class:`RolloutSlot` of writable ``[num_envs, T+1, ...]`` views, ``add()`` commits it, and the
learner's ``get()`` reads it in place. One process can do both sides (embodichain's usual use, with
``slots`` rollouts in flight instead of one); an actor in another process does the writing side with
``RolloutBuffer.writer(handle)``.

The layout is the pipeline's schema: two timescales, ``"observation"`` and ``"transition"``, each a
flat dict of field name to a ``[num_envs, T+1, *shape]`` leaf, so a process that knows only the
pipeline's name knows every field, its dtype, shape and alignment.

Given a ``device`` (embodichain's fifth argument), the buffer speaks embodichain's types:
``start_rollout()``, ``buffer`` and ``get()`` give TensorDicts (tensordict must be installed) of torch
tensors on that device; on the CPU those tensors are the slot's shared memory itself. Without one,
every rollout is a dict of numpy arrays.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import shmbuf
from shmbuf._errors import BufferEmpty, BufferFull, PipelineClosed, SchemaError, SlotTimeout, StaleRollout, UsageError
from shmbuf._validate import int_setting, timeout_setting
from shmbuf.layout import ACTION, OBS, REWARD, TERMINATED, TRUNCATED
from shmbuf.storage._buffer_views import (
    as_tensordict,
    is_tensordict,
    iterate_minibatches,
    tensordict_class,
    torch_device,
    transition_view,
)
from shmbuf.storage._torch import to_torch

__all__ = [
    "BufferEmpty", "BufferFull", "Field", "RolloutBuffer", "RolloutBufferWriter", "RolloutSlot", "iterate_minibatches",
    "to_torch", "transition_view",
]

OBSERVATION = "observation"
TRANSITION = "transition"
KINDS = (OBSERVATION, TRANSITION)
_DEFAULT = object()


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


# -- the layout --------------------------------------------------------------


def _dim(value: Any, setting: str) -> tuple[int, ...]:
    """An int >= 1 or a tuple of ints >= 0 (a trailing shape); else UsageError naming the setting."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 1:
            raise UsageError(f"{setting}: expected an int >= 1 or a shape tuple, got {value!r}")
        return (int(value),)
    if isinstance(value, (tuple, list)) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                                                 for d in value):
        return tuple(int(d) for d in value)
    raise UsageError(f"{setting}: expected an int >= 1 or a tuple of ints >= 0, got {value!r}")


def _dtype(value: Any, setting: str) -> np.dtype:
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "biufc" or dt.fields is not None:
        raise UsageError(f"{setting}: expected a numpy bool, integer, float or complex dtype, got {value!r}")
    return dt


def default_fields(obs_dim: Any, action_dim: Any, dtype: Any = np.float32) -> dict[str, Field]:
    """embodichain's fields: obs, action, sample_log_prob, value, reward, done, terminated, truncated."""
    fdt = _dtype(dtype, "RolloutBuffer(dtype=...)")
    b = np.dtype(bool)
    specs = {
        OBS: (_dim(obs_dim, "RolloutBuffer(obs_dim=...)"), fdt, OBSERVATION),
        ACTION: (_dim(action_dim, "RolloutBuffer(action_dim=...)"), fdt, TRANSITION),
        "sample_log_prob": ((), fdt, TRANSITION),
        "value": ((), fdt, OBSERVATION),
        REWARD: ((), fdt, TRANSITION),
        "done": ((), b, TRANSITION),
        TERMINATED: ((), b, TRANSITION),
        TRUNCATED: ((), b, TRANSITION),
    }
    return {name: Field(name, *spec) for name, spec in specs.items()}


def _merge_fields(base: dict[str, Field], extra: Mapping[str, Any] | None) -> dict[str, Field]:
    """``fields=``: name -> (shape, dtype) or (shape, dtype, kind) adds or overrides; name -> None removes."""
    out = dict(base)
    if extra is None:
        return out
    if not isinstance(extra, Mapping):
        raise UsageError("RolloutBuffer(fields=...): expected a dict of name -> (shape, dtype[, kind]), "
                         f"got {type(extra).__name__}")
    for name, spec in extra.items():
        where = f"RolloutBuffer(fields={{{name!r}: ...}})"
        if not isinstance(name, str) or not name or name.startswith("_") or "/" in name:
            raise UsageError(f"{where}: a field name must be a non-empty str not starting with '_' and without '/'")
        if spec is None:
            out.pop(name, None)
            continue
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise UsageError(f"{where}: expected (shape, dtype) or (shape, dtype, kind), or None to remove it, got {spec!r}")
        old = out.get(name)
        kind = spec[2] if len(spec) == 3 else (old.kind if old is not None else TRANSITION)
        if kind not in KINDS:
            raise UsageError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
        shape = spec[0] if isinstance(spec[0], (tuple, list)) else _dim(spec[0], where)
        out[name] = Field(name, _dim(tuple(shape), where), _dtype(spec[1], where), kind)
    return out


class Layout:
    """The fields of a rollout and its sizes; builds the pipeline's example, or reads it back from a schema."""

    def __init__(self, num_envs: int, rollout_len: int, fields: dict[str, Field]):
        for setting, v in (("num_envs", num_envs), ("rollout_len", rollout_len)):
            int_setting(f"RolloutBuffer({setting}=...)", v, 1)
        if not fields:
            raise UsageError("RolloutBuffer: no fields left (fields= removed them all)")
        for f in fields.values():
            if f.kind == OBSERVATION and f"next_{f.name}" in fields:
                raise UsageError(f"RolloutBuffer: field 'next_{f.name}' clashes with the next_{f.name} that "
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
        """The layout of a pipeline made by a RolloutBuffer; SchemaError if it is not one."""
        fields: dict[str, Field] = {}
        sizes = set()
        for leaf in schema.leaves:
            ok = len(leaf.path) == 2 and leaf.path[0] in KINDS and isinstance(leaf.path[1], str) and len(leaf.shape) >= 2
            if not ok:
                raise SchemaError(f"pipeline {name} is not a RolloutBuffer's: leaf {leaf.name} of shape {leaf.shape} is not "
                                  f"'{OBSERVATION}/<field>' or '{TRANSITION}/<field>' of shape [num_envs, T+1, ...]")
            kind, key = leaf.path
            assert isinstance(kind, str) and isinstance(key, str)  # `ok` checked both (KINDS are strs)
            sizes.add(leaf.shape[:2])
            fields[key] = Field(key, tuple(leaf.shape[2:]), leaf.dtype, kind)
        if len(sizes) != 1:
            raise SchemaError(f"pipeline {name} is not a RolloutBuffer's: its leaves disagree on [num_envs, T+1]: "
                              f"{sorted(sizes)}")
        (n, t1), = sizes
        return cls(n, t1 - 1, fields)


# -- checking what is written ------------------------------------------------


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is ``a`` seen through another array object (same memory, shape, strides and dtype)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _checked(f: Field, x: Any, shapes: tuple[tuple[int, ...], ...], what: str) -> np.ndarray:
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


class RolloutSlot(MutableMapping):
    """A rollout being written: field name -> writable ``[num_envs, T+1, ...]`` view of the shared slot.

    ``slot["obs"][:, t] = obs`` writes straight into shared memory (numpy's own rules); the checked
    ways are ``slot["reward"] = array`` (the whole field: ``[num_envs, T+1, ...]``, or ``[num_envs, T,
    ...]`` for a transition-only field, copied in) and :meth:`set_step`. Both check the field name,
    shape and dtype (``same_kind`` casting) before writing anything, and raise :class:`SchemaError`
    naming the field. A field cannot be replaced by another array or removed: the slot is the layout.

    Lifetime: until ``add()`` commits it (or the writer closes). After that every access raises
    :class:`StaleRollout`; arrays taken out earlier cannot know, and writing through them would
    change a rollout the learner may be reading.
    """

    def __init__(self, layout: Layout, views: dict[str, np.ndarray]):
        self._layout = layout
        self._views = views
        self._live = True

    def _live_views(self) -> dict[str, np.ndarray]:
        if not self._live:
            raise StaleRollout("this rollout was committed by add() (or its writer closed): its slot belongs to the learner "
                               "now; call start_rollout() for the next one")
        return self._views

    def _field(self, name: Any) -> Field:
        f = self._layout.fields.get(name)
        if f is None:
            raise SchemaError(f"unknown field {name!r}; this rollout's fields are {list(self._layout.fields)}")
        return f

    def __getitem__(self, name: str) -> np.ndarray:
        views = self._live_views()
        self._field(name)
        return views[name]

    def __setitem__(self, name: str, value: Any) -> None:
        views = self._live_views()
        f = self._field(name)
        view = views[name]
        if value is view:
            return
        n, t = self._layout.num_envs, self._layout.rollout_len
        shapes = (f.full_shape(n, t),) if f.kind == OBSERVATION else (f.full_shape(n, t), (n, t, *f.shape))
        x = _checked(f, value, shapes, "a whole-field write")
        view[:, : x.shape[1]] = x

    def __delitem__(self, name: str) -> None:
        self._field(name)
        raise SchemaError(f"field {name!r} cannot be removed: a rollout's fields are its pipeline's layout")

    def __iter__(self) -> Iterator[str]:
        return iter(self._live_views())

    def __len__(self) -> int:
        return len(self._views)

    def set_step(self, t: int, data: Mapping[str, Any]) -> None:
        """Write time index ``t`` of several fields: ``data[name]`` of shape ``[num_envs, *shape]``.

        ``t`` runs over 0..T for observation-aligned fields (T: the bootstrap row) and 0..T-1 for
        transition-only ones (T is padding). Everything is checked before anything is written.
        """
        views = self._live_views()
        n, t_len = self._layout.num_envs, self._layout.rollout_len
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise UsageError(f"set_step(t=...): expected an int time index, got {t!r}")
        if not isinstance(data, Mapping):
            raise SchemaError(f"set_step(t={t}, data=...): expected a mapping of field name -> [num_envs, ...] array, "
                              f"got {type(data).__name__}; e.g. set_step(t, {{'obs': obs, 'reward': reward}})")
        checked = []
        for name, value in data.items():
            f = self._field(name)
            last = t_len if f.kind == OBSERVATION else t_len - 1
            if not 0 <= t <= last:
                raise UsageError(f"set_step(t={t}): {f.describe()} takes t from 0 to {last}"
                                 + ("" if f.kind == OBSERVATION else f" (t={t_len} is its padding row)"))
            checked.append((views[name], _checked(f, value, ((n, *f.shape),), f"set_step(t={t})")))
        for view, x in checked:
            view[:, t] = x

    def __repr__(self) -> str:
        state = "live" if self._live else "committed"
        return f"RolloutSlot({state}, num_envs={self._layout.num_envs}, T={self._layout.rollout_len}, fields={list(self._views)})"


# -- the writing side --------------------------------------------------------


class RolloutBufferWriter:
    """The actor side: fills slots of a RolloutBuffer's pipeline in place, from any process.

    Make it from the buffer's ``handle`` (or name) in the actor's process:
    ``w = RolloutBuffer.writer(handle)``; then ``rollout = w.start_rollout()``, write the fields,
    ``w.add(rollout)``. It holds a shmbuf :class:`~shmbuf.Writer` (one writer lane); ``close()`` or a
    ``with`` block gives it back, and a ``with`` block ends quietly when the learner closes the buffer.

    Args:
        pipeline: the buffer's handle, its name, or the buffer itself (same process).
        timeout: how long ``start_rollout()`` waits for a free slot before :class:`SlotTimeout`.
        label: shown by ``shmbuf ls``.
    """

    def __init__(self, pipeline: Any, *, timeout: float | None = 30.0, label: str = "rollout-buffer"):
        if isinstance(pipeline, RolloutBuffer):
            pipeline = pipeline.handle
        self._writer = shmbuf.Writer(pipeline, timeout=timeout, label=label)
        try:
            self.layout = Layout.from_schema(self._writer.schema, self._writer.name)
        except BaseException:
            self._writer.close()
            raise
        self.num_envs, self.rollout_len = self.layout.num_envs, self.layout.rollout_len
        self._slot: RolloutSlot | None = None

    @property
    def buffer(self) -> RolloutSlot | None:
        """The rollout started and not yet added, or None."""
        return self._slot

    def start_rollout(self) -> RolloutSlot:
        """The shared slot to write the next rollout into (the same one again until :meth:`add`).

        Claims a slot (waiting up to ``timeout``) and zeroes the padding row T of transition-only
        fields; every other row holds what an earlier rollout left there, so write every row you use.
        """
        if self._slot is not None:
            return self._slot
        tree = self._writer.slot()
        views = {name: arr for ts in tree.values() for name, arr in ts.items()}
        t = self.rollout_len
        for f in self.layout.fields.values():
            if f.kind == TRANSITION:
                views[f.name][:, t] = 0
        self._slot = RolloutSlot(self.layout, views)
        return self._slot

    def add(self, rollout: Mapping[str, Any] | None = None) -> None:
        """Mark the started rollout ready: commit its slot to the learner (embodichain's ``add``).

        ``rollout`` is what :meth:`start_rollout` returned (or None, the same). A plain dict of the
        fields is accepted too: each array that is not the slot's own view is checked (name, shape
        ``[num_envs, T+1, ...]``, dtype) and copied in, all checks before any copy. Every field must be
        present; an unknown key raises :class:`SchemaError`.
        """
        slot = self._slot
        if slot is None:
            raise UsageError("add() without start_rollout(): there is no rollout being written; call start_rollout() first")
        if rollout is not None and rollout is not slot:
            if isinstance(rollout, RolloutSlot):
                raise StaleRollout("add() got a rollout that is not the one start_rollout() returned last (an earlier, "
                                   "committed one?); pass the current one, or None")
            self._copy_in(slot, rollout)
        self._writer.commit()
        slot._live = False
        self._slot = None

    def _copy_in(self, slot: RolloutSlot, rollout: Mapping[str, Any]) -> None:
        if not isinstance(rollout, Mapping):
            raise SchemaError("add(): expected the rollout start_rollout() returned or a dict of fields, "
                              f"got {type(rollout).__name__}")
        fields = self.layout.fields
        missing = sorted(set(fields) - set(rollout))
        extra = sorted(set(rollout) - set(fields), key=str)
        if missing or extra:
            raise SchemaError(f"add(): expected fields {list(fields)}; "
                              + "; ".join(p for p in (f"missing {missing}" if missing else "",
                                                       f"unknown {extra}" if extra else "") if p))
        views = slot._views
        todo = []
        for name, f in fields.items():
            x = rollout[name]
            if x is views[name]:
                continue
            shape = f.full_shape(self.num_envs, self.rollout_len)
            todo.append((views[name], _checked(f, x, (shape,), "add()")))
        for view, x in todo:
            if not _same_array(view, x):  # e.g. slot["obs"][...]: the view itself, nothing to copy
                view[...] = x

    def close(self) -> None:
        """Give the writer lane back; a rollout started and not added is dropped."""
        if self._slot is not None:
            self._slot._live = False
            self._slot = None
        self._writer.close()

    def __enter__(self) -> RolloutBufferWriter:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._slot is not None:
            self._slot._live = False
            self._slot = None
        return self._writer.__exit__(exc_type, exc, tb)


# -- the buffer (learner side, and the in-process writer) --------------------


class RolloutBuffer:
    """embodichain's ``RolloutBuffer`` on shared memory: ``[num_envs, T+1]`` rollouts, ``slots`` in flight.

    Args:
        num_envs, rollout_len (T), obs_dim, action_dim: as embodichain's (``obs_dim``/``action_dim``
            may also be shape tuples).
        device: embodichain's fifth argument (a ``str`` or ``torch.device``): rollouts are then
            TensorDicts of torch tensors on it (needs torch and tensordict); None (the default): dicts
            of numpy arrays.
        use_raw_obs: embodichain's; only False (raw observations are Python objects, which a
            shared-memory slot cannot hold: UsageError).
        action_chunk_size: embodichain's; > 0 adds the transition-only field ``action_chunk`` of shape
            ``[num_envs, T+1, action_chunk_size, *action_dim]``.
        fields: name -> ``(shape, dtype)`` or ``(shape, dtype, kind)`` adds or overrides a field
            (``kind``: ``"observation"``, T+1 valid rows, or ``"transition"``, T rows and a padding
            row; an override keeps the old kind unless given, a new field is ``"transition"``);
            name -> None removes one. E.g. ``{"action": ((), np.int64)}`` for discrete actions.
        slots: rollouts in flight (being written, waiting, or held by the learner).
        dtype: of the float fields (obs, action, sample_log_prob, value, reward).
        max_writers: writer processes (lanes) that may attach at once, this process's own included.
        timeout: how long :meth:`get` waits for a rollout unless it is given its own ``timeout``. 0
            (the default): a :meth:`get` with nothing stored raises at once, as embodichain's does.
            Seconds, or None (for ever), to wait for actors in other processes.
        keep_on_crash: as ``shmbuf.create``'s (leave the shared memory for ``shmbuf ls`` if this process dies).

    In one process it is both sides: ``start_rollout()``, write, ``add()``, then ``get()``. Actors
    in other processes use ``RolloutBuffer.writer(buffer.handle)``. Pickling the buffer (e.g. as a
    ``Process`` argument) sends its :class:`~shmbuf.Handle`, as a Reader's does. ``close()`` (or a
    ``with`` block, or garbage collection) stops every writer and removes the shared memory.
    """

    def __init__(self, num_envs: int, rollout_len: int, obs_dim: Any, action_dim: Any, device: Any = None,
                 use_raw_obs: bool = False, action_chunk_size: int = 0, *,
                 fields: Mapping[str, Any] | None = None, slots: int = 2, dtype: Any = np.float32,
                 max_writers: int = 16, timeout: float | None = 0.0, keep_on_crash: bool = False):
        timeout = timeout_setting("RolloutBuffer(timeout=...)", timeout)
        self.device = None if device is None else torch_device(device, "RolloutBuffer(device=...)")
        if self.device is not None:
            tensordict_class("RolloutBuffer(device=...)")
        if use_raw_obs is not False:
            raise UsageError(f"RolloutBuffer(use_raw_obs={use_raw_obs!r}): embodichain keeps raw observations as a Python "
                             "list of per-step objects beside the TensorDict; a shared-memory rollout holds only fixed-shape "
                             "arrays. Flatten them into 'obs', or give each part a field: fields={'name': (shape, dtype, "
                             "'observation')}")
        chunk = int_setting("RolloutBuffer(action_chunk_size=...)", action_chunk_size, 0)
        base = default_fields(obs_dim, action_dim, dtype)
        if chunk:
            act = base[ACTION]
            base["action_chunk"] = Field("action_chunk", (chunk, *act.shape), act.dtype, TRANSITION)
        self.action_chunk_size = chunk
        self.use_raw_obs = False
        self.layout = Layout(num_envs, rollout_len, _merge_fields(base, fields))
        self.num_envs, self.rollout_len = self.layout.num_envs, self.layout.rollout_len
        self.obs_dim, self.action_dim = obs_dim, action_dim
        self.timeout = timeout
        self._reader = shmbuf.create(self.layout.example(), slots, max_writers=max_writers, keep_on_crash=keep_on_crash)
        self.slots = self._reader.slots
        self._local: RolloutBufferWriter | None = None
        self._held: shmbuf.Rollout | None = None
        self._td: Any = None  # with a device: the TensorDict start_rollout() gave for the slot being written

    @property
    def handle(self) -> shmbuf.Handle:
        """What an actor process needs: ``RolloutBuffer.writer(handle)`` there."""
        return self._reader.handle

    @property
    def fields(self) -> dict[str, Field]:
        return dict(self.layout.fields)

    @property
    def obs_fields(self) -> tuple[str, ...]:
        """The observation-aligned fields (T+1 valid rows)."""
        return self.layout.obs_fields

    @property
    def reader(self) -> shmbuf.Reader:
        """The pipeline's :class:`~shmbuf.Reader` (stats, errors, close)."""
        return self._reader

    def __reduce__(self) -> Any:
        return (shmbuf.Handle, (self._reader.name,))

    @staticmethod
    def writer(handle: Any, *, timeout: float | None = 30.0, label: str = "rollout-buffer") -> RolloutBufferWriter:
        """A :class:`RolloutBufferWriter` for an actor process (pass the buffer's ``handle``)."""
        return RolloutBufferWriter(handle, timeout=timeout, label=label)

    # -- the in-process writing side (embodichain's collector) ---------------

    @property
    def buffer(self) -> Any:
        """The rollout this process started and has not added yet (what start_rollout() returned), or None."""
        if self._local is None or self._local.buffer is None:
            return None
        return self._local.buffer if self.device is None else self._td

    def start_rollout(self) -> Any:
        """The shared slot to write the next rollout into, in this process; see :meth:`RolloutBufferWriter.start_rollout`.

        Never waits: with every slot holding a rollout that ``get()`` has not taken (or that is held
        from ``get(flatten=False)``), only this process could free one, so it raises :class:`BufferFull`.

        With a ``device``: a TensorDict of batch shape ``[num_envs, T+1]`` (embodichain's). On the CPU
        its tensors are the slot's shared memory (``rollout["obs"][:, t] = obs`` writes the slot);
        on another device they are copies that :meth:`add` writes back into the slot. Lifetime: as the
        slot's, until :meth:`add`.
        """
        slot = self._start_slot()
        if self.device is None:
            return slot
        if self._td is None:
            t1 = (self.num_envs, self.rollout_len + 1)
            self._td = as_tensordict(dict(slot._views), t1, self.device, "RolloutBuffer.start_rollout()")
        return self._td

    def _start_slot(self) -> RolloutSlot:
        if self._reader.closed:
            raise PipelineClosed(f"start_rollout(): this RolloutBuffer (pipeline {self._reader.name}) is closed")
        if self._local is None:
            self._local = RolloutBufferWriter(self._reader.handle, timeout=0, label="in-process")
        if self._local.buffer is None:
            self._reader.poll()  # lend slots to our own lane (the reader lends only inside poll/get)
        try:
            return self._local.start_rollout()
        except SlotTimeout as exc:
            raise BufferFull(f"start_rollout(): every slot (slots={self.slots}) holds a rollout not yet consumed; call get() "
                             "(and release() after get(flatten=False)) first, or create the buffer with more slots") from exc

    def add(self, rollout: Any = None) -> None:
        """Mark the rollout started in this process ready (commit it); see :meth:`RolloutBufferWriter.add`.

        A TensorDict (with a ``device``: the one :meth:`start_rollout` gave, or another of the same
        fields) is checked field by field (SchemaError naming a missing or unknown key: a key the
        layout does not have cannot travel in the slot; declare it with ``fields=``), and every tensor
        that is not the slot's own memory is copied in.
        """
        if self._local is None or self._local.buffer is None:
            raise UsageError("add() without start_rollout(): there is no rollout being written in this process")
        td = self._td
        if is_tensordict(rollout) or (rollout is None and td is not None):
            self._copy_tensordict(self._local.buffer, td if rollout is None else rollout)
            rollout = None
        self._local.add(rollout)
        self._td = None

    def _copy_tensordict(self, slot: RolloutSlot, td: Any) -> None:
        fields = self.layout.fields
        keys = list(td.keys())
        missing = sorted(set(fields) - set(keys))
        extra = sorted((k for k in keys if k not in fields), key=str)
        if missing or extra:
            hint = (f"; a key the buffer's layout does not have cannot be stored in the shared slot: declare it, e.g. "
                    f"RolloutBuffer(..., fields={{{extra[0]!r}: ((), np.float32)}})" if extra else "")
            raise SchemaError(f"add(): expected the TensorDict's keys to be the buffer's fields {list(fields)}; "
                              + "; ".join(p for p in (f"missing {missing}" if missing else "",
                                                       f"unknown {extra}" if extra else "") if p) + hint)
        views = slot._views
        for name in fields:
            t = td.get(name)
            view = views[name]
            if t.device.type == "cpu" and t.data_ptr() == view.__array_interface__["data"][0] \
                    and tuple(t.shape) == view.shape and tuple(t.stride()) == tuple(s // view.itemsize for s in view.strides):
                continue  # the slot's own memory: written in place
            slot[name] = t.detach().cpu().numpy()

    # -- the learner side ---------------------------------------------------

    def is_full(self) -> bool:
        """Whether a rollout is waiting to be consumed by :meth:`get` (from any writer)."""
        return self._reader.poll() > 0

    def get(self, flatten: bool = True, *, timeout: Any = _DEFAULT) -> Any:
        """The next rollout, and free its slot; waits up to ``timeout`` (default: the buffer's).

        - ``flatten=True``: the transition view flattened to ``[num_envs * T, ...]``, as independent
          copies (one copy per byte, into new arrays that are yours), and the slot is released
          before this returns, so an actor can refill it at once.
        - ``flatten=False``: the whole rollout, ``[num_envs, T+1, ...]`` zero-copy views of the slot
          (embodichain returns its buffer here). Lifetime: they stay valid until the next ``get()``,
          :meth:`release` or :meth:`close`, which release the slot; do not keep them past that (the
          slot is rewritten), copy what must outlive it. Pass them to :meth:`transition_view`.

        The previous ``get(flatten=False)`` rollout is released first. With nothing stored it raises
        :class:`BufferEmpty` (a SlotTimeout and a RuntimeError) at once, as embodichain's empty buffer
        raises RuntimeError, unless a
        wait is asked for: ``timeout`` seconds (or the buffer's ``timeout``), None for ever.

        With a ``device`` the same, as TensorDicts on it (embodichain's): batch shape ``[num_envs * T]``
        (flattened) or ``[num_envs, T+1]``; the latter's tensors are the slot's memory on the CPU
        (same lifetime as above) and copies elsewhere (the slot is then released at once).
        """
        self.release()
        wait = self.timeout if timeout is _DEFAULT else timeout
        try:
            r = self._reader.get(wait)
        except SlotTimeout as exc:
            if wait != 0:
                raise
            raise BufferEmpty(f"RolloutBuffer.get(): the buffer is empty (no rollout was added that get() has not taken; "
                              f"pipeline {self._reader.name}). get() does not wait unless asked: pass get(timeout=seconds) "
                              "or RolloutBuffer(..., timeout=seconds) to wait for an actor in another process") from exc
        data = {name: arr for ts in r.data.values() for name, arr in ts.items()}
        if not flatten:
            if self.device is None:
                self._held = r
                return data
            try:
                td = as_tensordict(data, (self.num_envs, self.rollout_len + 1), self.device, "RolloutBuffer.get()")
            except BaseException:
                r.release()
                raise
            if self.device.type == "cpu":
                self._held = r
            else:
                r.release()
            return td
        try:
            flat = transition_view(data, flatten=True, obs_fields=self.obs_fields, copy=True)
        finally:
            r.release()
        if self.device is None:
            return flat
        return as_tensordict(flat, (self.num_envs * self.rollout_len,), self.device, "RolloutBuffer.get()")

    def release(self) -> None:
        """Give back the slot of the last ``get(flatten=False)`` (its views must not be used after). Idempotent."""
        r, self._held = self._held, None
        if r is not None and not r.released:
            r.release()

    def transition_view(self, rollout: Mapping[str, Any], flatten: bool = False) -> Any:
        """:func:`transition_view` with this buffer's observation-aligned fields (a TensorDict for a TensorDict)."""
        return transition_view(rollout, flatten, obs_fields=self.obs_fields)

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Stop the pipeline: writers' next calls raise PipelineClosed; the shared memory is removed."""
        self._held = None
        self._td = None
        if self._local is not None:
            self._local.close()
            self._local = None
        self._reader.close()

    @property
    def closed(self) -> bool:
        return self._reader.closed

    def __enter__(self) -> RolloutBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RolloutBuffer(num_envs={self.num_envs}, rollout_len={self.rollout_len}, slots={self.slots}, "
                f"fields={list(self.layout.fields)}, name={self._reader.name!r})")
