"""Behaviour cloning on CartPole-v1 from recorded rollouts: record an expert with a Collector, train from the files.

1. Two actor processes step CartPole with a hand-written expert (push the cart towards where the
   pole is falling: ``theta + 0.3 * theta_dot > 0``, which balances the pole for the whole 500 steps)
   and a :class:`shmbuf.storage.files.Recorder` writes every batch to a directory: one trajectory
   (one episode of one sub-env) per directory, ``.npy`` files, published atomically.
2. A small torch classifier (4 -> 64 -> 2) is trained with cross-entropy on the expert's actions,
   read from the files with :class:`shmbuf.storage.files.RolloutDataset` (shuffled trajectories, one
   batch of ``num_envs x T`` transitions per step, looping over the recording).
3. The cloned policy is evaluated greedily on fresh episodes; the run passes if its mean return is
   at least ``--bar`` (80 %) of the expert's mean return over the episodes it recorded.

    python examples/bc_cartpole.py                       # the full run
    python examples/bc_cartpole.py --frames 2048 --train-steps 10 --eval-episodes 2 --json   # a smoke test

Budget (defaults): 20,480 recorded frames (2 actors x 4 envs x T=128), 400 training steps of 16 x 32
transitions, 10 evaluation episodes. Measured on this project's 2-core machine (seeds 0, 1, 2): 12-19 s
wall in all, of which recording 5-9 s (most of it starting the actor processes), training 3-5 s,
evaluation under 1 s; the expert's mean return is 500 and the clone's 500 on every seed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shmbuf.storage.files import Recorder, RolloutDataset
from workers import Collector


class Expert:
    """Push towards the side the pole falls to; deterministic. Works on a batch of observations ``(E, 4)``."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return (obs[:, 2] + 0.3 * obs[:, 3] > 0).astype(np.int64)


def make_envs(n: int) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n)


def record(data_dir: str, args: argparse.Namespace) -> list[float]:
    """Collect with the expert and write every batch to ``data_dir``; return the returns of the episodes that ended."""
    returns: list[float] = []
    fpb = args.actors * args.envs * args.steps
    with Collector([functools.partial(make_envs, args.envs)] * args.actors, Expert(), frames_per_batch=fpb,
                   total_frames=args.frames, rollout_len=args.steps, seed=args.seed,
                   start_method=args.start_method) as collector, Recorder(data_dir, fsync=False) as rec:
        for batch in collector:
            rec.write(batch)  # copies what it keeps: the batch is released by the next one
            returns += batch.episode_returns.tolist()
    return returns


def train(data_dir: str, args: argparse.Namespace) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    n_traj = sum(1 for n in os.listdir(data_dir) if n.startswith("trajectory_"))
    ds = RolloutDataset(data_dir, num_envs=min(args.bc_envs, n_traj), dataset_loops=0, random_shuffle_traj_order=True,
                        seed=args.seed, wait_timeout=10)
    losses = []
    for _ in range(args.train_steps):
        b = ds.get_batch(args.bc_steps)  # (T, E, ...) numpy, ours to keep
        obs = torch.from_numpy(b.observation.reshape(-1, 4))
        act = torch.from_numpy(b.action.reshape(-1))
        loss = nn.functional.cross_entropy(net(obs), act)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net, losses


def evaluate(net: nn.Module, episodes: int, seed: int) -> list[float]:
    env = gym.make("CartPole-v1")
    out = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=10_000 + seed * 1000 + i)
            total, done = 0.0, False
            while not done:
                with torch.no_grad():
                    a = int(net(torch.from_numpy(np.asarray(obs, np.float32))).argmax())
                obs, r, term, trunc, _ = env.step(a)
                total += float(r)
                done = term or trunc
            out.append(total)
    finally:
        env.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=20_480, help="frames to record")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs", type=int, default=4, help="CartPole sub-envs per actor")
    ap.add_argument("--steps", type=int, default=128, help="T of each recorded rollout")
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--bc-envs", type=int, default=16, help="trajectories read side by side (RolloutDataset num_envs)")
    ap.add_argument("--bc-steps", type=int, default=32, help="transitions per trajectory per training step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-episodes", type=int, default=10)
    ap.add_argument("--bar", type=float, default=0.8, help="fraction of the expert's mean return to reach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="keep the recording here (default: a temporary directory)")
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON line with the figures at the end")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="shmbuf-bc-") as tmp:
        data_dir = args.data_dir or os.path.join(tmp, "rollouts")
        t0 = time.monotonic()
        expert = record(data_dir, args)
        t1 = time.monotonic()
        n_traj = sum(1 for n in os.listdir(data_dir) if n.startswith("trajectory_"))
        # a short recording may end no episode: then measure the expert as the clone is measured
        expert_mean = float(np.mean(expert)) if expert else float(np.mean(evaluate_expert(args.eval_episodes, args.seed)))
        net, losses = train(data_dir, args)
        t2 = time.monotonic()
        clone = evaluate(net, args.eval_episodes, args.seed)
        t3 = time.monotonic()
    result = {
        "expert_mean_return": expert_mean, "expert_episodes": len(expert), "trajectories": n_traj,
        "clone_mean_return": float(np.mean(clone)), "clone_returns": clone, "ratio": float(np.mean(clone)) / expert_mean,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "seconds": {"record": round(t1 - t0, 2), "train": round(t2 - t1, 2), "evaluate": round(t3 - t2, 2),
                    "total": round(t3 - t0, 2)},
    }
    result["passed"] = result["ratio"] >= args.bar
    if args.json:
        print(json.dumps(result))
    else:
        print(f"recorded {args.frames} frames ({n_traj} trajectories) in {result['seconds']['record']} s; "
              f"expert mean return {expert_mean:.1f} over {len(expert)} episodes")
        print(f"trained {args.train_steps} steps in {result['seconds']['train']} s: loss {result['loss_first']:.3f} -> "
              f"{result['loss_last']:.3f}")
        print(f"clone mean return {result['clone_mean_return']:.1f} over {args.eval_episodes} episodes: "
              f"{100 * result['ratio']:.0f}% of the expert ({'>=' if result['passed'] else '<'} {100 * args.bar:.0f}%)")
    return result


def evaluate_expert(episodes: int, seed: int) -> list[float]:
    class Wrap(nn.Module):
        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            a = Expert()(obs.numpy()[None])[0]
            return torch.nn.functional.one_hot(torch.tensor(a), 2).float()

    return evaluate(Wrap(), episodes, seed)


if __name__ == "__main__":
    main()
