"""The Ray benchmark's numbers from its raw runs: rows, the ratios, the aims, the table page and the plot.

``benchmarks/on_ray.py`` measures and calls :func:`build` and :func:`write`; ``--render`` redoes them from a
results file alone. Every ratio's denominator among the plain Ray actors is their best configuration in
that workload (the highest median rollouts/s), named wherever it appears.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import numpy as np

SYSTEMS = ("shmbuf", "shmbuf_ray", "shmbuf_ray_hop", "ray_actors", "shmbuf_ray_2node", "ray_actors_2node")
LETTER = {"shmbuf_ray": "(a)", "ray_actors": "(b)", "shmbuf": "(c)"}
AIM_VS_RAY = 2.0  # (a) / (b) at least: shmbuf on Ray against plain Ray actors
AIM_VS_SHMBUF = 0.7  # (a) / (c) at least, one node: within 30 % of shmbuf alone

def label(rec: dict[str, Any]) -> str:
    """The row a record belongs to: the system, and the peer's configuration."""
    if rec["system"].startswith("ray_actors"):
        return f"{rec['system']} [{rec['per_call']}/call, {rec['in_flight']} in flight]"
    return rec["system"]


# -- summaries, ratios, aims -------------------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "windows": [round(float(v), 3) for v in values]}


def summarize(runs: list[dict[str, Any]], clk_tck: int) -> list[dict[str, Any]]:
    """One row per (label, workload): medians over every window of every repeat."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        key = (label(r), r["workload"])
        row = rows.setdefault(key, {"label": key[0], "system": r["system"], "workload": r["workload"], "nodes": r["nodes"],
                                    "per_call": r["per_call"], "in_flight": r["in_flight"], "runs": 0, "ok_runs": 0,
                                    "errors": [], "_start": [],
                                    "_w": {k: [] for k in ("rps", "fps", "mcpu", "ocpu", "lcpu", "busy", "outside")}})
        row["runs"] += 1
        if r["status"] != "ok":
            row["errors"].append(f"repeat {r['repeat']}: {r['status']}: {r.get('error')}")
            continue
        row["ok_runs"] += 1
        row["_start"].append(r["startup_s"])
        cuts = r["cuts"]
        for a, b in itertools.pairwise(cuts):
            dt, n = b["t"] - a["t"], b["rollouts"] - a["rollouts"]
            if dt <= 0 or n <= 0:
                continue
            busy_s = (b["busy_jiffies"] - a["busy_jiffies"]) / clk_tck
            row["_w"]["rps"].append(n / dt)
            row["_w"]["fps"].append((b["frames"] - a["frames"]) / dt)
            row["_w"]["mcpu"].append(busy_s / n * 1e6)
            row["_w"]["lcpu"].append((b["learner_cpu_s"] - a["learner_cpu_s"]) / n * 1e6)
            row["_w"]["busy"].append(busy_s / dt)
            if "ours_jiffies" in a:  # results files from before it was recorded lack it
                ours_s = (b["ours_jiffies"] - a["ours_jiffies"]) / clk_tck
                row["_w"]["ocpu"].append(ours_s / n * 1e6)
                row["_w"]["outside"].append(max(0.0, busy_s - ours_s) / dt)
    out = []
    for row in rows.values():
        w = row.pop("_w")
        start = row.pop("_start")
        row.update({"rollouts_per_s": _spread(w["rps"]), "frames_per_s": _spread(w["fps"]),
                    "machine_cpu_us_per_rollout": _spread(w["mcpu"]), "learner_cpu_us_per_rollout": _spread(w["lcpu"]),
                    "machine_busy_cores": _spread(w["busy"]), "startup_s": _spread(start),
                    "run_cpu_us_per_rollout": _spread(w["ocpu"]), "outside_cores": _spread(w["outside"])})
        row["status"] = "ok" if row["rollouts_per_s"] else "failed"
        out.append(row)
    return out


def _med(row: dict[str, Any] | None, key: str = "rollouts_per_s") -> float | None:
    return row[key]["median"] if row and row.get(key) else None


def best_peer(rows: list[dict[str, Any]], workload: str, system: str = "ray_actors") -> dict[str, Any] | None:
    """The peer's best configuration on ``workload``: the highest median rollouts/s."""
    got = [r for r in rows if r["system"] == system and r["workload"] == workload and _med(r)]
    return max(got, key=_med) if got else None


