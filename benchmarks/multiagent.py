"""Multi-agent collection benchmark: agent steps/s delivered to the learner, and CPU per agent step, of shmbuf's
MultiAgentCollector against RLlib's own multi-agent sampling and a one-process PettingZoo loop, in one run.

One command, from the repository root (torchrl installs a top-level ``benchmarks`` package of its own, which
shadows this one anywhere else)::

    python -m benchmarks.multiagent [--quick] [--out DIR] [--systems ...] [--envs ...] [--policies ...]
    make bench-multiagent

writes ``<out>/<date>-<host>-multiagent[-quick].{json,md,png}``: every window of every run, the machine, the versions,
the settings (``.json``); the tables (``.md``); the plot (``.png``). ``--render FILE.json`` redraws a results file.

Envs and policies (``benchmarks/multiagent_envs.py``): MPE2's ``simple_spread_v3`` with 8 agents (``spread``, a real
and slow env) and a synthetic PettingZoo parallel env of 16 agents with a cheap numpy step (``synthetic``: what
collection costs per agent step shows); numpy linear policies (``obs @ W``, argmax), one shared by every agent
(``linear``) or two mapped by agent id (``linear2``). :data:`NUM_ENVS` envs in every system, rollouts of
:data:`ROLLOUT_LEN` env steps.

Systems:

1. ``floor``: one process, a plain PettingZoo loop over the envs: each step, each policy called once over all of its
   agents in all envs (batched), every transition (obs, action, reward, terminated, truncated, valid) stored into
   numpy ``(T, rows)`` arrays, an env reset when its agents are gone; it yields after each rollout of ``T`` env steps.
   The floor to beat.
2. ``shmbuf``: ``workers.MultiAgentCollector`` (copy=False, ``count_steps_by="env_steps"``), one round per actor per
   batch: 2 actors x 2 envs, 4 x 1, 1 x 4. Counted: ``batch.agent_steps``.
3. ``rllib``: RLlib's new-API-stack ``MultiAgentEnvRunner`` (Ray 2.60), the envs wrapped in RLlib's
   ``ParallelPettingZooEnv``, a ``MultiRLModule`` of one ``TorchRLModule`` per policy whose ``_forward`` runs the same
   numpy policy on the observation batch (``obs.numpy() @ W``, argmax) and returns ``Columns.ACTIONS`` (RLlib's
   connectors turn the numpy observations into a torch tensor and the actions back; no distribution is sampled):
   an ``EnvRunnerGroup`` of 2 remote env runners x 2 envs sampled as PPO's ``training_step`` does
   (``synchronous_parallel_sample(max_env_steps=...)``: ``sample()`` on each runner, the episodes gathered in the
   driver), the same sampled as IMPALA's old path does (``foreach_env_runner_async`` + ``fetch_ready_async_reqs``:
   2 requests kept in flight on each runner), and one local env runner
   of 4 envs in this process (``num_env_runners=0``). Counted: ``sum(episode.agent_steps())`` of what ``sample()``
   returned to the driver. Ray is started for each run (``ray.init``, every core) and shut down after it.
4. ``shmbuf_ray``: ``workers.RayCollector`` with the same envs and policies on that one-node Ray, 2 actors x 2 envs:
   behind a node owner (each batch a Ray object, what another node's batches are) or on the learner's own node.
   Counted: ``batch.agent_steps``.

Each figure is taken as benchmarks/collect.py takes it (its :func:`benchmarks.collect.run_one` and sweep are used
as they are): warm-up and start-up dropped, ``--windows`` windows of at least ``--window-s`` each cut at a delivery,
the median window; CPU of this process and of every process below it (the actors; for RLlib, Ray's daemons and its
env runner workers) from ``/proc`` over the windows, per agent step; passes alternating the systems' order.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from benchmarks import collect, machine
from benchmarks import collect_report as creport
from benchmarks import multiagent_envs as me
from benchmarks.collect_systems import Run
from benchmarks.inference import descendants

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_ENVS = 4  # envs in every system
ROLLOUT_LEN = 50  # env steps per rollout (the floor's, each actor's round, each RLlib env runner's sample())
# Seconds a run takes besides its windows (start-up, first delivery, shutdown), for the estimate printed at the start.
OVERHEAD_S = {"floor": 1.0, "shmbuf": 6.0, "shmbuf_ray": 20.0, "rllib": 25.0}  # quick runs on the busy 2-core machine


# ------------------------------------------------------------------ the one-process loop


class Floor(Run):
    """One process: the envs stepped in a loop, each policy called once per step over its agents, all stored."""

    LABEL = "one-process PettingZoo loop"
    VARIANTS: ClassVar[dict[str, str]] = {"loop": f"{NUM_ENVS} envs stepped in a Python loop, each policy batched over its "
                                                  "agents, every transition stored into numpy arrays"}

    def batches(self) -> Iterator[int]:
        envs = self.c = me.make_envs(self.env, NUM_ENVS)
        policies = me.make_policies(self.env, self.policy)
        mapping = me.mapping(self.policy)
        agents = envs[0].possible_agents
        rows = {pid: [(i, a) for i in range(NUM_ENVS) for a in agents if mapping(a) == pid] for pid in policies}
        obs_dim, _ = me.spaces(self.env)
        T = ROLLOUT_LEN
        store = {pid: {"obs": np.zeros((T, len(r), obs_dim), np.float32), "action": np.zeros((T, len(r)), np.int64),
                       "reward": np.zeros((T, len(r)), np.float32), "terminated": np.zeros((T, len(r)), bool),
                       "truncated": np.zeros((T, len(r)), bool), "valid": np.zeros((T, len(r)), bool)}
                 for pid, r in rows.items()}
        zero = np.zeros(obs_dim, np.float32)
        obs = [e.reset(seed=me.SEED + i)[0] for i, e in enumerate(envs)]
        while True:
            for t in range(T):
                actions: list[dict[str, int]] = [{} for _ in envs]
                for pid, rws in rows.items():
                    s = store[pid]
                    s["valid"][t] = valid = [a in obs[i] for i, a in rws]
                    s["obs"][t] = [obs[i].get(a, zero) for i, a in rws]
                    act = policies[pid](s["obs"][t])
                    s["action"][t] = act
                    for (i, a), x, ok in zip(rws, act.tolist(), valid):
                        if ok:
                            actions[i][a] = x
                out = [env.step(act) for env, act in zip(envs, actions)]
                for pid, rws in rows.items():
                    s = store[pid]
                    s["reward"][t] = [out[i][1].get(a, 0.0) for i, a in rws]
                    s["terminated"][t] = [out[i][2].get(a, False) for i, a in rws]
                    s["truncated"][t] = [out[i][3].get(a, False) for i, a in rws]
                for i, env in enumerate(envs):
                    obs[i] = out[i][0] if env.agents else env.reset()[0]
            yield int(sum(int(s["valid"].sum()) for s in store.values()))

    def close(self) -> None:
        for env in self.c or ():
            env.close()


# ------------------------------------------------------------------ shmbuf


class Shmbuf(Run):
    """``workers.MultiAgentCollector``: the envs and the policies in actor processes, one batch per round of each."""

    LABEL = "shmbuf MultiAgentCollector"
    IMPORTS = ("workers", "pettingzoo")
    VARIANTS: ClassVar[dict[str, str]] = {"2x2": "2 actors x 2 envs, copy=False", "4x1": "4 actors x 1 env, copy=False",
                                          "1x4": "1 actor x 4 envs, copy=False"}

    def batches(self) -> Iterator[int]:
        from workers import MultiAgentCollector

        actors, per = (int(x) for x in self.variant.split("x"))
        self.c = MultiAgentCollector([functools.partial(me.make_envs, self.env, per)] * actors,
                                     me.make_policies(self.env, self.policy), policy_mapping_fn=me.mapping(self.policy),
                                     frames_per_batch=ROLLOUT_LEN * NUM_ENVS, rollout_len=ROLLOUT_LEN, num_actors=actors,
                                     copy=False, seed=me.SEED)
        for b in self.c:
            yield int(b.agent_steps)


class ShmbufRay(Run):
    """``workers.RayCollector`` with the multi-agent envs on a one-node local Ray: a MultiAgentCollector behind a node
    owner (each batch one Ray object, as from another node), or in this process (the learner's own node)."""

    LABEL = "shmbuf RayCollector"
    IMPORTS = ("workers", "pettingzoo", "ray")
    VARIANTS: ClassVar[dict[str, str]] = {
        "2x2-owner": "2 actors x 2 envs behind a node owner (local_node=False): each batch one Ray object, as from "
                     "another node; copy=False",
        "2x2-local": "2 actors x 2 envs, the learner's own node (local_node=True): views of shared memory through a "
                     "thread, no Ray object; copy=False"}

    def __init__(self, env: str, policy: str, variant: str, frames_per_batch: int):
        super().__init__(env, policy, variant, frames_per_batch)
        self.ray = RayRun()

    def batches(self) -> Iterator[int]:
        from workers import RayCollector

        self.ray.start()
        self.c = RayCollector(functools.partial(me.make_envs, self.env, NUM_ENVS // 2),
                              me.make_policies(self.env, self.policy), policy_mapping_fn=me.mapping(self.policy),
                              frames_per_batch=ROLLOUT_LEN * NUM_ENVS, rollout_len=ROLLOUT_LEN, actors_per_node=2,
                              local_node=self.variant.endswith("-local"), seed=me.SEED)
        for b in self.c:
            yield int(b.agent_steps)

    def close(self) -> None:
        try:
            if self.c is not None:
                self.c.close()
        finally:
            self.ray.stop()


class RayRun:
    """A local Ray for one run (every core, this checkout on the workers' path), and its processes gone after it."""

    STOP_S = 20.0  # how long stop() waits for Ray's processes to leave after ray.shutdown() (longer on a busy machine)

    def __init__(self) -> None:
        self.started = False
        self.before: set[int] = set()

    def start(self) -> None:
        import ray

        self.before = set(descendants())
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}})
        self.started = True

    def stop(self) -> None:
        if not self.started:
            return
        import ray

        ray.shutdown()
        # Ray's daemons and workers leave on their own, after it returns: wait for them (polling, with a deadline),
        # so that the run's reaping finds nothing of Ray's left to kill.
        deadline = time.monotonic() + self.STOP_S
        while set(descendants()) - self.before and time.monotonic() < deadline:
            time.sleep(0.1)


