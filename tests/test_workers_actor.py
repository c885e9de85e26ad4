"""Episode bookkeeping: every transition, flag, bootstrap observation and episode statistic, exactly.

The actor loop runs in a thread of the test process (a Writer per lane, the
reader in the main thread) against CountingEnv, whose every transition is
known; rollouts are checked against the ground truth in commit order.
"""

from __future__ import annotations

from functools import partial

import gymnasium as gym
import numpy as np
import optree
import pytest

import shmbuf
from shmbuf import WeightPublisher
from shmbuf.layout import rollout_example, successors
from tests.helpers_workers import (
    LENGTHS,
    CountingEnv,
    DictObsEnv,
    EchoPolicy,
    ReusingCountingEnv,
    check_complete,
    check_truncated,
    collect,
    make_async_vector,
    make_vector,
)

MODES = ["NextStep", "SameStep", "Disabled"]


@pytest.mark.parametrize("T", [4, 9])
def test_truncate_single_env_across_rollout_boundaries(T):
    rollouts, loop = collect(lambda: CountingEnv(0), T=T, n_rollouts=7)
    assert [r["seq"] for r in rollouts] == list(range(7))
    check_truncated(rollouts, [0], T)
    assert [int(r["data"]["bootstrap"]["env_steps"]) for r in rollouts] == [T * (i + 1) for i in range(7)]
    assert loop.episodes == sum(r["fill"]["episode"] for r in rollouts)


@pytest.mark.parametrize("mode", MODES)
def test_truncate_vector_env_every_autoreset_mode(mode):
    rollouts, _ = collect(lambda: make_vector(3, mode), T=5, n_rollouts=6)
    check_truncated(rollouts, [0, 1, 2], 5)
    assert rollouts[0]["data"]["step"]["obs"].shape == (5, 3, 3)
    assert rollouts[0]["data"]["bootstrap"]["env_steps"] == 15


LOOP_SETTINGS = {
    "plain": {},
    "horizon": {"horizon": 3},
    "soft-horizon": {"horizon": 3, "soft_horizon": True},
    "no-done-at-end": {"no_done_at_end": True, "horizon": 4},
    "reset-each-rollout": {"reset_each_rollout": True},
    "small-episode-table": {"max_episodes": 3},
}


@pytest.mark.parametrize(("kind", "setting"), [(k, s) for k in ("single", "sync-next", "sync-same", "reusing")
                                               for s in LOOP_SETTINGS] + [("async-next", "plain"), ("async-next", "horizon")])
def test_rollouts_written_into_the_slot_equal_the_general_paths_bit_for_bit(kind, setting):
    """The hot path (workers._truncate: rows written straight into the slot, sub-envs stepped by the driver) against
    the general one (Writer.add per step, the vector env's own step and masked resets), on every setting that
    changes flags, cuts, episode records or where a rollout ends: every leaf, fill, seq and version equal."""
    make = {"single": lambda: CountingEnv(1), "sync-next": lambda: make_vector(3, "NextStep"),
            "sync-same": lambda: make_vector(3, "SameStep"), "async-next": lambda: make_async_vector(2, "NextStep"),
            "reusing": lambda: make_vector(3, "NextStep", copy=False)}[kind]
    kw = dict(LOOP_SETTINGS[setting], T=5, n_rollouts=6)
    fast, fast_loop = collect(make, **kw)
    slow, slow_loop = collect(make, general=True, **kw)
    assert type(fast_loop._direct).__name__ == "SlotRollouts" and slow_loop._direct is False
    assert len(fast) == len(slow) == 6
    for a, b in zip(fast, slow, strict=True):
        assert (a["seq"], a["fill"], a["version"]) == (b["seq"], b["fill"], b["version"])
        fa, fb = optree.tree_leaves(a["data"]), optree.tree_leaves(b["data"])
        n_step, n_ep = a["fill"]["step"], a["fill"]["episode"]
        paths = optree.tree_paths(a["data"])
        for path, x, y in zip(paths, fa, fb, strict=True):
            n = n_step if path[0] == "step" else n_ep if path[0] == "episode" else None
            if n is not None:
                x, y = x[:n], y[:n]
            assert np.array_equal(x, y), (path, x, y)
    assert (fast_loop.episodes, fast_loop.cut_episodes, fast_loop.soft_horizons, fast_loop.env_steps) == (
        slow_loop.episodes, slow_loop.cut_episodes, slow_loop.soft_horizons, slow_loop.env_steps)


