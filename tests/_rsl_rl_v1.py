"""A test double of rsl_rl 1.0.2's PPO/ActorCritic contract (legged_gym's default trainer), to drive a storage.

rsl_rl 1.0.2 is not on PyPI (rsl-rl-lib there starts at 2.1.1), so its code is not run here and none of it is
copied: these doubles make the same calls with the same arguments, in the same order, and check what they receive.

What rsl_rl 1.0.2 does with a storage (``rsl_rl/algorithms/ppo.py``, ``rsl_rl/modules/actor_critic.py``,
``rsl_rl/modules/actor_critic_recurrent.py``):

- ``PPO.init_storage``: ``RolloutStorage(num_envs, T, actor_obs_shape, critic_obs_shape, action_shape, device)``.
- ``PPO.act``: a recurrent actor-critic's ``get_hidden_states()`` (its actor's and critic's, taken before the step)
  go into ``transition.hidden_states``; then ``act(obs)``, ``evaluate(critic_obs)``, ``get_actions_log_prob``,
  ``action_mean``, ``action_std`` fill the transition.
- ``PPO.process_env_step``: rewards (plus ``gamma * values`` on a time-out), dones, ``add_transitions``,
  ``transition.clear()``, ``actor_critic.reset(dones)``.
- ``PPO.update``: ``reccurent_mini_batch_generator`` when ``actor_critic.is_recurrent``, else
  ``mini_batch_generator``; each minibatch is unpacked as an 11-tuple ``(obs, critic_obs, actions, target_values,
  advantages, returns, old_actions_log_prob, old_mu, old_sigma, hid_states, masks)``, then
  ``act(obs, masks=masks, hidden_states=hid_states[0])`` and ``evaluate(critic_obs, masks=masks,
  hidden_states=hid_states[1])``: on a feed-forward storage rsl_rl yields ``(None, None)`` and ``None`` there, and
  its feed-forward ``act``/``evaluate`` take them as ``**kwargs``; its recurrent memory refuses ``hidden_states=None``
  in batch mode (``masks`` given), runs its RNN over the padded trajectories from the given states and unpads the
  output to ``[T, envs, H]``. Then the clipped surrogate and value losses, a gradient step.
- The legged-robot fork's PPO reads the same minibatch by name: ``minibatch.hidden_states.actor`` and
  ``.critic`` (its recurrent modules hand over namedtuples with those fields), ``minibatch.masks``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn


class ActorCritic(nn.Module):
    """rsl_rl 1.0.2's feed-forward ``ActorCritic``: a Normal policy with a learned std; ``act`` and ``evaluate`` take
    ``masks``/``hidden_states`` as keyword arguments and do not use them. Records each update call's keywords."""

    is_recurrent = False

    def __init__(self, num_obs: int, num_actions: int, hidden: int = 8):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(num_obs, hidden), nn.ELU(), nn.Linear(hidden, num_actions))
        self.critic = nn.Sequential(nn.Linear(num_obs, hidden), nn.ELU(), nn.Linear(hidden, 1))
        self.std = nn.Parameter(torch.ones(num_actions))
        self.distribution: Any = None
        self.calls: list[tuple[str, Any, Any]] = []  # (method, masks, hidden_states) of each call with keywords

    def reset(self, dones: Any = None) -> None:
        pass

    @property
    def action_mean(self) -> Any:
        return self.distribution.mean

    @property
    def action_std(self) -> Any:
        return self.distribution.stddev

    @property
    def entropy(self) -> Any:
        return self.distribution.entropy().sum(dim=-1)

    def act(self, observations: Any, **kwargs: Any) -> Any:
        if kwargs:
            self.calls.append(("act", kwargs.get("masks"), kwargs.get("hidden_states")))
        mean = self.actor(self._features_a(observations, **kwargs))
        self.distribution = torch.distributions.Normal(mean, mean * 0.0 + self.std)
        return self.distribution.sample()

    def get_actions_log_prob(self, actions: Any) -> Any:
        return self.distribution.log_prob(actions).sum(dim=-1)

    def evaluate(self, critic_observations: Any, **kwargs: Any) -> Any:
        if kwargs:
            self.calls.append(("evaluate", kwargs.get("masks"), kwargs.get("hidden_states")))
        return self.critic(self._features_c(critic_observations, **kwargs))

    def _features_a(self, obs: Any, **kwargs: Any) -> Any:
        return obs

    def _features_c(self, obs: Any, **kwargs: Any) -> Any:
        return obs


