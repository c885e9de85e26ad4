"""Atari with each frame written once: the actors store one 84x84 frame per step, and the 4-frame stack is a view.

gymnasium's usual Atari stack is ``AtariPreprocessing`` then ``FrameStackObservation(4)``: every step's observation is
``(4, 84, 84)``, so each frame is copied into four observations and stored four times. Here the env stops at
``AtariPreprocessing``: a step's observation is its own frame, written once, into the shared-memory slot. The stack
is built from the frames by trajectory views, with the same requirement on both sides:

- in each actor, ``Collector(view_requirements={"obs": ViewRequirement("obs", shift="-3:0")})`` calls the policy with
  ``x["obs"]`` of shape ``(E, 4, 84, 84)``: a view of a ring of each sub-env's last frames, no copy per call;
- in the learner, ``build_views(rollout, {"stack": ViewRequirement("obs", shift="-3:0")}, prev=previous_rollout)``
  gives every step's stack, ``(T, E, 4, 84, 84)``, the frames before the rollout read from the lane's previous one.

Before an episode's first frame both sides repeat that frame, as ``FrameStackObservation`` pads with the reset
observation (and as RLlib fills a frame stack). The policy records a checksum of each input it acted on (a policy
extra), and the learner checks every step's stack against it: what the learner trains on is what the actor saw.

    python examples/atari_frames.py                         # Pong, 2 actors x 4 envs, 20 batches
    python examples/atari_frames.py --batches 2 --json      # a smoke test

Needs the ``atari`` extra (ale-py, whose ROMs ship inside it, and opencv for ``AtariPreprocessing``) and torch:
``pip install -e ".[atari,examples]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import optree
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shmbuf.storage.views import ViewRequirement, build_views
from workers import Collector

STACK = {"obs": ViewRequirement("obs", shift="-3:0")}  # the policy's input: the last 4 frames of its sub-env
LEARNER_STACK = {"stack": ViewRequirement("obs", shift="-3:0")}  # the same columns, built from the stored frames


def make_env(env_id: str = "ALE/Pong-v5") -> Any:
    """One ALE game with the standard preprocessing (frame skip 4 with max-pooling, 84x84 grayscale, up to 30 no-ops
    at reset, v5's sticky actions) and no frame stack: observations ``(84, 84)`` uint8."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.25)
    return AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False,
                              grayscale_obs=True, scale_obs=False)


def checksum(stack: torch.Tensor | np.ndarray) -> Any:
    """One number per row of ``(N, 4, 84, 84)`` frames that a swapped, shifted or stale frame changes: each frame's
    pixel sum weighted by its place in the stack."""
    weights = torch.arange(1, 5, dtype=torch.int64) if isinstance(stack, torch.Tensor) else np.arange(1, 5)
    sums = stack.reshape(stack.shape[0], 4, -1).sum(-1)
    return (sums * weights).sum(-1)