def _cpu(row: dict[str, Any] | None) -> float | None:
    """A row's CPU per rollout: its own processes', or the whole machine's where that was not recorded."""
    return _med(row, "run_cpu_us_per_rollout") or _med(row, "machine_cpu_us_per_rollout")


def row_of(rows: list[dict[str, Any]], system: str, workload: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["system"] == system and r["workload"] == workload), None)


def ratios(rows: list[dict[str, Any]], workloads: list[str]) -> dict[str, dict[str, Any]]:
    """Per workload, from the rows' medians: (a)/(b) against the peer's best, (a)/(c), and the two-node ones."""
    out = {}
    for wl in workloads:
        a, c = _med(row_of(rows, "shmbuf_ray", wl)), _med(row_of(rows, "shmbuf", wl))
        b_row, b2_row = best_peer(rows, wl), best_peer(rows, wl, "ray_actors_2node")
        b, b2 = _med(b_row), _med(b2_row)
        a2 = _med(row_of(rows, "shmbuf_ray_2node", wl))
        hop = _med(row_of(rows, "shmbuf_ray_hop", wl))
        out[wl] = {
            "hop_over_b": hop / b if hop and b else None, "hop_over_c": hop / c if hop and c else None,
            "a_over_b": a / b if a and b else None, "b_best": b_row["label"] if b_row else None,
            "a_over_c": a / c if a and c else None,
            "a2_over_b2": a2 / b2 if a2 and b2 else None, "b2": b2_row["label"] if b2_row else None,
            "a2_over_a": a2 / a if a2 and a else None,
        }
    return out


def aims(rat: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The aims, per workload: (a) >= 2x (b); (a) within 30 % of (c) on one node."""
    out = []
    for wl, r in rat.items():
        out.append({"aim": f"{wl}: shmbuf_ray / ray_actors' best >= {AIM_VS_RAY:g}", "value": r["a_over_b"],
                    "met": None if r["a_over_b"] is None else r["a_over_b"] >= AIM_VS_RAY})
        out.append({"aim": f"{wl}: shmbuf_ray / shmbuf >= {AIM_VS_SHMBUF:g} (within 30 %)", "value": r["a_over_c"],
                    "met": None if r["a_over_c"] is None else r["a_over_c"] >= AIM_VS_SHMBUF})
        if r.get("hop_over_c") is not None:  # the same with the learner's node behind an owner, as a remote one is
            out.append({"aim": f"{wl}: through Ray's object store (local_node=False): / ray_actors' best >= "
                               f"{AIM_VS_RAY:g}", "value": r["hop_over_b"], "met": r["hop_over_b"] >= AIM_VS_RAY})
            out.append({"aim": f"{wl}: through Ray's object store (local_node=False): / shmbuf >= {AIM_VS_SHMBUF:g}",
                        "value": r["hop_over_c"], "met": r["hop_over_c"] >= AIM_VS_SHMBUF})
    return out


# -- the page ----------------------------------------------------------------------------------------------------------

INLINE_BYTES = 100 * 1024  # Ray returns values up to this size inline to the caller, not through the object store
CHUNK = "5 MiB"  # the object manager's transfer chunk (object_manager_default_chunk_size)

SECOND_NODE = """\
From Ray's documented transfer path (this run's two "nodes" share one machine, one memory and the
loopback interface, so its two-node rows show Ray's extra work, not a network's). On one node,
`shmbuf_ray`'s hop is one copy: the node's owner returns the batch's arrays from `next_batch`, and
Ray serialises them into the node's object store (plasma, shared memory) if the object is over
100 KB; the learner's `ray.get` then maps them without a copy ("numpy arrays in the object store
are shared between workers on the same node (zero-copy deserialization)"). A smaller return value
is inlined: it travels in the reply to the call and is kept in the caller's in-process memory store.
With the owner on another machine, the learner's `ray.get` of a plasma object makes its node's
object manager pull it from the owner's node, in chunks (5 MiB by default) over the network, into
the learner's node's object store, and `ray.get` reads that copy, again without another one; an
inlined value simply crosses in the reply. So a second node adds, per batch, one network transfer
of the batch's bytes and one write into the learner's store, and nothing per rollout: the actors
still write every step straight into their own node's shared memory, and each node makes one object
per batch of B rollouts, where the peer makes one per call (1 or B/N rollouts), each its own pull
and its own round of Ray's bookkeeping. For large rollouts the link becomes the bound; the table
gives each object's size, its path, and the rollouts/s one link can carry at 1 and 10 Gbit/s
(bytes on the wire only; no protocol overhead). The CPU of the receive path (the object manager's
copy from the network into plasma) is paid on the learner's node; a local two-node cluster pays
it too, over loopback, so `shmbuf_ray_2node`'s CPU per rollout already contains it.

