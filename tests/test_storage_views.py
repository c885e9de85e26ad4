"""Learner-side trajectory views (shmbuf.storage.views.build_views): every shift form against hand-computed columns,
episode boundaries and rollout cuts under hypothesis (synthetic lanes and a real ActorLoop over a counting env),
which results are views of the slot, bad input, and the docs page's examples.

Every observation encodes (env, episode, step): a value from another episode in a shifted column is visible.
"""

from __future__ import annotations

import pathlib
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import SchemaError, ShmbufError, UsageError
from shmbuf.layout import rollout_example
from shmbuf.storage.views import MaskedView, ViewRequirement, build_views
from tests.helpers import doc_blocks, run_doc_block
from tests.helpers_workers import CountingEnv, EchoPolicy
from workers import ActorLoop, probe

VR = ViewRequirement
ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- a hand-made rollout: single env, truncate-episodes, two episode ends inside ------------------------
#
# obs = 100 + 10 * episode + step. The rollout starts at step 3 of episode 0 (begun in an earlier rollout):
#   t      0    1    2    3    4    5    6    7       bootstrap 123
#   obs  103  104  110  111  112  120  121  122      final_obs: episode 0 -> 105, episode 1 -> 113
#   end        T              t                      (terminated at 1, truncated at 4)

OBS = np.array([103, 104, 110, 111, 112, 120, 121, 122], np.float64)


def single(obs=OBS, term_at=(1,), trunc_at=(4,), finals=(105.0, 113.0), boot=123.0):
    T = len(obs)
    term, trunc = np.zeros(T, bool), np.zeros(T, bool)
    term[list(term_at)] = True
    trunc[list(trunc_at)] = True
    ends = sorted(term_at + trunc_at)
    return {
        "step": {"obs": obs[:, None].copy(), "action": (obs + 900).astype(np.int64), "reward": (obs - 99.5).astype(np.float32),
                 "terminated": term, "truncated": trunc},
        "episode": {"return": np.zeros(len(ends)), "length": np.zeros(len(ends), np.int64), "terminated": term[ends],
                    "truncated": trunc[ends], "env": np.zeros(len(ends), np.int32), "end": np.array(ends, np.int32),
                    "final_obs": np.array(finals)[:, None]},
        "bootstrap": {"obs": np.array([boot]), "env_steps": np.int64(T)},
    }


REQS = {
    "obs": VR(),
    "prev_actions": VR("action", shift=-1),
    "next_obs": VR("obs", shift=1),
    "a2": VR("action", shift=-2),
    "r_list": VR("reward", shift=[-1, 1]),
    "frames": VR("obs", shift="-2:0"),
    "obs2": VR("obs", shift=2),
}

EXPECTED = {
    "obs": OBS[:, None],
    "prev_actions": [0, 1003, 0, 1010, 1011, 0, 1020, 1021],
    "next_obs": np.array([104, 105, 111, 112, 113, 121, 122, 123.0])[:, None],
    "a2": [0, 0, 0, 0, 1010, 0, 0, 1020],
    "r_list": [[0, 4.5], [3.5, 0], [0, 11.5], [10.5, 12.5], [11.5, 0], [0, 21.5], [20.5, 22.5], [21.5, 0]],
    # RLlib's rule: before an episode's first step, its first observation (the rollout's first one for episode 0,
    # whose start this rollout does not hold)
    "frames": np.array([[103, 103, 103], [103, 103, 104], [110, 110, 110], [110, 110, 111], [110, 111, 112],
                        [120, 120, 120], [120, 120, 121], [120, 121, 122.0]])[:, :, None],
    "obs2": np.array([105, 0, 112, 113, 0, 122, 123, 0.0])[:, None],
}


def test_every_shift_form_single_env_truncate():
    data = single()
    out = build_views(data, REQS)
    assert list(out) == list(REQS)
    for k, want in EXPECTED.items():
        assert out[k].dtype == data["step"][REQS[k].column(k)].dtype, k
        np.testing.assert_array_equal(out[k], want, err_msg=k)
    assert np.shares_memory(out["obs"], data["step"]["obs"])
    for k in set(REQS) - {"obs"}:
        assert not np.shares_memory(out[k], data["step"][REQS[k].column(k)]), k


