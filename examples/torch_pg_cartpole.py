"""Learn CartPole-v1 with a small PyTorch policy-gradient learner fed by shmbuf.

Two actor processes step CartPole with a torch policy (one thread each) and
write whole episodes straight into shared memory (complete-episodes mode);
the learner gathers at least ``--frames-per-batch`` frames, takes a few
clipped policy-gradient steps (PPO's clipped surrogate on discounted
reward-to-go; the behaviour log-probs the actors stored make the policy lag
harmless), and broadcasts the new weights through shared memory. It stops
when the mean return of the last 100 episodes reaches ``--target``.

    python examples/torch_pg_cartpole.py                      # the full run
    python examples/torch_pg_cartpole.py --max-updates 3 --frames-per-batch 500 --json   # a smoke test

Budget: ``--max-updates`` (default 60) updates of ``--frames-per-batch``
(default 4000) frames: 240 000 env steps at most.
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

from workers import Collector


def actor_seed(seed: int, first_obs: np.ndarray) -> list[int]:
    """The seed of one actor's action sampling: the base seed and the actor's first observation.

    The Collector resets actor i's env with ``seed + 10000 i`` (a restarted one's with more), so that
    observation tells the actors apart and is the same in every run: the runs are reproducible and
    each actor samples its own stream (a pid would give neither).
    """
    return [seed, *np.frombuffer(np.ascontiguousarray(first_obs, np.float32).tobytes(), np.uint32).tolist()]


def make_net(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


class TorchPolicy:
    """The actors' policy: the same network, sampling actions and storing their log-probabilities."""

    def __init__(self, hidden: int, seed: int):
        self.net = make_net(hidden)
        self.seed = seed
        self.rng: np.random.Generator | None = None  # seeded in the actor, at its first observation

    def __call__(self, obs: np.ndarray):
        if self.rng is None:
            self.rng = np.random.default_rng(actor_seed(self.seed, obs))
        with torch.no_grad():
            logits = self.net(torch.from_numpy(obs).float()).numpy()
        logp_all = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        action = np.argmax(logp_all + self.rng.gumbel(size=logp_all.shape), axis=1)  # Gumbel-max: a sample
        return action, {"logp": logp_all[np.arange(len(action)), action].astype(np.float32)}

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.net.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


def reward_to_go(rewards: np.ndarray, lengths: np.ndarray, gamma: float) -> np.ndarray:
    out = np.empty_like(rewards, dtype=np.float64)
    start = 0
    for n in lengths:
        acc = 0.0
        for t in range(start + n - 1, start - 1, -1):
            acc = rewards[t] + gamma * acc
            out[t] = acc
        start += n
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--frames-per-batch", type=int, default=4000)
    ap.add_argument("--max-updates", type=int, default=60)
    ap.add_argument("--target", type=float, default=195.0, help="mean return of the last 100 episodes to stop at")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--epochs", type=int, default=4, help="gradient steps per batch")
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--progress", action="store_true", help="a tqdm bar over frames")
    ap.add_argument("--json", action="store_true", help="print one JSON line with the curve at the end")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    model = make_net(args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    curve = []
    t0 = time.monotonic()
    reached = None
    with Collector([make_env] * args.actors, policy_factory=functools.partial(TorchPolicy, args.hidden, args.seed),
                   frames_per_batch=args.frames_per_batch, total_frames=args.frames_per_batch * args.max_updates,
                   batch_mode="complete_episodes", rollout_len=500, weights=numpy_state(model),
                   start_method=args.start_method, seed=args.seed, progress=args.progress) as collector:
        recent: list[float] = []
        for update, batch in enumerate(collector, 1):
            step = batch.data["step"]
            obs = torch.from_numpy(step["obs"])
            act = torch.from_numpy(step["action"])
            old_logp = torch.from_numpy(step["logp"])
            ret = reward_to_go(step["reward"], batch.lengths, args.gamma)
            adv = torch.from_numpy((ret - ret.mean()) / (ret.std() + 1e-8)).float()
            losses = []
            for _ in range(args.epochs):
                logp = torch.log_softmax(model(obs), dim=1).gather(1, act[:, None]).squeeze(1)
                ratio = torch.exp(logp - old_logp)
                loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            collector.update_policy_weights(model)
            recent = (recent + batch.episode_returns.tolist())[-100:]
            row = {"update": update, "frames": collector.frames, "seconds": round(time.monotonic() - t0, 2),
                   "episodes": len(batch.episode_returns), "batch_return": float(batch.episode_returns.mean()),
                   "return_100": float(np.mean(recent)), "loss_first": losses[0], "loss_last": losses[-1],
                   "lag_max": int(batch.policy_lag.max()), "lag_mean": float(batch.policy_lag.mean())}
            curve.append(row)
            if not args.json and not args.progress:
                print(f"update {update:3d}  frames {row['frames']:7d}  {row['seconds']:6.1f} s  return(100) "
                      f"{row['return_100']:6.1f}  loss {losses[0]:+.4f}->{losses[-1]:+.4f}  lag max {row['lag_max']}")
            if len(recent) >= 20 and row["return_100"] >= args.target:
                reached = row
                break
        stats = collector.stats()
    result = {"reached": reached, "updates": len(curve), "seconds": round(time.monotonic() - t0, 2),
              "frames_per_s": stats["frames_per_s"], "policy_lag_mean": stats["policy_lag_mean"],
              "policy_lag_max": stats["policy_lag_max"], "curve": curve}
    if args.json:
        print(json.dumps(result))
    elif reached:
        print(f"reached mean return {reached['return_100']:.1f} >= {args.target} after {reached['update']} updates, "
              f"{reached['frames']} frames, {reached['seconds']:.1f} s; policy lag mean {stats['policy_lag_mean']:.2f}, "
              f"max {stats['policy_lag_max']}")
    else:
        print(f"did not reach {args.target} within {len(curve)} updates")
    return result


if __name__ == "__main__":
    main()
