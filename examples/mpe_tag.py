"""MPE2's simple_tag for multi-agent collection: the env, the policy mapping and a numpy policy, in a module of
their own so that processes on other machines can import them by name (docs/ray.md's multi-agent block ships it to
every Ray node with ``runtime_env={"py_modules": [mpe_tag]}``).

Six chasers (``adversary_*``) and two runners (``agent_*``) on one team each; a chaser sees 26 numbers, a runner 24.
"""

from __future__ import annotations

import numpy as np
from mpe2 import simple_tag_v3

OBS_DIM = {"chaser": 26, "runner": 24}  # with num_good=2, num_adversaries=6, num_obstacles=2
ACTIONS = 5  # Discrete(5): stay, left, right, down, up


def make_env(max_cycles: int = 50):
    return simple_tag_v3.parallel_env(num_good=2, num_adversaries=6, num_obstacles=2, max_cycles=max_cycles)


def team(agent_id, episode=None, **kwargs):  # RLlib's policy_mapping_fn
    return "chaser" if agent_id.startswith("adversary") else "runner"


class LinearPolicy:
    """The argmax of a linear function of each agent's observation, ``(n, obs_dim) -> (n,)``; weights ``{"w"}``."""

    def __init__(self, obs_dim: int):
        self.w = np.zeros((obs_dim, ACTIONS), np.float32)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return np.argmax(obs @ self.w, axis=1)

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.w = params["w"]
