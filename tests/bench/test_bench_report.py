"""The benchmark report's arithmetic, on hand-made summaries: echo's better configuration as every ratio's
denominator, issue 12's targets, the bound lines, both microbench formats, and the sweep plan. No processes,
no timing."""

from __future__ import annotations

import re
from typing import Any

import pytest

from benchmarks import report, run


def _spread(x: float) -> dict[str, Any]:
    return {"median": x, "min": x, "max": x, "windows": [x]}


def _summary(system: str, payload: str, rate: float, p99: float, learner: float = 5.0, actors: float = 10.0,
             views: float | None = None, mode: str = "transport", n: int = 2) -> dict[str, Any]:
    s = {"system": system, "payload": payload, "mode": mode, "actors": n, "batch": 16, "depth": 32, "status": "ok",
         "rollouts_per_s": _spread(rate), "mb_per_s": _spread(rate * 1e-3),
         "latency_us": {"p50": _spread(p99 / 2), "p99": _spread(p99)},
         "cpu_us_per_rollout": {"learner": learner, "actors": actors},
         "context_switches_per_rollout": {"learner": 0.0, "actors": 0.0}, "other_load_cores": 0.0}
    if views is not None:
        s["views_fraction"] = views
    return s


def _micro(new: bool) -> dict[str, Any]:
    def kind(us: float, ue: float) -> dict[str, Any]:
        return {"shmbuf": {"us_per_add": us, "min": us, "max": us, "windows": [us]},
                "echo": {"us_per_add": ue, "min": ue, "max": ue, "windows": [ue]},
                "ratio_shmbuf_to_echo": us / ue, "ratio_min": us / ue, "ratio_max": us / ue}

    if new:
        return {"payload": "small", "numpy": kind(1.0, 8.0), "python": kind(3.0, 6.0), "arrays": kind(1.0, 8.0),
                "plain": {"us_per_add": 0.5, "windows": [0.5]}}
    return {"payload": "small", "scalars": kind(2.6, 7.3), "arrays": kind(2.35, 7.3)}


@pytest.fixture
def summaries() -> list[dict[str, Any]]:
    out = []
    for payload, (shm, gat, e, e1) in {"small": (100_000, 60_000, 20_000, 30_000), "rl": (5_000, 4_000, 1_000, 800),
                                       "atari": (9_000, 8_000, 1_000, 600)}.items():
        out += [_summary("shmbuf", payload, shm, 100.0, learner=2.0, views=1.0),
                _summary("shmbuf_gather", payload, gat, 200.0, learner=8.0, views=0.0),
                _summary("echo", payload, e, 3_000.0), _summary("echo1", payload, e1, 900.0),
                _summary("faster_fifo", payload, 500, 5_000.0), _summary("mp_queue", payload, 400, 6_000.0)]
    return out


def _target(ts: list[dict[str, Any]], start: str) -> dict[str, Any]:
    hits = [t for t in ts if t["target"].startswith(start)]
    assert len(hits) == 1, (start, [t["target"] for t in ts])
    return hits[0]


def test_echo_best_takes_the_better_configuration_and_names_it(summaries: list[dict[str, Any]]) -> None:
    assert report.echo_best(summaries, "small", "transport", 2) == (30_000, "echo1")  # higher rate
    assert report.echo_best(summaries, "rl", "transport", 2) == (1_000, "echo")
    assert report.echo_best(summaries, "small", "transport", 2, ("latency_us", "p99"), lower=True) == (900.0, "echo1")
    summaries[3]["status"] = "stalled"  # echo1 small stalled: the other one is the better
    assert report.echo_best(summaries, "small", "transport", 2) == (20_000, "echo")
    assert report.echo_best(summaries, "small", "transport", 4) == (None, None)


