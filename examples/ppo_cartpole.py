"""PPO on CartPole-v1 with shmbuf's storage: shared-memory rollouts, GAE, shuffled minibatches.

Two actor processes each step a vector of CartPole envs with a copy of the actor-critic (one torch
thread each) and write every step straight into shared memory (truncate-episodes mode: T steps of
every sub-env per rollout), together with the value and log-probability their policy computed. The
learner wraps each batch of rollouts in a :class:`shmbuf.storage.RolloutStorage` (no per-step
loop; views where the layout allows, one gather per leaf where it does not), computes GAE
(bootstrapping through time-outs from the value of the episode's final observation, and not
through terminations), takes a few epochs of clipped PPO over shuffled minibatches, and
broadcasts the new weights. It stops when the mean return of the last 100 episodes reaches
``--target`` (475 by default: CartPole-v1's own threshold).

    python examples/ppo_cartpole.py                  # the full run
    python examples/ppo_cartpole.py --max-updates 3 --json     # a smoke test

Budget: ``--max-updates`` (default 300) updates of actors x envs x T (default 2 x 8 x 64 = 1024)
env steps: 307,200 env steps at most. Measured on this project's 2-core machine (seeds 0, 1, 2): 475
reached after 124, 125 and 143 updates (127k-146k env steps), 14-17 s after the actors started.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shmbuf.storage import RolloutStorage
from workers import Collector


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.v = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v(obs).squeeze(-1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sample an action per observation; return it with the value and log-probability the learner needs."""
        dist = torch.distributions.Categorical(logits=self.pi(obs))
        action = dist.sample()
        return action, {"value": self.value(obs), "log_prob": dist.log_prob(action)}


def actor_seed(seed: int, first_obs: np.ndarray) -> list[int]:
    """The seed of one actor's action sampling: the base seed and the actor's first observation.

    The Collector resets actor i's env with ``seed + 10000 i`` (a restarted one's with more), so that
    observation tells the actors apart and is the same in every run: the runs are reproducible and
    each actor samples its own stream (a pid would give neither).
    """
    return [seed, *np.frombuffer(np.ascontiguousarray(first_obs, np.float32).tobytes(), np.uint32).tolist()]


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


class Policy:
    """The actors' side: sample an action, and keep the value and log-probability the learner needs."""

    def __init__(self, hidden: int, seed: int):
        self.net = ActorCritic(hidden)  # its weights come from the learner before the first step
        self.seed = seed
        self.gen: torch.Generator | None = None  # seeded in the actor, at its first observation

    def __call__(self, obs: np.ndarray):
        if self.gen is None:  # its own generator: the process's global one stays as it was
            seed = np.random.SeedSequence(actor_seed(self.seed, obs)).generate_state(1)[0]
            self.gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            x = torch.from_numpy(obs).float()
            dist = torch.distributions.Categorical(logits=self.net.pi(x))
            action = torch.multinomial(dist.probs, 1, generator=self.gen).squeeze(-1)  # as dist.sample(), seeded
            return action.numpy(), {"value": self.net.value(x).numpy(), "log_prob": dist.log_prob(action).numpy()}

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.net.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})


def make_envs(n: int) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n)


def values_of(model: ActorCritic, obs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.value(torch.from_numpy(np.asarray(obs, np.float32))).numpy()


def compute_gae(model: ActorCritic, storage: RolloutStorage, gamma: float, lam: float) -> None:
    """GAE over ``storage``: bootstrap from V(next observation) after the last step, and, where an episode was cut
    by the time limit, from V(its final observation); never through a termination."""
    final = storage.time_out_observations
    storage.compute_returns(values_of(model, storage.bootstrap_observations), gamma, lam,
                            time_out_values=storage.time_out_values_from(values_of(model, final.obs)))


def ppo_update(model: ActorCritic, opt: torch.optim.Optimizer, storage: RolloutStorage, *, minibatches: int,
               epochs: int, clip: float, ent: float) -> float:
    """Epochs of clipped PPO over shuffled minibatches of ``storage``; return the last minibatch's value loss."""
    for mb in storage.mini_batch_generator(minibatches, epochs):
        obs = torch.from_numpy(mb.obs).float()
        dist = torch.distributions.Categorical(logits=model.pi(obs))
        logp = dist.log_prob(torch.from_numpy(mb.actions).long())
        adv = torch.from_numpy(mb.advantages).float()
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        ratio = torch.exp(logp - torch.from_numpy(mb.old_actions_log_prob).float())
        pg = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
        v_loss = 0.5 * (model.value(obs) - torch.from_numpy(mb.returns).float()).pow(2).mean()
        loss = pg + 0.5 * v_loss - ent * dist.entropy().mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return v_loss.item()


def add_ppo_arguments(ap: argparse.ArgumentParser) -> None:
    """The PPO hyperparameters (and the seed), shared with examples/ppo_async_cartpole.py."""
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--ent", type=float, default=0.0, help="entropy bonus")
    ap.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs", type=int, default=8, help="CartPole sub-envs per actor")
    ap.add_argument("--steps", type=int, default=64, help="T: steps of every sub-env per rollout")
    ap.add_argument("--max-updates", type=int, default=300)
    ap.add_argument("--target", type=float, default=475.0, help="mean return of the last 100 episodes to stop at")
    add_ppo_arguments(ap)
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON line with the curve at the end")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = ActorCritic(args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    frames_per_batch = args.actors * args.envs * args.steps
    shuffle = np.random.default_rng(args.seed)  # the minibatches' order
    curve, recent, reached = [], [], None
    t0 = time.monotonic()
    with Collector([functools.partial(make_envs, args.envs)] * args.actors,
                   policy_factory=functools.partial(Policy, args.hidden, args.seed),
                   frames_per_batch=frames_per_batch, total_frames=frames_per_batch * args.max_updates,
                   rollout_len=args.steps, weights=numpy_state(model), start_method=args.start_method,
                   seed=args.seed) as collector:
        for update, batch in enumerate(collector, 1):
            storage = RolloutStorage.from_rollout(batch, seed=shuffle)  # [T, B*E] over the batch (views where the layout allows)
            compute_gae(model, storage, args.gamma, args.lam)
            v_loss = ppo_update(model, opt, storage, minibatches=args.minibatches, epochs=args.epochs, clip=args.clip,
                                ent=args.ent)
            collector.update_policy_weights(model)
            recent = (recent + batch.episode_returns.tolist())[-100:]
            row = {"update": update, "frames": collector.frames, "seconds": round(time.monotonic() - t0, 2),
                   "episodes": len(batch.episode_returns), "return_100": float(np.mean(recent)) if recent else 0.0,
                   "v_loss": v_loss, "lag_max": int(batch.policy_lag.max())}
            curve.append(row)
            if not args.json:
                print(f"update {update:3d}  frames {row['frames']:7d}  {row['seconds']:6.1f} s  "
                      f"return(100) {row['return_100']:6.1f}  value loss {row['v_loss']:8.3f}  lag {row['lag_max']}")
            if len(recent) >= 100 and row["return_100"] >= args.target:
                reached = row
                break
        stats = collector.stats()
    result = {"reached": reached, "updates": len(curve), "seconds": round(time.monotonic() - t0, 2),
              "frames_per_s": stats["frames_per_s"], "curve": curve}
    if args.json:
        print(json.dumps(result))
    elif reached:
        print(f"reached mean return {reached['return_100']:.1f} >= {args.target} after {reached['update']} updates, "
              f"{reached['frames']} frames, {reached['seconds']:.1f} s")
    else:
        print(f"did not reach {args.target} within {len(curve)} updates")
    return result


if __name__ == "__main__":
    main()
