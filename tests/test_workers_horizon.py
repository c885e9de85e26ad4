"""Horizons in the actor loop (RLlib's horizon, soft_horizon, no_done_at_end), against CountingEnv's ground truth.

CountingEnv's episode k lasts LENGTHS[(k + env_id) % 7] steps and ends terminated (k % 3 == 0), truncated
(k % 3 == 1) or both (k % 3 == 2). With ``horizon=H`` the actor cuts longer episodes at H steps and resets
the env, which is exactly ``expected_stream(env_id, n, cap=H)``; a soft horizon never resets, so the env's
stream is the uncapped one and only the episode table changes.
"""

from __future__ import annotations

from functools import partial

import gymnasium as gym
import numpy as np
import pytest

from shmbuf import UsageError
from shmbuf.layout import successors
from tests.helpers_workers import LENGTHS, CountingEnv, EchoPolicy, expected_stream, make_counting, make_vector
from tests.helpers_workers import collect_with as collect
from workers import ActorLoop, Collector


def columns(rollouts, n_envs, vector):
    """Per sub-env: its stored step rows concatenated over rollouts (truncate-episodes, commit order)."""
    out = []
    for e in range(n_envs):
        rows = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated")}
        for r in rollouts:
            n, step = r["fill"]["step"], r["data"]["step"]
            for k, acc in rows.items():
                a = np.asarray(step[k])[:n]
                acc.append(a[:, e] if vector else a)
        out.append({k: np.concatenate(v) for k, v in rows.items()})
    return out


def episode_records(rollouts, e, vector):
    """Sub-env ``e``'s episode-table records in order: (end step in its stream, return, length, terminated, truncated)."""
    recs, pos = [], 0
    for r in rollouts:
        ep, m = r["data"]["episode"], r["fill"]["episode"]
        for i in range(m):
            if int(ep["env"][i]) == e:
                recs.append((pos + int(ep["end"][i]), float(ep["return"][i]), int(ep["length"][i]),
                             bool(ep["terminated"][i]), bool(ep["truncated"][i])))
        pos += r["fill"]["step"]
    return recs


def check_stream(col, truth, *, no_done=False):
    assert col["obs"].tolist() == [tr["obs"] for tr in truth]
    assert col["action"].tolist() == [tr["action"] for tr in truth]
    assert col["reward"].tolist() == [tr["reward"] for tr in truth]
    ended = [tr["terminated"] or tr["truncated"] for tr in truth]
    if no_done:
        assert not col["terminated"].any()
        assert col["truncated"].tolist() == ended
    else:
        assert col["terminated"].tolist() == [tr["terminated"] for tr in truth]
        assert col["truncated"].tolist() == [tr["truncated"] for tr in truth]


@pytest.mark.parametrize("where", ["single", "vector"])
@pytest.mark.parametrize("H", [1, 3, 5])
def test_horizon_cuts_episodes_at_exactly_H_steps_as_truncated(where, H):
    E = 1 if where == "single" else 3
    make = (lambda: CountingEnv(0)) if where == "single" else (lambda: make_vector(3))
    T = 6
    rollouts, loop = collect(make, EchoPolicy(), T=T, n_rollouts=6, horizon=H)
    n = 6 * T
    for e, col in enumerate(columns(rollouts, E, where == "vector")):
        truth = expected_stream(e, n, cap=H)  # the env reset at every cut, as the actor did
        check_stream(col, truth)
        assert (col["obs"][:, 2] < H).all()  # no episode takes a step past its H-th
        want = [(i, tr["ret"], tr["len"], tr["terminated"], tr["truncated"]) for i, tr in enumerate(truth)
                if tr["ret"] is not None]
        assert episode_records(rollouts, e, where == "vector") == want
        assert max(rec[2] for rec in want) <= H
    cuts = sum(1 for e in range(E) for tr in expected_stream(e, n, cap=H)
               if tr["ret"] is not None and LENGTHS[(tr["ep"] + e) % len(LENGTHS)] > H)
    assert loop.cut_episodes == cuts > 0
    for r in rollouts:  # successors: the cut step's successor is the env's real next observation (bootstrap from it)
        succ = successors(r["data"], r["fill"])
        obs = np.asarray(r["data"]["step"]["obs"])
        assert (succ[..., 2] == obs[..., 2] + 1).all() and (succ[..., 1] == obs[..., 1]).all()


def test_an_episode_the_env_ends_at_the_horizon_ends_by_itself():
    """LENGTHS[0] = 3 = H: the env's own end (terminated, k=0) is kept; no cut is counted (RLlib's hit_horizon)."""
    rollouts, loop = collect(lambda: CountingEnv(0), EchoPolicy(), T=3, n_rollouts=1, horizon=3)
    step = rollouts[0]["data"]["step"]
    assert step["terminated"].tolist() == [False, False, True] and not step["truncated"].any()
    assert loop.cut_episodes == 0


