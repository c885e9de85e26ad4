"""RolloutStorage and its rolling / next-observation variants: filling, GAE, minibatches, statistics, views."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.layout import rollout_example
from shmbuf.storage.compat.rsl_rl import QueueRolloutStorage, RolloutStorage, SarsaRolloutStorage, SarsaTransition
from shmbuf.storage.gae import compute_gae
from shmbuf.storage.rollout import Transition, split_and_pad_trajectories, unpad_trajectories
from tests import _rsl_rl

OBS, ACT = (3,), (2,)


def code(t: Any, n: Any, N: int) -> Any:
    """Every step's observation encodes where it is: t * N + n."""
    return t * N + n


def filled(T: int = 6, N: int = 4, *, dones: Any = None, time_outs: Any = None, cls: Any = RolloutStorage,
           hidden: bool = False, priv: bool = False, seed: int = 0, **kw: Any) -> RolloutStorage:
    """A storage filled step by step; obs[..., 0] = t * N + n, actions/values/... derived from it."""
    s = cls(N, T, OBS, (5,) if priv else None, ACT, (2, 3) if hidden else None, seed=seed, **kw)
    rng = np.random.default_rng(seed)
    d = np.zeros((T, N), bool) if dones is None else dones
    to = np.zeros((T, N), bool) if time_outs is None else time_outs
    for t in range(T):
        c = code(t, np.arange(N), N).astype(np.float32)
        tr = Transition(observations=np.repeat(c[:, None], 3, 1), actions=np.stack([c, -c], 1), rewards=rng.normal(size=N),
                        dones=d[t], time_outs=to[t], values=(c / 10)[:, None], actions_log_prob=-c,
                        action_mean=np.stack([c, c], 1), action_sigma=np.ones((N, 2)))
        if priv:
            tr.critic_observations = np.repeat(c[:, None], 5, 1) + 0.5
        if hidden:
            tr.hidden_states = (np.broadcast_to(c[:, None, None], (N, 2, 3)), -np.broadcast_to(c[:, None, None], (N, 2, 3)))
        s.add_transitions(tr)
    return s


# -- step by step --------------------------------------------------------------------------------------

def test_add_transitions_fills_rows_and_refuses_past_capacity_naming_step_and_capacity() -> None:
    s = filled(T=3, N=2)
    assert s.step == 3 and s.observations.shape == (3, 2, 3) and s.values.shape == (3, 2) and s.dones.dtype == bool
    np.testing.assert_array_equal(s.observations[2, 1], [5, 5, 5])
    np.testing.assert_allclose(s.values[:, 1], [0.1, 0.3, 0.5], rtol=1e-6)  # [N, 1] read as [N]
    with pytest.raises(shmbuf.TimescaleFull, match=r"step 3 is past the capacity num_transitions_per_env=3; call clear"):
        s.add_transitions(Transition())
    with pytest.raises(IndexError):  # the builtin a caller would catch
        s.add_transitions(Transition())
    s.clear()
    assert s.step == 0
    with pytest.raises(shmbuf.SchemaError, match=r"Transition.values is None"):
        s.add_transitions(Transition(observations=np.zeros((2, 3)), actions=np.zeros((2, 2)), rewards=np.zeros(2),
                                     dones=np.zeros(2), actions_log_prob=np.zeros(2)))
    with pytest.raises(shmbuf.SchemaError, match=r"Transition.actions: expected shape \(2, 2\).*got \(2, 3\)"):
        s.add_transitions(Transition(observations=np.zeros((2, 3)), actions=np.zeros((2, 3)), rewards=np.zeros(2),
                                     dones=np.zeros(2), values=np.zeros(2), actions_log_prob=np.zeros(2)))
    assert s.step == 0 and s.observations[0, 1, 0] == 1  # a refused transition wrote nothing


def test_compute_returns_is_compute_gae_into_the_storages_own_arrays_and_normalises_only_when_asked() -> None:
    rng = np.random.default_rng(1)
    d, to = rng.random((8, 5)) < 0.2, rng.random((8, 5)) < 0.2
    s = filled(T=8, N=5, dones=d, time_outs=to)
    adv_arr, ret_arr = s.advantages, s.returns
    lv = rng.normal(size=(5, 1))
    s.compute_returns(lv, 0.99, 0.95)
    want_a, want_r = compute_gae(s.rewards, s.values, d, lv[:, 0], 0.99, 0.95, time_outs=to)
    assert s.advantages is adv_arr and s.returns is ret_arr
    np.testing.assert_allclose(s.returns, want_r, atol=1e-5)
    np.testing.assert_allclose(s.advantages, want_a, atol=1e-5)
    tov = rng.normal(size=(8, 5))
    s.compute_returns(lv, 0.99, 0.95, time_out_values=tov, normalize_advantages=True)
    want_a, want_r = compute_gae(s.rewards, s.values, d, lv[:, 0], 0.99, 0.95, time_outs=to, time_out_values=tov)
    np.testing.assert_allclose(s.returns, want_r, atol=1e-5)  # returns from the raw advantages
    np.testing.assert_allclose(s.advantages, (want_a - want_a.mean()) / (want_a.std(ddof=1) + 1e-8), atol=1e-5)


# -- the flags' two conventions (issue 18, item 6) -------------------------------------------------------

def one_step(cls: Any, dones: bool, time_outs: bool) -> RolloutStorage:
    """The issue's case through add_transitions: one env, one step, r=0, V=1."""
    s = cls(1, 1, OBS, None, ACT)
    s.add_transitions((SarsaTransition if cls is SarsaRolloutStorage else Transition)(
        observations=np.zeros((1, 3)), actions=np.zeros((1, 2)), rewards=np.zeros(1), dones=np.array([dones]),
        time_outs=np.array([time_outs]), values=np.ones((1, 1)), actions_log_prob=np.zeros(1)))
    return s


