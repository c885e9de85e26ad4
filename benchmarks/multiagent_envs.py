"""The envs and policies of the multi-agent benchmark (``benchmarks/multiagent.py``): module level, so that every start
method (and Ray's workers) can pickle them by name.

Envs, PettingZoo parallel envs, the same in every system:

- ``spread``: MPE2's ``simple_spread_v3`` with ``N=8`` agents (and 8 landmarks), discrete actions, its default
  ``max_cycles=25``: a real env, and a slow one (milliseconds per env step, all in Python), 48 float32 numbers per
  agent's observation, ``Discrete(5)``.
- ``synthetic``: :class:`SyntheticParallelEnv`, 16 agents, all present for the whole episode, 8 float32 numbers per
  observation, ``Discrete(5)``, a cheap numpy step, episodes of 200-400 steps (seeded): what collection itself costs
  per agent step shows.

Policies, numpy in and out (``(n, obs_dim)`` float32 -> ``(n,)`` int64), weights from a fixed seed so that every
system runs the same ones:

- ``linear``: :class:`LinearPolicy`, ``obs @ W``, argmax; one policy (``"shared"``) for every agent.
- ``linear2``: two such policies of different weights, ``"even"`` and ``"odd"``, mapped by the agent id's number
  (:func:`policy_of`): the policy mapping is exercised, every system calls each policy once per env step over its
  agents.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ENVS = {"spread": "MPE2 simple_spread_v3, N=8 agents, discrete actions, max_cycles=25 (48 float32 obs, Discrete(5))",
        "synthetic": "synthetic PettingZoo ParallelEnv, 16 agents always present, 8 float32 obs, Discrete(5), "
                     "a numpy step, episodes of 200-400 steps"}
POLICIES = {"linear": "numpy obs @ W, argmax: one policy shared by every agent",
            "linear2": "two numpy linear policies (even and odd agent numbers), mapped by agent id"}
AGENTS = {"spread": 8, "synthetic": 16}
SEED = 0
SYNTH_OBS = 8
SYNTH_ACTIONS = 5


class SyntheticParallelEnv:
    """A cheap PettingZoo ``ParallelEnv``: 16 agents, ``(8,)`` float32 observations, ``Discrete(5)``, numpy step.

    Every agent is present from reset to the episode's end (a length drawn from 200-400 by its seeded RNG), when all
    are truncated together. The state is one ``(agents, 8)`` array; a step adds each agent's action to one of its
    numbers and decays the rest; each agent's reward is minus its first number's magnitude.
    """

    metadata: dict[str, Any] = {"render_modes": [], "name": "synthetic_parallel_v0", "is_parallelizable": True}
    render_mode = None

    def __init__(self, num_agents: int = 16) -> None:
        from gymnasium import spaces

        self.possible_agents = [f"agent_{i}" for i in range(num_agents)]
        self.agents: list[str] = []
        self._obs_space = spaces.Box(-np.inf, np.inf, (SYNTH_OBS,), np.float32)
        self._act_space = spaces.Discrete(SYNTH_ACTIONS)
        self.observation_spaces = dict.fromkeys(self.possible_agents, self._obs_space)
        self.action_spaces = dict.fromkeys(self.possible_agents, self._act_space)
        self._state = np.zeros((num_agents, SYNTH_OBS), np.float32)
        self._rng = np.random.default_rng(SEED)
        self._t = self._length = 0

    def observation_space(self, agent: str) -> Any:
        return self._obs_space

    def action_space(self, agent: str) -> Any:
        return self._act_space

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    @property
    def max_num_agents(self) -> int:
        return len(self.possible_agents)

    @property
    def unwrapped(self) -> SyntheticParallelEnv:
        return self

    def _obs(self) -> dict[str, np.ndarray]:
        return {a: self._state[i] for i, a in enumerate(self.possible_agents)}  # views: consumers copy, as of any env

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = self._rng.standard_normal(self._state.shape).astype(np.float32)
        self._t, self._length = 0, int(self._rng.integers(200, 401))
        self.agents = list(self.possible_agents)
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        act = np.fromiter((actions[a] for a in self.possible_agents), np.int64, len(self.possible_agents))
        s = self._state = self._state * np.float32(0.9)
        s[np.arange(len(act)), act % SYNTH_OBS] += np.float32(1.0)
        self._t += 1
        done = self._t >= self._length
        reward = (-np.abs(s[:, 0])).tolist()
        agents = self.possible_agents
        out = (self._obs(), dict(zip(agents, reward)), dict.fromkeys(agents, False), dict.fromkeys(agents, done),
               {a: {} for a in agents})
        if done:
            self.agents = []
        return out

    def close(self) -> None:
        pass

    def render(self) -> None:
        return None

    def state(self) -> np.ndarray:
        return self._state


def make_env(env: str) -> Any:
    """One PettingZoo parallel env of the benchmark."""
    if env == "spread":
        from mpe2 import simple_spread_v3

        return simple_spread_v3.parallel_env(N=AGENTS["spread"], continuous_actions=False)
    if env == "synthetic":
        return SyntheticParallelEnv(AGENTS["synthetic"])
    raise ValueError(f"env: expected one of {list(ENVS)}, got {env!r}")


def make_envs(env: str, n: int) -> list[Any]:
    """``n`` envs: an actor's factory (several envs per actor)."""
    return [make_env(env) for _ in range(n)]


def spaces(env: str) -> tuple[int, int]:
    """(observation size, number of actions) of ``env``'s agents (all alike in both envs)."""
    e = make_env(env)
    try:
        a = e.possible_agents[0]
        return int(np.prod(e.observation_space(a).shape)), int(e.action_space(a).n)
    finally:
        e.close()


class LinearPolicy:
    """``obs @ W``, argmax: ``(n, obs_dim)`` float32 -> ``(n,)`` int64. Picklable (its weights travel with it)."""

    def __init__(self, obs_dim: int, n_actions: int, seed: int):
        self.w = np.random.default_rng(seed).standard_normal((obs_dim, n_actions)).astype(np.float32)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return np.argmax(np.asarray(obs, np.float32).reshape(len(obs), -1) @ self.w, axis=1)


def policy_ids(policy: str) -> tuple[str, ...]:
    return ("shared",) if policy == "linear" else ("even", "odd")


def policy_of(agent_id: str, *args: Any, **kwargs: Any) -> str:
    """The ``linear2`` mapping (RLlib's ``policy_mapping_fn`` signature): even agent numbers to ``"even"``."""
    return "even" if int(agent_id.rsplit("_", 1)[1]) % 2 == 0 else "odd"


def shared_policy(agent_id: str, *args: Any, **kwargs: Any) -> str:
    """The ``linear`` mapping: every agent to ``"shared"``."""
    return "shared"


def mapping(policy: str) -> Any:
    return shared_policy if policy == "linear" else policy_of


def make_policies(env: str, policy: str) -> dict[str, LinearPolicy]:
    """``{policy_id: LinearPolicy}`` for ``env``: the same weights in every system (seeded by the policy's rank)."""
    obs_dim, n_actions = spaces(env)
    return {pid: LinearPolicy(obs_dim, n_actions, SEED + k) for k, pid in enumerate(policy_ids(policy))}
