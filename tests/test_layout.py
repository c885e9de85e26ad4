"""shmbuf.layout: the grid adapter and the vectorised successors, against a plain loop over simulated env streams."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuf import SchemaError, UsageError
from shmbuf.layout import (
    BOOTSTRAP,
    COMPLETE_EPISODES,
    END,
    ENV,
    ENV_STEPS,
    EPISODE,
    FINAL_OBS,
    LENGTH,
    OBS,
    RETURN,
    STEP,
    TERMINATED,
    TRUNCATE_EPISODES,
    TRUNCATED,
    grid,
    successors,
)

ITEM = (2,)


def simulate(rng: np.random.Generator, T: int, E: int | None, n: int, p_done: float) -> tuple[dict, dict, np.ndarray]:
    """One truncate-episodes rollout of capacity T with n stored steps, stepped by a plain loop: ``(data, fill, truth)``,
    ``truth[t, e]`` the observation that really followed step t of sub-env e (E None: a single env, no env dim)."""
    EE = E or 1
    obs = rng.normal(size=(T, EE, *ITEM))  # rows past n stay random: padding that must never be read
    term, trunc = np.zeros((T, EE), bool), np.zeros((T, EE), bool)
    truth = np.zeros((n, EE, *ITEM))
    rows = []
    cur = rng.normal(size=(EE, *ITEM))
    for t in range(n):
        for e in range(EE):
            obs[t, e] = cur[e]
            nxt = rng.normal(size=ITEM)
            truth[t, e] = nxt
            if rng.random() < p_done:
                (term if rng.random() < 0.5 else trunc)[t, e] = True
                rows.append((t, e, nxt))
                cur[e] = rng.normal(size=ITEM)  # the reset observation, never anyone's successor
            else:
                cur[e] = nxt
    M = max(T * EE, 2)
    end, env, final = np.zeros(M, np.int32), np.zeros(M, np.int32), rng.normal(size=(M, *ITEM))  # unfilled rows: junk
    for i, (t, e, x) in enumerate(rows):
        end[i], env[i], final[i] = t, e, x
    boot = truth[n - 1] if n else rng.normal(size=(EE, *ITEM))
    drop = (lambda a: a[:, 0]) if E is None else (lambda a: a)
    data = {STEP: {OBS: drop(obs), TERMINATED: drop(term), TRUNCATED: drop(trunc), "reward": drop(np.zeros((T, EE)))},
            EPISODE: {RETURN: np.zeros(M), LENGTH: np.zeros(M, np.int64), TERMINATED: np.zeros(M, bool),
                      TRUNCATED: np.zeros(M, bool), ENV: env, END: end, FINAL_OBS: final},
            BOOTSTRAP: {OBS: boot[0] if E is None else boot, ENV_STEPS: np.int64(0)}}
    return data, {STEP: n, EPISODE: len(rows)}, drop(truth)


def simulate_episode(rng: np.random.Generator, T: int, n: int) -> tuple[dict, dict, np.ndarray]:
    """One complete-episodes rollout: one episode of n steps (it ends at n - 1), capacity T."""
    obs = rng.normal(size=(T, *ITEM))
    truth = np.zeros((n, *ITEM))
    cur = rng.normal(size=ITEM)
    for t in range(n):
        obs[t] = cur
        cur = truth[t] = rng.normal(size=ITEM)
    term = np.zeros(T, bool)
    term[n - 1] = True
    data = {STEP: {OBS: obs, TERMINATED: term, TRUNCATED: np.zeros(T, bool)},
            EPISODE: {RETURN: np.float64(0), LENGTH: np.int64(n), TERMINATED: np.bool_(True), TRUNCATED: np.bool_(False),
                      ENV: np.int32(0)},
            BOOTSTRAP: {OBS: truth[n - 1], ENV_STEPS: np.int64(0)}}
    return data, {STEP: n, EPISODE: 1, BOOTSTRAP: 1}, truth


def stack(parts: list[tuple[dict, dict, np.ndarray]], T: int) -> tuple[SimpleNamespace, list[np.ndarray]]:
    datas = [d for d, _, _ in parts]
    data = {ts: {k: np.stack([d[ts][k] for d in datas]) for k in datas[0][ts]} for ts in datas[0]}
    fill = {k: np.array([f[k] for _, f, _ in parts]) for k in parts[0][1]}
    return SimpleNamespace(data=data, fill=fill, batch_mode=TRUNCATE_EPISODES), [tr for _, _, tr in parts]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 7), E=st.sampled_from([None, 1, 3]), p=st.sampled_from([0.0, 0.3, 0.9]),
       short=st.booleans())
def test_successors_of_one_rollout_are_what_followed_each_step(seed, T, E, p, short):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, T + 1)) if short else T
    data, fill, truth = simulate(rng, T, E, n, p)
    np.testing.assert_array_equal(successors(data, fill), truth)
    # rollout.filled(): the data cut to its fill, no fill given
    cut = {STEP: {k: v[:n] for k, v in data[STEP].items()}, EPISODE: {k: v[:fill[EPISODE]] for k, v in data[EPISODE].items()},
           BOOTSTRAP: data[BOOTSTRAP]}
    np.testing.assert_array_equal(successors(cut), truth)
    # a Rollout-like object
    np.testing.assert_array_equal(successors(SimpleNamespace(data=data, fill=fill)), truth)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 6), E=st.sampled_from([None, 2]), B=st.integers(1, 4))
def test_successors_of_a_batch_with_partial_fills(seed, T, E, B):
    rng = np.random.default_rng(seed)
    batch, truths = stack([simulate(rng, T, E, int(rng.integers(0, T + 1)), 0.4) for _ in range(B)], T)
    got = successors(batch)
    assert got.shape == batch.data[STEP][OBS].shape
    for b, tr in enumerate(truths):
        n = int(batch.fill[STEP][b])
        np.testing.assert_array_equal(got[b, :n], tr)
        assert not got[b, n:].any(), "padding is zeros"


@pytest.mark.parametrize("T", [1, 5])
def test_successors_of_complete_episodes_rollouts_and_batches(T):
    rng = np.random.default_rng(T)
    for n in range(1, T + 1):
        data, fill, truth = simulate_episode(rng, T, n)
        np.testing.assert_array_equal(successors(data, fill, batch_mode=COMPLETE_EPISODES), truth)
    # a complete-episodes CollectedBatch: episodes concatenated, one bootstrap row per episode, no fill
    eps = [simulate_episode(rng, T, int(rng.integers(1, T + 1))) for _ in range(4)]
    lengths = np.array([f[STEP] for _, f, _ in eps])
    data = {STEP: {k: np.concatenate([d[STEP][k][:f[STEP]] for d, f, _ in eps]) for k in eps[0][0][STEP]},
            BOOTSTRAP: {OBS: np.stack([d[BOOTSTRAP][OBS] for d, _, _ in eps])}}
    cb = SimpleNamespace(data=data, fill=None, batch_mode=COMPLETE_EPISODES, lengths=lengths)
    np.testing.assert_array_equal(successors(cb), np.concatenate([tr for _, _, tr in eps]))
    g = grid(cb)
    assert (g.B, g.T, g.E, g.n.tolist(), g.k.tolist()) == (1, int(lengths.sum()), 1, [int(lengths.sum())], [4])


def test_a_dict_observation_gives_a_dict_of_successors():
    rng = np.random.default_rng(0)
    data, fill, truth = simulate(rng, 6, 3, 6, 0.3)
    data[STEP][OBS] = {"x": data[STEP][OBS], "y": {"z": -data[STEP][OBS]}}
    data[EPISODE][FINAL_OBS] = {"x": data[EPISODE][FINAL_OBS], "y": {"z": -data[EPISODE][FINAL_OBS]}}
    data[BOOTSTRAP][OBS] = {"x": data[BOOTSTRAP][OBS], "y": {"z": -data[BOOTSTRAP][OBS]}}
    got = successors(data, fill)
    np.testing.assert_array_equal(got["x"], truth)
    np.testing.assert_array_equal(got["y"]["z"], -truth)


def test_grid_shapes_are_views_and_round_trip():
    rng = np.random.default_rng(1)
    batch, _ = stack([simulate(rng, 5, 3, 5, 0.3), simulate(rng, 5, 3, 2, 0.3)], 5)
    g = grid(batch)
    assert (g.batched, g.vector, g.B, g.T, g.E, g.n.tolist(), g.lead) == (True, True, 2, 5, 3, [5, 2], (2, 5, 3))
    obs = batch.data[STEP][OBS]
    assert np.shares_memory(g.as_bte(obs), obs) and g.from_bte(g.as_bte(obs)) is not None
    assert g.from_bte(g.as_bte(obs)).shape == obs.shape
    assert not g.done[1, 2:].any(), "no step past a fill ends an episode"
    b, i = g.filled_rows(batch.data[EPISODE][END].shape[1])
    assert np.bincount(b, minlength=2).tolist() == batch.fill[EPISODE].tolist()
    single, fill, _ = simulate(rng, 5, None, 3, 0.3)
    g = grid(single, fill)
    assert (g.batched, g.vector, g.B, g.T, g.E, g.capacity) == (False, False, 1, 3, 1, 5)
    assert g.as_bte(g.step[OBS]).shape == (1, 3, 1, *ITEM) and g.as_be(single[BOOTSTRAP][OBS]).shape == (1, 1, *ITEM)


def test_bad_input_is_named():
    rng = np.random.default_rng(2)
    data, fill, _ = simulate(rng, 5, 2, 5, 0.5)
    batch, _ = stack([(data, fill, None)] * 2, 5)
    with pytest.raises(UsageError, match="fill=None"):
        grid(batch.data)
    with pytest.raises(UsageError, match="batch_mode"):
        grid(data, batch_mode="episodes")
    with pytest.raises(UsageError, match=r"fill\['step'\]=9 is outside"):
        grid(data, {STEP: 9})
    with pytest.raises(SchemaError, match=r"bootstrap obs has shape \(3, 2\); expected \(2, 2\)"):
        successors({**data, BOOTSTRAP: {OBS: np.zeros((3, 2))}}, fill)
    data[STEP][TERMINATED][:] = data[STEP][TRUNCATED][:] = False
    data[STEP][TERMINATED][1] = True
    with pytest.raises(SchemaError, match="complete-episodes.*step 1"):
        successors(data, fill, batch_mode=COMPLETE_EPISODES)
    with pytest.raises(SchemaError, match="no row for it"):
        successors(data, {STEP: 5, EPISODE: 0})


@pytest.mark.parametrize("count", [float("inf"), float("nan"), 1e30, 2.5, "5", None])
def test_a_fill_count_that_is_no_integer_is_a_usage_error_not_a_numpy_warning(count):
    """Warnings are errors in this suite: inf, NaN or 1e30 must reach the UsageError, not a RuntimeWarning of numpy's."""
    rng = np.random.default_rng(3)
    data, fill, _ = simulate(rng, 5, 2, 5, 0.5)
    with pytest.raises(UsageError, match="expected integer counts"):
        grid(data, {**fill, STEP: count})