@pytest.mark.parametrize("cls", [RolloutStorage, QueueRolloutStorage, SarsaRolloutStorage])
def test_add_transitions_bootstraps_a_time_out_whatever_dones_says_as_rsl_rl(cls: Any) -> None:
    """rsl_rl and its forks mark a time-out dones=True and time_outs=True and bootstrap it: A = (0 + 0.99 * 1) - 1 = -0.01
    (last V = 5 is not read: the episode ended). shmbuf counted the step as terminated: A = -1."""
    for dones in (True, False):
        s = one_step(cls, dones=dones, time_outs=True)
        s.compute_returns(np.array([5.0]), 0.99, 0.95)
        np.testing.assert_allclose(s.advantages, [[-0.01]], rtol=0, atol=1e-6)
        np.testing.assert_allclose(s.returns, [[0.99]], rtol=0, atol=1e-6)
        assert s.flag_convention == "rsl_rl"
    s = one_step(cls, dones=True, time_outs=False)  # terminated: no bootstrap
    s.compute_returns(np.array([5.0]), 0.99, 0.95)
    np.testing.assert_array_equal(s.advantages, [[-1.0]])


def test_from_rollout_keeps_gymnasiums_rule_terminated_and_truncated_is_terminated() -> None:
    """shmbuf's own actors record gymnasium's terminated and truncated: a step flagged both is terminated."""
    step = {"obs": np.zeros((1, 1, 1, 3), np.float32), "action": np.zeros((1, 1, 1, 2), np.float32),
            "reward": np.zeros((1, 1, 1), np.float32), "terminated": np.ones((1, 1, 1), bool),
            "truncated": np.ones((1, 1, 1), bool), "value": np.ones((1, 1, 1), np.float32),
            "log_prob": np.zeros((1, 1, 1), np.float32)}
    cb = SimpleNamespace(data={"step": step}, fill={"step": np.ones(1, int)})
    s = RolloutStorage.from_rollout(cb)
    s.compute_returns(np.array([5.0]), 0.99, 0.95)
    np.testing.assert_array_equal(s.advantages, [[-1.0]])
    assert s.flag_convention == "gymnasium"
    step["terminated"][...] = False  # truncated only: bootstrapped
    s.compute_returns(np.array([5.0]), 0.99, 0.95)
    np.testing.assert_allclose(s.advantages, [[-0.01]], rtol=0, atol=1e-6)


def test_flag_convention_can_be_set_and_a_bad_one_is_refused() -> None:
    s = one_step(RolloutStorage, dones=True, time_outs=True)
    s.flag_convention = "gymnasium"  # filled with gymnasium's terminated / truncated as they are
    s.compute_returns(np.array([5.0]), 0.99, 0.95)
    np.testing.assert_array_equal(s.advantages, [[-1.0]])
    s.flag_convention = "gym"
    with pytest.raises(shmbuf.UsageError, match=r"flag_convention is 'gym'; expected 'rsl_rl'.*or 'gymnasium'"):
        s.compute_returns(np.array([5.0]), 0.99, 0.95)


@pytest.mark.parametrize("seed", range(10))
def test_add_transitions_then_compute_returns_is_rsl_rl_bit_for_bit(seed: int) -> None:
    """Filled step by step as rsl_rl's PPO fills its storage ([N, 1] values; time-outs are a subset of dones), the
    returns equal rsl_rl 5.5.1's (tests/_rsl_rl.py), bit for bit."""
    rng = np.random.default_rng(seed)
    T, N = 16, 6
    r, v = (rng.normal(size=(T, N)).astype(np.float32) for _ in range(2))
    lv = rng.normal(size=N).astype(np.float32)
    d = rng.random((T, N)) < 0.3
    to = d & (rng.random((T, N)) < 0.5)
    s = RolloutStorage(N, T, OBS, None, ACT)
    for t in range(T):
        s.add_transitions(Transition(observations=np.zeros((N, 3)), actions=np.zeros((N, 2)), rewards=r[t], dones=d[t],
                                     time_outs=to[t], values=v[t][:, None], actions_log_prob=np.zeros(N)))
    s.compute_returns(lv[:, None], 0.99, 0.95)
    want_adv, want_ret = _rsl_rl.transcribed(r, v, d, to, lv, 0.99, 0.95)
    np.testing.assert_array_equal(s.returns, want_ret)
    np.testing.assert_array_equal(s.returns - s.values, want_adv)


# -- minibatches ---------------------------------------------------------------------------------------

@settings(deadline=None, max_examples=40)
@given(T=st.integers(1, 9), N=st.integers(1, 6), k=st.integers(1, 12), epochs=st.integers(1, 3))
def test_mini_batch_generator_yields_every_transition_exactly_once_per_epoch(T: int, N: int, k: int, epochs: int) -> None:
    k = min(k, T * N)
    s = filled(T=T, N=N, seed=T * 100 + N)
    s.compute_returns(np.zeros(N), 0.9, 0.9)
    batches = list(s.mini_batch_generator(k, epochs))
    assert len(batches) == k * epochs
    for e in range(epochs):
        seen = np.concatenate([b.obs[:, 0] for b in batches[e * k:(e + 1) * k]]).astype(int)
        assert sorted(seen.tolist()) == list(range(T * N))
        sizes = [len(b.obs) for b in batches[e * k:(e + 1) * k]]
        assert max(sizes) - min(sizes) <= 1
    for b in batches:  # every field of a row comes from the same transition
        t, n = np.divmod(b.obs[:, 0].astype(int), N)
        assert b.obs.shape[1:] == OBS and b.actions.shape[1:] == ACT and b.values.ndim == 1
        np.testing.assert_array_equal(b.actions, s.actions[t, n])
        np.testing.assert_array_equal(b.returns, s.returns[t, n])
        np.testing.assert_array_equal(b.advantages, s.advantages[t, n])
        np.testing.assert_array_equal(b.old_actions_log_prob, s.actions_log_prob[t, n])
        np.testing.assert_array_equal(b.old_mu, s.mu[t, n])
        assert b.critic_obs is b.obs and b.hidden_states == (None, None) and b.masks is None


