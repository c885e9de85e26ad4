"""Porting an echo actor to shmbuf, side by side.

The same CartPole actor twice. Before: echo's ``TrajectoryAccumulator`` fills
a buffer in the actor's memory, ``TcpClient.send`` flattens it, copies it
into a socket, and the server copies it again into its ring. After: a
``shmbuf.Writer`` writes each step into the shared slot the learner will
read; ``commit()`` hands over a slot index. The example, the timescale rules
and the ``add()`` calls are the same: the port is three lines.

CartPole's rollouts are 1.7 KB, so both runs here are bound by the env, not
the transport; the benchmarks compare transports on payloads where it matters.

    python examples/echo_port.py                         # 200 rollouts of 64 steps each way
    python examples/echo_port.py --rollouts 8 --batch 4  # a smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import sys
import time

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import shmbuf

T = 64
EXAMPLE = {  # one example for both: echo's rules are shmbuf's rules
    "step": {
        "obs": np.zeros((T, 4), np.float32),
        "action": np.zeros((T,), np.int64),
        "reward": np.zeros((T,), np.float32),
        "terminated": np.zeros((T,), bool),
        "truncated": np.zeros((T,), bool),
    },
    "bootstrap": {"obs": np.zeros((4,), np.float32), "t": np.zeros((), np.int64)},  # 0-d leaf: single-item
}


def _steps(env: gym.Env, obs: np.ndarray, rng: np.random.Generator, add) -> np.ndarray:
    """T steps of a random policy; ``add`` is the only transport-specific call. (Episodes restart in place.)"""
    for _ in range(T):
        a = int(rng.integers(2))
        nobs, r, term, trunc, _ = env.step(a)
        add("step", {"obs": obs, "action": np.int64(a), "reward": np.float32(r), "terminated": np.bool_(term),
                     "truncated": np.bool_(trunc)})
        obs = env.reset()[0] if term or trunc else nobs
    return obs


def _rollout_digests(tree: dict, n: int) -> list[bytes]:
    """Each of a batch's ``n`` rollouts as the SHA-256 of all its leaves' bytes: observations, actions, rewards,
    flags, bootstrap. (CartPole pays 1.0 a step, so reward sums alone would agree whatever arrived.)"""
    out = []
    for b in range(n):
        h = hashlib.sha256()
        for ts in sorted(tree):
            for k in sorted(tree[ts]):
                h.update(np.ascontiguousarray(tree[ts][k][b]).tobytes())
        out.append(h.digest())
    return out


def _digest(rollouts: list[bytes]) -> str:
    """One digest of every rollout received, whatever order the actors' rollouts interleaved in."""
    return hashlib.sha256(b"".join(sorted(rollouts))).hexdigest()[:16]


# ---------------------------------------------------------------- before: echo
def echo_actor(port: int, n_rollouts: int, seed: int) -> None:
    from echo import TcpClient, TrajectoryAccumulator

    client = TcpClient("127.0.0.1", port, EXAMPLE)
    buf = TrajectoryAccumulator(EXAMPLE)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    for i in range(n_rollouts):
        obs = _steps(env, obs, rng, buf.add)
        buf.add("bootstrap", {"obs": obs, "t": np.int64(i)})
        client.send(buf.build())  # flatten, copy into the socket; the server copies again
    client.wait()
    client.close()


# ---------------------------------------------------------------- after: shmbuf
def shmbuf_actor(handle: shmbuf.Handle, n_rollouts: int, seed: int) -> None:
    with shmbuf.Writer(handle, EXAMPLE) as buf:  # was: TcpClient(...) and TrajectoryAccumulator(EXAMPLE)
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=seed)
        rng = np.random.default_rng(seed)
        for i in range(n_rollouts):
            obs = _steps(env, obs, rng, buf.add)  # each add() writes into the learner's slot
            buf.add("bootstrap", {"obs": obs, "t": np.int64(i)})
            buf.commit()  # was: client.send(buf.build()); only the slot index moves


def _join_or_kill(procs: list) -> None:
    """Give each actor 10 s to finish its rollouts, then kill it: a demo must never hang."""
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def run_echo(n_actors: int, n_rollouts: int, batch: int) -> tuple[float, float, str]:
    from echo import Server, TcpTransport

    server = Server(EXAMPLE, batch_size=batch, transport=TcpTransport(port=0))
    server.start()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=echo_actor, args=(server.port, n_rollouts, i)) for i in range(n_actors)]
    try:
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        total, rollouts = 0.0, []
        for _ in range(n_actors * n_rollouts // batch):
            sample = server.sample()  # (batch, T, ...) views into echo's ring
            total += float(sample.batch["step"]["reward"].sum())
            rollouts += _rollout_digests(sample.batch, batch)
        return time.perf_counter() - t0, total, _digest(rollouts)
    finally:
        _join_or_kill(procs)
        server.close()


def run_shmbuf(n_actors: int, n_rollouts: int, batch: int) -> tuple[float, float, str]:
    reader = shmbuf.create(EXAMPLE, slots=2 * batch + 2 * n_actors, max_writers=n_actors)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=shmbuf_actor, args=(reader.handle, n_rollouts, i)) for i in range(n_actors)]
    try:
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        total, rollouts = 0.0, []
        for _ in range(n_actors * n_rollouts // batch):
            b = reader.get_batch(batch, timeout=60)  # (batch, T, ...): views of a run of slots, or gathered
            total += float(b.data["step"]["reward"].sum())
            rollouts += _rollout_digests(b.data, batch)
        return time.perf_counter() - t0, total, _digest(rollouts)
    finally:
        _join_or_kill(procs)
        reader.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=2, help="actor processes (default 2)")
    ap.add_argument("--rollouts", type=int, default=200,
                    help="rollouts per actor (default 200); --actors * --rollouts must be a multiple of --batch, "
                         "since the learner reads whole batches")
    ap.add_argument("--batch", type=int, default=16, help="rollouts per learner batch (default 16)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if min(args.actors, args.rollouts, args.batch) < 1:
        ap.error("--actors, --rollouts and --batch must be at least 1")
    if (args.actors * args.rollouts) % args.batch:
        total = args.actors * args.rollouts
        step = args.batch // math.gcd(args.actors, args.batch)  # the rollouts per actor that make whole batches
        ap.error(f"--actors * --rollouts must be a multiple of --batch (the learner reads whole batches): "
                 f"{args.actors} * {args.rollouts} = {total} is not a multiple of {args.batch}; "
                 f"for example --rollouts {-(-args.rollouts // step) * step}")
    out = {}
    for name, run in (("echo", run_echo), ("shmbuf", run_shmbuf)):
        seconds, total, digest = run(args.actors, args.rollouts, args.batch)
        out[name] = {"seconds": round(seconds, 3), "reward_sum": total, "digest": digest,
                     "steps_per_s": args.actors * args.rollouts * T / seconds}
    # Same seeds, same policy, same env: both learners received the same rollouts, byte for byte (observations,
    # actions, rewards, flags, bootstrap; in whatever order they came).
    out["same_data"] = out["echo"]["digest"] == out["shmbuf"]["digest"]
    if args.json:
        print(json.dumps(out))
    else:
        for name in ("echo", "shmbuf"):
            r = out[name]
            print(f"{name:7s} {r['seconds']:7.2f} s  {r['steps_per_s']:10,.0f} env steps/s (process start included)")
        print(f"same rollouts received: {out['same_data']}")
    return out


if __name__ == "__main__":
    main()
