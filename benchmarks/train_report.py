"""The training benchmark's summaries, tables and plot (``benchmarks/train.py``'s results)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks import collect_report as creport

COLORS = {"one_process": "#555555", "shmbuf_lag0": "#1f77b4", "shmbuf_lag1": "#2ca02c",
          "floor": "#555555", "gym_async": "#9467bd", "puffer": "#ff7f0e", "collector": "#1f77b4",
          "async_batched": "#17becf", "envpool_sync": "#d62728", "envpool_async": "#e377c2", "ale_vec": "#8c564b"}
PEERS = ("gym_async", "puffer", "envpool_sync", "envpool_async", "ale_vec")  # the other people's systems
SHMBUF = ("collector", "async_batched")


def _n(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def train_label(res: dict[str, Any], system: str, enforced: bool | None) -> str:
    """A PPO system's label; a shmbuf one whose lag setting the Collector did not take says so."""
    label = res["config"]["train_labels"][system]
    if system != "one_process" and enforced is False:
        label += " (not enforced: free-running, lag measured)"
    return label


# ------------------------------------------------------------------ progress lines


def train_line(r: dict[str, Any]) -> str:
    head = f"{r['env_id']:12s} seed {r['seed']} {r['label']}"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r.get('error', '')[-300:]}"
    reached = r["reached"]
    when = f"threshold at {reached['seconds']:.1f} s ({reached['steps']:,} steps)" if reached else "threshold not reached"
    return (f"{head}: {_n(r['steps_per_s'])} steps/s, {when}, return {_n(r['final_return'], '.1f')} at {r['steps']:,} "
            f"steps, lag mean {r['lag_mean']:.2f} max {r['lag_max']}"
            + (f", {r.get('stale_dropped', 0)} stale dropped" if r["lag_enforced"] else " (measured)"))


def atari_line(r: dict[str, Any]) -> str:
    head = f"{r['env']:11s} {r['policy']:6s} {r['label']} [{r['variant']}]"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r.get('error', '')[-300:]}"
    sps = float(np.median(r["windows"]))
    c = r["cpu_cores"]
    return (f"{head}: {sps:,.0f} steps/s, CPU us/step {(c['learner'] + c['children']) / sps * 1e6:,.0f} "
            f"(this process {c['learner'] / sps * 1e6:,.0f}), outside {c['outside']:.2f} cores")


# ------------------------------------------------------------------ summaries


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def train_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (env, system): the seeds' figures and their means."""
    c = res["config"]
    out = []
    for env in c["train_envs"]:
        for s in c["train_systems"]:
            rs = [r for r in res["train_runs"] if r["env_id"] == env and r["system"] == s]
            ok = [r for r in rs if r["status"] == "ok"]
            if not rs:
                continue
            reached = [r["reached"] for r in ok if r["reached"]]
            enforced = {r["lag_enforced"] for r in ok}
            cpu = [r["cpu_us_per_step"] for r in ok if "cpu_us_per_step" in r]
            out.append({
                "env_id": env, "system": s, "runs": len(rs), "ok": len(ok), "seeds": [r["seed"] for r in ok],
                "label": train_label(res, s, None if len(enforced) != 1 else enforced.pop()),
                "steps_per_s": _mean([r["steps_per_s"] for r in ok]),
                "steps_per_s_each": [r["steps_per_s"] for r in ok],
                "reached": len(reached), "time_to_target_s": _mean([x["seconds"] for x in reached]),
                "time_to_target_each": [x["seconds"] if x else None for x in (r["reached"] for r in ok)],
                "steps_to_target": _mean([x["steps"] for x in reached]),
                "lag_mean": _mean([r["lag_mean"] for r in ok]), "lag_max": max((r["lag_max"] for r in ok), default=None),
                "final_return": _mean([r["final_return"] for r in ok]), "steps": _mean([r["steps"] for r in ok]),
                "first_iteration_s": _mean([r["first_iteration_s"] for r in ok]),
                "cpu_us_per_step": {k: _mean([x[k] for x in cpu]) for k in ("learner", "children")} if cpu else None,
                "errors": [r.get("error") for r in rs if r["status"] != "ok"],
            })
    floor = {r["env_id"]: r for r in out if r["system"] == "one_process"}
    for r in out:
        f = floor.get(r["env_id"])
        r["speed_ratio"] = r["steps_per_s"] / f["steps_per_s"] if f and r["steps_per_s"] and f["steps_per_s"] else None
        both = f and r["time_to_target_s"] and f["time_to_target_s"]
        r["time_ratio"] = f["time_to_target_s"] / r["time_to_target_s"] if both else None
    return out