def test_mini_batch_generator_reshuffles_each_epoch_and_carries_critic_obs() -> None:
    s = filled(T=8, N=8, priv=True)
    b = list(s.mini_batch_generator(2, 3))
    orders = [np.concatenate([b[2 * e].obs[:, 0], b[2 * e + 1].obs[:, 0]]) for e in range(3)]
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    np.testing.assert_array_equal(b[0].critic_obs[:, 0], b[0].obs[:, 0] + 0.5)
    with pytest.raises(shmbuf.UsageError, match=r"num_mini_batches=...\): expected an int from 1 to 64, got 65"):
        next(s.mini_batch_generator(65, 1))


def test_mini_batch_to_torch_shares_memory() -> None:
    torch = pytest.importorskip("torch")
    s = filled(T=4, N=2)
    b = next(s.mini_batch_generator(1, 1))
    tb = b.to_torch()
    assert isinstance(tb.obs, torch.Tensor) and tb.hidden_states == (None, None)
    tb.obs[0, 0] = 123.0
    assert b.obs[0, 0] == 123.0  # torch.from_numpy: the same memory on CPU
    assert type(tb) is type(b)


# -- recurrent -----------------------------------------------------------------------------------------

def hand_case() -> tuple[RolloutStorage, np.ndarray, np.ndarray]:
    # T=4, N=3. env 0 terminates at t=1; env 1 runs through; env 2 times out at t=0 and terminates at t=2.
    d = np.zeros((4, 3), bool)
    to = np.zeros((4, 3), bool)
    d[1, 0] = True
    to[0, 2] = True
    d[2, 2] = True
    return filled(T=4, N=3, dones=d, time_outs=to, hidden=True), d, to


def test_recurrent_minibatch_masks_padding_and_hidden_states_against_a_hand_built_example() -> None:
    s, _, _ = hand_case()
    (b,) = list(s.recurrent_mini_batch_generator(1, 1))
    # trajectories, env-major: env0 t0-1, env0 t2-3, env1 t0-3, env2 t0, env2 t1-2, env2 t3
    lengths = [2, 2, 4, 1, 2, 1]
    want_masks = np.array([[s_ < n for n in lengths] for s_ in range(4)])
    np.testing.assert_array_equal(b.masks, want_masks)
    def c(t: int, n: int) -> int:
        return t * 3 + n

    want = np.zeros((4, 6))
    for j, steps in enumerate([[c(0, 0), c(1, 0)], [c(2, 0), c(3, 0)], [c(t, 1) for t in range(4)], [c(0, 2)],
                               [c(1, 2), c(2, 2)], [c(3, 2)]]):
        want[: len(steps), j] = steps
    np.testing.assert_array_equal(b.obs[..., 0], want)  # padding is zeros
    assert b.obs.shape == (4, 6, 3) and b.critic_obs is b.obs
    starts = [c(0, 0), c(2, 0), c(0, 1), c(0, 2), c(1, 2), c(3, 2)]
    ha, hc = b.hidden_states
    assert ha.shape == (6, 2, 3)
    np.testing.assert_array_equal(ha[:, 0, 0], starts)  # the state stored at each trajectory's first step
    np.testing.assert_array_equal(hc[:, 1, 2], np.negative(starts))
    assert b.actions.shape == (4, 3, 2) and np.shares_memory(b.actions, s.actions)  # unpadded: a view
    np.testing.assert_array_equal(unpad_trajectories(b.obs, b.masks), s.observations)
    # per env: each minibatch is padded to its own longest trajectory
    per_env = list(s.recurrent_mini_batch_generator(3, 1))
    assert [m.obs.shape[:2] for m in per_env] == [(2, 2), (4, 1), (2, 3)]
    np.testing.assert_array_equal(per_env[2].masks, [[True, True, True], [False, True, False]])
    np.testing.assert_array_equal(unpad_trajectories(per_env[2].obs, per_env[2].masks, 4), s.observations[:, 2:3])
    # rsl_rl's padding to T, and its helper's name
    (r,) = list(s.recurrent_mini_batch_generator(1, 1, pad_to="rollout"))
    padded, masks = split_and_pad_trajectories(s.observations, s.dones | s.time_outs, pad_to=4)
    np.testing.assert_array_equal(r.obs, padded)
    np.testing.assert_array_equal(r.masks, masks)
    assert s.reccurent_mini_batch_generator == s.recurrent_mini_batch_generator  # The rsl_rl fork's spelling


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 10_000), T=st.integers(1, 8), N=st.integers(1, 6), k=st.integers(1, 6), shuffle=st.booleans())
def test_recurrent_generator_yields_every_valid_step_exactly_once_per_epoch(seed: int, T: int, N: int, k: int,
                                                                           shuffle: bool) -> None:
    k = min(k, N)
    rng = np.random.default_rng(seed)
    s = filled(T=T, N=N, dones=rng.random((T, N)) < 0.3, time_outs=rng.random((T, N)) < 0.2, hidden=True, seed=seed)
    batches = list(s.recurrent_mini_batch_generator(k, 2, shuffle=shuffle))
    assert len(batches) == 2 * k
    for epoch in (batches[:k], batches[k:]):
        seen = []
        for b in epoch:
            seen += b.obs[..., 0][b.masks].astype(int).tolist()
            assert not b.obs[~b.masks].any()  # padding is zeros
            first = b.obs[0, :, 0].astype(int)  # each trajectory's first step...
            np.testing.assert_array_equal(b.hidden_states[0][:, 0, 0], first)  # ...is where its hidden state is from
            # the unpadded fields are the same envs' steps, in the order unpad_trajectories gives back
            np.testing.assert_array_equal(unpad_trajectories(b.obs, b.masks, T)[..., 0], b.actions[..., 0])
        assert sorted(seen) == list(range(T * N))


def test_get_statistics_against_a_hand_computation() -> None:
    s, _, _ = hand_case()
    length, reward = s.get_statistics()
    assert length == pytest.approx((2 + 2 + 4 + 1 + 2 + 1) / 6)
    assert reward == pytest.approx(float(s.rewards.mean()))
    assert not s.dones[-1].any()  # unlike rsl_rl, nothing is written
    z = filled(T=5, N=2)  # no episode ends: one trajectory of T per env
    assert z.get_statistics()[0] == 5.0


