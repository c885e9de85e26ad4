"""The inference benchmark end to end at its smallest, and its event logs.

The sweep runs as its users run it, ``python -m benchmarks.inference --quick`` from the repository
root, in a session of its own: every process it starts (the forkserver's children keep its process
group) is killed at teardown even when the test fails, and the test fails if any was still alive
once the command had returned. Both rows of shmbuf's two collectors and one configuration of each
of TorchRL's, 4 envs, windows of a fraction of a second. No timing assertions: only that every
figure is there, positive and finite, and that nothing is left behind (processes, /dev/shm, the
event-log directory).
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import sys

import numpy as np
import pytest

from tests.conftest import leaked_since, shm_objects
from tests.helpers import run_bench

for _module in ("torch", "torchrl", "tensordict", "gymnasium", "tqdm"):
    pytest.importorskip(_module)

from benchmarks import inference  # noqa: E402  # after the skips: it imports torch and gymnasium

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


def _finite_positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_sweep_writes_every_figure_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    before = shm_objects()
    cmd = [sys.executable, "-m", "benchmarks.inference", "--quick", "--out", str(tmp_path), "--tmp", str(logs),
           "--windows", "2", "--window-s", "0.25", "--warmup-s", "0.25", "--stall-s", "30", "--start-timeout", "90"]
    code, out, left, _ = run_bench(cmd, ROOT)
    assert code == 0, out[-5000:]
    assert left == [], f"processes of the sweep outlived it: {left}"
    assert list(logs.iterdir()) == [], "the event-log directory was left behind"
    leaked = leaked_since(before)
    assert leaked == [], f"the sweep left shmbuf objects in /dev/shm: {[f.name for f in leaked]}"

    with open(tmp_path / "inference-quick.json") as f:
        saved = json.load(f)
    assert (tmp_path / "inference-quick.md").stat().st_size > 0
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra, which `make bench-smoke` installs
        assert (tmp_path / "inference-quick.png").stat().st_size > 0
    for key in ("cpu_model", "cores", "kernel", "python", "numpy", "shmbuf_commit"):
        assert saved["machine"][key], key
    assert saved["config"]["torch_threads_per_process"] == 1 and saved["config"]["forkserver_preload"]
    assert saved["skipped"] == {}
    systems = {r["system"] for r in saved["runs"]}
    assert systems == set(inference.SYSTEMS), systems
    variants = {(r["system"], r["variant"]) for r in saved["runs"]}
    assert {v for s, v in variants if s == "shmbuf_collector"} == {"nx1", "2xvec"}
    assert {v for s, v in variants if s == "shmbuf_async"} == {"processes", "2xvec"}
    for r in saved["runs"]:
        what = f"{r['system']} [{r['variant']}]"
        assert r["status"] == "ok", (what, r.get("error"))
        assert r["n"] == 4 and r["policy"] == "mlp64" and r["envs_logged"] == 4, what
        fps = r["frames_per_s"]
        assert all(_finite_positive(x) for x in fps["windows"]) and fps["min"] <= fps["median"] <= fps["max"], what
        # The figures against what they are made of: each window's rate times its length is a whole number of
        # frames (of batches, for what the learner received), and what was delivered is whole batches.
        window_s = [(b - a) / 1e9 for a, b in zip(r["edges_ns"], r["edges_ns"][1:])]
        assert len(window_s) == 2 and all(w > 0 for w in window_s), (what, r["edges_ns"])
        fpb = saved["config"]["frames_per_batch"]
        for rate, w in zip(fps["windows"], window_s):
            assert rate * w == pytest.approx(round(rate * w)), (what, fps, window_s)
        for rate, w in zip(r["delivered_per_s"], window_s):
            assert rate * w == pytest.approx(fpb * round(rate * w / fpb)), (what, r["delivered_per_s"], window_s)
        assert r["batches"] > 0 and r["frames_delivered"] == r["batches"] * fpb, what
        rt = r["round_trip_us"]
        assert _finite_positive(rt["p50"]) and rt["p99"] >= rt["p50"] and rt["n"] > 0, what
        assert _finite_positive(r["env_step_us"]["p50"]) and _finite_positive(r["wait_us"]["p50"]), what
        fwd = r["forward"]
        assert fwd["count"] > 0 and sum(fwd["hist"].values()) == fwd["count"], what
        assert all(1 <= int(k) <= 4 for k in fwd["hist"]), (what, fwd["hist"])
        rows = sum(int(k) * v for k, v in fwd["hist"].items())
        assert fwd["mean"] == pytest.approx(rows / fwd["count"]), (what, fwd)
        assert fwd["frame_weighted_mean"] == pytest.approx(sum(int(k) ** 2 * v for k, v in fwd["hist"].items()) / rows), what
        assert fwd["per_s"] == pytest.approx(fwd["count"] / sum(window_s)), (what, fwd)
        assert _finite_positive(fwd["duration_us_p50"]), what
        cpu = r["cpu_cores"]
        assert all(math.isfinite(cpu[k]) and cpu[k] >= 0 for k in ("learner", "children", "machine", "outside", "learner_kernel",
                                                                   "children_kernel", "children_switches_per_s")), what
        assert r["killed_pids"] == [], (what, r["killed_pids"])
    for ours in (r for r in saved["runs"] if r["system"] == "shmbuf_async"):
        assert ours["where"] == "learner" and ours["server"]["forwards"] > 0
    assert any(a["aim"].startswith("at least 20x") for a in saved["aims"])

    # --render rebuilds the table (and plot) from the raw records alone
    (tmp_path / "inference-quick.md").unlink()
    inference.main(["--render", str(tmp_path / "inference-quick.json"), "--no-plot"])
    page = (tmp_path / "inference-quick.md").read_text()
    assert "TorchRL MultiSyncCollector" in page
    # the aims are named by what they measure (readers know versions, not the project's issue numbers)
    assert "## Aims\n" in page and "| at least 20x TorchRL's AsyncBatchedCollector |" in page
    assert not re.search(r"\bissues? \d", page, re.I)


def test_event_log_keeps_order_across_the_ring_and_checks_its_header(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "ring.log")
    log = inference.EventLog(path, capacity=5)
    for i in range(8):
        log.add(10 * i, 10 * i + 1, i)
    log.close()
    recs = inference.read_log(path)
    assert recs[:, 2].tolist() == [3, 4, 5, 6, 7] and recs[:, 0].tolist() == [30, 40, 50, 60, 70]
    short = str(tmp_path / "short.log")
    log = inference.EventLog(short, capacity=5)
    log.add(1, 2, 3)
    log.close()
    assert inference.read_log(short).tolist() == [[1, 2, 3]]
    bad = tmp_path / "bad.log"
    np.zeros(8, np.int64).tofile(bad)
    with pytest.raises(ValueError, match="expected an event log"):
        inference.read_log(str(bad))


def test_analyse_counts_frames_round_trips_and_forwards_inside_the_windows(tmp_path: pathlib.Path) -> None:
    """Steps every 1 ms from t=0 (a reset at 5 ms), forwards of 2 rows; windows [2, 12) and [12, 22) ms."""
    ms = 1_000_000
    env = inference.EventLog(str(tmp_path / "env000-1-a.log"))
    for k in range(30):
        env.add(k * ms, k * ms + ms // 10, inference.RESET if k == 5 else inference.STEP)
    env.close()
    fwd = inference.EventLog(str(tmp_path / "fwd-1-b.log"))
    for k in range(30):
        fwd.add(k * ms, k * ms + ms // 5, 2)
    fwd.close()
    got = inference.analyse(str(tmp_path), [2 * ms, 12 * ms, 22 * ms])
    assert got["frames_per_s"]["windows"] == [9 / 0.01, 10 / 0.01]  # the reset at 5 ms is no frame
    assert got["round_trip_us"]["n"] == 18  # 19 steps inside; the one right after the reset starts no interval
    assert got["round_trip_us"]["p50"] == 1000.0 and got["wait_us"]["p50"] == 900.0 and got["env_step_us"]["p50"] == 100.0
    f = got["forward"]
    assert f["count"] == 20 and f["hist"] == {2: 20} and f["mean"] == 2.0 and f["duration_us_p50"] == 200.0
