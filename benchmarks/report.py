"""From raw run records to the numbers people read: per-run summaries, the targets against echo and the queues, a
table, a plot.

echo runs in two configurations ("echo": its defaults; "echo1": one drainer, one TCP thread). Every ratio
against echo takes the better of the two in the same row (higher rollouts/s, lower p99) as its denominator,
and names the configuration it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAMES = {"shmbuf": "shmbuf", "shmbuf_gather": "shmbuf gather", "echo": "echo", "echo1": "echo1",
         "faster_fifo": "faster_fifo", "mp_queue": "mp.Queue"}
LONG = {"shmbuf": "shmbuf, `get_batch(16)` (default zero_copy=True: zero-copy views when the 16 rollouts are one aligned run "
                  "of slots)",
        "shmbuf_gather": "shmbuf, `get_batch(16, zero_copy=False)` (always one gather copy into the batch)",
        "echo": "echo 0.2 over TCP, its defaults: `Server(example, 16, transport=TcpTransport(port=0))` "
                "(8 drainer threads, 8 TCP threads)",
        "echo1": "echo over TCP, `Server(..., transport=TcpTransport(port=0, num_threads=1), num_drainers=1)`",
        "faster_fifo": "`faster_fifo.Queue`, 16 `get_many`s stacked into a preallocated batch",
        "mp_queue": "`multiprocessing.Queue`, 16 `get`s stacked into a preallocated batch"}
ECHOS = ("echo", "echo1")
GOALS = {"small": 3.0, "rl": 8.0, "atari": 12.0}  # shmbuf / echo's better, transport, 2 actors, B=16
ADD_GOAL = 0.25
P99_GOAL = 0.1
LEARNER_CPU_GOAL = 3.0  # µs per small rollout at B=16


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "windows": []}
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "windows": [float(v) for v in values]}


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Rollouts/s, MB/s, latency and CPU per rollout of one run, each as median over windows with min/max."""
    out = {k: rec[k] for k in ("system", "payload", "mode", "actors", "batch", "status")}
    out["depth"] = rec.get("depth")
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
    extra = learner.get("extra") or {}
    if isinstance(extra.get("batches"), dict):  # shmbuf: zero-copy views and gathered batches, whole run
        views, gathered = extra["batches"].get("views", 0), extra["batches"].get("gathered", 0)
        out["batches"] = {"views": views, "gathered": gathered}
        out["views_fraction"] = views / (views + gathered) if views + gathered else None
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


def copy_bound(rollout_bytes: int, cores: int, copy_gb_s: float, copies: float = 2.0) -> float:
    """Rollouts/s a design that copies each byte ``copies`` times (2: the actor's write into the slot and the
    learner's gather into the batch; 1 with zero-copy batches) cannot exceed with ``cores`` cores copying at
    ``copy_gb_s`` each."""
    return cores * copy_gb_s * 1e9 / (copies * rollout_bytes)


def echo_best(summaries: list[dict[str, Any]], payload: str, mode: str, actors: int,
              path: tuple[str, ...] = ("rollouts_per_s",), lower: bool = False) -> tuple[float | None, str | None]:
    """echo's better figure of its two configurations in one row (higher, or lower with ``lower``) and which one."""
    got = [(v, s) for s in ECHOS
           if (v := _med(find(summaries, system=s, payload=payload, mode=mode, actors=actors), *path))]
    if not got:
        return None, None
    return (min if lower else max)(got, key=lambda x: x[0])


def _views(s: dict[str, Any] | None) -> float | None:
    return None if s is None or s["status"] != "ok" else s.get("views_fraction")


def _cpu(s: dict[str, Any] | None, side: str) -> float | None:
    return None if s is None or s["status"] != "ok" else s["cpu_us_per_rollout"][side]


