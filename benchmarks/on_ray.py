"""shmbuf on Ray against plain Ray actors and against shmbuf alone: ``python -m benchmarks.on_ray [--quick] [--out DIR]``.

Run it from the repository root (torchrl installs a ``benchmarks`` namespace package that shadows
this one elsewhere), or ``make bench-ray``. In one run, on this machine, for each workload of
``benchmarks/ray_envs.py`` (the ``small`` and ``atari`` payloads of the transport benchmark as
synthetic envs, and CartPole-v1), with ``ACTORS`` actor processes in all and ``BATCH`` rollouts per
batch, it measures rollouts/s, frames/s and CPU per rollout of:

- ``shmbuf``: ``workers.Collector`` alone, no Ray running ((c) in the tables);
- ``shmbuf_ray``: ``workers.RayCollector`` on a local one-node Ray cluster ((a) in the tables), in its default
  configuration: the learner's own node collected in the learner's process (``local_node=True``);
- ``shmbuf_ray_hop``: the same with ``local_node=False``: the node behind a node owner actor, each batch one
  Ray object through the object store, as every node other than the learner's is;
- ``ray_actors``: what a Ray user writes today ((b) in the tables): ``ACTORS`` plain Ray actors
  (``ray_envs.RolloutActor``) returning rollouts, a dict of numpy arrays, from a remote method; the
  learner keeps calls in flight on each, takes them as they finish (``ray.wait`` + ``ray.get``) and
  concatenates ``BATCH`` rollouts into a batch. Measured at 1 and ``BATCH / ACTORS`` rollouts per
  call, 2 and 4 calls in flight per actor; the best is every ratio's denominator, and is named;
- ``shmbuf_ray_2node`` and ``ray_actors_2node`` (the latter in the best one-node configuration):
  the same on a local two-node cluster (``ray.cluster_utils.Cluster``, one CPU each, one actor per node).

Every learner sums each batch's rewards (it reads the batch). Start-up (Ray's, the pipeline's, the
actors') is never counted: the clock starts after the first batch and a warm-up. Per window: rollouts
and frames taken, the machine's busy time (``/proc/stat``: every jiffy not idle or iowait, all
processes, ours and anyone else's), the run's own (every process below this one: Ray's daemons and
workers, the owners, the actors; the machine's less this is other people's load) and the learner
process's own CPU time (``time.process_time()``, every thread, Ray's included), each divided by the
rollouts. Figures are medians over every window of
every repeat. Writes ``<out>/<date>-<host>-ray[-quick].{json,md,png}``; see benchmarks/README.md ("Ray").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: make `benchmarks`, `shmbuf` and `workers` importable (and Ray's workers see it)
    sys.path.insert(0, _ROOT)

from benchmarks.ray_report import SYSTEMS, best_peer, build, summarize, write  # noqa: E402  # after the sys.path line above
from shmbuf._proc import CLOCK_TICKS, cpu_ticks, machine_ticks, stat_fields  # noqa: E402  # after the sys.path line above

ACTORS = 2  # actor processes in all (the machine measured has 2 cores)
BATCH = 16  # rollouts per batch
FULL = {"workloads": ("small", "atari", "cartpole"), "repeats": 3, "windows": 3, "window_s": 2.0, "warmup_s": 1.5,
        "per_call": (1, BATCH // ACTORS), "in_flight": (2, 4), "loop_rollouts": 40}
QUICK = {"workloads": ("small", "cartpole"), "repeats": 1, "windows": 2, "window_s": 0.4, "warmup_s": 0.3,
         "per_call": (1, BATCH // ACTORS), "in_flight": (2,), "loop_rollouts": 8}
STALL_S = 30.0
IDLE_S = 1.0  # after a cluster starts: how much CPU its processes take doing nothing
# Wall time for the estimate: a run's start-up, first batch and shutdown, and a cluster's start and stop (quick runs on
# the busy 2-core machine, 2026-11-21, rounded up).
START_S = {"shmbuf": 1.5, "shmbuf_ray": 2.0, "shmbuf_ray_hop": 2.0, "ray_actors": 1.2, "shmbuf_ray_2node": 2.7,
           "ray_actors_2node": 1.6}
CLUSTER_S = {1: 8.0, 2: 7.0}
STEP_KEYS = ("obs", "action", "reward", "terminated", "truncated", "bootstrap_obs", "episode_returns")


class Stalled(Exception):
    """No batch for ``--stall-s`` seconds."""


# -- what a window records ---------------------------------------------------------------------------------------------


def _ours_jiffies() -> int:
    """CPU jiffies (user + system) so far of this process and every live one below it: the run's own share of the
    machine (Ray's daemons and workers, node owners, actor processes); a process that exits takes its count along."""
    return sum(cpu_ticks(pid) for pid in descendants() | {os.getpid()})


def _cut(rollouts: int, frames: int) -> dict[str, Any]:
    busy, total = machine_ticks()  # the whole machine's, busy being all but idle and iowait
    return {"t": time.monotonic(), "rollouts": rollouts, "frames": frames, "busy_jiffies": busy, "all_jiffies": total,
            "ours_jiffies": _ours_jiffies(), "learner_cpu_s": time.process_time()}


def measure(next_batch: Callable[[], tuple[int, int]], *, warmup_s: float, windows: int, window_s: float
            ) -> list[dict[str, Any]]:
    """Take batches (``next_batch() -> (rollouts, frames)``): one, then ``warmup_s`` of them, then ``windows``
    windows of ``window_s``; return the cuts at each window's edges (``windows + 1`` of them)."""
    next_batch()  # the first batch: everything has started
    end = time.monotonic() + warmup_s
    while time.monotonic() < end:
        next_batch()
    rollouts = frames = 0
    cuts = [_cut(0, 0)]
    for _ in range(windows):
        end = time.monotonic() + window_s
        while time.monotonic() < end:
            r, f = next_batch()
            rollouts += r
            frames += f
        cuts.append(_cut(rollouts, frames))
    return cuts


# -- the systems: each makes batches of BATCH rollouts and says which processes it started ------------------------------


class ShmbufSource:
    """(c) ``workers.Collector``: ``actors`` processes writing into this machine's shared memory."""

    def __init__(self, w: Any, actors: int, batch: int, stall_s: float):
        from workers import Collector

        self.c = Collector(w.make_env, w.make_policy(), num_actors=actors, timeout=stall_s, **w.collector_kwargs(batch))
        self.it = iter(self.c)

    def next_batch(self) -> tuple[int, int]:
        b = next(self.it)
        float(b.data["step"]["reward"].sum())
        return len(b.lane), int(b.frames)

    def pids(self) -> list[int]:
        return list(self.c.pool.pids)

    def close(self) -> None:
        self.c.shutdown()


class ShmbufRaySource:
    """(a) ``workers.RayCollector``: on each node an owner actor with a Collector of ``actors_per_node`` processes."""

    def __init__(self, w: Any, actors_per_node: int, nodes: list[str], batch: int, stall_s: float, local_node: bool):
        from workers import RayCollector

        self.c = RayCollector(w.make_env, w.make_policy(), nodes=nodes, actors_per_node=actors_per_node, timeout=stall_s,
                              local_node=local_node, **w.collector_kwargs(batch))
        self.it = iter(self.c)

    def next_batch(self) -> tuple[int, int]:
        b = next(self.it)
        float(b.data["step"]["reward"].sum())
        return len(b.lane), int(b.frames)

    def pids(self) -> list[int]:
        out = []
        for n in self.c.nodes:
            info = n.info or {}
            out += [info.get("pid"), info.get("janitor_pid"), *info.get("actor_pids", [])]
        return [p for p in out if p and p != os.getpid()]  # the learner's own node: its owner is this process

    def close(self) -> None:
        self.c.shutdown()


class RayActorsSource:
    """(b) ``actors`` plain Ray actors, ``per_call`` rollouts per remote call, ``in_flight`` calls outstanding on each."""

    def __init__(self, w: Any, actors: int, nodes: list[str], batch: int, stall_s: float, per_call: int, in_flight: int):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from benchmarks.ray_envs import RolloutActor

        if batch % per_call:
            raise ValueError(f"per_call: expected a divisor of the batch ({batch}), got {per_call}")
        self.ray, self.batch, self.k, self.stall_s = ray, batch, per_call, stall_s
        self.frames_per_rollout = w.frames_per_rollout()
        cls = ray.remote(RolloutActor)
        self.actors = []
        for i in range(actors):
            opts: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0}
            if len(nodes) > 1:  # one actor per node, round robin
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
            self.actors.append(cls.options(**opts).remote(w.name, i))
        ready, _ = ray.wait([a.ready.remote() for a in self.actors], num_returns=actors, timeout=120.0)
        if len(ready) < actors:
            raise TimeoutError(f"{actors - len(ready)} of {actors} Ray actors did not start within 120 s")
        self._pids = ray.get(ready)
        self.pending: dict[Any, Any] = {}
        for a in self.actors:
            for _ in range(in_flight):
                self.pending[a.rollouts.remote(per_call)] = a

    def next_batch(self) -> tuple[int, int]:
        ray = self.ray
        got = []
        while len(got) * self.k < self.batch:
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=self.stall_s)
            if not ready:
                raise Stalled(f"no rollouts from any Ray actor within {self.stall_s} s")
            actor = self.pending.pop(ready[0])
            self.pending[actor.rollouts.remote(self.k)] = actor  # keep in_flight calls on it
            got.append(ray.get(ready[0]))
        batch = {k: np.concatenate([g[k] for g in got]) for k in STEP_KEYS}  # (BATCH, T, ...): what a training step takes
        float(batch["reward"].sum())
        return self.batch, self.batch * self.frames_per_rollout

    def pids(self) -> list[int]:
        return list(self._pids)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a, no_restart=True)
        self.pending.clear()


