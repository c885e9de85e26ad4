"""MultiAgentLoop against the one-process PettingZoo loop, in one process: CPU per agent step.

One command, from the repository root::

    python -m benchmarks.multiagent_loop [--quick] [--out DIR] [--profile] [--against REV]   # make bench-multiagent-loop

writes ``<out>/<date>-<host>-multiagent-loop[-quick].json`` and ``.md``. Two loops step the same PettingZoo
parallel envs (``benchmarks/multiagent_envs.py``: :data:`benchmarks.multiagent.NUM_ENVS` envs, rollouts of
:data:`benchmarks.multiagent.ROLLOUT_LEN` env steps) with the same numpy linear policies, alternated window by
window in this process; each window's figure is CPU time (``time.process_time``) per agent step, and the median
window is reported (ratios: the median of each round's ratio, the two systems back to back in each round, since
this machine's speed wanders over seconds):

- **floor**: the one-process loop of ``benchmarks/multiagent.py`` (:class:`benchmarks.multiagent.Floor`): each
  policy called once per env step over its agents, every transition (obs, action, reward, terminated, truncated,
  valid) stored into numpy arrays, an env reset when its agents are gone. What an actor process has to beat, core
  for core.
- **loop**: :class:`workers.lowlevel.MultiAgentLoop` writing each policy's rollouts through a
  :class:`shmbuf.Writer` into a real pipeline, which this process drains between windows (not timed): what each
  actor process of ``workers.MultiAgentCollector`` runs.

Cases: the synthetic 16-agent env (cheap numpy step: collection's own cost shows) with one policy and with two
(mapped by agent id), and MPE2's ``simple_spread`` (8 agents, milliseconds per env step) with one policy.
``--profile``: also print a cProfile of the loop on the synthetic env, two policies (not written to the results).
``--against REV``: also run MultiAgentLoop as it was at git revision ``REV`` (:func:`loop_at`), a third system in
every round: the change since then, measured in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks import actor_loop, machine
from benchmarks import multiagent_envs as me
from benchmarks.multiagent import NUM_ENVS, ROLLOUT_LEN, Floor

T = ROLLOUT_LEN
# (env, policy, rollouts per window): a window of about 0.1-0.5 s on this machine.
CASES = [("synthetic", "linear", 16), ("synthetic", "linear2", 16), ("spread", "linear", 1)]


class FloorRun:
    """The one-process loop of benchmarks/multiagent.py; one rollout of ``T`` env steps per ``next``."""

    def __init__(self, env: str, policy: str):
        self.run = Floor(env, policy, "loop", T * NUM_ENVS)
        self.gen = self.run.batches()

    def rollouts(self, k: int) -> int:
        return sum(next(self.gen) for _ in range(k))

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.gen.close()
        self.run.close()


class LoopRun:
    """workers.lowlevel.MultiAgentLoop with a Writer per policy, in this process; the pipelines are drained between
    windows."""

    def __init__(self, env: str, policy: str, loop_class: Any = None):
        import shmbuf
        from workers.lowlevel import MultiAgentLoop, multiagent_examples

        cls = loop_class or MultiAgentLoop  # another revision's class (loop_at), or this one

        self.envs = me.make_envs(env, NUM_ENVS)
        policies = me.make_policies(env, policy)
        mapping = me.mapping(policy)
        examples, _ = multiagent_examples(me.make_envs(env, NUM_ENVS), policies, mapping, rollout_len=T, seed=me.SEED)
        self.readers: dict[str, Any] = {}
        self.writers: dict[str, Any] = {}
        try:
            for pid, ex in examples.items():
                self.readers[pid] = shmbuf.create(ex, 64, max_writers=1)
                self.writers[pid] = shmbuf.Writer(self.readers[pid], timeout=10)
            self.loop = cls(self.envs, policies, self.writers, rollout_len=T, policy_mapping_fn=mapping,
                              seed=me.SEED)
        except BaseException:
            self.close()
            raise
        for r in self.readers.values():
            r.poll()  # lend the writers their slots: the loop runs in this thread

    def rollouts(self, k: int) -> int:
        before = self.loop.agent_steps
        self.loop.run(k)
        return self.loop.agent_steps - before

    def drain(self) -> None:
        import shmbuf

        for r in self.readers.values():
            while True:
                try:
                    r.get(timeout=0).release()
                except shmbuf.SlotTimeout:
                    break
            r.poll()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        for r in self.readers.values():
            r.close()
        for e in self.envs:
            e.close()


def loop_at(rev: str) -> Any:
    """MultiAgentLoop as it was at git revision ``rev``: its two modules (workers/_multiagent.py and
    workers/_agent_rows.py) loaded from git under private names, the rest of the package as it is now. For A/B runs
    of a change to the loop in one process (``--against``); a revision whose modules import what the package no
    longer has fails here."""
    import importlib.util
    import subprocess
    import sys
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mods = []
    with tempfile.TemporaryDirectory(prefix="multiagent-loop-") as tmp:  # the files are not needed once loaded
        for name, path in (("_bench_agent_rows", "workers/_agent_rows.py"), ("_bench_multiagent", "workers/_multiagent.py")):
            src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True,
                                 text=True).stdout
            src = src.replace("from workers._agent_rows import", "from _bench_agent_rows import")
            file = os.path.join(tmp, name + ".py")
            with open(file, "w") as f:
                f.write(src)
            spec = importlib.util.spec_from_file_location(name, file)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            mods.append(mod)
    return mods[1].MultiAgentLoop


def measure(systems: dict[str, Any], rollouts: int, windows: int) -> dict[str, list[float]]:
    """CPU microseconds per agent step of each system, ``windows`` windows of ``rollouts`` rollouts each, alternated."""
    out: dict[str, list[float]] = {name: [] for name in systems}
    for s in systems.values():  # warm-up: caches, first slots, first episodes
        s.rollouts(max(1, rollouts // 2))
        s.drain()
    for _ in range(windows):
        for name, s in systems.items():
            t0 = time.process_time()
            n = s.rollouts(rollouts)
            out[name].append((time.process_time() - t0) / n * 1e6)
            s.drain()
    return out


def run(windows: int, scale: float, against: str | None = None, progress: Any = print) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine.info(), "num_envs": NUM_ENVS, "rollout_len": T, "windows": windows,
                               "against": against, "cases": {}}
    old = loop_at(against) if against else None
    for env, policy, per in CASES:
        k = max(1, int(per * scale))
        progress(f"{env}, {policy}: floor and MultiAgentLoop, {windows} windows of {k} rollouts each")
        systems: dict[str, Any] = {}
        try:
            systems["floor"] = FloorRun(env, policy)
            systems["loop"] = LoopRun(env, policy)
            if old is not None:
                systems["loop_against"] = LoopRun(env, policy, old)
            w = measure(systems, k, windows)
        finally:
            for s in systems.values():
                s.close()
        ratio = statistics.median(x / y for x, y in zip(w["loop"], w["floor"], strict=True))
        results["cases"][f"{env}/{policy}"] = {
            "env": env, "policy": policy, "agents": me.AGENTS[env], "rollouts_per_window": k,
            "floor_us_per_agent_step": statistics.median(w["floor"]), "loop_us_per_agent_step": statistics.median(w["loop"]),
            "loop_over_floor": ratio, "windows": w}
        if old is not None:
            c = results["cases"][f"{env}/{policy}"]
            c["against_us_per_agent_step"] = statistics.median(w["loop_against"])
            c["against_over_floor"] = statistics.median(x / y for x, y in zip(w["loop_against"], w["floor"], strict=True))
            c["loop_over_against"] = statistics.median(x / y for x, y in zip(w["loop"], w["loop_against"], strict=True))
    results["loadavg_end"] = list(os.getloadavg())
    return results


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# MultiAgentLoop against the one-process PettingZoo loop, one process, {r['num_envs']} envs, "
             f"T={r['rollout_len']}", "", machine.line(r["machine"]), "",
             f"CPU per agent step (median of {r['windows']} rounds, the systems back to back in each; ratio: the "
             "median of the rounds' ratios), microseconds. Load average at the start "
             f"{r['machine']['loadavg_start'][0]:.2f}, at the end {r['loadavg_end'][0]:.2f} (on "
             f"{r['machine']['cores']} cores; CPU time per step grows when other processes share them):", "",
             "| env | agents | policies | floor (one-process loop) | MultiAgentLoop | loop / floor |",
             "|---|---:|---|---:|---:|---:|"]
    for c in r["cases"].values():
        pol = "one" if c["policy"] == "linear" else "two (by agent id)"
        lines.append(f"| {c['env']} | {c['agents']} | {pol} | {c['floor_us_per_agent_step']:.2f} | "
                     f"{c['loop_us_per_agent_step']:.2f} | {c['loop_over_floor']:.2f} |")
    if r.get("against"):
        lines += ["", f"MultiAgentLoop as it was at {r['against']} (its two modules from git), in the same rounds:", "",
                  "| env | policies | loop then, us | then / floor | now / then |", "|---|---|---:|---:|---:|"]
        for c in r["cases"].values():
            pol = "one" if c["policy"] == "linear" else "two"
            lines.append(f"| {c['env']} | {pol} | {c['against_us_per_agent_step']:.2f} | {c['against_over_floor']:.2f} | "
                         f"{c['loop_over_against']:.2f} |")
    return "\n".join(lines) + "\n"


def profile(rollouts: int) -> None:
    """cProfile of the loop on the synthetic env with two policies, the top functions by own time."""
    import cProfile
    import pstats

    s = LoopRun("synthetic", "linear2")
    try:
        s.rollouts(2)
        s.drain()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(1, rollouts // 16)):
            s.rollouts(16)
            s.drain()
        prof.disable()
    finally:
        s.close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 short windows per case (a look, not a figure)")
    ap.add_argument("--windows", type=int, default=None, help="rounds per case (default 15; --quick: 3)")
    ap.add_argument("--scale", type=float, default=None, help="rollouts per window, as a fraction of the default "
                                                              "(default 1; --quick: 0.25)")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the loop (synthetic, two policies)")
    ap.add_argument("--against", metavar="REV", help="also run MultiAgentLoop as it was at git revision REV, "
                                                     "alternated with the others (an A/B of a change to the loop)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args(argv)
    windows = a.windows or (3 if a.quick else 15)
    scale = a.scale or (0.25 if a.quick else 1.0)
    r = run(windows, scale, a.against)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{time.strftime('%Y-%m-%d')}-{r['machine']['host']}-multiagent-loop"
                        + ("-quick" if a.quick else ""))
    actor_loop.write(stem, r, markdown(r))
    if a.profile:
        profile(max(16, int(64 * scale)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