def test_filled_via_fill_and_padding_never_read():
    """``data`` at full capacity with ``fill``: the same columns as the filled rollout; garbage past the fill stays out."""
    data = single()
    T = 8
    padded = {
        "step": {k: np.concatenate([v, np.full((3,) + v.shape[1:], 777, v.dtype)]) for k, v in data["step"].items()},
        "episode": {k: np.concatenate([v, np.full((2,) + v.shape[1:], 7, v.dtype)]) for k, v in data["episode"].items()},
        "bootstrap": data["bootstrap"],
    }
    out = build_views(padded, REQS, fill={"step": T, "episode": 2})
    for k, want in EXPECTED.items():
        np.testing.assert_array_equal(out[k], want, err_msg=k)
    assert np.shares_memory(out["obs"], padded["step"]["obs"]) and len(out["obs"]) == T


def test_prev_reaches_into_the_previous_rollout():
    """prev: [190, 191 (terminated), 100, 101, 102], bootstrap 103: episode 0 began at prev's step 2."""
    prev = single(np.array([190, 191, 100, 101, 102.0]), term_at=(1,), trunc_at=(), finals=(192.0,), boot=103.0)
    reqs = {"prev_actions": VR("action", -1), "a2": VR("action", -2), "frames": VR("obs", "-2:0"),
            "long": VR("obs", "-5:0"), "next_obs": VR("obs", 1)}
    out = build_views(single(), reqs, prev=prev)
    np.testing.assert_array_equal(out["prev_actions"], [1002, 1003, 0, 1010, 1011, 0, 1020, 1021])
    np.testing.assert_array_equal(out["a2"], [1001, 1002, 0, 0, 1010, 0, 0, 1020])
    np.testing.assert_array_equal(out["frames"][:2, :, 0], [[101, 102, 103], [102, 103, 104]])
    np.testing.assert_array_equal(out["frames"][2:], EXPECTED["frames"][2:])
    np.testing.assert_array_equal(out["long"][0, :, 0], [100, 100, 100, 101, 102, 103])  # episode 9's steps stay out
    np.testing.assert_array_equal(out["next_obs"], EXPECTED["next_obs"])


def test_prev_whose_last_step_ended_the_episode_adds_nothing():
    prev = single(np.array([100, 101.0]), term_at=(1,), trunc_at=(), finals=(102.0,), boot=102.0)
    cur = single(np.array([110, 111.0]), term_at=(), trunc_at=(), finals=(), boot=112.0)
    out = build_views(cur, {"p": VR("action", -1)}, prev=prev)
    np.testing.assert_array_equal(out["p"], [0, 1010])


def test_prev_of_another_lane_is_refused():
    prev = single(np.array([100, 101.0]), term_at=(), trunc_at=(), finals=(), boot=555.0)
    with pytest.raises(UsageError, match="not the previous rollout"):
        build_views(single(), {"p": VR("action", -1)}, prev=prev)


# -- vector env (E = 2) -------------------------------------------------------------------------------------
#
# env 0: 100 101(T) | 110 111          bootstrap 112, final_obs of its first episode 102
# env 1: 203 204 205(t) | 300          bootstrap 301, final_obs 206


def vector():
    obs = np.array([[100, 203], [101, 204], [110, 205], [111, 300]], np.float64)
    term = np.zeros((4, 2), bool)
    trunc = np.zeros((4, 2), bool)
    term[1, 0] = True
    trunc[2, 1] = True
    return {
        "step": {"obs": obs[..., None], "action": (obs + 900).astype(np.int64), "reward": obs.astype(np.float32),
                 "terminated": term, "truncated": trunc},
        "episode": {"return": np.zeros(2), "length": np.zeros(2, np.int64), "terminated": np.array([True, False]),
                    "truncated": np.array([False, True]), "env": np.array([0, 1], np.int32), "end": np.array([1, 2], np.int32),
                    "final_obs": np.array([[102.0], [206.0]])},
        "bootstrap": {"obs": np.array([[112.0], [301.0]]), "env_steps": np.int64(8)},
    }


