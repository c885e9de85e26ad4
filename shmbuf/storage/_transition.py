"""What goes into the PPO storage and what comes out: :class:`Transition` rows, :class:`MiniBatch` es, the
storage's field tables, and the checks a row passes before it is written."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shmbuf._errors import SchemaError, UsageError
from shmbuf.storage._torch import host_array, to_torch

# Per-step arrays, in the order growth and untie_buffer_loop walk them (None ones are skipped).
STEP_ARRAYS = ("observations", "privileged_observations", "actions", "rewards", "dones", "time_outs", "values",
               "actions_log_prob", "mu", "sigma", "returns", "advantages", "hidden_states_actor", "hidden_states_critic")
# Transition attribute -> storage array; a scalar per env is [N] (rsl_rl's [N, 1] is read as [N]).
TRANSITION_FIELDS = {"observations": "observations", "critic_observations": "privileged_observations",
                     "actions": "actions", "rewards": "rewards", "dones": "dones", "time_outs": "time_outs",
                     "values": "values", "actions_log_prob": "actions_log_prob", "action_mean": "mu",
                     "action_sigma": "sigma"}
SCALAR_FIELDS = frozenset({"rewards", "dones", "time_outs", "values", "actions_log_prob"})
REQUIRED = ("observations", "actions", "rewards", "dones", "values", "actions_log_prob")


@dataclass
class Transition:
    """One step of every env, as ``RolloutStorage.Transition`` of rsl_rl's legged-robot forks (plus ``time_outs``): arrays with a
    leading ``N``. ``critic_observations``, ``time_outs`` (False), ``action_mean``/``action_sigma`` and
    ``hidden_states`` (``(actor, critic)``, each ``[N, *rnn_hidden_shape]``) may stay None.

    Flags as rsl_rl: ``dones`` ends the episode, ``time_outs`` says it hit its time limit and is
    bootstrapped whatever ``dones`` says (rsl_rl's envs set both). From gymnasium's ``terminated`` and
    ``truncated``: ``dones=terminated | truncated``, ``time_outs=truncated & ~terminated``."""

    observations: Any = None
    critic_observations: Any = None
    actions: Any = None
    rewards: Any = None
    dones: Any = None
    time_outs: Any = None
    values: Any = None
    actions_log_prob: Any = None
    action_mean: Any = None
    action_sigma: Any = None
    hidden_states: Any = None

    def clear(self) -> None:
        for f in fields(self):
            setattr(self, f.name, None)


@dataclass
class SarsaTransition(Transition):
    """A :class:`Transition` that also carries the next observation; read only at the storage's last row.
    ``next_privileged_observations`` is the forks' name for ``next_critic_observations`` (either may be set)."""

    next_observations: Any = None
    next_critic_observations: Any = None
    next_privileged_observations: Any = None


@dataclass
class ActionLabelTransition(Transition):
    """A :class:`Transition` with ``action_labels`` (shaped like ``actions``): the forks' ``ActionLabelRollout.Transition``."""

    action_labels: Any = None


class _ToTorch:
    __slots__ = ()

    def to_torch(self, device: Any = None) -> Any:
        """The same minibatch with every array a torch tensor (see :func:`shmbuf.storage._torch.to_torch`:
        shares memory on CPU; then ``.to(device)`` if given; read-only arrays are copied first)."""
        return to_torch(self, device)


# The field lists are literals (SarsaMiniBatch's repeats MiniBatch's, then adds two) so that a type checker knows
# the fields: it cannot read a namedtuple's fields from a variable.
class MiniBatch(_ToTorch, namedtuple("MiniBatch", ["obs", "critic_obs", "actions", "values", "advantages", "returns",
                                                   "old_actions_log_prob", "old_mu", "old_sigma", "hidden_states",
                                                   "masks"])):
    """One minibatch, the forks' field names. Flat (:meth:`TimeMajorStorage.mini_batch_generator`): every array
    ``[batch, ...]``, ``hidden_states`` ``(None, None)`` and ``masks`` None, as rsl_rl yields them. Recurrent:
    ``obs``/``critic_obs`` ``[L, traj, ...]`` padded, ``masks`` ``[L, traj]``, ``hidden_states`` an
    :class:`ActorCriticHiddenState` ``(actor, critic)`` ``[traj, *rnn_hidden_shape]`` (``(None, None)`` without
    stored hidden states), the other fields ``[T, envs, ...]`` unpadded. ``critic_obs`` is ``obs`` when there are
    no privileged observations. Every array is the generator's own copy, except the unpadded recurrent fields,
    which are views of the storage when the minibatch's envs are a contiguous range."""

    __slots__ = ()


class SarsaMiniBatch(_ToTorch, namedtuple("SarsaMiniBatch", ["obs", "critic_obs", "actions", "values", "advantages",
                                                             "returns", "old_actions_log_prob", "old_mu", "old_sigma",
                                                             "hidden_states", "masks", "next_obs", "next_critic_obs"])):
    """A :class:`MiniBatch` with ``next_obs`` and ``next_critic_obs`` shaped like ``obs``."""

    __slots__ = ()


class ActionLabelMiniBatch(_ToTorch, namedtuple("ActionLabelMiniBatch", ["obs", "critic_obs", "actions", "values",
                                                                         "advantages", "returns", "old_actions_log_prob",
                                                                         "old_mu", "old_sigma", "hidden_states", "masks",
                                                                         "action_labels"])):
    """A :class:`MiniBatch` with ``action_labels`` shaped like ``actions`` (the forks' ``ActionLabelRollout.MiniBatch``)."""

    __slots__ = ()


class ActorCriticHiddenState(namedtuple("ActorCriticHiddenState", ["actor", "critic"])):
    """A minibatch's ``hidden_states``: ``(actor, critic)``, read by index as rsl_rl's PPO does
    (``hid_states_batch[0]``) or by name as the legged-robot fork's does (``minibatch.hidden_states.actor``). A
    feed-forward minibatch (or a recurrent one of a storage without hidden states) carries ``(None, None)``,
    rsl_rl's value there."""

    __slots__ = ()


NO_HIDDEN_STATES = ActorCriticHiddenState(None, None)


# What the generators yield: a MiniBatch, or from a SarsaRolloutStorage a SarsaMiniBatch, from an ActionLabelRollout an
# ActionLabelMiniBatch (neither a subclass of it).
AnyMiniBatch = MiniBatch | SarsaMiniBatch | ActionLabelMiniBatch


TimeOutObservations = namedtuple("TimeOutObservations", ["step", "env", "obs"])
TimeOutObservations.__doc__ = """Truncated (not terminated) episodes of a rollout: row ``step[i]``, env ``env[i]``
ended by a time limit, and ``obs[i]`` is its final observation (a copy). See
:meth:`TimeMajorStorage.time_out_values_from`."""


def array_of(name: str, x: Any) -> np.ndarray:
    """``x`` as a numpy array, or SchemaError naming the field (ragged lists, a GPU tensor, ...)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(host_array(x))  # a torch tensor on any device: detached and copied to the host
    except Exception as exc:  # noqa: BLE001  # ragged nesting (ValueError), whatever an __array__ raises
        raise SchemaError(f"Transition.{name}: could not read a {type(x).__name__} as a numpy array ({type(exc).__name__}: "
                          f"{exc}); pass an array (or tensor) of one row of every env") from None


def as_row(name: str, x: Any, row: np.ndarray) -> np.ndarray:
    """``x`` checked to be writable into ``row`` (shape, and a dtype that casts 'same_kind'; bool or numbers into
    a bool row), or SchemaError naming the field. Nothing is written."""
    x = array_of(name, x)
    if name in SCALAR_FIELDS and x.shape == row.shape + (1,):
        x = x[..., 0]
    if x.shape != row.shape:
        raise SchemaError(f"Transition.{name}: expected shape {row.shape} (one row of every env), got {x.shape}")
    if row.dtype == np.bool_:
        if x.dtype.kind not in "biuf":
            raise SchemaError(f"Transition.{name}: expected bool (or numbers, nonzero meaning true), got dtype {x.dtype}")
    elif x.dtype.kind not in "biuf" or not np.can_cast(x.dtype, row.dtype, casting="same_kind"):
        raise SchemaError(f"Transition.{name}: expected numbers that cast to {row.dtype} under numpy's 'same_kind' rule, "
                          f"got dtype {x.dtype}")
    return x


def shape_setting(setting: str, value: Any) -> tuple[int, ...]:
    """A shape setting as a tuple of ints >= 0: an int ``k`` is ``(k,)``; else UsageError naming the setting."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    try:
        dims = tuple(value)
    except TypeError:
        dims = (None,)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise UsageError(f"{setting}: expected a shape (a tuple of ints >= 0, or one int), got {value!r:.80}")
    return tuple(int(d) for d in dims)

