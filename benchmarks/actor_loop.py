"""The actor loop against the bare loop, in one process: CPU per vector step, and copies per observation byte.

One command, from the repository root::

    python -m benchmarks.actor_loop [--quick] [--out DIR]      # part of: make bench-collect

writes ``<out>/<date>-<host>-loop.json`` and ``.md``. Two loops step the same vector env with the same
numpy linear policy, alternated window by window in this process, and each window's figure is
CPU time (``time.process_time``) per vector step; the median window is reported:

- **bare**: ``obs = env.reset()``, then per step ``action = policy(obs)``, ``env.step(action)``, and the
  transition (obs, action, reward, terminated, truncated) stored into a numpy buffer of ``T`` steps.
  gymnasium's ``SyncVectorEnv`` resets ended sub-envs itself (``NEXT_STEP``: the step after an
  end is a reset, which this loop stores as if it were a transition: the floor is not even correct,
  only cheap).
- **ActorLoop**: :class:`workers.ActorLoop` with a :class:`shmbuf.Writer`, rollouts of ``T`` steps
  committed to a pipeline that this process drains between windows (not timed).
- **bare, sub-envs by hand**: the bare loop stepping the 16 gymnasium envs in a Python loop, as
  ActorLoop's driver does with an unwrapped ``SyncVectorEnv`` (no info merge, no concatenation).

Two at once: the bare loop alone in a child process, and in each of two child processes running together
(CartPole), alternated: how much more CPU per step any process pays when two share this machine, which
bounds what two actors can gain over one process whatever they run.

Envs: ``CartPole-v1`` and :class:`AtariLike` (84x84x4 uint8 observations, a cheap step). Copies per
observation byte: each loop is run twice on :class:`AtariLike`, once with its observation and once with a
4-byte one; the difference in CPU per frame, divided by the CPU of one ``np.copyto`` of an observation,
is how many times each observation byte is copied (or read and written) per frame. The env's own step
makes one copy (it returns a new array, as most envs do), in every loop alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks import machine

T = 64


class AtariLike(gym.Env):
    """Atari-shaped observations (84x84x4 uint8, or ``shape``), 6 actions, a cheap step: a counter written
    into a fixed frame; episodes of 100 to 1000 steps from the seeded RNG."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, shape: tuple[int, ...] = (84, 84, 4)):
        self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)
        self.action_space = gym.spaces.Discrete(6)
        self._frame = np.zeros(shape, np.uint8)
        self._t = 0
        self._len = 100

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        self._len = int(self.np_random.integers(100, 1000))
        return self._frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        obs = self._frame.copy()
        obs.flat[0] = self._t & 0xFF
        return obs, 1.0, self._t >= self._len, False, {}


def make_env(kind: str, n: int) -> gym.vector.SyncVectorEnv:
    if kind == "cartpole":
        fns = [lambda: gym.make("CartPole-v1") for _ in range(n)]
    elif kind == "atari":
        fns = [AtariLike for _ in range(n)]
    else:  # the same env with a 4-byte observation: what is left is the cost that does not scale with bytes
        fns = [lambda: AtariLike((4,)) for _ in range(n)]
    return gym.vector.SyncVectorEnv(fns, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)


class Linear:
    """A numpy linear policy on (a strided subsample of) the flattened observation: argmax of ``x @ W``."""

    def __init__(self, obs_shape: tuple[int, ...], n_actions: int, stride: int):
        self.stride = stride
        d = len(np.zeros(obs_shape).reshape(-1)[::stride])
        self.W = np.random.default_rng(0).normal(size=(d, n_actions)).astype(np.float32)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        x = obs.reshape(len(obs), -1)[:, :: self.stride].astype(np.float32)
        return (x @ self.W).argmax(1)


def policy_for(env: Any) -> Linear:
    shape = env.single_observation_space.shape
    stride = 1 if int(np.prod(shape)) <= 64 else 97  # 84*84*4 / 97: 291 inputs, so the policy is not the cost
    return Linear(shape, int(env.single_action_space.n), stride)


