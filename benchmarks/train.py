"""Training at speed: CleanRL's PPO with and without shmbuf, and collection from real Atari games, in one run.

One command, from the repository root (torchrl installs a top-level ``benchmarks`` package of its own, which
shadows this one anywhere else)::

    python -m benchmarks.train [--quick] [--out DIR] [--seeds 1,2,3] [--train-envs ...] [--systems ...] ...
    make bench-train

writes ``<out>/<date>-<host>-train[-quick].{json,md,png}``: every training run (its curve, steps/s, time to the
env's return threshold, policy lag, CPU) and every Atari collection run (every window, CPU), the machine, the
versions and the settings (``.json``); the tables (``.md``); the plot (``.png``: learning curves, steps/s bars).
``--render FILE.json`` rewrites the ``.md`` and ``.png`` of a results file.

**Part 1, PPO end to end** (examples/ppo_cleanrl.py's :func:`train`, imported: the example and the benchmark are one
loop). CleanRL's ``ppo.py`` with its hyperparameters (4 envs x 128 steps, 500,000 steps, lr 2.5e-4 annealed, ...)
on ``CartPole-v1`` (threshold 475) and ``Acrobot-v1`` (threshold -100), seeds 1, 2, 3, three systems:

- ``one_process``: CleanRL's own loop over a gymnasium ``SyncVectorEnv(4)`` in one process (the floor to beat);
- ``shmbuf_lag0`` / ``shmbuf_lag1``: the same learner on ``workers.Collector`` (2 actors x 2 envs), the Collector
  given ``max_policy_lag=0`` / ``1`` (each run records the lag of every batch, and the rollouts the Collector gave
  back as too old, ``stale_dropped``).

Torch runs on one thread in every process (the learner and each actor). A run stops once the mean return of the
last 100 episodes reaches the env's threshold (``--full-budget``: it goes on to the end of the 500,000 steps).
Reported per system and env: env steps/s (over the iterations after the first, updates included), wall time to
the threshold (from the start of the run: the Collector's start-up counts), the iterations' mean and max policy
lag, the return at the end, CPU per env step (this process and its children).

**Part 2, collection on real Atari** (benchmarks/train_atari.py): ``ALE/Pong-v5`` and ``ALE/Breakout-v5`` with the
standard preprocessing, 8 and 16 envs, a random and a Nature-CNN policy, every system (one process, Collector,
AsyncBatchedCollector, gymnasium's AsyncVectorEnv, PufferLib, EnvPool sync and async, ale-py's vector env), measured
as benchmarks/collect.py measures (its ``run_one`` and sweep): agent steps/s at delivery, median of
``--windows`` windows after a warm-up, and CPU per step of the whole process tree from ``/proc``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from typing import Any

from benchmarks import collect, machine
from benchmarks import train_atari as ta
from benchmarks import train_report as report
from benchmarks.inference import cpu_between, cpu_sample, descendants, reap_new

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))  # ppo_cleanrl, by name, here and in the actors (forkserver's path)
import ppo_cleanrl  # noqa: E402  # after its directory is on the path

TRAIN_ENVS = ("CartPole-v1", "Acrobot-v1")
SEEDS = (1, 2, 3)
# name -> (label, the example's settings)
TRAIN_SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "one_process": ("one process, CleanRL's loop, SyncVectorEnv(4)", {"one_process": True}),
    "shmbuf_lag0": ("shmbuf Collector, max_policy_lag=0", {"max_policy_lag": 0}),
    "shmbuf_lag1": ("shmbuf Collector, max_policy_lag=1", {"max_policy_lag": 1}),
}
QUICK_STEPS = 2048  # --quick: 4 iterations of 512 steps
ATARI_FPB = 256  # agent steps per delivery: collectors' batches, one-process loops' stored rollouts
# For the estimate printed at the start: env steps/s of each system on a quiet 2-core machine (from the CPU per step
# measured on a shared one: one process 330-390 us, the Collector's learner and actors together 490 on 2 cores), the
# step at which a run reaches its threshold (seed 1 measured: CartPole 295k in one process, 218k on the Collector;
# Acrobot 184k), and each Collector run's start-up.
EST_STEPS_PER_S = {"one_process": 3300, "shmbuf_lag0": 3300, "shmbuf_lag1": 4000}
EST_REACH_STEPS = {"CartPole-v1": 300_000, "Acrobot-v1": 185_000}
EST_STARTUP_S = 4.0


# ------------------------------------------------------------------ part 1: PPO


def train_plan(a: argparse.Namespace) -> list[tuple[int, str, str]]:
    """(seed, env, system) in the order run: each seed and env runs every system, the order reversed every other time."""
    out, k = [], 0
    for seed in a.seeds:
        for env in a.train_envs:
            order = a.train_systems if k % 2 == 0 else a.train_systems[::-1]
            out += [(seed, env, s) for s in order]
            k += 1
    return out


def train_estimate_s(steps: list[tuple[int, str, str]], a: argparse.Namespace) -> tuple[float, float]:
    """(expected, at most) seconds for the training plan: runs stopping at the threshold, or every run to its budget."""
    expected = most = 0.0
    for _, env, s in steps:
        rate = EST_STEPS_PER_S[s]
        reach = a.total_timesteps if a.full_budget else min(a.total_timesteps, EST_REACH_STEPS.get(env, a.total_timesteps))
        extra = 0.0 if s == "one_process" else EST_STARTUP_S
        expected += reach / rate + extra
        most += a.total_timesteps / rate + extra
    return expected, most


def _slim(curve: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The curve as columns (what the plot and tables read), to keep the results file small."""
    keys = ("steps", "seconds", "return_recent", "lag_mean", "lag_max")
    return {k: [r[k] for r in curve] for k in keys}


