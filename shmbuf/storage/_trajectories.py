"""Trajectories of a time-major ``[T, N]`` storage (split at episode ends, padded, unpadded) and the index helpers
its minibatch generators use; numpy only (:func:`unpad_trajectories` also takes torch tensors)."""

from __future__ import annotations

from typing import Any

import numpy as np


def trajectories(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trajectories of a ``[T, N]`` episode-end mask, env-major (env 0's in time order, then env 1's, ...):
    ``(env, first step, length)`` of each. Every env's last trajectory is cut at T."""
    T, N = ends.shape
    first = np.empty((N, T), bool)
    first[:, 0] = True
    first[:, 1:] = ends[:-1].T
    starts = np.flatnonzero(first)
    lengths = np.diff(np.append(starts, N * T))
    env, t0 = np.divmod(starts, T)
    return env, t0, lengths


def pad(arr: np.ndarray, t0: np.ndarray, env: np.ndarray, lengths: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Trajectories of ``arr`` ``[T, N, ...]`` gathered into ``[L, traj, ...]`` (zeros past each end) and the masks."""
    masks = np.arange(L)[:, None] < lengths[None, :]
    s, c = np.nonzero(masks)
    out = np.zeros((L, len(lengths), *arr.shape[2:]), arr.dtype)
    out[s, c] = arr[t0[c] + s, env[c]]
    return out, masks


def split_and_pad_trajectories(arr: Any, dones: Any, *, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """rsl_rl's helper, in numpy: split ``arr`` ``[T, N, ...]`` at episode ends (``dones`` ``[T, N]``, true at a
    trajectory's last step) into trajectories, env-major, and pad them to ``[L, traj, ...]`` with zeros; return
    ``(padded, masks)``, ``masks[s, j]`` true where trajectory ``j`` has a step ``s``. ``L`` is ``pad_to``
    (rsl_rl pads to T) or the longest trajectory's length."""
    arr = np.asarray(arr)
    dones = np.asarray(dones).reshape(arr.shape[:2]).astype(bool, copy=False)
    env, t0, lengths = trajectories(dones)
    L = int(lengths.max()) if pad_to is None else int(pad_to)
    return pad(arr, t0, env, lengths, L)


def unpad_trajectories(padded: Any, masks: Any, num_steps: int | None = None) -> Any:
    """Inverse of the padding: ``[L, traj, ...]`` back to ``[T, envs, ...]`` (rsl_rl's ``unpad_trajectories``),
    for trajectories that tile whole envs, as a recurrent minibatch's do. ``num_steps`` is T (default ``L``, as
    when padded to T). Works on numpy arrays and torch tensors alike."""
    L = padded.shape[0]
    T = L if num_steps is None else num_steps
    flat = padded.swapaxes(0, 1)[masks.swapaxes(0, 1)]
    return flat.reshape(-1, T, *padded.shape[2:]).swapaxes(0, 1)


def aliases(arrays: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split off the fields that are the same array as an earlier one (rsl_rl's ``critic_obs = obs`` when there
    are no privileged observations): they are gathered once and yielded as the same object."""
    own: dict[str, Any] = {}
    alias: dict[str, str] = {}
    for name, a in arrays.items():
        same = next((m for m, b in own.items() if a is not None and b is a), None)
        if same is None:
            own[name] = a
        else:
            alias[name] = same
    return own, alias


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + c)`` for each pair, without a Python loop."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(total)


def flat_getter(arr: np.ndarray, n: int, N: int) -> Any:
    """``idx -> rows`` of ``arr[:n]`` taken as ``[n * N, ...]``: ``take`` on a flat view, or a 2-index gather."""
    head = arr[:n]
    try:
        flat = np.reshape(head, (n * N, *arr.shape[2:]), copy=False)
        return lambda idx: flat.take(idx, axis=0)
    except ValueError:
        return lambda idx: head[idx // N, idx % N]
