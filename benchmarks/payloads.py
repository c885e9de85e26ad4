"""The three payloads: one message is one rollout, ``{"step": {...leading dim T...}, "meta": {"send_ns": 0-d int64}}``.

``meta/send_ns`` (8 bytes) is the actor's ``time.monotonic_ns()`` when it sent or
committed the rollout. It rides in the payload of every system so that latency is
measured the same way everywhere; it is counted in the rollout's bytes.

- ``small``: T=64 CartPole-like steps.
- ``rl``: the 43-leaf observation of echo's own benchmark
  (instadeepai/echo, ``benches/bench_distributed.py``), stacked to T=5 as it does.
- ``atari``: T=32 frame stacks of 4×84×84 uint8.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAMES = ("small", "rl", "atari")

# echo's rl observation, leaf name -> (shape, dtype), in its order (the dict is sorted by optree anyway).
_F32, _F16, _I32 = np.float32, np.float16, np.int32
_RL_LEAVES: list[tuple[str, tuple[int, ...], Any]] = [("action_mask", (10, 17), _F32)] + [
    (f"feature_{i}", shape, dt)
    for i, (shape, dt) in enumerate(
        [
            ((2,), _F32), ((4,), _F32), ((3,), _F32),
            ((80, 2), _F32), ((80, 2), _F32), ((80, 1), _F32), ((80, 8), _F32), ((80, 2), _F32), ((80, 6), _F32),
            ((80, 2), _F32), ((80,), _F32), ((80,), _I32),
            ((80, 16, 2, 5), _F16), ((80, 16, 2, 5), _F16), ((80, 16, 1, 5), _F16), ((80, 16, 1, 5), _F16),
            ((10, 17), _F32), ((10, 8), _F32), ((10, 2), _F32), ((10, 2), _F32), ((10, 9), _F32), ((10, 8), _F32),
            ((10, 8), _F32), ((10, 4), _F32), ((10, 1), _F32), ((10, 5), _F32), ((10, 40), _F32), ((10, 30), _F32),
            ((10, 10), _F32), ((10, 8), _F32), ((10, 8), _F32), ((10, 8), _F32), ((10, 2), _F32), ((10, 6), _F32),
            ((10, 2), _F32), ((10,), _F32), ((10, 16, 6, 14), _F16), ((10, 16, 6, 14), _F16), ((10, 32, 24), _F32),
            ((10,), _I32), ((10, 16, 3, 14), _F16), ((10, 16, 3, 14), _F16),
        ],
        start=1,
    )
]
RL_T = 5


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.05
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(0, min(info.max, 255) + 1, size=shape, dtype=dtype)
    raise TypeError(dtype)


def step_spec(name: str) -> tuple[int, list[tuple[str, tuple[int, ...], Any]]]:
    """(T, [(leaf name, per-step shape, dtype)]) of a payload's ``step`` timescale."""
    if name == "small":
        return 64, [("obs", (4,), np.float32), ("action", (), np.int64), ("reward", (), np.float32), ("done", (), np.bool_)]
    if name == "rl":
        return RL_T, _RL_LEAVES
    if name == "atari":
        return 32, [("obs", (4, 84, 84), np.uint8), ("action", (), np.int64), ("reward", (), np.float32)]
    raise ValueError(f"payload: expected one of {NAMES}, got {name!r}")


def rollout(name: str, seed: int = 0) -> dict[str, Any]:
    """One filled rollout of payload ``name`` (random contents, fixed seed)."""
    t, leaves = step_spec(name)
    rng = np.random.default_rng(seed)
    step = {k: _random(rng, (t, *shape), dt) for k, shape, dt in leaves}
    return {"step": step, "meta": {"send_ns": np.zeros((), np.int64)}}


def example(name: str) -> dict[str, Any]:
    """The zero example that every system is built from (same tree as :func:`rollout`)."""
    t, leaves = step_spec(name)
    return {"step": {k: np.zeros((t, *shape), dt) for k, shape, dt in leaves}, "meta": {"send_ns": np.zeros((), np.int64)}}


def steps_of(tree: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """The rollout's ``step`` timescale cut into T per-step dicts (views, nothing copied)."""
    step = tree["step"]
    t = len(next(iter(step.values())))
    return [{k: v[i] for k, v in step.items()} for i in range(t)]


def nbytes(name: str) -> int:
    """Bytes of one rollout (every leaf, ``meta/send_ns`` included)."""
    t, leaves = step_spec(name)
    return 8 + sum(t * int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for _, shape, dt in leaves)


def touch_leaf(name: str) -> str:
    """The leaf the learner sums on every batch (the reward where there is one)."""
    return "reward" if name in ("small", "atari") else "feature_36"