# ------------------------------------------------------------------ RLlib


@functools.cache
def linear_rl_module() -> type:
    """The benchmark's numpy linear policy as an RLlib ``TorchRLModule`` (made here, so that importing this module needs
    no RLlib; Ray pickles the class by value to its env runners)."""
    import torch
    from ray.rllib.core.columns import Columns
    from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

    class LinearRLModule(TorchRLModule):
        """``_forward``: the observation batch as numpy, ``obs @ W``, argmax, as actions (no distribution sampled)."""

        def setup(self) -> None:
            torch.set_num_threads(1)
            c = self.model_config
            self.policy = me.LinearPolicy(c["obs_dim"], c["n_actions"], c["seed"])

        def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            return {Columns.ACTIONS: torch.from_numpy(self.policy(batch[Columns.OBS].numpy()))}

    return LinearRLModule


def _rllib_env(cfg: dict[str, Any]) -> Any:
    from ray.rllib.env.wrappers.pettingzoo_env import ParallelPettingZooEnv

    return ParallelPettingZooEnv(me.make_env(cfg["env"]))


def rllib_config(env: str, policy: str, runners: int, envs_per_runner: int, in_flight: int = 1) -> Any:
    """An RLlib config (PPO's, whose sampling settings the runners read) for ``env`` and ``policy``: the same envs
    and weights as the other systems (:func:`benchmarks.multiagent_envs.make_policies`'s seeds)."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.tune.registry import register_env

    register_env("shmbuf_bench_multiagent", _rllib_env)
    obs_dim, n_actions = me.spaces(env)
    specs = {pid: RLModuleSpec(module_class=linear_rl_module(),
                               model_config={"obs_dim": obs_dim, "n_actions": n_actions, "seed": me.SEED + k})
             for k, pid in enumerate(me.policy_ids(policy))}
    return (PPOConfig()
            .environment("shmbuf_bench_multiagent", env_config={"env": env})
            .multi_agent(policies=set(specs), policy_mapping_fn=me.mapping(policy))
            .rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs=specs))
            .env_runners(num_env_runners=runners, num_envs_per_env_runner=envs_per_runner,
                         rollout_fragment_length=ROLLOUT_LEN, batch_mode="truncate_episodes", num_cpus_per_env_runner=1,
                         max_requests_in_flight_per_env_runner=in_flight)
            .debugging(seed=me.SEED))


def _agent_steps(episodes: list[Any]) -> int:
    return int(sum(e.agent_steps() for e in episodes))


class RLlib(Run):
    """RLlib's ``MultiAgentEnvRunner``: remote env runners sampled as PPO or IMPALA do, or one in this process."""

    LABEL = "RLlib MultiAgentEnvRunner"
    IMPORTS = ("ray.rllib",)
    VARIANTS: ClassVar[dict[str, str]] = {
        "2x2-sync": "EnvRunnerGroup, 2 remote env runners x 2 envs, synchronous_parallel_sample (PPO's)",
        "2x2-async": "EnvRunnerGroup, 2 remote env runners x 2 envs, 2 sample() requests in flight on each (IMPALA's "
                     "foreach_env_runner_async + fetch_ready_async_reqs)",
        "local-1x4": "one MultiAgentEnvRunner of 4 envs in this process (num_env_runners=0), no Ray workers"}

    def __init__(self, env: str, policy: str, variant: str, frames_per_batch: int):
        super().__init__(env, policy, variant, frames_per_batch)
        self.ray = RayRun()

    def batches(self) -> Iterator[int]:
        if self.variant == "local-1x4":
            from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner

            runner = self.c = MultiAgentEnvRunner(config=rllib_config(self.env, self.policy, 0, NUM_ENVS))
            while True:
                yield _agent_steps(runner.sample())
        from ray.rllib.env.env_runner_group import EnvRunnerGroup
        from ray.rllib.execution.rollout_ops import synchronous_parallel_sample

        self.ray.start()
        config = rllib_config(self.env, self.policy, 2, NUM_ENVS // 2, in_flight=2 if self.variant == "2x2-async" else 1)
        group = self.c = EnvRunnerGroup(config=config, local_env_runner=False)
        if self.variant == "2x2-sync":
            while True:  # PPO's training_step, new API stack: one sample() from each runner, the episodes flattened
                episodes, _ = synchronous_parallel_sample(worker_set=group, max_env_steps=ROLLOUT_LEN * NUM_ENVS,
                                                          _uses_new_env_runners=True, _return_metrics=True)
                yield _agent_steps(episodes)
        while True:
            group.foreach_env_runner_async(lambda runner: runner.sample())
            got = group.fetch_ready_async_reqs(timeout_seconds=0.05)
            if got:
                yield sum(_agent_steps(eps) for _, eps in got)

    def close(self) -> None:
        try:
            if self.c is not None:
                self.c.stop()
        finally:
            self.ray.stop()


# name -> class; the order is the order of the tables, the plot and each pass of the sweep
SYSTEMS: dict[str, type[Run]] = {"floor": Floor, "shmbuf": Shmbuf, "shmbuf_ray": ShmbufRay, "rllib": RLlib}
COLORS = {"floor": "#7f7f7f", "shmbuf": "#d62728", "shmbuf_ray": "#ff9896", "rllib": "#1f77b4"}


# ------------------------------------------------------------------ report


def line(r: dict[str, Any]) -> str:
    """One run in one line, for the progress output."""
    head = f"{r['env']:9s} {r['policy']:7s} {r['label']} [{r['variant']}]"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r.get('error', '')[-300:]}"
    sps = float(np.median(r["windows"]))
    c = r["cpu_cores"]
    return (f"{head}: {sps:,.0f} agent steps/s, CPU us/agent step this process {c['learner'] / sps * 1e6:.1f} children "
            f"{c['children'] / sps * 1e6:.1f}, outside {c['outside']:.2f} cores")