class Agent(nn.Module):
    """A small actor-critic CNN on the stacked frames (a narrower Nature-DQN torso): samples an action and returns its
    log-probability, the value and the checksum of the input it acted on (the learner's check)."""

    def __init__(self, n_actions: int = 6):
        super().__init__()
        self.torso = nn.Sequential(nn.Conv2d(4, 16, 8, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
                                   nn.Flatten(), nn.Linear(32 * 9 * 9, 256), nn.ReLU())
        self.pi = nn.Linear(256, n_actions)
        self.v = nn.Linear(256, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        frames = x["obs"]  # (E, 4, 84, 84) uint8: a view of the actor's frame ring
        h = self.torso(frames.float() / 255.0)
        dist = torch.distributions.Categorical(logits=self.pi(h))
        action = dist.sample()
        return action, {"log_prob": dist.log_prob(action), "value": self.v(h).squeeze(-1),
                        "stack_sum": checksum(frames)}


class PreviousRollouts:
    """Each lane's last rollout (a copy), so that a rollout's first steps can read the frames before it (``prev=``)."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int, dict[str, Any]]] = {}

    def of(self, lane: int, epoch: int, seq: int) -> dict[str, Any] | None:
        """The rollout before ``(lane, epoch, seq)``, or None (a first rollout, or one of an actor restarted: its envs
        were reset, so its first frames start an episode, which is what build_views assumes without ``prev``)."""
        got = self.last.get(lane)
        return got[2] if got is not None and got[0] == epoch and got[1] == seq - 1 else None

    def keep(self, lane: int, epoch: int, seq: int, rollout: dict[str, Any]) -> None:
        self.last[lane] = (epoch, seq, optree.tree_map(np.array, rollout))


def rollout_of(batch: Any, b: int, buffered: set[str]) -> dict[str, Any]:
    """Rollout ``b`` of a truncate-episodes batch, each buffered timescale cut to its fill (views of the batch)."""
    return {ts: optree.tree_map(lambda a, n=int(batch.fill[ts][b]): a[b][:n], leaves) if ts in buffered
            else optree.tree_map(lambda a: a[b], leaves) for ts, leaves in batch.data.items()}


def learner_stacks(batch: Any, previous: PreviousRollouts, buffered: set[str]) -> tuple[int, int]:
    """Build every step's stack of every rollout of ``batch`` (``(n, E, 4, 84, 84)`` each), check it against the
    checksum its actor recorded; return ``(steps checked, mismatches)``."""
    checked = mismatched = 0
    for b in range(len(batch.lane)):
        rollout = rollout_of(batch, b, buffered)
        key = int(batch.lane[b]), int(batch.epoch[b]), int(batch.seq[b])
        stack = build_views(rollout, LEARNER_STACK, prev=previous.of(*key))["stack"]
        got = checksum(stack.reshape(-1, 4, 84, 84)).reshape(stack.shape[:2])
        want = rollout["step"]["stack_sum"]
        checked += want.size
        mismatched += int((got != want).sum())
        previous.keep(*key, rollout)
    return checked, mismatched


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="ALE/Pong-v5")
    ap.add_argument("--envs", type=int, default=8, help="envs in all, split between the actors")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--rollout-len", type=int, default=32)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = ap.parse_args(argv)
    import functools

    torch.set_num_threads(1)
    env_fns = [functools.partial(make_env, args.env)] * args.envs
    n_actions = make_env(args.env).action_space.n
    frames_per_batch = args.envs * args.rollout_len
    model = Agent(n_actions)  # the learner's copy: what a trainer would update and broadcast
    previous = PreviousRollouts()
    checked = mismatched = 0
    t0 = time.monotonic()
    with Collector(env_fns, policy_factory=functools.partial(Agent, n_actions), num_actors=args.actors,
                   frames_per_batch=frames_per_batch, rollout_len=args.rollout_len,
                   total_frames=frames_per_batch * args.batches, view_requirements=STACK, seed=0) as collector:
        schema = collector.reader.schema
        buffered = {ts.name for ts in schema.timescales if ts.buffered}
        obs = next(lf for lf in schema.by_name["step"].leaves if lf.path == ("step", "obs"))
        frame_bytes = int(np.prod(obs.shape[-2:])) * obs.dtype.itemsize  # (T, E, 84, 84): one frame per env step
        for batch in collector:
            c, m = learner_stacks(batch, previous, buffered)
            checked, mismatched = checked + c, mismatched + m
            collector.update_policy_weights(model)  # a trainer would step its optimiser on the stacks first
        frames = collector.frames
    out = {"env": args.env, "frames": frames, "seconds": round(time.monotonic() - t0, 2), "steps_checked": checked,
           "mismatches": mismatched, "shared_bytes_per_env_step": frame_bytes,
           "frame_stack_bytes_per_env_step": 4 * frame_bytes}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{frames} env steps of {args.env} in {out['seconds']} s; every stack the learner built equals the one "
              f"its actor acted on ({checked} checked, {mismatched} differ); shared memory holds "
              f"{out['shared_bytes_per_env_step']} bytes of frames per env step, a frame stack would hold "
              f"{out['frame_stack_bytes_per_env_step']}")
    return out


if __name__ == "__main__":
    main()