# -- from shmbuf rollouts -------------------------------------------------------------------------------

T_, E_ = 5, 3


def example(num_envs: int | None) -> dict[str, Any]:
    return rollout_example(np.zeros(3, np.float32), np.zeros(2, np.float32), rollout_len=T_, num_envs=num_envs,
                           extras={"value": np.zeros((), np.float32), "log_prob": np.zeros((), np.float32)})


def write_rollout(writer: shmbuf.Writer, k: int, num_envs: int | None) -> None:
    """Fill the writer's slot in place (as a vector-env actor would) with values that encode (k, t, e)."""
    tree = writer.slot()
    st_ = tree["step"]
    E = num_envs or 1
    env = (T_, E) if num_envs else (T_,)
    c = (k * 1000 + np.arange(T_)[:, None] * 10 + np.arange(E)[None, :]).astype(np.float32).reshape(env)
    st_["obs"][...] = c[..., None]
    st_["action"][...] = -c[..., None]
    st_["reward"][...] = c / 7
    st_["terminated"][...] = (c.astype(int) % 4) == 1
    st_["truncated"][...] = (c.astype(int) % 6) == 3
    st_["value"][...] = c / 3
    st_["log_prob"][...] = -c / 5
    tree["bootstrap"]["obs"][...] = (k * 1000 + 500 + np.arange(E)).reshape(env[1:] + (1,)) if num_envs else k * 1000 + 500
    ep = tree["episode"]
    ep["truncated"][:2] = [True, False]
    ep["terminated"][:2] = [False, True]
    ep["end"][:2] = [3, 1]
    ep["env"][:2] = [E - 1, 0]
    ep["final_obs"][0] = k * 1000 + 77
    writer.commit(fill={"step": T_, "episode": 2})


def want_tm(x: np.ndarray, has_env: bool) -> np.ndarray:
    """A batch leaf (B, T, [E], ...) in the [T, N, ...] layout, built the slow obvious way."""
    parts = [np.asarray(x[b]) for b in range(len(x))]
    return np.concatenate(parts, axis=1) if has_env else np.stack(parts, axis=1)


def pipeline(make_reader: Any, num_envs: int | None) -> tuple[shmbuf.Reader, shmbuf.Writer]:
    reader = make_reader(example(num_envs), slots=4, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=5.0)
    reader.poll()  # lends this thread's writer its slots
    return reader, writer


def test_from_a_rollout_of_a_vector_env_every_array_is_a_view_of_the_slot(make_reader: Any) -> None:
    reader, writer = pipeline(make_reader, E_)
    try:
        write_rollout(writer, 1, E_)
        with reader.get(timeout=5) as r:
            s = RolloutStorage.from_rollout(r)
            step = r.data["step"]
            assert s.copied == () and (s.num_transitions_per_env, s.num_envs, s.step) == (T_, E_, T_)
            for field, leaf in [("observations", "obs"), ("actions", "action"), ("rewards", "reward"), ("dones", "terminated"),
                                ("time_outs", "truncated"), ("values", "value"), ("actions_log_prob", "log_prob")]:
                a = getattr(s, field)
                assert np.shares_memory(a, step[leaf]), field
                np.testing.assert_array_equal(a, step[leaf])
            assert s.observations.shape == (T_, E_, 3) and s.values.shape == (T_, E_)
            assert np.shares_memory(s.bootstrap_observations, r.data["bootstrap"]["obs"])
            np.testing.assert_array_equal(s.bootstrap_observations[:, 0], [1500, 1501, 1502])
            s.compute_returns(np.zeros(E_), 0.9, 0.9)  # into the storage's own arrays
            assert not np.shares_memory(s.returns, step["value"])
            to = s.time_out_observations
            assert to.step.tolist() == [3] and to.env.tolist() == [E_ - 1] and to.obs[0, 0] == 1077
            tov = s.time_out_values_from([9.0])
            assert tov[3, E_ - 1] == 9.0 and tov.sum() == 9.0
            with pytest.raises(shmbuf.UsageError, match="view of Rollout"):
                s.add_transitions(Transition())
    finally:
        writer.close()


@pytest.mark.parametrize("num_envs", [E_, None])
def test_from_a_batch_copies_exactly_when_b_and_e_must_merge(make_reader: Any, num_envs: int | None) -> None:
    reader, writer = pipeline(make_reader, num_envs)
    try:
        for k in range(2):
            write_rollout(writer, k, num_envs)
        # gathered (zero_copy=False): contiguous (B, ...) buffers, so which fields are views is the storage's
        # choice alone; a zero-copy batch's slot stride can make a merge copy too
        b = reader.get_batch(2, timeout=5, zero_copy=False)
        s = RolloutStorage.from_rollout(b)
        step = b.data["step"]
        N = 2 * (num_envs or 1)
        assert s.num_envs == N and s.observations.shape == (T_, N, 3)
        for field, leaf in [("observations", "obs"), ("rewards", "reward"), ("dones", "terminated"), ("values", "value")]:
            a = getattr(s, field)
            np.testing.assert_array_equal(a, want_tm(step[leaf], num_envs is not None))
            # (B, T, E) -> [T, B*E] needs a copy when B > 1 and E > 1; (B, T) -> [T, B] is a transpose (a view)
            assert np.shares_memory(a, step[leaf]) == (num_envs is None), field
        assert set(s.copied) == ({"observations", "actions", "rewards", "dones", "time_outs", "values", "actions_log_prob"}
                                 if num_envs else set())
        np.testing.assert_array_equal(s.bootstrap_observations[:, 0],
                                      [500, 501, 502, 1500, 1501, 1502] if num_envs else [500, 1500])
        assert np.shares_memory(s.bootstrap_observations, b.data["bootstrap"]["obs"])
        to = s.time_out_observations  # one truncated episode per rollout, env E-1 of each
        assert to.step.tolist() == [3, 3] and to.env.tolist() == ([E_ - 1, 2 * E_ - 1] if num_envs else [0, 1])
        assert to.obs[:, 0].tolist() == [77, 1077]
    finally:
        writer.close()