def summarize(res: dict[str, Any]) -> None:
    """``res["train_rows"]``; ``res["rows"]`` (every Atari configuration, ``shown`` marking each system's fastest)
    and ``res["atari_ratios"]`` (each system's against the one-process floor and the fastest peer)."""
    res["train_rows"] = train_rows(res)
    rows = creport._rows(res["runs"])
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        k = (r["env"], r["policy"], r["system"])
        if k not in best or (r["runs"], r["fps"]["median"]) > (best[k]["runs"], best[k]["fps"]["median"]):
            best[k] = r
    order = {s: i for i, s in enumerate(res["config"]["labels"])}
    envs, pols = res["config"]["envs"], res["config"]["policies"]
    for r in rows:
        r["shown"] = best[(r["env"], r["policy"], r["system"])] is r
    rows.sort(key=lambda r: (envs.index(r["env"]) if r["env"] in envs else 99, pols.index(r["policy"]) if r["policy"] in pols
                             else 99, order.get(r["system"], 99), not r["shown"], -r["fps"]["median"]))
    res["rows"] = rows
    ratios = []
    for (env, pol, system), r in best.items():
        floor = best.get((env, pol, res["config"]["floor"]))
        peers = [best[(env, pol, p)] for p in PEERS if (env, pol, p) in best]
        top = max(peers, key=lambda x: x["fps"]["median"]) if peers else None
        ratios.append({"env": env, "policy": pol, "system": system,
                       "vs_floor": r["fps"]["median"] / floor["fps"]["median"] if floor else None,
                       "best_peer": top["system"] if top else None,
                       "vs_best_peer": r["fps"]["median"] / top["fps"]["median"] if top else None})
    res["atari_ratios"] = ratios


# ------------------------------------------------------------------ tables


