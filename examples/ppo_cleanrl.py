"""CleanRL's single-file PPO (its ``ppo.py`` for classic control), collected by ``workers.Collector``.

The learner is CleanRL's: the same agent (two 64-unit tanh MLPs, orthogonal init), the same hyperparameters
(4 envs x 128 steps per iteration, Adam 2.5e-4 annealed to 0, gamma 0.99, GAE lambda 0.95, 4 minibatches, 4
epochs, clip 0.2 on the ratio and on the value, entropy 0.01, value 0.5, gradient norm 0.5, normalised
advantages; seed 1), the same GAE recursion over ``dones`` (a time-out ends the bootstrap, as in CleanRL) and the
same update. Only the collection lines differ:

- ``--one-process``: CleanRL's own loop, stepping a gymnasium ``SyncVectorEnv`` in this process and calling the
  agent at every step (with ``SAME_STEP`` autoreset, the autoreset of the gymnasium 0.29 that CleanRL was written
  for: every row is a real transition). This is the trainer without shmbuf.
- by default: ``workers.Collector``, ``--num-actors`` (2) processes of ``num_envs / num_actors`` envs each, each
  with its own copy of the agent that samples the action and records its log-probability and value as policy
  extras. The rollout is read from the batch (``[T, B x E]``, the same tensors CleanRL's loop fills), and PPO's
  ratio is taken against the log-probability of the policy that acted. After each update the new weights go to
  the actors (``collector.update_policy_weights``).

Policy lag: each batch's ``policy_lag`` (the learner's weights version minus the version that collected each
rollout) is recorded. ``--max-policy-lag N`` is the Collector's setting (``0``: every rollout of a batch collected
with the learner's latest weights; ``1``: the actors collect the next batch during the update, never more than one
version behind; not given: free-running, the lag only measured); docs/on-policy.md says what it does to PPO and
why the ratio takes the log-probabilities the actors recorded.

    python examples/ppo_cleanrl.py                                  # CartPole-v1, 500,000 steps, the Collector
    python examples/ppo_cleanrl.py --one-process                    # the same trainer without shmbuf
    python examples/ppo_cleanrl.py --env-id Acrobot-v1 --max-policy-lag 1
    python examples/ppo_cleanrl.py --total-timesteps 2048 --json    # a smoke test

``make bench-train`` runs this loop (its :func:`train`) against the one-process loop on CartPole-v1 and
Acrobot-v1 (benchmarks/train.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn, optim
from torch.distributions.categorical import Categorical

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shmbuf.layout import ACTION, BOOTSTRAP, OBS, REWARD, STEP, TERMINATED, TRUNCATED
from workers import Collector

RETURN_WINDOW = 100  # "mean return of recent episodes": the last 100, gymnasium's definition of solved


@dataclass
class Args:
    """CleanRL's ``ppo.py`` arguments (its names and defaults), and this example's own below them."""

    env_id: str = "CartPole-v1"
    total_timesteps: int = 500_000
    learning_rate: float = 2.5e-4
    num_envs: int = 4
    num_steps: int = 128
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    seed: int = 1
    # this example's
    one_process: bool = False
    num_actors: int = 2
    max_policy_lag: int | None = None
    torch_threads: int = 1
    target: float | None = None  # the env's reward_threshold by default
    stop_at_target: bool = False
    start_method: str | None = None
    collector_timeout: float | None = None  # the longest wait for one batch (None: no limit)


# ------------------------------------------------------------------ the agent (CleanRL's)


def layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh(),
                                    layer_init(nn.Linear(64, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh(),
                                   layer_init(nn.Linear(64, n_actions), std=0.01))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def spaces(env_id: str) -> tuple[int, int]:
    """(observation size, number of actions) of ``env_id``."""
    env = gym.make(env_id)
    try:
        return int(np.prod(env.observation_space.shape)), int(env.action_space.n)
    finally:
        env.close()


# ------------------------------------------------------------------ one rollout, in CleanRL's tensors


@dataclass
class Rollout:
    """What CleanRL's collection loop leaves for the update: ``[num_steps, num_envs]`` tensors, the bootstrap, and
    the episodes that ended. ``dones[t]``: the episode ended before step ``t`` (row 0 is never read by the GAE)."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor
    values: torch.Tensor
    next_obs: torch.Tensor
    next_done: torch.Tensor
    episode_returns: list[float]
    policy_lag: np.ndarray  # per rollout of the batch (one process: always 0)


def make_env(env_id: str) -> Any:
    return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))