def train_one(seed: int, env: str, system: str, a: argparse.Namespace, bar: Any) -> dict[str, Any]:
    """One training run; its record (``status`` ok or failed, the example's figures, the curve, CPU)."""
    label, settings = TRAIN_SYSTEMS[system]
    args = ppo_cleanrl.Args(env_id=env, seed=seed, total_timesteps=a.total_timesteps, stop_at_target=not a.full_budget,
                            torch_threads=1, collector_timeout=a.stall_s, **settings)
    rec: dict[str, Any] = {"system": system, "label": label, "env_id": env, "seed": seed, "status": "ok",
                           "settings": {k: v for k, v in vars(args).items()}, "loadavg_before": list(os.getloadavg())}
    before = set(descendants())
    samples: list[tuple[int, dict[str, Any]]] = []  # (steps so far, CPU sample): at the first iteration and the last
    done = {"steps": 0}

    def on_iteration(row: dict[str, Any]) -> None:
        if not samples or row["last"]:  # from the first iteration on, the Collector's actors exist
            samples[1 if samples else 0:] = [(row["steps"], cpu_sample())]
        bar.update(row["steps"] - done["steps"])
        done["steps"] = row["steps"]
        ret = row["return_recent"]
        bar.set_postfix_str(f"{env} {system} seed {seed}: return {'-' if ret is None else f'{ret:.0f}'}, lag {row['lag_max']}")

    try:
        result = ppo_cleanrl.train(args, on_iteration)
        curve = result.pop("curve")
        result.pop("system")  # the example's word for its source ("collector"); the record keeps the benchmark's name
        rec.update(result)
        rec["curve"] = _slim(curve)
        if len(samples) == 2:  # CPU per env step between the two samples (the actors alive at both)
            (s0, c0), (s1, c1) = samples
            cpu = cpu_between(c0, c1)
            rate = (s1 - s0) / (c1["t"] - c0["t"])
            rec["cpu_cores"] = cpu
            rec["cpu_us_per_step"] = {k: cpu[k] / rate * 1e6 for k in ("learner", "children")}
    except Exception as exc:  # noqa: BLE001  # a failed run is recorded and the sweep goes on
        rec["status"], rec["error"] = "failed", f"{type(exc).__name__}: {exc}"[-3000:]
    finally:
        rec["killed_pids"] = reap_new(before)
        bar.update(a.total_timesteps - done["steps"])  # a run that stopped at its threshold: the rest of its budget
    return rec


