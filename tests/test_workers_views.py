"""Actor-side views: what the policy is given at every step, against hand-derived truth and the learner's columns.

A recording policy keeps a copy of every input dict the ActorLoop hands it. CountingEnv's ground truth
(tests/helpers_workers.py) says what each column held at every step, so the expected input of every
call is known: the column at each offset; before the sub-env's episode start, RLlib's fill (the episode's
first observation for obs, zeros for the other columns), never the previous episode's data. The learner
side builds the same columns from the stored rollout: with
``shmbuf.storage.views.build_views`` given the previous rollout of the lane (``prev=``), on every step;
without it (and in :func:`reference_views`, a small independent implementation of the same semantics)
on every step whose episode started inside the rollout or whose window lies inside it: a learner has
no data from before the rollout's first step.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import UsageError
from shmbuf.storage.views import ViewRequirement as VR
from shmbuf.storage.views import build_views
from tests.helpers import doc_blocks
from tests.helpers_workers import CountingEnv, RecordingPolicy, expected_stream
from tests.helpers_workers import collect_with as collect
from workers import ActorLoop, Collector
from workers.lowlevel import ActorViews

REQS = {
    "obs": VR(shift=0),
    "prev_actions": VR("action", shift=-1),
    "prev_rewards": VR("reward", shift=-1),
    "stack": VR("obs", shift="-3:0"),
    "sparse": VR("obs", shift=[-3, -1]),  # not contiguous: taken into a preallocated array
    "prev_twice_t": VR("twice_t", shift=-2, space=np.zeros((), np.float32)),  # a policy extra
    "prev_done": VR("terminated", shift=-1),
    "prev_cut": VR("truncated", shift="-2:-1"),
}


class EchoViewsPolicy:
    """Stores what it was given as step extras (``seen_<name>``), so a learner can compare it with its own columns."""

    def __call__(self, x: dict[str, Any]) -> Any:
        obs = x["obs"]
        action = (obs[:, 1] * 1000 + obs[:, 2]).astype(np.int64)
        extras = {f"seen_{k}": np.array(v) for k, v in x.items() if k != "prev_twice_t"}
        extras["twice_t"] = (2 * obs[:, 2]).astype(np.float32)
        return action, extras


def make_vector(n: int, mode: str = "NextStep"):
    return gym.vector.SyncVectorEnv([partial(CountingEnv, i) for i in range(n)],
                                    autoreset_mode=gym.vector.AutoresetMode(mode))


# -- running an ActorLoop in a thread (the reader in this one) -------------------------------------------


# -- the truth: what each column held at each step of CountingEnv ----------------------------------------


def column_truth(tr: dict[str, Any], col: str) -> np.ndarray:
    value = {"obs": tr["obs"], "action": tr["action"], "reward": tr["reward"], "terminated": tr["terminated"],
             "truncated": tr["truncated"], "twice_t": 2 * tr["obs"][2]}[col]
    return np.asarray(value)


def expected_input(truth: list[dict[str, Any]], i: int, vr: VR, key: str) -> np.ndarray:
    """What requirement ``vr`` gives at step ``i`` of one sub-env's stream: the column at each offset; before the
    episode's start (step ``i`` is the ``truth[i]["obs"][2]``-th of its episode) its first obs, or zeros."""
    col = vr.column(key)
    start = i - int(truth[i]["obs"][2])
    zero = np.zeros_like(column_truth(truth[i], col), dtype=float)
    if vr.fill_rule(key) == "first":
        zero = column_truth(truth[start], col).astype(float)
    vals = [column_truth(truth[i + o], col).astype(float) if i + o >= start else zero for o in vr.offsets]
    return np.stack(vals) if vr.windowed else vals[0]


def check_inputs_against_truth(seen: list[dict[str, Any]], n_envs: int, reqs: dict[str, VR], cap: int | None = None):
    assert seen, "the policy was never called"
    for e in range(n_envs):
        truth = expected_stream(e, len(seen), cap=cap)
        for i, x in enumerate(seen):
            assert set(x) == set(reqs)
            for key, vr in reqs.items():
                want = expected_input(truth, i, vr, key)
                assert np.array_equal(x[key][e], want), (key, e, i, x[key][e].tolist(), want.tolist())