def test_every_shift_form_vector_env():
    data = vector()
    out = build_views(data, {"obs": VR(), "pa": VR("action", -1), "no": VR("obs", 1), "w": VR("reward", [-1, 0, 1]),
                             "r": VR("obs", "-2:-1"), "pa2": VR("action", -2), "na": VR("action", 1)})
    np.testing.assert_array_equal(out["pa2"], [[0, 0], [0, 0], [0, 1103], [0, 0]])
    np.testing.assert_array_equal(out["na"], [[1001, 1104], [0, 1105], [1011, 0], [0, 0]])
    assert np.shares_memory(out["obs"], data["step"]["obs"])
    np.testing.assert_array_equal(out["pa"], [[0, 0], [1000, 1103], [0, 1104], [1010, 0]])
    np.testing.assert_array_equal(out["no"][..., 0], [[101, 204], [102, 205], [111, 206], [112, 301]])
    assert out["w"].shape == (4, 2, 3)  # (T, E, W): the window axis right after the time and env axes
    np.testing.assert_array_equal(out["w"][:, 0], [[0, 100, 101], [100, 101, 0], [0, 110, 111], [110, 111, 0]])
    np.testing.assert_array_equal(out["w"][:, 1], [[0, 203, 204], [203, 204, 205], [204, 205, 0], [0, 300, 0]])
    assert out["r"].shape == (4, 2, 2, 1)
    # env 1's first observation before its episode's first step (203: this rollout's; 300: episode 2 at t=3)
    np.testing.assert_array_equal(out["r"][:, 1, :, 0], [[203, 203], [203, 203], [203, 204], [300, 300]])


def test_batch_of_rollouts_with_padding():
    """Two rollouts (the vector one and one cut short at 2 steps) in a (B, T, E) batch: row by row, as alone."""
    a, b = vector(), vector()
    for v in b["step"].values():
        v[2:] = 77 if v.dtype != bool else True  # padding: garbage, and episode ends that are not data
    b["episode"]["end"][:] = 1
    b["bootstrap"]["obs"][:] = [[102.0], [205.0]]
    batch = {ts: {k: np.stack([a[ts][k], b[ts][k]]) for k in a[ts]} for ts in a}
    fill = {"step": np.array([4, 2]), "episode": np.array([2, 1])}
    reqs = {"pa": VR("action", -1), "no": VR("obs", 1), "w": VR("obs", "-1:1"), "o": VR("obs")}
    out = build_views(batch, reqs, fill=fill)
    alone_a = build_views(a, reqs)
    alone_b = build_views({"step": {k: v[:2] for k, v in b["step"].items()},
                           "episode": {k: v[:1] for k, v in b["episode"].items()}, "bootstrap": b["bootstrap"]}, reqs)
    for k in reqs:
        np.testing.assert_array_equal(out[k][0], alone_a[k], err_msg=k)
        np.testing.assert_array_equal(out[k][1, :2], alone_b[k], err_msg=k)
        if k != "o":
            assert (out[k][1, 2:] == 0).all() and 77 not in out[k][:, :2], k
    assert np.shares_memory(out["o"], batch["step"]["obs"])


def test_complete_episodes_single_and_batch():
    """One episode per rollout: before step 0 is truly before the episode; the last step's successor is the bootstrap."""
    obs = np.array([100, 101, 102, 777, 777], np.float64)
    term = np.array([0, 0, 1, 1, 1], bool)
    data = {"step": {"obs": obs, "action": (obs + 900).astype(np.int64), "reward": np.ones(5, np.float32),
                     "terminated": term, "truncated": np.zeros(5, bool)},
            "episode": {"return": np.float64(3), "length": np.int64(3), "terminated": np.True_, "truncated": np.False_,
                        "env": np.int32(0)},
            "bootstrap": {"obs": np.float64(103), "env_steps": np.int64(3)}}
    reqs = {"pa": VR("action", -1), "no": VR("obs", 1), "w": VR("obs", [-2, 0, 2])}
    out = build_views(data, reqs, fill={"step": 3, "episode": 1}, batch_mode="complete_episodes")
    np.testing.assert_array_equal(out["pa"], [0, 1000, 1001])
    np.testing.assert_array_equal(out["no"], [101, 102, 103])
    np.testing.assert_array_equal(out["w"], [[100, 100, 102], [100, 101, 103], [100, 102, 0]])  # 100: the first obs
    batch = {ts: {k: np.stack([v, v]) for k, v in data[ts].items()} for ts in data}
    got = build_views(batch, reqs, fill={"step": np.array([3, 2]), "episode": np.array([1, 1])}, batch_mode="complete_episodes")
    np.testing.assert_array_equal(got["no"], [[101, 102, 103, 0, 0], [101, 103, 0, 0, 0]])  # row 1: cut at 2 steps


