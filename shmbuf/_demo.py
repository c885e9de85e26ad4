"""``shmbuf demo`` / ``make demo``: real CartPole rollouts from actor processes to this learner, then the figures.

Each actor steps a vectorised CartPole-v1 (gymnasium, same-step autoreset, so
no reset observation is ever stored as a transition) with a tiny linear numpy
policy, writing every step straight into a shared slot; the learner takes
rollouts as zero-copy views, reads them, and releases them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

import shmbuf
from shmbuf.layout import ACTION, BOOTSTRAP, OBS, REWARD, STEP, TERMINATED, TRUNCATED


def example(steps: int, envs: int) -> dict[str, Any]:
    return {
        STEP: {
            OBS: np.zeros((steps, envs, 4), np.float32),
            ACTION: np.zeros((steps, envs), np.int64),
            REWARD: np.zeros((steps, envs), np.float32),
            TERMINATED: np.zeros((steps, envs), bool),
            TRUNCATED: np.zeros((steps, envs), bool),
        },
        # single-item timescales: a leading 1 (the bootstrap observation), or 0-d leaves (episode totals)
        BOOTSTRAP: {OBS: np.zeros((1, envs, 4), np.float32)},
        "episodes": {
            "count": np.zeros((), np.int64), "return_sum": np.zeros((), np.float64), "length_sum": np.zeros((), np.int64),
        },
    }


def actor(handle: shmbuf.Handle, envs: int, steps: int, seed: int) -> None:
    import gymnasium as gym

    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(4).astype(np.float32)  # a tiny linear policy: push toward where the pole falls
    obs, _ = env.reset(seed=seed)
    ep_return = np.zeros(envs)
    ep_length = np.zeros(envs, np.int64)
    step = {OBS: obs, ACTION: np.zeros(envs, np.int64), REWARD: None, TERMINATED: None, TRUNCATED: None}
    try:
        with shmbuf.Writer(handle, timeout=None, label=f"cartpole-{seed}") as writer:
            while True:
                count, ret_sum, len_sum = 0, 0.0, 0
                for _ in range(steps):
                    action = ((obs @ weights) + 0.3 * rng.standard_normal(envs) > 0).astype(np.int64)
                    next_obs, reward, terminated, truncated, _info = env.step(action)
                    step[OBS], step[ACTION] = obs, action
                    step[REWARD], step[TERMINATED], step[TRUNCATED] = reward, terminated, truncated
                    writer.add(STEP, step)
                    ep_return += reward
                    ep_length += 1
                    done = terminated | truncated
                    if done.any():
                        count += int(done.sum())
                        ret_sum += float(ep_return[done].sum())
                        len_sum += int(ep_length[done].sum())
                        ep_return[done] = 0
                        ep_length[done] = 0
                        # same-step autoreset: next_obs already holds the reset observation of finished envs
                    obs = next_obs
                writer.add(BOOTSTRAP, {OBS: obs})
                writer.add("episodes", {"count": count, "return_sum": ret_sum, "length_sum": len_sum})
                writer.commit()
    finally:  # the learner closing the pipeline is the normal way out: the `with` block ends quietly on it
        env.close()


def _first_rollout(reader: shmbuf.Reader, procs: list[Any], timeout: float) -> shmbuf.Rollout:
    """The first rollout, waited for in short slices so that actors that died at start are told at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return reader.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        except shmbuf.SlotTimeout:
            dead = [p for p in procs if p.exitcode is not None]
            if len(dead) == len(procs):
                codes = ", ".join(str(p.exitcode) for p in dead)
                raise shmbuf.BrokenPipeline(f"shmbuf demo: every actor exited before its first rollout (exit codes {codes}); "
                                            "their tracebacks are above") from None
            if time.monotonic() >= deadline:
                raise


def run(seconds: float = 10.0, actors: int = 2, envs_per_actor: int = 8, steps: int = 64) -> int:
    from tqdm import tqdm

    ctx = mp.get_context("spawn")
    reader = shmbuf.create(example(steps, envs_per_actor), slots=4 * actors, max_writers=actors)
    name = reader.name
    procs = [ctx.Process(target=actor, args=(reader.handle, envs_per_actor, steps, seed), daemon=True) for seed in range(actors)]
    print(f"shmbuf demo: {actors} actor processes x {envs_per_actor} CartPole-v1 envs, rollouts of {steps} steps, "
          f"{seconds:.0f} s, pipeline {name}")
    for p in procs:
        p.start()
    rollouts = episodes = 0
    returns = 0.0
    bytes_per = sum(lf.nbytes for lf in reader.schema.leaves)
    try:
        _first_rollout(reader, procs, 60.0).release()  # the actors import gymnasium and start
        reader.stats()  # reset nothing, just serve
        t0 = time.monotonic()
        with tqdm(total=round(seconds, 1), unit="s", bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s{postfix}") as bar:
            while (now := time.monotonic()) - t0 < seconds:
                with reader.get(timeout=10) as r:
                    # the learner reads the rollout where the actor wrote it
                    ep = r.data["episodes"]
                    n = int(ep["count"])
                    episodes += n
                    returns += float(ep["return_sum"])
                    _ = float(r.data[STEP][REWARD].sum())
                rollouts += 1
                if rollouts % 50 == 0:
                    bar.n = round(min(now - t0, seconds), 1)
                    bar.set_postfix_str(f"{rollouts * steps * envs_per_actor / (now - t0):,.0f} env steps/s")
            elapsed = time.monotonic() - t0
            bar.n = round(seconds, 1)
            bar.refresh()
        stats = reader.stats()
    finally:
        reader.close()  # actors' next call raises PipelineClosed and they leave
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)
    env_steps = rollouts * steps * envs_per_actor
    left = [e for e in os.listdir("/dev/shm") if name[1:] in e]
    print()
    print(f"  env steps/s          {env_steps / elapsed:>12,.0f}")
    print(f"  rollouts/s           {rollouts / elapsed:>12,.1f}   ({rollouts} rollouts of {steps} x {envs_per_actor} steps)")
    print(f"  MB/s                 {rollouts * bytes_per / elapsed / 1e6:>12,.2f}   ({bytes_per} bytes per rollout)")
    print(f"  commit -> learner    p50 {stats['latency_us_p50']:,.0f} us, p99 {stats['latency_us_p99']:,.0f} us")
    print(f"  episodes finished    {episodes:>12,}   mean return {returns / max(episodes, 1):.1f} (a random linear policy)")
    print(f"  partial rollouts dropped {stats['partial_dropped']}, bad messages {stats['bad_messages']}")
    print(f"  actors exited        {sum(p.exitcode == 0 for p in procs)}/{actors} cleanly")
    print(f"  left in /dev/shm     {'nothing' if not left else left}")
    return 0 if not left and all(p.exitcode == 0 for p in procs) else 1