def micro_kinds(micro: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The microbench's item kinds ("numpy", "python", "arrays"); an older results file, from before the
    microbench measured Python items, has "scalars" (numpy scalars, i.e. "numpy") and "arrays" only."""
    if not micro:
        return {}
    kinds = {k: micro[k] for k in ("numpy", "python", "arrays") if isinstance(micro.get(k), dict)}
    if "numpy" not in kinds and isinstance(micro.get("scalars"), dict):
        kinds["numpy"] = micro["scalars"]
    return kinds


def _throughput_bound(summaries: list[dict[str, Any]], payload: str, need: float, cores: int,
                      copy_bw: dict[str, Any], payload_bytes: dict[str, int] | None, actors: int) -> str:
    """Where a missed throughput target's time goes, from the run's own figures: the learner's CPU per rollout
    against one core, all CPU per rollout against the machine, and the copy bound at DRAM speed."""
    s = find(summaries, system="shmbuf", payload=payload, mode="transport", actors=actors)
    rate, lrn, act = _med(s, "rollouts_per_s"), _cpu(s, "learner"), _cpu(s, "actors")
    if not rate or not lrn or not act:
        return ""
    caps = {"the learner's core": 1e6 / lrn, f"{cores} cores of CPU": cores * 1e6 / (lrn + act)}
    parts = [f"learner {lrn:.1f} µs/rollout x {rate:,.0f}/s = {rate * lrn / 1e6:.2f} core (at most {1e6 / lrn:,.0f}/s)",
             f"learner + actors {lrn + act:.1f} µs/rollout (at most {cores * 1e6 / (lrn + act):,.0f}/s on {cores} cores)"]
    if payload_bytes and payload != "small":
        v = _views(s)
        copies = 2.0 - (v or 0.0)  # each gathered batch adds a copy
        cap = copy_bound(payload_bytes[payload], cores, copy_bw["dram"], copies)
        caps[f"the {copies:.2g}-copy bound"] = cap
        parts.append(f"{copies:.2g}-copy bound at DRAM copy speed {cap:,.0f}/s")
    name = min(caps, key=caps.__getitem__)
    parts.append(f"tightest: {name}; the target needs {need:,.0f}/s, i.e. at most "
                 f"{cores * 1e6 / need:.1f} µs of CPU per rollout in all")
    busy = rate * (lrn + act) / 1e6
    if caps[name] >= need:  # the CPU per rollout would allow it: the run left cores idle (waits, or other load)
        other = s.get("other_load_cores") if s else None
        why = (f"outside load ({other:.2f} core) took part of the machine" if other and other > 0.25
               else "waiting, not CPU, is what is left")
        parts.append(f"the CPU per rollout would allow it with every core busy, but the run's processes kept "
                     f"{busy:.2f} of {cores} cores busy: {why}")
    else:
        parts.append(f"the run's processes kept {busy:.2f} of {cores} cores busy")
    return "; ".join(parts)


def targets(summaries: list[dict[str, Any]], micro: dict[str, Any] | None, copy_bw: dict[str, Any],
            stalls: list[dict[str, Any]], cores: int = 2, payload_bytes: dict[str, int] | None = None,
            actors: int = 2) -> list[dict[str, Any]]:
    """Each target (transport mode, ``actors`` actors, B=16, against echo's better configuration):
    the figure, the goal, met or not (None when a figure is missing), and for a missed one what bounds it."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool | None, detail: str = "", bound: str = "") -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met, "detail": detail,
                    "bound": bound if met is False else ""})

    for payload, k in GOALS.items():
        shm = _med(find(summaries, system="shmbuf", payload=payload, mode="transport", actors=actors), "rollouts_per_s")
        gat = _med(find(summaries, system="shmbuf_gather", payload=payload, mode="transport", actors=actors),
                   "rollouts_per_s")
        e, which = echo_best(summaries, payload, "transport", actors)
        ratio = shm / e if shm and e else None
        v = _views(find(summaries, system="shmbuf", payload=payload, mode="transport", actors=actors))
        detail = f"{_fmt(shm)} vs {_fmt(e)} rollouts/s ({which})"
        if v is not None:
            detail += f"; {v:.0%} of batches were views"
        if gat and e:
            detail += f"; shmbuf gather {_fmt(gat)}/s = {gat / e:.2f}x"
        bound = _throughput_bound(summaries, payload, k * e, cores, copy_bw, payload_bytes, actors) if e else ""
        add(f"transport {payload}, {actors} actors: shmbuf / echo's better, rollouts/s", ratio, f">= {k:g}x",
            None if ratio is None else ratio >= k, detail, bound)
        for other in ("faster_fifo", "mp_queue"):
            o = _med(find(summaries, system=other, payload=payload, mode="transport", actors=actors), "rollouts_per_s")
            if o is None:
                continue
            r = shm / o if shm else None
            add(f"transport {payload}, {actors} actors: shmbuf / {NAMES[other]}, rollouts/s", r, ">= 1x",
                None if r is None else r >= 1, f"{_fmt(shm)} vs {_fmt(o)} rollouts/s")
    kinds = micro_kinds(micro)
    plain = (micro or {}).get("plain") or {}
    for kind, label in (("numpy", "numpy items"), ("python", "Python-scalar items")):
        x = kinds.get(kind)
        if x is None:
            add(f"`Writer.add` / `TrajectoryAccumulator.add` per step, {label}", None, f"<= {ADD_GOAL:g}", None,
                "not measured in this run")
            continue
        r, us, ue = x["ratio_shmbuf_to_echo"], x["shmbuf"]["us_per_add"], x["echo"]["us_per_add"]
        bound = ""
        if plain.get("us_per_add"):
            p = plain["us_per_add"]
            bound = (f"a plain slot write costs {p:.2f} µs ({p / ue:.2f}x echo's add), `add` {us:.2f}: its "
                     f"{us - p:.2f} µs above the floor would have to fall to {ADD_GOAL * ue - p:.2f}")
        add(f"`Writer.add` / `TrajectoryAccumulator.add` per step, {label}", r, f"<= {ADD_GOAL:g}", r <= ADD_GOAL,
            f"{us:.2f} vs {ue:.2f} µs per add, windows {x['ratio_min']:.2f}-{x['ratio_max']:.2f}", bound)
    for payload in GOALS:
        key = find(summaries, system="shmbuf", payload=payload, mode="transport", actors=actors)
        s = _med(key, "latency_us", "p99")
        e, which = echo_best(summaries, payload, "transport", actors, ("latency_us", "p99"), lower=True)
        r = s / e if s and e else None
        bound = ""
        rate = _med(key, "rollouts_per_s")
        if rate and e:
            depth = key.get("depth", 32) if key else 32
            batch = key["batch"] if key else 16
            bound = (f"p99 goal {P99_GOAL * e:,.0f} µs; {depth} rollouts in flight at {rate:,.0f}/s wait "
                     f"{depth / rate * 1e6:,.0f} µs on average (Little's law) and a batch of {batch} fills in "
                     f"{batch / rate * 1e6:,.0f} µs: at this rate the goal allows about "
                     f"{P99_GOAL * e * 1e-6 * rate:.1f} rollouts in flight")
        add(f"saturation latency, {payload}, {actors} actors, B=16: shmbuf p99 / echo's better p99", r,
            f"<= {P99_GOAL:g}", None if r is None else r <= P99_GOAL, f"{_fmt(s)} vs {_fmt(e)} µs ({which})", bound)
    key = find(summaries, system="shmbuf", payload="small", mode="transport", actors=actors)
    lrn = _cpu(key, "learner")
    gat = _cpu(find(summaries, system="shmbuf_gather", payload="small", mode="transport", actors=actors), "learner")
    e_l = [x for x in (_cpu(find(summaries, system=s, payload="small", mode="transport", actors=actors), "learner")
                       for s in ECHOS) if x]
    detail = "" if lrn is None else f"{lrn:.2f} µs ({lrn * 16:.0f} µs per batch of 16)"
    if lrn is not None and _views(key) is not None:
        detail += f", {_views(key):.0%} of batches views"
    bound = ""
    if lrn is not None:
        rate = _med(key, "rollouts_per_s") or 0
        bound = (f"the learner was {rate * lrn / 1e6:.2f} core busy at {rate:,.0f}/s"
                 + (f"; gathering every batch (shmbuf gather) costs {gat:.2f} µs" if gat else "")
                 + (f"; echo's learner {min(e_l):.1f} µs" if e_l else ""))
    add(f"learner CPU per small rollout, transport, {actors} actors, B=16 (µs)", lrn, f"<= {LEARNER_CPU_GOAL:g}",
        None if lrn is None else lrn <= LEARNER_CPU_GOAL, detail, bound)
    shm_stalls = [x for x in stalls if x["system"] in ("shmbuf", "shmbuf_gather")]
    others = {n: sum(1 for x in stalls if x["system"] == n) for n in NAMES if n not in ("shmbuf", "shmbuf_gather")}
    add("shmbuf stalls in the whole sweep", len(shm_stalls), "0", not shm_stalls,
        "others: " + ", ".join(f"{NAMES[n]} {c}" for n, c in others.items()),
        "; ".join(f"{x['system']} {x['payload']} {x['mode']} x{x['actors']}: {x.get('detail')}" for x in shm_stalls))
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