# -- the episode table's one writer -----------------------------------------------------------------------------


def test_the_episode_table_example_is_what_rollout_example_lays_out() -> None:
    """Both batch modes' tables: the leaves, dtypes and shapes every writer and reader relies on."""
    from shmbuf.layout import EpisodeTable, rollout_example

    obs = {"pos": np.zeros(3, np.float32), "cam": np.zeros((2, 2), np.uint8)}
    ex = rollout_example(obs, np.zeros(2, np.float32), rollout_len=4, num_envs=3)[EPISODE]
    assert list(ex) == list(EpisodeTable.FIELDS)
    want = {RETURN: np.float64, LENGTH: np.int64, TERMINATED: np.bool_, TRUNCATED: np.bool_, ENV: np.int32, END: np.int32}
    for k, dt in want.items():
        assert ex[k].dtype == dt and ex[k].shape == (12,), k
    assert ex[FINAL_OBS]["pos"].shape == (12, 3) and ex[FINAL_OBS]["cam"].dtype == np.uint8
    one = rollout_example(obs, np.zeros(2, np.float32), rollout_len=4, batch_mode=COMPLETE_EPISODES)[EPISODE]
    assert list(one) == list(EpisodeTable.RECORD) and all(v.shape == () for v in one.values())
    assert EpisodeTable.example(np.zeros(1), 1)[RETURN].shape == (2,)  # capacity 1 would make it single-item