COMPLETE_SETTINGS = {
    "plain": {},
    "horizon": {"horizon": 3},
    "no-done-at-end": {"no_done_at_end": True, "horizon": 4},
    "cut-at-T": {"T": 2},  # episodes longer than the rollout are cut at T (recorded truncated)
}


def _by_lane(rollouts):
    """Rollouts grouped by writer lane, each lane's in commit (seq) order: lanes commit independently."""
    out = {}
    for r in rollouts:
        out.setdefault(r["lane"], []).append(r)
    return {lane: sorted(rs, key=lambda r: r["seq"]) for lane, rs in sorted(out.items())}


@pytest.mark.parametrize(("kind", "setting"), [(k, s) for k in ("single", "sync-next", "sync-same", "reusing")
                                               for s in COMPLETE_SETTINGS] + [("async-next", "plain")])
def test_complete_episodes_written_into_the_slot_equal_the_general_paths_bit_for_bit(kind, setting):
    """workers._complete (each sub-env's episode written straight into its writer's slot) against the general path
    (Writer.add per sub-env per step): every leaf, fill, seq and version of every lane's episodes equal."""
    make = {"single": lambda: CountingEnv(1), "sync-next": lambda: make_vector(3, "NextStep"),
            "sync-same": lambda: make_vector(3, "SameStep"), "async-next": lambda: make_async_vector(2, "NextStep"),
            "reusing": lambda: make_vector(3, "NextStep", copy=False)}[kind]
    kw = {"T": 5, "n_rollouts": 8, "batch_mode": "complete_episodes", **COMPLETE_SETTINGS[setting]}
    fast, fast_loop = collect(make, **kw)
    slow, slow_loop = collect(make, general=True, **kw)
    assert type(fast_loop._direct).__name__ == "SlotEpisodes" and slow_loop._direct is False
    fast_lanes, slow_lanes = _by_lane(fast), _by_lane(slow)
    assert fast_lanes.keys() == slow_lanes.keys()
    for lane in fast_lanes:
        n = min(len(fast_lanes[lane]), len(slow_lanes[lane]))  # the two runs stop after 8 in all, maybe split apart
        assert n >= 1
        for a, b in zip(fast_lanes[lane][:n], slow_lanes[lane][:n], strict=True):
            assert (a["seq"], a["fill"], a["version"]) == (b["seq"], b["fill"], b["version"])
            for path, x, y in zip(optree.tree_paths(a["data"]), optree.tree_leaves(a["data"]),
                                  optree.tree_leaves(b["data"]), strict=True):
                if path[0] == "step":
                    x, y = x[: a["fill"]["step"]], y[: a["fill"]["step"]]
                assert np.array_equal(x, y), (lane, a["seq"], path, x, y)
    assert fast_loop.cut_episodes == slow_loop.cut_episodes and fast_loop.env_steps == slow_loop.env_steps
    if setting == "cut-at-T":
        assert fast_loop.cut_episodes > 0


class TurningPolicy(EchoPolicy):
    """EchoPolicy until its third call, then an action of another shape or dtype, or an extra renamed."""

    def __init__(self, turn: str):
        super().__init__()
        self.turn, self.calls = turn, 0

    def __call__(self, obs):
        action, extras = super().__call__(obs)
        self.calls += 1
        if self.calls < 3:
            return action, extras
        if self.turn == "shape":
            return np.stack([action, action], axis=1), extras
        if self.turn == "dtype":
            return action.astype(np.float64) + 0.5, extras
        return action, {"thrice_t": extras["twice_t"]}