Sources: Ray's docs, [Objects](https://docs.ray.io/en/latest/ray-core/objects.html) (one object
store per node; `ray.get` downloads an object the local store lacks; numpy arrays come back
zero-copy), [Serialization](https://docs.ray.io/en/latest/ray-core/objects/serialization.html)
(plasma; zero-copy numpy on a node), [return values](https://docs.ray.io/en/latest/ray-core/patterns/return-ray-put.html)
(values up to 100 KB are returned inline to the caller, not through the object store); the
object manager's 5 MiB chunks: ray-project/ray#43434.
"""


def transfer_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload and system, one batch object's bytes, its path, and what one link carries (rollouts/s)."""
    out = []
    cfg = result["config"]
    for wl in cfg["workloads"]:
        c = (result.get("loop_costs") or {}).get(wl)
        if not c or not c.get("shmbuf_rollout_bytes"):
            continue
        objects = [("shmbuf_ray", cfg["batch"], c["shmbuf_rollout_bytes"])]
        b = best_peer(result["rows"], wl)
        per = b["per_call"] if b else cfg["batch"] // cfg["actors"]
        objects.append((f"ray_actors [{per}/call]", per, c["peer_rollout_bytes"]))
        for name, rollouts, each in objects:
            size = rollouts * each
            out.append({"workload": wl, "system": name, "rollouts_per_object": rollouts, "object_bytes": size,
                        "path": "inline" if size <= INLINE_BYTES else "plasma + object manager",
                        "rollouts_per_s_1gbit": 1e9 / 8 / each, "rollouts_per_s_10gbit": 1e10 / 8 / each})
    return out


def _fmt(x: float | None, nd: int = 0) -> str:
    return "" if x is None else f"{x:,.{nd}f}"


def _x(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _conf(row: dict[str, Any] | None) -> str:
    """The peer's configuration of a row, to follow its figure."""
    return "" if row is None else f" ({row['per_call']}/call, {row['in_flight']} in flight)"


def _less(cpu: float | None, loop: float) -> float | None:
    """CPU per rollout beyond the actor loop's own."""
    return None if cpu is None else cpu - loop


def markdown(result: dict[str, Any]) -> str:
    rows, cfg = result["rows"], result["config"]
    wls = cfg["workloads"]
    rat = result["ratios"]
    L = [f"# shmbuf on Ray: {result['date']}{' (quick)' if cfg['quick'] else ''}", "",
         f"Machine: {result['machine_line']}. Ray {result['versions']['ray']}, gymnasium {result['versions']['gymnasium']}.",
         (f"{cfg['actors']} actor processes in all, B={cfg['batch']} rollouts per batch; {cfg['repeats']} repeat(s) x "
          f"{cfg['windows']} windows of {cfg['window_s']} s after a {cfg['warmup_s']} s warm-up; medians over every window. "
          f"Run took {result['wall_s'] / 60:.1f} min (estimate {result['estimate_s'] / 60:.1f}). Load average at start "
          f"{result['machine']['loadavg_start'][0]:.2f}, at end {result['machine']['loadavg_end'][0]:.2f}."), "",
         *([("**The code changed during the run** (shmbuf/, workers/ or benchmarks/ was edited): Ray's workers, "
             "the owners and the actors import it from disk when they start, so runs may mix versions; run again."), ""]
           if result["machine"].get("code_digest_end") != result["machine"].get("code_digest_start") else []),
         "## Rollouts/s", "",
         ("(a) collects on the learner's own node in its process (`RayCollector`'s default, `local_node=True`); "
          "the hop column is the same with that node behind a node owner, each batch through Ray's object store, "
          "as every other node is (`local_node=False`). With 2 nodes, the learner's node is read in its process and "
          "the other through the hop."), "",
         ("| workload | (c) shmbuf | (a) shmbuf_ray | (a), hop | (b) ray_actors' best | (a)/(b) | (a)/(c) | hop/(b) "
          "| hop/(c) | shmbuf_ray, 2 nodes | ray_actors, 2 nodes | (a)/(b), 2 nodes |"),
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for wl in wls:
        b = best_peer(rows, wl)
        b2 = best_peer(rows, wl, "ray_actors_2node")
        L.append(f"| {wl} | {_fmt(_med(row_of(rows, 'shmbuf', wl)))} | {_fmt(_med(row_of(rows, 'shmbuf_ray', wl)))} "
                 f"| {_fmt(_med(row_of(rows, 'shmbuf_ray_hop', wl)))} "
                 f"| {_fmt(_med(b))}{_conf(b)} | {_x(rat[wl]['a_over_b'])} | {_x(rat[wl]['a_over_c'])} "
                 f"| {_x(rat[wl].get('hop_over_b'))} | {_x(rat[wl].get('hop_over_c'))} "
                 f"| {_fmt(_med(row_of(rows, 'shmbuf_ray_2node', wl)))} | {_fmt(_med(b2))}{_conf(b2)} "
                 f"| {_x(rat[wl]['a2_over_b2'])} |")
    L += ["", "## Aims", "", "| aim | measured | met |", "|---|---:|---|"]
    for a in result["aims"]:
        L.append(f"| {a['aim']} | {_x(a['value'])} | {'' if a['met'] is None else ('yes' if a['met'] else '**no**')} |")
    costs = result.get("loop_costs") or {}
    if costs:
        L += ["", "## Where the time goes", "",
              ("The actor loops alone, in one process, no transport (µs per rollout): `workers.ActorLoop`, which every "
               "shmbuf actor runs, and the peer's loop (`ray_envs.RolloutActor`). Then each system's CPU per rollout "
               "(its own processes: every one below the run's; the whole machine's in a results file without it) and "
               "what it spends beyond its loop: transport, learner, Ray's processes, and the cost of sharing 2 cores "
               "among more processes (switches, caches)."), "",
              ("| workload | ActorLoop alone | peer loop alone | (c) CPU | (c) beyond loop | (a) CPU "
               "| (a) beyond loop | (b) CPU | (b) beyond loop |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for wl in wls:
            c = costs.get(wl)
            if not c:
                continue
            mc, ma, mb = (_cpu(r) for r in (row_of(rows, "shmbuf", wl), row_of(rows, "shmbuf_ray", wl), best_peer(rows, wl)))
            L.append(f"| {wl} | {_fmt(c['actor_loop_us'])} | {_fmt(c['peer_loop_us'])} | {_fmt(mc)} "
                     f"| {_fmt(_less(mc, c['actor_loop_us']))} | {_fmt(ma)} | {_fmt(_less(ma, c['actor_loop_us']))} "
                     f"| {_fmt(mb)} | {_fmt(_less(mb, c['peer_loop_us']))} |")
    L += ["", "## Every row", "",
          ("Rollouts/s median [min-max over windows]; CPU per rollout in µs: the whole machine (busy jiffies, "
           "everyone's), the run's own processes (this one and every one below it: Ray's daemons and workers, the "
           "owners, the actors) and the learner process alone; busy cores: the machine's during the windows, and of "
           "them the outside load (the machine's less the run's: other people's); start-up: construction to first "
           "batch (not counted in the rates)."), "",
          ("| workload | row | rollouts/s | frames/s | machine CPU µs/rollout | run CPU µs/rollout "
           "| learner CPU µs/rollout | busy cores | outside load, cores | start-up s | runs ok |"),
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for wl in wls:
        for r in sorted((r for r in rows if r["workload"] == wl), key=lambda r: (order[r["system"]], r["label"])):
            v = r["rollouts_per_s"]
            rng = f"{_fmt(v['median'])} [{_fmt(v['min'])}-{_fmt(v['max'])}]" if v else "failed"
            L.append(f"| {wl} | {LETTER.get(r['system'], '')} {r['label']} | {rng} | {_fmt(_med(r, 'frames_per_s'))} "
                     f"| {_fmt(_med(r, 'machine_cpu_us_per_rollout'))} | {_fmt(_med(r, 'run_cpu_us_per_rollout'))} "
                     f"| {_fmt(_med(r, 'learner_cpu_us_per_rollout'))} | {_fmt(_med(r, 'machine_busy_cores'), 2)} "
                     f"| {_fmt(_med(r, 'outside_cores'), 2)} | {_fmt(_med(r, 'startup_s'), 1)} "
                     f"| {r['ok_runs']}/{r['runs']} |")
    errs = [(r["label"], r["workload"], e) for r in rows for e in r["errors"]]
    if errs:
        L += ["", "Failed or stalled runs:", ""] + [f"- {lb}, {wl}: {e}" for lb, wl, e in errs]
    cl = result["clusters"]
    left = sorted({p for c in cl for p in c.get("left", [])} | set(result.get("left_pids", [])))
    idle = ", ".join(f"{c['idle_cores']:.2f}" for c in cl if c.get("idle_cores") is not None)
    L += ["", (f"Ray clusters started: {len(cl)} (start {', '.join(str(c.get('start_s')) for c in cl)} s, not counted"
               + (f"; their processes idle, before any run: {idle} cores" if idle else "")
               + f"). Processes left after the run: {left or 'none'}."), "", "## What a second physical node would change", "",
          SECOND_NODE]
    tr = transfer_rows(result)
    if tr:
        L += [("| workload | object | rollouts per object | bytes per object | path | rollouts/s per 1 Gbit/s link "
               "| per 10 Gbit/s link |"), "|---|---|---:|---:|---|---:|---:|"]
        L += [f"| {t['workload']} | {t['system']} | {t['rollouts_per_object']} | {t['object_bytes']:,} | {t['path']} "
              f"| {t['rollouts_per_s_1gbit']:,.0f} | {t['rollouts_per_s_10gbit']:,.0f} |" for t in tr]
    return "\n".join(L)


COLORS = {"shmbuf": "C0", "shmbuf_ray": "C2", "shmbuf_ray_hop": "C4", "ray_actors": "C3", "shmbuf_ray_2node": "C8",
          "ray_actors_2node": "C1"}


def plot(result: dict[str, Any], path: str) -> None:
    """One panel per workload: bars of rollouts/s (median, whiskers min-max) per system; the peer at its best."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, wls, rat = result["rows"], result["config"]["workloads"], result["ratios"]
    fig, axes = plt.subplots(1, len(wls), figsize=(4.2 * len(wls), 4.6), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        bars = [(s, best_peer(rows, wl, s) if s.startswith("ray_actors") else row_of(rows, s, wl)) for s in SYSTEMS]
        bars = [(s, r) for s, r in bars if r is not None and _med(r)]
        for i, (s, r) in enumerate(bars):
            v = r["rollouts_per_s"]
            ax.bar(i, v["median"], 0.7, color=COLORS[s], yerr=[[v["median"] - v["min"]], [v["max"] - v["median"]]],
                   capsize=3, error_kw={"lw": 0.8})
        ax.set_xticks(range(len(bars)))
        names = {"shmbuf": "(c) shmbuf", "shmbuf_ray": "(a) shmbuf\non Ray", "shmbuf_ray_hop": "(a) through\nobject store",
                 "ray_actors": "(b) Ray\nactors",
                 "shmbuf_ray_2node": "shmbuf on\nRay, 2 nodes", "ray_actors_2node": "Ray actors,\n2 nodes"}
        ax.set_xticklabels([names[s] + (f"\n{r['per_call']}/call, {r['in_flight']} in flight" if r["per_call"] else "")
                            for s, r in bars], fontsize=7)
        r = rat[wl]
        ax.set_title(f"{wl}: (a)/(b) {_x(r['a_over_b'])}, (a)/(c) {_x(r['a_over_c'])}", fontsize=9)
        ax.set_ylabel("rollouts/s")
        ax.grid(True, axis="y", alpha=0.3)
    cfg, m = result["config"], result["machine"]
    fig.suptitle(f"{cfg['actors']} actors, B={cfg['batch']}: {m['cpu_model']}, {m['cores_usable']} cores"
                 f"{' (quick)' if cfg['quick'] else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build(result: dict[str, Any]) -> dict[str, Any]:
    """Rows, ratios and aims from the raw runs (also what ``--render`` redoes)."""
    result["rows"] = summarize(result["runs"], result["clk_tck"])
    result["ratios"] = ratios(result["rows"], result["config"]["workloads"])
    result["aims"] = aims(result["ratios"])
    return result


def write(result: dict[str, Any], stem: str, plot_it: bool) -> dict[str, Any]:
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    if plot_it:
        plot(result, stem + ".png")
        md += f"\n![rollouts/s per workload and system]({os.path.basename(stem)}.png)\n"
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {stem}.json, .md{', .png' if plot_it else ''}")
    result["paths"] = {"json": stem + ".json", "md": stem + ".md", "png": stem + ".png" if plot_it else None}
    return result