def test_the_episode_table_writes_records_by_rows_and_as_a_writer_record() -> None:
    """``write`` stores rows (a slice of several records at once, or one row; a dict observation leaf by leaf), and
    ``record`` is the same record as the dict ``Writer.add`` takes."""
    from shmbuf.layout import EpisodeTable, rollout_example

    obs = {"pos": np.zeros(3, np.float32), "id": np.zeros((), np.int64)}
    ex = rollout_example(obs, np.zeros(2, np.float32), rollout_len=4, num_envs=3)
    ep = ex[EPISODE]
    table = EpisodeTable(ep)
    idx = np.array([0, 2])
    final = {"pos": np.arange(6, dtype=np.float32).reshape(2, 3), "id": np.array([7, 9])}
    table.write(slice(1, 3), np.array([1.5, 2.5]), np.array([4, 5]), np.array([True, False]), np.array([False, True]),
                idx, 3, final)
    assert ep[RETURN][1:3].tolist() == [1.5, 2.5] and ep[LENGTH][1:3].tolist() == [4, 5]
    assert ep[TERMINATED][1:3].tolist() == [True, False] and ep[TRUNCATED][1:3].tolist() == [False, True]
    assert ep[ENV][1:3].tolist() == [0, 2] and ep[END][1:3].tolist() == [3, 3]
    assert (ep[FINAL_OBS]["pos"][1:3] == final["pos"]).all() and ep[FINAL_OBS]["id"][1:3].tolist() == [7, 9]
    assert ep[RETURN][0] == 0 and ep[RETURN][3] == 0  # no other row touched
    table.write(0, 9.0, 1, False, True, 1, 0)  # end given, final_obs left as it was
    assert ep[RETURN][0] == 9.0 and ep[END][0] == 0 and ep[FINAL_OBS]["id"][0] == 0
    rec = EpisodeTable.record(np.float64(1.5), np.int64(4), np.bool_(True), np.bool_(False), np.int64(0), 3,
                              {"pos": final["pos"][0], "id": final["id"][0]})
    assert set(rec) == set(EpisodeTable.FIELDS) and rec[ENV].dtype == np.int32 and rec[END].dtype == np.int32
    assert set(EpisodeTable.record(1.0, 2, True, False, 0)) == set(EpisodeTable.RECORD)


