"""The env factories of :class:`workers.AsyncBatchedCollector` when TorchRL may be about: TorchRL envs come out stepped.

This module imports neither torch nor torchrl: a factory of it is pickled to every env worker process, which
then imports only this, and :mod:`workers.compat._torchrl` (and torch) only if its env is a TorchRL env (which has
imported torch already).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["TorchRLFactory", "is_torchrl_env"]


def is_torchrl_env(env: Any) -> bool:
    """Is ``env`` a TorchRL ``EnvBase`` (without importing torchrl when nothing has)?"""
    if sys.modules.get("torchrl") is None:
        return False
    from torchrl.envs import EnvBase

    return isinstance(env, EnvBase)


class TorchRLFactory:
    """An env factory whose TorchRL envs come out as :class:`workers.compat._torchrl.TorchRLEnv` (others as they
    are); picklable when the factory is. ``wrap_gym``: a plain gymnasium env (not a vector env) is wrapped in
    TorchRL's ``GymWrapper`` first, so that a TensorDict module's actions go through TorchRL's action spec as they
    would under TorchRL. Called in this process (the collector's probe), it records the env's reward dtype in
    ``reward_dtype`` (None: the factory gave no TorchRL env). ``seeded``, ``static_seed``: how its TorchRL envs take
    the collector's seed (see :class:`workers.compat._torchrl.TorchRLEnv`: not at all unless ``seeded``)."""

    def __init__(self, fn: Callable[..., Any], *, wrap_gym: bool = False, seeded: bool = False, static_seed: bool = False):
        self.fn = fn
        self.wrap_gym = wrap_gym
        self.seeded = seeded
        self.static_seed = static_seed
        self.reward_dtype: Any = None
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)  # what a picklability error names

    def __call__(self, **kwargs: Any) -> Any:
        env = self.fn(**kwargs)
        if self.wrap_gym and not is_torchrl_env(env) and _is_single_gym_env(env):
            from torchrl.envs import GymWrapper

            env = GymWrapper(env)
        if not is_torchrl_env(env):
            return env
        from workers.compat._torchrl import TorchRLEnv

        wrapped = TorchRLEnv(env, seeded=self.seeded, static_seed=self.static_seed)
        self.reward_dtype = wrapped.reward_dtype
        return wrapped

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "wrap_gym": self.wrap_gym, "seeded": self.seeded, "static_seed": self.static_seed,
                "reward_dtype": None}

    def __repr__(self) -> str:
        return f"TorchRLFactory({self.fn!r})"


def _is_single_gym_env(env: Any) -> bool:
    gymnasium = sys.modules.get("gymnasium")
    return gymnasium is not None and isinstance(env, gymnasium.Env)