def train_part(a: argparse.Namespace, res: dict[str, Any]) -> None:
    from tqdm.auto import tqdm

    steps = train_plan(a)
    expected, most = train_estimate_s(steps, a)
    print(f"train bench, PPO: {len(steps)} runs, about {expected / 60:.1f} minutes (at most {most / 60:.1f} if no run "
          "reaches its threshold)", file=sys.stderr, flush=True)
    bar = tqdm(total=len(steps) * a.total_timesteps, unit="step", unit_scale=True, desc="PPO", dynamic_ncols=True)
    try:
        for seed, env, s in steps:
            r = train_one(seed, env, s, a, bar)
            res["train_runs"].append(r)
            bar.write(report.train_line(r))
    finally:
        bar.close()


# ------------------------------------------------------------------ part 2: Atari


def atari_available(system: str) -> str | None:
    """None if ``system`` can run here, else why not."""
    for mod in ta.SYSTEMS[system].IMPORTS:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return None


def atari_part(a: argparse.Namespace, res: dict[str, Any]) -> None:
    for s in list(a.systems):
        why = atari_available(s)
        if why is not None:
            res["skipped"][s] = why
            a.systems.remove(s)
            print(f"{ta.SYSTEMS[s].LABEL} is not measured: {why}", file=sys.stderr)
    if a.systems and a.envs and a.policies:
        collect.sweep(a, res, systems=ta.SYSTEMS, overhead_s=ta.OVERHEAD_S, line=report.atari_line,
                      name="train bench, Atari collection")


# ------------------------------------------------------------------ main


def _names(p: argparse.ArgumentParser, what: str, got: str, known: Any, cast: Any = str) -> list[Any]:
    out = [cast(x) for x in got.split(",") if x]
    bad = [x for x in out if x not in known]
    if bad:
        p.error(f"{what}: unknown {bad}; choose from {list(known)}")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = collect.sweep_parser("python -m benchmarks.train", __doc__, ta.SYSTEMS, ta.ENVS, ta.POLICIES, window_s=1.0,
                             warmup_s=1.0, stall_s=60.0)
    p.description = __doc__.split("\n\n")[0] + " --systems, --variants, --envs and --policies choose the Atari part's runs."
    p.add_argument("--train-envs", default=",".join(TRAIN_ENVS), help=f"PPO's envs (default {','.join(TRAIN_ENVS)}; none: '')")
    p.add_argument("--train-systems", default=",".join(TRAIN_SYSTEMS), help=f"PPO's systems (default {','.join(TRAIN_SYSTEMS)})")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="PPO's seeds (default 1,2,3; --quick: 1)")
    p.add_argument("--total-timesteps", type=int, help="PPO's budget per run (default CleanRL's 500000; --quick: 2048)")
    p.add_argument("--full-budget", action="store_true", help="PPO runs go on past their threshold to the whole budget")
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    p.set_defaults(envs="pong-8" if quick else ",".join(ta.ENVS), passes=1)
    raw = p.parse_args(argv)
    seeds_given = raw.seeds != ",".join(map(str, SEEDS))
    a = collect.sweep_args(p, raw, ta.SYSTEMS, ta.ENVS, ta.POLICIES)
    a.train_envs = _names(p, "--train-envs", a.train_envs, TRAIN_ENVS)
    a.train_systems = _names(p, "--train-systems", a.train_systems, TRAIN_SYSTEMS)
    a.seeds = [int(s) for s in a.seeds.split(",") if s] if (seeds_given or not a.quick) else [1]
    a.total_timesteps = a.total_timesteps or (QUICK_STEPS if a.quick else ppo_cleanrl.Args().total_timesteps)
    a.frames_per_batch = ATARI_FPB
    return a