# -- hand-derived: the first calls of CountingEnv(1), written out ------------------------------------------

F0, F1, F2 = [1, 0, 0], [1, 1, 0], [1, 2, 0]  # each episode's first observation: RLlib's fill of an obs stack
HAND = [  # CountingEnv(1): episode 0 lasts 5 steps (terminated), episode 1 lasts 2 (truncated)
    # obs,      prev_actions, prev_rewards, stack
    ([1, 0, 0], 0, 0.0, [F0, F0, F0, [1, 0, 0]]),
    ([1, 0, 1], 0, 1.0, [F0, F0, [1, 0, 0], [1, 0, 1]]),
    ([1, 0, 2], 1, 2.0, [F0, [1, 0, 0], [1, 0, 1], [1, 0, 2]]),
    ([1, 0, 3], 2, 3.0, [[1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 0, 3]]),
    ([1, 0, 4], 3, 4.0, [[1, 0, 1], [1, 0, 2], [1, 0, 3], [1, 0, 4]]),
    ([1, 1, 0], 0, 0.0, [F1, F1, F1, [1, 1, 0]]),  # a new episode: nothing of episode 0 (last action 4, reward 5)
    ([1, 1, 1], 1000, 101.0, [F1, F1, [1, 1, 0], [1, 1, 1]]),
    ([1, 2, 0], 0, 0.0, [F2, F2, F2, [1, 2, 0]]),  # and nothing of episode 1 (last action 1001, reward 102)
]


@pytest.mark.parametrize("where", ["single", "vector"])
def test_hand_derived_inputs_of_the_first_steps(where):
    policy = RecordingPolicy()
    make = (lambda: CountingEnv(1)) if where == "single" else (lambda: make_vector(3))
    collect(make, policy, T=4, n_rollouts=2, view_requirements=REQS)
    e = 0 if where == "single" else 1
    for i, (obs, prev_a, prev_r, stack) in enumerate(HAND):
        x = policy.seen[i]
        assert x["obs"][e].tolist() == obs
        assert x["prev_actions"][e] == prev_a and x["prev_actions"].dtype == np.int64
        assert x["prev_rewards"][e] == prev_r and x["prev_rewards"].dtype == np.float32
        assert x["stack"][e].tolist() == stack
        assert x["sparse"][e].tolist() == [stack[0], stack[2]]
        assert not x["prev_done"][e] and not x["prev_cut"][e].any()
    n = 1 if where == "single" else 3
    assert policy.seen[0]["stack"].shape == (n, 4, 3) and policy.seen[0]["prev_actions"].shape == (n,)
    assert policy.seen[0]["prev_cut"].shape == (n, 2) and policy.seen[0]["prev_cut"].dtype == bool


@pytest.mark.parametrize("batch_mode", ["truncate_episodes", "complete_episodes"])
@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_every_input_of_a_vector_env_matches_the_truth(mode, batch_mode):
    """E=3 sub-envs whose episodes end at different steps, every autoreset mode, both batch modes."""
    policy = RecordingPolicy()
    T = 8
    collect(lambda: make_vector(3, mode), policy, T=T, n_rollouts=6, batch_mode=batch_mode, view_requirements=REQS)
    check_inputs_against_truth(policy.seen, 3, REQS, cap=T if batch_mode == "complete_episodes" else None)


def test_single_env_inputs_match_the_truth():
    policy = RecordingPolicy()
    collect(lambda: CountingEnv(0), policy, T=5, n_rollouts=8, view_requirements=REQS)
    assert len(policy.seen) == 40
    check_inputs_against_truth(policy.seen, 1, REQS)


