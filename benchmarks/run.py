"""The benchmark sweep: ``python benchmarks/run.py [--quick] [--out DIR]`` (also ``shmbuf bench``, ``make bench``).

Runs shmbuf (zero-copy and gathered batches), echo's TCP transport (its defaults and one drainer with one
TCP thread), faster_fifo and multiprocessing.Queue on the same payloads in one run, and writes
``<out>/<date>-<host>.json`` (every raw figure), ``.md`` (the tables, and the targets: shmbuf against
echo's better configuration, faster_fifo and multiprocessing.Queue) and ``.png`` (the plot).
See benchmarks/README.md for what is measured and how.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script from anywhere: make `benchmarks` and `shmbuf` importable
    sys.path.insert(0, _ROOT)

# Every transport and step configuration runs with TARGET_ACTORS actors (the targets' configuration); the scaling
# row adds SCALING_ACTORS for the SCALING_PAYLOADS in transport mode. 78 runs of ~12-14 s: ~18 minutes on 2 cores.
FULL = {"actors": (2,), "scaling_actors": (1, 2, 4, 8), "windows": 5, "window_s": 2.0, "warmup_s": 1.5,
        "micro_windows": 5, "micro_window_s": 0.5, "copy_s": 1.0}
QUICK = {"actors": (2,), "scaling_actors": (), "windows": 3, "window_s": 0.25, "warmup_s": 0.25, "micro_windows": 3,
         "micro_window_s": 0.1, "copy_s": 0.2}
TARGET_ACTORS = 2
SCALING_PAYLOADS = ("small", "atari")
BATCH = 16
# Rollouts in flight: shmbuf slots, mp.Queue maxsize, faster_fifo byte budget. Three batches, as echo's Server
# holds by default (num_buffers=3): the learner holds one batch while the actors fill the other two.
DEPTH = 3 * BATCH
PACE_RATE = 200.0  # rollouts/s, all actors together, in the paced latency runs
LATENCY_ACTORS = 2
STALL_S = 10.0
MODES = ("transport", "step", "latency")


def _csv(kind: Any) -> Any:
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def parse_args(argv: list[str] | None, prog: str = "benchmarks/run.py") -> argparse.Namespace:
    """The sweep's options; ``prog`` is the name its usage and errors give (``shmbuf bench`` from the command line)."""
    from benchmarks import payloads, transports

    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("--quick", action="store_true", help="CI-sized: 2 actors only, short windows (about 2 minutes)")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"),
                   help="where to write the results (default: benchmarks/results/)")
    p.add_argument("--systems", type=_csv(str), default=transports.SYSTEMS, help="subset, comma-separated")
    p.add_argument("--payloads", type=_csv(str), default=payloads.NAMES, help="subset, comma-separated")
    p.add_argument("--modes", type=_csv(str), default=MODES, help="subset of transport,step,latency")
    p.add_argument("--actors", type=_csv(int), default=None,
                   help=f"actor counts of every transport and step run (default {TARGET_ACTORS}); given alone, it also "
                        "replaces the scaling row")
    p.add_argument("--scaling-actors", type=_csv(int), default=None,
                   help="the scaling row's actor counts, transport mode (default 1,2,4,8; quick: none)")
    p.add_argument("--scaling-payloads", type=_csv(str), default=SCALING_PAYLOADS,
                   help=f"payloads of the scaling row (default {','.join(SCALING_PAYLOADS)})")
    p.add_argument("--windows", type=int, default=None, help="measured windows per run")
    p.add_argument("--window-s", type=float, default=None, help="seconds per window")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up seconds, dropped")
    p.add_argument("--stall-s", type=float, default=STALL_S, help="no batch for this long: the run is stalled")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--render", metavar="JSON", help="only rewrite the .md and .png of a results file (no run)")
    a = p.parse_args(argv)
    for name, allowed in (("systems", transports.SYSTEMS), ("payloads", payloads.NAMES), ("modes", MODES),
                          ("scaling_payloads", payloads.NAMES)):
        bad = [x for x in getattr(a, name) if x not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: unknown {bad}; expected a subset of {','.join(allowed)}")
    base = QUICK if a.quick else FULL
    if a.scaling_actors is None:  # --actors alone narrows everything to those counts
        a.scaling_actors = () if a.actors is not None else base["scaling_actors"]
    for k in ("actors", "windows", "window_s", "warmup_s"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    a.micro_windows, a.micro_window_s, a.copy_s = base["micro_windows"], base["micro_window_s"], base["copy_s"]
    return a


def actor_counts(a: argparse.Namespace, mode: str, payload: str) -> tuple[int, ...]:
    """The actor counts one (mode, payload) runs with: the scaling row's for its payloads in transport mode."""
    if mode == "latency":
        return (LATENCY_ACTORS,)
    if mode == "transport" and payload in a.scaling_payloads and a.scaling_actors:
        return tuple(sorted(set(a.scaling_actors) | set(a.actors)))
    return tuple(a.actors)


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the sweep. Systems are interleaved inside each configuration, so that a drift
    in the machine's load hits them alike."""
    from benchmarks import transports

    only = {"step": transports.STEP_SYSTEMS, "latency": transports.LATENCY_SYSTEMS}
    runs = []
    for mode in a.modes:
        systems = [s for s in a.systems if s in only.get(mode, transports.SYSTEMS)]
        for payload in a.payloads:
            for n in actor_counts(a, mode, payload):
                for s in systems:
                    runs.append({
                        "system": s, "payload": payload, "mode": mode, "actors": n,
                        "batch": 1 if mode == "latency" else BATCH,
                        "pace_s": n / PACE_RATE if mode == "latency" else 0.0,
                    })
    return runs


def estimate_s(a: argparse.Namespace, runs: list[dict[str, Any]]) -> float:
    """Wall time of a sweep: each run's warm-up and windows, plus start-up and shutdown (0.8 s, and 0.3 s per actor
    to spawn: the 2026-11-21 sweep's per-run wall times, and 8-actor runs on a busy machine, rounded up), plus the
    microbench and the copy measurements."""
    per_run = sum(a.warmup_s + a.windows * a.window_s + 0.8 + 0.3 * r["actors"] for r in runs)
    micro = 4 * 2 * a.micro_windows * a.micro_window_s + 3.0 if "step" in a.modes else 0.0
    return per_run + micro + 4 * 2 * a.copy_s


def _microbench(a: argparse.Namespace) -> dict[str, Any] | None:
    """Writer.add vs TrajectoryAccumulator.add, in a child process of its own."""
    import multiprocessing as mp

    from benchmarks import microbench

    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=microbench.child, args=(tx, "small", a.micro_windows, a.micro_window_s), daemon=True)
    p.start()
    tx.close()
    try:
        if rx.poll(120.0):
            return json.loads(rx.recv_bytes())
        return None
    except EOFError:
        return None
    finally:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()
        rx.close()


def render(path: str, plot: bool = True) -> dict[str, Any]:
    """Rewrite the table page and the plot of a results file from its raw records (nothing is re-measured)."""
    from benchmarks import report

    with open(path) as f:
        result = json.load(f)
    result["summaries"] = [report.summarize(r) for r in result["runs"]]
    result["stalls"] = [s for s in result["summaries"] if s["status"] != "ok"]
    result["targets"] = report.targets(result["summaries"], result["microbench"], result["copy_bandwidth"],
                                       result["stalls"], cores=result["machine"]["cores_usable"],
                                       payload_bytes=result["payload_bytes"])
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    _write_page(result, path[: -len(".json")], plot)
    return result


def _write_page(result: dict[str, Any], stem: str, plot: bool) -> None:
    from benchmarks import report

    md = report.markdown(result)
    if plot:
        report.plot(result, stem + ".png")
        md += f"\n![rollouts/s and MB/s]({os.path.basename(stem)}.png)\n"
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {stem}.json, .md{'' if not plot else ', .png'}")


# What each part of a sweep imports, and the package that provides it (all in the `bench` extra).
_NEEDS = {"echo": ("echo", "id-echo"), "echo1": ("echo", "id-echo"), "faster_fifo": ("faster_fifo", "faster-fifo")}


def _require_extras(a: argparse.Namespace) -> None:
    """Stop at once, saying what to install, rather than fail mid-sweep when the bench extra is missing."""
    import importlib.util

    needed = list(dict.fromkeys(_NEEDS[s] for s in a.systems if s in _NEEDS)) + [("tqdm", "tqdm")]
    if not a.no_plot:
        needed.append(("matplotlib", "matplotlib"))
    missing = [pkg for mod, pkg in needed if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit(
            f"the benchmark needs {', '.join(missing)} (the `bench` extra): run `make bench`, which installs it, "
            "or `pip install -e '.[bench]'`; or leave those systems out with --systems"
        )


def main(argv: list[str] | None = None, prog: str = "benchmarks/run.py") -> dict[str, Any]:
    from tqdm import tqdm

    from benchmarks import harness, machine, payloads, report

    a = parse_args(argv, prog)
    if a.render:
        return render(a.render, plot=not a.no_plot)
    _require_extras(a)
    runs = plan(a)
    m = machine.info()
    print(f"machine: {machine.line(m)}", flush=True)
    print(f"{len(runs)} runs, about {estimate_s(a, runs) / 60:.1f} minutes", flush=True)
    bw_bytes = payloads.nbytes("atari")
    copy_start = {"rollout": machine.copy_bandwidth(bw_bytes, a.copy_s), "dram": machine.copy_bandwidth(128 << 20, a.copy_s)}
    t0 = time.monotonic()
    records, summaries = [], []
    bar = tqdm(runs, desc="bench", unit="run", dynamic_ncols=True)
    for r in bar:
        bar.set_postfix_str(f"{r['system']} {r['payload']} {r['mode']} x{r['actors']}")
        rec = harness.run_one(r["system"], r["payload"], r["mode"], r["actors"], batch=r["batch"], depth=DEPTH,
                              windows=a.windows, window_s=a.window_s, warmup_s=a.warmup_s, stall_s=a.stall_s,
                              pace_s=r["pace_s"])
        records.append(rec)
        s = report.summarize(rec)
        summaries.append(s)
        if s["status"] != "ok":
            bar.write(f"  {r['system']} {r['payload']} {r['mode']} x{r['actors']}: {s['status']} ({s.get('detail')})")
    bar.close()
    echo_in = any(s in a.systems for s in ("echo", "echo1"))
    micro = _microbench(a) if "step" in a.modes and "shmbuf" in a.systems and echo_in else None
    copy_end = {"rollout": machine.copy_bandwidth(bw_bytes, a.copy_s), "dram": machine.copy_bandwidth(128 << 20, a.copy_s)}
    m["loadavg_end"] = list(os.getloadavg())
    copy_bw = {k: (copy_start[k]["gb_s"] + copy_end[k]["gb_s"]) / 2 for k in ("rollout", "dram")}
    stalls = [s for s in summaries if s["status"] != "ok"]
    date = datetime.date.today().isoformat()
    result = {
        "date": date,
        "machine": m,
        "machine_line": machine.line(m),
        "config": {"systems": list(a.systems), "payloads": list(a.payloads), "modes": list(a.modes),
                   "actors": list(a.actors), "scaling_actors": list(a.scaling_actors),
                   "scaling_payloads": list(a.scaling_payloads), "target_actors": TARGET_ACTORS, "batch": BATCH,
                   "depth": DEPTH, "windows": a.windows, "window_s": a.window_s,
                   "warmup_s": a.warmup_s, "stall_s": a.stall_s, "pace_rate": PACE_RATE, "latency_actors": LATENCY_ACTORS,
                   "quick": a.quick},
        "payload_bytes": {p: payloads.nbytes(p) for p in payloads.NAMES},
        "copy_bandwidth": copy_bw,
        "copy_bandwidth_detail": {"start": copy_start, "end": copy_end},
        "microbench": micro,
        "summaries": summaries,
        "stalls": stalls,
        "sweep_s": round(time.monotonic() - t0, 1),
        "estimate_s": round(estimate_s(a, runs), 1),
        "runs": records,
    }
    result["targets"] = report.targets(summaries, micro, copy_bw, stalls, cores=m["cores_usable"],
                                       payload_bytes=result["payload_bytes"])
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{date}-{m['host']}{'-quick' if a.quick else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    _write_page(result, stem, plot=not a.no_plot)
    print(f"sweep: {result['sweep_s']} s")
    result["paths"] = {"json": stem + ".json", "md": stem + ".md", "png": None if a.no_plot else stem + ".png"}
    return result


if __name__ == "__main__":
    main()