VERSIONS = ("torch", "gymnasium", "ale-py", "envpool", "opencv-python-headless", "pufferlib-core", "psutil")


def config(a: argparse.Namespace, preload: list[str] | None) -> dict[str, Any]:
    defaults = ppo_cleanrl.Args()
    return {
        "quick": a.quick, "versions": {m: machine._version(m) for m in VERSIONS},
        "start_method": mp.get_start_method(allow_none=True) or "default", "forkserver_preload": preload,
        "torch_threads_per_process": 1,
        # part 1
        "train_envs": a.train_envs, "train_systems": a.train_systems, "seeds": a.seeds,
        "train_labels": {s: v[0] for s, v in TRAIN_SYSTEMS.items()}, "total_timesteps": a.total_timesteps,
        "full_budget": a.full_budget, "return_window": ppo_cleanrl.RETURN_WINDOW,
        "ppo": {k: getattr(defaults, k) for k in ("num_envs", "num_steps", "learning_rate", "anneal_lr", "gamma", "gae_lambda",
                                                  "num_minibatches", "update_epochs", "norm_adv", "clip_coef", "clip_vloss",
                                                  "ent_coef", "vf_coef", "max_grad_norm", "target_kl", "num_actors")},
        # part 2 (the names benchmarks.collect's sweep and report read)
        "envs": a.envs, "policies": a.policies, "systems": a.systems, "passes": a.passes, "windows": a.windows,
        "window_s": a.window_s, "warmup_s": a.warmup_s, "frames_per_batch": a.frames_per_batch,
        "env_desc": ta.ENVS, "policy_desc": ta.POLICIES, "atari_settings": ta.SETTINGS, "floor": ta.FLOOR,
        "variants": {s: ta.SYSTEMS[s].VARIANTS for s in ta.SYSTEMS}, "labels": {s: ta.SYSTEMS[s].LABEL for s in ta.SYSTEMS},
    }


def write(res: dict[str, Any], stem: str, draw: bool) -> None:
    res["paths"] = {"json": stem + ".json", "md": stem + ".md"}
    if draw and report.plot(res, stem + ".png"):
        res["paths"]["png"] = stem + ".png"
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report.tables(res))


def main(argv: list[str] | None = None, *, preload: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        report.summarize(res)
        write(res, a.render.removesuffix(".json"), not a.no_plot)
        print(report.tables(res))
        return res
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine.info(), "train_runs": [],
                           "runs": [], "skipped": {}}
    res["machine_line"] = machine.line(res["machine"])
    res["config"] = config(a, preload)
    t0 = time.perf_counter()
    try:
        if a.train_envs and a.train_systems:
            train_part(a, res)
        res["train_seconds"] = time.perf_counter() - t0
        atari_part(a, res)
    finally:
        torch.set_num_threads(threads_before)
    res["seconds"] = time.perf_counter() - t0
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    report.summarize(res)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{res['date']}-{socket.gethostname()}-train{'-quick' if a.quick else ''}")
    write(res, stem, not a.no_plot)
    print(report.tables(res))
    print(f"results: {stem}.json / .md" + (" / .png" if "png" in res["paths"] else ""), file=sys.stderr)
    return res


PRELOAD = ["torch", "gymnasium", "numpy", "ppo_cleanrl", "benchmarks.train_atari", "workers"]


def cli() -> None:
    """``python -m benchmarks.train``: the actors and env processes fork from one forkserver that has the heavy imports
    done (set here, not in :func:`main`: the start method and the forkserver's preload are process-wide)."""
    preload = PRELOAD + [m for m in ("ale_py", "cv2") if importlib.util.find_spec(m)]
    mp.set_start_method("forkserver")
    mp.set_forkserver_preload(preload)
    main(preload=preload)


if __name__ == "__main__":
    cli()
