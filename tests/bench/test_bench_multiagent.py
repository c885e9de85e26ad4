"""The multi-agent benchmark end to end at its smallest, as its users run it: ``python -m benchmarks.multiagent --quick``.

Every system briefly (the one-process loop, shmbuf's MultiAgentCollector, RLlib's remote env runners and its local
one) on the synthetic 16-agent env with the two-policy mapping, windows of a fraction of a second: about a minute,
most of it Ray starting and stopping. RLlib's system may be missing only where RLlib cannot be imported, and the
results then say why. The command runs in a session of its own: every process it starts (Ray's daemons included)
keeps its process group and is killed at teardown even when the test fails. No timing assertions: only that every
figure is there, positive and finite, that the ratios are the rows', and that nothing is left behind.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import pathlib
import sys
import time

import pytest

from tests.conftest import leaked_since, shm_objects
from tests.helpers import run_bench

for _module in ("pettingzoo", "mpe2", "tqdm", "matplotlib", "torch", "gymnasium", "ray"):
    pytest.importorskip(_module)

from benchmarks import multiagent  # noqa: E402  # after the skips, as the other bench tests import theirs
from tests.helpers import ray_session_processes  # noqa: E402  (after the importorskip above)

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


def _rllib_importable() -> bool:
    try:
        importlib.import_module("ray.rllib")
    except ImportError:
        return False
    return True


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.xdist_group("bench-ray")  # `make bench-smoke` runs in parallel: one Ray cluster at a time
def test_quick_run_measures_every_system_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    before = shm_objects()
    rllib = _rllib_importable()
    runs = {("floor", "loop"), ("shmbuf", "2x2"), ("shmbuf_ray", "2x2-owner")} | (
        {("rllib", "2x2-sync"), ("rllib", "local-1x4")} if rllib else set())
    cmd = [sys.executable, "-m", "benchmarks.multiagent", "--quick", "--envs", "synthetic", "--policies", "linear2",
           "--variants", "floor:loop,shmbuf:2x2,shmbuf_ray:2x2-owner,rllib:2x2-sync,rllib:local-1x4", "--out", str(tmp_path),
           "--windows", "2", "--window-s", "0.25", "--warmup-s", "0.25", "--stall-s", "60"]
    code, out, left, ray_left = run_bench(cmd, ROOT, timeout=280, grace=10.0, others=ray_session_processes)
    assert code == 0, out[-5000:]
    assert left == [], f"processes of the run outlived it: {left}"
    assert ray_left == [], f"Ray processes of the run outlived it: {ray_left}"
    # An object of another test run sharing /dev/shm reads as removable for an instant while it is torn down (its
    # segment gone, its semaphores not yet): poll with a deadline, as conftest's end-of-suite check does.
    deadline = time.monotonic() + 5.0
    while (leaked := leaked_since(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leaked == [], f"the run left shmbuf objects in /dev/shm: {[f.name for f in leaked]}"
    assert f"multiagent bench: {len(runs)} runs, about" in out, out[-3000:]

    [path] = list(tmp_path.glob("*-multiagent-quick.json"))
    saved = json.loads(path.read_text())
    md = path.with_suffix(".md").read_text()
    assert path.with_suffix(".png").stat().st_size > 0
    for key in ("cpu_model", "cores", "kernel", "python", "numpy", "shmbuf_commit", "loadavg_start", "loadavg_end"):
        assert saved["machine"][key], key
    c = saved["config"]
    assert c["quick"] and c["num_envs"] == multiagent.NUM_ENVS and c["agents"]["synthetic"] == 16
    assert c["versions"]["pettingzoo"] != "not installed" and c["versions"]["ray"] != "not installed"
    if rllib:
        assert saved["skipped"] == {}
        assert c["rllib_version"].startswith("ray 2.60") and "TorchRLModule" in c["rllib_policy"] and "RLlib:" in md
    else:  # the only system allowed to be missing, and the results say why
        assert set(saved["skipped"]) == {"rllib"} and "import ray.rllib failed" in saved["skipped"]["rllib"]
        assert "## Not measured" in md and "RLlib MultiAgentEnvRunner: not measured: import ray.rllib failed" in md

    assert {(r["system"], r["variant"]) for r in saved["runs"]} == runs
    for r in saved["runs"]:
        what = f"{r['system']} [{r['variant']}]"
        assert r["status"] == "ok", (what, r.get("error"))
        assert r["env"] == "synthetic" and r["policy"] == "linear2", what
        assert len(r["windows"]) == 2 and all(_finite_positive(w) for w in r["windows"]), (what, r["windows"])
        assert all(w >= 0.25 for w in r["window_s"]), (what, r["window_s"])
        assert r["deliveries"] >= 2 and _finite_positive(r["startup_s"]), what
        cpu = r["cpu_cores"]
        for k in ("learner", "children", "machine", "outside"):
            assert math.isfinite(cpu[k]) and cpu[k] >= 0, (what, k, cpu)
        assert r["killed_pids"] == [], (what, r["killed_pids"])  # every system shut itself down, Ray included

    rows = {(r["system"], r["variant"]): r for r in saved["rows"]}
    assert set(rows) == runs
    for k, r in rows.items():
        assert _finite_positive(r["fps"]["median"]) and r["fps"]["min"] <= r["fps"]["median"] <= r["fps"]["max"], k
        assert _finite_positive(r["cpu_us_per_frame"]["total"]), k
    for k in (("shmbuf", "2x2"), ("shmbuf_ray", "2x2-owner"), ("rllib", "2x2-sync")):  # actors, owners, env runners: children
        if k in rows:
            assert _finite_positive(rows[k]["cpu_us_per_frame"]["children"]), k
    shown = {r["system"]: r for r in saved["rows"] if r["shown"]}
    assert set(shown) == {s for s, _ in runs}
    ratios = {(x["system"], x["against"]): x for x in saved["ratios"]}
    for s in shown:
        if s != "floor":
            assert ratios[(s, "floor")]["sps_ratio"] == pytest.approx(shown[s]["fps"]["median"] / shown["floor"]["fps"]["median"])
    if rllib:
        for s in ("shmbuf", "shmbuf_ray"):
            assert ratios[(s, "rllib")]["sps_ratio"] == pytest.approx(shown[s]["fps"]["median"] / shown["rllib"]["fps"]["median"])
        assert "## shmbuf against RLlib" in md
    assert "## synthetic, linear2" in md and "Quick run" in md

    again = copy.deepcopy(saved)  # the figures are the runs' figures: what --render does gives the same rows
    multiagent.summarize(again)
    assert again["rows"] == saved["rows"] and again["ratios"] == saved["ratios"]


def test_the_in_process_loop_benchmark_measures_each_case_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    """``python -m benchmarks.multiagent_loop`` at its smallest: MultiAgentLoop and the one-process loop on every
    case, alternated; every window's figure is positive and finite, each ratio is the median of the rounds' ratios,
    and the run leaves no process and no shmbuf object behind. No timing assertions."""
    import statistics

    before = shm_objects()
    cmd = [sys.executable, "-m", "benchmarks.multiagent_loop", "--quick", "--windows", "2", "--scale", "0.1",
           "--out", str(tmp_path)]
    code, out, left, _ = run_bench(cmd, ROOT, timeout=280)
    assert code == 0, out[-5000:]
    assert left == [], f"processes of the run outlived it: {left}"
    deadline = time.monotonic() + 5.0
    while (leaked := leaked_since(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leaked == [], f"the run left shmbuf objects in /dev/shm: {[f.name for f in leaked]}"
    [path] = list(tmp_path.glob("*-multiagent-loop-quick.json"))
    saved = json.loads(path.read_text())
    md = path.with_suffix(".md").read_text()
    assert saved["num_envs"] == multiagent.NUM_ENVS and saved["rollout_len"] == multiagent.ROLLOUT_LEN
    assert set(saved["cases"]) == {"synthetic/linear", "synthetic/linear2", "spread/linear"}
    for name, c in saved["cases"].items():
        w = c["windows"]
        assert len(w["floor"]) == len(w["loop"]) == 2 and all(_finite_positive(x) for x in w["floor"] + w["loop"]), name
        assert c["floor_us_per_agent_step"] == statistics.median(w["floor"]), name
        assert c["loop_us_per_agent_step"] == statistics.median(w["loop"]), name
        assert c["loop_over_floor"] == pytest.approx(statistics.median(x / y for x, y in zip(w["loop"], w["floor"]))), name
        assert f"| {c['env']} | {c['agents']} |" in md and f"{c['loop_over_floor']:.2f} |" in md, name