def test_complete_episodes_collected_batch_concatenated():
    """A complete-episodes CollectedBatch (episodes concatenated, split by lengths) reads as one lane."""
    class Collected:  # what workers.CollectedBatch carries (the learner side never imports workers)
        def __init__(self):
            self.batch_mode = "complete_episodes"
            self.fill = None
            self.lengths = np.array([2, 3])
            self.data = {"step": {"obs": np.array([100, 101, 110, 111, 112.0]), "action": np.arange(5),
                                  "terminated": np.array([0, 1, 0, 0, 1], bool), "truncated": np.zeros(5, bool)},
                         "episode": {"return": np.zeros(2), "length": np.array([2, 3])},
                         "bootstrap": {"obs": np.array([102, 113.0]), "env_steps": np.array([2, 5])}}

    out = build_views(Collected(), {"po": VR("obs", -1), "no": VR("obs", 1)})
    np.testing.assert_array_equal(out["po"], [100, 100, 110, 110, 111])
    np.testing.assert_array_equal(out["no"], [101, 102, 111, 112, 113])


def test_used_for_training_false_is_left_out_only_for_training():
    reqs = {"obs": VR(), "state_out": VR("action", used_for_training=False)}
    assert list(build_views(single(), reqs)) == ["obs"]
    assert list(build_views(single(), reqs, for_training=False)) == ["obs", "state_out"]


