"""PPO on CartPole-v1 with the policy only in the learner: env processes ask one batched inference server.

The sibling of examples/ppo_cartpole.py, with :class:`workers.AsyncBatchedCollector` instead of
:class:`workers.Collector`. Each of ``--envs`` env worker processes steps one CartPole env and holds no
policy: it writes its observation into a shared-memory request slot and sleeps until the inference
server, a thread of this (the learner) process, has answered. The server's policy is a copy of the
actor-critic (``copy.deepcopy``) whose ``forward`` samples an action and returns it with the value and
log-probability PPO needs; it answers every pending request in one forward pass. The transitions, the
value and log-probability, and the weights version that chose each action (the step leaf
``policy_version``) reach the learner through the shmbuf pipeline. The learner wraps each batch in a
:class:`shmbuf.storage.RolloutStorage`, computes GAE and takes clipped PPO epochs with
examples/ppo_cartpole.py's own functions, then copies the new weights into the server's copy with
``collector.update_policy_weights(model)``. It stops when the mean return of the last 100 episodes
reaches ``--target`` (195 by default, the return at which CartPole-v0 counts as solved), and reports
the policy lag and the server's forward-pass batch sizes.

    python examples/ppo_async_cartpole.py                        # the full run, with a progress bar
    python examples/ppo_async_cartpole.py --max-updates 3 --json  # a smoke test

Budget: ``--max-updates`` (default 150) updates of envs x T (default 8 x 128 = 1024) env steps: 153,600
env steps at most. Measured on this project's 2-core machine, shared (load average 5-8), two runs of
seeds 0, 1, 2 (and two more of seed 0): 195 reached after 36/36/33/34, 32/32 and 34/37 updates (33k-38k env
steps; which worker the server answers first differs from run to run), 14-24 s after the collector was
created, of which 3-8 s went to starting the 8 env workers; 2,200-3,500 env frames/s; a forward pass served
4.7-5.6 requests on average. The asynchrony shows as policy lag: the learner trains on
one batch while the workers fill the next with the previous weights, so most steps are one version old
(mean rollout lag 1.4-1.7, at most 3-4), which PPO's ratio to the stored log-probability absorbs.

torch is imported inside :func:`main`, not at the top: under ``forkserver`` (the default) and
``spawn``, Python 3.11 re-runs this file's top level in every env worker, which needs no torch, and
importing it there costs each of them about 2.5 s of CPU before it takes its first step.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shmbuf.storage import RolloutStorage
from workers import AsyncBatchedCollector

SERVER_STATS = ("forwards", "requests", "mean_batch", "batch_sizes", "lingered_out", "dropped", "forward_s",
                "busy_s", "policy_version")


def main(argv: list[str] | None = None) -> dict:
    import torch  # here, not at the top: the env workers re-run the top level (see the module doc)
    from ppo_cartpole import ActorCritic, add_ppo_arguments, compute_gae, ppo_update

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=8, help="env worker processes, one CartPole env each")
    ap.add_argument("--steps", type=int, default=128, help="T: steps of every env worker per rollout")
    ap.add_argument("--max-updates", type=int, default=150)
    ap.add_argument("--target", type=float, default=195.0, help="mean return of the last 100 episodes to stop at")
    ap.add_argument("--min-batch-size", type=int, default=1, help="fewest requests per forward pass (the server "
                    "waits up to --server-timeout s for them)")
    ap.add_argument("--server-timeout", type=float, default=0.01)
    ap.add_argument("--slots", type=int, default=None, help="rollout slots in shared memory, which bound how far "
                    "the env workers run ahead of the learner (default: 2 batches' worth: the one being trained on "
                    "and the next; the collector's own default adds 2 per worker, and the policy lag with it)")
    add_ppo_arguments(ap)
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON line with the curve at the end")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = ActorCritic(args.hidden)
    server_policy = copy.deepcopy(model)  # the only copy that acts; the env workers hold none
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    frames_per_batch = args.envs * args.steps
    shuffle = np.random.default_rng(args.seed)  # the minibatches' order
    curve, recent, reached, first_batch_s = [], [], None, None
    step_lags = np.zeros(1, np.int64)  # env steps by lag: the learner's version when handed out - the acting version
    t0 = time.monotonic()
    with AsyncBatchedCollector([functools.partial(gym.make, "CartPole-v1")] * args.envs, policy=server_policy,
                               frames_per_batch=frames_per_batch, total_frames=frames_per_batch * args.max_updates,
                               rollout_len=args.steps, max_batch_size=args.envs, min_batch_size=args.min_batch_size,
                               server_timeout=args.server_timeout, slots=args.slots or 2 * args.envs,
                               start_method=args.start_method, seed=args.seed,
                               progress=not args.json) as collector:
        for update, batch in enumerate(collector, 1):
            if first_batch_s is None:
                first_batch_s = round(time.monotonic() - t0, 2)
            lag = collector.policy_version - batch.data["step"]["policy_version"]  # (B, T), per env step
            counts = np.bincount(lag.ravel())
            step_lags = np.pad(step_lags, (0, max(0, len(counts) - len(step_lags))))
            step_lags[: len(counts)] += counts
            storage = RolloutStorage.from_rollout(batch, seed=shuffle)  # [T, B]: a transposed view of the batch
            compute_gae(model, storage, args.gamma, args.lam)
            v_loss = ppo_update(model, opt, storage, minibatches=args.minibatches, epochs=args.epochs, clip=args.clip,
                                ent=args.ent)
            collector.update_policy_weights(model)  # into the server's copy, between two forward passes
            recent = (recent + batch.episode_returns.tolist())[-100:]
            row = {"update": update, "frames": collector.frames, "seconds": round(time.monotonic() - t0, 2),
                   "episodes": len(batch.episode_returns), "return_100": float(np.mean(recent)) if recent else 0.0,
                   "v_loss": v_loss, "lag_max": int(batch.policy_lag.max()), "step_lag_mean": float(lag.mean())}
            curve.append(row)
            if len(recent) >= 100 and row["return_100"] >= args.target:
                reached = row
                break
        stats = collector.stats()  # frames/s and lag while the workers still run; "dropped" before the table closes
    # The server's counters once its thread has stopped, so that they agree with each other.
    server = {**{k: collector.stats()["server"][k] for k in SERVER_STATS}, "dropped": stats["server"]["dropped"]}
    result = {"reached": reached, "updates": len(curve), "seconds": round(time.monotonic() - t0, 2),
              "first_batch_s": first_batch_s, "frames": stats["frames"], "frames_per_s": stats["frames_per_s"],
              "policy_lag_mean": stats["policy_lag_mean"], "policy_lag_max": stats["policy_lag_max"],
              "step_lags": step_lags.tolist(), "server": server, "curve": curve}
    if args.json:
        print(json.dumps(result))
        return result
    if reached:
        print(f"reached mean return {reached['return_100']:.1f} >= {args.target} after {reached['update']} updates, "
              f"{reached['frames']} frames, {reached['seconds']:.1f} s (the first batch after {first_batch_s} s)")
    else:
        print(f"did not reach {args.target} within {len(curve)} updates")
    print(report(result, args.envs))
    return result


def report(result: dict, envs: int) -> str:
    """The policy lag and the server's batching, as lines of text."""
    steps = np.asarray(result["step_lags"])
    shares = ", ".join(f"{lag}: {100 * n / steps.sum():.1f} %" for lag, n in enumerate(steps) if n)
    s = result["server"]
    sizes = ", ".join(f"{k}: {v}" for k, v in sorted(s["batch_sizes"].items()))
    return (
        "policy lag (the learner's weights version when a batch was handed out, minus the version that acted):\n"
        f"  per rollout (batch.policy_lag): mean {result['policy_lag_mean']:.2f}, max {result['policy_lag_max']}\n"
        f"  per env step (step leaf policy_version): {shares}\n"
        f"inference server: {s['forwards']} forward passes for {s['requests']} requests, mean batch "
        f"{s['mean_batch']:.2f} of at most {envs}; weights version {s['policy_version']}\n"
        f"  forward passes by batch size: {sizes}\n"
        f"  {s['forward_s']:.1f} s in forward passes, {s['busy_s']:.1f} s busy; {s['lingered_out']} dispatched below "
        f"min_batch_size when server_timeout passed; {s['dropped']} requests dropped; "
        f"{result['frames_per_s']:.0f} env frames/s"
    )


if __name__ == "__main__":
    main()
