"""Per-step cost of the accumulators, in one process: ``Writer.add`` against echo's ``TrajectoryAccumulator.add``.

Both write the same T steps of a payload; shmbuf's writer runs in the reader's
own thread (the reader lends it slots, takes each commit and releases it).
Only the T ``add`` calls are timed; the commit / build is outside the clock.
Windows alternate between shmbuf, echo and the plain write, kind after kind, so
that a change in the machine's load hits all of them; reported per system: the
median over windows of the mean time per ``add``, the spread, and the median of
the per-window ratios.

Three kinds of per-step items:

- ``numpy``: what indexing a rollout gives (``reward[t]`` is a numpy scalar,
  ``obs[t]`` an array). The step mode of the sweep uses these too.
- ``python``: Python float / int / bool for the scalar leaves, as a single
  gymnasium env returns reward, action, terminated; arrays for the others.
- ``arrays``: every item an ndarray, 0-d for the scalar leaves (``reward[t, ...]``),
  as a vectorised env or a policy network's output gives.

And the floor, ``plain``: a hand-written slot write (``dst[i] = x`` per leaf into
preallocated numpy arrays, no checks) of the ``numpy`` items, in the same windows.

Result: ``{"payload", "numpy": K, "python": K, "arrays": K, "plain": P}``, each K
``{"shmbuf": S, "echo": S, "ratio_shmbuf_to_echo", "ratio_min", "ratio_max"}`` with
S ``{"us_per_add", "min", "max", "windows"}``, and P ``{"us_per_add", "min", "max",
"windows", "items": "numpy"}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("numpy", "python", "arrays")


def _window(fn: Callable[[int], tuple[int, int]], window_s: float) -> float:
    spent = adds = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < window_s:
        s, a = fn(20)
        spent += s
        adds += a
    return spent / adds / 1e3  # µs per add


def _items(step: dict[str, np.ndarray], kind: str) -> list[dict[str, Any]]:
    t = len(next(iter(step.values())))
    if kind == "numpy":
        return [{k: v[i] for k, v in step.items()} for i in range(t)]
    if kind == "python":
        return [{k: v[i].item() if v.ndim == 1 else v[i] for k, v in step.items()} for i in range(t)]
    if kind == "arrays":
        return [{k: v[i, ...] for k, v in step.items()} for i in range(t)]
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def _stats(windows: list[float]) -> dict[str, Any]:
    return {"us_per_add": float(np.median(windows)), "min": min(windows), "max": max(windows), "windows": windows}


def add_per_step(payload: str, windows: int, window_s: float) -> dict[str, Any]:
    from echo import TrajectoryAccumulator

    import shmbuf
    from benchmarks import payloads

    example = payloads.example(payload)
    step = payloads.rollout(payload)["step"]
    meta = {"send_ns": np.zeros((), np.int64)}
    reader = shmbuf.create(example, slots=4, max_writers=1)
    try:
        w = shmbuf.Writer(reader, timeout=5.0)
        reader.poll()
        acc = TrajectoryAccumulator(example)
        floor = [(k, np.zeros_like(v)) for k, v in step.items()]

        def shm(steps: list[dict[str, Any]]) -> Callable[[int], tuple[int, int]]:
            def run(rollouts: int) -> tuple[int, int]:
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
            return run

        def ech(steps: list[dict[str, Any]]) -> Callable[[int], tuple[int, int]]:
            def run(rollouts: int) -> tuple[int, int]:
                spent = 0
                for _ in range(rollouts):
                    t0 = time.perf_counter_ns()
                    for s in steps:
                        acc.add("step", s)
                    spent += time.perf_counter_ns() - t0
                    acc.add("meta", meta)
                    acc.build()
                return spent, rollouts * len(steps)
            return run

        def plain(steps: list[dict[str, Any]]) -> Callable[[int], tuple[int, int]]:
            def run(rollouts: int) -> tuple[int, int]:
                spent = 0
                for _ in range(rollouts):
                    t0 = time.perf_counter_ns()
                    i = 0
                    for s in steps:
                        for k, dst in floor:
                            dst[i] = s[k]
                        i += 1
                    spent += time.perf_counter_ns() - t0
                return spent, rollouts * len(steps)
            return run

        runs = {kind: (shm(_items(step, kind)), ech(_items(step, kind))) for kind in KINDS}
        floor_run = plain(_items(step, "numpy"))
        for a, b in runs.values():  # warm-up, dropped: every slot's views built, every code path run once
            a(5)
            b(5)
        floor_run(5)
        got: dict[str, tuple[list[float], list[float]]] = {kind: ([], []) for kind in KINDS}
        floor_w: list[float] = []
        for _ in range(windows):
            for kind, (a, b) in runs.items():
                got[kind][0].append(_window(a, window_s))
                got[kind][1].append(_window(b, window_s))
            floor_w.append(_window(floor_run, window_s))
        w.close()
    finally:
        reader.close()
    res: dict[str, Any] = {"payload": payload}
    for kind, (a_w, b_w) in got.items():
        ratios = [x / y for x, y in zip(a_w, b_w)]
        res[kind] = {"shmbuf": _stats(a_w), "echo": _stats(b_w), "ratio_shmbuf_to_echo": float(np.median(ratios)),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)}
    res["plain"] = {**_stats(floor_w), "items": "numpy"}
    return res


def child(conn: Any, payload: str, windows: int, window_s: float) -> None:
    import json

    conn.send_bytes(json.dumps(add_per_step(payload, windows, window_s)).encode())
