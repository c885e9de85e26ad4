"""Reading shmbuf rollouts into the PPO storage's time-major ``[T, N, ...]`` arrays (views where the layout allows).

The rollout is read through :func:`shmbuf.layout.grid` (``(B, T, E, ...)`` views), then each step leaf is
seen as ``[T, B * E, ...]``: a view, except for a batch with an env dim where B, E and T are all > 1.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import SchemaError, UsageError
from shmbuf.storage._common import leaf_at
from shmbuf.storage._transition import TimeOutObservations


def short_repr(src: Any) -> str:
    r = repr(src)  # a Rollout's or Batch's repr is one short line; a plain container's may hold every array
    return r if len(r) <= 200 else f"{type(src).__name__} object at 0x{id(src):x}"


@contextmanager
def _from_rollout_errors() -> Iterator[None]:
    """shmbuf.layout's errors said as from_rollout's own."""
    try:
        yield
    except (SchemaError, UsageError) as e:
        raise type(e)(f"from_rollout: {e}") from None


class RolloutSource:
    """A Rollout ``(T, [E], ...)`` or a batch ``(B, T, [E], ...)``, read through ``.data`` and ``.fill``."""

    def __init__(self, src: Any, reward_key: str):
        data, fill = getattr(src, "data", None), getattr(src, "fill", None)
        self.name = short_repr(src)
        if not isinstance(data, Mapping) or not isinstance(data.get(L.STEP), Mapping):
            raise UsageError(f"from_rollout: expected a shmbuf Rollout, Batch or workers CollectedBatch (with .data['step'] "
                             f"and .fill), got {type(src).__name__}")
        if fill is None:
            raise UsageError(f"from_rollout: {self.name} has fill=None: a complete-episodes batch (episodes "
                             "concatenated, not time-major [T, N]); collect with batch_mode='truncate_episodes'")
        if not isinstance(fill, Mapping) or L.STEP not in fill:
            have = sorted(fill) if isinstance(fill, Mapping) else type(fill).__name__
            raise SchemaError(f"from_rollout: {self.name} has no fill['step'] (the filled count of each rollout; there is "
                              f"{have}): expected a shmbuf Rollout, Batch or workers CollectedBatch")
        try:  # the reward leaf sets T, E (and B)
            leaf_at(data[L.STEP], reward_key, "from_rollout")
        except KeyError as e:
            raise SchemaError(f"{e.args[0]}. The storage needs the rewards (reward_key={reward_key!r})") from None
        with _from_rollout_errors():
            self.g = g = L.grid(data, fill, ref=reward_key)
        self.data, self.step = data, g.step
        self.batched = g.batched
        self.B, self.T = g.B, g.capacity
        self.E = g.E if g.vector else None
        self.N = g.B * g.E
        self._check_full()
        self.copied: list[str] = []

    def _check_full(self) -> None:
        short = np.flatnonzero(self.g.n != self.T)
        if short.size:
            i = int(short[0])
            which = f"rollout {i} of the batch {self.name}" if self.batched else f"the rollout {self.name}"
            raise UsageError(f"from_rollout: {which} has fill['step']={int(self.g.n[i])} of T={self.T}: only "
                             "full rollouts make a [T, N] storage; collect in truncate-episodes mode with an episode "
                             "table that cannot fill (the default max_episodes), or drop short rollouts first")

    def steps(self, key: str, what: str, field: str, *, scalar: bool = False) -> np.ndarray:
        """Step leaf ``key`` as ``[T, N, ...]``: a view, or (batch with an env dim) a copy, ``field`` then
        recorded in ``copied``."""
        try:
            x = np.asarray(leaf_at(self.step, key, "from_rollout"))
        except KeyError as e:
            raise SchemaError(f"{e.args[0]}. The storage needs {what}") from None
        with _from_rollout_errors():
            xc = self.g.as_bte(x, f"step leaf {key!r}")
        rest = xc.shape[3:]
        y = np.swapaxes(xc, 0, 1)  # (T, B, E, ...)
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
                                  f"and env, {self.g.lead} (or with a trailing 1)")
        return y

    def per_env(self, x: Any) -> np.ndarray:
        """A ``(B, [E], ...)`` or ``([E], ...)`` leaf as ``[N, ...]`` (always a view: the env dims are adjacent)."""
        xe = self.g.as_be(x)
        return xe.reshape(self.N, *xe.shape[2:])

    def bootstrap(self, key: str) -> np.ndarray | None:
        """The bootstrap observation under ``key`` ("obs/..." paths map into ``data['bootstrap']``) as ``[N, ...]``."""
        boot = self.g.bootstrap
        try:
            return None if boot is None else self.per_env(leaf_at(boot, key, "bootstrap"))
        except KeyError:
            return None

    def time_outs(self, obs_key: str) -> TimeOutObservations | None:
        """Episodes that were truncated (not terminated), from the episode table: where and their final obs."""
        g, ep = self.g, self.g.episode
        parts = obs_key.split("/")
        if not isinstance(ep, Mapping) or any(k not in ep for k in (L.END, L.ENV, L.TRUNCATED, L.TERMINATED, L.FINAL_OBS)) \
                or parts[0] != L.OBS:
            return None
        trunc = g.table(ep[L.TRUNCATED]) & ~g.table(ep[L.TERMINATED])
        with _from_rollout_errors():
            b, i = g.filled_rows(trunc.shape[1])
        sel = trunc[b, i]
        b, i = b[sel], i[sel]
        final = ep[L.FINAL_OBS]
        for p in parts[1:]:
            final = final[p]
        env = b * g.E + g.table(ep[L.ENV])[b, i].astype(np.intp)
        return TimeOutObservations(g.table(ep[L.END])[b, i].astype(np.intp), env, g.table(final)[b, i])


def check_keys(required: dict[str, Any], optional: dict[str, Any]) -> None:
    """from_rollout's leaf keys: a non-empty str each (None allowed for the optional ones); UsageError naming the setting."""
    for setting, key in [*required.items(), *optional.items()]:
        if key is None and setting in optional:
            continue
        if not isinstance(key, str) or not key:
            need = "" if setting in optional else " (required: the storage cannot do without it)"
            raise UsageError(f"from_rollout({setting}=...): expected the name of a step leaf, a str ('a/b' walks nested "
                             f"dicts){need}, got {key!r:.80}")