@pytest.mark.parametrize("batch_mode", ["truncate_episodes", "complete_episodes"])
@pytest.mark.parametrize(("turn", "says"), [("shape", r"policy output 'action': expected shape \(3,\)"),
                                            ("dtype", "policy output 'action': expected dtype int64"),
                                            ("extras", r"policy extras: expected \['twice_t'\]")])
def test_a_policy_output_that_does_not_fit_the_slot_is_refused_by_name(batch_mode, turn, says):
    """The hot paths store the policy's outputs straight into the slot: one of another shape or dtype, or an extra
    under another name, raises SchemaError naming the leaf, the expected and the received."""
    with pytest.raises(shmbuf.SchemaError, match=says):
        collect(lambda: make_vector(3, "NextStep"), T=5, n_rollouts=4, batch_mode=batch_mode,
                policy=TurningPolicy(turn), probe_policy=EchoPolicy())


def _dict_echo(obs):
    return EchoPolicy()(obs["pos"])


def test_pytree_observations_take_the_general_path():
    rollouts, loop = collect(lambda: DictObsEnv(), T=4, n_rollouts=2, policy=_dict_echo)
    assert loop._direct is False
    assert rollouts[0]["data"]["step"]["obs"]["pos"].shape == (4, 3)
    assert rollouts[1]["data"]["step"]["obs"]["pos"][0].tolist() == [0, 1, 1]  # step 4: episode 0 lasted 3 steps


def test_truncate_async_vector_env_next_step():
    """gymnasium's AsyncVectorEnv (sub-envs in their own processes) takes the same masked reset."""
    def make():
        return gym.vector.AsyncVectorEnv([partial(CountingEnv, i) for i in range(2)], context="spawn",
                                         autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)

    rollouts, _ = collect(make, T=5, n_rollouts=6)
    check_truncated(rollouts, [0, 1], 5)


# -- envs that overwrite their observation buffer every step (copy=False) -------------------------------


def check_successor_is_next_obs(rollouts, batch_mode):
    """Stored obs[t+1] is the successor of step t wherever step t did not end an episode."""
    for r in rollouts:
        d, n = r["data"], r["fill"]["step"]
        obs = np.asarray(d["step"]["obs"])[:n]
        succ = successors(d, r["fill"], batch_mode=batch_mode)
        ended = (np.asarray(d["step"]["terminated"]) | np.asarray(d["step"]["truncated"]))[:n]
        keep = ~ended[:-1]
        assert np.array_equal(obs[1:][keep], succ[:-1][keep])
        assert (succ[..., 2] == obs[..., 2] + 1).all()  # CountingEnv's obs holds its step counter


REUSING = {"sync-next": lambda: make_vector(3, "NextStep", copy=False),
           "sync-same": lambda: make_vector(3, "SameStep", copy=False),
           "sync-disabled": lambda: make_vector(3, "Disabled", copy=False),
           "async-next": lambda: make_async_vector(2, "NextStep", copy=False),
           "async-same": lambda: make_async_vector(2, "SameStep", copy=False)}


@pytest.mark.parametrize("kind", list(REUSING))
def test_truncate_vector_env_without_copy_stores_the_observation_acted_on(kind):
    rollouts, loop = collect(REUSING[kind], T=5, n_rollouts=6)
    check_successor_is_next_obs(rollouts, "truncate_episodes")
    check_truncated(rollouts, list(range(loop.E)), 5)


@pytest.mark.parametrize("T", [4, 8])  # 4: episodes longer than T are cut, and those sub-envs reset by the actor
@pytest.mark.parametrize("kind", list(REUSING))
def test_complete_vector_env_without_copy_stores_the_observation_acted_on(kind, T):
    rollouts, loop = collect(REUSING[kind], T=T, n_rollouts=12, batch_mode="complete_episodes")
    check_successor_is_next_obs(rollouts, "complete_episodes")
    check_complete(rollouts, loop.E, T)


@pytest.mark.parametrize("batch_mode", ["truncate_episodes", "complete_episodes"])
def test_single_env_that_reuses_its_observation_array(batch_mode):
    rollouts, _ = collect(lambda: ReusingCountingEnv(0), T=4, n_rollouts=8, batch_mode=batch_mode)
    check_successor_is_next_obs(rollouts, batch_mode)
    if batch_mode == "truncate_episodes":
        check_truncated(rollouts, [0], 4)
    else:
        check_complete(rollouts, 1, 4)