@pytest.mark.parametrize("where", ["single", "vector"])
def test_soft_horizon_neither_resets_nor_flags_and_restarts_the_bookkeeping(where):
    E = 1 if where == "single" else 3
    make = (lambda: CountingEnv(0)) if where == "single" else (lambda: make_vector(3))
    H, T = 2, 6
    rollouts, loop = collect(make, EchoPolicy(), T=T, n_rollouts=6, horizon=H, soft_horizon=True)
    n = 6 * T
    softs = 0
    for e, col in enumerate(columns(rollouts, E, where == "vector")):
        truth = expected_stream(e, n)  # the env's own episodes, never reset by the actor
        check_stream(col, truth)
        # The table: a record every H steps of a logical episode (neither flag), and one at the env's own end.
        want, ret, length = [], 0.0, 0
        for i, tr in enumerate(truth):
            ret += tr["reward"]
            length += 1
            if tr["ret"] is not None:
                want.append((i, ret, length, tr["terminated"], tr["truncated"]))
            elif length == H:
                want.append((i, ret, length, False, False))
                softs += 1
            else:
                continue
            ret, length = 0.0, 0
        assert episode_records(rollouts, e, where == "vector") == want
    assert loop.soft_horizons == softs > 0 and loop.cut_episodes == 0
    for r in rollouts:  # a soft record's final_obs is the real next observation: successors stay exact
        succ, obs = successors(r["data"], r["fill"]), np.asarray(r["data"]["step"]["obs"])
        assert (succ[..., 2] == obs[..., 2] + 1).all()


@pytest.mark.parametrize("batch_mode", ["truncate_episodes", "complete_episodes"])
@pytest.mark.parametrize("H", [None, 3])
def test_no_done_at_end_records_every_end_as_truncated(batch_mode, H):
    T = 8
    rollouts, _ = collect(lambda: CountingEnv(1), EchoPolicy(), T=T, n_rollouts=6, batch_mode=batch_mode,
                             horizon=H, no_done_at_end=True)
    n = sum(r["fill"]["step"] for r in rollouts)
    cap = H if batch_mode == "truncate_episodes" else min(H or T, T)
    truth = expected_stream(1, n, cap=cap)
    check_stream(columns(rollouts, 1, False)[0], truth, no_done=True)
    if batch_mode == "truncate_episodes":
        recs = episode_records(rollouts, 0, False)
    else:
        recs, pos = [], 0
        for r in rollouts:
            ep = r["data"]["episode"]
            pos += r["fill"]["step"]
            recs.append((pos - 1, float(ep["return"]), int(ep["length"]), bool(ep["terminated"]), bool(ep["truncated"])))
    want = [(i, tr["ret"], tr["len"], False, True) for i, tr in enumerate(truth) if tr["ret"] is not None]
    assert recs == want


def test_complete_episodes_cut_at_the_smaller_of_horizon_and_T():
    rollouts, loop = collect(lambda: make_vector(2), EchoPolicy(), T=6, n_rollouts=8, batch_mode="complete_episodes",
                             horizon=3)
    assert max(r["fill"]["step"] for r in rollouts) == 3
    for r in rollouts:
        n, ep = r["fill"]["step"], r["data"]["episode"]
        assert int(ep["length"]) == n <= 3
        assert r["data"]["step"]["obs"][0][2] == 0  # every rollout still starts at an episode's start
    assert loop.cut_episodes > 0


def test_the_envs_own_time_limit_is_left_alone():
    """horizon larger than the env's TimeLimit: the env still ends its episodes at its own limit (not raised)."""
    def make():
        return gym.wrappers.TimeLimit(CountingEnv(3), max_episode_steps=4)

    rollouts, loop = collect(make, EchoPolicy(), T=10, n_rollouts=2, horizon=50)
    step = rollouts[0]["data"]["step"]
    assert step["obs"][:, 2].max() <= 3  # CountingEnv(3)'s first episode lasts 7: TimeLimit ends it at 4
    assert step["truncated"][3] and loop.cut_episodes == 0


# -- refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({"horizon": 0}, r"horizon: expected an int >= 1.*got 0"),
    ({"horizon": 2.5}, r"horizon: expected an int >= 1.*got 2.5"),
    ({"horizon": True}, r"horizon: expected an int >= 1.*got True"),
    ({"soft_horizon": True}, r"soft_horizon=True needs horizon="),
    ({"soft_horizon": 1, "horizon": 3}, r"soft_horizon: expected a bool, got 1"),
    ({"no_done_at_end": "yes"}, r"no_done_at_end: expected a bool, got 'yes'"),
    ({"horizon": 3, "soft_horizon": True, "batch_mode": "complete_episodes"},
     r"soft_horizon=True with batch_mode='complete_episodes'.*use batch_mode='truncate_episodes'"),
])
def test_bad_settings_are_refused_by_the_loop_and_the_collector(kw, match):
    kw = dict(kw)
    batch_mode = kw.pop("batch_mode", "truncate_episodes")
    env = CountingEnv(0)
    with pytest.raises(UsageError, match=match):
        ActorLoop(env, EchoPolicy(), [object()] * 1, rollout_len=4, batch_mode=batch_mode, **kw)
    with pytest.raises(UsageError, match=match):  # refused before any env, pipeline or process is made
        Collector(partial(make_counting, 0), EchoPolicy(), frames_per_batch=8, rollout_len=4, batch_mode=batch_mode,
                  start_method="fork", **kw)
    assert issubclass(UsageError, ValueError) and issubclass(UsageError, TypeError)


def test_collector_passes_horizons_to_its_actors():
    with Collector([make_counting] * 2, EchoPolicy(), frames_per_batch=16, total_frames=32, rollout_len=4, copy=True,
                   start_method="forkserver", timeout=30, seed=None, horizon=2, no_done_at_end=True) as c:
        batches = list(c)
    for b in batches:
        assert not b.data["step"]["terminated"].any()
        assert (b.data["step"]["obs"][..., 2] < 2).all()
        assert (b.episode_lengths <= 2).all() and len(b.episode_lengths) > 0
