"""PPO rollout storage (002 / rsl_rl's ``RolloutStorage``), its rolling and next-observation variants, and
filling one straight from shmbuf rollouts and batches.

Layout: every per-step array is time-major ``[T, N, ...]`` (T = ``num_transitions_per_env``, N = ``num_envs``).
Scalars per step (rewards, dones, time_outs, values, actions_log_prob, returns, advantages) are ``[T, N]``,
not rsl_rl's ``[T, N, 1]`` (a ``[N, 1]`` input is accepted and read as ``[N]``); dones and time_outs are bool.

The flags mean what the way in says (``flag_convention``; see :mod:`shmbuf.storage.gae` for the formulas):

- ``add_transitions`` (``"rsl_rl"``): 002 / rsl_rl's ``dones`` (every episode end) and ``time_outs`` (hit the
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
:class:`MiniBatch` of numpy arrays with ``to_torch(device=None)``. numpy only; torch is imported by ``to_torch``.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shmbuf._errors import SchemaError, TimescaleFull, UsageError
from shmbuf.storage._torch import to_torch
from shmbuf.storage.gae import check_discount, compute_gae
from shmbuf.storage.gae import normalize_advantages as _normalize
from shmbuf.storage._common import generator, leaf_at

__all__ = [
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


# -- what goes in, what comes out ---------------------------------------------------------------------

@dataclass
class Transition:
    """One step of every env, as 002's ``RolloutStorage.Transition`` (plus ``time_outs``): arrays with a
    leading ``N``. ``critic_observations``, ``time_outs`` (False), ``action_mean``/``action_sigma`` and
    ``hidden_states`` (``(actor, critic)``, each ``[N, *rnn_hidden_shape]``) may stay None.

    Flags as 002 / rsl_rl: ``dones`` ends the episode, ``time_outs`` says it hit its time limit and is
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
    """A :class:`Transition` that also carries the next observation; read only at the storage's last row."""

    next_observations: Any = None
    next_critic_observations: Any = None


class _ToTorch:
    __slots__ = ()

    def to_torch(self, device: Any = None) -> Any:
        """The same minibatch with every array a torch tensor (see :func:`shmbuf.storage._torch.to_torch`:
        shares memory on CPU; then ``.to(device)`` if given; read-only arrays are copied first)."""
        return to_torch(self, device)


_MB_FIELDS = ["obs", "critic_obs", "actions", "values", "advantages", "returns", "old_actions_log_prob", "old_mu",
              "old_sigma", "hidden_states", "masks"]


class MiniBatch(_ToTorch, namedtuple("MiniBatch", _MB_FIELDS)):
    """One minibatch, 002's field names. Flat (:meth:`RolloutStorage.mini_batch_generator`): every array
    ``[batch, ...]``, ``hidden_states`` and ``masks`` None. Recurrent: ``obs``/``critic_obs`` ``[L, traj, ...]``
    padded, ``masks`` ``[L, traj]``, ``hidden_states`` ``(actor, critic)`` ``[traj, *rnn_hidden_shape]`` (or
    None), the other fields ``[T, envs, ...]`` unpadded. ``critic_obs`` is ``obs`` when there are no privileged
    observations. Every array is the generator's own copy, except the unpadded recurrent fields, which are
    views of the storage when the minibatch's envs are a contiguous range."""

    __slots__ = ()


class SarsaMiniBatch(_ToTorch, namedtuple("SarsaMiniBatch", [*_MB_FIELDS, "next_obs", "next_critic_obs"])):
    """A :class:`MiniBatch` with ``next_obs`` and ``next_critic_obs`` shaped like ``obs``."""

    __slots__ = ()


TimeOutObservations = namedtuple("TimeOutObservations", ["step", "env", "obs"])
TimeOutObservations.__doc__ = """Truncated (not terminated) episodes of a rollout: row ``step[i]``, env ``env[i]``
ended by a time limit, and ``obs[i]`` is its final observation (a copy). See
:meth:`RolloutStorage.time_out_values_from`."""


# -- trajectory helpers ------------------------------------------------------------------------------

