"""The Ray benchmark's workloads, and the peer's Ray actor: importable by module name, as Ray's workers need.

Three workloads, the same for every system of ``benchmarks/on_ray.py``:

- ``small`` and ``atari``: a synthetic gymnasium env whose observation is the ``obs`` leaf of that
  payload of the transport benchmark (``benchmarks/payloads.py``: ``(4,)`` float32 and
  ``(4, 84, 84)`` uint8), one env per actor, T = the payload's (64 and 32), a step that costs
  next to nothing (it hands back one preallocated observation), a policy that looks at one number.
  Episodes are cut at ``EPISODE_STEPS`` steps, so the episode path is taken now and then.
- ``cartpole``: gymnasium's CartPole-v1, a sync vector env of ``CARTPOLE_ENVS`` per actor, T=64, a
  linear numpy policy (softmax sampling over ``obs @ w``).

:class:`RolloutActor` is the peer (what a Ray user writes today): a plain Ray actor stepping the same
env with the same policy through the same :class:`workers.lowlevel.EnvDriver` (so every system steps the env
alike, autoreset included), filling numpy arrays for ``k`` rollouts and returning them, a dict of
numpy arrays, from a remote method. Ray serialises that dict its own way (pickle protocol 5 with the
arrays out of band); nothing of shmbuf's crosses a process boundary by pickle.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium
import numpy as np

from benchmarks import payloads

NAMES = ("small", "atari", "cartpole")
EPISODE_STEPS = 1000
CARTPOLE_ENVS = 8
CARTPOLE_T = 64


class PayloadEnv(gymnasium.Env):
    """A gymnasium env whose observation is payload ``name``'s per-step ``obs`` leaf; a step costs next to nothing.

    ``reset``/``step`` hand back one preallocated observation (random contents, fixed seed), reward 1.0,
    never terminated, truncated every ``episode_steps`` steps. Action space: Discrete(2).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, name: str = "small", episode_steps: int = EPISODE_STEPS):
        _, leaves = payloads.step_spec(name)
        shape, dtype = next((s, d) for k, s, d in leaves if k == "obs")
        dtype = np.dtype(dtype)
        low, high = (0, 255) if dtype.kind == "u" else (-np.inf, np.inf)
        self.observation_space = gymnasium.spaces.Box(low, high, shape, dtype)
        self.action_space = gymnasium.spaces.Discrete(2)
        self._obs = payloads._random(np.random.default_rng(0), shape, dtype)
        self._episode_steps = episode_steps
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        self._t = 0
        return self._obs, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        return self._obs, 1.0, False, self._t >= self._episode_steps, {}



class SignPolicy:
    """The trivial numpy policy of the synthetic workloads: action = whether the observation's first number is above 0."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return (obs.reshape(len(obs), -1)[:, 0] > 0).astype(np.int64)


class LinearPolicy:
    """CartPole's policy: sample from softmax(obs @ w) (Gumbel-max), w fixed and random so that episodes vary."""

    def __init__(self, seed: int = 0):
        self.w = np.random.default_rng(seed).standard_normal((4, 2)).astype(np.float32)
        self.rng = np.random.default_rng([seed, os.getpid()])

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        logits = obs @ self.w
        return np.argmax(logits + self.rng.gumbel(size=logits.shape), axis=1)

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.w = params["w"]


def make_payload_env(name: str) -> PayloadEnv:
    return PayloadEnv(name)


def make_cartpole(num_envs: int = CARTPOLE_ENVS) -> Any:
    return gymnasium.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")


@dataclass(frozen=True)
class Workload:
    """One workload: its env factory (picklable), policy, T, sub-envs per actor, and the episode table's size."""

    name: str
    make_env: Callable[[], Any]
    make_policy: Callable[[], Any]
    rollout_len: int
    num_envs: int
    max_episodes: int | None  # Collector(max_episodes=): None is its default, T * E

    def frames_per_rollout(self) -> int:
        return self.rollout_len * self.num_envs

    def collector_kwargs(self, batch: int) -> dict[str, Any]:
        """What Collector and RayCollector take for this workload, at ``batch`` rollouts per batch."""
        return {"frames_per_batch": batch * self.frames_per_rollout(), "rollout_len": self.rollout_len,
                "max_episodes": self.max_episodes}


