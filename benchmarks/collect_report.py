"""The collection benchmark's figures from its runs: rows, ratios, the aims, the tables and the plot.

Everything here is computed from the results file's raw runs (``--render`` redraws an old file): a row is one
(env, policy, system, configuration), its windows pooled over the passes; a system's shown row is its fastest
configuration; the aims are evaluated from the rows, never typed in.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

OUTSIDE_MARK = 0.25  # cores of outside load above which a row is marked ‡
FLOOR_NAMES = {"floor_vec": "SyncVectorEnv(16) loop", "floor_hand": "16-env hand loop"}


def _n(x: float | None, fmt: str = ",.0f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def line(r: dict[str, Any]) -> str:
    """One run in one line, for the progress output."""
    head = f"{r['env']:8s} {r['policy']:6s} {r['label']} [{r['variant']}]"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r.get('error', '')[-300:]}"
    fps = float(np.median(r["windows"]))
    c = r["cpu_cores"]
    return (f"{head}: {fps:,.0f} frames/s, CPU us/frame learner {c['learner'] / fps * 1e6:.1f} children "
            f"{c['children'] / fps * 1e6:.1f}, outside {c['outside']:.2f} cores")


def ranked_variants(runs: list[dict[str, Any]], env: str, policy: str, system: str) -> list[str]:
    """The configurations of ``system`` measured in ``runs``, fastest first (median window)."""
    rows = [r for r in _rows(runs) if (r["env"], r["policy"], r["system"]) == (env, policy, system)]
    return [r["variant"] for r in sorted(rows, key=lambda r: -r["fps"]["median"])]


def _rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (env, policy, system, variant) that measured: windows pooled, CPU per frame averaged over runs."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r["status"] == "ok":
            groups.setdefault((r["env"], r["policy"], r["system"], r["variant"]), []).append(r)
    out = []
    for (env, pol, system, variant), rs in groups.items():
        windows = [w for r in rs for w in r["windows"]]
        per_frame: dict[str, list[float]] = {"learner": [], "children": [], "outside": [], "machine": []}
        children = []
        for r in rs:
            fps = float(np.median(r["windows"]))
            c = r["cpu_cores"]
            per_frame["learner"].append(c["learner"] / fps * 1e6)
            per_frame["children"].append(c["children"] / fps * 1e6)
            per_frame["outside"].append(c["outside"])
            per_frame["machine"].append(c["machine"])
            children.append(c.get("per_child", []))
        learner, kids = float(np.mean(per_frame["learner"])), float(np.mean(per_frame["children"]))
        out.append({
            "env": env, "policy": pol, "system": system, "variant": variant, "label": rs[0]["label"],
            "variant_desc": rs[0]["variant_desc"], "runs": len(rs),
            "fps": {"median": float(np.median(windows)), "min": min(windows), "max": max(windows), "windows": windows},
            "cpu_us_per_frame": {"learner": learner, "children": kids, "total": learner + kids},
            "outside_cores": {"mean": float(np.mean(per_frame["outside"])), "max": max(per_frame["outside"])},
            "machine_cores": float(np.mean(per_frame["machine"])),
            "busiest_children_cores": children[-1][:4],
            "startup_s": float(np.mean([r.get("startup_s", math.nan) for r in rs])),
        })
    return out


def summarize(res: dict[str, Any]) -> None:
    """``res["rows"]`` (every configuration; ``shown`` marks each system's row), ``res["ratios"]``, ``res["aims"]``.

    A system's row is its fastest configuration among those measured in every pass (with several passes: the first
    pass's two fastest, their windows pooled over the passes), so that one lucky run does not pick it.
    """
    rows = _rows(res["runs"])
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:  # among the configurations measured in the most passes, the fastest
        k = (r["env"], r["policy"], r["system"])
        if k not in best or (r["runs"], r["fps"]["median"]) > (best[k]["runs"], best[k]["fps"]["median"]):
            best[k] = r
    for r in rows:
        r["shown"] = best[(r["env"], r["policy"], r["system"])] is r
    order = {s: i for i, s in enumerate(res["config"]["labels"])}
    rows.sort(key=lambda r: (res["config"]["envs"].index(r["env"]) if r["env"] in res["config"]["envs"] else 9,
                             res["config"]["policies"].index(r["policy"]) if r["policy"] in res["config"]["policies"] else 9,
                             order.get(r["system"], 99), not r["shown"], -r["fps"]["median"]))
    res["rows"] = rows
    ratios = []
    for (env, pol, system), r in best.items():
        for floor in ("floor_vec", "floor_hand"):
            f = best.get((env, pol, floor))
            if f is not None and system != floor:
                ratios.append({"env": env, "policy": pol, "system": system, "against": floor,
                               "fps_ratio": r["fps"]["median"] / f["fps"]["median"],
                               "cpu_ratio": r["cpu_us_per_frame"]["total"] / f["cpu_us_per_frame"]["total"]})
    res["ratios"] = ratios
    res["aims"] = aims(best)


def aims(best: dict[tuple[str, str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """This bench's aims (Collector against the floors and PufferLib, AsyncBatchedCollector against Collector), each
    with its measured figure, for every env (and floor) measured."""
    out: list[dict[str, Any]] = []

    def fps(k: tuple[str, str, str]) -> float:
        return best[k]["fps"]["median"]

    def add(aim: str, env: str, policy: str, against: str, value: float, goal: float, *, at_most: bool = False) -> None:
        out.append({"aim": aim, "env": env, "policy": policy, "against": against, "value": value, "goal": goal,
                    "met": value <= goal if at_most else value >= goal})

    envs = sorted({k[0] for k in best})
    for env in envs:
        for floor, name in FLOOR_NAMES.items():
            for pol, goal in (("linear", 1.7), ("mlp64", 1.0)):
                c, f = (env, pol, "collector"), (env, pol, floor)
                if c in best and f in best:
                    add(f"Collector frames/s >= {goal}x the one-process loop ({pol})", env, pol, f"{name} [{best[f]['variant']}]",
                        fps(c) / fps(f), goal)
            for pol in ("linear", "mlp64"):
                c, f = (env, pol, "collector"), (env, pol, floor)
                if c in best and f in best:
                    add("Collector actor CPU per frame <= 1.15x the one-process loop's", env, pol, name,
                        best[c]["cpu_us_per_frame"]["children"] / best[f]["cpu_us_per_frame"]["total"], 1.15, at_most=True)
        for pol in ("linear", "mlp64"):
            c, p = (env, pol, "collector"), (env, pol, "puffer")
            if c in best and p in best:
                add("Collector frames/s >= 1.5x PufferLib's best configuration", env, pol,
                    f"PufferLib [{best[p]['variant']}]", fps(c) / fps(p), 1.5)
        c, ab = (env, "mlp512", "collector"), (env, "mlp512", "async_batched")
        if c in best and ab in best:
            add("AsyncBatchedCollector frames/s >= Collector's with a 512-unit MLP at 16 envs", env, "mlp512",
                f"Collector [{best[c]['variant']}]", fps(ab) / fps(c), 1.0)
    return out


# ------------------------------------------------------------------ tables


def _label(r: dict[str, Any]) -> str:
    return f"{r['label']} [{r['variant']}]"


def tables(res: dict[str, Any]) -> str:
    c = res["config"]
    v = c["versions"]
    lines = [f"# Collection benchmark, {res['date']}", "",
             (f"Machine: {res['machine_line']}; torch {v['torch']}, torchrl {v['torchrl']}, gymnasium {v['gymnasium']}, "
              f"pufferlib-core {v['pufferlib-core']}. Load average at start {res['machine']['loadavg_start']}, "
              f"at end {res['machine'].get('loadavg_end')}."), "",
             (f"Settings: 16 envs in every system; {c['passes']} pass(es), {c['windows']} windows of at least "
              f"{c['window_s']} s per run after {c['warmup_s']} s of warm-up (start-up excluded), frames counted at "
              f"delivery ({c['frames_per_batch']} per batch or stored rollout), each figure the median of the pooled "
              f"windows (± half their spread). Policies: " + "; ".join(f"{k}: {d}" for k, d in c["policy_desc"].items())
              + f"; the atari policies read {c['atari_policy_input']}. Torch on one thread everywhere. "
              f"The sweep took {res.get('seconds', 0) / 60:.1f} minutes."), "",
             ("**CPU µs/frame**: this process (the learner: for the one-process systems, the whole loop) / its child "
              "processes (actors, env workers) / both, from /proc over the windows. **outside**: cores busy outside the "
              f"run, from /proc/stat (‡: more than {OUTSIDE_MARK}). **× floor**: frames/s against each one-process loop."), ""]
    if c["quick"]:
        lines += ["**Quick run**: each system's first configuration only, short windows: a look, not a measurement.", ""]
    rows = res.get("rows", [])
    outside = [r["cpu_cores"]["outside"] for r in res["runs"] if r["status"] == "ok"]
    if outside and float(np.median(outside)) > OUTSIDE_MARK:
        lines += [(f"**Load from outside the run**: median {float(np.median(outside)):.2f} core, at most {max(outside):.2f}, "
                   f"over the runs: the machine was shared, so these figures are noisy (compare the ± spreads); a quiet "
                   "machine gives the figures to quote."), ""]
    for env in c["envs"]:
        for pol in c["policies"]:
            shown = [r for r in rows if r["env"] == env and r["policy"] == pol and r["shown"]]
            if not shown:
                continue
            floors = {r["system"]: r for r in shown if r["system"] in FLOOR_NAMES}
            lines += [f"## {env}, {pol}", "",
                      "| system [configuration] | frames/s | × floor (vec) | × floor (hand) | CPU µs/frame learner / children / "
                      "total | outside |", "|---|---:|---:|---:|---:|---:|"]
            for r in shown:
                fps = r["fps"]
                spread = f" ±{(fps['max'] - fps['min']) / 2:,.0f}" if len(fps["windows"]) > 1 else ""
                mark = " ‡" if r["outside_cores"]["max"] > OUTSIDE_MARK else ""
                x = [f"{fps['median'] / floors[f]['fps']['median']:.2f}x" if f in floors else "n/a" for f in FLOOR_NAMES]
                cpu = r["cpu_us_per_frame"]
                lines.append(f"| {_label(r)} | {_n(fps['median'])}{spread}{mark} | {x[0]} | {x[1]} | {cpu['learner']:.1f} / "
                             f"{cpu['children']:.1f} / {cpu['total']:.1f} | {r['outside_cores']['mean']:.2f} |")
            lines.append("")
    if res.get("aims"):
        lines += ["## Aims (computed from the rows above)", "",
                  "| aim | env | policy | against | measured | goal | met |", "|---|---|---|---|---:|---:|---|"]
        for m in res["aims"]:
            lines.append(f"| {m['aim']} | {m['env']} | {m['policy']} | {m['against']} | {m['value']:.2f}x | {m['goal']}x | "
                         f"{'yes' if m['met'] else '**no**'} |")
        lines.append("")
    lines += _where_the_time_goes(res)
    lines += [("## Every configuration (in bold, each system's row above: the fastest of those measured in every pass, "
               "the first pass's two fastest)"), "",
              "| env | policy | system | configuration | frames/s | CPU µs/frame learner / children | start-up s | runs |",
              "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        name, fps = r["variant_desc"], _n(r["fps"]["median"])
        if r["shown"]:
            name, fps = f"**{name}**", f"**{fps}**"
        cpu = r["cpu_us_per_frame"]
        lines.append(f"| {r['env']} | {r['policy']} | {r['label']} | {name} | {fps} | {cpu['learner']:.1f} / "
                     f"{cpu['children']:.1f} | {_n(r['startup_s'], '.1f')} | {r['runs']} |")
    lines.append("")
    bad = [r for r in res["runs"] if r["status"] != "ok"]
    if bad or res.get("skipped"):
        lines += ["## Not measured", ""]
        lines += [f"- {r['env']} {r['policy']} {_label(r)}: {r['status']}: {(r.get('error') or '').splitlines()[-1][:200]}"
                  for r in bad if (r.get("error") or "").splitlines()]
        lines += [f"- {c['labels'].get(s, s)}: {why}" for s, why in res.get("skipped", {}).items()]
        lines.append("")
    return "\n".join(lines)


def _where_the_time_goes(res: dict[str, Any]) -> list[str]:
    """Per env and policy: the Collector's CPU per frame against the floor's, the rate 2 cores allow at that cost, and the
    cost the frames/s aim would allow."""
    cores = res["machine"].get("cores_usable") or res["machine"].get("cores") or 2
    best = {(r["env"], r["policy"], r["system"]): r for r in res.get("rows", []) if r["shown"]}
    out = []
    for (env, pol, system), col in best.items():
        floor = best.get((env, pol, "floor_vec"))
        if system != "collector" or floor is None:
            continue
        goal = {"linear": 1.7}.get(pol, 1.0)
        cpu, f_cpu = col["cpu_us_per_frame"], floor["cpu_us_per_frame"]["total"]
        busy = cpu["total"] * col["fps"]["median"] / 1e6
        out.append(f"| {env} | {pol} | {f_cpu:.1f} | {cpu['children']:.1f} / {cpu['learner']:.1f} | {busy:.2f} | "
                   f"{_n(cores / cpu['total'] * 1e6)} | {_n(col['fps']['median'])} | {goal}x: {_n(goal * floor['fps']['median'])}"
                   f" | {cores / (goal * floor['fps']['median']) * 1e6:.1f} |")
    if not out:
        return []
    return ["## Where the Collector's time goes (from the rows above)", "",
            (f"CPU per frame against the one-process loop's (SyncVectorEnv row), the rate {cores} cores allow at the "
             "Collector's cost if both were busy all the time, and the cost per frame at which they would allow the aim's "
             f"rate. **cores busy**: the Collector's processes, in its row's configuration; below {cores}, frames/s stay "
             "below the bound (one actor, or actors waiting)."), "",
            ("| env | policy | floor CPU µs/frame | Collector actors / learner µs/frame | cores busy | bound frames/s | "
             "measured | aim frames/s | µs/frame the aim allows |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"] + out + [""]


# ------------------------------------------------------------------ plot

COLORS = {"floor_vec": "#7f7f7f", "floor_hand": "#c7c7c7", "gym_async": "#9467bd", "puffer": "#2ca02c",
          "torchrl_multisync": "#1f77b4", "collector": "#d62728", "async_batched": "#ff9896"}


def plot(res: dict[str, Any], path: str) -> bool:
    """Frames/s per system (its fastest configuration) for each env x policy, the floors as lines; CPU per frame."""
    return bars_and_cpu(res, path, colors=COLORS, unit="frame", rate_label="frames/s (median window)",
                        floors=[("floor_vec", "-", "floor: SyncVectorEnv(16) loop"),
                                ("floor_hand", "--", "floor: 16 envs by hand")],
                        title=f"16 envs, {res['machine']['cores']} cores: frames/s per system (its fastest configuration)",
                        cpu_title="CPU per frame: child processes (actors, env workers); stacked on them, this process "
                                  "(learner, or the loop)")


def bars_and_cpu(res: dict[str, Any], path: str, *, colors: dict[str, str], unit: str, rate_label: str,
                 floors: list[tuple[str, str, str | None]], title: str, cpu_title: str | None = None) -> bool:
    """The collection benchmarks' figure: above, each system's rate (its fastest configuration) as a bar per env x
    policy, log scale, with each floor system as a line across its group (``floors``: system, line style, legend
    label or None); below, CPU µs per ``unit``, child processes solid with this process stacked on them, hatched.
    ``res`` is a results dict of ``benchmarks.collect``'s shape. Returns False without matplotlib or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    c = res["config"]
    rows = [r for r in res.get("rows", []) if r["shown"]]
    groups = [(e, p) for e in c["envs"] for p in c["policies"] if any(r["env"] == e and r["policy"] == p for r in rows)]
    systems = [s for s in c["labels"] if any(r["system"] == s for r in rows)]
    if not groups:
        return False
    by = {(r["env"], r["policy"], r["system"]): r for r in rows}
    fig, (ax_f, ax_c) = plt.subplots(2, 1, figsize=(max(9.0, 2.2 * len(groups) + 3), 10), sharex=True)
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        got = [by.get((e, p, s)) for e, p in groups]
        rate = [r["fps"]["median"] if r else 0 for r in got]
        bars = ax_f.bar(xs, rate, width, color=colors.get(s, "k"), label=c["labels"][s])
        for b, f, r in zip(bars, rate, got):
            if r:
                k = f"{f / 1000:.0f}k" if f >= 10_000 else f"{f / 1000:.1f}k"
                ax_f.annotate(f"{k} {r['variant']}", (b.get_x() + b.get_width() / 2, f),
                              ha="center", va="bottom", fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
        kids = [r["cpu_us_per_frame"]["children"] if r else 0 for r in got]
        learner = [r["cpu_us_per_frame"]["learner"] if r else 0 for r in got]
        ax_c.bar(xs, kids, width, color=colors.get(s, "k"))
        ax_c.bar(xs, learner, width, bottom=kids, color=colors.get(s, "k"), alpha=0.45, hatch="//", edgecolor="white")
    for g, (e, p) in enumerate(groups):
        for floor, style, _ in floors:
            r = by.get((e, p, floor))
            if r:
                ax_f.hlines(r["fps"]["median"], g - 0.45, g + 0.45, colors="k", linestyles=style, linewidth=1)
    for _, style, label in floors:
        if label:
            ax_f.hlines([], 0, 0, colors="k", linestyles=style, linewidth=1, label=label)
    ax_f.set_ylabel(rate_label)
    ax_f.set_yscale("log")
    _, hi = ax_f.get_ylim()
    ax_f.set_ylim(min(r["fps"]["median"] for r in rows) / 3, hi * 12)  # every bar's foot in view; room for the labels
    ax_f.grid(axis="y", which="both", alpha=0.3)
    ax_f.set_title(title)
    ax_f.legend(fontsize=8, ncol=4, loc="upper right")
    ax_c.set_ylabel(f"CPU µs per {unit}\n(solid: child processes; hatched: this process)")
    ax_c.set_yscale("log")
    lowest = min((r["cpu_us_per_frame"][k] for r in rows for k in ("learner", "children") if r["cpu_us_per_frame"][k] > 0),
                 default=1.0)
    ax_c.set_ylim(bottom=lowest / 3)  # a log axis would start at the smallest bar's top
    ax_c.grid(axis="y", which="both", alpha=0.3)
    ax_c.set_xticks(range(len(groups)), [f"{e}\n{p}" for e, p in groups])
    if cpu_title:
        ax_c.set_title(cpu_title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
