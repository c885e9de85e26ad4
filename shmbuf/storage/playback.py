"""Playback: a recording fed into a shmbuf pipeline as truncate-episodes rollouts, so the same learner code
trains on live actors or on files.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shmbuf._errors import UsageError
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
    if isinstance(rollout_len, bool) or not isinstance(rollout_len, int) or rollout_len < 2:
        raise UsageError(f"playback_example(rollout_len=...): expected an int >= 2, got {rollout_len!r}")
    if num_envs is not None and (isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1):
        raise UsageError(f"playback_example(num_envs=...): expected None (a single env) or an int >= 1, got {num_envs!r}")
    if max_episodes is not None and (isinstance(max_episodes, bool) or not isinstance(max_episodes, (int, np.integer))
                                     or max_episodes < 1):
        raise UsageError(f"playback_example(max_episodes=...): expected None (T * E) or an int >= 1, got {max_episodes!r}")
    leaves = {lf["file"]: lf for lf in meta["leaves"]}
    T, env = rollout_len, (() if num_envs is None else (num_envs,))
    E = num_envs or 1
    m = max(T * E if max_episodes is None else int(max_episodes), 2)
    fields = dict(meta["fields"]["items"])

    def zeros(lead: tuple[int, ...]) -> Any:
        return lambda f: np.zeros(lead + tuple(leaves[f]["shape"]), leaves[f]["dtype"])

    step = {k: build(d, zeros((T, *env))) for k, d in fields.items()}
    if "truncated" not in step:
        step["truncated"] = np.zeros((T, *env), bool)
    episode = {"return": np.zeros(m, np.float64), "length": np.zeros(m, np.int64), "terminated": np.zeros(m, bool),
               "truncated": np.zeros(m, bool), "env": np.zeros(m, np.int32), "end": np.zeros(m, np.int32),
               "final_obs": build(fields["obs"], zeros((m,)))}
    bootstrap = {"obs": build(fields["obs"], zeros(env)), "env_steps": np.zeros((), np.int64)}
    return {"step": step, "episode": episode, "bootstrap": bootstrap}


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
    ep_cap = len(example["episode"]["env"])
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
                writer.commit(fill={"episode": len(ends)})
                committed += 1
        except shmbuf.PipelineClosed:
            pass
    return committed


def _write_rollout(slot: dict[str, Any], out: dict[str, np.ndarray], ds: RolloutDataset,
                   ends: list[tuple[int, int, _Traj]], single: bool, env_steps: int) -> None:
    """One played rollout into the slot's views (``(T, [E], ...)``); the copy from the batch is the only one."""
    step = slot["step"]
    for name, view in flat_leaves(step):
        if name == "truncated" and "truncated" not in out:
            src = out["cut"]
        elif name == "truncated":
            src = (out["truncated"] != 0) | out["cut"]
        else:
            src = out[name]
        view[...] = src[:, 0] if single else src
    ep = slot["episode"]
    for k, (e, t, traj) in enumerate(ends):
        info = traj.info
        ep["return"][k] = info["episode_return"]
        ep["length"][k] = info["episode_length"]
        ep["terminated"][k] = info["terminated"]
        ep["truncated"][k] = bool(info["truncated"]) or traj.unflagged_end
        ep["env"][k] = e
        ep["end"][k] = t
        for name, view in flat_leaves({"obs": ep["final_obs"]}):
            view[k] = traj.final[name]
    boot = slot["bootstrap"]
    for name, view in flat_leaves({"obs": boot["obs"]}):
        last = out["next:" + name][-1]
        view[...] = last[0] if single else last
    boot["env_steps"][...] = env_steps