def env_rollouts(args: Args, agent: Agent) -> Iterator[Rollout]:
    """CleanRL's loop: step a ``SyncVectorEnv`` here, the agent called at every step."""
    envs = gym.vector.SyncVectorEnv([functools.partial(make_env, args.env_id)] * args.num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    try:
        shape = envs.single_observation_space.shape
        obs = torch.zeros((args.num_steps, args.num_envs) + shape)
        actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape)
        logprobs = torch.zeros((args.num_steps, args.num_envs))
        rewards = torch.zeros((args.num_steps, args.num_envs))
        dones = torch.zeros((args.num_steps, args.num_envs))
        values = torch.zeros((args.num_steps, args.num_envs))
        next_obs_np, _ = envs.reset(seed=args.seed)
        next_obs = torch.Tensor(next_obs_np)
        next_done = torch.zeros(args.num_envs)
        while True:
            ended: list[float] = []
            for step in range(0, args.num_steps):
                obs[step] = next_obs
                dones[step] = next_done
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob
                next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                next_done_np = np.logical_or(terminations, truncations)
                rewards[step] = torch.tensor(reward).view(-1)
                next_obs, next_done = torch.Tensor(next_obs_np), torch.Tensor(next_done_np)
                if "final_info" in infos:
                    ep = infos["final_info"]["episode"]
                    ended += ep["r"][infos["final_info"]["_episode"]].tolist()
            yield Rollout(obs, actions, logprobs, rewards, dones, values, next_obs, next_done, ended, np.zeros(1, np.int64))
    finally:
        envs.close()


def actor_seed(seed: int, first_obs: np.ndarray) -> list[int]:
    """The seed of one actor's action sampling: the base seed and the actor's first observation (the Collector
    resets actor i's envs with ``seed + 10000 i``, so it tells the actors apart and is the same in every run)."""
    return [seed, *np.frombuffer(np.ascontiguousarray(first_obs, np.float32).tobytes(), np.uint32).tolist()]


class ActorPolicy:
    """The actors' copy of the agent: sample the action, record its log-probability and value (the behaviour
    policy's, which PPO's ratio and the GAE need)."""

    def __init__(self, env_id: str, seed: int):
        self.agent = Agent(*spaces(env_id))  # its weights come from the learner before the first step
        self.seed = seed
        self.gen: torch.Generator | None = None  # seeded at the first observation

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if self.gen is None:
            self.gen = torch.Generator().manual_seed(int(np.random.SeedSequence(actor_seed(self.seed, obs)).generate_state(1)[0]))
        with torch.no_grad():
            x = torch.Tensor(obs)
            probs = Categorical(logits=self.agent.actor(x))
            action = torch.multinomial(probs.probs, 1, generator=self.gen).squeeze(-1)  # probs.sample(), seeded
            return action.numpy(), {"logprob": probs.log_prob(action).numpy(), "value": self.agent.critic(x).flatten().numpy()}

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.agent.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})


def numpy_state(agent: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in agent.state_dict().items()}


def _cleanrl_order(x: np.ndarray) -> torch.Tensor:
    """A step leaf ``(B, T, E, ...)`` as CleanRL's ``[T, B x E, ...]`` (a copy)."""
    b, t, e = x.shape[:3]
    return torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 0, 1)).reshape(t, b * e, *x.shape[3:]))


def batch_rollout(batch: Any) -> Rollout:
    """A Collector batch as CleanRL's rollout tensors: its ``B`` rollouts of ``E`` envs side by side as ``B x E``
    columns, each a run of ``T`` consecutive steps of one env with its own bootstrap."""
    s, boot = batch.data[STEP], batch.data[BOOTSTRAP]
    ended = _cleanrl_order(s[TERMINATED] | s[TRUNCATED]).float()
    dones = torch.zeros_like(ended)
    dones[1:] = ended[:-1]
    next_obs = torch.from_numpy(np.asarray(boot[OBS], np.float32).reshape(ended.shape[1], -1))
    return Rollout(obs=_cleanrl_order(s[OBS]).float(), actions=_cleanrl_order(s[ACTION]).float(),
                   logprobs=_cleanrl_order(s["logprob"]).float(), rewards=_cleanrl_order(s[REWARD]).float(), dones=dones,
                   values=_cleanrl_order(s["value"]).float(), next_obs=next_obs, next_done=ended[-1],
                   episode_returns=batch.episode_returns.tolist(), policy_lag=np.asarray(batch.policy_lag))