def summarize(res: dict[str, Any]) -> None:
    """``res["rows"]`` (every configuration, benchmarks/collect_report.py's rows: ``fps`` and ``cpu_us_per_frame`` are
    per agent step here; ``shown`` marks each system's row) and ``res["ratios"]`` (each system against the floor)."""
    rows = creport._rows(res["runs"])
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:  # among the configurations measured in the most passes, the fastest
        k = (r["env"], r["policy"], r["system"])
        if k not in best or (r["runs"], r["fps"]["median"]) > (best[k]["runs"], best[k]["fps"]["median"]):
            best[k] = r
    order = list(res["config"]["labels"])
    for r in rows:
        r["shown"] = best[(r["env"], r["policy"], r["system"])] is r
    rows.sort(key=lambda r: (r["env"], r["policy"], order.index(r["system"]), not r["shown"], -r["fps"]["median"]))
    res["rows"] = rows
    res["ratios"] = [{"env": env, "policy": pol, "system": s, "against": "floor",
                      "sps_ratio": r["fps"]["median"] / f["fps"]["median"],
                      "cpu_ratio": r["cpu_us_per_frame"]["total"] / f["cpu_us_per_frame"]["total"]}
                     for (env, pol, s), r in best.items() if s != "floor" and (f := best.get((env, pol, "floor")))]
    res["ratios"] += [{"env": env, "policy": pol, "system": s, "against": "rllib",
                       "sps_ratio": r["fps"]["median"] / x["fps"]["median"],
                       "cpu_ratio": r["cpu_us_per_frame"]["total"] / x["cpu_us_per_frame"]["total"]}
                      for (env, pol, s), r in best.items()
                      if s in ("shmbuf", "shmbuf_ray") and (x := best.get((env, pol, "rllib")))]


