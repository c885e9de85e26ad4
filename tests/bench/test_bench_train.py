"""The training benchmark end to end at its smallest, as its users run it: ``python -m benchmarks.train --quick``.

PPO: CartPole-v1 and Acrobot-v1, seed 1, 2,048 steps (4 iterations) of each of the three systems. Atari: Pong with
8 envs and the random policy, the systems `make test` installs (EnvPool and PufferLib are the `bench` extra's), windows
of a fraction of a second. The command runs in a session of its own: every process it starts is killed at teardown
even when the test fails, and the test fails if any was still alive once the command had returned. No timing
assertions: only that every figure is there, positive and finite, that the rows and ratios are the runs' own, and that
nothing is left behind (processes, /dev/shm).
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import sys
import time

import pytest

from tests.conftest import leaked_since, shm_objects
from tests.helpers import run_bench

for _module in ("torch", "gymnasium", "tqdm", "matplotlib", "ale_py", "cv2"):
    pytest.importorskip(_module)

from benchmarks import train_report  # noqa: E402  # after the skips, as the other bench tests import theirs

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
ATARI = ("floor", "collector", "async_batched", "ale_vec")
TRAIN = ("one_process", "shmbuf_lag0", "shmbuf_lag1")
ENVS = ("CartPole-v1", "Acrobot-v1")


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_trains_collects_writes_every_figure_and_leaves_nothing(tmp_path: pathlib.Path) -> None:

    before = shm_objects()
    cmd = [sys.executable, "-m", "benchmarks.train", "--quick", "--systems", ",".join(ATARI), "--envs", "pong-8",
           "--policies", "random", "--out", str(tmp_path), "--windows", "2", "--window-s", "0.25", "--warmup-s", "0.25"]
    code, out, left, _ = run_bench(cmd, ROOT, timeout=900)
    assert code == 0, out[-5000:]
    assert left == [], f"processes of the run outlived it: {left}"
    # As the suite's own end check does: 5 s for objects to go. Other suites share this machine's /dev/shm, and one of
    # theirs caught between its segment's unlink and its semaphores' (owner gone, so counted) is not this run's leak.
    deadline = time.monotonic() + 5.0
    while leaked_since(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    leaked = leaked_since(before)
    assert leaked == [], f"the run left shmbuf objects in /dev/shm: {[f.name for f in leaked]}"
    assert "train bench, PPO: 6 runs, about" in out and "train bench, Atari collection: 4 runs, about" in out, out[-3000:]

    stems = list(tmp_path.glob("*-train-quick.json"))
    assert len(stems) == 1, list(tmp_path.iterdir())
    stem = stems[0].with_suffix("")
    with open(stems[0]) as f:
        saved = json.load(f)
    md = stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").stat().st_size > 0
    c = saved["config"]
    assert c["quick"] and c["seeds"] == [1] and c["total_timesteps"] == 2048 and c["torch_threads_per_process"] == 1
    for key in ("torch", "gymnasium", "ale-py"):
        assert c["versions"][key] != "not installed", key

    # PPO: every run ran its 4 iterations; the lag is recorded, and held exactly
    runs = {(r["env_id"], r["system"]): r for r in saved["train_runs"]}
    assert sorted(runs) == sorted((e, s) for e in ENVS for s in TRAIN)
    for (env, system), r in runs.items():
        what = f"{env} {system}"
        assert r["status"] == "ok", (what, r.get("error"))
        assert r["steps"] == 2048 and r["iterations"] == 4 and len(r["curve"]["steps"]) == 4, what
        assert r["curve"]["steps"] == [512, 1024, 1536, 2048], what
        assert _finite_positive(r["steps_per_s"]) and r["killed_pids"] == [], what
        assert r["settings"]["seed"] == 1 and r["settings"]["torch_threads"] == 1, what
        assert _finite_positive(r["cpu_us_per_step"]["learner"]), what
        if system == "one_process":
            assert r["lag_mean"] == 0 and r["lag_max"] == 0 and r["lag_enforced"] is False, what
            assert r["cpu_us_per_step"]["children"] == 0, what
        else:
            assert r["settings"]["max_policy_lag"] == int(system[-1]), what
            assert r["lag_enforced"] is True and r["stale_dropped"] >= 0, what
            assert 0 <= r["lag_mean"] <= r["lag_max"] <= r["settings"]["max_policy_lag"], what  # held in every batch
            assert _finite_positive(r["cpu_us_per_step"]["children"]), what  # the actors are child processes
    rows = {(r["env_id"], r["system"]): r for r in saved["train_rows"]}
    for (env, system), r in rows.items():
        assert r["steps_per_s"] == pytest.approx(runs[(env, system)]["steps_per_s"])
        assert r["speed_ratio"] == pytest.approx(r["steps_per_s"] / rows[(env, "one_process")]["steps_per_s"])
        assert f"| {env} | {r['label']} | 1/1 | {r['steps_per_s']:,.0f} |" in md, (env, system)
        assert "not enforced" not in r["label"]

    # Atari: one run per system, every window measured, CPU from the whole process tree
    assert saved["skipped"] == {}
    assert sorted(r["system"] for r in saved["runs"]) == sorted(ATARI)
    for r in saved["runs"]:
        what = f"{r['system']} [{r['variant']}]"
        assert r["status"] == "ok", (what, r.get("error"))
        assert r["env"] == "pong-8" and r["policy"] == "random", what
        assert len(r["windows"]) == 2 and all(_finite_positive(w) for w in r["windows"]), (what, r["windows"])
        assert r["killed_pids"] == [], what
    atari = {r["system"]: r for r in saved["rows"] if r["shown"]}
    assert set(atari) == set(ATARI)
    for s in ("collector", "async_batched"):  # the actors and env workers are child processes
        assert _finite_positive(atari[s]["cpu_us_per_frame"]["children"]), s
    ratios = {r["system"]: r for r in saved["atari_ratios"]}
    for s in ATARI:
        assert ratios[s]["vs_floor"] == pytest.approx(atari[s]["fps"]["median"] / atari["floor"]["fps"]["median"]), s
    assert ratios["collector"]["best_peer"] == "ale_vec"  # the one peer measured here
    assert "## PPO end to end" in md and "## Collection on real Atari" in md

    # the figures are the runs' figures: summarizing the raw runs again gives the same rows (what --render does)
    again = copy.deepcopy(saved)
    train_report.summarize(again)
    assert again["rows"] == saved["rows"] and again["train_rows"] == saved["train_rows"]


def test_every_atari_policy_travels_to_the_actors_as_it_is_and_on_views() -> None:
    """The actors get their policy by pickle: a random policy on trajectory views failed to unpickle once (a class
    whose __new__ took an argument), which only a full run (every variant) showed."""
    import pickle

    from benchmarks import train_atari as ta

    for kind in ("random", "cnn"):
        policy = ta.make_policy("pong", kind)
        for p in (policy, ta.on_views(policy)):
            assert type(pickle.loads(pickle.dumps(p))) is type(p), (kind, type(p))
