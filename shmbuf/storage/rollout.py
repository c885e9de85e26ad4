"""The time-major rollout storage (shmbuf's own): :class:`TimeMajorStorage`, its records, and filling one straight
from shmbuf rollouts and batches. rsl_rl's ``RolloutStorage`` and its forks' variants are this storage with their
signatures and torch idiom: :mod:`shmbuf.storage.compat.rsl_rl`.

Layout: every per-step array is time-major ``[T, N, ...]`` (T = ``num_transitions_per_env``, N = ``num_envs``).
Scalars per step (rewards, dones, time_outs, values, actions_log_prob, returns, advantages) are ``[T, N]``,
not rsl_rl's ``[T, N, 1]`` (a ``[N, 1]`` input is accepted and read as ``[N]``); dones and time_outs are bool.

The flags mean what the way in says (``flag_convention``; see :mod:`shmbuf.storage.gae` for the formulas):

- ``add_transitions`` (``"rsl_rl"``): rsl_rl's ``dones`` (every episode end) and ``time_outs`` (hit the
  time limit); a time-out bootstraps whatever ``dones`` says, as rsl_rl's PPO does;
- ``from_rollout`` (``"gymnasium"``): ``dones`` is gymnasium's ``terminated``, ``time_outs`` its
  ``truncated``; a step both terminated and truncated counts as terminated (no bootstrap).

Two ways in:

- step by step: :meth:`TimeMajorStorage.add_transitions` copies one :class:`Transition` into row ``step``;
- whole rollouts: :meth:`TimeMajorStorage.from_rollout` takes a ``shmbuf.Rollout`` (leaves ``(T, [E], ...)``),
  a ``shmbuf.Batch`` or a workers ``CollectedBatch`` (leaves ``(B, T, [E], ...)``) and makes the storage's
  arrays *views* of its step leaves wherever the layout allows (see that method for exactly when it copies).

Ways out: :meth:`~TimeMajorStorage.mini_batch_generator` (flat, shuffled) and
:meth:`~TimeMajorStorage.recurrent_mini_batch_generator` (whole trajectories, padded, with masks); each yields a
:class:`MiniBatch` of numpy arrays with ``to_torch(device=None)``. numpy only; torch is imported by ``to_torch``.

The names of rsl_rl's storage module that this module used to hold (``RolloutStorage``, ``QueueRolloutStorage``,
``SarsaRolloutStorage``, ``ActionLabelRollout`` and the variants' records) moved to
:mod:`shmbuf.storage.compat.rsl_rl`; importing them from here still works, with a DeprecationWarning.
"""

from shmbuf._moved import moved
from shmbuf.storage._rollout_storage import TimeMajorStorage
from shmbuf.storage._trajectories import split_and_pad_trajectories, unpad_trajectories
from shmbuf.storage._transition import ActorCriticHiddenState, MiniBatch, TimeOutObservations, Transition

__all__ = [
    "ActorCriticHiddenState",
    "MiniBatch",
    "TimeMajorStorage",
    "TimeOutObservations",
    "Transition",
    "split_and_pad_trajectories",
    "unpad_trajectories",
]

# rsl_rl's names, moved to its façade (CHANGELOG.md): still importable from here, with a warning.
_MOVED = {name: "shmbuf.storage.compat.rsl_rl" for name in (
    "ActionLabelMiniBatch", "ActionLabelRollout", "ActionLabelTransition", "QueueRolloutStorage", "RolloutStorage",
    "SarsaMiniBatch", "SarsaRolloutStorage", "SarsaTransition")}


def __getattr__(name: str) -> object:
    return moved("shmbuf.storage.rollout", name, _MOVED)
