"""Multi-core collection benchmark: frames/s and CPU per frame of every way to collect from 16 envs on this machine.

One command, from the repository root (torchrl installs a top-level ``benchmarks`` package of its own, which
shadows this one anywhere else)::

    python -m benchmarks.collect [--quick] [--out DIR] [--systems ...] [--envs ...] [--policies ...]
    make bench-collect

writes ``<out>/<date>-<host>-collect[-quick].{json,md,png}``: every window of every run of every configuration, the
machine, the settings (``.json``); the tables, the ratios and the aims, each with its measured figure
(``.md``); the plot (``.png``). ``--render FILE.json`` rewrites the ``.md`` and ``.png`` of a results file.

Systems (``benchmarks/collect_systems.py``), 16 envs in each; envs and policies in ``benchmarks/collect_envs.py``:

1. ``floor_vec``: one process, gymnasium ``SyncVectorEnv(16)``, the policy, each transition stored into numpy arrays
   (the floor to beat); ``floor_hand``: one process stepping 16 plain envs in a Python loop, each next observation
   written into the store (the loop shmbuf's actors could run over sub-envs directly). Every ratio is given
   against both.
2. ``gym_async``: gymnasium ``AsyncVectorEnv(16, shared_memory=True)``, the same policy and store.
3. ``puffer``: PufferLib 3 (``pufferlib-core``): ``vector.Serial`` and ``vector.Multiprocessing`` with 1 and 2 workers.
4. ``torchrl_multisync``: TorchRL's ``MultiSyncCollector``, 2 workers x ``SerialEnv(8)`` or 16 x 1.
5. ``collector``: ``workers.Collector``, 2 actors x ``SyncVectorEnv(8)`` or 1 x 16.
6. ``async_batched``: ``workers.AsyncBatchedCollector``, 2 or 4 env processes with vector envs, or 16 x 1.

Every configuration of every system is measured; the fastest of each system is its row (all are in the json and in
the .md's last table). ``mlp512`` (CartPole) is the AsyncBatchedCollector-against-Collector case: only the floors and
those two run with it.

How each figure is taken, the same way for every system:

- **frames/s at delivery**: the benchmark's own thread iterates the system (a one-process loop yields after each
  rollout of 64 steps x 16 envs it stored; a collector at each batch of 1024 frames) and notes the time and the real
  transitions delivered. No wrapper sits inside the envs, so the floor is the plain loop. After ``--warmup-s``
  (dropped; start-up too), ``--windows`` windows of at least ``--window-s`` seconds, each cut at a delivery (so each
  holds whole deliveries, and its rate is frames over its own length); the figure is the median window.
- **CPU per frame**: this process's CPU (the learner: the loop itself for the one-process systems, the batch
  consumer and, for AsyncBatchedCollector, the inference server) and each child process's (actors, env workers),
  from ``/proc``, between the first and last window edges, divided by the frames/s; and the machine's busy time from
  ``/proc/stat``, whose part not in the run is the outside load (the machine is shared).
- **alternation**: ``--passes`` passes over the plan; in each, for each env and policy, the systems one after the
  other (every other pass in reverse order). The first pass runs every configuration, the later ones each system's
  two fastest of the first pass again; a configuration's windows are pooled over its passes before the median, and
  a system's row is its fastest configuration among those measured in every pass.

Torch runs on one thread in every process and every thread that calls it (benchmarks/inference.py says why); the
process pools start from the standard library's forkserver with torch, gymnasium and torchrl preloaded (set in
:func:`cli`; PufferLib and gymnasium take the default context too), so that start-up stays short; it is not measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from benchmarks import collect_envs as ce
from benchmarks import collect_report as report
from benchmarks import machine
from benchmarks.collect_systems import FLOORS, SYSTEMS
from benchmarks.inference import cpu_between, cpu_sample, descendants, reap_new

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMES_PER_BATCH = 1024
LARGE_POLICY = "mlp512"  # only the floors and shmbuf's two collectors run with it, on CartPole
LARGE_SYSTEMS = ("floor_vec", "floor_hand", "collector", "async_batched")
AGAIN = 2  # configurations of each system measured again in every later pass: the first pass's fastest two
# Seconds a run takes besides its windows (start-up, first delivery, shutdown), for the estimate printed at the start.
OVERHEAD_S = {"floor_vec": 0.5, "floor_hand": 0.5, "gym_async": 2.5, "puffer": 2.0, "torchrl_multisync": 6.0,
              "collector": 2.5, "async_batched": 3.0}


# ------------------------------------------------------------------ one run


def _windows(arrivals: list[tuple[int, int]], start: int, windows: int, window_ns: int) -> tuple[list[int], list[float]]:
    """Window edges (indices into ``arrivals``) from arrival ``start``: each window ends at the first arrival at least
    ``window_ns`` after it began; and each window's frames/s (the frames delivered after its first edge, up to and
    including its last, over its length)."""
    edges, rates = [start], []
    i = start
    for _ in range(windows):
        t0, frames = arrivals[i][0], 0
        j = i + 1
        while j < len(arrivals) and arrivals[j][0] - t0 < window_ns:
            frames += arrivals[j][1]
            j += 1
        if j == len(arrivals):
            break
        frames += arrivals[j][1]
        rates.append(frames / ((arrivals[j][0] - t0) / 1e9))
        edges.append(j)
        i = j
    return edges, rates


def _per_child(a: dict[str, Any], b: dict[str, Any]) -> list[float]:
    """Cores busy in each child process present at both samples, busiest first."""
    dt = b["t"] - a["t"]
    out = [(sum(u[:2]) - sum(a["children"][p][:2])) / dt for p, u in b["children"].items() if p in a["children"]]
    return sorted((round(x, 4) for x in out), reverse=True)


def run_one(system: str, variant: str, env: str, policy: str, a: argparse.Namespace, *,
            systems: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start one system, let it warm up, measure ``a.windows`` windows at its deliveries, stop it.

    ``systems``: where ``system`` is looked up (default this benchmark's; benchmarks/multiagent.py passes its own)."""
    cls = (systems or SYSTEMS)[system]
    rec: dict[str, Any] = {"system": system, "label": cls.LABEL, "variant": variant, "variant_desc": cls.VARIANTS[variant],
                           "env": env, "policy": policy, "status": "ok", "loadavg_before": list(os.getloadavg())}
    before = set(descendants())
    arrivals: list[tuple[int, int]] = []
    stalled = threading.Event()
    finished = threading.Event()

    main_thread = threading.get_ident()

    def watchdog() -> None:
        # A run that delivers nothing for stall_s is interrupted: SIGINT to the main thread (which ends a blocking wait
        # there too) raises KeyboardInterrupt in it, and the run is recorded as stalled.
        while not finished.wait(min(1.0, a.stall_s / 4)):
            last = arrivals[-1][0] if arrivals else t_start
            if time.monotonic_ns() - last > a.stall_s * 1e9:
                stalled.set()
                signal.pthread_kill(main_thread, signal.SIGINT)
                return

    run = None
    it = None
    t_start = time.monotonic_ns()
    dog = threading.Thread(target=watchdog, name="bench-watchdog", daemon=True)
    dog.start()
    try:
        run = cls(env, policy, variant, a.frames_per_batch)
        it = iter(run.batches())
        warm_end = None
        cpu: list[dict[str, Any]] = []
        window_ns = int(a.window_s * 1e9)
        start = None
        for frames in it:
            now = time.monotonic_ns()
            arrivals.append((now, frames))
            if warm_end is None:
                rec["startup_s"] = (now - t_start) / 1e9
                warm_end = now + int(a.warmup_s * 1e9)
            elif start is None:
                if now >= warm_end and not cpu:
                    cpu.append(cpu_sample())  # its cost falls before the first window: that starts at the next delivery
                elif cpu:
                    start = len(arrivals) - 1
                    target = now + a.windows * window_ns
            elif now >= target:
                edges, rates = _windows(arrivals, start, a.windows, window_ns)
                if len(rates) == a.windows:
                    cpu.append(cpu_sample())
                    break
        else:
            raise RuntimeError("the system stopped delivering")
        rec["windows"] = rates
        rec["window_s"] = [(arrivals[j][0] - arrivals[i][0]) / 1e9 for i, j in zip(edges, edges[1:])]
        rec["deliveries"] = edges[-1] - edges[0]
        rec["cpu_cores"] = cpu_between(*cpu)
        rec["cpu_cores"]["per_child"] = _per_child(*cpu)
    except KeyboardInterrupt:
        if not stalled.is_set():
            raise
        rec["status"], rec["error"] = "stalled", f"no delivery for {a.stall_s} s"
    except Exception as exc:  # noqa: BLE001  # a failed run is recorded and the sweep goes on
        rec["status"], rec["error"] = "failed", f"{type(exc).__name__}: {exc}"[-3000:]
    finally:
        finished.set()
        try:
            if it is not None and hasattr(it, "close"):
                it.close()
            if run is not None:
                run.close()
        except Exception as exc:  # noqa: BLE001  # recorded; what is left of the run is killed below
            rec.setdefault("error", f"shutdown: {exc!r}"[-3000:])
        rec["killed_pids"] = reap_new(before)
        rec["seconds"] = (time.monotonic_ns() - t_start) / 1e9
    return rec


