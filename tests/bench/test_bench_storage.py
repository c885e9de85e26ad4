"""The storage benchmark (benchmarks/storage.py, `make bench-storage`) end to end at its smallest.

Moved here from tests/test_storage_replay.py with the other benchmark smoke tests (`make bench-smoke`).
"""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.conftest import leaked_since


def test_storage_bench_smoke(tmp_path: pathlib.Path) -> None:
    """benchmarks/storage.py end to end at its smallest: every section has figures, the files are written, nothing is left."""
    pytest.importorskip("torchrl")  # in the test and bench extras; a bare `pip install -e .` has no torchrl
    from benchmarks import storage

    before = {e for e in os.listdir("/dev/shm") if "shmbuf-" in e}
    res = storage.main(["--quick", "--windows", "1", "--window-s", "0.05", "--warmup-s", "0", "--repeats", "1",
                        "--rows", "vec64", "--gae-t", "24", "--procs", "1,2", "--out", str(tmp_path)])
    assert [(r["system"], r["insert_rows_per_s"]["median"] > 0, r["sample_rows_per_s"]["median"] > 0)
            for r in res["replay"]] == [("shmbuf", True, True), ("torchrl", True, True), ("numpy_ring", True, True)]
    assert [(r["procs"], r["exit_codes"]) for r in res["processes"]] == [(1, [0]), (2, [0, 0])]
    assert res["gae"][0]["max_abs_diff"] < 1e-4 and res["machine"]["cpu_model"]
    assert os.path.exists(res["paths"]["json"]) and "| vec64 | insert |" in pathlib.Path(res["paths"]["md"]).read_text()
    assert not leaked_since(before)  # nothing of ours or of a dead child: other programs may share /dev/shm
