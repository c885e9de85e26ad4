"""The benchmark harness end to end at its smallest: shmbuf and mp.Queue, small payload, 1 actor, short windows.

No timing assertions: only that a run produces a result with the expected fields, that its
figures are what its raw record (the learner's window cuts and latency windows) gives, and
that every process and /dev/shm object is gone afterwards (the suite-wide leak check in
conftest also watches this).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

pytest.importorskip("tqdm")
pytest.importorskip("echo")

from benchmarks import harness, run  # after the skips: the bench extras may be missing


def _left_of(name: str) -> list[str]:
    """What pipeline ``name`` left in /dev/shm (other people's pipelines may come and go meanwhile)."""
    token = name.rsplit("-", 1)[-1]
    return [e for e in os.listdir("/dev/shm") if token in e]


def test_one_run_cleans_up_and_reports() -> None:
    rec = harness.run_one("shmbuf", "small", "transport", 1, batch=4, depth=8, windows=2, window_s=0.1, warmup_s=0.05,
                          stall_s=10.0)
    assert rec["status"] == "ok", rec
    assert len(rec["learner"]["cuts"]) == 3 and rec["learner"]["cuts"][-1]["batches"] > rec["learner"]["cuts"][0]["batches"]
    assert rec["killed_pids"] == [] or all(isinstance(p, int) for p in rec["killed_pids"])
    assert not mp.active_children()
    assert rec["address"].startswith("/shmbuf-") or rec["address"].startswith("shmbuf-")
    assert _left_of(rec["address"]) == [], "the run left objects in /dev/shm"


def test_sweep_writes_json_table_plot(tmp_path: os.PathLike[str]) -> None:
    try:
        import matplotlib  # noqa: F401  (the bench extra, which `make bench-smoke` installs)
        plot = True
    except ImportError:
        plot = False
    result = run.main(["--quick", "--systems", "shmbuf,mp_queue", "--payloads", "small", "--modes", "transport",
                       "--actors", "1", "--windows", "2", "--window-s", "0.1", "--warmup-s", "0.05", "--out", str(tmp_path)]
                      + ([] if plot else ["--no-plot"]))
    with open(result["paths"]["json"]) as f:
        saved = json.load(f)
    for key in ("date", "machine", "machine_line", "config", "copy_bandwidth", "summaries", "stalls", "targets", "runs"):
        assert key in saved, key
    m = saved["machine"]
    for key in ("cpu_model", "cores", "kernel", "python", "numpy", "echo"):
        assert m[key], key
    assert saved["copy_bandwidth"]["rollout"] > 0 and saved["copy_bandwidth"]["dram"] > 0
    assert [(s["system"], s["status"]) for s in saved["summaries"]] == [("shmbuf", "ok"), ("mp_queue", "ok")]
    for s in saved["summaries"]:
        # Each figure is checked against the raw record it comes from, not only for being positive.
        (r,) = [r for r in saved["runs"] if r["system"] == s["system"]]
        cuts = r["learner"]["cuts"]
        delivered = [(b["batches"] - a["batches"]) * r["batch"] for a, b in zip(cuts, cuts[1:])]
        assert len(delivered) == 2 and all(n > 0 for n in delivered), cuts  # --windows 2, each with rollouts in it
        rates = [n / (b["t"] - a["t"]) for n, a, b in zip(delivered, cuts, cuts[1:])]
        assert s["rollouts_per_s"]["windows"] == pytest.approx(rates)
        assert s["rollouts_per_s"]["median"] == pytest.approx(sum(rates) / 2)
        assert s["mb_per_s"]["windows"] == pytest.approx([x * r["rollout_bytes"] / 1e6 for x in rates])
        lat = r["learner"]["latency_us"]
        assert [w["n"] for w in lat] == delivered  # every rollout of a window timed once
        assert all(0 < w["p50"] <= w["p99"] for w in lat), lat
        assert s["latency_us"]["p50"]["windows"] == [w["p50"] for w in lat]
        assert s["latency_us"]["p99"]["windows"] == [w["p99"] for w in lat]
        cpu = [(b["cpu_ns"] - a["cpu_ns"]) / 1e3 / n for n, a, b in zip(delivered, cuts, cuts[1:])]
        assert s["cpu_us_per_rollout"]["learner"] == pytest.approx(sum(cpu) / 2) and all(x > 0 for x in cpu)
        assert s["cpu_us_per_rollout"]["actors"] > 0
    assert any(t["target"].startswith("transport small, 2 actors") for t in saved["targets"])
    assert os.path.getsize(result["paths"]["md"]) > 0
    if plot:
        assert os.path.getsize(result["paths"]["png"]) > 0
    assert not mp.active_children()
    for r in saved["runs"]:
        if r["system"] == "shmbuf":
            assert _left_of(r["address"]) == [], "the sweep left objects in /dev/shm"


def test_watchdog_kills_a_stalled_run_and_cleans_up() -> None:
    # Actors paced at one rollout per 5 s never fill a batch of 4: the watchdog must call it stalled after 1 s.
    rec = harness.run_one("shmbuf", "small", "latency", 1, batch=4, depth=8, windows=1, window_s=0.1, warmup_s=0.05,
                          stall_s=1.0, pace_s=5.0)
    assert rec["status"] == "stalled", rec
    assert rec["stall"]["batches_before"] == 0
    assert len(rec["killed_pids"]) == 2  # the learner and the actor, by pid
    assert not mp.active_children()
    assert _left_of(rec["address"]) == [], "the killed learner's pipeline was left in /dev/shm"


def test_a_sweep_without_the_bench_extra_says_what_to_install(monkeypatch) -> None:
    """Before: a sweep without echo installed reported 'echo learner died while starting', then crashed on
    faster_fifo's import, and wrote nothing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("echo", "faster_fifo") else real(name, *a))
    with pytest.raises(SystemExit, match=r"needs id-echo, faster-fifo \(the `bench` extra\): run `make bench`"):
        run.main(["--quick", "--systems", "shmbuf,echo,faster_fifo", "--no-plot"], prog="shmbuf bench")