def test_the_episode_table_writes_a_complete_episodes_record_and_names_what_it_lacks() -> None:
    from shmbuf.layout import EpisodeTable

    rec = EpisodeTable.example()
    table = EpisodeTable(rec)
    table.write(..., 3.5, 7, False, True, 2)
    assert (rec[RETURN], rec[LENGTH], rec[TERMINATED], rec[TRUNCATED], rec[ENV]) == (3.5, 7, False, True, 2)
    with pytest.raises(SchemaError, match="has no 'end'"):
        table.write(..., 1.0, 1, True, False, 0, 5)
    with pytest.raises(SchemaError, match="has no 'final_obs'"):
        table.write(..., 1.0, 1, True, False, 0, None, np.zeros(2))
    with pytest.raises(SchemaError, match=r"missing \['length'\]"):
        EpisodeTable({k: v for k, v in rec.items() if k != LENGTH})
    table = EpisodeTable(EpisodeTable.example({"a": np.zeros(2)}, 4))
    with pytest.raises(SchemaError, match="final_obs does not have the table's structure"):
        table.write(0, 1.0, 1, True, False, 0, 0, np.zeros(2))


def test_an_episode_record_goes_through_writer_add_as_the_general_actor_path_writes_it(make_reader) -> None:
    """``EpisodeTable.record`` is what ``Writer.add(EPISODE, ...)`` takes, one record per call, read back as written."""
    import shmbuf
    from shmbuf.layout import EpisodeTable, rollout_example

    ex = rollout_example({"pos": np.zeros(2, np.float32)}, np.zeros(1, np.float32), rollout_len=3, num_envs=2)
    reader = make_reader(ex, slots=2, max_writers=1)
    with shmbuf.Writer(reader.handle, timeout=5) as w:
        reader.poll()
        for t in range(3):
            w.add(STEP, {OBS: {"pos": np.full((2, 2), t, np.float32)}, "action": np.zeros((2, 1), np.float32),
                         "reward": np.ones(2, np.float32), TERMINATED: np.array([t == 1, False]),
                         TRUNCATED: np.array([False, t == 2])})
        w.add(EPISODE, EpisodeTable.record(np.float64(2.0), np.int64(2), np.bool_(True), np.bool_(False), 0, 1,
                                           {"pos": np.full(2, 7, np.float32)}))
        w.add(EPISODE, EpisodeTable.record(np.float64(3.0), np.int64(3), np.bool_(False), np.bool_(True), 1, 2,
                                           {"pos": np.full(2, 8, np.float32)}))
        w.add(BOOTSTRAP, {OBS: {"pos": np.zeros((2, 2), np.float32)}, ENV_STEPS: np.int64(6)})
        w.commit(fill={STEP: 3, EPISODE: 2})
    with reader.get(timeout=5) as r:
        ep = r.data[EPISODE]
        assert ep[RETURN][:2].tolist() == [2.0, 3.0] and ep[LENGTH][:2].tolist() == [2, 3]
        assert ep[ENV][:2].tolist() == [0, 1] and ep[END][:2].tolist() == [1, 2]
        assert ep[TERMINATED][:2].tolist() == [True, False] and ep[TRUNCATED][:2].tolist() == [False, True]
        assert ep[FINAL_OBS]["pos"][:2].tolist() == [[7, 7], [8, 8]]