def loop_costs(workloads: tuple[str, ...], rollouts: int) -> dict[str, dict[str, float]]:
    """Where the time goes, before any transport: µs per rollout of each actor loop alone, in this process.

    ``actor_loop``: :class:`workers.ActorLoop` (what every shmbuf actor runs) writing into a pipeline that
    this process drains between rollouts; ``peer_loop``: :class:`ray_envs.RolloutActor`'s loop filling
    numpy arrays (``rollouts(1)``). Alternated, ``rollouts`` of each; medians.
    """
    import shmbuf
    from benchmarks import ray_envs
    from shmbuf.layout import rollout_example
    from workers import ActorLoop, probe

    out = {}
    for name in workloads:
        w = ray_envs.workload(name)
        env, policy = w.make_env(), w.make_policy()
        p = probe(env, policy, 0)
        example = rollout_example(p["obs"], p["action"], rollout_len=w.rollout_len,
                                  num_envs=w.num_envs if p["vector"] else None, extras=p["extras"],
                                  max_episodes=w.max_episodes)
        reader = shmbuf.create(example, 4, max_writers=1)
        writer = peer = None
        try:
            writer = shmbuf.Writer(reader.name, timeout=10.0)
            with contextlib.suppress(shmbuf.SlotTimeout):
                reader.get(0.01)  # the reader's first look lends the writer its slots
            loop = ActorLoop(env, policy, [writer], rollout_len=w.rollout_len, max_episodes=w.max_episodes, seed=0)
            peer = ray_envs.RolloutActor(name)
            mine, theirs = [], []
            for _ in range(rollouts + 2):  # the first two of each: warm-up
                t = time.perf_counter()
                loop.run(1)
                mine.append(time.perf_counter() - t)
                reader.get(10.0).release()
                t = time.perf_counter()
                peer.rollouts(1)
                theirs.append(time.perf_counter() - t)
            one = peer.rollouts(1)
            out[name] = {"actor_loop_us": float(np.median(mine[2:])) * 1e6, "peer_loop_us": float(np.median(theirs[2:])) * 1e6,
                         "shmbuf_rollout_bytes": int(sum(lf.nbytes for lf in reader.schema.leaves)),
                         "peer_rollout_bytes": int(sum(v.nbytes for v in one.values()))}
        finally:
            if writer is not None:
                writer.close()
            reader.close()
            env.close()
            if peer is not None:
                peer.close()
    return out


