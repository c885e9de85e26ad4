"""The envs and policies of the collection benchmark (``benchmarks/collect.py``): module level, so that every start
method can pickle them by name.

Envs, 16 in every system:

- ``cartpole``: gymnasium's ``CartPole-v1`` (``gymnasium.make``, its default wrappers).
- ``atari``: :class:`SyntheticAtari`, an Atari-shaped env: ``(4, 84, 84)`` uint8 observations (a frame stack),
  ``Discrete(6)`` actions, a cheap step (a counter written into a fixed frame), episodes of a length drawn from
  100-1000 by its seeded RNG. It returns its own frame array at every step, as an emulator's screen buffer: every
  system copies it into its own buffer.

Vector envs are made with ``copy=False`` (the consumer copies each observation into its store at once, so the vector
env's second copy would only be waste) and ``autoreset_mode=SAME_STEP``: every row a vector env returns is a real
transition (the episode's final observation is in ``info["final_obs"]``), so no system has to skip a reset row.

Policies: ``linear`` (numpy: ``x @ W``, argmax), ``mlp64`` and ``mlp512`` (torch: ``x -> h -> h -> actions``, ReLU,
argmax). ``x`` is the observation as float32, flattened; for ``atari`` a strided subsample of the newest frame of the
stack, ``obs[:, -1, ::6, ::6]`` (14 x 14 = 196 values), so that the policy is not the whole cost of a frame. Weights
come from a fixed seed: the same policy in every system. Torch runs on one thread (:func:`one_torch_thread`, called
where torch policies are made and by :class:`TorchPolicy` once per calling thread).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import nn

ENVS = {"cartpole": "CartPole-v1", "atari": "synthetic 4x84x84 uint8, Discrete(6), episodes of 100-1000 steps"}
POLICIES = {"linear": "numpy x @ W, argmax", "mlp64": "torch MLP, two 64-unit layers, argmax",
            "mlp512": "torch MLP, two 512-unit layers, argmax"}
HIDDEN = {"mlp64": 64, "mlp512": 512}
SUBSAMPLE = 6  # the atari policies read obs[:, -1, ::6, ::6]
SEED = 0


class SyntheticAtari(gymnasium.Env):
    """Atari-shaped and cheap: ``(4, 84, 84)`` uint8 frames, ``Discrete(6)``, episodes of 100-1000 steps (seeded)."""

    metadata: dict[str, Any] = {"render_modes": []}  # gymnasium's class attribute, as gymnasium declares it

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.action_space = gymnasium.spaces.Discrete(6)
        self._frame = np.zeros((4, 84, 84), np.uint8)
        self._rng = np.random.default_rng(0)
        self._t = self._length = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t, self._length = 0, int(self._rng.integers(100, 1001))
        self._frame[-1, 0, :4] = 0
        return self._frame, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        self._frame[-1, 0, :4] = (self._t & 255, (self._t >> 8) & 255, int(action), 1)
        return self._frame, 1.0, self._t >= self._length, False, {}


def make_env(env: str) -> Any:
    """One env of the benchmark by name (``cartpole`` or ``atari``)."""
    if env == "cartpole":
        return gymnasium.make("CartPole-v1")
    if env == "atari":
        return SyntheticAtari()
    raise ValueError(f"env: expected one of {list(ENVS)}, got {env!r}")


def make_vec(env: str, n: int, autoreset: str = "SameStep") -> Any:
    """A gymnasium ``SyncVectorEnv`` of ``n`` envs, ``copy=False``, ``autoreset`` (``SameStep`` or ``NextStep``)."""
    return gymnasium.vector.SyncVectorEnv([functools.partial(make_env, env)] * n, copy=False,
                                          autoreset_mode=gymnasium.vector.AutoresetMode(autoreset))


def make_puffer_env(env: str, buf: Any = None, seed: int = 0) -> Any:
    """One env in PufferLib's gymnasium emulation (PufferLib calls this with its shared buffers and a seed)."""
    from pufferlib.emulation import GymnasiumPufferEnv

    return GymnasiumPufferEnv(env_creator=make_env, env_args=[env], buf=buf, seed=seed)