def test_space_gives_the_fill_shape_check_and_a_dict_column():
    space = gym.spaces.Box(0, 1000, (1,), np.float32)
    out = build_views(single(), {"po": VR("obs", -1, space=space, fill="zeros")})
    assert out["po"].dtype == np.float64 and out["po"][0, 0] == 0  # zeros of the column's dtype
    data = single()
    data["step"]["obs"] = {"pos": data["step"]["obs"], "t": np.arange(8)}
    data["bootstrap"]["obs"] = {"pos": data["bootstrap"]["obs"], "t": np.int64(8)}
    data["episode"]["final_obs"] = {"pos": data["episode"]["final_obs"], "t": np.array([2, 5])}
    dspace = gym.spaces.Dict({"pos": space, "t": gym.spaces.Discrete(9)})
    out = build_views(data, {"no": VR("obs", 1, space=dspace), "tt": VR("obs/t", -1)})
    np.testing.assert_array_equal(out["no"]["pos"], EXPECTED["next_obs"])
    np.testing.assert_array_equal(out["no"]["t"], [1, 2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(out["tt"], [0, 0, 2, 2, 3, 5, 5, 6])  # a leaf of obs: the episode's first value


# -- the zero-copy form --------------------------------------------------------------------------------------


def test_mask_form_is_views_with_validity():
    data = single()
    out = build_views(data, {"o": VR("obs"), "pa": VR("action", -1), "no": VR("obs", 1), "f": VR("obs", "-2:0"),
                             "e": VR("reward", [1, -1]), "z": VR("action", [0, 0])}, mask=True)
    for k, v in out.items():
        assert isinstance(v, MaskedView)
        assert np.shares_memory(v.values, data["step"][{"o": "obs", "pa": "action", "no": "obs", "f": "obs", "e": "reward",
                                                         "z": "action"}[k]]), k
    assert out["o"].steps == slice(0, 8) and out["o"].valid.all()
    pa = out["pa"]
    assert pa.steps == slice(1, 8)
    np.testing.assert_array_equal(pa.values, data["step"]["action"][:7])
    np.testing.assert_array_equal(pa.valid, [True, False, True, True, False, True, True])  # steps 2 and 5 begin episodes
    no = out["no"]
    assert no.steps == slice(0, 7)
    np.testing.assert_array_equal(no.valid, [True, False, True, True, False, True, True])  # final obs is not in the leaf
    f = out["f"]
    assert f.steps == slice(2, 8) and f.values.shape == (6, 3, 1) and not f.values.flags.writeable
    np.testing.assert_array_equal(f.values[..., 0], [[103, 104, 110], [104, 110, 111], [110, 111, 112], [111, 112, 120],
                                                     [112, 120, 121], [120, 121, 122]])
    want = np.where(f.valid, f.values[..., 0], 0)
    zeros = build_views(data, {"f": VR("obs", "-2:0", fill="zeros")})["f"]
    np.testing.assert_array_equal(want, zeros[2:, :, 0])  # masked, it is the copied form of fill="zeros"
    e = out["e"]  # offsets [1, -1]: a negative stride
    assert e.steps == slice(1, 7)
    np.testing.assert_array_equal(np.where(e.valid, e.values, 0), np.asarray(EXPECTED["r_list"])[1:7, ::-1])


def test_mask_form_refuses_uneven_lists_and_prev():
    with pytest.raises(UsageError, match="'u'.*evenly spaced"):
        build_views(single(), {"u": VR("obs", [-3, -1, 0])}, mask=True)
    with pytest.raises(UsageError, match="prev with mask=True"):
        build_views(single(), {"o": VR("obs")}, mask=True, prev=single())


# -- bad input -----------------------------------------------------------------------------------------------


def test_bad_input_names_the_column():
    with pytest.raises(SchemaError, match="column 'prev_actions' reads 'actions'.*shmbuf's action"):
        build_views(single(), {"prev_actions": VR("actions", -1)})
    with pytest.raises(UsageError, match="column 'po'.*shape"):
        build_views(single(), {"po": VR("obs", -1, space=gym.spaces.Box(0, 1, (4,)))})
    batch = {ts: {k: np.stack([v, v]) for k, v in d.items()} for ts, d in single().items()}
    with pytest.raises(UsageError, match="batch.*fill=None"):
        build_views(batch, {"o": VR("obs")})
    bad = single()
    bad["step"]["value"] = np.zeros(5)
    with pytest.raises(SchemaError, match="column 'v'.*'value' has shape \\(5,\\)"):
        build_views(bad, {"v": VR("value", -1)})
    no_table = single()
    del no_table["episode"]
    with pytest.raises(SchemaError, match="column 'no'.*final_obs"):
        build_views(no_table, {"no": VR("obs", 1)})
    missing_row = single()
    missing_row["episode"] = {k: v[:1] for k, v in missing_row["episode"].items()}
    with pytest.raises(SchemaError, match="column 'no'.*step 4.*no row"):
        build_views(missing_row, {"no": VR("obs", 1)})
    with pytest.raises(SchemaError, match="complete-episodes.*step 1"):
        build_views(single(), {"no": VR("obs", 1)}, batch_mode="complete_episodes")
    with pytest.raises(UsageError, match="batch_mode"):
        build_views(single(), {"o": VR()}, batch_mode="episodes")
    with pytest.raises(UsageError, match="ViewRequirement"):
        build_views(single(), {"o": "obs"})
    for exc in (SchemaError, UsageError):
        assert issubclass(exc, ShmbufError) and issubclass(exc, ValueError)


def _with(part: str, **changes):
    r = single()
    r[part] = {**r[part], **changes}
    return r


def _batch_of(r):
    return {ts: {k: np.stack([v, v]) for k, v in d.items()} for ts, d in r.items()}


@pytest.mark.parametrize("fill, match", [
    ({"step": "a"}, r"fill\['step'\]: expected integer counts.*'a'"),
    ({"step": 2.5}, r"fill\['step'\]: expected integer counts"),
    ({"step": 8, "episode": "x"}, r"fill\['episode'\]: expected integer counts.*'x'"),
    ({"step": 8, "episode": 5}, r"fill\['episode'\]=5 is outside the episode table's capacity 0..2"),
    ({"step": 8, "episode": -1}, r"fill\['episode'\]=-1 is outside"),
])
def test_bad_fill_counts_are_usage_errors(fill, match):
    with pytest.raises(UsageError, match=match):
        build_views(single(), {"n": VR("obs", 1)}, fill=fill)


def test_bad_batch_fill_counts_are_usage_errors():
    batch = _batch_of(single())
    with pytest.raises(UsageError, match=r"fill\['step'\]: expected integer counts"):
        build_views(batch, {"n": VR("obs", 1)}, fill={"step": np.array(["a", "b"])})
    with pytest.raises(UsageError, match=r"fill\['episode'\] \[2\] does not fit the batch: expected 2 counts"):
        build_views(batch, {"n": VR("obs", 1)}, fill={"step": np.array([8, 8]), "episode": np.array([2])})


@pytest.mark.parametrize("field, rows", [("final_obs", np.zeros((0, 1))), ("env", np.zeros(0, np.int32))])
def test_an_episode_table_with_too_few_rows_is_a_schema_error(field, rows):
    r = _with("episode", **{field: rows})
    with pytest.raises(SchemaError, match=r"column 'n': the episode table has .* rows, fewer than the .* episodes"):
        build_views(r, {"n": VR("obs", 1)}, fill={"step": 8, "episode": 2})
    batch = _batch_of(r)
    with pytest.raises(SchemaError, match=r"column 'n': the episode table has .* rows, fewer than the 2 episodes"):
        build_views(batch, {"n": VR("obs", 1)}, fill={"step": np.array([8, 8]), "episode": np.array([2, 2])})


def test_episode_ends_of_a_float_dtype_are_a_schema_error():
    r = _with("episode", end=np.array([1.7, 4.0]))
    with pytest.raises(SchemaError, match=r"column 'n': the episode table's 'end' has dtype float64; expected integers"):
        build_views(r, {"n": VR("obs", 1)})


def test_a_scalar_step_leaf_is_named_before_it_is_indexed():
    r = _with("step", obs=np.float64(3.0))
    with pytest.raises(SchemaError, match=r"step leaf 'obs' is a scalar"):
        build_views(r, {"n": VR("obs", 1)})
    r = _with("step", extra={"deep": np.float32(1.0)})
    with pytest.raises(SchemaError, match=r"step leaf 'extra/deep' is a scalar"):
        build_views(r, {"o": VR("obs")})


# -- hypothesis: synthetic lanes, random episode lengths and rollout cuts -----------------------------------


def lane_stream(lengths: list[int], kinds: list[int], env: int, n: int):
    """The first n steps of env ``env``: obs (env+1, k+1, s+1) per step; its episodes' lengths; final obs and ends."""
    rows, k = [], 0
    while len(rows) < n:
        L = lengths[k % len(lengths)]
        for s in range(L):
            rows.append((env, k, s, L, kinds[k % len(kinds)] if s == L - 1 else 0))
        k += 1
    return rows[:n]


def synth_rollouts(lengths, kinds, E, cuts, vector):
    """Truncate-episodes rollouts of E lanes stepped together, cut at ``cuts`` (step counts), as the actor lays them out."""
    total = sum(cuts)
    streams = [lane_stream(lengths[e:] + lengths[:e], kinds, e, total + 1) for e in range(E)]
    out, pos = [], 0
    for n in cuts:
        steps = [[streams[e][pos + t] for e in range(E)] for t in range(n)]
        obs = np.array([[[e + 1, k + 1, s + 1] for (e, k, s, _, _) in row] for row in steps], np.float64).reshape(n, E, 3)
        act = np.array([[1000 * k + s for (_, k, s, _, _) in row] for row in steps], np.int64).reshape(n, E)
        kind = np.array([[x[4] for x in row] for row in steps], np.int64).reshape(n, E)
        term, trunc = (kind == 1) | (kind == 3), (kind == 2) | (kind == 3)
        ends = [(t, e) for t in range(n) for e in range(E) if kind[t, e]]
        final = np.array([[e + 1, steps[t][e][1] + 1, steps[t][e][3] + 1] for t, e in ends], np.float64).reshape(-1, 3)
        nxt = [streams[e][pos + n] for e in range(E)]
        at_end = {e: i for i, (t, e) in enumerate(ends) if t == n - 1}
        boot = np.array([final[at_end[e]] if kind[n - 1, e] else [e + 1, k + 1, s + 1] for e, (_, k, s, _, _) in enumerate(nxt)],
                        np.float64)
        d = {"step": {"obs": obs, "action": act, "reward": act.astype(np.float32) + 1, "terminated": term, "truncated": trunc},
             "episode": {"end": np.array([t for t, _ in ends], np.int32), "env": np.array([e for _, e in ends], np.int32),
                         "final_obs": final, "length": np.zeros(len(ends), np.int64)},
             "bootstrap": {"obs": boot, "env_steps": np.int64(pos + n)}}
        if not vector:
            d["step"] = {k: v[:, 0] for k, v in d["step"].items()}
            d["bootstrap"]["obs"] = boot[0]
        out.append((d, [[streams[e][pos + t][3] for e in range(E)] for t in range(n)]))
        pos += n
    return out


def truth(obs_row, L, t, o, n, col, reach):
    """What position (step t, offset o) must hold: from the step's own (env, k, s) and its episode's length L.

    None: zeros. Before the episode's start, ``obs`` holds its first observation (RLlib's rule): the earliest step
    of the episode the learner has (``reach`` steps before the rollout, given prev; else the rollout's first)."""
    e, k, s = (int(v) - 1 for v in obs_row)
    s2 = s + o
    earliest = max(0, s - t - reach)  # the episode's step index of the earliest row the learner has of it
    if col == "obs" and s2 < earliest:
        return [e + 1, k + 1, earliest + 1]
    if s2 < 0 or t + o < -reach:
        return None
    if col == "obs":
        if s2 > L or t + o > n:
            return None
        return [e + 1, k + 1, s2 + 1]
    if s2 > L - 1 or t + o > n - 1:
        return None
    return 1000 * k + s2


SHIFTS = st.sampled_from([0, -1, 1, -2, 2, [-1, 1], [0, -3], "-3:0", "-1:2", "0:1"])


def check_columns(d, Ls, out, reqs, n, reach, vector):
    obs = d["step"]["obs"] if vector else d["step"]["obs"][:, None]
    E = obs.shape[1]
    for name, req in reqs.items():
        col = req.column(name)
        got = out[name] if vector else out[name][:, None]
        offs = req.offsets
        for t in range(n):
            for e in range(E):
                for j, o in enumerate(offs):
                    v = got[t, e, j] if req.windowed else got[t, e]
                    want = truth(obs[t, e], Ls[t][e], t, o, n, col, reach)
                    if want is None:
                        assert not np.any(v), (name, t, e, o, v)  # the fill value: never another episode's data
                    else:
                        assert np.asarray(v).tolist() == want, (name, t, e, o, v, want)
                        if col == "obs":
                            assert v[1] == obs[t, e, 1], "a value from another episode"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), kinds=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       E=st.integers(1, 3), cuts=st.lists(st.integers(1, 7), min_size=2, max_size=4),
       shifts=st.lists(SHIFTS, min_size=1, max_size=3), with_prev=st.booleans())