def test_a_horizon_cut_starts_the_views_anew_and_a_soft_horizon_does_not():
    reqs = {"obs": VR(), "stack": VR("obs", shift="-3:0"), "prev_actions": VR("action", shift=-1)}
    hard = RecordingPolicy()
    collect(lambda: CountingEnv(0), hard, T=6, n_rollouts=4, view_requirements=reqs, horizon=3)
    check_inputs_against_truth(hard.seen, 1, reqs, cap=3)  # the truth with episodes cut at 3 steps
    soft = RecordingPolicy()
    _, loop = collect(lambda: CountingEnv(0), soft, T=6, n_rollouts=4, view_requirements=reqs, horizon=2,
                             soft_horizon=True)
    assert loop.soft_horizons > 0
    check_inputs_against_truth(soft.seen, 1, reqs)  # the env's own episodes: a soft horizon is no boundary


# -- the learner side: the same columns from the stored rollout ------------------------------------------


def reference_views(step: dict[str, Any], n: int, reqs: dict[str, VR], vector: bool,
                    first_is_start: bool = False) -> dict[str, tuple[Any, Any]]:
    """brief10's learner-side views of one rollout: ``{key: (values, known)}``.

    ``values`` (n, E, [W], ...): the column at t + offset where that is at or after the episode's start
    (the step after the last ``terminated | truncated`` before t, or the rollout's first step); where it
    is before a start inside the rollout, RLlib's fill: the episode's first obs for obs, zeros otherwise.
    ``known`` (n, E): False where the window reaches before the rollout's first step in an episode that
    started before it (the learner has no data).
    ``first_is_start``: the rollout's first step starts an episode (complete-episodes rollouts): all known.
    """
    def envs(a):
        a = np.asarray(a)[:n]
        return a if vector else a[:, None]

    done = envs(step["terminated"]) | envs(step["truncated"])
    E = done.shape[1]
    start = np.zeros((n, E), np.int64)
    for t in range(1, n):
        start[t] = np.where(done[t - 1], t, start[t - 1])
    out = {}
    for key, vr in reqs.items():
        col = envs(step[vr.column(key)])
        vals = []
        for o in vr.offsets:
            src = np.clip(np.arange(n) + o, 0, n - 1)
            v = col[src].copy()
            before = (np.arange(n)[:, None] + o) < start
            v[before] = col[start, np.arange(E)][before] if vr.fill_rule(key) == "first" else 0
            vals.append(v)
        values = np.stack(vals, axis=2) if vr.windowed else vals[0]
        known = (start > 0) | (np.arange(n)[:, None] + min(vr.offsets) >= 0) | first_is_start
        out[key] = (values, known)
    return out


def test_learner_columns_agree_with_what_the_policy_saw_truncate_episodes():
    policy = RecordingPolicy()
    T = 7
    rollouts, _ = collect(lambda: make_vector(3), policy, T=T, n_rollouts=6, view_requirements=REQS)
    compared = skipped = 0
    for r_i, r in enumerate(rollouts):
        n = r["fill"]["step"]
        assert n == T
        cols = reference_views(r["data"]["step"], n, REQS, vector=True)
        for key, (values, known) in cols.items():
            for t in range(n):
                seen = policy.seen[r_i * T + t][key]
                for e in range(3):
                    if not known[t, e]:
                        skipped += 1
                        continue
                    compared += 1
                    assert np.array_equal(seen[e], values[t, e]), (key, r_i, t, e)
                    assert seen[e].dtype == values.dtype, key
    assert compared > 3 * skipped > 0  # most are comparable; the known difference (history before the rollout) is real


def test_learner_columns_agree_with_what_the_policy_saw_complete_episodes():
    """Complete-episodes rollouts start at an episode's start: every step of every rollout agrees."""
    policy = RecordingPolicy()
    rollouts, _ = collect(lambda: make_vector(2), policy, T=8, n_rollouts=10, batch_mode="complete_episodes",
                          view_requirements=REQS)
    for e in range(2):
        mine = sorted((r for r in rollouts if int(r["data"]["episode"]["env"]) == e), key=lambda r: r["seq"])
        assert mine
        pos = 0
        for r in mine:
            n = r["fill"]["step"]
            for key, (values, known) in reference_views(r["data"]["step"], n, REQS, vector=False, first_is_start=True).items():
                assert known.all()
                for t in range(n):
                    assert np.array_equal(policy.seen[pos + t][key][e], values[t, 0]), (key, e, pos + t)
            pos += n