class Memory(nn.Module):
    """rsl_rl 1.0.2's ``Memory`` (a GRU here): in batch mode (``masks`` given) it needs the hidden states, runs over
    the padded trajectories ``[L, traj, ...]`` from them and gives the real steps back as ``[T, envs, H]``; in
    inference mode it steps one observation and keeps its own state."""

    def __init__(self, num_obs: int, hidden: int):
        super().__init__()
        self.rnn = nn.GRU(input_size=num_obs, hidden_size=hidden, num_layers=1)
        self.hidden_states: Any = None

    def forward(self, x: Any, masks: Any = None, hidden_states: Any = None) -> Any:
        if masks is None:
            out, self.hidden_states = self.rnn(x.unsqueeze(0), self.hidden_states)
            return out.squeeze(0)
        if hidden_states is None:
            raise ValueError("Hidden states not passed to memory module during policy update")
        out, _ = self.rnn(x, hidden_states)
        T = out.shape[0]
        return out.transpose(1, 0)[masks.transpose(1, 0)].view(-1, T, out.shape[-1]).transpose(1, 0)

    def reset(self, dones: Any) -> None:
        self.hidden_states[..., dones.bool(), :] = 0.0


class ActorCriticRecurrent(ActorCritic):
    """rsl_rl 1.0.2's ``ActorCriticRecurrent`` (GRU): a memory in front of the actor and of the critic;
    ``get_hidden_states()`` is ``(actor's, critic's)``, each torch's ``(num_layers, N, H)``."""

    is_recurrent = True

    def __init__(self, num_obs: int, num_actions: int, hidden: int = 8):
        super().__init__(hidden, num_actions, hidden)
        self.memory_a = Memory(num_obs, hidden)
        self.memory_c = Memory(num_obs, hidden)

    def reset(self, dones: Any = None) -> None:
        self.memory_a.reset(dones)
        self.memory_c.reset(dones)

    def get_hidden_states(self) -> Any:
        return self.memory_a.hidden_states, self.memory_c.hidden_states

    def _features_a(self, obs: Any, masks: Any = None, hidden_states: Any = None) -> Any:
        return self.memory_a(obs, masks, hidden_states)

    def _features_c(self, obs: Any, masks: Any = None, hidden_states: Any = None) -> Any:
        return self.memory_c(obs, masks, hidden_states)


def collect(storage: Any, ac: ActorCritic, T: int, N: int, num_obs: int, *, gamma: float = 0.99, seed: int = 0) -> Any:
    """Fill ``storage`` as rsl_rl 1.0.2's ``PPO.act`` / ``process_env_step`` do, on a random env whose episodes end
    at random (some on a time-out); returns the last critic observations."""
    g = torch.Generator().manual_seed(seed)
    transition = type(storage).Transition()
    obs = torch.randn(N, num_obs, generator=g)
    if ac.is_recurrent:  # the memories' first state, as after a first inference step
        with torch.no_grad():
            ac.act(obs)
            ac.evaluate(obs)
    for _ in range(T):
        with torch.no_grad():
            if ac.is_recurrent:
                transition.hidden_states = tuple(h.clone() for h in ac.get_hidden_states())
            transition.actions = ac.act(obs).detach()
            transition.values = ac.evaluate(obs).detach()
            transition.actions_log_prob = ac.get_actions_log_prob(transition.actions).detach()
            transition.action_mean = ac.action_mean.detach()
            transition.action_sigma = ac.action_std.detach()
        transition.observations = obs
        transition.critic_observations = obs
        rewards = torch.randn(N, generator=g)
        dones = (torch.rand(N, generator=g) < 0.2).long()
        time_outs = dones.bool() & (torch.rand(N, generator=g) < 0.5)
        transition.rewards = rewards.clone()
        transition.dones = dones
        transition.rewards += gamma * torch.squeeze(transition.values * time_outs.unsqueeze(1), 1)
        storage.add_transitions(transition)
        transition.clear()
        ac.reset(dones)
        obs = torch.randn(N, num_obs, generator=g)
    return obs