def _trajectories(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trajectories of a ``[T, N]`` episode-end mask, env-major (env 0's in time order, then env 1's, ...):
    ``(env, first step, length)`` of each. Every env's last trajectory is cut at T."""
    T, N = ends.shape
    first = np.empty((N, T), bool)
    first[:, 0] = True
    first[:, 1:] = ends[:-1].T
    starts = np.flatnonzero(first)
    lengths = np.diff(np.append(starts, N * T))
    env, t0 = np.divmod(starts, T)
    return env, t0, lengths


def _pad(arr: np.ndarray, t0: np.ndarray, env: np.ndarray, lengths: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Trajectories of ``arr`` ``[T, N, ...]`` gathered into ``[L, traj, ...]`` (zeros past each end) and the masks."""
    masks = np.arange(L)[:, None] < lengths[None, :]
    s, c = np.nonzero(masks)
    out = np.zeros((L, len(lengths), *arr.shape[2:]), arr.dtype)
    out[s, c] = arr[t0[c] + s, env[c]]
    return out, masks


def split_and_pad_trajectories(arr: Any, dones: Any, *, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """rsl_rl's helper, in numpy: split ``arr`` ``[T, N, ...]`` at episode ends (``dones`` ``[T, N]``, true at a
    trajectory's last step) into trajectories, env-major, and pad them to ``[L, traj, ...]`` with zeros; return
    ``(padded, masks)``, ``masks[s, j]`` true where trajectory ``j`` has a step ``s``. ``L`` is ``pad_to``
    (rsl_rl pads to T) or the longest trajectory's length."""
    arr = np.asarray(arr)
    dones = np.asarray(dones).reshape(arr.shape[:2]).astype(bool, copy=False)
    env, t0, lengths = _trajectories(dones)
    L = int(lengths.max()) if pad_to is None else int(pad_to)
    return _pad(arr, t0, env, lengths, L)


def unpad_trajectories(padded: Any, masks: Any, num_steps: int | None = None) -> Any:
    """Inverse of the padding: ``[L, traj, ...]`` back to ``[T, envs, ...]`` (rsl_rl's ``unpad_trajectories``),
    for trajectories that tile whole envs, as a recurrent minibatch's do. ``num_steps`` is T (default ``L``, as
    when padded to T). Works on numpy arrays and torch tensors alike."""
    L = padded.shape[0]
    T = L if num_steps is None else num_steps
    flat = padded.swapaxes(0, 1)[masks.swapaxes(0, 1)]
    return flat.reshape(-1, T, *padded.shape[2:]).swapaxes(0, 1)


# -- reading shmbuf rollouts ---------------------------------------------------------------------------

def _short_repr(src: Any) -> str:
    r = repr(src)  # a Rollout's or Batch's repr is one short line; a plain container's may hold every array
    return r if len(r) <= 200 else f"{type(src).__name__} object at 0x{id(src):x}"


class _Source:
    """A Rollout ``(T, [E], ...)`` or a batch ``(B, T, [E], ...)``, read through ``.data`` and ``.fill``."""

    def __init__(self, src: Any, reward_key: str):
        data, fill = getattr(src, "data", None), getattr(src, "fill", None)
        self.name = _short_repr(src)
        if not isinstance(data, Mapping) or not isinstance(data.get("step"), Mapping):
            raise UsageError(f"from_rollout: expected a shmbuf Rollout, Batch or workers CollectedBatch (with .data['step'] "
                             f"and .fill), got {type(src).__name__}")
        if fill is None:
            raise UsageError(f"from_rollout: {self.name} has fill=None: a complete-episodes batch (episodes "
                             "concatenated, not time-major [T, N]); collect with batch_mode='truncate_episodes'")
        if not isinstance(fill, Mapping) or "step" not in fill:
            have = sorted(fill) if isinstance(fill, Mapping) else type(fill).__name__
            raise SchemaError(f"from_rollout: {self.name} has no fill['step'] (the filled count of each rollout; there is "
                              f"{have}): expected a shmbuf Rollout, Batch or workers CollectedBatch")
        self.data, self.step = data, data["step"]
        try:  # the reward leaf sets T, E (and B)
            rew = np.asarray(leaf_at(self.step, reward_key, "from_rollout"))
        except KeyError as e:
            raise SchemaError(f"{e.args[0]}. The storage needs the rewards (reward_key={reward_key!r})") from None
        f = fill["step"]
        self.batched = np.ndim(f) > 0
        lead = 1 if self.batched else 0
        if rew.ndim not in (lead + 1, lead + 2):
            raise SchemaError(f"from_rollout: step leaf {reward_key!r} (reward_key) has shape {rew.shape}; expected "
                              f"{'(B, T) or (B, T, E)' if self.batched else '(T,) or (T, E)'}")
        self.B = rew.shape[0] if self.batched else 1
        self.T = rew.shape[lead]
        self.E = rew.shape[lead + 1] if rew.ndim == lead + 2 else None
        self.N = self.B * (self.E or 1)
        self._check_full(np.asarray(f))
        self.copied: list[str] = []
        self.fill = fill

    def _check_full(self, f: np.ndarray) -> None:
        short = np.flatnonzero(f.reshape(-1) != self.T)
        if short.size:
            i = int(short[0])
            which = f"rollout {i} of the batch {self.name}" if self.batched else f"the rollout {self.name}"
            raise UsageError(f"from_rollout: {which} has fill['step']={int(f.reshape(-1)[i])} of T={self.T}: only "
                             "full rollouts make a [T, N] storage; collect in truncate-episodes mode with an episode "
                             "table that cannot fill (the default max_episodes), or drop short rollouts first")

    def lead_shape(self) -> tuple[int, ...]:
        env = () if self.E is None else (self.E,)
        return ((self.B,) if self.batched else ()) + (self.T,) + env

    def steps(self, key: str, what: str, field: str, *, scalar: bool = False) -> np.ndarray:
        """Step leaf ``key`` as ``[T, N, ...]``: a view, or (batch with an env dim) a copy, ``field`` then
        recorded in ``copied``."""
        try:
            x = leaf_at(self.step, key, "from_rollout")
        except KeyError as e:
            raise SchemaError(f"{e.args[0]}. The storage needs {what}") from None
        x = np.asarray(x)
        lead = self.lead_shape()
        if x.shape[: len(lead)] != lead:
            raise SchemaError(f"from_rollout: step leaf {key!r} has shape {x.shape}; expected it to start with {lead}")
        rest = x.shape[len(lead):]
        if not self.batched:
            y = x if self.E is not None else x[:, None]
        elif self.E is None:
            y = x.swapaxes(0, 1)
        else:
            y = x.swapaxes(0, 1)
            try:
                y = np.reshape(y, (self.T, self.N, *rest), copy=False)
            except ValueError:  # (T, B, E) with B > 1, E > 1, T > 1 cannot be merged into B*E without a copy
                y = np.reshape(y, (self.T, self.N, *rest))
                self.copied.append(field)
        if scalar:
            if y.shape[2:] == (1,):
                y = y[..., 0]
            if y.shape != (self.T, self.N):
                raise SchemaError(f"from_rollout: step leaf {key!r} has shape {x.shape}; expected one number per step "
                                  f"and env, {lead} (or with a trailing 1)")
        return y

    def per_env(self, x: Any) -> np.ndarray:
        """A ``(B, [E], ...)`` or ``([E], ...)`` leaf as ``[N, ...]`` (always a view: the env dims are adjacent)."""
        x = np.asarray(x)
        k = (1 if self.batched else 0) + (0 if self.E is None else 1)
        return x.reshape(self.N, *x.shape[k:]) if k else x[None]

    def bootstrap(self, key: str) -> np.ndarray | None:
        """The bootstrap observation under ``key`` ("obs/..." paths map into ``data['bootstrap']``) as ``[N, ...]``."""
        boot = self.data.get("bootstrap")
        try:
            return None if boot is None else self.per_env(leaf_at(boot, key, "bootstrap"))
        except KeyError:
            return None

    def time_outs(self, obs_key: str) -> TimeOutObservations | None:
        """Episodes that were truncated (not terminated), from the episode table: where and their final obs."""
        ep = self.data.get("episode")
        parts = obs_key.split("/")
        need = ("end", "env", "truncated", "terminated", "final_obs")
        if not isinstance(ep, Mapping) or any(k not in ep for k in need) or parts[0] != "obs":
            return None
        n = np.asarray(self.fill["episode"])
        trunc = np.asarray(ep["truncated"]) & ~np.asarray(ep["terminated"])
        valid = np.arange(trunc.shape[-1]) < (n[:, None] if self.batched else n)
        idx = np.nonzero(trunc & valid)
        final = ep["final_obs"]
        for p in parts[1:]:
            final = final[p]
        env = np.asarray(ep["env"])[idx].astype(np.intp)
        if self.batched:
            env = idx[0] * (self.E or 1) + env
        return TimeOutObservations(np.asarray(ep["end"])[idx].astype(np.intp), env, np.asarray(final)[idx])


def _array(name: str, x: Any) -> np.ndarray:
    """``x`` as a numpy array, or SchemaError naming the field (ragged lists, a GPU tensor, ...)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001  # ragged nesting (ValueError), whatever an __array__ raises
        raise SchemaError(f"Transition.{name}: could not read a {type(x).__name__} as a numpy array ({type(exc).__name__}: "
                          f"{exc}); pass an array of one row of every env (for torch: tensor.detach().cpu())") from None


def _as_row(name: str, x: Any, row: np.ndarray) -> np.ndarray:
    """``x`` checked to be writable into ``row`` (shape, and a dtype that casts 'same_kind'; bool or numbers into
    a bool row), or SchemaError naming the field. Nothing is written."""
    x = _array(name, x)
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


def _shape(setting: str, value: Any) -> tuple[int, ...]:
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


def _check_int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"{name}: expected an int {rng}, got {v!r}")
    return int(v)


def _check_keys(required: dict[str, Any], optional: dict[str, Any]) -> None:
    """from_rollout's leaf keys: a non-empty str each (None allowed for the optional ones); UsageError naming the setting."""
    for setting, key in [*required.items(), *optional.items()]:
        if key is None and setting in optional:
            continue
        if not isinstance(key, str) or not key:
            need = "" if setting in optional else " (required: the storage cannot do without it)"
            raise UsageError(f"from_rollout({setting}=...): expected the name of a step leaf, a str ('a/b' walks nested "
                             f"dicts){need}, got {key!r:.80}")


def _aliases(arrays: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split off the fields that are the same array as an earlier one (002's ``critic_obs = obs`` when there
    are no privileged observations): they are gathered once and yielded as the same object."""
    own: dict[str, Any] = {}
    alias: dict[str, str] = {}
    for name, a in arrays.items():
        same = next((m for m, b in own.items() if a is not None and b is a), None)
        if same is None:
            own[name] = a
        else:
            alias[name] = same
    return own, alias


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + c)`` for each pair, without a Python loop."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(total)


def _flat_getter(arr: np.ndarray, n: int, N: int) -> Any:
    """``idx -> rows`` of ``arr[:n]`` taken as ``[n * N, ...]``: ``take`` on a flat view, or a 2-index gather."""
    head = arr[:n]
    try:
        flat = np.reshape(head, (n * N, *arr.shape[2:]), copy=False)
        return lambda idx: flat.take(idx, axis=0)
    except ValueError:
        return lambda idx: head[idx // N, idx % N]


# -- the storage ----------------------------------------------------------------------------------------

class RolloutStorage:
    """PPO rollout storage: time-major ``[T, N, ...]`` numpy arrays (002 / rsl_rl's ``RolloutStorage``).

    Arrays: ``observations``, ``privileged_observations`` (critic observations; None when not used),
    ``actions``, ``rewards``, ``dones``, ``time_outs`` (read as ``flag_convention`` says), ``values``,
    ``actions_log_prob``, ``mu``, ``sigma``, ``returns``, ``advantages``, and with ``rnn_hidden_shape``
    ``hidden_states_actor``/``hidden_states_critic`` ``[T, N, *rnn_hidden_shape]`` (the state each step's
    network call started from; with torch's ``(num_layers, N, H)`` store ``h.transpose(0, 1)``; an LSTM's
    ``(h, c)`` can be stacked into ``rnn_hidden_shape = (2, num_layers, H)``).

    ``step`` counts the rows filled; :meth:`compute_returns`, the generators and :meth:`get_statistics`
    work on rows ``[0, step)``. Shuffling draws from ``rng`` (``np.random.default_rng(seed)``).

    ``flag_convention`` says how :meth:`compute_returns` reads the flags: ``"rsl_rl"`` for a storage made
    here and filled by :meth:`add_transitions` (002 / rsl_rl: ``dones`` every episode end, and a
    ``time_outs`` step bootstraps whatever ``dones`` says), ``"gymnasium"`` for one made by
    :meth:`from_rollout` (``dones`` = terminated, ``time_outs`` = truncated; terminated wins). Set it to
    ``"gymnasium"`` to fill with gymnasium's ``terminated``/``truncated`` as they are.
    """

    Transition = Transition
    MiniBatch = MiniBatch

    def __init__(self, num_envs: int, num_transitions_per_env: int, obs_shape: Any, privileged_obs_shape: Any,
                 actions_shape: Any, rnn_hidden_shape: Any = None, *, dtype: Any = np.float32, seed: Any = None):
        N = _check_int("num_envs", num_envs, 1)
        T = _check_int("num_transitions_per_env", num_transitions_per_env, 1)
        self._setup(T, N, seed)
        f = np.dtype(dtype)
        if not np.issubdtype(f, np.floating):
            raise UsageError(f"dtype: expected a floating dtype, got {f}")
        obs = _shape("obs_shape", obs_shape)
        act = _shape("actions_shape", actions_shape)
        priv = privileged_obs_shape
        if isinstance(priv, (list, tuple)) and len(priv) > 0 and priv[0] is None:
            priv = None  # rsl_rl passes [None] for "no privileged observations"
        priv = None if priv is None else _shape("privileged_obs_shape", priv)
        hid = None if rnn_hidden_shape is None else _shape("rnn_hidden_shape", rnn_hidden_shape)
        self.observations = np.zeros((T, N, *obs), f)
        self.privileged_observations = None if priv is None else np.zeros((T, N, *priv), f)
        self.actions = np.zeros((T, N, *act), f)
        self.rewards = np.zeros((T, N), f)
        self.dones = np.zeros((T, N), bool)
        self.time_outs = np.zeros((T, N), bool)
        self.values = np.zeros((T, N), f)
        self.actions_log_prob = np.zeros((T, N), f)
        self.mu = np.zeros((T, N, *act), f)
        self.sigma = np.zeros((T, N, *act), f)
        self.returns = np.zeros((T, N), f)
        self.advantages = np.zeros((T, N), f)
        if hid is not None:
            self.hidden_states_actor = np.zeros((T, N, *hid), f)
            self.hidden_states_critic = np.zeros((T, N, *hid), f)

    def _setup(self, T: int, N: int, seed: Any) -> None:
        self.num_transitions_per_env = T
        self.num_envs = N
        self.rng = generator(seed, "seed")
        self.step = 0
        self.privileged_observations: np.ndarray | None = None
        self.mu: np.ndarray | None = None
        self.sigma: np.ndarray | None = None
        self.hidden_states_actor: np.ndarray | None = None
        self.hidden_states_critic: np.ndarray | None = None
        self.bootstrap_observations: np.ndarray | None = None
        self.bootstrap_critic_observations: np.ndarray | None = None
        self.time_out_observations: TimeOutObservations | None = None
        self.copied: tuple[str, ...] = ()
        self._borrowed: str | None = None
        self.flag_convention = "rsl_rl"  # add_transitions: 002 / rsl_rl's dones and time_outs

    # -- filling --------------------------------------------------------------------------------------

    @classmethod
    def from_rollout(cls, rollout_or_batch: Any, *, obs_key: str = "obs", critic_obs_key: str | None = None,
                     action_key: str = "action", reward_key: str = "reward", terminated_key: str = "terminated",
                     truncated_key: str = "truncated", value_key: str = "value", log_prob_key: str = "log_prob",
                     mu_key: str | None = None, sigma_key: str | None = None,
                     hidden_states_keys: tuple[str, str] | None = None, seed: Any = None) -> RolloutStorage:
        """A full storage over a shmbuf rollout or batch, in the workers layout, without a per-step loop.

        ``rollout_or_batch``: a ``shmbuf.Rollout`` (step leaves ``(T, [E], ...)``), or a ``shmbuf.Batch`` /
        workers ``CollectedBatch`` (``(B, T, [E], ...)``), read through ``.data`` and ``.fill``. Keys name step
        leaves (``"a/b"`` walks a nested dict); ``value_key`` and ``log_prob_key`` are policy extras, so the
        policy must return ``(action, {"value": ..., "log_prob": ...})``. ``obs_key``, ``action_key``,
        ``reward_key``, ``terminated_key``, ``value_key`` and ``log_prob_key`` are required (a str; None is a
        UsageError); ``truncated_key=None`` means no episode is ever truncated (``time_outs`` all False, the
        storage's own array); a key with no leaf is a SchemaError naming it. ``dones`` is the terminated leaf
        and ``time_outs`` the truncated one, read as gymnasium means them (``flag_convention =
        "gymnasium"``): a step both terminated and truncated is terminated and not bootstrapped. Every
        rollout must be full (``fill["step"] == T``); a short one is refused with a UsageError naming it
        and its fill.

        Views and copies: ``N = B * E`` (E = 1 without an env dim). Each per-step array is a view of the
        source's leaf, except for a batch whose leaves have an env dim with B > 1, E > 1 and T > 1: merging
        ``(T, B, E)`` into ``[T, B*E]`` then needs one copy of that leaf (the field's name goes to ``copied``;
        so does ``dones``/``time_outs`` when the flags are not bool and must be converted). A
        Rollout is never copied; a batch without an env dim becomes ``[T, B]`` by a transpose (a view).
        ``returns`` and ``advantages`` are the storage's own. ``bootstrap_observations`` ``[N, ...]`` (a view
        of ``data["bootstrap"]``) is what ``last_values`` is computed from, and ``time_out_observations`` the
        final observations of truncated episodes (see :meth:`time_out_values_from`).

        Lifetime: the views are the source's: valid until the Rollout is released, or until the reader (or
        Collector) refills its batch buffer (``copy=False``); writing into them writes into the source.
        The storage cannot take ``add_transitions`` (it would write into the rollout).
        """
        _check_keys({"obs_key": obs_key, "action_key": action_key, "reward_key": reward_key,
                     "terminated_key": terminated_key, "value_key": value_key, "log_prob_key": log_prob_key},
                    {"critic_obs_key": critic_obs_key, "truncated_key": truncated_key, "mu_key": mu_key, "sigma_key": sigma_key})
        if hidden_states_keys is not None:
            if not (isinstance(hidden_states_keys, (tuple, list)) and len(hidden_states_keys) == 2):
                raise UsageError(f"from_rollout(hidden_states_keys=...): expected (actor key, critic key), got {hidden_states_keys!r:.80}")
            _check_keys({"hidden_states_keys[0]": hidden_states_keys[0], "hidden_states_keys[1]": hidden_states_keys[1]}, {})
        src = _Source(rollout_or_batch, reward_key)
        need_v = f"the critic's value of each step's observation (a policy extra, key {value_key!r})"
        need_lp = f"the log-probability of each step's action (a policy extra, key {log_prob_key!r})"
        def steps(field: str, key: str | None, what: str, scalar: bool = False) -> np.ndarray | None:
            return None if key is None else src.steps(key, what, field, scalar=scalar)

        arrays: dict[str, np.ndarray | None] = {
            "observations": steps("observations", obs_key, "the observations (obs_key=...)"),
            "privileged_observations": steps("privileged_observations", critic_obs_key, "critic observations"),
            "actions": steps("actions", action_key, "the actions (action_key=...)"),
            "rewards": steps("rewards", reward_key, "the rewards", True),
            "dones": steps("dones", terminated_key, "terminated flags", True),
            "time_outs": steps("time_outs", truncated_key, "truncated flags", True),
            "values": steps("values", value_key, need_v + ": make the policy return (action, {'value': V(obs), ...})", True),
            "actions_log_prob": steps("actions_log_prob", log_prob_key,
                                      need_lp + ": make the policy return (action, {'log_prob': ...})", True),
            "mu": steps("mu", mu_key, "the action means (mu_key=...)"),
            "sigma": steps("sigma", sigma_key, "the action stds (sigma_key=...)"),
        }
        if hidden_states_keys is not None:
            arrays["hidden_states_actor"] = steps("hidden_states_actor", hidden_states_keys[0], "actor hidden states")
            arrays["hidden_states_critic"] = steps("hidden_states_critic", hidden_states_keys[1], "critic hidden states")
        if arrays["time_outs"] is None:  # truncated_key=None: no episode is ever truncated
            arrays["time_outs"] = np.zeros((src.T, src.N), bool)
        for k in ("dones", "time_outs"):
            if arrays[k].dtype.kind not in "biuf":  # type: ignore[union-attr]
                raise SchemaError(f"from_rollout: step leaf for {k} has dtype {arrays[k].dtype}: expected bool or numbers "  # type: ignore[union-attr]
                                  "(nonzero meaning true)")
            if arrays[k].dtype != np.bool_:  # type: ignore[union-attr]
                arrays[k] = arrays[k] != 0
                if k not in src.copied:
                    src.copied.append(k)
        self = cls.__new__(cls)
        self._setup(src.T, src.N, seed)
        self.bootstrap_observations = src.bootstrap(obs_key)
        if critic_obs_key is not None:
            self.bootstrap_critic_observations = src.bootstrap(critic_obs_key)
        self.time_out_observations = None if truncated_key is None else src.time_outs(obs_key)
        self._adopt(arrays, src)
        self.copied = tuple(src.copied)
        self.flag_convention = "gymnasium"  # the actors' own terminated / truncated
        return self

    def _adopt(self, arrays: dict[str, np.ndarray | None], src: _Source) -> None:
        for k, a in arrays.items():
            setattr(self, k, a)
        dtype = np.result_type(arrays["values"], arrays["rewards"], np.float32)  # type: ignore[arg-type]
        self.returns = np.zeros((src.T, src.N), dtype)
        self.advantages = np.zeros((src.T, src.N), dtype)
        self.step = src.T
        self._borrowed = src.name

    def add_transitions(self, transition: Transition) -> None:
        """Copy one step of every env into row ``step`` and advance it.

        Raises:
            TimescaleFull (an IndexError): the storage is full (``step == num_transitions_per_env``).
            SchemaError (a ValueError): a required field is None or has the wrong shape (names it).
            UsageError: this storage is a view of a rollout (made by :meth:`from_rollout`).
        """
        if self._borrowed is not None:
            raise UsageError(f"add_transitions: this storage is a view of {self._borrowed} (made by from_rollout); "
                             "writing would change that rollout. Make a RolloutStorage(...) to fill step by step")
        T = self.num_transitions_per_env
        if self.step >= T:
            raise TimescaleFull(f"{type(self).__name__}.add_transitions: step {self.step} is past the capacity "
                                f"num_transitions_per_env={T}; call clear() after each update, or make a larger storage")
        self._write_row(self.step, transition)
        self.step += 1

    def _write_row(self, t: int, tr: Transition) -> None:
        rows = {}
        for name, field in TRANSITION_FIELDS.items():  # check everything before writing anything
            dst = getattr(self, field)
            x = getattr(tr, name)
            if dst is None:
                continue
            if x is None:
                if field in REQUIRED or field == "privileged_observations":
                    raise SchemaError(f"Transition.{name} is None; this storage needs it (shape {dst.shape[1:]})")
                if field == "time_outs":
                    rows[field] = np.zeros(dst.shape[1:], bool)
                continue
            rows[field] = _as_row(name, x, dst[t])
        hidden = self._hidden_rows(tr.hidden_states)
        # every field checked (shape and dtype): from here on nothing can fail half-way
        for field, x in rows.items():
            dst = getattr(self, field)
            if dst.dtype == np.bool_:
                np.not_equal(x, 0, out=dst[t])
            else:
                np.copyto(dst[t], x, casting="same_kind")
        for name, dst, x in hidden:
            if getattr(self, name) is None:
                setattr(self, name, dst)
            np.copyto(dst[t], x, casting="same_kind")

    def _hidden_rows(self, hidden: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(storage name, array, checked row)`` of each hidden state given; a new array (first use without
        ``rnn_hidden_shape``) is allocated here and attached by the caller once everything is checked."""
        if hidden is None:
            return []
        if not (isinstance(hidden, (tuple, list)) and len(hidden) == 2):
            raise SchemaError(f"Transition.hidden_states: expected (actor, critic) arrays, got {type(hidden).__name__}")
        out = []
        for name, h in zip(("hidden_states_actor", "hidden_states_critic"), hidden):
            if h is None:
                continue
            h = _array(name, h)
            dst = getattr(self, name)
            if dst is None:  # first use without rnn_hidden_shape: allocate from the example, as 002 does
                if h.shape[:1] != (self.num_envs,):
                    raise SchemaError(f"Transition.hidden_states: expected a leading num_envs={self.num_envs}, got {h.shape}")
                dst = np.zeros((self.num_transitions_per_env, *h.shape), self.values.dtype)
            out.append((name, dst, _as_row(name, h, dst[0])))
        return out

    def clear(self) -> None:
        """Start the next rollout at row 0 (nothing is zeroed: every row is rewritten before it is read)."""
        self.step = 0

    # -- returns and advantages -----------------------------------------------------------------------

    def _count(self) -> int:
        """How many rows (from row 0, in time order) hold data."""
        return self.step

    def _filled(self) -> int:
        n = self._count()
        if n == 0:
            raise UsageError(f"{type(self).__name__}: nothing is stored yet (step 0); add transitions first")
        return n

    def compute_returns(self, last_values: Any, gamma: float, lam: float, *, time_out_values: Any = None,
                        normalize_advantages: bool = False) -> None:
        """GAE into this storage's own ``advantages`` and ``returns`` (rows ``[0, step)``), via :func:`compute_gae`.

        ``last_values`` ``[N]`` (or ``[N, 1]``): the critic's value of the observation after the last row.
        Time-outs bootstrap from ``time_out_values`` ``[T, N]`` (the final observations' values, read only at
        time-out steps; :meth:`time_out_values_from` builds it) or else from ``values`` (002's approximation);
        terminations do not bootstrap. Which steps are time-outs follows ``flag_convention``: ``"rsl_rl"``
        (filled by :meth:`add_transitions`): every ``time_outs`` step, whatever ``dones`` says, as rsl_rl's
        PPO (``compute_gae(..., time_outs=)``); ``"gymnasium"`` (made by :meth:`from_rollout`): ``time_outs
        & ~dones`` (``compute_gae(..., truncated=)``). ``normalize_advantages``: then ``(A - mean) / (std +
        1e-8)`` over all rows, as rsl_rl does on every call (off by default: returns are computed before
        normalising either way).
        ``gamma`` and ``lam``: real numbers from 0 to 1 (else UsageError naming the setting).
        """
        self._check_discounts(gamma, lam)
        rule = self.flag_convention
        if rule not in ("rsl_rl", "gymnasium"):
            raise UsageError(f"{type(self).__name__}.compute_returns: flag_convention is {rule!r:.80}; expected "
                             "'rsl_rl' (dones and time_outs as 002 / rsl_rl) or 'gymnasium' (terminated and truncated)")
        n = self._filled()
        lv = np.asarray(last_values)
        if lv.shape == (self.num_envs, 1):
            lv = lv[:, 0]
        tov = None
        if time_out_values is not None:
            tov = np.asarray(time_out_values)
            if tov.shape[2:] == (1,):
                tov = tov[..., 0]
            tov = tov[:n]
        flags = {"time_outs" if rule == "rsl_rl" else "truncated": self.time_outs[:n]}
        compute_gae(self.rewards[:n], self.values[:n], self.dones[:n], lv, gamma, lam, **flags,
                    time_out_values=tov, out=(self.advantages[:n], self.returns[:n]))
        if normalize_advantages:
            _normalize(self.advantages[:n])

    def _check_discounts(self, gamma: Any, lam: Any) -> None:
        where = f"{type(self).__name__}.compute_returns"
        check_discount(where, "gamma", gamma)
        check_discount(where, "lam", lam)

    def time_out_values_from(self, final_values: Any) -> np.ndarray:
        """``[T, N]`` zeros with ``final_values[i]`` (the critic's value of ``time_out_observations.obs[i]``) at
        each truncated episode's last step: the ``time_out_values`` of :meth:`compute_returns`."""
        to = self.time_out_observations
        if to is None:
            raise UsageError("time_out_values_from: this storage has no time_out_observations (it was not made by "
                             "from_rollout from a rollout with a truncate-episodes episode table)")
        out = np.zeros(self.values.shape, self.values.dtype)
        v = np.asarray(final_values).reshape(len(to.step))
        out[to.step, to.env] = v
        return out

    # -- minibatches --------------------------------------------------------------------------------------

    def _obs_fields(self) -> dict[str, np.ndarray]:
        """Fields padded into trajectories by the recurrent generator (observation-like)."""
        obs = self.observations
        priv = self.privileged_observations
        return {"obs": obs, "critic_obs": obs if priv is None else priv}

    def _step_fields(self) -> dict[str, np.ndarray | None]:
        return {"actions": self.actions, "values": self.values, "advantages": self.advantages, "returns": self.returns,
                "old_actions_log_prob": self.actions_log_prob, "old_mu": self.mu, "old_sigma": self.sigma}

    def mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8) -> Iterator[MiniBatch]:
        """Shuffled flat minibatches ``[batch, ...]`` of rows ``[0, step)``: each epoch draws a new permutation
        and every transition is in exactly one of its ``num_mini_batches`` minibatches (sizes differ by at most
        one when ``step * num_envs`` does not divide; rsl_rl drops the remainder, and reuses one permutation for
        every epoch). The arrays are fresh copies (gathered)."""
        n = self._filled()
        N = self.num_envs
        M = n * N
        k = _check_int("mini_batch_generator(num_mini_batches=...)", num_mini_batches, 1, M)
        epochs = _check_int("mini_batch_generator(num_epochs=...)", num_epochs, 0)
        src, alias = _aliases({**self._obs_fields(), **self._step_fields()})
        get = {name: (None if a is None else _flat_getter(a, n, N)) for name, a in src.items()}
        for _ in range(epochs):
            for idx in np.array_split(self.rng.permutation(M), k):
                out = {name: (None if g is None else g(idx)) for name, g in get.items()}
                for name, same in alias.items():
                    out[name] = out[same]
                yield self.MiniBatch(**out, hidden_states=None, masks=None)

    def recurrent_mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8, *, shuffle: bool = False,
                                       pad_to: str = "longest") -> Iterator[MiniBatch]:
        """Minibatches of whole envs, their trajectories split at episode ends (``dones`` or ``time_outs``).

        Envs are cut into ``num_mini_batches`` groups (contiguous ranges as rsl_rl does, or with
        ``shuffle=True`` a fresh random split each epoch, each group in ascending env order). For a group,
        ``obs``/``critic_obs`` are its trajectories (env-major, each in time order) padded with zeros to
        ``[L, traj, ...]``, ``L`` the longest of them (``pad_to="longest"``) or T (``pad_to="rollout"``, as
        rsl_rl); ``masks`` ``[L, traj]`` marks the real steps, so every stored step is in exactly one minibatch
        per epoch; ``hidden_states`` are ``(actor, critic)`` as stored at each trajectory's first step,
        ``[traj, *rnn_hidden_shape]`` (None without hidden states). The other fields are ``[T, envs, ...]``:
        :func:`unpad_trajectories` (with ``num_steps=T``) maps a network's padded output onto them.
        """
        n = self._filled()
        N = self.num_envs
        k = _check_int("recurrent_mini_batch_generator(num_mini_batches=...)", num_mini_batches, 1, N)
        epochs = _check_int("recurrent_mini_batch_generator(num_epochs=...)", num_epochs, 0)
        if pad_to not in ("longest", "rollout"):
            raise UsageError(f"recurrent_mini_batch_generator(pad_to=...): expected 'longest' or 'rollout', got {pad_to!r}")
        env, t0, lengths = _trajectories(self.dones[:n] | self.time_outs[:n])
        obs_f, alias = _aliases(self._obs_fields())
        obs_f = {name: a[:n] for name, a in obs_f.items()}
        step_f = {name: (None if a is None else a[:n]) for name, a in self._step_fields().items()}
        hid = (self.hidden_states_actor, self.hidden_states_critic)
        bounds = np.searchsorted(env, np.arange(N + 1))  # trajectories of env e: [bounds[e], bounds[e + 1])
        for _ in range(epochs):
            order = np.arange(N) if not shuffle else self.rng.permutation(N)
            for group in np.array_split(order, k):
                if shuffle:
                    group = np.sort(group)
                    j = _ranges(bounds[group], bounds[group + 1] - bounds[group])
                    cols: Any = group
                else:
                    lo, hi = int(group[0]), int(group[-1]) + 1
                    j = np.arange(bounds[lo], bounds[hi])
                    cols = slice(lo, hi)
                L = n if pad_to == "rollout" else int(lengths[j].max())
                out: dict[str, Any] = {}
                masks = None
                for name, a in obs_f.items():
                    out[name], masks = _pad(a, t0[j], env[j], lengths[j], L)
                for name, same in alias.items():
                    out[name] = out[same]
                for name, a in step_f.items():
                    out[name] = None if a is None else a[:, cols]
                h = None
                if hid[0] is not None or hid[1] is not None:
                    h = tuple(None if x is None else x[t0[j], env[j]] for x in hid)
                yield self.MiniBatch(**out, hidden_states=h, masks=masks)

    # 002's spelling, for users who search for it
    reccurent_mini_batch_generator = recurrent_mini_batch_generator

    # -- statistics --------------------------------------------------------------------------------------

    def get_statistics(self) -> tuple[float, float]:
        """``(mean trajectory length, mean reward)`` over rows ``[0, step)``, as rsl_rl computes them: trajectories
        are cut at episode ends (dones or time_outs) and at the last row (so unfinished episodes count with
        their length so far); the reward mean is over every step and env. Nothing is modified (rsl_rl's
        version sets ``dones[-1] = 1`` in the storage)."""
        n = self._filled()
        _, _, lengths = _trajectories(self.dones[:n] | self.time_outs[:n])
        return float(lengths.mean()), float(self.rewards[:n].mean())

    def __repr__(self) -> str:
        src = "" if self._borrowed is None else f", view of {self._borrowed}"
        return (f"{type(self).__name__}(num_envs={self.num_envs}, num_transitions_per_env={self.num_transitions_per_env}, "
                f"step={self.step}{src})")


class QueueRolloutStorage(RolloutStorage):
    """A rolling buffer (002's ``QueueRolloutStorage``): it starts with one rollout's rows and, at each
    :meth:`clear` after a full rollout, grows by one rollout (:meth:`expand_buffer_once`) up to
    ``int(buffer_dilation_ratio * num_transitions_per_env)`` rows; from then on it loops, the newest rows
    overwriting the oldest. ``num_transitions_per_env`` is the current buffer length, as in 002, and
    ``num_timesteps_each_rollout`` the rollout length. ``buffer_full`` becomes true when it first loops.

    :meth:`compute_returns` and the recurrent generator first :meth:`untie_buffer_loop` (the time order GAE
    and trajectories need; 002 unties only for the recurrent generator). All of them work on the valid rows:
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
    def from_rollout(cls, *args: Any, **kwargs: Any) -> RolloutStorage:
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
        for name in STEP_ARRAYS:
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, np.concatenate([a, np.zeros((grow, *a.shape[1:]), a.dtype)]))
        self.num_transitions_per_env += grow
        return grow

    def add_transitions(self, transition: Transition) -> None:
        super().add_transitions(transition)
        if self.step >= self.num_transitions_per_env:
            self.buffer_full = self.buffer_full or self.num_transitions_per_env >= self.max_buffer_length
            if self.buffer_full:
                self.step = 0

    def clear(self) -> None:
        """Keep the data: grow if a rollout filled the buffer and it may still grow (002's ``clear``)."""
        if self.step >= self.num_transitions_per_env and not self.buffer_full:
            self.expand_buffer_once()

    def _count(self) -> int:
        return self.num_transitions_per_env if self.buffer_full else self.step

    def untie_buffer_loop(self) -> None:
        """Rotate every per-step array in place so that the oldest row is row 0 and the newest the last
        (``[5,6,7,8,9,0,1,2,3,4] -> [0,...,9]``, 9 the newest), and set ``step`` to 0 (the next write replaces
        the oldest). A no-op until the buffer has looped. Views of the arrays stay views (same memory)."""
        s = self.step
        if not self.buffer_full:
            return
        if 0 < s < self.num_transitions_per_env:
            for name in STEP_ARRAYS:
                a = getattr(self, name)
                if a is not None:
                    a[...] = np.concatenate([a[s:], a[:s]])
        self.step = 0

    def compute_returns(self, last_values: Any, gamma: float, lam: float, *, time_out_values: Any = None,
                        normalize_advantages: bool = False) -> None:
        """:meth:`untie_buffer_loop`, then :meth:`RolloutStorage.compute_returns` over the valid rows.

        ``time_out_values`` ``[T, N]`` (T the current buffer length) is indexed like the storage's rows *as
        they are when you call* (its row ``i`` goes with ``values[i]``, whatever the loop's position): it is
        rotated the same way as the storage (a rotated copy; your array is not changed). Build it after an
        explicit ``untie_buffer_loop()`` and it is used as it is (the rotation is then none).
        """
        self._check_discounts(gamma, lam)
        s, T = self.step, self.num_transitions_per_env
        if time_out_values is not None:
            tov = np.asarray(time_out_values)
            if tov.shape[:2] != (T, self.num_envs) or tov.shape[2:] not in ((), (1,)):
                raise SchemaError(f"{type(self).__name__}.compute_returns: time_out_values has shape {tov.shape}, expected "
                                  f"{(T, self.num_envs)} like values (the buffer's rows, in their order before the call)")
            if self.buffer_full and 0 < s < T:
                time_out_values = np.concatenate([tov[s:], tov[:s]])
        self.untie_buffer_loop()
        super().compute_returns(last_values, gamma, lam, time_out_values=time_out_values,
                                normalize_advantages=normalize_advantages)

    def recurrent_mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8, **kwargs: Any) -> Iterator[MiniBatch]:
        self.untie_buffer_loop()
        return super().recurrent_mini_batch_generator(num_mini_batches, num_epochs, **kwargs)

    reccurent_mini_batch_generator = recurrent_mini_batch_generator


class SarsaRolloutStorage(RolloutStorage):
    """Storage with next observations (002's ``SarsaRolloutStorage``): one ``all_observations`` buffer of T+1
    rows; ``observations = all_observations[:-1]`` and ``next_observations = all_observations[1:]`` are views
    of it, so ``(s, a, r, s')`` stay aligned without a second copy; the same for privileged observations.
    The last row is the observation after the rollout: set by :meth:`set_bootstrap_observations`, by the
    last :class:`SarsaTransition`'s ``next_observations``, or by :meth:`from_rollout` from ``data["bootstrap"]``.

    ``next_observations[t]`` at an episode end is the next episode's first observation (the env reset), as in
    002: mask with ``dones | time_outs``; a truncated episode's final observation is in ``time_out_observations``.
    """

    Transition = SarsaTransition
    MiniBatch = SarsaMiniBatch

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
    def from_rollout(cls, rollout_or_batch: Any, **kwargs: Any) -> RolloutStorage:
        """As :meth:`RolloutStorage.from_rollout`, plus ``next_observations``. The slot holds the step
        observations and the bootstrap observation in two leaves, so ``all_observations`` (T+1 rows) is one
        copy of them (``"observations"`` is in ``copied``); every other field stays a view."""
        return super().from_rollout(rollout_or_batch, **kwargs)

    def _adopt(self, arrays: dict[str, np.ndarray | None], src: _Source) -> None:
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

    def add_transitions(self, transition: Transition) -> None:
        nxt = getattr(transition, "next_observations", None)
        last = self.step + 1 == self.num_transitions_per_env and nxt is not None and self._borrowed is None
        if last:  # checked before the row is written, like every other field
            self._bootstrap_rows(nxt, getattr(transition, "next_critic_observations", None), self.step + 1)
        super().add_transitions(transition)
        if last:
            self.set_bootstrap_observations(nxt, getattr(transition, "next_critic_observations", None))

    def _bootstrap_rows(self, observations: Any, critic_observations: Any, t: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(row of all_*, checked array)`` for the observation after row ``t - 1``; SchemaError naming a bad one."""
        rows = [(self.all_observations[t], _as_row("next_observations", observations, self.all_observations[t]))]
        if self.all_privileged_observations is not None and critic_observations is not None:
            dst = self.all_privileged_observations[t]
            rows.append((dst, _as_row("next_critic_observations", critic_observations, dst)))
        return rows

    def _obs_fields(self) -> dict[str, np.ndarray]:
        out = super()._obs_fields()
        nxt = self.next_observations
        priv = self.next_privileged_observations
        out["next_obs"] = nxt
        out["next_critic_obs"] = nxt if priv is None else priv
        return out