def test_learner_columns_agree_through_a_collector_in_spawned_processes():
    """The policy stores what it saw as extras; the learner's columns from the same requirements match them.

    Also checks that view requirements and horizons are pickled into the actors (spawn).
    """
    reqs = {k: v for k, v in REQS.items() if k != "prev_twice_t"}
    with Collector(partial(make_vector, 2), EchoViewsPolicy(), num_actors=1, frames_per_batch=24, total_frames=72,
                   rollout_len=6, copy=True, start_method="spawn", timeout=60, seed=None, view_requirements=reqs,
                   horizon=4) as c:
        batches = list(c)
    compared = 0
    for b in batches:
        for i in range(len(b.lane)):
            step = {k: v[i] for k, v in b.data["step"].items()}
            n = int(b.fill["step"][i])
            assert (step["obs"][:n, :, 2] < 4).all()  # horizon=4: no episode reaches a fifth step
            for key, (values, known) in reference_views(step, n, reqs, vector=True).items():
                seen = step[f"seen_{key}"][:n]
                compared += int(known.sum())
                assert np.array_equal(seen[known], values[known]), key
    assert compared > 0


LOOP_OPTIONS = {"plain": {}, "horizon": {"horizon": 3}, "soft-horizon": {"horizon": 2, "soft_horizon": True},
                "no-done-at-end": {"no_done_at_end": True}, "both": {"horizon": 4, "no_done_at_end": True}}


@pytest.mark.parametrize("where", ["single", "vector"])
@pytest.mark.parametrize("options", list(LOOP_OPTIONS))
def test_build_views_with_prev_gives_exactly_what_the_policy_saw(where, options):
    """Given each rollout and the one before it on its lane, the learner rebuilds every input of every step."""
    policy = RecordingPolicy()
    T = 7
    make = (lambda: CountingEnv(0)) if where == "single" else (lambda: make_vector(3))
    rollouts, _ = collect(make, policy, T=T, n_rollouts=5, view_requirements=REQS, **LOOP_OPTIONS[options])
    for i, r in enumerate(rollouts):
        assert r["fill"]["step"] == T
        cols = build_views(r["data"], REQS, fill=r["fill"], prev=rollouts[i - 1]["data"] if i else None, for_training=False)
        assert set(cols) == set(REQS)
        for key, v in cols.items():
            for t in range(T):
                seen = policy.seen[i * T + t][key]
                got = v[t] if where == "vector" else v[t][None]
                assert np.array_equal(seen, got) and seen.dtype == got.dtype, (key, i, t, seen.tolist(), got.tolist())


def test_build_views_of_complete_episodes_gives_exactly_what_the_policy_saw():
    policy = RecordingPolicy()
    rollouts, _ = collect(lambda: make_vector(2), policy, T=8, n_rollouts=10, batch_mode="complete_episodes",
                          view_requirements=REQS, horizon=4, no_done_at_end=True)
    for e in range(2):
        pos = 0
        for r in sorted((r for r in rollouts if int(r["data"]["episode"]["env"]) == e), key=lambda r: r["seq"]):
            n = r["fill"]["step"]
            cols = build_views(r["data"], REQS, fill=r["fill"], batch_mode="complete_episodes", for_training=False)
            for key, v in cols.items():
                assert len(v) == n
                for t in range(n):
                    assert np.array_equal(policy.seen[pos + t][key][e], v[t]), (key, e, pos + t)
            pos += n


def test_build_views_of_a_collector_batch_agrees_where_the_rollout_holds_the_history():
    reqs = {k: v for k, v in REQS.items() if k != "prev_twice_t"}
    with Collector(partial(make_vector, 2), EchoViewsPolicy(), num_actors=1, frames_per_batch=24, total_frames=48,
                   rollout_len=6, copy=True, start_method="fork", timeout=60, seed=None, view_requirements=reqs,
                   horizon=4) as c:
        batches = list(c)
    for b in batches:
        cols = build_views(b, reqs, for_training=False)
        for key, v in cols.items():
            seen = b.data["step"][f"seen_{key}"]
            assert v.shape == seen.shape
            for i in range(len(b.lane)):
                _, known = reference_views({k: x[i] for k, x in b.data["step"].items()}, int(b.fill["step"][i]), reqs,
                                           vector=True)[key]
                assert known.any() and np.array_equal(seen[i][known], v[i][known]), key


