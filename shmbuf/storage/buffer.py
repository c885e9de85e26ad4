"""The ``[num_envs, T+1]`` slot buffer (shmbuf's own): rollouts of named fields, each one slot of a shmbuf pipeline,
written in place by an actor (this process or another) and read in place by the learner. embodichain's
``RolloutBuffer`` is this buffer with its signature and types: :mod:`shmbuf.storage.compat.embodichain`.

Every field shares the batch shape ``[num_envs, T+1]``. *Observation-aligned* fields (kind ``"observation"``, e.g.
``obs``, ``value``) use all T+1 rows: row T is the bootstrap observation and its value. *Transition-only* fields
(kind ``"transition"``: actions, rewards, flags, ...) hold T valid rows; row T is padding, zeroed by
``start_rollout()``. :func:`transition_view` drops the padding and exposes ``obs[:, :T]`` and
``next_obs = obs[:, 1:]`` (likewise ``value``/``next_value``), all views.

Each rollout is a slot of a shmbuf pipeline: ``start_rollout()`` returns that slot's shared memory as a
:class:`RolloutSlot` of writable ``[num_envs, T+1, ...]`` views, ``add()`` commits it, and the learner's ``get()``
reads it in place. One process can do both sides (with ``slots`` rollouts in flight); an actor in another process
does the writing side with ``SlotBuffer.writer(handle)`` (a :class:`RolloutBufferWriter`).

The layout is the pipeline's schema (:mod:`shmbuf.storage._buffer_layout`): two timescales, ``"observation"`` and
``"transition"``, each a flat dict of field name to a ``[num_envs, T+1, *shape]`` leaf, so a process that knows only
the pipeline's name knows every field, its dtype, shape and alignment. Every rollout is a dict of numpy arrays.

embodichain's ``RolloutBuffer`` used to be defined here; importing it from here still works, with a
DeprecationWarning (it lives in :mod:`shmbuf.storage.compat.embodichain`, and in :mod:`shmbuf.storage`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np

import shmbuf
from shmbuf._closable import Closable
from shmbuf._errors import BufferEmpty, BufferFull, PipelineClosed, SchemaError, SlotTimeout, StaleRollout, UsageError
from shmbuf._moved import moved
from shmbuf._validate import timeout_setting
from shmbuf.storage._buffer_layout import (
    KINDS,  # noqa: F401  # importable from here, as it always was (the layout moved to _buffer_layout)
    OBSERVATION,
    TRANSITION,
    Field,
    Layout,
    checked_array,
    merge_fields,
    same_array,
)
from shmbuf.storage._buffer_views import iterate_minibatches, transition_view
from shmbuf.storage._torch import to_torch

__all__ = [
    "BufferEmpty", "BufferFull", "Field", "RolloutBufferWriter", "RolloutSlot", "SlotBuffer", "iterate_minibatches",
    "to_torch", "transition_view",
]

_DEFAULT = object()

# embodichain's buffer, moved to its façade (CHANGELOG.md): still importable from here, with a warning.
_MOVED = {"RolloutBuffer": "shmbuf.storage.compat.embodichain", "default_fields": "shmbuf.storage.compat.embodichain"}


def __getattr__(name: str) -> object:
    return moved("shmbuf.storage.buffer", name, _MOVED)


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
        x = checked_array(f, value, shapes, "a whole-field write")
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
            checked.append((views[name], checked_array(f, value, ((n, *f.shape),), f"set_step(t={t})")))
        for view, x in checked:
            view[:, t] = x

    def __repr__(self) -> str:
        state = "live" if self._live else "committed"
        return f"RolloutSlot({state}, num_envs={self._layout.num_envs}, T={self._layout.rollout_len}, fields={list(self._views)})"


# -- the writing side --------------------------------------------------------


class RolloutBufferWriter(Closable):
    """The actor side: fills slots of a SlotBuffer's (or RolloutBuffer's) pipeline in place, from any process.

    Make it from the buffer's ``handle`` (or name) in the actor's process:
    ``w = SlotBuffer.writer(handle)`` (``RolloutBuffer.writer(handle)``); then ``rollout = w.start_rollout()``, write the fields,
    ``w.add(rollout)``. It holds a shmbuf :class:`~shmbuf.Writer` (one writer lane); ``close()`` or a
    ``with`` block gives it back, and a ``with`` block ends quietly when the learner closes the buffer.

    Args:
        pipeline: the buffer's handle, its name, or the buffer itself (same process).
        timeout: how long ``start_rollout()`` waits for a free slot before :class:`SlotTimeout`.
        label: shown by ``shmbuf ls``.
    """

    def __init__(self, pipeline: Any, *, timeout: float | None = 30.0, label: str = "rollout-buffer"):
        if isinstance(pipeline, SlotBuffer):
            pipeline = pipeline.handle
        self._writer = shmbuf.Writer(pipeline, timeout=timeout, label=label)
        self.name = self._writer.name
        self._own("writer", self._writer.close)
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
            todo.append((views[name], checked_array(f, x, (shape,), "add()")))
        for view, x in todo:
            if not same_array(view, x):  # e.g. slot["obs"][...]: the view itself, nothing to copy
                view[...] = x

    def close(self, timeout: float | None = None) -> None:
        """Give the writer lane back; a rollout started and not added is dropped. ``timeout``: as ``Writer.close``'s
        (the most its goodbye waits for the reader)."""
        timeout = timeout_setting("RolloutBufferWriter.close(timeout=...)", timeout)
        if self._slot is not None:
            self._slot._live = False
            self._slot = None
        self._writer.close(timeout)
        super().close()

    def __exit__(  # type: ignore[override]  # a bool, not Closable's None: it ends the block quietly on a reader's close
        self, exc_type: Any, exc: BaseException | None, tb: Any
    ) -> bool:
        if self._slot is not None:
            self._slot._live = False
            self._slot = None
        try:
            return self._writer.__exit__(exc_type, exc, tb)
        finally:
            super().close()


# -- the buffer (learner side, and the in-process writer) --------------------


class SlotBuffer(Closable):
    """``[num_envs, T+1]`` rollouts of named fields on shared memory, ``slots`` in flight.

    Args:
        num_envs, rollout_len (T): the batch shape ``[num_envs, T+1]`` of every field.
        fields: name -> ``(shape, dtype)`` or ``(shape, dtype, kind)`` (``shape``: the trailing shape, an int or a
            tuple; ``kind``: ``"observation"``, T+1 valid rows, or ``"transition"``, T rows and a padding row, the
            default), or a :class:`Field`. E.g. ``{"obs": ((4,), np.float32, "observation"), "action": ((),
            np.int64), "reward": ((), np.float32)}``.
        slots: rollouts in flight (being written, waiting, or held by the learner).
        max_writers: writer processes (lanes) that may attach at once, this process's own included.
        timeout: how long :meth:`get` waits for a rollout unless it is given its own ``timeout``. 0 (the default): a
            :meth:`get` with nothing stored raises at once. Seconds, or None (for ever), to wait for actors in other
            processes.
        keep_on_crash: as ``shmbuf.create``'s (leave the shared memory for ``shmbuf ls`` if this process dies).

    In one process it is both sides: ``start_rollout()``, write, ``add()``, then ``get()``. Actors in other processes
    use ``SlotBuffer.writer(buffer.handle)``. Pickling the buffer (e.g. as a ``Process`` argument) sends its
    :class:`~shmbuf.Handle`, as a Reader's does. ``close()`` (or a ``with`` block, or garbage collection) stops
    every writer and removes the shared memory.
    """

    def __init__(self, num_envs: int, rollout_len: int, fields: Mapping[str, Any], *, slots: int = 2,
                 max_writers: int = 16, timeout: float | None = 0.0, keep_on_crash: bool = False):
        where = type(self).__name__
        self.timeout = timeout_setting(f"{where}(timeout=...)", timeout)
        self.layout = Layout(num_envs, rollout_len, merge_fields({}, fields, where), where)
        self.num_envs, self.rollout_len = self.layout.num_envs, self.layout.rollout_len
        self._reader = shmbuf.create(self.layout.example(), slots, max_writers=max_writers, keep_on_crash=keep_on_crash)
        self.name = self._reader.name
        self._own("reader", self._reader.close)
        self._unlinks(self._reader.unlink)  # unlink(): the pipeline's names, as its Reader's
        self.slots = self._reader.slots
        self._local: RolloutBufferWriter | None = None
        self._held: shmbuf.Rollout | None = None

    @property
    def handle(self) -> shmbuf.Handle:
        """What an actor process needs: ``SlotBuffer.writer(handle)`` there."""
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

    # -- the in-process writing side -------------------------------------------

    @property
    def buffer(self) -> Any:
        """The rollout this process started and has not added yet (what start_rollout() returned), or None."""
        return None if self._local is None else self._local.buffer

    def start_rollout(self) -> Any:
        """The shared slot to write the next rollout into, in this process; see :meth:`RolloutBufferWriter.start_rollout`.

        Never waits: with every slot holding a rollout that ``get()`` has not taken (or that is held
        from ``get(flatten=False)``), only this process could free one, so it raises :class:`BufferFull`.
        Lifetime: as the slot's, until :meth:`add`.
        """
        return self._start_slot()

    def _start_slot(self) -> RolloutSlot:
        if self._reader.closed:
            raise PipelineClosed(f"start_rollout(): this {type(self).__name__} (pipeline {self._reader.name}) is closed")
        if self._local is None:
            self._local = RolloutBufferWriter(self._reader.handle, timeout=0, label="in-process")
            self._own("in-process writer", self._local.close)  # after the reader's: released before it
        if self._local.buffer is None:
            self._reader.poll()  # lend slots to our own lane (the reader lends only inside poll/get)
        try:
            return self._local.start_rollout()
        except SlotTimeout as exc:
            raise BufferFull(f"start_rollout(): every slot (slots={self.slots}) holds a rollout not yet consumed; call get() "
                             "(and release() after get(flatten=False)) first, or create the buffer with more slots") from exc

    def _check_started(self) -> RolloutBufferWriter:
        if self._local is None or self._local.buffer is None:
            raise UsageError("add() without start_rollout(): there is no rollout being written in this process")
        return self._local

    def add(self, rollout: Any = None) -> None:
        """Mark the rollout started in this process ready (commit it); see :meth:`RolloutBufferWriter.add`."""
        self._check_started().add(rollout)

    # -- the learner side ---------------------------------------------------

    def is_full(self) -> bool:
        """Whether a rollout is waiting to be consumed by :meth:`get` (from any writer)."""
        return self._reader.poll() > 0

    def get(self, flatten: bool = True, *, timeout: Any = _DEFAULT) -> Any:
        """The next rollout, and free its slot; waits up to ``timeout`` (default: the buffer's).

        - ``flatten=True``: the transition view flattened to ``[num_envs * T, ...]``, as independent
          copies (one copy per byte, into new arrays that are yours), and the slot is released
          before this returns, so an actor can refill it at once.
        - ``flatten=False``: the whole rollout, ``[num_envs, T+1, ...]`` zero-copy views of the slot.
          Lifetime: they stay valid until the next ``get()``, :meth:`release` or :meth:`close`, which
          release the slot; do not keep them past that (the slot is rewritten), copy what must outlive
          it. Pass them to :meth:`transition_view`.

        The previous ``get(flatten=False)`` rollout is released first. With nothing stored it raises
        :class:`BufferEmpty` (a SlotTimeout and a RuntimeError) at once, unless a wait is asked for:
        ``timeout`` seconds (or the buffer's ``timeout``), None for ever.
        """
        r, data = self._next(timeout)
        if not flatten:
            self._held = r
            return data
        return self._flat(r, data)

    def _next(self, timeout: Any) -> tuple[shmbuf.Rollout, dict[str, np.ndarray]]:
        """The next rollout and its fields (views of the slot), the previous ``get(flatten=False)`` released first."""
        self.release()
        wait = self.timeout if timeout is _DEFAULT else timeout
        try:
            r = self._reader.get(wait)
        except SlotTimeout as exc:
            if wait != 0:
                raise
            name = type(self).__name__
            raise BufferEmpty(f"{name}.get(): the buffer is empty (no rollout was added that get() has not taken; "
                              f"pipeline {self._reader.name}). get() does not wait unless asked: pass get(timeout=seconds) "
                              f"or {name}(..., timeout=seconds) to wait for an actor in another process") from exc
        return r, {name: arr for ts in r.data.values() for name, arr in ts.items()}

    def _flat(self, r: shmbuf.Rollout, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The flattened transition view of ``data``, copied, and ``r`` released."""
        try:
            return transition_view(data, flatten=True, obs_fields=self.obs_fields, copy=True)
        finally:
            r.release()

    def release(self) -> None:
        """Give back the slot of the last ``get(flatten=False)`` (its views must not be used after). Idempotent."""
        r, self._held = self._held, None
        if r is not None and not r.released:
            r.release()

    def transition_view(self, rollout: Mapping[str, Any], flatten: bool = False) -> Any:
        """:func:`transition_view` with this buffer's observation-aligned fields (a TensorDict for a TensorDict)."""
        return transition_view(rollout, flatten, obs_fields=self.obs_fields)

    # -- lifetime -----------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop the pipeline: writers' next calls raise PipelineClosed; the shared memory is removed. Waits for
        nothing (``timeout``: accepted, as by every shmbuf close, and checked)."""
        self._held = None
        super().close(timeout)  # the in-process writer, then the reader
        self._local = None

    @property
    def closed(self) -> bool:
        return self._reader.closed

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_envs={self.num_envs}, rollout_len={self.rollout_len}, slots={self.slots}, "
                f"fields={list(self.layout.fields)}, name={self._reader.name!r})")