class CollectorRollouts:
    """The rollouts from ``workers.Collector``; :meth:`update_policy` sends the learner's weights to the actors."""

    def __init__(self, args: Args, agent: Agent, iterations: int):
        if args.num_envs % args.num_actors:
            raise ValueError(f"--num-envs: expected a multiple of --num-actors={args.num_actors}, got {args.num_envs}")
        per_actor = args.num_envs // args.num_actors
        envs = functools.partial(gym.vector.SyncVectorEnv, [functools.partial(gym.make, args.env_id)] * per_actor)
        frames = args.num_envs * args.num_steps
        policy = functools.partial(ActorPolicy, args.env_id, args.seed)
        self.collector = Collector([envs] * args.num_actors, policy_factory=policy,
                                   frames_per_batch=frames, total_frames=frames * iterations, rollout_len=args.num_steps,
                                   weights=numpy_state(agent), seed=args.seed, start_method=args.start_method,
                                   timeout=args.collector_timeout, max_policy_lag=args.max_policy_lag)

    def __iter__(self) -> Iterator[Rollout]:
        for batch in self.collector:
            yield batch_rollout(batch)

    def update_policy(self, agent: Agent) -> None:
        self.collector.update_policy_weights(agent)

    def stale_dropped(self) -> int:
        """Rollouts the collector gave back unread, older than ``max_policy_lag`` allows (0 on a balanced machine)."""
        return int(self.collector.stats().get("stale_dropped", 0))

    def close(self) -> None:
        self.collector.close()


# ------------------------------------------------------------------ CleanRL's loop