# -- ActorViews alone: random episode ends against a full-history reference (hypothesis) -----------------


SHIFTS = [0, -1, -2, "-3:0", "-2:-1", [-4, -1], [-1, -3]]


@settings(deadline=None, max_examples=60)
@given(E=st.integers(1, 3), n=st.integers(1, 30), seed=st.integers(0, 2**16),
       obs_shifts=st.lists(st.sampled_from(SHIFTS), min_size=1, max_size=3),
       act_shifts=st.lists(st.sampled_from([s for s in SHIFTS if s not in (0, "-3:0")]), max_size=2))
def test_views_never_show_a_previous_episode(E, n, seed, obs_shifts, act_shifts):
    rng = np.random.default_rng(seed)
    reqs = {f"o{i}": VR("obs", shift=s) for i, s in enumerate(obs_shifts)}
    reqs |= {f"a{i}": VR("action", shift=s) for i, s in enumerate(act_shifts)}
    reqs["r"] = VR("reward", shift=-1)
    obs = rng.normal(size=(E, 2))
    views = ActorViews(reqs, obs, E, gym.spaces.Box(-1, 1, (3,), np.float32))
    hist_obs, hist_act, hist_rew = [obs.copy()], [], []
    start = np.zeros(E, np.int64)  # index in the history where each sub-env's episode began
    for i in range(n):
        x = views.inputs()
        for key, vr in reqs.items():
            hist = {"obs": hist_obs, "action": hist_act, "reward": hist_rew}[vr.column(key)]
            for e in range(E):
                want = []
                for o in vr.offsets:
                    j = i + o
                    item = np.zeros_like(hist_obs[0][e] if vr.column(key) == "obs" else
                                         (np.zeros(3, np.float32) if vr.column(key) == "action" else np.float32(0)))
                    if vr.column(key) == "obs":  # RLlib's fill: the episode's first observation
                        item = hist_obs[start[e]][e]
                    want.append(hist[j][e] if j >= start[e] else item)
                got = x[key][e]
                assert np.array_equal(got, np.stack(want) if vr.windowed else want[0]), (key, i, e)
        action = rng.normal(size=(E, 3)).astype(np.float32)
        reward = rng.normal(size=E).astype(np.float32)
        term = rng.random(E) < 0.15
        trunc = rng.random(E) < 0.1
        nobs = rng.normal(size=(E, 2))
        views.advance(action, {}, reward, term, trunc, nobs)
        hist_act.append(action)
        hist_rew.append(reward)
        hist_obs.append(nobs.copy())
        start[term | trunc] = i + 1


def test_windows_are_views_of_the_ring_and_lists_are_not():
    views = ActorViews({"stack": VR("obs", shift="-3:0"), "one": VR("obs", shift=-1), "sparse": VR("obs", shift=[-3, 0])},
                       np.zeros((2, 3)), 2)
    x = views.inputs()
    ring = views.rings["obs", "first"][1][0].buf
    assert np.shares_memory(x["stack"], ring) and np.shares_memory(x["one"], ring)
    assert not np.shares_memory(x["sparse"], ring)
    assert x["stack"].shape == (2, 4, 3) and x["sparse"].shape == (2, 2, 3)


def test_dict_observations_give_a_dict_per_view():
    obs = {"pos": np.arange(6.0).reshape(2, 3), "t": np.zeros((2, 1), np.int32)}
    views = ActorViews({"stack": VR("obs", shift="-1:0"), "obs": VR()}, obs, 2)
    x = views.inputs()
    assert set(x["stack"]) == {"pos", "t"} and x["stack"]["pos"].shape == (2, 2, 3) and x["stack"]["t"].dtype == np.int32
    assert x["obs"]["pos"].tolist() == obs["pos"].tolist()
    nobs = {"pos": obs["pos"] + 10, "t": obs["t"] + 1}
    views.advance(np.zeros(2, np.int64), {}, np.zeros(2, np.float32), np.array([True, False]), np.zeros(2, bool), nobs)
    x = views.inputs()
    assert x["stack"]["pos"][0].tolist() == [nobs["pos"][0].tolist()] * 2  # sub-env 0 started anew: its first obs
    assert x["stack"]["pos"][1].tolist() == [obs["pos"][1].tolist(), nobs["pos"][1].tolist()]


