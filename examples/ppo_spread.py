"""PPO with one shared policy on MPE2's simple_spread: multi-agent collection from actor processes.

Three agents must spread over three landmarks. Each agent is rewarded by how close the landmarks are
to their nearest agent, and penalised for collisions. Two actor processes each step several
simple_spread envs through :class:`workers.MultiAgentCollector`. Every agent maps to one policy,
``"shared"``: parameter sharing, the usual baseline for this env. The policy samples an action and
returns the value and log-probability the learner needs. It is called once per env step, over all of
its agents in all of the actor's envs. Each agent's stream is a row of the policy's rollouts
(docs/multiagent.md), so the learner reads a batch as PPO storage with the rows in place of sub-envs
(:class:`shmbuf.storage.RolloutStorage`). It computes GAE, bootstrapping from V(final observation) where
an episode hit its time limit, takes clipped PPO epochs, and broadcasts the new weights.

The measure is the mean return of an agent's 25-step episode, over the last 500 agent episodes (about ten
updates' worth: one update's 48 are too few to tell). The run prints, as the level to beat, the same mean
with every agent acting uniformly at random. ``--target`` stops the run once it is reached.

    python examples/ppo_spread.py                           # the full run
    python examples/ppo_spread.py --max-updates 2 --json    # a smoke test

Measured on this project's 2-core machine (seed 0, the machine shared with other work): -20.34 over the last
500 agent episodes after 123 updates (147,600 agent steps, 149 s), against -26.25 acting at random.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np
import torch
from mpe2 import simple_spread_v3
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ppo_cartpole import add_ppo_arguments, numpy_state, ppo_update, values_of  # the PPO pieces, shared

from shmbuf.storage import RolloutStorage
from workers import MultiAgentCollector

OBS_DIM, N_ACTIONS = 18, 5  # simple_spread with N=3: 18 numbers per agent, Discrete(5)


def make_env(n: int, max_cycles: int) -> list:
    """``n`` simple_spread envs: one actor steps them all, and calls the policy once per step over all their agents."""
    return [simple_spread_v3.parallel_env(N=3, max_cycles=max_cycles, continuous_actions=False) for _ in range(n)]


def shared(agent_id: str, episode=None, **kwargs) -> str:  # RLlib's policy_mapping_fn: every agent, one policy
    return "shared"


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                nn.Linear(hidden, N_ACTIONS))
        self.v = nn.Sequential(nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                               nn.Linear(hidden, 1))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v(obs).squeeze(-1)


class Policy:
    """The actors' side: sample an action per agent, and keep the value and log-probability the learner needs."""

    def __init__(self, hidden: int, seed: int):
        self.net = ActorCritic(hidden)  # its weights come from the learner before the first step
        self.gen = torch.Generator().manual_seed(seed)
        self.seeded = False

    def __call__(self, obs: np.ndarray):
        if not self.seeded:  # each actor its own stream: the seed and the actor's first observations
            words = np.frombuffer(np.ascontiguousarray(obs, np.float32).tobytes(), np.uint32)[:8].tolist()
            self.gen.manual_seed(int(np.random.SeedSequence([int(self.gen.initial_seed()), *words]).generate_state(1)[0]))
            self.seeded = True
        with torch.no_grad():
            x = torch.from_numpy(obs)
            dist = torch.distributions.Categorical(logits=self.net.pi(x))
            action = torch.multinomial(dist.probs, 1, generator=self.gen).squeeze(-1)
            return action.numpy(), {"value": self.net.value(x).numpy(), "log_prob": dist.log_prob(action).numpy()}

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.net.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})