# -- clusters and processes --------------------------------------------------------------------------------------------


def _children() -> dict[int, int]:
    """pid -> ppid of every live process (zombies left out)."""
    out = {}
    for e in os.listdir("/proc"):
        fields = stat_fields(e) if e.isdigit() else None
        if fields is not None and fields[0] not in (b"Z", b"X"):  # state, then ppid
            out[int(e)] = int(fields[1])
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants() -> set[int]:
    """Every live process below this one (Ray's daemons and workers, the collectors' actors), less this
    process's own multiprocessing helpers (the forkserver and resource tracker live as long as it does)."""
    parent = _children()
    root = os.getpid()
    found = {p for p, pp in parent.items() if pp == root and ("forkserver" in _cmdline(p) or "resource_tracker" in _cmdline(p))}
    helpers = set(found)
    grew = True
    while grew:
        grew = False
        for p, pp in parent.items():
            if p not in found and (pp == root or pp in found):
                found.add(p)
                grew = True
    return found - helpers


def alive(pids: set[int]) -> set[int]:
    live = _children()
    return {p for p in pids if p in live}


@contextlib.contextmanager
def ray_cluster(nodes: int, cores: int, record: dict[str, Any], pids: set[int]) -> Iterator[list[str]]:
    """A local Ray cluster: ``ray.init`` with every core (1 node), or ``Cluster`` with one CPU a node (2 nodes).

    Yields the alive node ids, the head's first. On the way out shuts Ray down and waits (15 s) for every
    process it started, and every one the runs added to ``pids``, to be gone; what is left goes in
    ``record["left"]``, its start and stop times in ``record["start_s"]``, ``["stop_s"]``.
    """
    import ray

    t0 = time.monotonic()
    cluster = None
    try:
        if nodes == 1:
            ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
        else:
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        head = ray.get_runtime_context().get_node_id()
        ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        ids.sort(key=lambda i: i != head)
        if len(ids) != nodes:
            raise RuntimeError(f"Ray cluster: expected {nodes} alive nodes, got {len(ids)}")
        record["start_s"] = round(time.monotonic() - t0, 2)
        j0, t1 = _ours_jiffies(), time.monotonic()  # what Ray's processes cost doing nothing
        time.sleep(IDLE_S)
        record["idle_cores"] = round((_ours_jiffies() - j0) / CLOCK_TICKS / (time.monotonic() - t1), 3)
        yield ids
    finally:
        pids |= descendants()
        t1 = time.monotonic()
        try:
            ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
        deadline = time.monotonic() + 15.0
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        record["left"] = [f"{p}: {_cmdline(p)[:200]}" for p in sorted(alive(pids))]
        record["stop_s"] = round(time.monotonic() - t1, 2)


