"""From raw run records to the numbers people read: per-run summaries, the targets of issue 3, a table, a plot."""

from __future__ import annotations

from typing import Any

import numpy as np

NAMES = {"shmbuf": "shmbuf", "echo": "echo (TCP)", "faster_fifo": "faster_fifo", "mp_queue": "mp.Queue"}


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "windows": []}
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "windows": [float(v) for v in values]}


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Rollouts/s, MB/s, latency and CPU per rollout of one run, each as median over windows with min/max."""
    out = {k: rec[k] for k in ("system", "payload", "mode", "actors", "batch", "status")}
    if rec["status"] != "ok":
        out["detail"] = rec.get("stall") or rec.get("error")
        return out
    learner = rec["learner"]
    cuts = learner["cuts"]
    b = rec["batch"]
    rps, lcpu, lsw = [], [], []
    for k in range(1, len(cuts)):
        dt = cuts[k]["t"] - cuts[k - 1]["t"]
        n = (cuts[k]["batches"] - cuts[k - 1]["batches"]) * b
        rps.append(n / dt)
        lcpu.append((cuts[k]["cpu_ns"] - cuts[k - 1]["cpu_ns"]) / 1e3 / n)
        lsw.append((cuts[k]["vcsw"] + cuts[k]["ivcsw"] - cuts[k - 1]["vcsw"] - cuts[k - 1]["ivcsw"]) / n)
    out["rollouts_per_s"] = _spread(rps)
    out["mb_per_s"] = _spread([r * rec["rollout_bytes"] / 1e6 for r in rps])
    lat = [w for w in learner["latency_us"] if w]
    out["latency_us"] = {"p50": _spread([w["p50"] for w in lat]), "p99": _spread([w["p99"] for w in lat])}
    actor_cpu, actor_sw = _actor_usage(rec["actor_rows"])
    out["cpu_us_per_rollout"] = {"learner": _spread(lcpu)["median"], "actors": actor_cpu}
    out["context_switches_per_rollout"] = {"learner": _spread(lsw)["median"], "actors": actor_sw}
    # Cores busy on the machine during the windows, less what this run's learner and actors used: other people's load.
    if rec.get("machine_busy_cores") is not None and actor_cpu is not None:
        span = cuts[-1]["t"] - cuts[0]["t"]
        n_all = (cuts[-1]["batches"] - cuts[0]["batches"]) * b
        mine = ((cuts[-1]["cpu_ns"] - cuts[0]["cpu_ns"]) / 1e9 + actor_cpu * 1e-6 * n_all) / span
        out["other_load_cores"] = round(max(0.0, rec["machine_busy_cores"] - mine), 2)
    return out


def _actor_usage(rows: list[list[list[int]]]) -> tuple[float | None, float | None]:
    """All actors' CPU (µs) and context switches over the measured windows, per rollout they sent meanwhile."""
    cpu = n = sw = 0
    for row in rows:
        # From the first window's start to the last phase this actor noted (the stop, unless it was blocked).
        seen = [p for p in range(1, len(row)) if row[p][0] >= 0]
        if len(seen) < 2:
            continue
        a, z = row[seen[0]], row[seen[-1]]
        n += z[0] - a[0]
        cpu += z[1] - a[1]
        sw += z[2] + z[3] - a[2] - a[3]
    return (cpu / 1e3 / n, sw / n) if n else (None, None)


def find(summaries: list[dict[str, Any]], **key: Any) -> dict[str, Any] | None:
    for s in summaries:
        if all(s.get(k) == v for k, v in key.items()):
            return s
    return None


def _med(s: dict[str, Any] | None, *path: str) -> float | None:
    if s is None or s["status"] != "ok":
        return None
    x: Any = s
    for p in path:
        x = x[p]
    return x["median"] if isinstance(x, dict) else x


def copy_bound(rollout_bytes: int, cores: int, copy_gb_s: float) -> float:
    """Rollouts/s a design that copies each byte twice (the actor's write into the slot, the learner's
    gather into the batch) cannot exceed with ``cores`` cores copying at ``copy_gb_s`` each."""
    return cores * copy_gb_s * 1e9 / (2 * rollout_bytes)


