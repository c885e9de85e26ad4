"""The rollout layout: the one contract between the actors that write rollouts and the learner code that reads them.

``workers`` writes rollouts in this layout and ``shmbuf.storage`` reads them; both import the keys from here,
and no other module spells them. numpy only. One way to import it: ``from shmbuf import layout as L``, then
``L.STEP``, ``L.OBS``, ``L.grid(...)``.

Layout (what :func:`rollout_example` builds; ``[E]`` is present for vector envs only; ``...`` is the
observation's or action's own shape)::

    STEP "step"          buffered, capacity T
        OBS          "obs"         (T, [E], ...)   the observation the action was taken on
        ACTION       "action"      (T, [E], ...)
        REWARD       "reward"      (T, [E])        float32
        TERMINATED   "terminated"  (T, [E])        bool: the MDP ended (no bootstrap)
        TRUNCATED    "truncated"   (T, [E])        bool: cut by a time limit (bootstrap from the final obs)
        <extras>                   (T, [E], ...)   whatever else the policy returned (log-probs, values, ...)
        VALID        "valid"       (T, K)          (multi-agent rollouts only) bool: the row's agent acted at
                                                   this step; the rows K of a policy's rollouts take the place
                                                   of sub-envs (workers' multi-agent loop)
    EPISODE "episode"    one record per episode that ended inside this rollout
        RETURN, LENGTH             of the whole episode (it may have started in an earlier rollout)
        TERMINATED, TRUNCATED      how it ended
        ENV          "env"         which sub-env (0 for a single env)
        END          "end"         (truncate-episodes) its last step's index in this rollout
        FINAL_OBS    "final_obs"   (truncate-episodes) the episode's final observation
    BOOTSTRAP "bootstrap" single-item
        OBS                        ([E], ...)      the successor of the last transition: the final observation
                                                   if that transition ended the episode, else the next one
        ENV_STEPS    "env_steps"   ()              env steps this actor has taken so far (all sub-envs)

Batch modes (RLlib's names, :data:`BATCH_MODES`):

- ``truncate_episodes``: every rollout is exactly T steps of every sub-env;
  it may start and end mid-episode. The episode table is buffered with
  capacity ``max_episodes`` (default ``T * E``, which can never fill). With a
  smaller table a rollout is committed short (fill < T) when the next step
  could overflow it, so nothing is ever dropped.
- ``complete_episodes``: a rollout is one episode of one sub-env, committed
  short when the episode ends before T. A vector env gets one Writer (lane)
  per sub-env. An episode still running after T steps is cut there like a
  time limit would: recorded ``truncated``, the sub-env reset.

Writing episode records: :class:`EpisodeTable` is their one writer (and lays the table out), for every
actor loop and for playback alike.

Reading rollouts back (the learner side): :func:`grid` sees a Rollout, a Batch, a workers CollectedBatch
or a data dict with its fill as one grid of ``B`` rollouts x ``T`` steps x ``E`` sub-envs (:class:`Grid`:
step leaves as ``(B, T, E, ...)`` views, the fill counts, the episode table), and :func:`successors`
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuf._errors import UsageError
from shmbuf.layout._episodes import EpisodeTable
from shmbuf.layout._grid import Grid, grid, successors
from shmbuf.layout._keys import (
    ACTION,
    BATCH_MODES,
    BOOTSTRAP,
    COMPLETE_EPISODES,
    END,
    ENV,
    ENV_STEPS,
    EPISODE,
    FINAL_OBS,
    FLAG_KEYS,
    LENGTH,
    OBS,
    RETURN,
    REWARD,
    STEP,
    STEP_KEYS,
    TERMINATED,
    TRUNCATE_EPISODES,
    TRUNCATED,
    VALID,
    check_batch_mode,
    zeros_with_lead,
)

__all__ = [
    "ACTION", "BATCH_MODES", "BOOTSTRAP", "COMPLETE_EPISODES", "END", "ENV", "ENV_STEPS", "EPISODE", "FINAL_OBS",
    "FLAG_KEYS", "LENGTH", "OBS", "RETURN", "REWARD", "STEP", "STEP_KEYS", "TERMINATED", "TRUNCATED",
    "TRUNCATE_EPISODES", "VALID", "EpisodeTable", "Grid", "check_batch_mode", "grid", "rollout_example", "successors",
    "zeros_with_lead",
]


def rollout_example(obs: Any, action: Any, *, rollout_len: int, num_envs: int | None = None,
                    extras: dict[str, Any] | None = None, batch_mode: str = TRUNCATE_EPISODES,
                    max_episodes: int | None = None) -> dict[str, Any]:
    """The shmbuf example (schema) of one rollout; see the module doc.

    Args:
        obs, action: one observation and one action of a single sub-env (no env dim).
        rollout_len: T, steps per rollout (at least 2).
        num_envs: E for a vector env in truncate-episodes mode (adds an env dim);
            None for a single env, and always None in complete-episodes mode.
        extras: one item of each extra step leaf the policy returns (no env dim).
        max_episodes: episode-table capacity in truncate-episodes mode (default T*E).
    """
    check_batch_mode(batch_mode)
    if not isinstance(rollout_len, int) or rollout_len < 2:
        raise UsageError(f"rollout_len: expected an int >= 2, got {rollout_len!r}")
    extras = dict(extras or {})
    clash = sorted(set(extras) & set(STEP_KEYS))
    if clash:
        raise UsageError(f"policy extras {clash} clash with the step leaves {list(STEP_KEYS)}; rename them")
    T = rollout_len
    env_dims: tuple[int, ...] = ()
    if num_envs is not None:
        if batch_mode == COMPLETE_EPISODES:
            raise UsageError("num_envs: complete-episodes rollouts hold one sub-env each; pass num_envs=None")
        env_dims = (int(num_envs),)
    E = num_envs or 1
    step = {
        OBS: zeros_with_lead(obs, T, *env_dims),
        ACTION: zeros_with_lead(action, T, *env_dims),
        REWARD: np.zeros((T, *env_dims), np.float32),
        TERMINATED: np.zeros((T, *env_dims), bool),
        TRUNCATED: np.zeros((T, *env_dims), bool),
    }
    for k, v in extras.items():
        step[k] = zeros_with_lead(v, T, *env_dims)
    bootstrap = {OBS: zeros_with_lead(obs, *env_dims), ENV_STEPS: np.zeros((), np.int64)}
    if batch_mode == COMPLETE_EPISODES:
        episode = EpisodeTable.example()
    else:
        m = T * E if max_episodes is None else int(max_episodes)
        if m < E:
            raise UsageError(f"max_episodes: expected at least num_envs={E} (every sub-env may end an episode in one "
                             f"step), got {m}")
        episode = EpisodeTable.example(obs, m)
    return {STEP: step, EPISODE: episode, BOOTSTRAP: bootstrap}