def workload(name: str) -> Workload:
    """The workload called ``name`` (one of :data:`NAMES`).

    The synthetic ones keep a 2-record episode table (``max_episodes=2``; an episode ends every
    ``EPISODE_STEPS`` steps, so at most one per rollout): the default, T records each with a
    final observation, would make an atari rollout carry another 0.9 MB of mostly empty table.
    """
    if name in ("small", "atari"):
        t, _ = payloads.step_spec(name)
        return Workload(name, functools.partial(make_payload_env, name), SignPolicy, t, 1, 2)
    if name == "cartpole":
        return Workload(name, functools.partial(make_cartpole, CARTPOLE_ENVS), LinearPolicy, CARTPOLE_T, CARTPOLE_ENVS,
                        None)
    raise ValueError(f"workload: expected one of {NAMES}, got {name!r}")


class RolloutActor:
    """The peer: a plain Ray actor (``ray.remote(RolloutActor)``) returning rollouts as a dict of numpy arrays.

    ``rollouts(k)`` steps its env ``k * T`` times and returns ``{"obs": (k, T, [E], ...), "action",
    "reward" (float32), "terminated", "truncated": (k, T, [E]), "bootstrap_obs": (k, [E], ...),
    "episode_returns": (n,)}``: the same step leaves as a shmbuf rollout, and what a learner needs
    to bootstrap and to log returns. Fresh arrays every call (Ray copies them out when the method
    returns; a user does not reuse buffers whose lifetime Ray decides).
    """

    def __init__(self, name: str, seed: int = 0):
        from workers.lowlevel import EnvDriver

        w = workload(name)
        self.T = w.rollout_len
        self.env = w.make_env()
        self.policy = w.make_policy()
        self.driver = EnvDriver(self.env)
        self.single = not self.driver.vector
        self.obs = self.driver.reset(seed)
        self.ep_ret = np.zeros(self.driver.num_envs, np.float64)

    def ready(self) -> int:
        return os.getpid()

    def rollouts(self, k: int) -> dict[str, np.ndarray]:
        T, single = self.T, self.single
        E = () if single else (self.driver.num_envs,)
        o = self.obs
        out = {"obs": np.empty((k, T, *E, *o.shape[1:]), o.dtype), "action": np.empty((k, T, *E), np.int64),
               "reward": np.empty((k, T, *E), np.float32), "terminated": np.empty((k, T, *E), np.bool_),
               "truncated": np.empty((k, T, *E), np.bool_), "bootstrap_obs": np.empty((k, *E, *o.shape[1:]), o.dtype)}
        obs_b, act_b, rew_b, term_b, trunc_b = (out[x] for x in ("obs", "action", "reward", "terminated", "truncated"))
        returns: list[float] = []
        for i in range(k):
            succ = self.obs
            for t in range(T):
                obs = self.obs
                action = self.policy(obs)
                nobs, rew, term, trunc, succ = self.driver.step(action)
                if single:
                    obs_b[i, t], act_b[i, t], rew_b[i, t] = obs[0], action[0], rew[0]
                    term_b[i, t], trunc_b[i, t] = term[0], trunc[0]
                else:
                    obs_b[i, t], act_b[i, t], rew_b[i, t], term_b[i, t], trunc_b[i, t] = obs, action, rew, term, trunc
                self.ep_ret += rew
                done = term | trunc
                if done.any():
                    returns.extend(self.ep_ret[done].tolist())
                    self.ep_ret[done] = 0.0
                self.obs = nobs
            out["bootstrap_obs"][i] = succ[0] if single else succ
        out["episode_returns"] = np.asarray(returns, np.float64)
        return out

    def close(self) -> None:
        self.driver.close()