def _losses(ac: ActorCritic, opt: Any, actions: Any, target_values: Any, advantages: Any, returns: Any,
            old_log_prob: Any, value: Any, clip: float = 0.2) -> tuple[float, float]:
    log_prob = ac.get_actions_log_prob(actions)
    ratio = torch.exp(log_prob - torch.squeeze(old_log_prob))
    surrogate = torch.max(-torch.squeeze(advantages) * ratio,
                          -torch.squeeze(advantages) * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)).mean()
    value_clipped = target_values + (value - target_values).clamp(-clip, clip)
    value_loss = torch.max((value - returns).pow(2), (value_clipped - returns).pow(2)).mean()
    loss = surrogate + value_loss - 0.01 * ac.entropy.mean()
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(ac.parameters(), 1.0)
    opt.step()
    return value_loss.detach().item(), surrogate.detach().item()


def ppo_update(storage: Any, ac: ActorCritic, num_mini_batches: int, num_epochs: int) -> list[tuple[float, float]]:
    """rsl_rl 1.0.2's ``PPO.update`` over ``storage``: the generator chosen by ``is_recurrent``, each minibatch
    unpacked as its 11-tuple, ``hid_states_batch[0]`` / ``[1]`` handed to ``act`` / ``evaluate``; the losses of
    each minibatch."""
    opt = torch.optim.Adam(ac.parameters(), lr=1e-3)
    if ac.is_recurrent:
        generator = storage.reccurent_mini_batch_generator(num_mini_batches, num_epochs)
    else:
        generator = storage.mini_batch_generator(num_mini_batches, num_epochs)
    out = []
    for (obs_batch, critic_obs_batch, actions_batch, target_values_batch, advantages_batch, returns_batch,
         old_actions_log_prob_batch, _old_mu_batch, _old_sigma_batch, hid_states_batch, masks_batch) in generator:
        ac.act(obs_batch, masks=masks_batch, hidden_states=hid_states_batch[0])
        value_batch = ac.evaluate(critic_obs_batch, masks=masks_batch, hidden_states=hid_states_batch[1])
        out.append(_losses(ac, opt, actions_batch, target_values_batch, advantages_batch, returns_batch,
                           old_actions_log_prob_batch, value_batch))
    storage.clear()
    return out


def fork_update(storage: Any, ac: ActorCritic, num_mini_batches: int, num_epochs: int) -> list[tuple[float, float]]:
    """The legged-robot fork's ``PPO.update`` / ``compute_losses``: the same loop, reading each minibatch by name
    (``minibatch.hidden_states.actor``, ``minibatch.hidden_states.critic``, ``minibatch.masks``, ...)."""
    opt = torch.optim.Adam(ac.parameters(), lr=1e-3)
    if ac.is_recurrent:
        generator = storage.reccurent_mini_batch_generator(num_mini_batches, num_epochs)
    else:
        generator = storage.mini_batch_generator(num_mini_batches, num_epochs)
    out = []
    for minibatch in generator:
        ac.act(minibatch.obs, masks=minibatch.masks, hidden_states=minibatch.hidden_states.actor)
        value = ac.evaluate(minibatch.critic_obs, masks=minibatch.masks, hidden_states=minibatch.hidden_states.critic)
        out.append(_losses(ac, opt, minibatch.actions, minibatch.values, minibatch.advantages, minibatch.returns,
                           minibatch.old_actions_log_prob, value))
    storage.clear()
    return out