def test_targets_of_issue_12(summaries: list[dict[str, Any]]) -> None:
    bw = {"rollout": 30.0, "dram": 9.0}
    ts = report.targets(summaries, _micro(True), bw, [], cores=2, payload_bytes={"small": 1864, "rl": 1_020_388,
                                                                                   "atari": 903_560})
    small = _target(ts, "transport small, 2 actors: shmbuf / echo's better")
    assert small["value"] == pytest.approx(100_000 / 30_000) and small["met"] and small["goal"] == ">= 3x"
    assert "(echo1)" in small["detail"] and "100% of batches were views" in small["detail"]
    assert small["bound"] == ""  # met: no bound line
    rl = _target(ts, "transport rl, 2 actors: shmbuf / echo's better")
    assert rl["value"] == pytest.approx(5.0) and rl["met"] is False
    assert "1-copy bound" in rl["bound"] and "8,000/s" in rl["bound"]  # needs 8x echo's 1,000/s
    atari = _target(ts, "transport atari, 2 actors: shmbuf / echo's better")
    assert atari["value"] == pytest.approx(9.0) and atari["met"] is False and atari["goal"] == ">= 12x"
    assert _target(ts, "transport rl, 2 actors: shmbuf / faster_fifo")["met"]
    assert _target(ts, "`Writer.add` / `TrajectoryAccumulator.add` per step, numpy")["met"]  # 0.125
    py = _target(ts, "`Writer.add` / `TrajectoryAccumulator.add` per step, Python")
    assert py["value"] == pytest.approx(0.5) and py["met"] is False and "plain slot write costs 0.50" in py["bound"]
    lat = _target(ts, "saturation latency, small")
    assert lat["value"] == pytest.approx(100 / 900) and lat["met"] is False and "(echo1)" in lat["detail"]
    assert "Little's law" in lat["bound"]
    cpu = _target(ts, "learner CPU per small rollout")
    assert cpu["value"] == 2.0 and cpu["met"]
    assert _target(ts, "shmbuf stalls")["met"]


def test_missing_figures_are_not_judged(summaries: list[dict[str, Any]]) -> None:
    """An old results file: the microbench's "scalars" stands for "numpy", Python items are "not measured"."""
    ts = report.targets(summaries, _micro(False), {"rollout": 30.0, "dram": 9.0}, [])
    assert _target(ts, "`Writer.add` / `TrajectoryAccumulator.add` per step, numpy")["value"] == pytest.approx(2.6 / 7.3)
    py = _target(ts, "`Writer.add` / `TrajectoryAccumulator.add` per step, Python")
    assert py["value"] is None and py["met"] is None
    ts = report.targets([s for s in summaries if s["system"] not in ("echo", "echo1")], None, {"dram": 9.0}, [])
    assert _target(ts, "transport small, 2 actors: shmbuf / echo's better")["met"] is None


def test_markdown_has_every_system_and_the_bound_lines(summaries: list[dict[str, Any]]) -> None:
    result = {"date": "2026-01-01", "machine": {"host": "h", "loadavg_start": [0.0], "loadavg_end": [0.0]},
              "machine_line": "m", "copy_bandwidth": {"rollout": 30.0, "dram": 9.0},
              "config": {"systems": list(report.NAMES), "payloads": ["small", "rl", "atari"], "batch": 16, "depth": 32,
                         "windows": 5, "window_s": 2.0, "warmup_s": 1.5, "pace_rate": 200.0, "latency_actors": 2},
              "payload_bytes": {"small": 1864, "rl": 1_020_388, "atari": 903_560}, "microbench": _micro(True),
              "summaries": summaries, "stalls": []}
    result["targets"] = report.targets(summaries, result["microbench"], result["copy_bandwidth"], [])
    md = report.markdown(result)
    assert "| small | 2 | 100,000 ±0% | 60,000 ±0% | 20,000 ±0% | 30,000 ±0% |" in md
    assert "| 3.33x (echo1) | 2.00x (echo1) |" in md
    assert "batches as views" in md and "| 100% | 0% |" in md
    assert "the floor: a hand-written slot write" in md
    assert "### What bounds each missed target" in md and "- transport rl, 2 actors" in md
    # The page names its targets by what they measure; readers know versions, not the project's issue numbers.
    assert "## Targets (transport, 2 actors, B=16, against echo's better configuration)" in md
    assert not re.search(r"\bissues? \d", md, re.I)


def test_the_plan_runs_the_scaling_row_and_everything_else_at_two_actors() -> None:
    runs = run.plan(run.parse_args([]))
    by = {(r["system"], r["payload"], r["mode"]): set() for r in runs}
    for r in runs:
        by[(r["system"], r["payload"], r["mode"])].add(r["actors"])
    assert by[("echo1", "small", "transport")] == {1, 2, 4, 8}
    assert by[("shmbuf_gather", "atari", "transport")] == {1, 2, 4, 8}
    assert by[("shmbuf", "rl", "transport")] == {2}
    assert by[("echo1", "rl", "step")] == {2} and ("shmbuf_gather", "rl", "step") not in by
    assert ("shmbuf_gather", "small", "latency") not in by and by[("echo1", "small", "latency")] == {2}
    assert len(runs) == 78
    assert {r["actors"] for r in run.plan(run.parse_args(["--actors", "1"]))} == {1, 2}  # latency stays at 2
    assert {r["actors"] for r in run.plan(run.parse_args(["--quick"]))} == {2}