# -- one run -----------------------------------------------------------------------------------------------------------


def run_one(system: str, workload: str, *, nodes: list[str] | None, per_call: int | None = None,
            in_flight: int | None = None, windows: int, window_s: float, warmup_s: float, stall_s: float,
            repeat: int, pids: set[int]) -> dict[str, Any]:
    """Start ``system`` on ``workload``, measure it, stop it; a record with the cuts, or the error."""
    from benchmarks import ray_envs

    w = ray_envs.workload(workload)
    rec: dict[str, Any] = {"system": system, "workload": workload, "repeat": repeat, "nodes": len(nodes or []) or None,
                           "per_call": per_call, "in_flight": in_flight, "loadavg_start": list(os.getloadavg())}
    t0 = time.monotonic()
    src: Any = None
    try:
        if system == "shmbuf":
            src = ShmbufSource(w, ACTORS, BATCH, stall_s)
        elif system.startswith("shmbuf_ray"):
            assert nodes
            src = ShmbufRaySource(w, ACTORS // len(nodes), nodes, BATCH, stall_s, local_node=system != "shmbuf_ray_hop")
        else:
            assert nodes and per_call and in_flight
            src = RayActorsSource(w, ACTORS, nodes, BATCH, stall_s, per_call, in_flight)
        first = {}

        def next_batch() -> tuple[int, int]:
            got = src.next_batch()
            first.setdefault("t", time.monotonic())
            return got

        rec["cuts"] = measure(next_batch, warmup_s=warmup_s, windows=windows, window_s=window_s)
        rec["startup_s"] = round(first["t"] - t0, 3)
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001  (a system that fails or stalls is recorded as such; the others go on)
        from shmbuf import SlotTimeout

        rec["status"] = "stalled" if isinstance(exc, (Stalled, SlotTimeout)) else "error"
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if src is not None:
            with contextlib.suppress(Exception):
                pids.update(src.pids())
            pids.update(descendants())
            t1 = time.monotonic()
            src.close()
            rec["shutdown_s"] = round(time.monotonic() - t1, 3)
    rec["loadavg_end"] = list(os.getloadavg())
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    return rec


# -- the run -----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.on_ray", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows, one repeat, small and cartpole only (~1 minute)")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"),
                   help="where to write (default: benchmarks/results/)")
    p.add_argument("--workloads", default=None, help="comma-separated subset of small,atari,cartpole")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=None, help="times every system runs (interleaved)")
    p.add_argument("--windows", type=int, default=None, help="measured windows per run")
    p.add_argument("--window-s", type=float, default=None, help="seconds per window")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up seconds after the first batch, dropped")
    p.add_argument("--stall-s", type=float, default=STALL_S, help="no batch for this long: the run is stalled")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--render", metavar="JSON", help="only rewrite a results file's rows, .md and .png (no run)")
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    a.workloads = tuple(x for x in (a.workloads.split(",") if a.workloads else base["workloads"]) if x)
    a.systems = tuple(x for x in a.systems.split(",") if x)
    from benchmarks.ray_envs import NAMES

    for name, got, allowed in (("workloads", a.workloads, NAMES), ("systems", a.systems, SYSTEMS)):
        bad = [x for x in got if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; expected a subset of {','.join(allowed)}")
    for k in ("repeats", "windows", "window_s", "warmup_s"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    a.per_call, a.in_flight, a.loop_rollouts = base["per_call"], base["in_flight"], base["loop_rollouts"]
    return a


def plan(a: argparse.Namespace) -> list[tuple[int, list[dict[str, Any]]]]:
    """Per repeat, three phases: (nodes, runs): 0 = no Ray (shmbuf alone), then one node, then two nodes.

    ``ray_actors_2node`` runs in the configuration that was best on one node in the first repeat (chosen when it
    first starts, kept for the others, so that its windows pool into one row).
    """
    peers = [{"per_call": k, "in_flight": f} for k in a.per_call for f in a.in_flight]
    phases: list[tuple[int, list[dict[str, Any]]]] = []
    for rep in range(a.repeats):
        for nodes, systems in ((0, ("shmbuf",)), (1, ("shmbuf_ray", "shmbuf_ray_hop", "ray_actors")),
                               (2, ("shmbuf_ray_2node", "ray_actors_2node"))):
            runs = []
            for wl in a.workloads:
                for s in systems:
                    if s not in a.systems:
                        continue
                    if s == "ray_actors":
                        runs += [{"system": s, "workload": wl, "repeat": rep, **c} for c in peers]
                    else:
                        runs.append({"system": s, "workload": wl, "repeat": rep})
            if runs:
                phases.append((nodes, runs))
    return phases


def estimate_s(a: argparse.Namespace, phases: list[tuple[int, list[dict[str, Any]]]]) -> float:
    per = a.warmup_s + a.windows * a.window_s
    return sum(CLUSTER_S.get(n, 0.0) + sum(per + START_S[r["system"]] for r in runs) for n, runs in phases)


def code_digest() -> str:
    """A digest of the code every process of a run imports (shmbuf/, workers/, benchmarks/): Ray's workers, the node
    owners and the actors import it from disk when they start, so a checkout edited during the run mixes versions."""
    import hashlib

    h = hashlib.sha256()
    for pkg in ("shmbuf", "workers", "benchmarks"):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(_ROOT, pkg))):
            dirnames.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for m in ("ray", "gymnasium"):
        try:
            out[m] = version(m)
        except PackageNotFoundError:
            out[m] = "not installed"
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.render:
        with open(a.render) as f:
            result = build(json.load(f))
        return write(result, a.render[: -len(".json")], not a.no_plot)
    import importlib.util

    missing = [m for m in ("ray", "gymnasium") + (() if a.no_plot else ("matplotlib",)) if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"the Ray benchmark needs {', '.join(missing)}: `make bench-ray` installs them (the bench extra), "
                         "or pip install -e '.[bench]'")
    from benchmarks import machine

    m = machine.info()
    m["ray"] = _versions()["ray"]
    m["code_digest_start"] = code_digest()
    cores = m["cores_usable"]
    phases = plan(a)
    n_runs = sum(len(r) for _, r in phases)
    est = estimate_s(a, phases)
    print(f"machine: {machine.line(m)}", flush=True)
    print(f"{n_runs} runs in {len(phases)} phases, about {est / 60:.1f} minutes", flush=True)
    t0 = time.monotonic()
    costs = loop_costs(a.workloads, a.loop_rollouts)
    runs: list[dict[str, Any]] = []
    clusters: list[dict[str, Any]] = []
    pids: set[int] = set()
    peer2: dict[str, tuple[int, int]] = {}  # workload -> the two-node peer's (per_call, in_flight), kept for every repeat
    done = 0
    for nodes, todo in phases:
        cl: dict[str, Any] = {"nodes": nodes}
        with contextlib.ExitStack() as stack:
            ids = None
            if nodes:
                clusters.append(cl)
                ids = stack.enter_context(ray_cluster(nodes, cores, cl, pids))
            for r in todo:
                if r["system"] == "ray_actors_2node":  # the peer's best one-node configuration of the first repeat
                    if r["workload"] not in peer2:
                        best = best_peer(summarize(runs, CLOCK_TICKS), r["workload"])
                        peer2[r["workload"]] = (best["per_call"], best["in_flight"]) if best else (BATCH // ACTORS, 2)
                    r = {**r, "per_call": peer2[r["workload"]][0], "in_flight": peer2[r["workload"]][1]}
                done += 1
                print(f"[{done}/{n_runs}, {time.monotonic() - t0:.0f} s] {r['system']} {r['workload']}"
                      + (f" {r['per_call']}/call {r['in_flight']} in flight" if "per_call" in r else ""), flush=True)
                rec = run_one(r["system"], r["workload"], nodes=ids, per_call=r.get("per_call"),
                              in_flight=r.get("in_flight"), windows=a.windows, window_s=a.window_s, warmup_s=a.warmup_s,
                              stall_s=a.stall_s, repeat=r["repeat"], pids=pids)
                if rec["status"] != "ok":
                    print(f"  {rec['status']}: {rec.get('error')}", flush=True)
                runs.append(rec)
        if not nodes:  # shmbuf alone: its actors must be gone before Ray starts
            deadline = time.monotonic() + 15.0
            while alive(pids) and time.monotonic() < deadline:
                time.sleep(0.1)
    deadline = time.monotonic() + 15.0
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    m["loadavg_end"] = list(os.getloadavg())
    m["code_digest_end"] = code_digest()
    date = datetime.date.today().isoformat()
    result = {
        "date": date, "machine": m, "machine_line": machine.line(m), "versions": _versions(),
        "config": {"workloads": list(a.workloads), "systems": list(a.systems), "actors": ACTORS, "batch": BATCH,
                   "repeats": a.repeats, "windows": a.windows, "window_s": a.window_s, "warmup_s": a.warmup_s,
                   "stall_s": a.stall_s, "per_call": list(a.per_call), "in_flight": list(a.in_flight), "quick": a.quick},
        "clk_tck": CLOCK_TICKS, "wall_s": round(time.monotonic() - t0, 1), "estimate_s": round(est, 1),
        "clusters": clusters, "loop_costs": costs,
        "left_pids": [f"{p}: {_cmdline(p)[:200]}" for p in sorted(alive(pids))], "runs": runs,
    }
    build(result)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{date}-{socket.gethostname()}-ray{'-quick' if a.quick else ''}")
    return write(result, stem, not a.no_plot)


if __name__ == "__main__":
    main()