def _counts(S: list[dict[str, Any]], mode: str, payload: str) -> list[int]:
    return sorted({x["actors"] for x in S if x["mode"] == mode and x["payload"] == payload})


def _ratio_cell(num: float | None, den: float | None, which: str | None = None) -> str:
    if not num or not den:
        return "–"
    return f"{num / den:.2f}x" + (f" ({which})" if which else "")


def _present(S: list[dict[str, Any]], systems: list[str], mode: str) -> list[str]:
    return [s for s in systems if any(x["mode"] == mode and x["system"] == s for x in S)]


def _throughput_tables(result: dict[str, Any], mode: str, title: str) -> list[str]:
    S = result["summaries"]
    ms = _present(S, result["config"]["systems"], mode)
    if not ms:
        return []
    has_echo = any(s in ECHOS for s in ms)
    ratio_heads = ([f"{NAMES[s]} / echo's better" for s in ("shmbuf", "shmbuf_gather") if s in ms] if has_echo else [])
    ratio_heads += [f"shmbuf / {NAMES[s]}" for s in ("faster_fifo", "mp_queue") if s in ms and "shmbuf" in ms]
    lines = [f"## {title}: rollouts/s", "", "| payload | actors | " + " | ".join(NAMES[s] for s in ms) + " | "
             + " | ".join(ratio_heads) + " |", "|---|---:|" + "---:|" * (len(ms) + len(ratio_heads))]
    for payload in result["config"]["payloads"]:
        for n in _counts(S, mode, payload):
            row = {s: find(S, system=s, payload=payload, mode=mode, actors=n) for s in ms}
            if not any(row.values()):
                continue
            e, which = echo_best(S, payload, mode, n)
            ratios = []
            if has_echo:
                ratios += [_ratio_cell(_med(row[s], "rollouts_per_s"), e, which) for s in ("shmbuf", "shmbuf_gather")
                           if s in ms]
            ratios += [_ratio_cell(_med(row["shmbuf"], "rollouts_per_s"), _med(row[s], "rollouts_per_s"))
                       for s in ("faster_fifo", "mp_queue") if s in ms and "shmbuf" in ms]
            lines.append(f"| {payload} | {n} | " + " | ".join(_cell(row[s], "rollouts_per_s") for s in ms) + " | "
                         + " | ".join(ratios) + " |")
    bw = result["copy_bandwidth"]
    lines += ["", f"## {title}: MB/s", "", "| payload | actors | " + " | ".join(NAMES[s] for s in ms)
              + " | shmbuf / 1-core copy (DRAM; cache-resident) |", "|---|---:|" + "---:|" * (len(ms) + 1)]
    for payload in result["config"]["payloads"]:
        for n in _counts(S, mode, payload):
            row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in ms]
            mb = _med(row[ms.index("shmbuf")], "mb_per_s") if "shmbuf" in ms else None
            frac = f"{mb / (bw['dram'] * 1e3):.1%}; {mb / (bw['rollout'] * 1e3):.1%}" if mb else "–"
            lines.append(f"| {payload} | {n} | " + " | ".join(_cell(r, "mb_per_s") for r in row) + f" | {frac} |")
    shm = [s for s in ("shmbuf", "shmbuf_gather") if s in ms]
    lines += ["", f"## {title}: CPU µs per rollout (all actors together / learner)", "",
              "| payload | actors | " + " | ".join(NAMES[s] for s in ms) + "".join(f" | {NAMES[s]}: batches as views"
                                                                           for s in shm) + " |",
              "|---|---:|" + "---:|" * (len(ms) + len(shm))]
    for payload in result["config"]["payloads"]:
        for n in _counts(S, mode, payload):
            row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in ms]
            cells = _cells(row, lambda r: f"{_fmt(r['cpu_us_per_rollout']['actors'], 1)} / "
                                          f"{_fmt(r['cpu_us_per_rollout']['learner'], 1)}")
            views = []
            for s in shm:
                v = _views(row[ms.index(s)])
                views.append("–" if v is None else f"{v:.0%}")
            lines.append(f"| {payload} | {n} | " + " | ".join(cells + views) + " |")
    lines.append("")
    return lines


