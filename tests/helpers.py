"""Shared by tests and their child processes (must be importable under spawn)."""

from __future__ import annotations

import zlib
from typing import Any

import msgpack
import numpy as np

import shmbuf

from tests.conftest import small_example


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
