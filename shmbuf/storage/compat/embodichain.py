"""embodichain's rollout buffer on shmbuf.storage: ``RolloutBuffer`` (``embodichain.agents.rl.buffer``) and its
helpers ``transition_view``, ``iterate_minibatches`` (``embodichain.agents.rl.buffer.utils``), with embodichain's
signature, fields and types translated onto shmbuf's :class:`~shmbuf.storage.buffer.SlotBuffer`.

What is embodichain's here: the constructor ``RolloutBuffer(num_envs, rollout_len, obs_dim, action_dim, device,
use_raw_obs, action_chunk_size)``, its fields (``obs``, ``action``, ``sample_log_prob``, ``value``, ``reward``,
``done``, ``terminated``, ``truncated``, and ``action_chunk``), and, given a ``device``, its types: ``start_rollout()``,
``buffer`` and ``get()`` give TensorDicts (tensordict must be installed) of torch tensors on that device; on the CPU
those tensors are the slot's shared memory itself. Without one, every rollout is a dict of numpy arrays, as the
SlotBuffer's. ``transition_view`` and ``iterate_minibatches`` are shmbuf's own functions (they follow their input's
type: numpy dicts or TensorDicts), under the names embodichain gave them.

Port by changing the import: ``from embodichain.agents.rl.buffer import RolloutBuffer`` becomes
``from shmbuf.storage.compat.embodichain import RolloutBuffer`` (or ``from shmbuf.storage import RolloutBuffer``;
docs/from-embodichain.md maps every name). torch and tensordict are imported only with a device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import SchemaError, UsageError
from shmbuf._validate import int_setting, timeout_setting
from shmbuf.storage._buffer_layout import OBSERVATION, TRANSITION, Field, dim_setting, dtype_setting, merge_fields
from shmbuf.storage._buffer_views import as_tensordict, is_tensordict, tensordict_class, torch_device
from shmbuf.storage.buffer import _DEFAULT, RolloutSlot, SlotBuffer, iterate_minibatches, transition_view

__all__ = ["RolloutBuffer", "default_fields", "iterate_minibatches", "transition_view"]


def default_fields(obs_dim: Any, action_dim: Any, dtype: Any = np.float32) -> dict[str, Field]:
    """embodichain's fields: obs, action, sample_log_prob, value, reward, done, terminated, truncated."""
    fdt = dtype_setting(dtype, "RolloutBuffer(dtype=...)")
    b = np.dtype(bool)
    specs = {
        L.OBS: (dim_setting(obs_dim, "RolloutBuffer(obs_dim=...)"), fdt, OBSERVATION),
        L.ACTION: (dim_setting(action_dim, "RolloutBuffer(action_dim=...)"), fdt, TRANSITION),
        "sample_log_prob": ((), fdt, TRANSITION),
        "value": ((), fdt, OBSERVATION),
        L.REWARD: ((), fdt, TRANSITION),
        "done": ((), b, TRANSITION),
        L.TERMINATED: ((), b, TRANSITION),
        L.TRUNCATED: ((), b, TRANSITION),
    }
    return {name: Field(name, *spec) for name, spec in specs.items()}


class RolloutBuffer(SlotBuffer):
    """embodichain's ``RolloutBuffer`` on shared memory: a :class:`~shmbuf.storage.buffer.SlotBuffer` of embodichain's
    fields, ``[num_envs, T+1]`` rollouts, ``slots`` in flight.

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
        timeout = timeout_setting("RolloutBuffer(timeout=...)", timeout)  # checked first, as it always was
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
            act = base[L.ACTION]
            base["action_chunk"] = Field("action_chunk", (chunk, *act.shape), act.dtype, TRANSITION)
        self.action_chunk_size = chunk
        self.use_raw_obs = False
        merged = merge_fields(base, fields, "RolloutBuffer")
        self.obs_dim, self.action_dim = obs_dim, action_dim
        self._td: Any = None  # with a device: the TensorDict start_rollout() gave for the slot being written
        super().__init__(num_envs, rollout_len, merged, slots=slots, max_writers=max_writers, timeout=timeout,
                         keep_on_crash=keep_on_crash)

    # -- the in-process writing side (embodichain's collector) ---------------

    @property
    def buffer(self) -> Any:
        """The rollout this process started and has not added yet (what start_rollout() returned), or None."""
        slot = super().buffer
        return slot if slot is None or self.device is None else self._td

    def start_rollout(self) -> Any:
        """The shared slot to write the next rollout into, in this process; see :meth:`RolloutBufferWriter.start_rollout
        <shmbuf.storage.buffer.RolloutBufferWriter.start_rollout>`.

        Never waits: with every slot holding a rollout that ``get()`` has not taken (or that is held
        from ``get(flatten=False)``), only this process could free one, so it raises :class:`~shmbuf.BufferFull`.

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

    def add(self, rollout: Any = None) -> None:
        """Mark the rollout started in this process ready (commit it); see :meth:`RolloutBufferWriter.add
        <shmbuf.storage.buffer.RolloutBufferWriter.add>`.

        A TensorDict (with a ``device``: the one :meth:`start_rollout` gave, or another of the same
        fields) is checked field by field (SchemaError naming a missing or unknown key: a key the
        layout does not have cannot travel in the slot; declare it with ``fields=``), and every tensor
        that is not the slot's own memory is copied in.
        """
        local = self._check_started()
        td = self._td
        if is_tensordict(rollout) or (rollout is None and td is not None):
            slot = local.buffer
            assert slot is not None  # _check_started
            self._copy_tensordict(slot, td if rollout is None else rollout)
            rollout = None
        local.add(rollout)
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

    def get(self, flatten: bool = True, *, timeout: Any = _DEFAULT) -> Any:
        """The next rollout, and free its slot; see :meth:`SlotBuffer.get <shmbuf.storage.buffer.SlotBuffer.get>`
        (``flatten=False`` is the whole rollout, which embodichain returns as its buffer; with nothing stored it
        raises at once, as embodichain's empty buffer raises RuntimeError, unless a wait is asked for).

        With a ``device`` the same, as TensorDicts on it (embodichain's): batch shape ``[num_envs * T]``
        (flattened) or ``[num_envs, T+1]``; the latter's tensors are the slot's memory on the CPU
        (same lifetime as the views) and copies elsewhere (the slot is then released at once).
        """
        if self.device is None:
            return super().get(flatten, timeout=timeout)
        r, data = self._next(timeout)
        if not flatten:
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
        flat = self._flat(r, data)
        return as_tensordict(flat, (self.num_envs * self.rollout_len,), self.device, "RolloutBuffer.get()")

    def close(self, timeout: float | None = None) -> None:
        """Stop the pipeline: writers' next calls raise PipelineClosed; the shared memory is removed. Waits for
        nothing (``timeout``: accepted, as by every shmbuf close, and checked)."""
        self._td = None
        super().close(timeout)