def collected_batch(B: int, E: int, *, fill: Any = None, extras: bool = True) -> SimpleNamespace:
    """A CollectedBatch-like object (duck-typed: .data, .fill) in the workers layout."""
    rng = np.random.default_rng(B * 10 + E)
    step = {"obs": rng.normal(size=(B, T_, E, 3)).astype(np.float32), "action": rng.normal(size=(B, T_, E, 2)),
            "reward": rng.normal(size=(B, T_, E)).astype(np.float32), "terminated": rng.random((B, T_, E)) < 0.2,
            "truncated": rng.random((B, T_, E)) < 0.2}
    if extras:
        step["value"] = rng.normal(size=(B, T_, E, 1)).astype(np.float32)  # a critic's [E, 1] output
        step["log_prob"] = rng.normal(size=(B, T_, E)).astype(np.float32)
    data = {"step": step, "bootstrap": {"obs": rng.normal(size=(B, E, 3))}}
    return SimpleNamespace(data=data, fill={"step": np.full(B, T_) if fill is None else np.asarray(fill)})


def test_from_a_collected_batch_like_object_one_rollout_is_all_views_and_short_ones_are_refused() -> None:
    cb = collected_batch(1, 4)
    s = RolloutStorage.from_rollout(cb)
    assert s.copied == () and s.num_envs == 4
    for field, leaf in [("observations", "obs"), ("actions", "action"), ("values", "value"), ("time_outs", "truncated")]:
        assert np.shares_memory(getattr(s, field), cb.data["step"][leaf])
    np.testing.assert_array_equal(s.values, cb.data["step"]["value"][0, ..., 0])
    np.testing.assert_array_equal(s.observations, cb.data["step"]["obs"][0])
    with pytest.raises(shmbuf.UsageError, match=r"rollout 1 of the batch .* has fill\['step'\]=3 of T=5"):
        RolloutStorage.from_rollout(collected_batch(3, 2, fill=[5, 3, 5]))
    with pytest.raises(shmbuf.SchemaError, match=r"no leaf 'value'.*policy return \(action, \{'value'"):
        RolloutStorage.from_rollout(collected_batch(1, 2, extras=False))
    with pytest.raises(shmbuf.UsageError, match="fill=None: a complete-episodes batch"):
        RolloutStorage.from_rollout(SimpleNamespace(data={"step": {}}, fill=None))
    with pytest.raises(shmbuf.UsageError, match="expected a shmbuf Rollout, Batch or workers CollectedBatch"):
        RolloutStorage.from_rollout({"step": {}})


def test_from_rollout_walks_nested_observations_and_reads_per_step_hidden_states() -> None:
    cb = collected_batch(1, 2)
    step = cb.data["step"]
    step["obs"] = {"policy": step["obs"], "critic": np.ones((1, T_, 2, 5), np.float32)}
    step["h_actor"] = np.arange(T_ * 2 * 4, dtype=np.float32).reshape(1, T_, 2, 4)
    step["h_critic"] = -step["h_actor"]
    cb.data["bootstrap"]["obs"] = {"policy": cb.data["bootstrap"]["obs"], "critic": np.zeros((1, 2, 5))}
    s = RolloutStorage.from_rollout(cb, obs_key="obs/policy", critic_obs_key="obs/critic",
                                    hidden_states_keys=("h_actor", "h_critic"))
    assert s.privileged_observations.shape == (T_, 2, 5) and np.shares_memory(s.privileged_observations, step["obs"]["critic"])
    assert s.bootstrap_observations.shape == (2, 3) and s.bootstrap_critic_observations.shape == (2, 5)
    s.compute_returns(np.zeros(2), 0.9, 0.9)
    for b in s.recurrent_mini_batch_generator(2, 1):
        ha, hc = b.hidden_states
        for j in range(b.obs.shape[1]):  # find each trajectory's first step in the store (observations are random)
            t, n = np.argwhere((s.observations == b.obs[0, j]).all(-1))[0]
            np.testing.assert_array_equal(ha[j], s.hidden_states_actor[t, n])
        np.testing.assert_array_equal(hc, -ha)
    torch = pytest.importorskip("torch")
    tb = b.to_torch()
    assert tb.masks.dtype == torch.bool and isinstance(tb.hidden_states[0], torch.Tensor)
    with pytest.raises(shmbuf.SchemaError, match=r"no leaf 'obs/pixels' \(at 'pixels'; there is \['critic', 'policy'\]\)"):
        RolloutStorage.from_rollout(cb, obs_key="obs/pixels")


def test_a_short_rollout_from_a_pipeline_is_refused_naming_it(make_reader: Any) -> None:
    reader, writer = pipeline(make_reader, E_)
    try:
        writer.slot()
        writer.commit(fill={"step": 2, "episode": 0})
        with reader.get(timeout=5) as r, pytest.raises(shmbuf.UsageError,
                                                       match=r"the rollout Rollout\(.*\) has fill\['step'\]=2 of T=5"):
            RolloutStorage.from_rollout(r)
    finally:
        writer.close()


# -- rolling and next-observation storage ----------------------------------------------------------------

def add_coded(s: RolloutStorage, start: int, count: int) -> None:
    """Add ``count`` steps whose observation is their global step number."""
    N = s.num_envs
    for g in range(start, start + count):
        s.add_transitions(Transition(observations=np.full((N, 3), g), actions=np.zeros((N, 2)), rewards=np.full(N, g),
                                     dones=np.zeros(N), values=np.zeros(N), actions_log_prob=np.zeros(N)))