def read_arrays(rollout_or_batch: Any, *, obs_key: str, critic_obs_key: str | None, action_key: str, reward_key: str,
                terminated_key: str, truncated_key: str | None, value_key: str, log_prob_key: str, mu_key: str | None,
                sigma_key: str | None, hidden_states_keys: tuple[str, str] | None) -> tuple[RolloutSource, dict[str, Any]]:
    """The storage's per-step arrays ``[T, N, ...]`` read from a rollout or batch by the keys ``from_rollout`` was
    given (checked here), and its source: views where the layout allows (see ``from_rollout``); the flags as bool."""
    check_keys({"obs_key": obs_key, "action_key": action_key, "reward_key": reward_key,
                 "terminated_key": terminated_key, "value_key": value_key, "log_prob_key": log_prob_key},
                {"critic_obs_key": critic_obs_key, "truncated_key": truncated_key, "mu_key": mu_key, "sigma_key": sigma_key})
    if hidden_states_keys is not None:
        if not (isinstance(hidden_states_keys, (tuple, list)) and len(hidden_states_keys) == 2):
            raise UsageError("from_rollout(hidden_states_keys=...): expected (actor key, critic key), "
                             f"got {hidden_states_keys!r:.80}")
        check_keys({"hidden_states_keys[0]": hidden_states_keys[0], "hidden_states_keys[1]": hidden_states_keys[1]}, {})
    src = RolloutSource(rollout_or_batch, reward_key)
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
        flags = arrays[k]
        assert flags is not None  # terminated_key is required (check_keys), time_outs was just filled
        if flags.dtype.kind not in "biuf":
            raise SchemaError(f"from_rollout: step leaf for {k} has dtype {flags.dtype}: expected bool or numbers "
                              "(nonzero meaning true)")
        if flags.dtype != np.bool_:
            arrays[k] = flags != 0
            if k not in src.copied:
                src.copied.append(k)
    return src, arrays
