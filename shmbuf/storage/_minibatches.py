"""The minibatches of a time-major ``[T, N, ...]`` storage: flat and shuffled, or whole trajectories padded with
masks. numpy only; each yields plain dicts of arrays, which :class:`~shmbuf.storage.rollout.TimeMajorStorage`'s
generators turn into its ``MiniBatch`` records (and a façade into its framework's types)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from shmbuf.storage._trajectories import aliases, flat_getter, pad, ranges, trajectories
from shmbuf.storage._transition import NO_HIDDEN_STATES, ActorCriticHiddenState


def flat_minibatches(fields: dict[str, np.ndarray | None], n: int, N: int, k: int, epochs: int,
                     rng: np.random.Generator) -> Iterator[dict[str, Any]]:
    """``k`` shuffled minibatches of rows ``[0, n)`` of every ``[T, N, ...]`` field (None stays None), per epoch: a
    new permutation each epoch, every one of the ``n * N`` transitions in exactly one minibatch (sizes differ by at
    most one). A field that is the same array as an earlier one is gathered once and given as the same object."""
    src, alias = aliases(fields)
    get = {name: (None if a is None else flat_getter(a, n, N)) for name, a in src.items()}
    for _ in range(epochs):
        for idx in np.array_split(rng.permutation(n * N), k):
            out = {name: (None if g is None else g(idx)) for name, g in get.items()}
            for name, same in alias.items():
                out[name] = out[same]
            yield out


def recurrent_minibatches(obs_fields: dict[str, np.ndarray], step_fields: dict[str, np.ndarray | None],
                          ends: np.ndarray, hidden: tuple[np.ndarray | None, np.ndarray | None], n: int, N: int, k: int,
                          epochs: int, rng: np.random.Generator, *, shuffle: bool,
                          pad_to: str) -> Iterator[dict[str, Any]]:
    """Minibatches of whole envs, their trajectories split at ``ends`` (``[n, N]``, true at a trajectory's last step).

    Envs are cut into ``k`` groups (contiguous ranges, or with ``shuffle`` a fresh random split each epoch, each group
    in ascending env order). ``obs_fields`` are padded per trajectory to ``[L, traj, ...]`` (``L``: the group's longest
    trajectory, ``pad_to="longest"``, or ``n``, ``"rollout"``) with ``masks``; ``step_fields`` stay ``[n, envs, ...]``
    (views for a contiguous range); ``hidden_states`` are ``(actor, critic)`` at each trajectory's first step
    (``(None, None)`` when neither is stored).
    """
    env, t0, lengths = trajectories(ends)
    obs_f, alias = aliases(obs_fields)
    obs_f = {name: a[:n] for name, a in obs_f.items()}
    step_f = {name: (None if a is None else a[:n]) for name, a in step_fields.items()}
    bounds = np.searchsorted(env, np.arange(N + 1))  # trajectories of env e: [bounds[e], bounds[e + 1])
    for _ in range(epochs):
        order = np.arange(N) if not shuffle else rng.permutation(N)
        for group in np.array_split(order, k):
            if shuffle:
                group = np.sort(group)
                j = ranges(bounds[group], bounds[group + 1] - bounds[group])
                cols: Any = group
            else:
                lo, hi = int(group[0]), int(group[-1]) + 1
                j = np.arange(bounds[lo], bounds[hi])
                cols = slice(lo, hi)
            L = n if pad_to == "rollout" else int(lengths[j].max())
            out: dict[str, Any] = {}
            masks = None
            for name, a in obs_f.items():
                out[name], masks = pad(a, t0[j], env[j], lengths[j], L)
            for name, same in alias.items():
                out[name] = out[same]
            for name, a in step_f.items():
                out[name] = None if a is None else a[:, cols]
            h = NO_HIDDEN_STATES
            if hidden[0] is not None or hidden[1] is not None:
                h = ActorCriticHiddenState(*(None if x is None else x[t0[j], env[j]] for x in hidden))
            out["hidden_states"] = h
            out["masks"] = masks
            yield out