def test_queue_storage_grows_then_loops_and_untie_puts_the_newest_last() -> None:
    q = QueueRolloutStorage(2, 4, OBS, None, ACT, buffer_dilation_ratio=2.5)
    assert q.num_transitions_per_env == 4 and q.max_buffer_length == 10
    add_coded(q, 0, 4)
    with pytest.raises(shmbuf.TimescaleFull, match="call clear"):
        add_coded(q, 4, 1)
    q.clear()  # grows by one rollout
    assert q.num_transitions_per_env == 8 and q.step == 4 and not q.buffer_full
    (b,) = list(q.mini_batch_generator(1, 1))  # the valid rows only
    assert sorted(b.obs[:, 0].tolist()) == sorted([g for g in range(4) for _ in range(2)])
    add_coded(q, 4, 4)
    q.clear()  # grows by what is left to the limit: 2 rows
    assert q.expand_buffer_once() == 0 and q.num_transitions_per_env == 10
    add_coded(q, 8, 4)  # rows 8, 9, then loops: 10 -> row 0, 11 -> row 1
    assert q.buffer_full and q.step == 2
    np.testing.assert_array_equal(q.observations[:, 0, 0], [10, 11, 2, 3, 4, 5, 6, 7, 8, 9])
    q.clear()  # full: keeps everything
    assert q.num_transitions_per_env == 10 and q.step == 2
    view = q.observations
    q.untie_buffer_loop()
    np.testing.assert_array_equal(q.observations[:, 0, 0], np.arange(2, 12))  # time order, newest last
    assert q.observations is view and q.step == 0
    seen = np.concatenate([b.obs[:, 0] for b in q.mini_batch_generator(3, 1)])
    assert sorted(seen.tolist()) == sorted([g for g in range(2, 12) for _ in range(2)])
    add_coded(q, 12, 3)  # overwrites the three oldest
    q.compute_returns(np.zeros(2), 1.0, 1.0)  # unties first: returns are sums of the later rewards in time order
    np.testing.assert_array_equal(q.observations[:, 0, 0], np.arange(5, 15))
    np.testing.assert_allclose(q.returns[:, 0], np.cumsum(np.arange(5, 15)[::-1])[::-1])
    with pytest.raises(shmbuf.UsageError, match="QueueRolloutStorage owns"):
        QueueRolloutStorage.from_rollout(collected_batch(1, 2))


def test_sarsa_next_observations_are_a_view_of_one_buffer_of_t_plus_1_rows() -> None:
    s = SarsaRolloutStorage(2, 4, OBS, (5,), ACT)
    assert s.all_observations.shape == (5, 2, 3)
    for a, b in [(s.observations, s.all_observations), (s.next_observations, s.all_observations),
                 (s.privileged_observations, s.all_privileged_observations),
                 (s.next_privileged_observations, s.all_privileged_observations)]:
        assert np.shares_memory(a, b)
    for t in range(4):
        tr = SarsaTransition(observations=np.full((2, 3), t), critic_observations=np.full((2, 5), 10 + t),
                             actions=np.zeros((2, 2)), rewards=np.zeros(2), dones=np.zeros(2), values=np.zeros(2),
                             actions_log_prob=np.zeros(2), next_observations=np.full((2, 3), t + 1),
                             next_critic_observations=np.full((2, 5), 11 + t))
        s.add_transitions(tr)
    np.testing.assert_array_equal(s.next_observations[:, 0, 0], [1, 2, 3, 4])  # the last row from the last transition
    np.testing.assert_array_equal(s.next_privileged_observations[:, 1, 0], [11, 12, 13, 14])
    for b in s.mini_batch_generator(2, 1):
        np.testing.assert_array_equal(b.next_obs[:, 0], b.obs[:, 0] + 1)
        np.testing.assert_array_equal(b.next_critic_obs[:, 0], b.critic_obs[:, 0] + 1)
    (r,) = list(s.recurrent_mini_batch_generator(1, 1))
    np.testing.assert_array_equal(r.next_obs[..., 0][r.masks], r.obs[..., 0][r.masks] + 1)


def test_sarsa_from_a_rollout_copies_the_observations_once_and_keeps_the_rest_as_views() -> None:
    cb = collected_batch(1, 3)
    s = SarsaRolloutStorage.from_rollout(cb)
    assert s.copied == ("observations",)
    assert np.shares_memory(s.next_observations, s.all_observations)
    assert not np.shares_memory(s.observations, cb.data["step"]["obs"])
    assert np.shares_memory(s.values, cb.data["step"]["value"])
    np.testing.assert_array_equal(s.next_observations[:-1], cb.data["step"]["obs"][0, 1:])
    np.testing.assert_array_equal(s.next_observations[-1], cb.data["bootstrap"]["obs"][0].astype(np.float32))
    b = next(s.mini_batch_generator(1, 1))
    assert b.next_critic_obs is b.next_obs


# -- the docs example ---------------------------------------------------------------------------------


# -- review fixes: keys, bad input, settings, the queue's time_out_values ------------------------------------

def test_from_rollout_reads_the_reward_leaf_named_by_reward_key() -> None:
    """reward_key was ignored (a hard-coded 'reward' leaf set T and E): a KeyError for any other name."""
    cb = collected_batch(2, 3)
    step = cb.data["step"]
    step["rew"] = step.pop("reward")
    s = RolloutStorage.from_rollout(cb, reward_key="rew")
    assert (s.num_transitions_per_env, s.num_envs) == (T_, 6)
    np.testing.assert_array_equal(s.rewards, want_tm(step["rew"], True))
    with pytest.raises(shmbuf.SchemaError, match=r"no leaf 'reward' .*reward_key='reward'") as info:
        RolloutStorage.from_rollout(cb)
    assert not isinstance(info.value, KeyError)


def test_from_rollout_key_settings_and_a_fill_without_step() -> None:
    cb = collected_batch(1, 2)
    s = RolloutStorage.from_rollout(cb, truncated_key=None)  # no truncation: the storage's own all-False time_outs
    assert s.time_outs.shape == (T_, 2) and s.time_outs.dtype == bool and not s.time_outs.any()
    assert s.time_out_observations is None and "time_outs" not in s.copied
    s.compute_returns(np.zeros(2), 0.9, 0.9)
    for setting in ("value_key", "reward_key", "obs_key", "terminated_key"):
        with pytest.raises(shmbuf.UsageError, match=rf"from_rollout\({setting}=\.\.\.\): .*required"):
            RolloutStorage.from_rollout(cb, **{setting: None})
    with pytest.raises(shmbuf.UsageError, match=r"hidden_states_keys"):
        RolloutStorage.from_rollout(cb, hidden_states_keys="h")
    with pytest.raises(shmbuf.SchemaError, match=r"no fill\['step'\] .*there is \['episode'\]"):
        RolloutStorage.from_rollout(SimpleNamespace(data=cb.data, fill={"episode": 0}))
    cb.data["step"]["terminated"] = np.full((1, T_, 2), "x")
    with pytest.raises(shmbuf.SchemaError, match=r"dones has dtype <U1: expected bool or numbers"):
        RolloutStorage.from_rollout(cb)