def _bound_lines(result: dict[str, Any]) -> list[str]:
    missed = [t for t in result["targets"] if t["met"] is False and t.get("bound")]
    if not missed:
        return []
    lines = ["### What bounds each missed target (from this run's figures)", ""]
    lines += [f"- {t['target']}: {t['bound']}." for t in missed]
    return lines + [""]


def markdown(result: dict[str, Any]) -> str:
    """The Markdown page: machine line, the throughput tables, CPU, latency, the add microbench, the targets."""
    S = result["summaries"]
    systems = result["config"]["systems"]
    m = result["machine"]
    cfg = result["config"]
    bw = result["copy_bandwidth"]
    sweep = (f"Sweep: B={cfg['batch']} stacked rollouts per batch, queue depth {cfg['depth']}, {cfg['windows']} windows "
             f"of {cfg['window_s']} s after {cfg['warmup_s']} s of warm-up; medians over windows, ± half the min–max "
             f"spread; {len(result.get('runs', S))} runs in {result.get('sweep_s', 0) / 60:.1f} minutes. Load average "
             f"at start {m['loadavg_start'][0]:.2f}, at end {m.get('loadavg_end', [0])[0]:.2f}. ‡: more than {LOADED} "
             "core of other people's load on the machine during that run (see the section on it below).")
    lines = [f"# shmbuf benchmark {result['date']} on {m['host']}", "", f"Machine: {result['machine_line']}", "",
             (f"Single-core `np.copyto` bandwidth in this run: {bw['rollout']:.1f} GB/s on one atari rollout "
              f"(cache-resident), {bw['dram']:.1f} GB/s on 128 MiB (DRAM)."), "", sweep, "", "Systems:", ""]
    lines += [f"- **{NAMES[s]}**: {LONG[s]}" for s in systems if s in LONG]
    lines += ["", ("Every ratio against echo divides by echo's better configuration in that row (higher rollouts/s, "
                   "lower p99) and names it in brackets."), ""]
    lines += _throughput_tables(result, "transport", "Transport mode (actors send a built rollout)")
    lines += _throughput_tables(result, "step", "Step mode (actors add T steps, then commit / build + send)")
    lat_sys = [s for s in systems if any(x["system"] == s and x["mode"] in ("latency", "transport") for x in S)]
    lines += ["## Latency, send/commit to the learner holding the batch: p50 / p99 µs", "",
              "| payload | load | " + " | ".join(NAMES[s] for s in lat_sys) + " | shmbuf p99 / echo's better p99 |",
              "|---|---|" + "---:|" * (len(lat_sys) + 1)]
    n = cfg["latency_actors"]
    for payload in cfg["payloads"]:
        for mode, label in (("latency", f"paced, {cfg['pace_rate']:g}/s, B=1"), ("transport", f"saturation, B={cfg['batch']}")):
            row = [find(S, system=s, payload=payload, mode=mode, actors=n) for s in lat_sys]
            if not any(row):
                continue
            cells = _cells(row, lambda r: f"{_fmt(_med(r, 'latency_us', 'p50'))} / {_fmt(_med(r, 'latency_us', 'p99'))}")
            e, which = echo_best(S, payload, mode, n, ("latency_us", "p99"), lower=True)
            shm = _med(find(S, system="shmbuf", payload=payload, mode=mode, actors=n), "latency_us", "p99")
            lines.append(f"| {payload} | {label}, {n} actors | " + " | ".join(cells) + f" | {_ratio_cell(shm, e, which)} |")
    lines.append("")
    kinds = micro_kinds(result.get("microbench"))
    if kinds:
        mb = result["microbench"]
        lines += ["## Per-step accumulate (one process, small payload, µs per `add`)", "",
                  "| items | shmbuf `Writer.add` | echo `TrajectoryAccumulator.add` | ratio (median of windows) |",
                  "|---|---:|---:|---:|"]
        for kind, label in (("numpy", "numpy items, as indexing a rollout gives (`reward[t]`)"),
                            ("python", "Python scalars, float32 array obs (one gymnasium env)"),
                            ("arrays", "arrays, 0-d for scalar leaves (`reward[t, ...]`)")):
            x = kinds.get(kind)
            if x is None:
                lines.append(f"| {label} | – | – | not measured |")
                continue
            lines.append(f"| {label} | {x['shmbuf']['us_per_add']:.2f} | {x['echo']['us_per_add']:.2f} | "
                         f"{x['ratio_shmbuf_to_echo']:.2f} ({x['ratio_min']:.2f}–{x['ratio_max']:.2f}) |")
        plain = mb.get("plain") or {}
        if plain.get("us_per_add"):
            lines.append(f"| the floor: a hand-written slot write (`dst[i] = x` per leaf, no checks) | "
                         f"{plain['us_per_add']:.2f} | | |")
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
    lines += ["", "## Targets (transport, 2 actors, B=16, against echo's better configuration)", "",
              "| target | value | goal | met |", "|---|---:|---|---|"]
    for t in result["targets"]:
        v = t["value"]
        vs = "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} ({t['detail']}) | {vs} | {t['goal']} | {met} |" if t["detail"]
                     else f"| {t['target']} | {vs} | {t['goal']} | {met} |")
    lines.append("")
    lines += _bound_lines(result)
    return "\n".join(lines) + "\n"