def test_hypothesis_synthetic_lanes(lengths, kinds, E, cuts, shifts, with_prev):
    vector = E > 1
    rolls = synth_rollouts(lengths, kinds, E, cuts, vector)
    reqs = {f"c{i}": VR("obs" if i % 2 == 0 else "action", shift=s) for i, s in enumerate(shifts)}
    for r, (d, Ls) in enumerate(rolls):
        prev = rolls[r - 1][0] if with_prev and r > 0 else None
        out = build_views(d, reqs, prev=prev)
        reach = cuts[r - 1] if prev is not None else 0
        check_columns(d, Ls, out, reqs, cuts[r], reach, vector)
    # the same rollouts in one padded batch: row b equals rollout b alone, whatever the padding holds
    T = max(cuts)
    M = max(max(len(d["episode"]["end"]) for d, _ in rolls), 1)

    def pad(a, size):
        return np.concatenate([a, np.full((size - len(a),) + a.shape[1:], 9, a.dtype)])

    batch = {"step": {k: np.stack([pad(d["step"][k], T) for d, _ in rolls]) for k in rolls[0][0]["step"]},
             "episode": {k: np.stack([pad(d["episode"][k], M) for d, _ in rolls]) for k in rolls[0][0]["episode"]},
             "bootstrap": {k: np.stack([d["bootstrap"][k] for d, _ in rolls]) for k in rolls[0][0]["bootstrap"]}}
    fill = {"step": np.array(cuts), "episode": np.array([len(d["episode"]["end"]) for d, _ in rolls])}
    out = build_views(batch, reqs, fill=fill)
    for b, (d, _) in enumerate(rolls):
        alone = build_views(d, reqs)
        for k in reqs:
            np.testing.assert_array_equal(out[k][b, : cuts[b]], alone[k], err_msg=k)
    masked = build_views(batch, reqs, fill=fill, mask=True)
    for k, req in reqs.items():  # the zero-copy form agrees with the copied one wherever it says valid
        mv = masked[k]
        src = batch["step"][req.column(k)]
        assert np.shares_memory(mv.values, src) or mv.values.size == 0
        copied = out[k][:, mv.steps]
        v = mv.valid.reshape(mv.valid.shape + (1,) * (mv.values.ndim - mv.valid.ndim))
        np.testing.assert_array_equal(np.where(v, mv.values, 0), np.where(v, copied, 0), err_msg=k)