# -- refusals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reqs, match", [
    ({"next_obs": VR("obs", shift=1)}, r"view_requirements\['next_obs'\] \(column 'obs', shift=1\): offset 1 is after"),
    ({"w": VR("obs", shift="-2:1")}, r"offset 1 is after the step the policy acts on"),
    ({"a": VR("action", shift=0)}, r"\['a'\] \(column 'action', shift=0\): offset 0 is this step's own action"),
    ({"r": VR("reward", shift=[-1, 0])}, r"offset 0 is this step's own reward.*shift=-1"),
    ({"prev_actions": VR("actions", shift=-1)}, r"column 'actions' is RLlib's name; the workers step leaf is 'action'"),
    ({"d": VR("dones", shift=-1)}, r"'dones' is RLlib's name.*'terminated' or 'truncated'"),
    ({"x": VR("logp", shift=-1)}, r"view column 'logp'.*give the requirement space="),
    ({}, r"view_requirements: expected a non-empty dict"),
    ({"obs": "obs"}, r"view_requirements\['obs'\]: expected a shmbuf.storage.views.ViewRequirement, got str"),
    ({"s": VR("obs", shift=-1, space=gym.spaces.Box(0, 1, (4,)))}, r"space.*shape \(4,\) is not the column's item shape \(3,\)"),
])
def test_bad_requirements_are_refused_at_construction(reqs, match):
    env = CountingEnv(0)
    with pytest.raises(UsageError, match=match):
        ActorLoop(env, RecordingPolicy(), [object()], rollout_len=4, view_requirements=reqs)


def test_an_extra_the_policy_does_not_return_is_named():
    policy = RecordingPolicy()
    with pytest.raises(UsageError, match=r"view column 'logp' is not a step leaf.*extras: \['twice_t'\]"):
        collect(lambda: CountingEnv(0), policy, T=4, n_rollouts=1,
                view_requirements={"obs": VR(), "lp": VR("logp", shift=-1, space=np.zeros((), np.float32))})


def test_actions_of_another_dtype_than_the_fill_are_named():
    """The fill before the first action comes from the env's action space (Discrete: int64); int32 actions are refused."""

    def policy(x):
        return (x["obs"][:, 1] * 1000 + x["obs"][:, 2]).astype(np.int32)

    with pytest.raises(UsageError, match=r"view column 'action': the policy returned items of int32 \(\), but the fill "
                                         r"before its first output was int64 \(\) \(from the env's action space\)"):
        collect(lambda: CountingEnv(0), policy, T=4, n_rollouts=1,
                view_requirements={"obs": VR(), "pa": VR("action", shift=-1)})
    # ... and accepted with a space that says int32
    collect(lambda: CountingEnv(0), policy, T=4, n_rollouts=1,
            view_requirements={"obs": VR(), "pa": VR("action", shift=-1, space=np.zeros((), np.int32))})


def test_without_requirements_the_policy_gets_the_bare_observation():
    seen = []

    def policy(obs):
        seen.append(type(obs))
        return (obs[:, 1] * 1000 + obs[:, 2]).astype(np.int64)

    collect(lambda: CountingEnv(0), policy, T=4, n_rollouts=1)
    assert set(seen) == {np.ndarray}


def test_a_torch_module_gets_the_views_as_tensors():
    """TorchPolicy maps torch.from_numpy over the dict: strided ring views become tensors without a copy."""
    torch = pytest.importorskip("torch", reason="the check is about torch modules (pip install torch==2.13.0)")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, x):
            self.seen.append({k: v.clone() for k, v in x.items()})
            obs = x["stack"][:, -1]
            return (obs[:, 1] * 1000 + obs[:, 2]).long()

    net = Net()
    reqs = {"stack": VR("obs", shift="-3:0"), "prev_actions": VR("action", shift=-1)}
    collect(lambda: make_vector(2), net, T=4, n_rollouts=3, view_requirements=reqs)
    assert isinstance(net.seen[0]["stack"], torch.Tensor) and net.seen[0]["stack"].shape == (2, 4, 3)
    check_inputs_against_truth([{k: v.numpy() for k, v in x.items()} for x in net.seen[1:]], 2, reqs)


