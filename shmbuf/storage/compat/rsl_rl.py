"""rsl_rl and its legged-robot forks, on shmbuf.storage: every name their users import, with their signatures, spellings
and torch idiom translated onto shmbuf's own engines.

- ``RolloutStorage`` (``rsl_rl.storage.rollout_storage``): :class:`~shmbuf.storage.rollout.TimeMajorStorage` with the
  forks' signature (``RolloutStorage(num_envs, num_transitions_per_env, obs_shape, privileged_obs_shape,
  actions_shape, device)``, rsl_rl's ``[None]`` for no privileged observations) and, given a ``device``, their torch
  idiom: minibatches as tensors on it in their shapes (per-step scalars ``[..., 1]``, hidden states in torch's
  layout and containers), advantages normalised by default, recurrent padding to T, ``get_statistics`` as tensors;
  and the misspelt ``reccurent_mini_batch_generator``.
- The forks' variants, their behaviours here: ``QueueRolloutStorage`` (a rolling buffer that grows, then loops),
  ``ActionLabelRollout`` (with action labels) and ``SarsaRolloutStorage`` (next observations as views of one
  T+1-row buffer); their records ``SarsaTransition``, ``SarsaMiniBatch``, ``ActionLabelTransition``,
  ``ActionLabelMiniBatch``.
- The rest under the forks' names, from the rooms that hold them: ``Transition``, ``MiniBatch``,
  ``ActorCriticHiddenState`` (the storage's records), ``split_and_pad_trajectories`` and ``unpad_trajectories``
  (``rsl_rl.utils``), ``ReplayBuffer`` (``ReplayBuffer(obs_dim, buffer_size, device)`` makes the forks' in-process
  ring, ``LocalReplayBuffer``), ``RolloutFileBase``, ``RolloutDataset`` and ``get_frame_range``
  (``rollout_files``), and the forks' pickled recordings (``read_pickled_recording``, ``convert_pickled_recording``).

Port by changing the import: ``from rsl_rl.storage.rollout_storage import ...`` becomes
``from shmbuf.storage.compat.rsl_rl import ...`` (docs/from-rsl_rl.md maps every name). torch is imported only on the
device paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from shmbuf._errors import SchemaError, UsageError
from shmbuf.storage._file_base import RolloutFileBase
from shmbuf.storage._local_replay import LocalReplayBuffer
from shmbuf.storage._pickled import convert_pickled_recording, read_pickled_recording
from shmbuf.storage._rollout_source import RolloutSource
from shmbuf.storage._rollout_storage import TimeMajorStorage
from shmbuf.storage._torch import device_setting, host_array, is_device, is_tensor, to_torch
from shmbuf.storage._trajectories import split_and_pad_trajectories, unpad_trajectories
from shmbuf.storage._transition import (
    ActionLabelMiniBatch,
    ActionLabelTransition,
    ActorCriticHiddenState,
    AnyMiniBatch,
    MiniBatch,
    SarsaMiniBatch,
    SarsaTransition,
    TimeOutObservations,
    Transition,
    as_row,
)
from shmbuf.storage.dataset import FileTransition, RolloutDataset, get_frame_range
from shmbuf.storage.replay import ReplayBuffer

__all__ = [
    "ActionLabelMiniBatch", "ActionLabelRollout", "ActionLabelTransition", "ActorCriticHiddenState", "FileTransition",
    "LocalReplayBuffer", "MiniBatch", "QueueRolloutStorage", "ReplayBuffer", "RolloutDataset", "RolloutFileBase",
    "RolloutStorage", "SarsaMiniBatch", "SarsaRolloutStorage", "SarsaTransition", "TimeOutObservations", "Transition",
    "convert_pickled_recording", "get_frame_range", "read_pickled_recording", "split_and_pad_trajectories",
    "unpad_trajectories",
]

# Under another name: inside the storages' bodies, Transition is the class attribute (see _rollout_storage).
_Transition = Transition
_HIDDEN = ("hidden_states_actor", "hidden_states_critic")


class RolloutStorage(TimeMajorStorage):
    """rsl_rl's ``RolloutStorage``: :class:`~shmbuf.storage.rollout.TimeMajorStorage` (arrays, ``add_transitions``,
    ``from_rollout``, ``compute_returns``, the generators, ``get_statistics``: see there) with the forks' signature.

    ``device`` (the sixth positional argument of rsl_rl's legged-robot forks, or ``device=``; a ``str`` or
    ``torch.device`` there is a device, never ``rnn_hidden_shape``): the storage speaks the forks' torch idiom.
    Transitions may hold tensors on any device (as without it); minibatches are torch tensors on ``device`` with the
    forks' shapes (``values``, ``advantages``, ``returns``, ``old_actions_log_prob`` ``[..., 1]``; ``hidden_states``
    in torch's ``(num_layers, traj, H)`` layout, an LSTM's as ``(h, c)``, read from transitions in torch's
    ``(num_layers, N, H)`` layout); :meth:`compute_returns` normalises the advantages unless told not to and the
    recurrent generator pads to ``T`` (both as the forks); :meth:`get_statistics` gives 0-d tensors. The arrays
    themselves stay host numpy ``[T, N, ...]``. Without ``device`` everything is numpy, as the engine's.
    """

    device: Any  # None, or a torch.device (set in _setup, then by __init__)

    def __init__(self, num_envs: int, num_transitions_per_env: int, obs_shape: Any, privileged_obs_shape: Any,
                 actions_shape: Any, rnn_hidden_shape: Any = None, *, dtype: Any = np.float32, seed: Any = None,
                 device: Any = None):
        if is_device(rnn_hidden_shape):  # rsl_rl: RolloutStorage(..., actions_shape, device)
            if device is not None:
                raise UsageError(f"{type(self).__name__}: a device was given twice ({rnn_hidden_shape!r} in the sixth place, "
                                 f"and device={device!r}); give it once")
            device, rnn_hidden_shape = rnn_hidden_shape, None
        if isinstance(num_envs, str):
            raise UsageError(f"{type(self).__name__}({num_envs!r}, ...): that is rsl_rl 2+'s signature (training_type, num_envs, "
                             "num_transitions_per_env, obs TensorDict, actions_shape, device), which shmbuf does not take; "
                             f"use rsl_rl 1.x's: {type(self).__name__}(num_envs, num_transitions_per_env, obs_shape, "
                             "privileged_obs_shape, actions_shape, device) (docs/from-rsl_rl.md)")
        dev = None if device is None else device_setting(f"{type(self).__name__}(device=...)", device)
        priv = privileged_obs_shape
        if isinstance(priv, (list, tuple)) and len(priv) > 0 and priv[0] is None:
            priv = None  # rsl_rl passes [None] for "no privileged observations"
        super().__init__(num_envs, num_transitions_per_env, obs_shape, priv, actions_shape, rnn_hidden_shape, dtype=dtype,
                         seed=seed)
        self.device = dev

    def _setup(self, T: int, N: int, seed: Any) -> None:
        super()._setup(T, N, seed)
        self.device = None  # a torch.device: the forks' torch idiom (see the class docstring)
        self._hidden_form: list[str | None] = [None, None]  # with a device: "gru" ((L, N, H)) or "lstm" ((h, c)), per side
        # with a device: the containers hidden states came in (the forks' ActorCriticHiddenState / LstmHiddenState
        # namedarraytuples, or plain tuples), to give them back in the same types: (outer, [actor's, critic's (h, c)])
        self._hidden_types: tuple[Any, list[Any]] = (ActorCriticHiddenState, [tuple, tuple])
        self._hidden_read: tuple[list[str | None], list[Any]] = ([None, None], [tuple, tuple])  # one add's, until checked

    # -- hidden states in torch's layout (with a device) -------------------------------------------------------------

    def _hidden_rows(self, hidden: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
        self._hidden_read = (list(self._hidden_form), list(self._hidden_types[1]))
        return super()._hidden_rows(hidden)

    def _hidden_array(self, name: str, h: Any) -> Any:
        if self.device is None:
            return h
        i = _HIDDEN.index(name)
        forms, inner = self._hidden_read
        inner[i] = type(h)
        h, forms[i] = self._torch_hidden(name, h)
        return h

    def _hidden_checked(self, hidden: Any) -> None:
        self._hidden_form = self._hidden_read[0]  # only what passed every check is remembered
        # plain tuples (rsl_rl 1.x's) come back named, so that the fork's ``.actor`` reads them too
        self._hidden_types = (ActorCriticHiddenState if type(hidden) is tuple else type(hidden), self._hidden_read[1])

    def _torch_hidden(self, name: str, h: Any) -> tuple[np.ndarray, str]:
        """A hidden state in torch's layout, ``(num_layers, N, H)`` (a GRU's) or ``(h, c)`` of them (an LSTM's), as the
        per-env row stored here: ``(N, num_layers, H)`` or ``(N, 2, num_layers, H)``; SchemaError naming it else."""
        N = self.num_envs

        def one(x: Any) -> np.ndarray:
            a = np.asarray(host_array(x))
            if a.ndim != 3 or a.shape[1] != N:
                raise SchemaError(f"Transition.hidden_states ({name}): with a device, hidden states are in torch's layout "
                                  f"(num_layers, num_envs={N}, hidden) or an LSTM's (h, c) of them; got shape {a.shape}")
            return np.swapaxes(a, 0, 1)

        if isinstance(h, (tuple, list)):
            if len(h) != 2:
                raise SchemaError(f"Transition.hidden_states ({name}): expected a tensor or an LSTM's (h, c), got "
                                  f"{len(h)} items")
            return np.stack([one(h[0]), one(h[1])], 1), "lstm"
        return one(h), "gru"

    # -- the forks' defaults with a device, and their types out -----------------------------------------------------

    def compute_returns(self, last_values: Any, gamma: float, lam: float, *, time_out_values: Any = None,
                        normalize_advantages: bool | None = None) -> None:
        """:meth:`TimeMajorStorage.compute_returns <shmbuf.storage.rollout.TimeMajorStorage.compute_returns>`;
        ``normalize_advantages=None`` (the default) is off, or on for a storage with a ``device`` (the forks always
        normalise)."""
        if normalize_advantages is None:
            normalize_advantages = self.device is not None
        super().compute_returns(last_values, gamma, lam, time_out_values=time_out_values,
                                normalize_advantages=normalize_advantages)

    def recurrent_mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8, *, shuffle: bool = False,
                                       pad_to: str | None = None) -> Iterator[AnyMiniBatch]:
        """:meth:`TimeMajorStorage.recurrent_mini_batch_generator
        <shmbuf.storage.rollout.TimeMajorStorage.recurrent_mini_batch_generator>`; ``pad_to=None``: ``"longest"``,
        or ``"rollout"`` for a storage with a ``device`` (the forks' padding, which its ``unpad_trajectories``
        needs)."""
        if pad_to is None:
            pad_to = "longest" if self.device is None else "rollout"
        return super().recurrent_mini_batch_generator(num_mini_batches, num_epochs, shuffle=shuffle, pad_to=pad_to)

    # the forks' spelling, for users who search for it
    reccurent_mini_batch_generator = recurrent_mini_batch_generator

    def _out(self, mb: Any) -> Any:
        """A minibatch as given (no device), or as the forks give it: tensors on the device, per-step scalars ``[..., 1]``,
        hidden states in torch's ``(num_layers, traj, H)`` layout (``(h, c)`` for an LSTM)."""
        if self.device is None:
            return mb
        t = to_torch(mb._replace(hidden_states=None), self.device)
        scalars = {f: getattr(t, f)[..., None] for f in ("values", "advantages", "returns", "old_actions_log_prob")}
        hidden = mb.hidden_states
        if any(x is not None for x in hidden):
            outer, inner = self._hidden_types
            hidden = _same_type(outer, [None if x is None else self._hidden_out(x, form, kind)
                                        for x, form, kind in zip(hidden, self._hidden_form, inner)])
        return t._replace(**scalars, hidden_states=hidden)

    def _hidden_out(self, x: np.ndarray, form: str | None, kind: Any) -> Any:
        h = to_torch(x, self.device)
        if form == "gru":
            return h.transpose(0, 1).contiguous()
        if form == "lstm":
            return _same_type(kind, [h[:, 0].transpose(0, 1).contiguous(), h[:, 1].transpose(0, 1).contiguous()])
        return h  # preallocated by rnn_hidden_shape and not filled from torch's layout: as stored

    def get_statistics(self) -> tuple[Any, Any]:
        """:meth:`TimeMajorStorage.get_statistics <shmbuf.storage.rollout.TimeMajorStorage.get_statistics>`; with a
        ``device``: 0-d tensors there, as the forks give."""
        out = super().get_statistics()
        if self.device is None:
            return out
        import torch

        return torch.tensor(out[0], device=self.device), torch.tensor(out[1], device=self.device)


def _same_type(kind: Any, items: list[Any]) -> Any:
    """``items`` in a container of type ``kind``: a namedtuple (the forks' namedarraytuples are namedtuples) by its fields,
    a list, or else a tuple."""
    if isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_make"):
        return kind._make(items)
    return list(items) if kind is list else tuple(items)


class QueueRolloutStorage(RolloutStorage):
    """A rolling buffer (the forks' ``QueueRolloutStorage``): it starts with one rollout's rows and, at each
    :meth:`clear` after a full rollout, grows by one rollout (:meth:`expand_buffer_once`) up to
    ``int(buffer_dilation_ratio * num_transitions_per_env)`` rows; from then on it loops, the newest rows
    overwriting the oldest. ``num_transitions_per_env`` is the current buffer length, as in the forks, and
    ``num_timesteps_each_rollout`` the rollout length. ``buffer_full`` becomes true when it first loops.

    :meth:`compute_returns` and the recurrent generator first :meth:`untie_buffer_loop` (the time order GAE
    and trajectories need; the forks untie only for the recurrent generator). All of them work on the valid rows:
    every row once the buffer has looped, else rows ``[0, step)``.
    """

    def __init__(self, num_envs: int, num_transitions_per_env: int, *args: Any, buffer_dilation_ratio: float = 1.0,
                 **kwargs: Any):
        if not isinstance(buffer_dilation_ratio, (int, float)) or buffer_dilation_ratio < 1.0:
            raise UsageError(f"buffer_dilation_ratio: expected a number >= 1.0, got {buffer_dilation_ratio!r}")
        super().__init__(num_envs, num_transitions_per_env, *args, **kwargs)
        self.num_timesteps_each_rollout = self.num_transitions_per_env
        self.buffer_dilation_ratio = float(buffer_dilation_ratio)
        self.buffer_full = False

    @classmethod
    def from_rollout(cls, *args: Any, **kwargs: Any) -> TimeMajorStorage:
        raise UsageError("QueueRolloutStorage owns its growing buffer; use RolloutStorage.from_rollout for a view of "
                         "a rollout, or add_transitions to keep rollouts here")

    @property
    def max_buffer_length(self) -> int:
        return int(self.buffer_dilation_ratio * self.num_timesteps_each_rollout)

    def expand_buffer_once(self) -> int:
        """Grow every per-step array by one rollout's rows (less at the limit); return how many rows were added.
        The arrays are new (the old rows copied into them): views taken earlier do not see later writes."""
        grow = min(self.max_buffer_length - self.num_transitions_per_env, self.num_timesteps_each_rollout)
        if grow <= 0:
            return 0
        for name in self._step_arrays:
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, np.concatenate([a, np.zeros((grow, *a.shape[1:]), a.dtype)]))
        self.num_transitions_per_env += grow
        return grow

    def add_transitions(self, transition: _Transition) -> None:
        super().add_transitions(transition)
        if self.step >= self.num_transitions_per_env:
            self.buffer_full = self.buffer_full or self.num_transitions_per_env >= self.max_buffer_length
            if self.buffer_full:
                self.step = 0

    def clear(self) -> None:
        """Keep the data: grow if a rollout filled the buffer and it may still grow (the forks' ``clear``)."""
        if self.step >= self.num_transitions_per_env and not self.buffer_full:
            self.expand_buffer_once()

    def _count(self) -> int:
        return self.num_transitions_per_env if self.buffer_full else self.step

    def swap_from_cursor(self, buffer: Any) -> Any:
        """The forks' helper: ``buffer`` (an array or tensor with the buffer's rows first) rotated so that row ``step`` comes
        first, as a new array (or tensor); as it is when ``step`` is 0 or past the end."""
        s = self.step
        if s == 0 or s >= len(buffer):
            return buffer
        if is_tensor(buffer):
            import torch

            return torch.cat([buffer[s:], buffer[:s]])
        a = np.asarray(buffer)
        return np.concatenate([a[s:], a[:s]])

    def untie_buffer_loop(self) -> None:
        """Rotate every per-step array in place so that the oldest row is row 0 and the newest the last
        (``[5,6,7,8,9,0,1,2,3,4] -> [0,...,9]``, 9 the newest), and set ``step`` to 0 (the next write replaces
        the oldest). A no-op until the buffer has looped. Views of the arrays stay views (same memory)."""
        s = self.step
        if not self.buffer_full:
            return
        if 0 < s < self.num_transitions_per_env:
            for name in self._step_arrays:
                a = getattr(self, name)
                if a is not None:
                    a[...] = np.concatenate([a[s:], a[:s]])
        self.step = 0

    def compute_returns(self, last_values: Any, gamma: float, lam: float, *, time_out_values: Any = None,
                        normalize_advantages: bool | None = None) -> None:
        """:meth:`untie_buffer_loop`, then :meth:`RolloutStorage.compute_returns` over the valid rows.

        ``time_out_values`` ``[T, N]`` (T the current buffer length) is indexed like the storage's rows *as
        they are when you call* (its row ``i`` goes with ``values[i]``, whatever the loop's position): it is
        rotated the same way as the storage (a rotated copy; your array is not changed). Build it after an
        explicit ``untie_buffer_loop()`` and it is used as it is (the rotation is then none).
        """
        self._check_discounts(gamma, lam)
        s, T = self.step, self.num_transitions_per_env
        if time_out_values is not None:
            tov = np.asarray(host_array(time_out_values))
            if tov.shape[:2] != (T, self.num_envs) or tov.shape[2:] not in ((), (1,)):
                raise SchemaError(f"{type(self).__name__}.compute_returns: time_out_values has shape {tov.shape}, expected "
                                  f"{(T, self.num_envs)} like values (the buffer's rows, in their order before the call)")
            if self.buffer_full and 0 < s < T:
                time_out_values = np.concatenate([tov[s:], tov[:s]])
        self.untie_buffer_loop()
        super().compute_returns(last_values, gamma, lam, time_out_values=time_out_values,
                                normalize_advantages=normalize_advantages)

    def recurrent_mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8, **kwargs: Any) -> Iterator[AnyMiniBatch]:
        self.untie_buffer_loop()
        return super().recurrent_mini_batch_generator(num_mini_batches, num_epochs, **kwargs)

    reccurent_mini_batch_generator = recurrent_mini_batch_generator