def random_return(episodes: int, max_cycles: int, seed: int) -> float:
    """The mean return of an agent's episode when every agent acts uniformly at random: the level to beat."""
    env = simple_spread_v3.parallel_env(N=3, max_cycles=max_cycles, continuous_actions=False)
    rng = np.random.default_rng(seed)
    total, n = 0.0, 0
    env.reset(seed=seed)
    for _ in range(episodes):
        while env.agents:
            _, rew, _, _, _ = env.step({a: int(rng.integers(N_ACTIONS)) for a in env.agents})
            total += sum(rew.values())
        n += 3
        env.reset()
    env.close()
    return total / n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs", type=int, default=4, help="simple_spread envs per actor")
    ap.add_argument("--steps", type=int, default=50, help="T: env steps per rollout (two 25-step episodes)")
    ap.add_argument("--max-cycles", type=int, default=25, help="simple_spread's episode length")
    ap.add_argument("--max-updates", type=int, default=400)
    ap.add_argument("--target", type=float, default=-20.5,
                    help="mean return of an agent's episode, over the last 500, to stop at")
    add_ppo_arguments(ap)
    ap.set_defaults(gamma=0.95, ent=0.01)  # 25-step episodes: a shorter horizon; some exploration among 5 actions
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON line with the curve at the end")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = ActorCritic(args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    shuffle = np.random.default_rng(args.seed)
    baseline = random_return(200, args.max_cycles, args.seed)
    curve: list[dict] = []
    recent: list[float] = []
    reached = None
    t0 = time.monotonic()
    frames_per_batch = args.actors * args.envs * args.steps
    with MultiAgentCollector([functools.partial(make_env, args.envs, args.max_cycles)] * args.actors,
                             policy_factories={"shared": functools.partial(Policy, args.hidden, args.seed)},
                             policy_mapping_fn=shared,
                             frames_per_batch=frames_per_batch, total_frames=frames_per_batch * args.max_updates,
                             rollout_len=args.steps, weights={"shared": numpy_state(model)},
                             start_method=args.start_method, seed=args.seed) as collector:
        for update, batch in enumerate(collector, 1):
            b = batch["shared"]
            assert b.data["step"]["valid"].all()  # simple_spread's agents act at every step: no step to mask
            storage = RolloutStorage.from_rollout(b, seed=shuffle)  # [T, B*rows]: each agent's stream is a row
            final = storage.time_out_observations
            storage.compute_returns(values_of(model, storage.bootstrap_observations), args.gamma, args.lam,
                                    time_out_values=storage.time_out_values_from(values_of(model, final.obs)))
            v_loss = ppo_update(model, opt, storage, minibatches=args.minibatches, epochs=args.epochs, clip=args.clip,
                                ent=args.ent)
            collector.update_policy_weights({"shared": model})
            recent = (recent + b.episode_returns.tolist())[-500:]
            row = {"update": update, "agent_steps": collector.agent_steps, "seconds": round(time.monotonic() - t0, 2),
                   "return_500": float(np.mean(recent)) if recent else 0.0, "v_loss": v_loss,
                   "lag_max": int(b.policy_lag.max())}
            curve.append(row)
            if not args.json:
                print(f"update {update:3d}  agent steps {row['agent_steps']:7d}  {row['seconds']:6.1f} s  "
                      f"return(500) {row['return_500']:7.2f}  value loss {v_loss:7.3f}  lag {row['lag_max']}")
            if len(recent) >= 500 and row["return_500"] >= args.target:
                reached = row
                break
        stats = collector.stats()
    result = {"random_return": baseline, "reached": reached, "updates": len(curve),
              "seconds": round(time.monotonic() - t0, 2), "agent_steps_per_s": stats["agent_steps"] / max(stats["seconds"], 1e-9),
              "curve": curve}
    if args.json:
        print(json.dumps(result))
    elif reached:
        print(f"reached {reached['return_500']:.2f} >= {args.target} (random: {baseline:.2f}) after {reached['update']} "
              f"updates, {reached['agent_steps']} agent steps, {reached['seconds']:.1f} s")
    else:
        print(f"did not reach {args.target} within {len(curve)} updates (random: {baseline:.2f})")
    return result


if __name__ == "__main__":
    main()
