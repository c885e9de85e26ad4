"""The zero-copy model (benchmarks/zero_copy.py, `make bench-zero-copy`) end to end at its smallest."""

from __future__ import annotations

import json
import pathlib

from benchmarks import zero_copy


def test_zero_copy_bench_smoke(tmp_path: pathlib.Path) -> None:
    """Every setting runs, the files are written, and what needs no rule holds: one writer's batches are all views."""
    rows = zero_copy.main(["--seeds", "1", "--batches", "20", "--out", str(tmp_path)])
    assert [r["setting"] for r in rows] == [name for name, _ in zero_copy.SETTINGS]
    assert all(r["batches"] == 20 and 0 <= r["views"] <= 20 and r["simulated_s"] > 0 for r in rows)
    one = {r["setting"]: r for r in rows}["1 writer, no pause"]
    assert one["views"] == 20, one
    (json_path,) = tmp_path.glob("zero-copy-*.json")
    assert len(json.loads(json_path.read_text())["rows"]) == len(rows)
    assert "| 1 writer, no pause | 100.0 % |" in json_path.with_suffix(".md").read_text()
