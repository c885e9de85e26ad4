"""rsl_rl's GAE, as the reference for the rsl_rl fork's flag convention: a line-by-line torch transcription of rsl_rl 5.5.1
(always available: torch is a test dependency), and rsl_rl's own code when it is installed (it is not a
dependency: ``pip install --no-deps rsl-rl-lib`` to run that check too).

rsl_rl 5.5.1, ``rsl_rl/algorithms/ppo.py``:

- ``PPO.process_env_step``: ``transition.rewards = rewards.clone()``, then on a time-out
  ``transition.rewards += self.gamma * torch.squeeze(transition.values * extras["time_outs"].unsqueeze(1), 1)``
  (whatever ``dones`` says), and the storage keeps ``dones`` as given;
- ``PPO.compute_returns``: backwards over the steps, ``next_is_not_terminal = 1.0 - dones[step].float()``,
  ``delta = rewards[step] + next_is_not_terminal * gamma * next_values - values[step]``,
  ``advantage = delta + next_is_not_terminal * gamma * lam * advantage``, ``returns[step] = advantage +
  values[step]``; then ``advantages = returns - values`` (normalised unless per minibatch).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest


def transcribed(rewards: np.ndarray, values: np.ndarray, dones: np.ndarray, time_outs: np.ndarray,
                last_values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)`` ``[T, N]`` float32, computed as rsl_rl 5.5.1 does (layout ``[T, N, 1]``)."""
    torch = pytest.importorskip("torch")
    T, N = rewards.shape
    st_rewards = torch.zeros(T, N, 1)
    st_values = torch.zeros(T, N, 1)
    st_dones = torch.zeros(T, N, 1).byte()
    st_returns = torch.zeros(T, N, 1)
    for t in range(T):  # PPO.act + PPO.process_env_step + RolloutStorage.add_transition
        tr_values = torch.from_numpy(np.ascontiguousarray(values[t], np.float32))[:, None]
        tr_rewards = torch.from_numpy(np.ascontiguousarray(rewards[t], np.float32)).clone()
        tr_rewards += gamma * torch.squeeze(tr_values * torch.from_numpy(time_outs[t]).unsqueeze(1), 1)
        st_rewards[t].copy_(tr_rewards.view(-1, 1))
        st_dones[t].copy_(torch.from_numpy(dones[t]).view(-1, 1))
        st_values[t].copy_(tr_values)
    last = torch.from_numpy(np.ascontiguousarray(last_values, np.float32))[:, None]
    advantage: Any = 0
    for step in reversed(range(T)):  # PPO.compute_returns
        next_values = last if step == T - 1 else st_values[step + 1]
        next_is_not_terminal = 1.0 - st_dones[step].float()
        delta = st_rewards[step] + next_is_not_terminal * gamma * next_values - st_values[step]
        advantage = delta + next_is_not_terminal * gamma * lam * advantage
        st_returns[step] = advantage + st_values[step]
    st_advantages = st_returns - st_values
    return st_advantages[..., 0].numpy(), st_returns[..., 0].numpy()


def import_rsl_rl(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """rsl_rl's ``(PPO, RolloutStorage)``, or skip. rsl_rl's utils import ``torch.utils.tensorboard``, which needs
    the tensorboard package; GAE does not, so an empty ``SummaryWriter`` stands in while importing if it is absent."""
    pytest.importorskip("rsl_rl", reason="rsl_rl is not installed (pip install --no-deps rsl-rl-lib to check against it)")
    pytest.importorskip("tensordict")
    try:
        import torch.utils.tensorboard  # noqa: F401  # imported only to see whether it imports
    except ImportError:
        stub = types.ModuleType("torch.utils.tensorboard")
        stub.SummaryWriter = type("SummaryWriter", (), {})  # type: ignore[attr-defined]  # a module made here, empty
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", stub)
    from rsl_rl.algorithms.ppo import PPO
    from rsl_rl.storage import RolloutStorage

    return PPO, RolloutStorage


def real(monkeypatch: pytest.MonkeyPatch, rewards: np.ndarray, values: np.ndarray, dones: np.ndarray,
         time_outs: np.ndarray, last_values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)`` from rsl_rl's own ``PPO.process_env_step`` and ``PPO.compute_returns`` (run on a
    stand-in for the PPO object: a critic that returns ``last_values``, no RND, no normalisation)."""
    PPO, RolloutStorage = import_rsl_rl(monkeypatch)
    import torch
    from tensordict import TensorDict

    T, N = rewards.shape
    obs = TensorDict({"x": torch.zeros(N, 1)}, batch_size=[N])

    class Critic:
        def get_hidden_state(self) -> None:
            return None

        def reset(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __call__(self, obs: Any) -> Any:
            return torch.from_numpy(np.ascontiguousarray(last_values, np.float32))[:, None]

    ppo = types.SimpleNamespace(storage=RolloutStorage("rl", N, T, obs, (1,)), gamma=gamma, lam=lam, rnd=None,
                                actor=Critic(), critic=Critic(), device="cpu", normalize_advantage_per_mini_batch=True,
                                transition=RolloutStorage.Transition())
    for t in range(T):
        tr = ppo.transition
        tr.observations, tr.actions, tr.distribution_params = obs, torch.zeros(N, 1), (torch.zeros(N, 1),)
        tr.values = torch.from_numpy(np.ascontiguousarray(values[t], np.float32))[:, None]
        tr.actions_log_prob = torch.zeros(N)
        PPO.process_env_step(ppo, obs, torch.from_numpy(np.ascontiguousarray(rewards[t], np.float32)),
                             torch.from_numpy(dones[t]), {"time_outs": torch.from_numpy(time_outs[t])})
    PPO.compute_returns(ppo, obs)
    return ppo.storage.advantages[..., 0].numpy(), ppo.storage.returns[..., 0].numpy()
