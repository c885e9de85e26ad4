"""Shared by tests and their child processes (must be importable under spawn)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import zlib
from typing import Any

import msgpack
import numpy as np

import shmbuf

from tests.conftest import small_example

ROOT = pathlib.Path(__file__).resolve().parent.parent


def doc_blocks(page: str) -> list[str]:
    """The ```python blocks of ``docs/<page>`` (or a path from the repo root), in order."""
    path = ROOT / page if "/" in page else ROOT / "docs" / page
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_doc_block(page: str, k: int, tmp_path: pathlib.Path, timeout: float = 180) -> str:
    """Run block ``k`` of a docs page as written, as a script in a fresh interpreter (warnings are errors);
    return what it printed, for the test to check against what the page says it prints."""
    script = tmp_path / f"doc_block_{k}.py"
    script.write_text(doc_blocks(page)[k])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, f"block {k} of {page} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def fill_step(step: dict[str, np.ndarray], lane_tag: int, seq: int, t: int) -> None:
    step["obs"][:] = (lane_tag, seq, t, lane_tag * 1000 + seq)
    step["action"][...] = seq * 100 + t
    step["reward"][...] = t * 0.5
    step["done"][...] = t % 2 == 0


def checksum(data: dict[str, Any], fill: int) -> int:
    c = 0
    for name in ("obs", "action", "reward", "done"):
        c = zlib.crc32(np.ascontiguousarray(data["step"][name][:fill]).tobytes(), c)
    return c


def exactly_once_writer(name: str, tag: int, n: int, t: int, out: Any) -> None:
    """Write ``n`` rollouts of varying length; send (seq, length, crc) of each back to the test over ``out``."""
    step = {k: np.zeros(v.shape[1:], v.dtype) for k, v in small_example(t)["step"].items()}
    crcs = []
    with shmbuf.Writer(name, timeout=60, label=f"w{tag}") as w:
        for seq in range(n):
            length = 1 + (seq * 7 + tag) % t
            for i in range(length):
                fill_step(step, tag, seq, i)
                w.add("step", step)
            w.add("episode", {"return": np.array([seq], np.float32), "length": np.array([length], np.int32)})
            w.add("final", {"obs": np.full(4, tag, np.float32), "value": np.float32(seq)})
            got = w.commit()
            assert got == seq
            # what the reader must see, computed from what we wrote
            exp = {k: np.zeros((t, *v.shape), v.dtype) for k, v in step.items()}
            for i in range(length):
                fill_step(step, tag, seq, i)
                for k in exp:
                    exp[k][i] = step[k]
            crcs.append((seq, length, checksum({"step": exp}, length)))
    out.send_bytes(msgpack.packb(crcs))  # results as msgpack, like everything else here
    out.close()


# ------------------------------------------------------------- fault tests

FT = 8  # steps per rollout in fault tests


def fault_example() -> dict[str, Any]:
    """small_example plus a check timescale: the writer's tag and a CRC of the steps it wrote."""
    ex = small_example(FT)
    ex["check"] = {"tag": np.zeros((), np.int64), "crc": np.zeros((), np.int64), "seq": np.zeros((), np.int64)}
    return ex


def loop_writer(name: str, tag: int, committed: Any, rollouts: int = -1, timeout: float | None = None) -> None:
    """Commit rollouts until killed (or ``rollouts`` done); publish the last committed seq in ``committed``."""
    step = {k: np.zeros(v.shape[1:], v.dtype) for k, v in small_example(FT)["step"].items()}
    buf = {k: np.zeros((FT, *v.shape), v.dtype) for k, v in step.items()}
    seq = 0
    try:
        with shmbuf.Writer(name, timeout=timeout, label=f"tag{tag}") as w:
            while seq != rollouts:
                length = 1 + (seq * 5 + tag) % FT
                for i in range(length):
                    fill_step(step, tag, seq, i)
                    w.add("step", step)
                    for k in buf:
                        buf[k][i] = step[k]
                w.add("episode", {"return": np.array([seq], np.float32), "length": np.array([length], np.int32)})
                w.add("check", {"tag": tag, "crc": checksum({"step": buf}, length), "seq": seq})
                w.commit()
                committed.value = seq
                seq += 1
    except (shmbuf.PipelineClosed, shmbuf.BrokenPipeline):
        # The reader closed while this writer was still attaching (the with block swallows it once inside), or
        # died: the expected ways out, told apart from a crash.
        os._exit(3)
    if seq != rollouts:  # left the loop early: the reader closed, and the with block ended quietly on PipelineClosed
        os._exit(3)


def verify(r: shmbuf.Rollout) -> tuple[int, int]:
    """Check a fault-test rollout is intact; return (tag, seq)."""
    d = r.data
    tag, seq, crc = int(d["check"]["tag"]), int(d["check"]["seq"]), int(d["check"]["crc"])
    assert r.seq == seq, f"lane seq {r.seq} != written seq {seq}"
    assert checksum(d, r.fill["step"]) == crc, f"tag {tag} seq {seq}: data does not match its checksum"
    assert d["episode"]["return"][0] == seq and d["episode"]["length"][0] == r.fill["step"]
    return tag, seq