# -- real rollouts from workers.ActorLoop over a counting env ------------------------------------------------


def actor_rollouts(make_env, *, T, n_rollouts, batch_mode):
    """Run an ActorLoop in this thread, handing each committed rollout to the reader at once; copies, in commit order."""
    policy = EchoPolicy()
    penv = make_env()
    try:
        p = probe(penv, policy)
    finally:
        penv.close()
    vector = p["vector"] and batch_mode == "truncate_episodes"
    example = rollout_example(p["obs"], p["action"], rollout_len=T, num_envs=p["num_envs"] if vector else None,
                              extras=p["extras"], batch_mode=batch_mode)
    n_writers = p["num_envs"] if batch_mode == "complete_episodes" else 1
    env = make_env()
    reader = shmbuf.create(example, slots=4 * n_writers + 4, max_writers=n_writers)
    writers = []
    out = []
    try:
        writers = [shmbuf.Writer(reader.handle, timeout=10) for _ in range(n_writers)]
        reader.poll()
        loop = ActorLoop(env, policy, writers, rollout_len=T, batch_mode=batch_mode)
        deadline = time.monotonic() + 60
        while len(out) < n_rollouts:
            assert time.monotonic() < deadline, f"{len(out)} of {n_rollouts} rollouts in 60 s"
            loop.run(1)
            while True:
                try:
                    r = reader.get(timeout=0)
                except shmbuf.SlotTimeout:
                    break
                with r:
                    out.append((r.lane, r.copy()))
    finally:
        for w in writers:
            w.close()
        reader.close()
        env.close()
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), E=st.integers(1, 3), T=st.integers(2, 6),
       mode=st.sampled_from(["truncate_episodes", "complete_episodes"]), shifts=st.lists(SHIFTS, min_size=1, max_size=3))