class Bare:
    """The bare loop (see the module doc); ``by_hand``: step the sub-envs in a Python loop."""

    def __init__(self, kind: str, n: int, by_hand: bool = False):
        self.env = make_env(kind, n)
        self.policy = policy_for(self.env)
        obs, _ = self.env.reset(seed=0)
        self.obs = obs
        self.by_hand = by_hand
        self.buf = {"obs": np.zeros((T, *obs.shape), obs.dtype), "action": np.zeros((T, n), np.int64),
                    "reward": np.zeros((T, n), np.float32), "terminated": np.zeros((T, n), bool),
                    "truncated": np.zeros((T, n), bool)}
        self.t = 0

    def steps(self, k: int) -> None:
        buf, env, policy = self.buf, self.env, self.policy
        envs = env.envs
        obs, t = self.obs, self.t
        for _ in range(k):
            a = policy(obs)
            if self.by_hand:
                nobs = np.empty_like(obs)
                rew, te, tr = np.zeros(len(envs)), np.zeros(len(envs), bool), np.zeros(len(envs), bool)
                for i, (e, ai) in enumerate(zip(envs, a)):
                    o, rew[i], te[i], tr[i], _ = e.step(ai)
                    if te[i] or tr[i]:
                        o, _ = e.reset()
                    nobs[i] = o
            else:
                nobs, rew, te, tr, _ = env.step(a)
            buf["obs"][t] = obs
            buf["action"][t] = a
            buf["reward"][t] = rew
            buf["terminated"][t] = te
            buf["truncated"][t] = tr
            obs, t = nobs, (t + 1) % T
        self.obs, self.t = obs, t

    def close(self) -> None:
        self.env.close()