def targets(summaries: list[dict[str, Any]], micro: dict[str, Any] | None, copy_bw: dict[str, Any],
            stalls: list[dict[str, Any]], cores: int = 2, payload_bytes: dict[str, int] | None = None
            ) -> list[dict[str, Any]]:
    """Each target of issue 3: the figures, the ratio, met or not (None when a figure is missing)."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool | None, detail: str = "") -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met, "detail": detail})

    need = {"small": 4.0, "rl": 8.0, "atari": 10.0}
    for payload, k in need.items():
        shm = _med(find(summaries, system="shmbuf", payload=payload, mode="transport", actors=2), "rollouts_per_s")
        for other in ("echo", "faster_fifo", "mp_queue"):
            o = _med(find(summaries, system=other, payload=payload, mode="transport", actors=2), "rollouts_per_s")
            ratio = shm / o if shm and o else None
            goal = k if other == "echo" else 1.0
            detail = f"{shm and round(shm)} vs {o and round(o)} rollouts/s"
            if other == "echo" and o and payload_bytes and payload != "small":
                bound = copy_bound(payload_bytes[payload], cores, copy_bw["dram"])
                detail += f"; 2-copy bound at DRAM copy speed {bound:,.0f}/s = {bound / o:.1f}x echo"
            add(f"transport {payload}, 2 actors: shmbuf / {NAMES[other]} rollouts/s", ratio, f">= {goal:g}x",
                None if ratio is None else ratio >= goal, detail)
    atari = find(summaries, system="shmbuf", payload="atari", mode="transport", actors=2)
    mb = _med(atari, "mb_per_s")
    for label, bw in (("cache-resident copy (one rollout)", copy_bw["rollout"]), ("DRAM copy (128 MiB)", copy_bw["dram"])):
        frac = mb / (bw * 1e3) if mb else None
        add(f"transport atari, 2 actors: shmbuf MB/s / single-core {label}", frac, ">= 0.40",
            None if frac is None else frac >= 0.40, f"{mb and round(mb)} MB/s vs {bw * 1e3:.0f} MB/s")
    shm = find(summaries, system="shmbuf", payload="small", mode="step", actors=2)
    ech = find(summaries, system="echo", payload="small", mode="step", actors=2)
    a = shm["cpu_us_per_rollout"]["actors"] if shm and shm["status"] == "ok" else None
    e = ech["cpu_us_per_rollout"]["actors"] if ech and ech["status"] == "ok" else None
    r = a / e if a and e else None
    add("step small, 2 actors: actor CPU per rollout shmbuf / echo", r, "<= 0.333", None if r is None else r <= 1 / 3,
        f"{a and round(a, 1)} vs {e and round(e, 1)} µs per rollout")
    if micro:
        for kind, label in (("scalars", "scalar items (headline)"), ("arrays", "0-d array items")):
            x = micro[kind]
            r = x["ratio_shmbuf_to_echo"]
            add(f"step small: Writer.add / TrajectoryAccumulator.add per step, {label}", r, "<= 0.4", r <= 0.4,
                f"{x['shmbuf']['us_per_add']:.2f} vs {x['echo']['us_per_add']:.2f} µs per add")
    for payload in ("small", "rl", "atari"):
        s = _med(find(summaries, system="shmbuf", payload=payload, mode="transport", actors=2), "latency_us", "p99")
        e = _med(find(summaries, system="echo", payload=payload, mode="transport", actors=2), "latency_us", "p99")
        r = s / e if s and e else None
        add(f"latency at saturation, {payload}, 2 actors: shmbuf p99 / echo p99", r, "<= 0.1", None if r is None else r <= 0.1,
            f"{s and round(s)} vs {e and round(e)} µs")
    shm_stalls = [x for x in stalls if x["system"] == "shmbuf"]
    add("stalls of shmbuf in the whole sweep", len(shm_stalls), "0", not shm_stalls)
    return out


def _cells(row: list, fmt: Any) -> list[str]:
    """One table cell per run: blank where a run is missing, its status where it did not finish, else ``fmt(run)``."""
    return ["" if r is None else r["status"].upper() if r["status"] != "ok" else fmt(r) for r in row]


def _fmt(x: float | None, nd: int = 0) -> str:
    if x is None:
        return "–"
    if nd == 0:
        return f"{x:,.0f}"
    return f"{x:,.{nd}f}"


LOADED = 0.75  # cores of other people's load above which a figure is marked


def _cell(s: dict[str, Any] | None, key: str, nd: int = 0) -> str:
    if s is None:
        return ""
    if s["status"] != "ok":
        return s["status"].upper()
    v = s[key]
    if v["median"] is None:
        return "–"
    spread = (v["max"] - v["min"]) / v["median"] * 100 if v["median"] else 0
    mark = " ‡" if (s.get("other_load_cores") or 0) > LOADED else ""
    return f"{_fmt(v['median'], nd)} ±{spread / 2:.0f}%{mark}"


def markdown(result: dict[str, Any]) -> str:
    """The Markdown page: machine line, the throughput tables, latency, CPU, the targets."""
    S = result["summaries"]
    systems = result["config"]["systems"]
    m = result["machine"]
    lines = [f"# shmbuf benchmark {result['date']} on {m['host']}", "", f"Machine: {result['machine_line']}", "",
             f"Single-core `np.copyto` bandwidth in this run: {result['copy_bandwidth']['rollout']:.1f} GB/s "
             f"on one atari rollout (cache-resident), {result['copy_bandwidth']['dram']:.1f} GB/s on 128 MiB (DRAM).",
             "", f"Sweep: B={result['config']['batch']} stacked rollouts per batch, queue depth {result['config']['depth']}, "
             f"{result['config']['windows']} windows of {result['config']['window_s']} s after {result['config']['warmup_s']} s "
             f"of warm-up; medians over windows, ± half the min–max spread. Load average at start "
             f"{m['loadavg_start'][0]:.2f}, at end {m.get('loadavg_end', [0])[0]:.2f}. ‡: more than {LOADED} core of "
             f"other people's load on the machine during that run (see the section on it below).", ""]
    for mode, title in (("transport", "Transport mode (actors send a built rollout)"),
                        ("step", "Step mode (actors add T steps, then commit / build + send)")):
        ms = [s for s in systems if any(x["mode"] == mode and x["system"] == s for x in S)]
        if not ms:
            continue
        lines += [f"## {title}: rollouts/s", "", "| payload | actors | " + " | ".join(NAMES[s] for s in ms) + " | "
                  + " | ".join(f"shmbuf / {NAMES[s]}" for s in ms if s != "shmbuf") + " |",
                  "|---|---:|" + "---:|" * (2 * len(ms) - 1)]
        for payload in result["config"]["payloads"]:
            for n in result["config"]["actors"]:
                row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in ms]
                if not any(row):
                    continue
                shm = _med(row[ms.index("shmbuf")], "rollouts_per_s") if "shmbuf" in ms else None
                ratios = []
                for s, r in zip(ms, row):
                    if s == "shmbuf":
                        continue
                    o = _med(r, "rollouts_per_s")
                    ratios.append(f"{shm / o:.2f}x" if shm and o else "–")
                lines.append(f"| {payload} | {n} | " + " | ".join(_cell(r, "rollouts_per_s") for r in row) + " | "
                             + " | ".join(ratios) + " |")
        bw = result["copy_bandwidth"]
        lines += ["", f"## {title}: MB/s", "", "| payload | actors | " + " | ".join(NAMES[s] for s in ms)
                  + " | shmbuf / 1-core copy (DRAM; cache-resident) |", "|---|---:|" + "---:|" * (len(ms) + 1)]
        for payload in result["config"]["payloads"]:
            for n in result["config"]["actors"]:
                row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in ms]
                if any(row):
                    mb = _med(row[ms.index("shmbuf")], "mb_per_s") if "shmbuf" in ms else None
                    frac = f"{mb / (bw['dram'] * 1e3):.1%}; {mb / (bw['rollout'] * 1e3):.1%}" if mb else "–"
                    lines.append(f"| {payload} | {n} | " + " | ".join(_cell(r, "mb_per_s") for r in row) + f" | {frac} |")
        lines += ["", f"## {title}: CPU µs per rollout (actors, all of them / learner)", "",
                  "| payload | actors | " + " | ".join(NAMES[s] for s in ms) + " |", "|---|---:|" + "---:|" * len(ms)]
        for payload in result["config"]["payloads"]:
            for n in result["config"]["actors"]:
                row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in ms]
                if not any(row):
                    continue
                cells = _cells(row, lambda r: f"{_fmt(r['cpu_us_per_rollout']['actors'], 1)} / "
                                              f"{_fmt(r['cpu_us_per_rollout']['learner'], 1)}")
                lines.append(f"| {payload} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Latency, send/commit to the learner holding the batch: p50 / p99 µs", "",
              "| payload | load | " + " | ".join(NAMES[s] for s in systems) + " |", "|---|---|" + "---:|" * len(systems)]
    for payload in result["config"]["payloads"]:
        for mode, label in (("latency", f"paced, {result['config']['pace_rate']:g}/s, B=1"),
                            ("transport", f"saturation, B={result['config']['batch']}")):
            n = result["config"]["latency_actors"]
            row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in systems]
            if not any(row):
                continue
            cells = _cells(row, lambda r: f"{_fmt(_med(r, 'latency_us', 'p50'))} / {_fmt(_med(r, 'latency_us', 'p99'))}")
            lines.append(f"| {payload} | {label}, {n} actors | " + " | ".join(cells) + " |")
    lines.append("")
    if result.get("microbench"):
        mb = result["microbench"]
        lines += ["## Per-step accumulate (one process, small payload, µs per `add`)", "",
                  "| items | shmbuf `Writer.add` | echo `TrajectoryAccumulator.add` | ratio (median of windows) |",
                  "|---|---:|---:|---:|"]
        for kind, label in (("scalars", "numpy scalars (`reward[t]`)"), ("arrays", "arrays, 0-d for scalars (`reward[t, ...]`)")):
            x = mb[kind]
            lines.append(f"| {label} | {x['shmbuf']['us_per_add']:.2f} | {x['echo']['us_per_add']:.2f} | "
                         f"{x['ratio_shmbuf_to_echo']:.2f} ({x['ratio_min']:.2f}–{x['ratio_max']:.2f}) |")
        lines.append("")
    other = [(x.get("other_load_cores"), x) for x in S if x.get("other_load_cores") is not None]
    if other:
        vals = [o for o, _ in other]
        busy = [x for o, x in other if o > 0.25]
        named = ", ".join(f"{NAMES[x['system']]} {x['payload']} {x['mode']} x{x['actors']} ({x['other_load_cores']:.2f})"
                          for x in busy)
        lines += ["## Other load on the machine during the runs", "",
                  f"Cores busy with processes outside the run (from /proc/stat, less the run's own CPU): median "
                  f"{np.median(vals):.2f}, max {max(vals):.2f}; {len(busy)} of {len(other)} runs saw more than 0.25 core"
                  + (f": {named}" if busy else "") + ".", ""]
    lines += ["## Stalls", ""]
    if result["stalls"]:
        for s in result["stalls"]:
            lines.append(f"- {NAMES[s['system']]}, {s['payload']}, {s['mode']}, {s['actors']} actors: {s['status']} "
                         f"({s.get('detail')})")
    else:
        lines.append("None.")
    lines += ["", "## Targets (issue 3)", "", "| target | value | goal | met |", "|---|---:|---|---|"]
    for t in result["targets"]:
        v = t["value"]
        vs = "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} ({t['detail']}) | {vs} | {t['goal']} | {met} |" if t["detail"]
                     else f"| {t['target']} | {vs} | {t['goal']} | {met} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """Rollouts/s and MB/s against actor count, one panel per payload, transport mode (step mode dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = result["summaries"]
    payloads = result["config"]["payloads"]
    fig, axes = plt.subplots(2, len(payloads), figsize=(4.6 * len(payloads), 7.5), squeeze=False)
    colors = {"shmbuf": "C0", "echo": "C3", "faster_fifo": "C2", "mp_queue": "C7"}
    for j, payload in enumerate(payloads):
        for i, (key, label) in enumerate((("rollouts_per_s", "rollouts/s"), ("mb_per_s", "MB/s"))):
            ax = axes[i][j]
            for mode, style in (("transport", "-"), ("step", "--")):
                for s in result["config"]["systems"]:
                    pts = [(x["actors"], x[key]) for x in S
                           if x["system"] == s and x["payload"] == payload and x["mode"] == mode and x["status"] == "ok"]
                    if not pts:
                        continue
                    xs = [p[0] for p in pts]
                    ys = [p[1]["median"] for p in pts]
                    lo = [p[1]["median"] - p[1]["min"] for p in pts]
                    hi = [p[1]["max"] - p[1]["median"] for p in pts]
                    ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style + "o", color=colors[s], capsize=3, ms=4,
                                label=f"{NAMES[s]} ({mode})")
                    for x in S:  # mark stalls on the axis
                        if x["system"] == s and x["payload"] == payload and x["mode"] == mode and x["status"] != "ok":
                            ax.plot([x["actors"]], [0], "x", color=colors[s], ms=9)
            ax.set_yscale("log")
            ax.set_xticks(result["config"]["actors"])
            ax.set_xlabel("actor processes")
            ax.set_ylabel(label)
            ax.set_title(f"{payload} ({result['payload_bytes'][payload] / 1e6:.3g} MB/rollout)" if i == 0 else "")
            ax.grid(True, which="both", alpha=0.3)
        if payload == "atari":
            bw = result["copy_bandwidth"]["dram"] * 1e3
            axes[1][j].axhline(bw, color="k", ls=":", lw=1, label="1-core copy, DRAM")
    axes[0][0].legend(fontsize=7, loc="lower left")
    axes[1][-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"shmbuf vs echo TCP vs queues, B={result['config']['batch']} batches — {result['machine']['cpu_model']}, "
                 f"{result['machine']['cores']} cores, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