def test_hypothesis_real_actor_rollouts(lengths, E, T, mode, shifts):
    lengths = tuple(lengths)
    if E == 1:
        make_env = partial(CountingEnv, 0, lengths)
    else:
        make_env = partial(lambda: gym.vector.SyncVectorEnv([partial(CountingEnv, i, lengths) for i in range(E)]))
    rolls = actor_rollouts(make_env, T=T, n_rollouts=5, batch_mode=mode)
    reqs = {f"c{i}": VR("obs" if i % 2 == 0 else "action", shift=s) for i, s in enumerate(shifts)}
    last: dict[int, dict] = {}
    for lane, d in rolls:
        n = len(d["step"]["action"])
        vector = d["step"]["obs"].ndim == 3
        obs = d["step"]["obs"] if vector else d["step"]["obs"][:, None]
        cap = T if mode == "complete_episodes" else None  # complete-episodes cuts an episode at T steps
        Ls = [[min(lengths[(int(obs[t, e, 1]) + int(obs[t, e, 0])) % len(lengths)], cap or 10**9) for e in range(obs.shape[1])]
              for t in range(n)]
        shifted = {**d, "step": {**d["step"], "obs": d["step"]["obs"] + 1}}  # the truth's (env+1, k+1, s+1) encoding
        shifted["bootstrap"] = {**d["bootstrap"], "obs": d["bootstrap"]["obs"] + 1}
        if mode == "truncate_episodes":
            shifted["episode"] = {**d["episode"], "final_obs": d["episode"]["final_obs"] + 1}
        prev = last.get(lane) if mode == "truncate_episodes" else None
        out = build_views(shifted, reqs, batch_mode=mode, prev=prev)
        reach = len(prev["step"]["action"]) if prev is not None else 0
        check_columns(shifted, Ls, out, reqs, n, reach, vector)
        last[lane] = shifted


def test_views_of_a_live_rollout_and_batch_share_the_slot(make_reader):
    env = CountingEnv(0)
    p = probe(env, EchoPolicy())
    example = rollout_example(p["obs"], p["action"], rollout_len=5, extras=p["extras"])
    reader = make_reader(example, slots=8, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=10)
    try:
        reader.poll()
        ActorLoop(CountingEnv(0), EchoPolicy(), [writer], rollout_len=5).run(3)
        reqs = {"obs": VR(), "w": VR("obs", "-2:0"), "pa": VR("action", -1)}
        with reader.get(timeout=10) as r:
            out = build_views(r, reqs)  # the Rollout itself: its data and fill
            masked = build_views(r, reqs, mask=True)
            leaf = r.data["step"]
            assert np.shares_memory(out["obs"], leaf["obs"])
            assert not np.shares_memory(out["w"], leaf["obs"]) and not np.shares_memory(out["pa"], leaf["action"])
            assert np.shares_memory(masked["w"].values, leaf["obs"]) and np.shares_memory(masked["pa"].values, leaf["action"])
        b = reader.get_batch(2, timeout=10)
        out = build_views(b, reqs)
        assert out["w"].shape == (2, 5, 3, 3) and np.shares_memory(out["obs"], b.data["step"]["obs"])
    finally:
        writer.close()


# -- the docs page -------------------------------------------------------------------------------------------

BLOCKS = doc_blocks("views.md")


def test_the_page_has_examples_and_an_actor_side_section():
    text = (ROOT / "docs" / "views.md").read_text()
    assert len(BLOCKS) >= 2 and "\n## Actor side" in text


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_docs_block_runs(k, tmp_path):
    run_doc_block("views.md", k, tmp_path, timeout=120)
