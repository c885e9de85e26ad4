"""Per-step cost of the accumulators, in one process: ``Writer.add`` against echo's ``TrajectoryAccumulator.add``.

Both write the same T steps of a payload; shmbuf's writer runs in the reader's
own thread (the reader lends it slots, takes each commit and releases it).
Only the T ``add`` calls are timed; the commit / build is outside the clock.
Reported: the median over ``windows`` windows of the mean time per ``add``, with
the spread.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def _windows(fn: Any, windows: int, window_s: float) -> list[float]:
    out = []
    fn(3)  # warm-up, dropped
    for _ in range(windows):
        spent = 0
        adds = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < window_s:
            s, a = fn(50)
            spent += s
            adds += a
        out.append(spent / adds / 1e3)  # µs per add
    return out


def add_per_step(payload: str, windows: int, window_s: float) -> dict[str, Any]:
    import shmbuf
    from echo import TrajectoryAccumulator

    from benchmarks import payloads

    example = payloads.example(payload)
    steps = payloads.steps_of(payloads.rollout(payload))
    meta = {"send_ns": np.zeros((), np.int64)}
    reader = shmbuf.create(example, slots=4, max_writers=1)
    try:
        w = shmbuf.Writer(reader, timeout=5.0)
        reader.poll()

        def shm(rollouts: int) -> tuple[int, int]:
            spent = 0
            for _ in range(rollouts):
                t0 = time.perf_counter_ns()
                for s in steps:
                    w.add("step", s)
                spent += time.perf_counter_ns() - t0
                w.add("meta", meta)
                w.commit()
                reader.get(timeout=5.0).release()
            return spent, rollouts * len(steps)

        acc = TrajectoryAccumulator(example)

        def ech(rollouts: int) -> tuple[int, int]:
            spent = 0
            for _ in range(rollouts):
                t0 = time.perf_counter_ns()
                for s in steps:
                    acc.add("step", s)
                spent += time.perf_counter_ns() - t0
                acc.add("meta", meta)
                acc.build()
            return spent, rollouts * len(steps)

        res = {}
        for name, fn in (("shmbuf", shm), ("echo", ech)):
            us = _windows(fn, windows, window_s)
            res[name] = {"us_per_add": float(np.median(us)), "min": min(us), "max": max(us), "windows": us}
        w.close()
    finally:
        reader.close()
    res["payload"] = payload
    res["ratio_shmbuf_to_echo"] = res["shmbuf"]["us_per_add"] / res["echo"]["us_per_add"]
    return res


def child(conn: Any, payload: str, windows: int, window_s: float) -> None:
    import json

    conn.send_bytes(json.dumps(add_per_step(payload, windows, window_s)).encode())
