"""PPO rollout storage (rsl_rl's ``RolloutStorage``), its rolling and next-observation variants, and
filling one straight from shmbuf rollouts and batches.

Layout: every per-step array is time-major ``[T, N, ...]`` (T = ``num_transitions_per_env``, N = ``num_envs``).
Scalars per step (rewards, dones, time_outs, values, actions_log_prob, returns, advantages) are ``[T, N]``,
not rsl_rl's ``[T, N, 1]`` (a ``[N, 1]`` input is accepted and read as ``[N]``); dones and time_outs are bool.

The flags mean what the way in says (``flag_convention``; see :mod:`shmbuf.storage.gae` for the formulas):

- ``add_transitions`` (``"rsl_rl"``): rsl_rl's ``dones`` (every episode end) and ``time_outs`` (hit the
  time limit); a time-out bootstraps whatever ``dones`` says, as rsl_rl's PPO does;
- ``from_rollout`` (``"gymnasium"``): ``dones`` is gymnasium's ``terminated``, ``time_outs`` its
  ``truncated``; a step both terminated and truncated counts as terminated (no bootstrap).

Two ways in:

- step by step: :meth:`RolloutStorage.add_transitions` copies one :class:`Transition` into row ``step``;
- whole rollouts: :meth:`RolloutStorage.from_rollout` takes a ``shmbuf.Rollout`` (leaves ``(T, [E], ...)``),
  a ``shmbuf.Batch`` or a workers ``CollectedBatch`` (leaves ``(B, T, [E], ...)``) and makes the storage's
  arrays *views* of its step leaves wherever the layout allows (see that method for exactly when it copies).

Ways out: :meth:`~RolloutStorage.mini_batch_generator` (flat, shuffled) and
:meth:`~RolloutStorage.recurrent_mini_batch_generator` (whole trajectories, padded, with masks); each yields a
:class:`MiniBatch` of numpy arrays with ``to_torch(device=None)``. numpy only; torch is imported by ``to_torch``, and by a
storage made with a ``device`` (the sixth positional argument of rsl_rl's legged-robot forks): its minibatches are
torch tensors there, in the forks' shapes (see :class:`RolloutStorage`).
"""

from shmbuf.storage._rollout_storage import RolloutStorage
from shmbuf.storage._rollout_variants import ActionLabelRollout, QueueRolloutStorage, SarsaRolloutStorage
from shmbuf.storage._trajectories import split_and_pad_trajectories, unpad_trajectories
from shmbuf.storage._transition import (
    ActionLabelMiniBatch,
    ActionLabelTransition,
    ActorCriticHiddenState,
    MiniBatch,
    SarsaMiniBatch,
    SarsaTransition,
    TimeOutObservations,
    Transition,
)

__all__ = [
    "ActionLabelMiniBatch",
    "ActionLabelRollout",
    "ActionLabelTransition",
    "ActorCriticHiddenState",
    "MiniBatch",
    "QueueRolloutStorage",
    "RolloutStorage",
    "SarsaMiniBatch",
    "SarsaRolloutStorage",
    "SarsaTransition",
    "TimeOutObservations",
    "Transition",
    "split_and_pad_trajectories",
    "unpad_trajectories",
]