class SarsaRolloutStorage(RolloutStorage):
    """Storage with next observations (the forks' ``SarsaRolloutStorage``): one ``all_observations`` buffer of T+1
    rows; ``observations = all_observations[:-1]`` and ``next_observations = all_observations[1:]`` are views
    of it, so ``(s, a, r, s')`` stay aligned without a second copy; the same for privileged observations.
    The last row is the observation after the rollout: set by :meth:`set_bootstrap_observations`, by the
    last :class:`SarsaTransition`'s ``next_observations``, or by :meth:`from_rollout` from ``data["bootstrap"]``.

    ``next_observations[t]`` at an episode end is the next episode's first observation (the env reset), as in
    As in the forks: mask with ``dones | time_outs``; a truncated episode's final observation is in ``time_out_observations``.
    """

    Transition = SarsaTransition
    MiniBatch = SarsaMiniBatch

    # Made by _link: T+1 rows, and the two views of them (observations itself is the other).
    all_observations: np.ndarray
    next_observations: np.ndarray
    all_privileged_observations: np.ndarray | None
    next_privileged_observations: np.ndarray | None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._link()

    def _link(self) -> None:
        """Make ``all_*`` of T+1 rows and the two views of it (copying the current T rows in)."""
        for base in ("observations", "privileged_observations"):
            a = getattr(self, base)
            if a is None:
                setattr(self, f"all_{base}", None)
                setattr(self, f"next_{base}", None)
                continue
            full = np.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype)
            full[:-1] = a
            setattr(self, f"all_{base}", full)
            setattr(self, base, full[:-1])
            setattr(self, f"next_{base}", full[1:])

    @classmethod
    def from_rollout(cls, rollout_or_batch: Any, **kwargs: Any) -> TimeMajorStorage:
        """As :meth:`RolloutStorage.from_rollout`, plus ``next_observations``. The slot holds the step
        observations and the bootstrap observation in two leaves, so ``all_observations`` (T+1 rows) is one
        copy of them (``"observations"`` is in ``copied``); every other field stays a view."""
        return super().from_rollout(rollout_or_batch, **kwargs)

    def _adopt(self, arrays: dict[str, np.ndarray | None], src: RolloutSource) -> None:
        super()._adopt(arrays, src)
        if self.bootstrap_observations is None:
            raise SchemaError("SarsaRolloutStorage.from_rollout: the rollout has no data['bootstrap'] observation; "
                              "the last next_observation comes from it")
        self._link()
        self.all_observations[-1] = self.bootstrap_observations
        src.copied.append("observations")
        if self.all_privileged_observations is not None:
            if self.bootstrap_critic_observations is None:
                raise SchemaError("SarsaRolloutStorage.from_rollout: no bootstrap critic observation in data['bootstrap']")
            self.all_privileged_observations[-1] = self.bootstrap_critic_observations
            src.copied.append("privileged_observations")

    def set_bootstrap_observations(self, observations: Any, critic_observations: Any = None) -> None:
        """Write the observation after row ``step - 1`` (so ``next_observations[step - 1]``)."""
        for dst, x in self._bootstrap_rows(observations, critic_observations, self.step):
            np.copyto(dst, x, casting="same_kind")

    def add_transitions(self, transition: _Transition) -> None:
        nxt = getattr(transition, "next_observations", None)
        nxt_critic = getattr(transition, "next_critic_observations", None)
        if nxt_critic is None:  # the forks' name for it
            nxt_critic = getattr(transition, "next_privileged_observations", None)
        last = self.step + 1 == self.num_transitions_per_env and nxt is not None and self._borrowed is None
        if last:  # checked before the row is written, like every other field
            self._bootstrap_rows(nxt, nxt_critic, self.step + 1)
        super().add_transitions(transition)
        if last:
            self.set_bootstrap_observations(nxt, nxt_critic)

    def _bootstrap_rows(self, observations: Any, critic_observations: Any, t: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(row of all_*, checked array)`` for the observation after row ``t - 1``; SchemaError naming a bad one."""
        rows = [(self.all_observations[t], as_row("next_observations", observations, self.all_observations[t]))]
        if self.all_privileged_observations is not None and critic_observations is not None:
            dst = self.all_privileged_observations[t]
            rows.append((dst, as_row("next_critic_observations", critic_observations, dst)))
        return rows

    def _obs_fields(self) -> dict[str, np.ndarray]:
        out = super()._obs_fields()
        nxt = self.next_observations
        priv = self.next_privileged_observations
        out["next_obs"] = nxt
        out["next_critic_obs"] = nxt if priv is None else priv
        return out


class ActionLabelRollout(QueueRolloutStorage):
    """A :class:`QueueRolloutStorage` that also keeps an action label per step (the forks' ``ActionLabelRollout``, e.g. a
    teacher's action for imitation): ``action_labels`` ``[T, N, *actions_shape]``, filled from each
    :class:`ActionLabelTransition`'s ``action_labels`` (required, shaped like ``actions``), grown, looped and untied
    with the other arrays; its minibatches are :class:`ActionLabelMiniBatch` es (every field of :class:`MiniBatch`,
    then ``action_labels`` laid out like ``actions``)."""

    Transition = ActionLabelTransition
    MiniBatch = ActionLabelMiniBatch
    _transition_fields = {**RolloutStorage._transition_fields, "action_labels": "action_labels"}
    _required = (*RolloutStorage._required, "action_labels")
    _step_arrays = (*RolloutStorage._step_arrays, "action_labels")

    action_labels: np.ndarray

    def __init__(self, num_envs: int, num_transitions_per_env: int, *args: Any, **kwargs: Any):
        super().__init__(num_envs, num_transitions_per_env, *args, **kwargs)
        self.action_labels = np.zeros_like(self.actions)

    def _step_fields(self) -> dict[str, np.ndarray | None]:
        return {**super()._step_fields(), "action_labels": self.action_labels}
