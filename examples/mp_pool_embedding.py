"""An existing ``multiprocessing.Pool`` trainer, with shmbuf embedded: nothing else to adopt.

The trainer already farms rollouts out to a Pool. Before, each task returned
its arrays, which the Pool pickled through a pipe. After, each worker process
attaches a Writer once (the Pool's ``initializer``, given only the
pipeline's handle: a name) and each task writes its rollout into shared
memory and returns a few numbers. The learner reads the rollouts as a batch.

    python examples/mp_pool_embedding.py                        # 64 iterations of 8 rollouts
    python examples/mp_pool_embedding.py --iterations 2 --rollouts 4 --workers 2   # a smoke test
    python examples/mp_pool_embedding.py --pickle               # the "before", to compare
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.util
import os
import sys
import time

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import shmbuf

T = 128
EXAMPLE = {
    "step": {"obs": np.zeros((T, 4), np.float32), "action": np.zeros(T, np.int64), "reward": np.zeros(T, np.float32),
             "done": np.zeros(T, bool)},
    "info": {"seed": np.zeros((), np.int64), "episodes": np.zeros((), np.int64)},
}

# One Writer per Pool worker process, made by the initializer (the usual Pool idiom for per-worker state).
_writer: shmbuf.Writer | None = None


def attach(handle: shmbuf.Handle, attached) -> None:
    """Pool initializer: runs once in each worker process."""
    global _writer
    _writer = shmbuf.Writer(handle, timeout=60, label=f"pool-{os.getpid()}")
    # Give the lane back when the Pool shuts the worker down (else the reader reclaims it as dead).
    mp.util.Finalize(_writer, _writer.close, exitpriority=10)
    attached.release()  # the learner reads nothing before every worker has its lane: see below


def rollout(seed: int, w: np.ndarray, add) -> int:
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    episodes = 0
    for _ in range(T):
        a = int(np.argmax(obs @ w + rng.gumbel(size=2)))
        nobs, r, term, trunc, _ = env.step(a)
        add({"obs": obs, "action": np.int64(a), "reward": np.float32(r), "done": np.bool_(term or trunc)})
        if term or trunc:
            episodes += 1
            nobs, _ = env.reset()
        obs = nobs
    env.close()
    return episodes


def task_shmbuf(seed: int, w: np.ndarray) -> int:
    """After: write into shared memory, return a number."""
    episodes = rollout(seed, w, lambda s: _writer.add("step", s))
    _writer.add("info", {"seed": np.int64(seed), "episodes": np.int64(episodes)})
    _writer.commit()
    return episodes


def task_pickle(seed: int, w: np.ndarray) -> dict:
    """Before: build arrays, return them (the Pool pickles them back)."""
    steps: list[dict] = []
    episodes = rollout(seed, w, steps.append)
    return {"step": {k: np.stack([s[k] for s in steps]) for k in steps[0]},
            "info": {"seed": np.int64(seed), "episodes": np.int64(episodes)}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=64)
    ap.add_argument("--rollouts", type=int, default=8, help="per iteration")
    ap.add_argument("--pickle", action="store_true", help="run the trainer as it was before shmbuf")
    ap.add_argument("--start-method", default="spawn")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    ctx = mp.get_context(args.start_method)
    w = np.zeros((4, 2), np.float32)
    rng = np.random.default_rng(0)
    reader = None if args.pickle else shmbuf.create(EXAMPLE, slots=2 * args.rollouts, max_writers=args.workers)
    attached = ctx.Semaphore(0)
    pool = ctx.Pool(args.workers) if args.pickle else ctx.Pool(args.workers, initializer=attach,
                                                               initargs=(reader.handle, attached))
    if not args.pickle:
        # The reader lends all its free slots to the writers it knows when it first looks; a worker that
        # attached later would get slots only as rollouts are released. So: every lane first, then read.
        for _ in range(args.workers):
            if not attached.acquire(timeout=120):
                raise TimeoutError("a Pool worker did not attach within 120 s")
    batch = {"reward": np.zeros((args.rollouts, T), np.float32), "obs": np.zeros((args.rollouts, T, 4), np.float32)}
    seen = 0.0
    try:
        t0 = time.perf_counter()
        for it in range(args.iterations):
            seeds = [it * args.rollouts + k for k in range(args.rollouts)]
            if args.pickle:
                trees = pool.starmap(task_pickle, [(s, w) for s in seeds])
                rewards = np.stack([t["step"]["reward"] for t in trees])
            else:
                pending = pool.starmap_async(task_shmbuf, [(s, w) for s in seeds])
                for k in range(args.rollouts):
                    # Gathered one by one, each slot released at once, so a worker that needs a slot gets the
                    # next one released (get_batch would hold them all until the batch is full: see
                    # docs/embedding.md on a finite number of tasks).
                    with reader.get(timeout=60) as r:
                        batch["reward"][k] = r.data["step"]["reward"]
                        batch["obs"][k] = r.data["step"]["obs"]
                pending.get(timeout=60)  # the tasks' small return values (and any exception)
                rewards = batch["reward"]
            seen += float(rewards.sum())
            w = w + 0.01 * rng.standard_normal(w.shape).astype(np.float32)  # stands in for a training step
        seconds = time.perf_counter() - t0
    finally:
        pool.close()
        pool.join()
        if reader is not None:
            reader.close()
    frames = args.iterations * args.rollouts * T
    out = {"mode": "pickle" if args.pickle else "shmbuf", "frames": frames, "seconds": round(seconds, 3),
           "frames_per_s": frames / seconds, "reward_sum": seen}
    print(json.dumps(out) if args.json else f"{out['mode']}: {frames} frames in {seconds:.2f} s "
          f"({out['frames_per_s']:,.0f}/s), reward sum {seen:.0f}")
    return out


if __name__ == "__main__":
    main()