# ------------------------------------------------------------------ the sweep


def combos(a: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(env, policy, systems) in the order measured."""
    out = []
    for env in a.envs:
        for pol in a.policies:
            if pol == LARGE_POLICY:
                if env != "cartpole":
                    continue
                systems = [s for s in a.systems if s in LARGE_SYSTEMS]
            else:
                systems = list(a.systems)
            if systems:
                out.append((env, pol, systems))
    return out


def variants(system: str, a: argparse.Namespace, systems: dict[str, Any] | None = None) -> list[str]:
    names = list((systems or SYSTEMS)[system].VARIANTS)
    if a.variants.get(system):
        return [v for v in names if v in a.variants[system]]
    return names[:1] if a.quick else names


def plan(a: argparse.Namespace, systems: dict[str, Any] | None = None) -> list[tuple[int, str, str, str, str | int]]:
    """(pass, env, policy, system, variant) in the order run; in the later passes the variant is a rank: the system's
    configurations of the first pass, fastest first, of which the first :data:`AGAIN` run again. ``systems``: as
    :func:`run_one`'s."""
    out: list[tuple[int, str, str, str, str | int]] = []
    for p in range(a.passes):
        for env, pol, names in combos(a):
            order = names if p % 2 == 0 else names[::-1]
            for s in order:
                vs = variants(s, a, systems)
                out += [(p, env, pol, s, v) for v in vs] if p == 0 else [(p, env, pol, s, k) for k in range(min(AGAIN, len(vs)))]
    return out


def estimate_s(steps: list[tuple[int, str, str, str, str | int]], a: argparse.Namespace,
               overhead_s: dict[str, float] | None = None) -> float:
    per_run = a.warmup_s + a.windows * a.window_s * 1.1
    return sum(per_run + (overhead_s or OVERHEAD_S)[s] for _, _, _, s, _ in steps)


def sweep(a: argparse.Namespace, res: dict[str, Any], *, systems: dict[str, Any] | None = None,
          overhead_s: dict[str, float] | None = None, line: Any = None, name: str = "collect bench") -> None:
    """Run the plan, appending each run's record to ``res["runs"]``. ``systems``, ``overhead_s`` (seconds each run takes
    besides its windows), ``line`` (one run's progress line) and ``name``: another benchmark's own (default this one's:
    benchmarks/multiagent.py passes its own)."""
    from tqdm.auto import tqdm

    steps = plan(a, systems)
    est = estimate_s(steps, a, overhead_s)
    print(f"{name}: {len(steps)} runs, about {est / 60:.1f} minutes "
          f"({len(combos(a))} env x policy, {a.passes} pass(es))", file=sys.stderr, flush=True)
    bar = tqdm(total=len(steps), unit="run", desc=name, dynamic_ncols=True)
    try:
        for p, env, pol, s, v in steps:
            if isinstance(v, int):  # a later pass: the first pass's v-th fastest configuration
                ranked = report.ranked_variants([r for r in res["runs"] if r["pass"] == 0], env, pol, s)
                if v >= len(ranked):
                    bar.update(1)
                    continue
                v = ranked[v]
            bar.set_postfix_str(f"{env} {pol} {s} [{v}]")
            r = run_one(s, v, env, pol, a, systems=systems)
            r["pass"] = p
            res["runs"].append(r)
            bar.update(1)
            bar.write((line or report.line)(r))
    finally:
        bar.close()


# ------------------------------------------------------------------ main


def available(system: str) -> str | None:
    """None if ``system`` can run here, else why not."""
    for mod in SYSTEMS[system].IMPORTS:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return None


def sweep_parser(prog: str, doc: str, systems: dict[str, Any], envs: dict[str, Any], policies: dict[str, Any], *,
                 window_s: float, warmup_s: float, stall_s: float) -> argparse.ArgumentParser:
    """The command line a sweep of ``systems`` x ``envs`` x ``policies`` takes (this bench's, and the multi-agent one's):
    the defaults for a window, the warm-up and a stall are each bench's own. :func:`sweep_args` reads it."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="each system's first configuration, one pass, short windows (a fast look; the test)")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"), help="where to write the results")
    p.add_argument("--systems", default=",".join(systems), help=f"systems (default all: {','.join(systems)})")
    p.add_argument("--variants", default="",
                   help="configurations to run, as system:variant,... (default: all; --quick: each system's first)")
    p.add_argument("--envs", default=",".join(envs), help=f"envs (default {','.join(envs)})")
    p.add_argument("--policies", default=",".join(policies), help=f"policies (default {','.join(policies)})")
    p.add_argument("--passes", type=int, help="passes over the plan (default 2, quick 1)")
    p.add_argument("--windows", type=int, help="timed windows per run (default 3, quick 2)")
    p.add_argument("--window-s", type=float, help=f"seconds per window, at least (default {window_s}, quick 0.3)")
    p.add_argument("--warmup-s", type=float,
                   help=f"warm-up seconds from the first delivery, dropped (default {warmup_s}, quick 0.3)")
    p.add_argument("--stall-s", type=float, default=stall_s, help="a run that delivers nothing for this long is stopped")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--render", metavar="FILE.json", help="rewrite the .md and .png of a results file; measure nothing")
    p.set_defaults(window_default=window_s, warmup_default=warmup_s)
    return p


def sweep_args(p: argparse.ArgumentParser, a: argparse.Namespace, systems: dict[str, Any], envs: dict[str, Any],
               policies: dict[str, Any]) -> argparse.Namespace:
    """``a`` from :func:`sweep_parser`, its lists split, the --quick defaults applied, every name checked (an unknown
    one is a usage error naming the known ones); ``a.variants`` becomes ``{system: [variant, ...]}``."""
    q = a.quick
    a.systems = [s for s in a.systems.split(",") if s]
    a.envs = [e for e in a.envs.split(",") if e]
    a.policies = [x for x in a.policies.split(",") if x]
    a.passes = a.passes or (1 if q else 2)
    a.windows = a.windows or (2 if q else 3)
    a.window_s = a.window_s or (0.3 if q else a.window_default)
    a.warmup_s = a.warmup_s if a.warmup_s is not None else (0.3 if q else a.warmup_default)
    for what, got, known in (("--systems", a.systems, systems), ("--envs", a.envs, envs), ("--policies", a.policies, policies)):
        bad = [x for x in got if x not in known]
        if bad:
            p.error(f"{what}: unknown {bad}; choose from {list(known)}")
    wanted: dict[str, list[str]] = {}
    for item in (x for x in a.variants.split(",") if x):
        s, _, v = item.partition(":")
        if s not in systems or v not in systems[s].VARIANTS:
            known_v = ",".join(f"{k}:{v}" for k, c in systems.items() for v in c.VARIANTS)
            p.error(f"--variants: unknown {item!r}; choose from {known_v}")
        wanted.setdefault(s, []).append(v)
    a.variants = wanted
    return a


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = sweep_parser("python -m benchmarks.collect", __doc__, SYSTEMS, ce.ENVS, ce.POLICIES, window_s=1.0, warmup_s=1.0,
                     stall_s=60.0)
    p.add_argument("--frames-per-batch", type=int, default=FRAMES_PER_BATCH,
                   help=f"frames per delivery: collectors' batches, one-process loops' rollouts (default {FRAMES_PER_BATCH})")
    a = sweep_args(p, p.parse_args(argv), SYSTEMS, ce.ENVS, ce.POLICIES)
    if a.frames_per_batch % (16 * 16):
        p.error(f"--frames-per-batch: expected a multiple of 256 (16 envs x 16 steps), got {a.frames_per_batch}")
    return a


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
        report.summarize(res)  # from the raw runs again: a file written by an older report gets today's rows and aims
        write(res, a.render.removesuffix(".json"), not a.no_plot)
        print(report.tables(res))
        return res
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine.info(), "runs": [], "skipped": {}}
    res["machine_line"] = machine.line(res["machine"])
    versions = {m: machine._version(m) for m in ("torch", "torchrl", "tensordict", "gymnasium", "pufferlib-core", "psutil")}
    res["config"] = {"quick": a.quick, "envs": a.envs, "policies": a.policies, "systems": a.systems,
                     "num_envs": 16, "frames_per_batch": a.frames_per_batch, "passes": a.passes, "windows": a.windows,
                     "window_s": a.window_s, "warmup_s": a.warmup_s, "large_policy": LARGE_POLICY,
                     "large_systems": list(LARGE_SYSTEMS), "floors": list(FLOORS), "env_desc": ce.ENVS,
                     "policy_desc": ce.POLICIES, "atari_policy_input": f"obs[:, -1, ::{ce.SUBSAMPLE}, ::{ce.SUBSAMPLE}]",
                     "torch_threads_per_process": 1, "start_method": mp.get_start_method(allow_none=True) or "default",
                     "forkserver_preload": preload, "versions": versions,
                     "variants": {s: SYSTEMS[s].VARIANTS for s in SYSTEMS}, "labels": {s: SYSTEMS[s].LABEL for s in SYSTEMS}}
    for s in list(a.systems):
        why = available(s)
        if why is not None:
            res["skipped"][s] = why
            a.systems.remove(s)
            print(f"{SYSTEMS[s].LABEL} is not measured: {why}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        sweep(a, res)
    finally:
        torch.set_num_threads(threads_before)
    res["seconds"] = time.perf_counter() - t0
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    report.summarize(res)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{res['date']}-{socket.gethostname()}-collect{'-quick' if a.quick else ''}")
    write(res, stem, not a.no_plot)
    print(report.tables(res))
    print(f"results: {stem}.json / .md" + (" / .png" if "png" in res["paths"] else ""), file=sys.stderr)
    return res


PRELOAD = ["torch", "gymnasium", "numpy", "benchmarks.collect_envs"]


def cli() -> None:
    """``python -m benchmarks.collect``: process pools fork from one forkserver that has the heavy imports done.

    Set here, not in :func:`main`: the start method and the forkserver's preload are process-wide. torchrl is
    preloaded when it is installed.
    """
    preload = PRELOAD + [m for m in ("torchrl", "torchrl.collectors", "tensordict") if importlib.util.find_spec(m.split(".")[0])]
    mp.set_start_method("forkserver")
    mp.set_forkserver_preload(preload)
    main(preload=preload)


if __name__ == "__main__":
    cli()