COLORS = {"shmbuf": "C0", "shmbuf_gather": "C9", "echo": "C3", "echo1": "C1", "faster_fifo": "C2", "mp_queue": "C7"}


def plot(result: dict[str, Any], path: str) -> None:
    """Transport mode, rollouts/s: one panel of bars per payload and system at the targets' actor count, then
    one panel per payload of the scaling row (rollouts/s against actor processes). Log scales."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = [x for x in result["summaries"] if x["mode"] == "transport"]
    cfg = result["config"]
    systems = [s for s in cfg["systems"] if any(x["system"] == s for x in S)]
    payloads = [p for p in cfg["payloads"] if any(x["payload"] == p for x in S)]
    n0 = cfg.get("target_actors", 2)
    if not any(x["actors"] == n0 for x in S):  # a narrowed sweep without the targets' actor count
        n0 = min((x["actors"] for x in S), default=n0)
    scaling = [p for p in payloads if len(_counts(S, "transport", p)) > 1]
    fig, axes = plt.subplots(1, 1 + len(scaling), figsize=(6.5 + 4.6 * len(scaling), 5.2), squeeze=False,
                             gridspec_kw={"width_ratios": [1.4] + [1] * len(scaling)})
    ax = axes[0][0]
    width = 0.8 / max(1, len(systems))
    top = 1.0
    for i, s in enumerate(systems):
        for j, p in enumerate(payloads):
            r = find(S, system=s, payload=p, actors=n0)
            x = j + (i - (len(systems) - 1) / 2) * width
            if r is None:
                continue
            if r["status"] != "ok":
                ax.plot([x], [1], "x", color=COLORS.get(s, "k"), ms=9)
                continue
            v = r["rollouts_per_s"]
            top = max(top, v["max"])
            ax.bar(x, v["median"], width, color=COLORS.get(s, "k"), label=NAMES[s] if j == 0 else None,
                   yerr=[[v["median"] - v["min"]], [v["max"] - v["median"]]], capsize=2, error_kw={"lw": 0.8})
            if s == "shmbuf":
                e, which = echo_best(S, p, "transport", n0)
                if e:
                    ax.annotate(f"{v['median'] / e:.1f}x\n{which}", (x, v["max"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(payloads)))
    ax.set_xticklabels([f"{p}\n({result['payload_bytes'][p] / 1e6:.3g} MB)" for p in payloads])
    ax.set_yscale("log")
    ax.set_ylim(top=top * 6)  # room for the ratio labels and the legend above the bars
    ax.set_ylabel("rollouts/s")
    ax.set_title(f"transport, {n0} actors, B={cfg['batch']} (label: shmbuf / echo's better)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    for k, p in enumerate(scaling, start=1):
        ax = axes[0][k]
        for s in systems:
            pts = sorted((x["actors"], x["rollouts_per_s"]) for x in S
                         if x["system"] == s and x["payload"] == p and x["status"] == "ok")
            if pts:
                xs, ys = [a for a, _ in pts], [v["median"] for _, v in pts]
                yerr = [[v["median"] - v["min"] for _, v in pts], [v["max"] - v["median"] for _, v in pts]]
                ax.errorbar(xs, ys, yerr=yerr, fmt="-o", color=COLORS.get(s, "k"), capsize=3, ms=4, label=NAMES[s])
        bottom = ax.get_ylim()[0]
        for x in S:  # mark runs that stalled or failed at the bottom of the axis
            if x["payload"] == p and x["status"] != "ok":
                ax.plot([x["actors"]], [bottom], "x", color=COLORS.get(x["system"], "k"), ms=9, clip_on=False)
        counts = _counts(S, "transport", p)
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(c) for c in counts])
        ax.set_yscale("log")
        ax.set_xlabel("actor processes")
        ax.set_title(f"scaling, {p}, transport, B={cfg['batch']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"rollouts/s per payload and system — {result['machine']['cpu_model']}, "
                 f"{result['machine']['cores']} cores, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
