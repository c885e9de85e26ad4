"""Per-step cost of the accumulators, in one process: ``Writer.add`` against echo's ``TrajectoryAccumulator.add``.

Both write the same T steps of a payload; shmbuf's writer runs in the reader's
own thread (the reader lends it slots, takes each commit and releases it).
Only the T ``add`` calls are timed; the commit / build is outside the clock.
Windows alternate between the two, so that a change in the machine's load hits
both; reported: the median over windows of the mean time per ``add``, the
spread, and the median of the per-window ratios.

Two kinds of per-step items are measured:

- ``scalars``: what indexing a rollout gives (``reward[t]`` is a numpy scalar),
  and what a single gymnasium env returns for reward / action / done (scalars).
  This is the headline, the step mode of the sweep uses these too.
- ``arrays``: every item a numpy array, 0-d for the scalar leaves (``reward[t, ...]``),
  as a vectorised env or a policy network's output gives.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def _window(fn: Any, window_s: float) -> float:
    spent = adds = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < window_s:
        s, a = fn(20)
        spent += s
        adds += a
    return spent / adds / 1e3  # µs per add


def _items(step: dict[str, np.ndarray], kind: str) -> list[dict[str, Any]]:
    t = len(next(iter(step.values())))
    if kind == "scalars":
        return [{k: v[i] for k, v in step.items()} for i in range(t)]
    return [{k: v[i, ...] for k, v in step.items()} for i in range(t)]


def add_per_step(payload: str, windows: int, window_s: float) -> dict[str, Any]:
    import shmbuf
    from echo import TrajectoryAccumulator

    from benchmarks import payloads

    example = payloads.example(payload)
    step = payloads.rollout(payload)["step"]
    meta = {"send_ns": np.zeros((), np.int64)}
    reader = shmbuf.create(example, slots=4, max_writers=1)
    res: dict[str, Any] = {"payload": payload}
    try:
        w = shmbuf.Writer(reader, timeout=5.0)
        reader.poll()
        acc = TrajectoryAccumulator(example)
        for kind in ("scalars", "arrays"):
            steps = _items(step, kind)

            def shm(rollouts: int, steps: list[dict[str, Any]] = steps) -> tuple[int, int]:
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

            def ech(rollouts: int, steps: list[dict[str, Any]] = steps) -> tuple[int, int]:
                spent = 0
                for _ in range(rollouts):
                    t0 = time.perf_counter_ns()
                    for s in steps:
                        acc.add("step", s)
                    spent += time.perf_counter_ns() - t0
                    acc.add("meta", meta)
                    acc.build()
                return spent, rollouts * len(steps)

            shm(3)
            ech(3)  # warm-up, dropped
            a, b = [], []
            for _ in range(windows):
                a.append(_window(shm, window_s))
                b.append(_window(ech, window_s))
            ratios = [x / y for x, y in zip(a, b)]
            res[kind] = {
                "shmbuf": {"us_per_add": float(np.median(a)), "min": min(a), "max": max(a), "windows": a},
                "echo": {"us_per_add": float(np.median(b)), "min": min(b), "max": max(b), "windows": b},
                "ratio_shmbuf_to_echo": float(np.median(ratios)),
                "ratio_min": min(ratios), "ratio_max": max(ratios),
            }
        w.close()
    finally:
        reader.close()
    return res


def child(conn: Any, payload: str, windows: int, window_s: float) -> None:
    import json

    conn.send_bytes(json.dumps(add_per_step(payload, windows, window_s)).encode())