def test_truncate_small_episode_table_commits_short_and_loses_nothing():
    rollouts, _ = collect(lambda: CountingEnv(0), T=12, n_rollouts=8, max_episodes=2)
    fills = [r["fill"]["step"] for r in rollouts]
    assert min(fills) < 12 and all(r["fill"]["episode"] <= 2 for r in rollouts)
    check_truncated(rollouts, [0], 12, cap_episodes=True)


def test_truncate_small_episode_table_vector():
    rollouts, _ = collect(lambda: make_vector(2, "NextStep"), T=6, n_rollouts=8, max_episodes=3)
    assert min(r["fill"]["step"] for r in rollouts) < 6
    check_truncated(rollouts, [0, 1], 6, cap_episodes=True)


def test_complete_single_env_one_episode_per_rollout():
    rollouts, loop = collect(lambda: CountingEnv(0), T=8, n_rollouts=10, batch_mode="complete_episodes")
    assert [r["fill"]["step"] for r in rollouts] == [LENGTHS[k % len(LENGTHS)] for k in range(10)]
    check_complete(rollouts, 1, 8)
    assert loop.cut_episodes == 0


def test_complete_episodes_longer_than_T_are_cut_as_truncated():
    rollouts, loop = collect(lambda: CountingEnv(0), T=4, n_rollouts=10, batch_mode="complete_episodes")
    assert max(r["fill"]["step"] for r in rollouts) == 4
    check_complete(rollouts, 1, 4)
    assert loop.cut_episodes == sum(1 for k in range(10) if LENGTHS[k % len(LENGTHS)] > 4)


@pytest.mark.parametrize("mode", MODES)
def test_complete_vector_env_one_lane_per_sub_env(mode):
    rollouts, _ = collect(lambda: make_vector(3, mode), T=8, n_rollouts=15, batch_mode="complete_episodes")
    by_env = check_complete(rollouts, 3, 8)
    assert all(by_env[e] for e in range(3))
    assert len({r["lane"] for r in rollouts}) == 3


def test_weights_are_applied_at_rollout_boundaries_and_stamped():
    pub = WeightPublisher({"w": np.zeros(2)})
    try:
        pub.publish({"w": np.full(2, 7.0)}, version=7)
        policy = EchoPolicy()
        rollouts, loop = collect(lambda: CountingEnv(0), T=4, n_rollouts=3, weights=pub.handle, policy=policy)
        assert policy.loaded == [7.0]
        assert [r["version"] for r in rollouts] == [7, 7, 7]
    finally:
        pub.close()


def test_rollout_example_rules():
    ex = rollout_example(np.zeros(4, np.float32), np.zeros((), np.int64), rollout_len=8, num_envs=2,
                         extras={"logp": np.zeros((), np.float32)})
    s = shmbuf.Schema.from_example(ex)
    kinds = {ts.name: (ts.kind, ts.capacity) for ts in s.timescales}
    assert kinds == {"step": ("buffered", 8), "episode": ("buffered", 16), "bootstrap": ("single-item", 1)}
    with pytest.raises(ValueError, match="clash"):
        rollout_example(np.zeros(4), np.zeros(()), rollout_len=8, extras={"reward": np.zeros(())})
    with pytest.raises(ValueError, match="rollout_len"):
        rollout_example(np.zeros(4), np.zeros(()), rollout_len=1)
    with pytest.raises(ValueError, match="batch_mode"):
        rollout_example(np.zeros(4), np.zeros(()), rollout_len=4, batch_mode="episodes")
    ex = rollout_example(np.zeros(4), np.zeros(()), rollout_len=4, batch_mode="complete_episodes")
    kinds = {ts.name: ts.kind for ts in shmbuf.Schema.from_example(ex).timescales}
    assert kinds == {"step": "buffered", "episode": "single-item", "bootstrap": "single-item"}