# -- docs/workers.md: every python block runs as written ------------------------------------------------


DOC_BLOCKS = doc_blocks("workers.md")


def test_workers_md_python_blocks_are_the_ones_run_here():
    assert len(DOC_BLOCKS) == 2
    assert "view_requirements=views" in DOC_BLOCKS[0] and "horizon=" in DOC_BLOCKS[1]


def _cartpole_episodes(policy: Any, steps: int, horizon: int | None = None) -> tuple[list[int], int]:
    """A plain gymnasium loop (reset with seed 0, then unseeded resets, as ActorLoop does): the lengths of the
    episodes that end within ``steps`` steps, in order, and how many of them ``horizon`` cut."""
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    prev = obs  # the view's fill before an episode's first step: its first observation (RLlib's)
    lengths, cut, t = [], 0, 0
    for _ in range(steps):
        a = policy(obs, prev)
        prev = obs
        obs, _, term, trunc, _ = env.step(int(a))
        t += 1
        if horizon is not None and t == horizon and not (term or trunc):
            cut += 1
            trunc = True
        if term or trunc:
            lengths.append(t)
            obs, _ = env.reset()
            prev, t = obs, 0
    env.close()
    return lengths, cut


def test_workers_md_python_block_0_prints_the_episodes_a_plain_loop_gives(capsys):
    """The view block's policy looks one frame back through the stack view: the same policy written against a plain
    gymnasium loop must end the same episodes in each of the two 64-step rollouts."""
    exec(compile(  # noqa: S102 -- the page's own code, run as written
        DOC_BLOCKS[0], "docs/workers.md block 0", "exec"), {"__name__": "__doc_block__"})
    lines = capsys.readouterr().out.strip().splitlines()
    lengths, _ = _cartpole_episodes(lambda obs, prev: obs[2] + (obs[3] - prev[3]) > 0, 128)
    ends = np.cumsum(lengths)
    want = [f"(64, 4) episode lengths {np.array([n for n, e in zip(lengths, ends) if lo < e <= lo + 64])}"
            for lo in (0, 64)]
    assert lines == want


def test_workers_md_python_block_1_prints_the_horizons_cuts(capsys):
    exec(compile(  # noqa: S102 -- the page's own code, run as written
        DOC_BLOCKS[1], "docs/workers.md block 1", "exec"), {"__name__": "__doc_block__"})
    lengths, cut = _cartpole_episodes(lambda obs, prev: obs[2] > 0, 200, horizon=25)
    assert capsys.readouterr().out.strip() == f"lengths {np.array(lengths)} cut by the horizon: {cut}"


def test_a_learner_side_path_into_the_observation_is_refused_on_the_actor_side_with_what_to_ask_instead():
    from workers._views import check_view_requirements

    with pytest.raises(shmbuf.UsageError, match=r"column 'obs/pixels' is a learner-side path .* takes the whole 'obs'"):
        check_view_requirements({"px": VR("obs/pixels", shift=-1)})


def test_batch_repeat_value_leaves_the_actors_inputs_per_step():
    """RLlib's compute-actions views are built at every step whatever batch_repeat_value says (it shapes training
    columns only): the actor's inputs are the same with and without it."""
    from dataclasses import replace

    plain, repeated = RecordingPolicy(), RecordingPolicy()
    collect(lambda: CountingEnv(0), plain, T=6, n_rollouts=3, view_requirements=REQS)
    reqs = {k: replace(v, batch_repeat_value=4) for k, v in REQS.items()}
    collect(lambda: CountingEnv(0), repeated, T=6, n_rollouts=3, view_requirements=reqs)
    assert len(plain.seen) == len(repeated.seen) == 18
    for a, b in zip(plain.seen, repeated.seen, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