def make_torchrl_env(env: str) -> Any:
    """One env in TorchRL's ``GymWrapper`` (integer actions, as the policies give)."""
    from torchrl.envs import GymWrapper

    one_torch_thread()
    return GymWrapper(make_env(env), categorical_action_encoding=True)


def make_torchrl_serial(env: str, n: int) -> Any:
    """One TorchRL worker's envs: a ``SerialEnv`` of ``n``."""
    from torchrl.envs import SerialEnv

    one_torch_thread()
    return SerialEnv(n, functools.partial(make_torchrl_env, env))


# ------------------------------------------------------------------ policies


def obs_dim(env: str) -> tuple[int, int]:
    """(policy input features, actions) of ``env``."""
    return (4, 2) if env == "cartpole" else ((84 // SUBSAMPLE) ** 2, 6)


def features(obs: np.ndarray) -> np.ndarray:
    """The policy's input, ``(n, features)`` float32: the observation flattened; a frame stack subsampled first."""
    if obs.ndim == 4:
        obs = obs[:, -1, ::SUBSAMPLE, ::SUBSAMPLE]
    return obs.reshape(len(obs), -1).astype(np.float32)


class LinearPolicy:
    """``argmax(features(obs) @ W)``: numpy, int64 actions. Picklable (its weights are an array)."""

    def __init__(self, env: str):
        d, a = obs_dim(env)
        self.w = np.random.default_rng(SEED).standard_normal((d, a)).astype(np.float32) / np.sqrt(d)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return (features(obs) @ self.w).argmax(1)


_PER_THREAD = threading.local()


def one_torch_thread() -> None:
    """torch on one thread in the calling thread (OpenMP's setting is per thread: see benchmarks/inference.py)."""
    if not getattr(_PER_THREAD, "one", False):
        torch.set_num_threads(1)
        _PER_THREAD.one = True


class TorchPolicy(nn.Module):
    """``features -> h -> h -> actions`` (ReLU), argmax: int64 actions. Takes a tensor of observations."""

    def __init__(self, env: str, hidden: int):
        super().__init__()
        d, a = obs_dim(env)
        self.atari = env == "atari"
        self.obs_ndim = 3 if self.atari else 1
        with torch.random.fork_rng():
            torch.manual_seed(SEED)
            self.net = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, a))

    def forward(self, obs: Any) -> Any:
        one_torch_thread()
        single = obs.dim() == self.obs_ndim  # one env's observation (TorchRL's workers of one env): no batch axis
        if single:
            obs = obs.unsqueeze(0)
        if self.atari:
            obs = obs[:, -1, ::SUBSAMPLE, ::SUBSAMPLE]
        out = self.net(obs.reshape(obs.shape[0], -1).float()).argmax(-1)
        return out[0] if single else out


class TorchLinear(nn.Module):
    """:class:`LinearPolicy` on tensors, computed in numpy (for TorchRL, which calls modules)."""

    def __init__(self, env: str):
        super().__init__()
        self.linear = LinearPolicy(env)
        self.obs_ndim = 3 if env == "atari" else 1

    def forward(self, obs: Any) -> Any:
        x = obs.numpy()
        if x.ndim == self.obs_ndim:  # one env's observation: no batch axis
            return torch.from_numpy(self.linear(x[None]))[0]
        return torch.from_numpy(self.linear(x))


def make_policy(env: str, policy: str) -> Any:
    """The policy ``policy`` for ``env``: a :class:`LinearPolicy` or a torch module (one torch thread)."""
    if policy == "linear":
        return LinearPolicy(env)
    one_torch_thread()
    return TorchPolicy(env, HIDDEN[policy]).eval()


def numpy_caller(policy: Any) -> Any:
    """``obs (numpy) -> actions (numpy)`` for a policy of :func:`make_policy`: what the one-process loops call."""
    if isinstance(policy, LinearPolicy):
        return policy

    def call(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return policy(torch.from_numpy(obs)).numpy()

    return call


def make_td_policy(env: str, policy: str) -> Any:
    """The policy as a ``TensorDictModule`` (``observation`` -> ``action``) for TorchRL; a numpy policy inside a module."""
    from tensordict.nn import TensorDictModule

    inner = TorchLinear(env) if policy == "linear" else make_policy(env, policy)
    return TensorDictModule(inner, in_keys=["observation"], out_keys=["action"])
