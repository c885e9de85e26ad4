"""Playback: a recording fed into a shmbuf pipeline as truncate-episodes rollouts, so the same learner code
trains on live actors or on files.

:func:`play` reads through a :class:`~shmbuf.storage.dataset.RolloutDataset`'s own batch filling
(``_alloc``, ``_fill``, which report the trajectories a rollout ends), so that both hand out
trajectories alike.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import UsageError
from shmbuf._validate import int_setting
from shmbuf.storage._fileformat import build, flat_leaves, read_metadata
from shmbuf.storage.dataset import RolloutDataset, _Traj


def playback_example(data_dir: str | os.PathLike[str], *, rollout_len: int, num_envs: int | None = None,
                     max_episodes: int | None = None) -> dict[str, Any]:
    """The shmbuf example of the rollouts :func:`play` writes: the workers truncate-episodes layout.

    Same tree as ``workers.rollout_example(obs, action, rollout_len=T, num_envs=E, extras=...)`` for
    the recorded fields: step leaves ``(T, [E], ...)``; an episode table of capacity ``max_episodes``
    (default ``T * E``) with return, length, terminated, truncated, env, end, final_obs; bootstrap
    obs and env_steps. ``num_envs=None``: a single env (no env dim).
    """
    meta = read_metadata(data_dir)
    rollout_len = int_setting("playback_example(rollout_len=...)", rollout_len, 2)
    if num_envs is not None:
        num_envs = int_setting("playback_example(num_envs=...) (None: a single env)", num_envs)
    if max_episodes is not None:
        max_episodes = int_setting("playback_example(max_episodes=...) (None: T * E)", max_episodes)
    leaves = {lf["file"]: lf for lf in meta["leaves"]}
    T, env = rollout_len, (() if num_envs is None else (num_envs,))
    E = num_envs or 1
    fields = dict(meta["fields"]["items"])

    def zeros(lead: tuple[int, ...]) -> Any:
        return lambda f: np.zeros(lead + tuple(leaves[f]["shape"]), leaves[f]["dtype"])

    step = {k: build(d, zeros((T, *env))) for k, d in fields.items()}
    if L.TRUNCATED not in step:
        step[L.TRUNCATED] = np.zeros((T, *env), bool)
    episode = L.EpisodeTable.example(build(fields[L.OBS], zeros(())), T * E if max_episodes is None else max_episodes)
    bootstrap = {L.OBS: build(fields[L.OBS], zeros(env)), L.ENV_STEPS: np.zeros((), np.int64)}
    return {L.STEP: step, L.EPISODE: episode, L.BOOTSTRAP: bootstrap}


def play(data_dir: str | os.PathLike[str], pipeline: Any, *, rollout_len: int, num_envs: int | None = None,
         dataset_loops: int = 1, random_shuffle_traj_order: bool = False, keep_latest_n_trajs: int = 0,
         seed: Any = None, max_rollouts: int | None = None, max_episodes: int | None = None,
         wait_timeout: float | None = 60.0, writer_timeout: float | None = 30.0, label: str = "playback") -> int:
    """Feed a recording into a shmbuf pipeline as truncate-episodes rollouts (:func:`playback_example`'s layout).

    The same learner code then trains on live actors or on files. Each of ``num_envs`` (None: one,
    without an env dim) streams plays trajectories one after another, handed out as
    :class:`RolloutDataset` does (same arguments, ``starting_frame_range=(0, 1)``); each rollout is
    ``rollout_len`` steps of every stream, written straight into the slot (``Writer.slot()``). A
    trajectory's last frame ends an episode: its record goes to the episode table with the recorded
    return and length, and a trajectory cut short by the recording is marked ``truncated`` there
    (bootstrap from its final observation), as the actor loop marks an episode it cuts.

    Returns the number of rollouts committed. Stops when the recording is used up (a last partial
    rollout is not committed), after ``max_rollouts``, or when the reader closes the pipeline.
    """
    import shmbuf

    T = rollout_len
    example = playback_example(data_dir, rollout_len=T, num_envs=num_envs, max_episodes=max_episodes)
    E = num_envs or 1
    ds = RolloutDataset(data_dir, E, dataset_loops, random_shuffle_traj_order, keep_latest_n_trajs, seed=seed,
                        wait_timeout=wait_timeout)
    committed, env_steps = 0, 0
    ep_cap = len(example[L.EPISODE][L.ENV])
    with shmbuf.Writer(pipeline, example, timeout=writer_timeout, label=label) as writer:
        try:
            ds.reset()
            while max_rollouts is None or committed < max_rollouts:
                out = ds._alloc(T)
                ends: list[tuple[int, int, _Traj]] = []
                try:
                    ds._fill(out, T, ends)
                except StopIteration:
                    break
                ends.sort(key=lambda x: (x[1], x[0]))  # the actor loop's order: by step, then by env
                if len(ends) > ep_cap:
                    raise UsageError(f"play(max_episodes={max_episodes}): a rollout ends {len(ends)} trajectories; "
                                     f"raise max_episodes to at least that")
                env_steps += T * E
                _write_rollout(writer.slot(), out, ds, ends, num_envs is None, env_steps)
                writer.commit(fill={L.EPISODE: len(ends)})
                committed += 1
        except shmbuf.PipelineClosed:
            pass
    return committed


def _write_rollout(slot: dict[str, Any], out: dict[str, np.ndarray], ds: RolloutDataset,
                   ends: list[tuple[int, int, _Traj]], single: bool, env_steps: int) -> None:
    """One played rollout into the slot's views (``(T, [E], ...)``); the copy from the batch is the only one.

    It builds a rollout from successors the dataset already read (the bootstrap obs is the last step's, the
    episode table's final_obs each ended trajectory's), so there is no successor to compute here.
    """
    step = slot[L.STEP]
    for name, view in flat_leaves(step):
        if name == L.TRUNCATED and L.TRUNCATED not in out:
            src = out["cut"]
        elif name == L.TRUNCATED:
            src = (out[L.TRUNCATED] != 0) | out["cut"]
        else:
            src = out[name]
        view[...] = src[:, 0] if single else src
    table = L.EpisodeTable(slot[L.EPISODE])
    obs = ds._fields[ds.obs_key]  # the recorded observation's tree: the final observations' files by leaf
    for k, (e, t, traj) in enumerate(ends):
        info = traj.info
        table.write(k, info["episode_return"], info["episode_length"], info[L.TERMINATED],
                    bool(info[L.TRUNCATED]) or traj.unflagged_end, e, t, build(obs, traj.final.__getitem__))
    boot = slot[L.BOOTSTRAP]
    for name, view in flat_leaves({L.OBS: boot[L.OBS]}):
        last = out["next:" + name][-1]
        view[...] = last[0] if single else last
    boot[L.ENV_STEPS][...] = env_steps