def _train_tables(res: dict[str, Any]) -> list[str]:
    c = res["config"]
    ppo = c["ppo"]
    out = ["## PPO end to end (CleanRL's ppo.py, examples/ppo_cleanrl.py)", "",
           f"CleanRL's hyperparameters: {ppo['num_envs']} envs x {ppo['num_steps']} steps per iteration, "
           f"lr {ppo['learning_rate']} {'annealed to 0 over the budget' if ppo['anneal_lr'] else 'constant'}, gamma "
           f"{ppo['gamma']}, GAE lambda {ppo['gae_lambda']}, {ppo['num_minibatches']} minibatches, {ppo['update_epochs']} "
           f"epochs, clip {ppo['clip_coef']} (value clipped: {ppo['clip_vloss']}), entropy {ppo['ent_coef']}, value "
           f"{ppo['vf_coef']}, gradient norm {ppo['max_grad_norm']}. Budget {c['total_timesteps']:,} steps per run"
           + ("" if c["full_budget"] else ", stopped once the threshold is reached") + f"; seeds {c['seeds']}. "
           f"shmbuf: {ppo['num_actors']} actors x {ppo['num_envs'] // ppo['num_actors']} envs. Torch on 1 thread in every "
           f"process. max_policy_lag held by the Collector (every batch's lag recorded; rollouts dropped as too old "
           "counted per run). "
           f"Threshold: the mean return of the last {c['return_window']} episodes.", "",
           "| env | system | runs | steps/s | x one process | time to threshold (s) | x one process | reached | "
           "steps to threshold | lag mean / max | return at the end | CPU µs/step (this process / children) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["train_rows"]:
        cpu = r["cpu_us_per_step"]
        each = ", ".join(_n(x, ".1f") for x in r["time_to_target_each"])
        out.append(f"| {r['env_id']} | {r['label']} | {r['ok']}/{r['runs']} | {_n(r['steps_per_s'])} | "
                   f"{_n(r['speed_ratio'], '.2f')}x | {_n(r['time_to_target_s'], '.1f')} ({each}) | "
                   f"{_n(r['time_ratio'], '.2f')}x | {r['reached']}/{r['ok']} | {_n(r['steps_to_target'])} | "
                   f"{_n(r['lag_mean'], '.2f')} / {_n(r['lag_max'])} | "
                   f"{_n(r['final_return'], '.1f')} | "
                   + (f"{_n(cpu['learner'], '.0f')} / {_n(cpu['children'], '.0f')} |" if cpu else "- |"))
    errors = [(r["env_id"], r["system"], e) for r in res["train_rows"] for e in r["errors"]]
    if errors:
        out += ["", "Failed runs:", ""] + [f"- {env} {s}: {e}" for env, s, e in errors]
    out += ["", "steps/s: env steps over the iterations after the first (updates included), mean of the seeds. Time to "
            "threshold: from the run's start (the Collector's start-up included) to the iteration at which the threshold "
            "was reached, mean of the seeds that reached it (each in brackets); x one process: the one-process time over "
            "this one (above 1: sooner). Lag: each iteration's mean policy lag over its rollouts, averaged; max: the "
            "largest of any rollout.", ""]
    return out


def _atari_tables(res: dict[str, Any]) -> list[str]:
    c = res["config"]
    st = c["atari_settings"]
    out = ["## Collection on real Atari", "",
           f"Standard preprocessing on every side: noop_max {st['noop_max']}, frame skip {st['frame_skip']} (max over the "
           f"last two frames), {st['screen']}x{st['screen']} grayscale, {st['stack']}-frame stack, sticky actions "
           f"{st['sticky_actions']}, no life-loss terminal, rewards unclipped, no FIRE on reset. {c['frames_per_batch']} "
           f"agent steps per delivery; {c['passes']} pass(es), {c['windows']} windows of at least {c['window_s']} s after "
           f"{c['warmup_s']} s of warm-up; the figure is the median window (± half the spread). CPU: this process and "
           "every process below it, from /proc, over the windows.", "",
           "| env | policy | system | configuration | agent steps/s | x one process | x best peer | CPU µs/step (this "
           "process / children) | outside cores |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    ratios = {(r["env"], r["policy"], r["system"]): r for r in res.get("atari_ratios", [])}
    for r in res.get("rows", []):
        if not r["shown"]:
            continue
        q = ratios.get((r["env"], r["policy"], r["system"]), {})
        f = r["fps"]
        peer = f" ({q['best_peer']})" if q.get("best_peer") else ""
        out.append(f"| {r['env']} | {r['policy']} | {r['label']} | {r['variant_desc']} | {_n(f['median'])} ±"
                   f"{_n((f['max'] - f['min']) / 2)} | {_n(q.get('vs_floor'), '.2f')}x | "
                   f"{_n(q.get('vs_best_peer'), '.2f')}x{peer} | "
                   f"{_n(r['cpu_us_per_frame']['total'])} ({_n(r['cpu_us_per_frame']['learner'])} / "
                   f"{_n(r['cpu_us_per_frame']['children'])}) | {r['outside_cores']['max']:.2f} |")
    others = [r for r in res.get("rows", []) if not r["shown"]]
    if others:
        out += ["", "Other configurations measured (not each system's fastest):", "",
                "| env | policy | system | configuration | agent steps/s |", "|---|---|---|---|---:|"]
        out += [f"| {r['env']} | {r['policy']} | {r['label']} | {r['variant_desc']} | {_n(r['fps']['median'])} |" for r in others]
    failed = [r for r in res["runs"] if r["status"] != "ok"]
    if failed:
        out += ["", "Failed runs:", ""] + [f"- {r['env']} {r['policy']} {r['label']} [{r['variant']}]: {r['status']}: "
                                           f"{r.get('error', '')[-300:]}" for r in failed]
    if res.get("skipped"):
        out += ["", "Not measured: " + "; ".join(f"{c['labels'].get(s, s)} ({why})" for s, why in res["skipped"].items())]
    return out + [""]


def tables(res: dict[str, Any]) -> str:
    c = res["config"]
    v = ", ".join(f"{k} {x}" for k, x in c["versions"].items())
    head = [f"# Training at speed: {res['date']}" + (" (quick)" if c["quick"] else ""), "",
            f"Machine: {res['machine_line']}; {v}. Load average at start {res['machine']['loadavg_start']}, at end "
            f"{res['machine'].get('loadavg_end')}. The run took {res.get('seconds', 0) / 60:.1f} minutes (PPO "
            f"{res.get('train_seconds', 0) / 60:.1f}).", ""]
    body = _train_tables(res) if res["train_runs"] else []
    body += _atari_tables(res) if res["runs"] else []
    return "\n".join(head + body)


# ------------------------------------------------------------------ plot


def plot(res: dict[str, Any], path: str) -> bool:
    """Learning curves (return against env steps, per env, one thin line per seed in each system's colour), PPO's
    steps/s per system, and the Atari systems' agent steps/s. False without matplotlib or runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    c = res["config"]
    envs = [e for e in c["train_envs"] if any(r["env_id"] == e and r["status"] == "ok" for r in res["train_runs"])]
    atari = [r for r in res.get("rows", []) if r["shown"]]
    if not envs and not atari:
        return False
    fig = plt.figure(figsize=(16, 10 if envs and atari else 5.5))
    grid = fig.add_gridspec(2 if envs and atari else 1, max(len(envs) + 1, 1))
    if envs:
        _curves(res, fig, grid, envs)
    if atari:
        ax = fig.add_subplot(grid[-1, :])
        _atari_bars(res, ax, atari)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _curves(res: dict[str, Any], fig: Any, grid: Any, envs: list[str]) -> None:
    c = res["config"]
    rows = {(r["env_id"], r["system"]): r for r in res["train_rows"]}
    for i, env in enumerate(envs):
        ax = fig.add_subplot(grid[0, i])
        for s in c["train_systems"]:
            runs = [r for r in res["train_runs"] if r["env_id"] == env and r["system"] == s and r["status"] == "ok"]
            for r in runs:
                cu = r["curve"]
                xs = [x for x, y in zip(cu["steps"], cu["return_recent"]) if y is not None]
                ys = [y for y in cu["return_recent"] if y is not None]
                ax.plot(xs, ys, color=COLORS[s], linewidth=0.8, alpha=0.6)
            row = rows.get((env, s))
            if row:
                ax.plot([], [], color=COLORS[s], linewidth=2, label=row["label"])
        target = next((r["target"] for r in res["train_runs"] if r["env_id"] == env and r["status"] == "ok"), None)
        if target is not None:
            ax.axhline(target, color="k", linestyle=":", linewidth=1, label=f"threshold {target:g}")
        ax.set_xlabel("env steps")
        ax.set_ylabel(f"mean return, last {c['return_window']} episodes")
        ax.set_title(f"{env}: one line per seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    ax = fig.add_subplot(grid[0, len(envs)])
    width = 0.8 / max(1, len(c["train_systems"]))
    for j, s in enumerate(c["train_systems"]):
        xs = [g + (j - (len(c["train_systems"]) - 1) / 2) * width for g in range(len(envs))]
        got = [rows.get((e, s)) for e in envs]
        ys = [(r["steps_per_s"] or 0) if r else 0 for r in got]
        bars = ax.bar(xs, ys, width, color=COLORS[s], label=s)
        for b, r in zip(bars, got):
            if r and r["steps_per_s"]:
                ax.annotate(f"{r['steps_per_s']:,.0f}\nlag {r['lag_mean']:.1f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(envs)), envs)
    ax.set_ylabel("env steps/s while training (mean of seeds)")
    ax.set_title("PPO steps/s (lag: mean policy lag)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def _atari_bars(res: dict[str, Any], ax: Any, rows: list[dict[str, Any]]) -> None:
    c = res["config"]
    groups = [(e, p) for e in c["envs"] for p in c["policies"] if any(r["env"] == e and r["policy"] == p for r in rows)]
    systems = [s for s in c["labels"] if any(r["system"] == s for r in rows)]
    by = {(r["env"], r["policy"], r["system"]): r for r in rows}
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        got = [by.get((e, p, s)) for e, p in groups]
        ys = [r["fps"]["median"] if r else 0 for r in got]
        ax.bar(xs, ys, width, color=COLORS.get(s, "k"), label=c["labels"][s])
        for x, y in zip(xs, ys):
            if y:
                ax.annotate(f"{y:,.0f}", (x, y), ha="center", va="bottom", fontsize=6, rotation=90,
                            xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)), [f"{e}\n{p}" for e, p in groups])
    ax.set_ylabel("agent steps/s (median window)")
    ax.set_title(f"Atari collection, {res['machine']['cores']} cores: each system's fastest configuration")
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    _, hi = ax.get_ylim()
    ax.set_ylim(0, hi * 1.15)