def tables(res: dict[str, Any]) -> str:
    c, n = res["config"], creport._n
    v = c["versions"]
    lines = [f"# Multi-agent collection benchmark, {res['date']}", "",
             (f"Machine: {res['machine_line']}; " + ", ".join(f"{k} {x}" for k, x in v.items())
              + f". Load average at start {res['machine']['loadavg_start']}, at end {res['machine'].get('loadavg_end')}."), "",
             (f"Settings: {c['num_envs']} envs in every system, rollouts of {c['rollout_len']} env steps; {c['passes']} "
              f"pass(es), {c['windows']} windows of at least {c['window_s']} s per run after {c['warmup_s']} s of warm-up "
              "(start-up excluded), agent steps counted at delivery to this process, each figure the median of the pooled "
              "windows (± half their spread). Envs: " + "; ".join(f"{k}: {d}" for k, d in c["env_desc"].items())
              + ". Policies: " + "; ".join(f"{k}: {d}" for k, d in c["policy_desc"].items())
              + f". The sweep took {res.get('seconds', 0) / 60:.1f} minutes."), "",
             ("**CPU µs/agent step**: this process (the learner; for the one-process loop and RLlib's local env runner, "
              "the whole loop) / every process below it (shmbuf's actors; Ray's daemons and env runners) / both, from "
              f"/proc over the windows. **outside**: cores busy outside the run (‡: more than {creport.OUTSIDE_MARK}). "
              "**× loop**: agent steps/s against the one-process loop's."), ""]
    if c["quick"]:
        lines += ["**Quick run**: each system's first configuration only, short windows: a look, not a measurement.", ""]
    if c.get("rllib_version"):
        lines += [f"RLlib: {c['rllib_version']}. Its policy: {c['rllib_policy']}", ""]
    rows = res.get("rows", [])
    for env in c["envs"]:
        for pol in c["policies"]:
            shown = [r for r in rows if r["env"] == env and r["policy"] == pol and r["shown"]]
            if not shown:
                continue
            floor = next((r for r in shown if r["system"] == "floor"), None)
            lines += [f"## {env}, {pol}", "", "| system [configuration] | agent steps/s | × loop | CPU µs/agent step "
                      "this process / children / total | outside |", "|---|---:|---:|---:|---:|"]
            for r in shown:
                sps = r["fps"]
                spread = f" ±{(sps['max'] - sps['min']) / 2:,.0f}" if len(sps["windows"]) > 1 else ""
                mark = " ‡" if r["outside_cores"]["max"] > creport.OUTSIDE_MARK else ""
                x = f"{sps['median'] / floor['fps']['median']:.2f}x" if floor else "n/a"
                cpu = r["cpu_us_per_frame"]
                lines.append(f"| {r['label']} [{r['variant']}] | {n(sps['median'])}{spread}{mark} | {x} | "
                             f"{cpu['learner']:.1f} / {cpu['children']:.1f} / {cpu['total']:.1f} | "
                             f"{r['outside_cores']['mean']:.2f} |")
            lines.append("")
    vs = [x for x in res.get("ratios", []) if x["against"] == "rllib"]
    if vs:
        lines += ["## shmbuf against RLlib (each one's fastest configuration)", "",
                  "| env | policy | shmbuf system | agent steps/s, shmbuf / RLlib | CPU per agent step, shmbuf / RLlib |",
                  "|---|---|---|---:|---:|"]
        lines += [f"| {x['env']} | {x['policy']} | {c['labels'][x['system']]} | {x['sps_ratio']:.2f}x | "
                  f"{x['cpu_ratio']:.2f}x |" for x in vs]
        lines.append("")
    lines += ["## Every configuration (in bold, each system's row above)", "",
              "| env | policy | system | configuration | agent steps/s | CPU µs/agent step this process / children | "
              "start-up s | runs |", "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        name, sps = r["variant_desc"], n(r["fps"]["median"])
        if r["shown"]:
            name, sps = f"**{name}**", f"**{sps}**"
        cpu = r["cpu_us_per_frame"]
        lines.append(f"| {r['env']} | {r['policy']} | {r['label']} | {name} | {sps} | {cpu['learner']:.1f} / "
                     f"{cpu['children']:.1f} | {n(r['startup_s'], '.1f')} | {r['runs']} |")
    lines.append("")
    bad = [r for r in res["runs"] if r["status"] != "ok"]
    if bad or res.get("skipped"):
        lines += ["## Not measured", ""]
        lines += [f"- {r['env']} {r['policy']} {r['label']} [{r['variant']}]: {r['status']}: "
                  f"{(r.get('error') or '').splitlines()[-1][:300] if r.get('error') else ''}" for r in bad]
        lines += [f"- {c['labels'].get(s, s)}: not measured: {why}" for s, why in res.get("skipped", {}).items()]
        lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> bool:
    """Agent steps/s per system (its fastest configuration) for each env x policy, the loop as a line; CPU per step."""
    return creport.bars_and_cpu(res, path, colors=COLORS, unit="agent step",
                                rate_label="agent steps/s delivered (median window)", floors=[("floor", "--", None)],
                                title=f"{res['config']['num_envs']} multi-agent envs, {res['machine']['cores']} cores: "
                                      "agent steps/s (dashed: the one-process loop)")


def write(res: dict[str, Any], stem: str, draw: bool) -> None:
    res["paths"] = {"json": stem + ".json", "md": stem + ".md"}
    if draw and plot(res, stem + ".png"):
        res["paths"]["png"] = stem + ".png"
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(tables(res))


# ------------------------------------------------------------------ main


def available(system: str) -> str | None:
    """None if ``system`` can run here, else why not (its modules imported: RLlib's import fails on missing deps)."""
    for mod in SYSTEMS[system].IMPORTS:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            return f"import {mod} failed: {type(exc).__name__}: {exc}"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = collect.sweep_parser("python -m benchmarks.multiagent", __doc__, SYSTEMS, me.ENVS, me.POLICIES, window_s=3.0,
                             warmup_s=2.0, stall_s=120.0)
    a = collect.sweep_args(p, p.parse_args(argv), SYSTEMS, me.ENVS, me.POLICIES)
    a.frames_per_batch = ROLLOUT_LEN * NUM_ENVS  # env steps per delivery; what run_one passes each system
    return a


VERSIONS = ("numpy", "pettingzoo", "mpe2", "gymnasium", "ray", "torch", "dm-tree", "pandas", "pyarrow", "pydantic",
            "lz4", "ormsgpack", "tensorboardX")


def main(argv: list[str] | None = None, *, preload: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        summarize(res)
        write(res, a.render.removesuffix(".json"), not a.no_plot)
        print(tables(res))
        return res
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine.info(), "runs": [], "skipped": {}}
    res["machine_line"] = machine.line(res["machine"])
    res["config"] = {"quick": a.quick, "envs": a.envs, "policies": a.policies, "systems": a.systems, "num_envs": NUM_ENVS,
                     "rollout_len": ROLLOUT_LEN, "passes": a.passes, "windows": a.windows, "window_s": a.window_s,
                     "warmup_s": a.warmup_s, "env_desc": me.ENVS, "policy_desc": me.POLICIES, "agents": me.AGENTS,
                     "start_method": mp.get_start_method(allow_none=True) or "default", "forkserver_preload": preload,
                     "versions": {m: machine._version(m) for m in VERSIONS},
                     "variants": {s: SYSTEMS[s].VARIANTS for s in SYSTEMS}, "labels": {s: SYSTEMS[s].LABEL for s in SYSTEMS},
                     "rllib_version": "", "rllib_policy": ""}
    for s in list(a.systems):
        why = available(s)
        if why is not None:
            res["skipped"][s] = why
            a.systems.remove(s)
            print(f"{SYSTEMS[s].LABEL} is not measured: {why}", file=sys.stderr)
    if "rllib" in a.systems:
        res["config"]["rllib_version"] = (f"ray {machine._version('ray')} (new API stack: MultiAgentEnvRunner, "
                                          "ParallelPettingZooEnv, PPOConfig's sampling settings)")
        res["config"]["rllib_policy"] = ("a MultiRLModule of one TorchRLModule per policy; its _forward takes the observation "
                                         "batch as numpy, runs the same LinearPolicy (obs @ W, argmax) and returns the actions "
                                         "(Columns.ACTIONS); RLlib's default connectors around it")
    t0 = time.perf_counter()
    collect.sweep(a, res, systems=SYSTEMS, overhead_s=OVERHEAD_S, line=line, name="multiagent bench")
    res["seconds"] = time.perf_counter() - t0
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    summarize(res)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"{res['date']}-{socket.gethostname()}-multiagent{'-quick' if a.quick else ''}")
    write(res, stem, not a.no_plot)
    print(tables(res))
    print(f"results: {stem}.json / .md" + (" / .png" if "png" in res["paths"] else ""), file=sys.stderr)
    return res


PRELOAD = ["numpy", "pettingzoo", "mpe2", "benchmarks.multiagent_envs", "workers"]


def cli() -> None:
    """``python -m benchmarks.multiagent``: shmbuf's actors fork from one forkserver that has the imports done (set
    here, not in :func:`main`: the start method and the forkserver's preload are process-wide)."""
    mp.set_start_method("forkserver")
    mp.set_forkserver_preload(PRELOAD)
    main(preload=PRELOAD)


if __name__ == "__main__":
    cli()