def good_transition(N: int = 2) -> Transition:
    return Transition(observations=np.ones((N, 3)), actions=np.ones((N, 2)), rewards=np.ones(N), dones=np.zeros(N),
                      values=np.ones(N), actions_log_prob=np.ones(N), hidden_states=(np.ones((N, 4)), np.ones((N, 4))))


@pytest.mark.parametrize("field,value", [
    ("observations", [[1.0, 2.0, 3.0], [1.0, 2.0]]),  # ragged: numpy's ValueError
    ("observations", np.full((2, 3), "a")),  # strings: numpy's TypeError from copyto
    ("dones", np.array(["a", "b"])),  # numpy's UFuncTypeError from not_equal
    ("actions", np.array([["a", "b"], ["c", "d"]])),  # after valid observations: they were written first
    ("values", np.array([None, None])),  # object arrays
    ("rewards", np.ones(2, complex)),
    ("hidden_states", (np.ones((2, 4)), np.full((2, 4), "h"))),  # the actor's was allocated and written first
])
def test_bad_transitions_are_schema_errors_naming_the_field_and_write_nothing(field: str, value: Any) -> None:
    s = RolloutStorage(2, 3, OBS, None, ACT)
    s.add_transitions(good_transition())
    before = {k: v.copy() for k, v in vars(s).items() if isinstance(v, np.ndarray)}
    tr = good_transition()
    tr.observations = np.full((2, 3), 7.0)
    setattr(tr, field, value)
    with pytest.raises(shmbuf.SchemaError, match=rf"Transition\.{field}"):
        s.add_transitions(tr)
    after = {k: v for k, v in vars(s).items() if isinstance(v, np.ndarray)}
    assert s.step == 1 and after.keys() == before.keys()
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)


def test_hidden_states_are_allocated_only_by_a_transition_that_is_written() -> None:
    s = RolloutStorage(2, 3, OBS, None, ACT)
    tr = good_transition()
    tr.hidden_states = (np.ones((2, 4)), np.full((2, 4), "h"))
    with pytest.raises(shmbuf.SchemaError, match="hidden_states_critic"):
        s.add_transitions(tr)
    assert s.hidden_states_actor is None and s.hidden_states_critic is None and s.step == 0


def test_shape_and_seed_settings() -> None:
    a = RolloutStorage(2, 3, 5, None, 1, 4)  # one int is a 1-d shape
    b = RolloutStorage(2, 3, (5,), [None], (1,), (4,))
    for name in ("observations", "actions", "hidden_states_actor"):
        assert getattr(a, name).shape == getattr(b, name).shape
    assert a.privileged_observations is None and b.privileged_observations is None
    for args, setting in [((2, 3, None, None, (1,)), "obs_shape"), ((2, 3, (2,), None, "x"), "actions_shape"),
                          ((2, 3, (2,), (-1,), (1,)), "privileged_obs_shape"),
                          ((2, 3, (2,), None, (1,), 2.5), "rnn_hidden_shape")]:
        with pytest.raises(shmbuf.UsageError, match=rf"^{setting}: expected a shape"):
            RolloutStorage(*args)
    with pytest.raises(shmbuf.UsageError, match=r"^seed: expected None, an int"):
        RolloutStorage(2, 3, 5, None, 1, seed="x")


@pytest.mark.parametrize("setting", ["gamma", "lam"])
@pytest.mark.parametrize("cls", [RolloutStorage, QueueRolloutStorage])
def test_compute_returns_refuses_a_gamma_or_lam_that_is_not_from_0_to_1(cls: Any, setting: str) -> None:
    s = filled(T=3, N=2, cls=cls)
    kw = {"gamma": 0.9, "lam": 0.9, setting: None}
    with pytest.raises(shmbuf.UsageError, match=rf"{cls.__name__}\.compute_returns\({setting}=\.\.\.\)"):
        s.compute_returns(np.zeros(2), kw["gamma"], kw["lam"])
    assert np.isfinite(s.returns).all()


def test_queue_compute_returns_rotates_time_out_values_with_the_rows() -> None:
    """time_out_values is indexed like the rows when compute_returns is called; it was used unrotated after the untie."""
    rng = np.random.default_rng(4)
    N = 3
    q = QueueRolloutStorage(N, 4, OBS, None, ACT, buffer_dilation_ratio=1.5)  # grows to 6 rows, then loops
    for g in range(4 + 2 + 3):  # 9 steps: the 6-row buffer has looped, step == 3
        q.add_transitions(Transition(observations=np.full((N, 3), g), actions=np.zeros((N, 2)), rewards=rng.normal(size=N),
                                     dones=rng.random(N) < 0.1, time_outs=rng.random(N) < 0.5, values=rng.normal(size=N),
                                     actions_log_prob=np.zeros(N)))
        if g in (3, 5):
            q.clear()
    assert q.buffer_full and q.step == 3 and q.num_transitions_per_env == 6
    tov = np.where(q.time_outs, rng.normal(size=(6, N)), 0.0)  # row i goes with values[i], as stored now
    mine = tov.copy()
    order = np.r_[3:6, 0:3]  # the rows in time order
    want = compute_gae(q.rewards[order], q.values[order], q.dones[order], np.ones(N), 0.9, 0.8,
                       time_outs=q.time_outs[order], time_out_values=tov[order])
    q.compute_returns(np.ones(N), 0.9, 0.8, time_out_values=tov)
    np.testing.assert_array_equal(tov, mine)  # the caller's array is not changed
    np.testing.assert_array_equal(q.observations[:, 0, 0], np.arange(3, 9))
    np.testing.assert_allclose(q.advantages, want[0], atol=1e-5)
    np.testing.assert_allclose(q.returns, want[1], atol=1e-5)
    q.compute_returns(np.ones(N), 0.9, 0.8, time_out_values=tov[order])  # untied now: used as it is
    np.testing.assert_allclose(q.advantages, want[0], atol=1e-5)
    with pytest.raises(shmbuf.SchemaError, match=r"time_out_values has shape \(4, 3\)"):
        q.compute_returns(np.ones(N), 0.9, 0.8, time_out_values=tov[:4])


