"""The masked-action env of the multi-agent Dict-observation tests (PettingZoo classic's ``observation`` +
``action_mask``, as a parallel env), its policies and the plain PettingZoo loop over it: shared by
tests/test_multiagent_dict.py and tests/test_ray_multiagent.py."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import optree
import pettingzoo

AGENTS = ["player_0", "player_1", "scout_0"]
N_ACTIONS = 4
LENGTHS = [7, 4, 9, 3]  # episode lengths in env steps, in turn
SCOUT_JOINS, SCOUT_LEAVES = 2, 5  # the scout acts from step 2 and terminates at step 5 (when the episode lasts)


class MaskedEnv(pettingzoo.ParallelEnv):
    """A deterministic parallel env with action masks, as PettingZoo classic's (which are AEC envs, not parallel ones).

    Players observe ``{"observation": [env, k, t] (float32), "action_mask": (4,) int8}`` from the reset to the
    episode's end (truncated). The scout is absent at the reset (so its policy is laid out from its space), joins at
    step 2 and terminates at step 5; it observes a tuple ``([100 * env + episode, t] (float64), {"action_mask": ...})``.
    Two actions are legal per agent and step, and ``step`` raises on an illegal one: a policy that acted on another
    agent's mask, or another step's, stops the loop."""

    metadata = {"name": "masked_v0"}

    def __init__(self, env_id: int = 0):
        self.env_id = env_id
        self.possible_agents = list(AGENTS)
        self.episode = -1
        self.t = 0
        self.agents: list[str] = []
        self.masks: dict[str, np.ndarray] = {}

    def observation_space(self, agent):
        mask = gym.spaces.Box(0, 1, (N_ACTIONS,), np.int8)
        if agent.startswith("player"):
            return gym.spaces.Dict({"observation": gym.spaces.Box(-1e9, 1e9, (3,), np.float32), "action_mask": mask})
        return gym.spaces.Tuple((gym.spaces.Box(-1e9, 1e9, (2,), np.float64), gym.spaces.Dict({"action_mask": mask})))

    def action_space(self, agent):
        return gym.spaces.Discrete(N_ACTIONS)

    def _obs(self, agent):
        k = AGENTS.index(agent)
        mask = np.zeros(N_ACTIONS, np.int8)
        mask[[(self.t + k) % N_ACTIONS, (self.t + 2 * k + 1) % N_ACTIONS]] = 1
        self.masks[agent] = mask
        if agent.startswith("player"):
            return {"observation": np.array([self.env_id, k, self.t], np.float32), "action_mask": mask.copy()}
        return np.array([100 * self.env_id + self.episode, self.t], np.float64), {"action_mask": mask.copy()}

    def reset(self, seed=None, options=None):
        self.episode += 1
        self.t = 0
        self.length = LENGTHS[(self.episode + self.env_id) % len(LENGTHS)]
        self.agents = ["player_0", "player_1"]
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        assert set(actions) == set(self.agents), (actions, self.agents)
        for a, act in actions.items():
            if not self.masks[a][int(act)]:
                raise ValueError(f"{a}: action {int(act)} is masked out at step {self.t} (mask {self.masks[a]})")
        self.t += 1
        rew = {a: float(self.t + 0.5 * AGENTS.index(a) + int(actions[a]) * 0.01) for a in actions}
        end = self.t >= self.length
        term = {a: a == "scout_0" and self.t == SCOUT_LEAVES for a in actions}
        trunc = {a: end and not term[a] for a in actions}
        obs = {a: self._obs(a) for a in actions}
        self.agents = [a for a in self.agents if not (term[a] or trunc[a])]
        if self.t == SCOUT_JOINS and not end:
            self.agents.append("scout_0")
            obs["scout_0"] = self._obs("scout_0")
        return obs, rew, term, trunc, {a: {} for a in actions}


def player_policy(obs):
    """A dict of batched arrays in, the highest legal action out."""
    return np.argmax(obs["action_mask"] * np.arange(1, N_ACTIONS + 1), axis=1).astype(np.int64)


def scout_policy(obs):
    """A tuple in, the lowest legal action out, with an extra."""
    pos, rest = obs
    act = np.argmax(rest["action_mask"] * np.arange(N_ACTIONS, 0, -1), axis=1).astype(np.int64)
    return act, {"value": pos[:, 1].astype(np.float32)}


POLICIES = {"player": player_policy, "scout": scout_policy}


def team(agent_id, episode=None, **kwargs):
    return agent_id.split("_")[0]


def plain_streams(n_envs, n_steps, env_ids=None):
    """The plain PettingZoo loop over ``MaskedEnv``: ``{(env, agent): [transition, ...]}``, as
    tests.test_workers_multiagent's."""
    streams = {}
    for i in range(n_envs):
        env = MaskedEnv(i if env_ids is None else env_ids[i])
        obs, _ = env.reset(seed=i)
        for _ in range(n_steps):
            acts, extras = {}, {}
            for a in env.agents:
                out = POLICIES[team(a)](optree.tree_map(lambda x: np.asarray(x)[None], obs[a]))
                act, ex = out if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else (out, {})
                acts[a], extras[a] = int(act[0]), {k: v[0] for k, v in ex.items()}
            nobs, rew, term, trunc, _ = env.step(acts)
            for a in acts:
                streams.setdefault((i, a), []).append(
                    {"obs": obs[a], "action": acts[a], "reward": np.float32(rew[a]), "terminated": term[a],
                     "truncated": trunc[a], "succ": nobs[a], **extras[a]})
            obs = {a: o for a, o in nobs.items() if not (term.get(a) or trunc.get(a))}
            if not env.agents:
                obs, _ = env.reset()
    return streams
