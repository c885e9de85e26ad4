"""The Ray benchmark end to end, as its users run it: ``python -m benchmarks.on_ray --quick``, small workload only.

One command in a session of its own (every process it starts, Ray's daemons included, keeps its
process group, and is killed at teardown even when the test fails). No timing assertions: only that
every system has its row with positive rates, that the ratios and aims are the ones the rows give,
and that nothing is left behind: no process of the run (its own check, and Ray's session processes
by the run's pid), no shmbuf object in /dev/shm. About 40 s: two Ray clusters start.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks import ray_report  # numpy only: importable without the skipped extras
from tests.conftest import leaked_since, shm_objects
from tests.helpers import ray_session_processes, run_bench

for _module in ("ray", "gymnasium"):
    pytest.importorskip(_module)

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.xdist_group("bench-ray")  # `make bench-smoke` runs in parallel: one Ray cluster at a time
def test_quick_run_has_every_row_computes_ratios_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    before = shm_objects()
    plot = importlib.util.find_spec("matplotlib") is not None  # the bench extra, which `make bench-smoke` installs
    cmd = [sys.executable, "-m", "benchmarks.on_ray", "--quick", "--workloads", "small", "--out", str(tmp_path),
           "--stall-s", "30"] + ([] if plot else ["--no-plot"])
    code, out, left, ray_left = run_bench(cmd, ROOT, grace=10.0, others=ray_session_processes)
    assert code == 0, out[-5000:]
    assert left == [], f"processes of the run outlived it: {left}"
    assert ray_left == [], f"Ray processes of the run outlived it: {ray_left}"
    leaked = leaked_since(before)
    assert leaked == [], f"the run left shmbuf objects in /dev/shm: {[f.name for f in leaked]}"

    [path] = list(tmp_path.glob("*-ray-quick.json"))
    saved = json.loads(path.read_text())
    assert path.with_suffix(".md").stat().st_size > 0
    if plot:
        assert path.with_suffix(".png").stat().st_size > 0
    assert saved["left_pids"] == [] and all(c["left"] == [] for c in saved["clusters"]), saved["clusters"]
    assert [c["nodes"] for c in saved["clusters"]] == [1, 2]
    assert saved["config"]["workloads"] == ["small"] and saved["config"]["actors"] == 2 and saved["config"]["batch"] == 16
    assert set(saved["loop_costs"]) == {"small"} and _positive(saved["loop_costs"]["small"]["actor_loop_us"])

    rows = {r["label"]: r for r in saved["rows"]}
    assert {r["system"] for r in rows.values()} == set(ray_report.SYSTEMS)
    peers = [r for r in rows.values() if r["system"] == "ray_actors"]
    assert {(r["per_call"], r["in_flight"]) for r in peers} == {(1, 2), (8, 2)}  # both configurations measured
    for label, r in rows.items():
        assert r["status"] == "ok" and r["ok_runs"] == r["runs"] == 1, (label, r["errors"])
        for key in ("rollouts_per_s", "frames_per_s", "machine_cpu_us_per_rollout", "learner_cpu_us_per_rollout"):
            v = r[key]
            assert all(_positive(x) for x in v["windows"]) and v["min"] <= v["median"] <= v["max"], (label, key, v)
        assert r["frames_per_s"]["median"] == pytest.approx(64 * r["rollouts_per_s"]["median"], rel=1e-6), label

    med = {label: r["rollouts_per_s"]["median"] for label, r in rows.items()}
    best = max(peers, key=lambda r: r["rollouts_per_s"]["median"])
    [best2] = [r for r in rows.values() if r["system"] == "ray_actors_2node"]
    assert (best2["per_call"], best2["in_flight"]) == (best["per_call"], best["in_flight"])  # the best one-node configuration
    rat = saved["ratios"]["small"]
    assert rat["b_best"] == best["label"]
    assert rat["a_over_b"] == pytest.approx(med["shmbuf_ray"] / best["rollouts_per_s"]["median"])
    assert rat["a_over_c"] == pytest.approx(med["shmbuf_ray"] / med["shmbuf"])
    assert rat["a2_over_b2"] == pytest.approx(med["shmbuf_ray_2node"] / best2["rollouts_per_s"]["median"])
    aims = {a["aim"]: a for a in saved["aims"]}
    assert aims["small: shmbuf_ray / ray_actors' best >= 2"]["met"] == (rat["a_over_b"] >= 2.0)
    assert aims["small: shmbuf_ray / shmbuf >= 0.7 (within 30 %)"]["met"] == (rat["a_over_c"] >= 0.7)

    # --render rebuilds the rows and the page from the raw runs alone
    path.with_suffix(".md").unlink()
    again = subprocess.run([sys.executable, "-m", "benchmarks.on_ray", "--render", str(path), "--no-plot"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    page = path.with_suffix(".md").read_text()
    assert "What a second physical node would change" in page and f"{rat['a_over_b']:.2f}x" in page
    # the aims are named by what they measure (readers know versions, not the project's issue numbers)
    assert "## Aims\n" in page and "| small: shmbuf_ray / ray_actors' best >= 2 |" in page
    assert not re.search(r"\bissues? \d", page, re.I)