def test_sarsa_checks_the_last_next_observation_before_writing_the_row() -> None:
    """The last SarsaTransition's next_observations were checked after its row was written and step advanced."""
    s = SarsaRolloutStorage(2, 2, OBS, None, ACT)
    tr = SarsaTransition(**{f: getattr(good_transition(), f) for f in ("observations", "actions", "rewards", "dones",
                                                                          "values", "actions_log_prob")})
    s.add_transitions(tr)
    tr.observations = np.full((2, 3), 5.0)
    tr.next_observations = np.full((2, 3), "x")
    with pytest.raises(shmbuf.SchemaError, match=r"Transition\.next_observations"):
        s.add_transitions(tr)
    assert s.step == 1 and not s.all_observations[1:].any()
    tr.next_observations = np.full((2, 3), 6.0)
    s.add_transitions(tr)
    assert s.step == 2 and (s.next_observations[1] == 6).all() and (s.observations[1] == 5).all()


def test_action_label_rollout_on_numpy_carries_labels_into_every_minibatch() -> None:
    """The rsl_rl fork's ActionLabelRollout without a device: numpy labels, required, laid out like the actions."""
    from shmbuf.storage.compat.rsl_rl import ActionLabelMiniBatch, ActionLabelRollout, ActionLabelTransition

    N, T = 2, 3
    s = ActionLabelRollout(N, T, OBS, None, ACT, seed=0)
    assert s.Transition is ActionLabelTransition and s.action_labels.shape == (T, N, 2)
    for t in range(T):
        s.add_transitions(ActionLabelTransition(observations=np.full((N, 3), t), actions=np.full((N, 2), t),
                                                action_labels=np.full((N, 2), 10 + t), rewards=np.zeros(N),
                                                dones=np.zeros(N), values=np.zeros(N), actions_log_prob=np.zeros(N)))
    s.compute_returns(np.zeros(N), 0.99, 0.95)
    batches = list(s.mini_batch_generator(2, 1))
    assert len(batches) == 2
    for b in batches:
        assert isinstance(b, ActionLabelMiniBatch) and isinstance(b.action_labels, np.ndarray)
        np.testing.assert_array_equal(b.action_labels, b.actions + 10)
    with pytest.raises(shmbuf.SchemaError, match=r"Transition.action_labels is None"):
        s.clear()
        s.add_transitions(ActionLabelTransition(observations=np.zeros((N, 3)), actions=np.zeros((N, 2)),
                                                rewards=np.zeros(N), dones=np.zeros(N), values=np.zeros(N),
                                                actions_log_prob=np.zeros(N)))


def test_a_device_without_torch_is_refused_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device asks for torch tensors; without torch (here: its import made to fail) that is a UsageError, not a
    late ImportError, and leaving the device out is the numpy storage, as always."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(shmbuf.UsageError, match=r"'cpu' asks for torch tensors.*torch is not installed.*leave the device out"):
        RolloutStorage(2, 3, OBS, None, ACT, "cpu")
    assert RolloutStorage(2, 3, OBS, None, ACT).device is None


# -- shmbuf's own engine and rsl_rl's façade over it ------------------------------------------------------------


def test_time_major_storage_is_the_engine_and_rolloutstorage_adds_only_the_forks_shims() -> None:
    """Without a device, rsl_rl's RolloutStorage is the engine: the same GAE and the same minibatches, draw for draw.
    The engine takes no device (numpy in, numpy out) and no rsl_rl quirk: a str in the sixth place is a bad shape."""
    from shmbuf.storage.rollout import TimeMajorStorage

    assert issubclass(RolloutStorage, TimeMajorStorage) and not hasattr(TimeMajorStorage, "reccurent_mini_batch_generator")
    dones = np.zeros((6, 4), bool)
    dones[2, 1] = dones[4, 3] = True
    a, b = filled(dones=dones, cls=TimeMajorStorage, hidden=True), filled(dones=dones, cls=RolloutStorage, hidden=True)
    for s in (a, b):
        s.compute_returns(np.ones(4), 0.99, 0.95)
    assert np.array_equal(a.advantages, b.advantages) and np.array_equal(a.returns, b.returns)
    for ma, mb in zip(a.mini_batch_generator(3, 2), b.mini_batch_generator(3, 2)):
        assert all(np.array_equal(x, y) for x, y in zip(ma[:9], mb[:9]))
    for ma, mb in zip(a.recurrent_mini_batch_generator(2, 1), b.recurrent_mini_batch_generator(2, 1)):
        assert np.array_equal(ma.obs, mb.obs) and np.array_equal(ma.masks, mb.masks)
        assert np.array_equal(ma.hidden_states.actor, mb.hidden_states.actor)
    assert a.get_statistics() == b.get_statistics()
    with pytest.raises(shmbuf.UsageError, match="rnn_hidden_shape: expected a shape"):
        TimeMajorStorage(2, 3, OBS, None, ACT, "cpu")
    with pytest.raises(TypeError, match="device"):
        TimeMajorStorage(2, 3, OBS, None, ACT, device="cpu")
    with pytest.raises(shmbuf.UsageError, match="privileged_obs_shape"):
        TimeMajorStorage(2, 3, OBS, [None], ACT)  # rsl_rl's [None] is the façade's to read
    assert RolloutStorage(2, 3, OBS, [None], ACT).privileged_observations is None