def train(args: Args, on_iteration: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """CleanRL's PPO over ``args``; returns the curve (one row per iteration) and the run's figures.

    ``on_iteration(row)`` is called after each update (a benchmark's progress bar; ``row["last"]``: no iteration
    follows). Times are from this call's
    start (so the Collector's start-up counts); ``steps_per_s`` is over the iterations after the first.
    """
    t0 = time.monotonic()
    torch.set_num_threads(args.torch_threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    target = args.target if args.target is not None else gym.spec(args.env_id).reward_threshold
    batch_size = int(args.num_envs * args.num_steps)
    minibatch_size = int(batch_size // args.num_minibatches)
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        raise ValueError(f"--total-timesteps: expected at least num_envs x num_steps = {batch_size}, got {args.total_timesteps}")

    agent = Agent(*spaces(args.env_id))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    source: Any = None
    if args.one_process:
        rollouts: Iterator[Rollout] = env_rollouts(args, agent)
        update_policy: Callable[[Agent], None] = lambda _agent: None  # noqa: E731  # the agent acting is the one trained
    else:
        source = CollectorRollouts(args, agent, num_iterations)
        rollouts, update_policy = iter(source), source.update_policy
    recent: deque[float] = deque(maxlen=RETURN_WINDOW)
    curve: list[dict[str, Any]] = []
    reached = None
    global_step = 0
    t_first = None
    try:
        for iteration in range(1, num_iterations + 1):
            ro = next(rollouts)
            global_step += batch_size
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # bootstrap value if not done
            with torch.no_grad():
                next_value = agent.get_value(ro.next_obs).reshape(1, -1)
                advantages = torch.zeros_like(ro.rewards)
                lastgaelam: Any = 0
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - ro.next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - ro.dones[t + 1]
                        nextvalues = ro.values[t + 1]
                    delta = ro.rewards[t] + args.gamma * nextvalues * nextnonterminal - ro.values[t]
                    advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                returns = advantages + ro.values

            # flatten the batch
            b_obs = ro.obs.reshape((-1,) + ro.obs.shape[2:])
            b_logprobs = ro.logprobs.reshape(-1)
            b_actions = ro.actions.reshape((-1,) + ro.actions.shape[2:])
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = ro.values.reshape(-1)

            # optimizing the policy and value network
            b_inds = np.arange(batch_size)
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, batch_size, minibatch_size):
                    mb_inds = b_inds[start:start + minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()
                    with torch.no_grad():
                        approx_kl = ((ratio - 1) - logratio).mean()
                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                    pg_loss = torch.max(-mb_advantages * ratio,
                                        -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
                    newvalue = newvalue.view(-1)
                    if args.clip_vloss:
                        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                        v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef)
                        v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - b_returns[mb_inds]) ** 2).mean()
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                    loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                if args.target_kl is not None and approx_kl > args.target_kl:
                    break
            update_policy(agent)

            now = time.monotonic()
            t_first = now if t_first is None else t_first
            recent.extend(ro.episode_returns)
            row = {"iteration": iteration, "steps": global_step, "seconds": round(now - t0, 3),
                   "episodes": len(ro.episode_returns), "return_recent": float(np.mean(recent)) if recent else None,
                   "lag_mean": float(np.mean(ro.policy_lag)), "lag_max": int(np.max(ro.policy_lag)),
                   "v_loss": float(v_loss.item()), "approx_kl": float(approx_kl.item())}
            if reached is None and len(recent) == RETURN_WINDOW and row["return_recent"] >= target:
                reached = row
            row["last"] = iteration == num_iterations or (reached is row and args.stop_at_target)
            curve.append(row)
            if on_iteration is not None:
                on_iteration(row)
            if row["last"]:
                break
    finally:
        stale = 0
        if source is not None:
            with contextlib.suppress(Exception):  # figures only: the close below must run
                stale = source.stale_dropped()
            source.close()
        elif hasattr(rollouts, "close"):
            rollouts.close()
    end = time.monotonic()
    lags = [r["lag_mean"] for r in curve]
    timed = curve[-1]["steps"] - curve[0]["steps"]
    return {"env_id": args.env_id, "seed": args.seed, "system": "one_process" if args.one_process else "collector",
            "max_policy_lag": args.max_policy_lag, "stale_dropped": stale, "target": target,
            "lag_enforced": args.max_policy_lag is not None and not args.one_process,
            "reached": reached, "iterations": len(curve), "steps": global_step, "seconds": round(end - t0, 3),
            "first_iteration_s": curve[0]["seconds"],
            "steps_per_s": timed / (curve[-1]["seconds"] - curve[0]["seconds"]) if timed else None,
            "lag_mean": float(np.mean(lags)), "lag_max": max(r["lag_max"] for r in curve),
            "final_return": curve[-1]["return_recent"], "torch_threads": args.torch_threads, "curve": curve}


def parse_args(argv: list[str] | None = None) -> tuple[Args, bool]:
    """The run's :class:`Args`, and whether to print the result as one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="CleanRL's arguments keep its names and defaults.")
    d = Args()
    for name in ("env_id", "total_timesteps", "learning_rate", "num_envs", "num_steps", "gamma", "gae_lambda",
                 "num_minibatches", "update_epochs", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    for name in ("anneal_lr", "norm_adv", "clip_vloss"):
        ap.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=getattr(d, name))
    ap.add_argument("--target-kl", type=float, default=None)
    ap.add_argument("--one-process", action="store_true", help="CleanRL's own loop over a SyncVectorEnv, no Collector")
    ap.add_argument("--num-actors", type=int, default=d.num_actors, help="Collector actor processes (num_envs split among them)")
    ap.add_argument("--max-policy-lag", type=int, default=None,
                    help="passed to the Collector where it takes it (0: synchronous; 1: one version behind at most)")
    ap.add_argument("--torch-threads", type=int, default=d.torch_threads, help="torch threads of the learner")
    ap.add_argument("--target", type=float, default=None, help="the return to reach (default: the env's reward_threshold)")
    ap.add_argument("--stop-at-target", action="store_true", help=f"stop once the mean of the last {RETURN_WINDOW} "
                    "episodes reaches --target")
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--collector-timeout", type=float, default=None, help="the longest wait for one batch, in s")
    ap.add_argument("--json", action="store_true", help="print one JSON line with the result and curve at the end")
    ns = vars(ap.parse_args(argv))
    return Args(**{f.name: ns[f.name] for f in fields(Args)}), ns["json"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, quiet = parse_args(argv)

    def show(row: dict[str, Any]) -> None:
        if not quiet and (row["iteration"] % 20 == 0 or row["iteration"] == 1):
            ret = "-" if row["return_recent"] is None else f"{row['return_recent']:7.1f}"
            print(f"iteration {row['iteration']:4d}  steps {row['steps']:7d}  {row['seconds']:6.1f} s  return {ret}  "
                  f"lag {row['lag_max']}")

    result = train(args, show)
    if quiet:
        print(json.dumps(result))
    else:
        with contextlib.suppress(TypeError):
            print(f"{result['steps']} steps in {result['seconds']:.1f} s, {result['steps_per_s']:,.0f} steps/s; "
                  f"policy lag mean {result['lag_mean']:.2f}, max {result['lag_max']}"
                  + (" (enforced)" if result["lag_enforced"] else " (measured)"))
        r = result["reached"]
        print(f"reached {r['return_recent']:.1f} >= {result['target']} at step {r['steps']}, {r['seconds']:.1f} s" if r
              else f"did not reach {result['target']}; final mean return {result['final_return']}")
    return result


if __name__ == "__main__":
    main()