class Loop:
    """workers.ActorLoop with a Writer, in this process; the pipeline is drained between windows."""

    def __init__(self, kind: str, n: int):
        import shmbuf
        from shmbuf.layout import rollout_example
        from workers import ActorLoop, probe

        self.env = make_env(kind, n)
        self.policy = policy_for(self.env)
        p = probe(self.env, self.policy, 0)
        example = rollout_example(p["obs"], p["action"], rollout_len=T, num_envs=n)
        self.reader = shmbuf.create(example, 64, max_writers=1)
        self.writer = shmbuf.Writer(self.reader, timeout=10)
        self.loop = ActorLoop(self.env, self.policy, [self.writer], rollout_len=T, seed=0)
        self.reader.poll()  # lend the writer its slots: the loop runs in this thread

    def steps(self, k: int) -> None:
        self.loop.run(max(1, k // T))

    def drain(self) -> None:
        import shmbuf

        while True:
            try:
                self.reader.get(timeout=0).release()
            except shmbuf.SlotTimeout:
                break
        self.reader.poll()

    def close(self) -> None:
        self.writer.close()
        self.reader.close()
        self.env.close()


def measure(systems: dict[str, Any], steps: int, windows: int) -> dict[str, list[float]]:
    """CPU microseconds per vector step of each system, ``windows`` windows each, alternated."""
    out: dict[str, list[float]] = {name: [] for name in systems}
    for s in systems.values():  # warm-up: caches, first slots, first episodes
        s.steps(T)
        if isinstance(s, Loop):
            s.drain()
    for _ in range(windows):
        for name, s in systems.items():
            n = steps - steps % T
            t0 = time.process_time()
            s.steps(n)
            out[name].append((time.process_time() - t0) / n * 1e6)
            if isinstance(s, Loop):
                s.drain()
    return out


def _bare_cpu(kind: str, n: int, steps: int, out: Any, i: int) -> None:
    """In a child: the bare loop's CPU microseconds per vector step, written to ``out[i]``."""
    b = Bare(kind, n)
    b.steps(T)
    t0 = time.process_time()
    b.steps(steps)
    out[i] = (time.process_time() - t0) / steps * 1e6
    b.close()


def side_by_side(kind: str, n: int, steps: int, rounds: int) -> dict[str, Any]:
    """The bare loop's CPU per vector step alone in a process, and in each of two processes running at once (what
    two actors on two cores pay for sharing the machine: caches, memory bandwidth, the hypervisor); median over
    ``rounds`` rounds of each, alternated."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    solo: list[float] = []
    pair: list[float] = []
    for _ in range(rounds):
        for k in (1, 2):
            out = ctx.Array("d", k)
            procs = [ctx.Process(target=_bare_cpu, args=(kind, n, steps, out, i)) for i in range(k)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                if p.is_alive():
                    p.kill()
                    p.join()
            (solo if k == 1 else pair).extend(out[:])
    return {"solo_us_per_step": statistics.median(solo), "pair_us_per_step": statistics.median(pair),
            "pair_over_solo": statistics.median(pair) / statistics.median(solo), "solo": solo, "pair": pair}


def paired(env: dict[str, Any], a: str, b: str) -> float:
    """The median over rounds of ``a``'s CPU per step over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(env[a]["windows"], env[b]["windows"], strict=True))


def copy_cost_us(shape: tuple[int, ...], n: int) -> float:
    """CPU microseconds of one np.copyto of ``n`` observations of ``shape`` (uint8) into the next of ``T`` rows, as
    a loop stores a step (a row of a rollout buffer: not in cache when it is written, unlike a copy repeated in place)."""
    src, dst = np.ones((n, *shape), np.uint8), np.zeros((T, n, *shape), np.uint8)
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        for k in range(4 * T):
            np.copyto(dst[k % T], src)
        runs.append((time.process_time() - t0) / (4 * T) * 1e6)
    return statistics.median(runs)


def run(n: int, steps: int, windows: int, progress: Callable[[str], None] = print) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine.info(), "num_envs": n, "rollout_len": T, "steps_per_window": steps,
                               "windows": windows, "envs": {}}
    for kind in ("cartpole", "atari", "atari-small"):
        progress(f"{kind}: bare, bare by hand and ActorLoop, {windows} windows of {steps} vector steps each")
        systems = {"bare": Bare(kind, n), "bare_by_hand": Bare(kind, n, by_hand=True), "actor_loop": Loop(kind, n)}
        try:
            w = measure(systems, steps, windows)
        finally:
            for s in systems.values():
                s.close()
        results["envs"][kind] = {name: {"us_per_step": statistics.median(v), "windows": v} for name, v in w.items()}
    progress("cartpole: the bare loop alone in a process, and two at once in two processes")
    results["side_by_side"] = side_by_side("cartpole", n, steps * 4, max(3, windows // 3))
    copy_us = copy_cost_us((84, 84, 4), n)
    results["copy_us_per_step"] = copy_us
    big, small = results["envs"]["atari"], results["envs"]["atari-small"]
    results["copies_per_obs_byte"] = {name: (big[name]["us_per_step"] - small[name]["us_per_step"]) / copy_us
                                      for name in big}
    # Ratios paired by round (the systems of one round ran back to back): this machine's speed wanders by up to 2x
    # over seconds (a VM's neighbours), which shifts every system of a round alike.
    results["ratio_actor_loop_to_bare"] = {kind: paired(r, "actor_loop", "bare") for kind, r in results["envs"].items()}
    results["ratio_actor_loop_to_bare_by_hand"] = {kind: paired(r, "actor_loop", "bare_by_hand")
                                                   for kind, r in results["envs"].items()}
    results["aim"] = {"actor_loop_within_15pct_of_bare_cartpole": results["ratio_actor_loop_to_bare"]["cartpole"] <= 1.15}

    return results


def markdown(r: dict[str, Any]) -> str:
    n = r["num_envs"]
    lines = [f"# ActorLoop against the bare loop, one process, {n} envs, T={r['rollout_len']}", "",
             machine.line(r["machine"]), "",
             f"CPU per vector step (median of {r['windows']} rounds of {r['steps_per_window']} steps, the systems back "
             "to back in each; ratios: the median of the rounds' ratios), microseconds:", "",
             "| env | bare | bare, sub-envs by hand | ActorLoop | ActorLoop / bare | ActorLoop / by hand |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, e in r["envs"].items():
        b, h, a = (e[k]["us_per_step"] for k in ("bare", "bare_by_hand", "actor_loop"))
        ra, rh = r["ratio_actor_loop_to_bare"][kind], r["ratio_actor_loop_to_bare_by_hand"][kind]
        lines.append(f"| {kind} | {b:.1f} | {h:.1f} | {a:.1f} | {ra:.2f} | {rh:.2f} |")
    c = r["copies_per_obs_byte"]
    lines += ["", f"Copies per observation byte (84x84x4, from the difference with a 4-byte observation, in units of "
                  f"one np.copyto of {n} observations into a buffer row = {r['copy_us_per_step']:.1f} us; the env's "
                  f"step makes one in each loop): bare {c['bare']:.2f}, bare by hand {c['bare_by_hand']:.2f}, "
                  f"ActorLoop {c['actor_loop']:.2f}.", "",
              f"Two processes at once (CartPole, the bare loop in each): {r['side_by_side']['pair_us_per_step']:.1f} us "
              f"of CPU per vector step each, against {r['side_by_side']['solo_us_per_step']:.1f} alone: "
              f"{r['side_by_side']['pair_over_solo']:.2f}x, what sharing this machine costs any two processes.", "",
              f"Aim: ActorLoop within 15 % of the bare loop on CartPole: "
              f"{'met' if r['aim']['actor_loop_within_15pct_of_bare_cartpole'] else 'not met'} "
              f"({r['ratio_actor_loop_to_bare']['cartpole']:.2f}x)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 short windows per system (a look, not a figure)")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args(argv)
    steps, windows = (256, 3) if a.quick else (256, 25)
    r = run(a.num_envs, steps, windows)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{time.strftime('%Y-%m-%d')}-{r['machine']['host']}-loop" + ("-quick" if a.quick else ""))
    write(stem, r, markdown(r))
    return 0


def write(stem: str, r: dict, page: str) -> None:
    """An in-process benchmark's results: ``stem.json`` (every figure) and ``stem.md`` (``page``), printed too."""
    with open(stem + ".json", "w") as f:
        json.dump(r, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(page)
    print(page)
    print(f"written: {stem}.json, {stem}.md")


if __name__ == "__main__":
    raise SystemExit(main())
