"""Collect CartPole-v1 rollouts from actor processes through shmbuf, with a progress bar.

A tiny linear numpy policy runs in each actor; every batch the learner
perturbs its weights and broadcasts them (shared memory, no pickle), so the
policy lag you would see in training shows up here too.

    python examples/cartpole_collect.py                                # 2 actors, 200k frames
    python examples/cartpole_collect.py --frames 4096 --frames-per-batch 1024 --no-progress   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from workers import Collector


def actor_seed(seed: int, first_obs: np.ndarray) -> list[int]:
    """The seed of one actor's action sampling: the base seed and the actor's first observation.

    The Collector resets actor i's env with ``seed + 10000 i`` (a restarted one's with more), so that
    observation tells the actors apart and is the same in every run: the runs are reproducible and
    each actor samples its own stream (a pid would give neither).
    """
    return [seed, *np.frombuffer(np.ascontiguousarray(first_obs, np.float32).tobytes(), np.uint32).tolist()]


class LinearPolicy:
    """Softmax over a linear function of the observation; weights come from the learner."""

    def __init__(self, seed: int = 0):
        self.w = np.zeros((4, 2), np.float32)
        self.seed = seed
        self.rng: np.random.Generator | None = None  # seeded in the actor, at its first observation

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        if self.rng is None:
            self.rng = np.random.default_rng(actor_seed(self.seed, obs))
        logits = obs @ self.w
        return np.argmax(logits + self.rng.gumbel(size=logits.shape), axis=1)

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.w = params["w"]


def make_env(num_envs: int = 1):
    if num_envs == 1:
        return gym.make("CartPole-v1")
    return gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs-per-actor", type=int, default=1, help="> 1: a gymnasium sync vector env per actor")
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--frames-per-batch", type=int, default=4096)
    ap.add_argument("--rollout-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="env resets, the actors' action sampling, the weight noise")
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    w = np.zeros((4, 2), np.float32)
    with Collector([partial(make_env, args.envs_per_actor)] * args.actors, LinearPolicy(args.seed), seed=args.seed,
                   frames_per_batch=args.frames_per_batch, total_frames=args.frames, rollout_len=args.rollout_len,
                   weights={"w": w}, start_method=args.start_method, progress=not args.no_progress) as collector:
        for batch in collector:
            obs = batch.data["step"]["obs"]  # (B, T, [E,] 4): a view, valid until the next batch
            assert np.isfinite(obs).all()
            w = w + 0.01 * rng.standard_normal(w.shape).astype(np.float32)  # stands in for a gradient step
            collector.update_policy_weights({"w": w})
        stats = collector.stats()
    out = {k: stats[k] for k in ("frames", "seconds", "frames_per_s", "policy_lag_mean", "policy_lag_max",
                                 "return_mean_100")}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['frames']} frames in {out['seconds']:.2f} s: {out['frames_per_s']:,.0f} env steps/s with "
              f"{args.actors} actors x {args.envs_per_actor} envs; policy lag mean {out['policy_lag_mean']:.2f}, "
              f"max {out['policy_lag_max']}")
    return out


if __name__ == "__main__":
    main()
