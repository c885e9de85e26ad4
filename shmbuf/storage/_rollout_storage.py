"""The time-major rollout storage, shmbuf's own: ``[T, N, ...]`` numpy arrays filled step by step or viewed from
shmbuf rollouts, with GAE and minibatches. The public module is :mod:`shmbuf.storage.rollout` (its docstring says
the layout and flag rules); rsl_rl's ``RolloutStorage`` is this engine with its forks' signature and torch idiom
(:mod:`shmbuf.storage.compat.rsl_rl`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import SchemaError, TimescaleFull, UsageError
from shmbuf._validate import int_setting
from shmbuf.storage._common import generator
from shmbuf.storage._minibatches import flat_minibatches, recurrent_minibatches
from shmbuf.storage._rollout_source import RolloutSource, read_arrays
from shmbuf.storage._torch import host_array
from shmbuf.storage._trajectories import trajectories
from shmbuf.storage._transition import (
    NO_HIDDEN_STATES,
    REQUIRED,
    STEP_ARRAYS,
    TRANSITION_FIELDS,
    AnyMiniBatch,
    TimeOutObservations,
    array_of,
    as_row,
    shape_setting,
)

# Under other names: inside the class body, Transition and MiniBatch are the class attributes (the storage's record
# types, ``storage.Transition()`` as the forks spell it), which a type checker does not take as types in the methods'
# annotations.
from shmbuf.storage._transition import MiniBatch as _MiniBatch
from shmbuf.storage._transition import Transition as _Transition
from shmbuf.storage.gae import check_discount, compute_gae
from shmbuf.storage.gae import normalize_advantages as _normalize


class TimeMajorStorage:
    """A rollout as time-major ``[T, N, ...]`` numpy arrays, with GAE and minibatches (shmbuf's own storage).

    Arrays: ``observations``, ``privileged_observations`` (critic observations; None when not used),
    ``actions``, ``rewards``, ``dones``, ``time_outs`` (read as ``flag_convention`` says), ``values``,
    ``actions_log_prob``, ``mu``, ``sigma``, ``returns``, ``advantages``, and with ``rnn_hidden_shape``
    ``hidden_states_actor``/``hidden_states_critic`` ``[T, N, *rnn_hidden_shape]`` (the state each step's
    network call started from; with torch's ``(num_layers, N, H)`` store ``h.transpose(0, 1)``; an LSTM's
    ``(h, c)`` can be stacked into ``rnn_hidden_shape = (2, num_layers, H)``). The names are the ones rsl_rl gave
    the PPO storage, kept because they are what every port reads.

    ``step`` counts the rows filled; :meth:`compute_returns`, the generators and :meth:`get_statistics`
    work on rows ``[0, step)``. Shuffling draws from ``rng`` (``np.random.default_rng(seed)``).

    ``flag_convention`` says how :meth:`compute_returns` reads the flags: ``"rsl_rl"`` for a storage made
    here and filled by :meth:`add_transitions` (rsl_rl: ``dones`` every episode end, and a
    ``time_outs`` step bootstraps whatever ``dones`` says), ``"gymnasium"`` for one made by
    :meth:`from_rollout` (``dones`` = terminated, ``time_outs`` = truncated; terminated wins). Set it to
    ``"gymnasium"`` to fill with gymnasium's ``terminated``/``truncated`` as they are.

    numpy in, numpy out: transitions may hold torch tensors (copied to the host), minibatches are numpy with
    ``to_torch(device)``. rsl_rl's ``RolloutStorage`` (:mod:`shmbuf.storage.compat.rsl_rl`) adds its forks'
    signature (a ``device`` in the sixth place) and torch idiom (minibatches as tensors on the device).
    """

    Transition: ClassVar[type[_Transition]] = _Transition
    MiniBatch: ClassVar[type[AnyMiniBatch]] = _MiniBatch
    # Transition attribute -> array, the fields a transition must carry, the per-step arrays (subclasses add theirs).
    _transition_fields: ClassVar[dict[str, str]] = TRANSITION_FIELDS
    _required: ClassVar[tuple[str, ...]] = REQUIRED
    _step_arrays: ClassVar[tuple[str, ...]] = STEP_ARRAYS

    # Set in _setup (None) and, when the storage has them, in __init__ or from_rollout.
    privileged_observations: np.ndarray | None
    mu: np.ndarray | None
    sigma: np.ndarray | None
    hidden_states_actor: np.ndarray | None
    hidden_states_critic: np.ndarray | None
    obs_shape: tuple[int, ...] | None  # the forks' shape attributes (checked; None before __init__ / from_rollout sets them)
    privileged_obs_shape: tuple[int, ...] | None
    actions_shape: tuple[int, ...] | None

    def __init__(self, num_envs: int, num_transitions_per_env: int, obs_shape: Any, privileged_obs_shape: Any,
                 actions_shape: Any, rnn_hidden_shape: Any = None, *, dtype: Any = np.float32, seed: Any = None):
        N = int_setting("num_envs", num_envs, 1)
        T = int_setting("num_transitions_per_env", num_transitions_per_env, 1)
        self._setup(T, N, seed)
        f = np.dtype(dtype)
        if not np.issubdtype(f, np.floating):
            raise UsageError(f"dtype: expected a floating dtype, got {f}")
        obs = shape_setting("obs_shape", obs_shape)
        act = shape_setting("actions_shape", actions_shape)
        priv = None if privileged_obs_shape is None else shape_setting("privileged_obs_shape", privileged_obs_shape)
        hid = None if rnn_hidden_shape is None else shape_setting("rnn_hidden_shape", rnn_hidden_shape)
        self.obs_shape, self.privileged_obs_shape, self.actions_shape = obs, priv, act  # the forks' attributes (checked)
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
        self.privileged_observations = None
        self.mu = None
        self.sigma = None
        self.hidden_states_actor = None
        self.hidden_states_critic = None
        self.bootstrap_observations: np.ndarray | None = None
        self.bootstrap_critic_observations: np.ndarray | None = None
        self.time_out_observations: TimeOutObservations | None = None
        self.copied: tuple[str, ...] = ()
        self._borrowed: str | None = None
        self.flag_convention = "rsl_rl"  # add_transitions: rsl_rl's dones and time_outs
        self.obs_shape = self.privileged_obs_shape = self.actions_shape = None  # set by __init__ or from the arrays

    # -- filling --------------------------------------------------------------------------------------

    @classmethod
    def from_rollout(cls, rollout_or_batch: Any, *, obs_key: str = L.OBS, critic_obs_key: str | None = None,
                     action_key: str = L.ACTION, reward_key: str = L.REWARD, terminated_key: str = L.TERMINATED,
                     truncated_key: str = L.TRUNCATED, value_key: str = "value", log_prob_key: str = "log_prob",
                     mu_key: str | None = None, sigma_key: str | None = None,
                     hidden_states_keys: tuple[str, str] | None = None, seed: Any = None) -> TimeMajorStorage:
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
        src, arrays = read_arrays(rollout_or_batch, obs_key=obs_key, critic_obs_key=critic_obs_key,
                                  action_key=action_key, reward_key=reward_key, terminated_key=terminated_key,
                                  truncated_key=truncated_key, value_key=value_key, log_prob_key=log_prob_key,
                                  mu_key=mu_key, sigma_key=sigma_key, hidden_states_keys=hidden_states_keys)
        self = cls.__new__(cls)
        self._setup(src.T, src.N, seed)
        self.bootstrap_observations = src.bootstrap(obs_key)
        if critic_obs_key is not None:
            self.bootstrap_critic_observations = src.bootstrap(critic_obs_key)
        self.time_out_observations = None if truncated_key is None else src.time_outs(obs_key)
        self._adopt(arrays, src)
        priv = self.privileged_observations
        self.obs_shape, self.actions_shape = self.observations.shape[2:], self.actions.shape[2:]
        self.privileged_obs_shape = None if priv is None else priv.shape[2:]
        self.copied = tuple(src.copied)
        self.flag_convention = "gymnasium"  # the actors' own terminated / truncated
        return self

    def _adopt(self, arrays: dict[str, np.ndarray | None], src: RolloutSource) -> None:
        for k, a in arrays.items():
            setattr(self, k, a)
        dtype = np.result_type(arrays["values"], arrays["rewards"], np.float32)
        self.returns = np.zeros((src.T, src.N), dtype)
        self.advantages = np.zeros((src.T, src.N), dtype)
        self.step = src.T
        self._borrowed = src.name

    def add_transitions(self, transition: _Transition) -> None:
        """Copy one step of every env into row ``step`` and advance it.

        Raises:
            TimescaleFull (an IndexError): the storage is full (``step == num_transitions_per_env``).
            SchemaError (a ValueError): a required field is None or has the wrong shape (names it).
            UsageError: this storage is a view of a rollout (made by :meth:`from_rollout`).
        """
        if self._borrowed is not None:
            raise UsageError(f"add_transitions: this storage is a view of {self._borrowed} (made by from_rollout); "
                             f"writing would change that rollout. Make a {type(self).__name__}(...) to fill step by step")
        T = self.num_transitions_per_env
        if self.step >= T:
            raise TimescaleFull(f"{type(self).__name__}.add_transitions: step {self.step} is past the capacity "
                                f"num_transitions_per_env={T}; call clear() after each update, or make a larger storage")
        self._write_row(self.step, transition)
        self.step += 1

    def _write_row(self, t: int, tr: _Transition) -> None:
        rows = {}
        for name, field in self._transition_fields.items():  # check everything before writing anything
            dst = getattr(self, field)
            x = getattr(tr, name)
            if dst is None:
                continue
            if x is None:
                if field in self._required or field == "privileged_observations":
                    raise SchemaError(f"Transition.{name} is None; this storage needs it (shape {dst.shape[1:]})")
                if field == "time_outs":
                    rows[field] = np.zeros(dst.shape[1:], bool)
                continue
            rows[field] = as_row(name, x, dst[t])
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
            h = array_of(name, self._hidden_array(name, h))
            dst = getattr(self, name)
            if dst is None:  # first use without rnn_hidden_shape: allocate from the example, as the forks do
                if h.shape[:1] != (self.num_envs,):
                    raise SchemaError(f"Transition.hidden_states: expected a leading num_envs={self.num_envs}, got {h.shape}")
                dst = np.zeros((self.num_transitions_per_env, *h.shape), self.values.dtype)
            out.append((name, dst, as_row(name, h, dst[0])))
        self._hidden_checked(hidden)
        return out

    def _hidden_array(self, name: str, h: Any) -> Any:
        """A hidden state as given, before it is read as ``[N, *rnn_hidden_shape]`` rows (a façade reads another layout)."""
        return h

    def _hidden_checked(self, hidden: Any) -> None:
        """Both hidden states passed their checks (a façade remembers what it read, only then)."""

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
        time-out steps; :meth:`time_out_values_from` builds it) or else from ``values`` (the forks' approximation);
        terminations do not bootstrap. Which steps are time-outs follows ``flag_convention``: ``"rsl_rl"``
        (filled by :meth:`add_transitions`): every ``time_outs`` step, whatever ``dones`` says, as rsl_rl's
        PPO (``compute_gae(..., time_outs=)``); ``"gymnasium"`` (made by :meth:`from_rollout`): ``time_outs
        & ~dones`` (``compute_gae(..., truncated=)``). ``normalize_advantages``: then ``(A - mean) / (std +
        1e-8)`` over all rows, as rsl_rl does on every call (off by default: returns are computed before
        normalising either way). ``last_values`` and ``time_out_values`` may be tensors on any device.
        ``gamma`` and ``lam``: real numbers from 0 to 1 (else UsageError naming the setting).
        """
        self._check_discounts(gamma, lam)
        rule = self.flag_convention
        if rule not in ("rsl_rl", "gymnasium"):
            raise UsageError(f"{type(self).__name__}.compute_returns: flag_convention is {rule!r:.80}; expected "
                             "'rsl_rl' (dones and time_outs as rsl_rl) or 'gymnasium' (terminated and truncated)")
        n = self._filled()
        lv = np.asarray(host_array(last_values))
        if lv.shape == (self.num_envs, 1):
            lv = lv[:, 0]
        tov = None
        if time_out_values is not None:
            tov = np.asarray(host_array(time_out_values))
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

    def mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8) -> Iterator[AnyMiniBatch]:
        """Shuffled flat minibatches ``[batch, ...]`` of rows ``[0, step)``: each epoch draws a new permutation
        and every transition is in exactly one of its ``num_mini_batches`` minibatches (sizes differ by at most
        one when ``step * num_envs`` does not divide; rsl_rl drops the remainder, and reuses one permutation for
        every epoch). The arrays are fresh copies (gathered)."""
        n = self._filled()
        N = self.num_envs
        M = n * N
        k = int_setting("mini_batch_generator(num_mini_batches=...)", num_mini_batches, 1, M)
        epochs = int_setting("mini_batch_generator(num_epochs=...)", num_epochs, 0)
        for out in flat_minibatches({**self._obs_fields(), **self._step_fields()}, n, N, k, epochs, self.rng):
            yield self._out(self.MiniBatch(**out, hidden_states=NO_HIDDEN_STATES, masks=None))

    def recurrent_mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8, *, shuffle: bool = False,
                                       pad_to: str = "longest") -> Iterator[AnyMiniBatch]:
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
        k = int_setting("recurrent_mini_batch_generator(num_mini_batches=...)", num_mini_batches, 1, N)
        epochs = int_setting("recurrent_mini_batch_generator(num_epochs=...)", num_epochs, 0)
        if pad_to not in ("longest", "rollout"):
            raise UsageError(f"recurrent_mini_batch_generator(pad_to=...): expected 'longest' or 'rollout', got {pad_to!r}")
        for out in recurrent_minibatches(self._obs_fields(), self._step_fields(), self.dones[:n] | self.time_outs[:n],
                                         (self.hidden_states_actor, self.hidden_states_critic), n, N, k, epochs,
                                         self.rng, shuffle=shuffle, pad_to=pad_to):
            yield self._out(self.MiniBatch(**out))

    def _out(self, mb: Any) -> Any:
        """A minibatch as the generators give it (a façade converts it to its framework's types here)."""
        return mb

    # -- statistics --------------------------------------------------------------------------------------

    def get_statistics(self) -> tuple[Any, Any]:
        """``(mean trajectory length, mean reward)`` over rows ``[0, step)``, as rsl_rl computes them: trajectories
        are cut at episode ends (dones or time_outs) and at the last row (so unfinished episodes count with
        their length so far); the reward mean is over every step and env. Nothing is modified (rsl_rl's
        version sets ``dones[-1] = 1`` in the storage)."""
        n = self._filled()
        _, _, lengths = trajectories(self.dones[:n] | self.time_outs[:n])
        return float(lengths.mean()), float(self.rewards[:n].mean())

    def __repr__(self) -> str:
        src = "" if self._borrowed is None else f", view of {self._borrowed}"
        return (f"{type(self).__name__}(num_envs={self.num_envs}, num_transitions_per_env={self.num_transitions_per_env}, "
                f"step={self.step}{src})")

