"""The collection benchmark end to end at its smallest, as its users run it: ``python -m benchmarks.collect --quick``.

The systems `make bench-smoke` always installs (the two one-process floors, gymnasium's AsyncVectorEnv, workers.Collector),
CartPole with the numpy linear policy, windows of a fraction of a second: about 30 s. The command runs in a session
of its own: every process it starts (the forkserver's children keep its process group) is killed at teardown even
when the test fails, and the test fails if any was still alive once the command had returned. No timing assertions:
only that every figure is there, positive and finite, that the ratios and aims are the ones the rows give, and that
nothing is left behind (processes, /dev/shm).
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import sys

import pytest

from tests.conftest import leaked_since, shm_objects
from tests.helpers import run_bench

for _module in ("torch", "gymnasium", "tqdm", "matplotlib"):
    pytest.importorskip(_module)

from benchmarks import collect_report  # noqa: E402  # after the skips, as the other bench tests import theirs

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
SYSTEMS = ("floor_vec", "floor_hand", "gym_async", "collector")


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_writes_every_figure_computes_the_aims_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    before = shm_objects()
    cmd = [sys.executable, "-m", "benchmarks.collect", "--quick", "--systems", ",".join(SYSTEMS), "--envs", "cartpole",
           "--policies", "linear", "--out", str(tmp_path), "--windows", "2", "--window-s", "0.25", "--warmup-s", "0.25",
           "--stall-s", "60"]
    code, out, left, _ = run_bench(cmd, ROOT)
    assert code == 0, out[-5000:]
    assert left == [], f"processes of the run outlived it: {left}"
    leaked = leaked_since(before)
    assert leaked == [], f"the run left shmbuf objects in /dev/shm: {[f.name for f in leaked]}"
    assert f"collect bench: {len(SYSTEMS)} runs, about" in out, out[-3000:]  # the count and estimate come first

    stems = list(tmp_path.glob("*-collect-quick.json"))
    assert len(stems) == 1, list(tmp_path.iterdir())
    stem = stems[0].with_suffix("")
    with open(stems[0]) as f:
        saved = json.load(f)
    md = stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").stat().st_size > 0
    for key in ("cpu_model", "cores", "kernel", "python", "numpy", "shmbuf_commit", "loadavg_start", "loadavg_end"):
        assert saved["machine"][key], key
    c = saved["config"]
    assert c["quick"] and c["num_envs"] == 16 and c["torch_threads_per_process"] == 1 and c["forkserver_preload"]
    assert saved["skipped"] == {}

    # the runs: one per system (--quick runs each system's first configuration), every window measured
    assert sorted(r["system"] for r in saved["runs"]) == sorted(SYSTEMS)
    for r in saved["runs"]:
        what = f"{r['system']} [{r['variant']}]"
        assert r["status"] == "ok", (what, r.get("error"))
        assert r["env"] == "cartpole" and r["policy"] == "linear", what
        assert len(r["windows"]) == 2 and all(_finite_positive(w) for w in r["windows"]), (what, r["windows"])
        assert all(w >= 0.25 for w in r["window_s"]), (what, r["window_s"])  # each window cut at a delivery past its length
        assert r["deliveries"] >= 2 and _finite_positive(r["startup_s"]), what
        cpu = r["cpu_cores"]
        for k in ("learner", "children", "machine", "outside", "learner_kernel", "children_kernel"):
            assert math.isfinite(cpu[k]) and cpu[k] >= 0, (what, k, cpu)
        assert cpu["learner"] > 0, what
        assert r["killed_pids"] == [], (what, r["killed_pids"])  # every system shut itself down

    # the rows, from the runs: each system's row is its one configuration here; children work where they should
    rows = {r["system"]: r for r in saved["rows"]}
    assert set(rows) == set(SYSTEMS) and all(r["shown"] for r in rows.values())
    for s, r in rows.items():
        assert _finite_positive(r["fps"]["median"]) and r["fps"]["min"] <= r["fps"]["median"] <= r["fps"]["max"], s
        per_frame = r["cpu_us_per_frame"]
        assert _finite_positive(per_frame["learner"]) and per_frame["total"] == pytest.approx(
            per_frame["learner"] + per_frame["children"]), s
    for s in ("gym_async", "collector"):  # the env workers and the actors are child processes
        assert _finite_positive(rows[s]["cpu_us_per_frame"]["children"]), s

    # every ratio is the rows' ratio, against both floors
    ratios = {(x["system"], x["against"]): x for x in saved["ratios"]}
    for s in SYSTEMS:
        for floor in ("floor_vec", "floor_hand"):
            if s == floor:
                continue
            x = ratios[(s, floor)]
            assert x["fps_ratio"] == pytest.approx(rows[s]["fps"]["median"] / rows[floor]["fps"]["median"]), (s, floor)

    # the aims this run can judge: Collector against each floor with the linear policy (frames/s, actor CPU per frame)
    aims = saved["aims"]
    assert len(aims) == 4, aims
    for m in aims:
        floor = "floor_vec" if m["against"].startswith("SyncVectorEnv") else "floor_hand"
        if m["aim"].startswith("Collector frames/s"):
            assert m["value"] == pytest.approx(rows["collector"]["fps"]["median"] / rows[floor]["fps"]["median"]), m
            assert m["goal"] == 1.7 and m["met"] == (m["value"] >= 1.7), m
        else:
            want = rows["collector"]["cpu_us_per_frame"]["children"] / rows[floor]["cpu_us_per_frame"]["total"]
            assert m["value"] == pytest.approx(want) and m["goal"] == 1.15 and m["met"] == (m["value"] <= 1.15), m
        assert f"| {m['aim']} | cartpole | linear | {m['against']} | {m['value']:.2f}x |" in md, m
    assert "## cartpole, linear" in md and "Quick run" in md

    # the figures are the runs' figures: summarizing the raw runs again gives the same rows and aims (what --render does)
    again = copy.deepcopy(saved)
    collect_report.summarize(again)
    assert again["rows"] == saved["rows"] and again["aims"] == saved["aims"]
