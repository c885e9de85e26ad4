"""Batch assembly, in one room: what a collector hands out (:class:`CollectedBatch`) and how it is made from the
rollouts a reader gave, whatever the collector (one machine or a Ray node, one policy or several).

- truncate-episodes: :func:`rounds_batch` over a reader's batch of ``B`` rollouts (views or a copy), with the
  episodes they recorded concatenated;
- complete-episodes: episodes copied one by one into a part (:func:`no_episodes`, :func:`take_episode`) and
  concatenated by :func:`episodes_batch` once the part holds enough frames;
- :func:`valid_steps`: the agent steps of multi-agent rollouts; :func:`progress`: a collector's figures.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import numpy as np
import optree

from shmbuf import layout as L

__all__ = ["CollectedBatch", "episodes_batch", "no_episodes", "progress", "rounds_batch", "take_episode", "valid_steps"]


class CollectedBatch:
    """One batch from a :class:`Collector`.

    ``data``: the rollout tree. Truncate-episodes: leaves ``(B, T, [E], ...)``
    for step leaves, ``(B, M, ...)`` for the episode table, ``(B, [E], ...)``
    for bootstrap; ``fill`` gives the filled counts per rollout. With
    ``copy=False`` (the default) they are views of the collector's batch
    buffer, overwritten by the next batch: copy what must live longer.
    Complete-episodes: every episode's steps concatenated, ``(N, ...)``,
    episodes split by ``lengths``; always the caller's own arrays.

    ``policy_version`` (B,): the weights version each rollout was collected
    with; ``policy_lag`` (B,): the learner's version when the batch was
    handed out minus that. ``lane``/``epoch``/``seq`` (B,): which writer lane made each
    rollout, which claim of that lane its writer held (an actor restarted with
    ``restart=True`` takes a new one) and the rollout's number in that claim, from 0: the
    key ``(lane, epoch, seq)`` names one rollout for the collector's whole life, actor
    restarts included (``(lane, seq)`` alone repeats after one). ``episode_returns``/
    ``episode_lengths``: of the episodes that ended inside this batch. ``frames``: env steps in it.
    """

    __slots__ = ("data", "fill", "policy_version", "policy_lag", "lane", "epoch", "seq", "frames", "episode_returns",
                 "episode_lengths", "lengths", "batch_mode")
    # What the collectors set (a field left out of the keywords is None: tests build partial batches).
    data: dict[str, Any]
    fill: dict[str, np.ndarray] | None  # None for complete-episodes batches
    policy_version: np.ndarray
    policy_lag: np.ndarray
    lane: np.ndarray
    epoch: np.ndarray
    seq: np.ndarray
    frames: int
    episode_returns: np.ndarray
    episode_lengths: np.ndarray
    lengths: np.ndarray
    batch_mode: str

    def __init__(self, **kw: Any):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def to_tensordict(self, *, rename: dict[str, str] | None = None) -> Any:
        """This batch in TorchRL's layout (tensordict needed): see :func:`workers.to_tensordict`."""
        from workers.compat._tensordict import to_tensordict

        return to_tensordict(self, rename=rename)

    def __repr__(self) -> str:
        return (f"CollectedBatch({self.batch_mode}, frames={self.frames}, episodes={len(self.episode_returns)}, "
                f"lag={self.policy_lag.tolist()})")


def no_episodes() -> dict[str, Any]:
    """A complete-episodes batch being gathered: the episodes' copies, their metadata, their frames."""
    return {"got": [], "versions": [], "lanes": [], "epochs": [], "seqs": [], "lengths": [], "frames": 0}


def rounds_batch(data: Any, fill: dict[str, np.ndarray], *, policy_version: np.ndarray, lane: np.ndarray,
                 epoch: np.ndarray, seq: np.ndarray, learner_version: int, frames: int) -> CollectedBatch:
    """A truncate-episodes batch of ``B`` rollouts (leaves ``(B, T, ...)``, ``fill`` each timescale's count per
    rollout), with the episodes they recorded concatenated; ``learner_version``: the learner's, for the lag."""
    ep_n = fill[L.EPISODE]
    rows = range(len(ep_n))
    return CollectedBatch(
        data=data, fill=fill, policy_version=policy_version, policy_lag=learner_version - policy_version, lane=lane,
        epoch=epoch, seq=seq, frames=frames,
        episode_returns=np.concatenate([data[L.EPISODE][L.RETURN][i, : ep_n[i]] for i in rows]),
        episode_lengths=np.concatenate([data[L.EPISODE][L.LENGTH][i, : ep_n[i]] for i in rows]), lengths=fill[L.STEP],
        batch_mode=L.TRUNCATE_EPISODES,
    )


def episodes_batch(part: dict[str, Any], policy_version: int) -> CollectedBatch:
    """A complete-episodes batch from the episodes gathered in ``part`` (see :func:`no_episodes`): every episode's
    steps concatenated, ``(N, ...)``, split by ``lengths``; ``policy_version``: the learner's, for the lag."""
    got = part["got"]
    data = {
        L.STEP: optree.tree_map(lambda *xs: np.concatenate(xs), *[g[L.STEP] for g in got]),
        L.EPISODE: optree.tree_map(lambda *xs: np.stack(xs), *[g[L.EPISODE] for g in got]),
        L.BOOTSTRAP: optree.tree_map(lambda *xs: np.stack(xs), *[g[L.BOOTSTRAP] for g in got]),
    }
    v = np.asarray(part["versions"], np.int64)
    return CollectedBatch(
        data=data, fill=None, policy_version=v, policy_lag=policy_version - v, lane=np.asarray(part["lanes"], np.int64),
        epoch=np.asarray(part["epochs"], np.int64), seq=np.asarray(part["seqs"], np.int64),
        frames=part["frames"], episode_returns=data[L.EPISODE][L.RETURN], episode_lengths=data[L.EPISODE][L.LENGTH],
        lengths=np.asarray(part["lengths"], np.int64), batch_mode=L.COMPLETE_EPISODES,
    )


def take_episode(part: dict[str, Any], r: Any) -> None:
    """Copy the rollout ``r`` (one episode) into ``part``, with its metadata, and release it."""
    try:
        part["got"].append(r.copy())
        part["versions"].append(r.policy_version)
        part["lanes"].append(r.lane)
        part["epochs"].append(r.epoch)
        part["seqs"].append(r.seq)
        part["lengths"].append(r.fill[L.STEP])
        part["frames"] += r.fill[L.STEP]
    finally:
        r.release()


def progress(frames: int, batches: int, t0: float | None, policy_version: int, lags: deque[int],
             returns: deque[float]) -> dict[str, Any]:
    """A collector's figures: frames, batches and frames/s since its first batch was asked for, lag, recent returns."""
    elapsed = time.monotonic() - t0 if t0 is not None else 0.0
    lag = np.asarray(lags) if lags else np.zeros(1)
    return {
        "frames": frames,
        "batches": batches,
        "seconds": elapsed,
        "frames_per_s": frames / elapsed if elapsed > 0 else math.nan,
        "policy_version": policy_version,
        "policy_lag_mean": float(lag.mean()),
        "policy_lag_max": int(lag.max()),
        "return_mean_100": float(np.mean(returns)) if returns else math.nan,
    }


def valid_steps(data: Any, fill: dict[str, np.ndarray]) -> int:
    """The agent steps of truncate-episodes rollouts ``(B, T, K, ...)``: each one's valid rows up to its fill."""
    valid = data[L.STEP][L.VALID]
    return int(sum(valid[i, : fill[L.STEP][i]].sum() for i in range(len(fill[L.STEP]))))
