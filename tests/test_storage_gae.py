"""compute_gae against the obvious per-step, per-env loop, on random data with terminations and time-outs, in both
flag conventions (``time_outs=``: rsl_rl; ``truncated=``: gymnasium), and against rsl_rl's own arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.storage.gae import compute_gae, normalize_advantages
from tests import _rsl_rl

RULES = {"time_outs": "rsl_rl", "truncated": "gymnasium"}  # compute_gae's keyword -> its flag convention


def gae_loop(rewards, values, dones, time_outs, last_values, gamma, lam, time_out_values=None, rule="gymnasium"):
    """GAE the plain way: one env at a time, one step at a time, backwards. ``rule="gymnasium"``: a step both
    terminated and truncated is terminated; ``"rsl_rl"``: a time-out bootstraps whatever ``dones`` says."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        a = 0.0
        for t in reversed(range(T)):
            next_v = last_values[n] if t == T - 1 else values[t + 1, n]
            r = rewards[t, n]
            if dones[t, n] and (rule == "gymnasium" or not time_outs[t, n]):  # terminated: nothing after it
                next_v, a = 0.0, 0.0
            elif time_outs[t, n]:  # truncated: bootstrap from the final observation's value, then cut
                final_v = values[t, n] if time_out_values is None else time_out_values[t, n]
                r = r + gamma * final_v
                next_v, a = 0.0, 0.0
            delta = r + gamma * next_v - values[t, n]
            a = delta + gamma * lam * a
            adv[t, n] = a
    return adv, adv + values


def random_case(seed: int, T: int, N: int, p_done: float, p_out: float):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, N))
    values = rng.normal(size=(T, N))
    dones = rng.random((T, N)) < p_done
    time_outs = rng.random((T, N)) < p_out
    last_values = rng.normal(size=N)
    tov = np.where(time_outs, rng.normal(size=(T, N)), np.nan)  # NaN off the time-outs: must never be read
    return rewards, values, dones, time_outs, last_values, tov


@settings(deadline=None, max_examples=150)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 40), N=st.integers(1, 7),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), p_done=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
       p_out=st.sampled_from([0.0, 0.05, 0.3, 1.0]), with_tov=st.booleans(), flag=st.sampled_from(sorted(RULES)))
def test_gae_equals_the_per_step_loop(seed, T, N, gamma, lam, p_done, p_out, with_tov, flag) -> None:
    rewards, values, dones, time_outs, last_values, tov = random_case(seed, T, N, p_done, p_out)
    tov = tov if with_tov else None
    adv, ret = compute_gae(rewards, values, dones, last_values, gamma, lam, **{flag: time_outs}, time_out_values=tov)
    want_adv, want_ret = gae_loop(rewards, values, dones, time_outs, last_values, gamma, lam, tov, RULES[flag])
    assert adv.dtype == np.float64 and adv.shape == (T, N)
    np.testing.assert_allclose(adv, want_adv, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ret, want_ret, rtol=0, atol=1e-6)


def test_without_time_outs_it_is_rsl_rls_recursion_and_each_convention_is_its_reward_fold() -> None:
    rewards, values, dones, time_outs, last_values, _ = random_case(3, 30, 5, 0.1, 0.1)
    adv, _ = compute_gae(rewards, values, dones, last_values, 0.99, 0.95)
    np.testing.assert_allclose(adv, gae_loop(rewards, values, dones, np.zeros_like(dones), last_values, 0.99, 0.95)[0],
                               atol=1e-9)
    # rsl_rl folds gamma * V * time_outs into the rewards, whatever dones says, and cuts at dones (which include
    # the time-outs): time_outs= is that
    folded = rewards + 0.99 * values * time_outs
    a1, r1 = compute_gae(folded, values, dones | time_outs, last_values, 0.99, 0.95)
    a2, r2 = compute_gae(rewards, values, dones, last_values, 0.99, 0.95, time_outs=time_outs)
    np.testing.assert_allclose(a1, a2, atol=1e-12)
    np.testing.assert_allclose(r1, r2, atol=1e-12)
    # gymnasium: terminated wins, so only truncated & ~terminated is folded: truncated= is that
    folded = rewards + 0.99 * values * (time_outs & ~dones)
    a1, r1 = compute_gae(folded, values, dones | time_outs, last_values, 0.99, 0.95)
    a2, r2 = compute_gae(rewards, values, dones, last_values, 0.99, 0.95, truncated=time_outs)
    np.testing.assert_allclose(a1, a2, atol=1e-12)
    np.testing.assert_allclose(r1, r2, atol=1e-12)
    assert (dones & time_outs).any() and not np.allclose(a2, compute_gae(rewards, values, dones, last_values, 0.99, 0.95,
                                                                         time_outs=time_outs)[0])


def test_the_issues_case_a_time_out_flagged_done_bootstraps_under_time_outs_not_under_truncated() -> None:
    """Issue 18 item 6: r=0, V=1, dones=1, time_outs=1, last V=5, gamma=0.99, lam=0.95. rsl_rl (and its forks) bootstrap:
    A = (0 + 0.99 * 1) - 1 = -0.01, returns 0.99. shmbuf counted the step as terminated: A = -1, returns 0."""
    one = np.ones((1, 1), np.float32)
    args = (0 * one, one, one.astype(bool), np.full(1, 5, np.float32), 0.99, 0.95)
    adv, ret = compute_gae(*args, time_outs=one.astype(bool))
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [[-0.01]], rtol=0, atol=1e-6)
    np.testing.assert_allclose(ret, [[0.99]], rtol=0, atol=1e-6)
    adv, ret = compute_gae(*args, truncated=one.astype(bool))  # gymnasium's terminated and truncated: terminated
    np.testing.assert_allclose(adv, [[-1.0]], rtol=0, atol=0)
    np.testing.assert_allclose(ret, [[0.0]], rtol=0, atol=0)
    # two steps, by hand: step 1 as above; step 0 (r=1, V=2, no flags) carries it back
    # A1 = 0.99 - 1 = -0.01; A0 = (1 + 0.99 * 1 - 2) + 0.99 * 0.95 * A1 = -0.01 - 0.009405 = -0.019405
    r, v = np.array([[1.0], [0.0]]), np.array([[2.0], [1.0]])
    flags = np.array([[False], [True]])
    adv, ret = compute_gae(r, v, flags, np.array([5.0]), 0.99, 0.95, time_outs=flags)
    np.testing.assert_allclose(adv[:, 0], [-0.019405, -0.01], rtol=0, atol=1e-12)
    np.testing.assert_allclose(ret[:, 0], [1.980595, 0.99], rtol=0, atol=1e-12)
    adv, _ = compute_gae(r, v, flags, np.array([5.0]), 0.99, 0.95, truncated=flags)
    np.testing.assert_allclose(adv[:, 0], [-0.01 + 0.99 * 0.95 * -1.0, -1.0], rtol=0, atol=1e-12)


def test_time_outs_and_truncated_together_are_refused() -> None:
    r = np.zeros((3, 2))
    with pytest.raises(shmbuf.UsageError, match=r"both time_outs= \(rsl_rl.*and truncated= \(gymnasium"):
        compute_gae(r, r, r, np.zeros(2), 0.9, 0.9, time_outs=r, truncated=r)


def rsl_rl_case(seed: int):
    """float32 data in rsl_rl's convention: time-outs are a subset of dones (its envs set both at a time limit).
    Every case has a time-out (the flag these tests are about): where the draw made none, one step of one env is
    made a time-out."""
    rng = np.random.default_rng(seed)
    T, N = int(rng.integers(1, 40)), int(rng.integers(1, 9))
    rewards, values = (rng.normal(size=(T, N)).astype(np.float32) for _ in range(2))
    last_values = rng.normal(size=N).astype(np.float32)
    dones = rng.random((T, N)) < rng.choice([0.05, 0.3, 1.0])
    time_outs = dones & (rng.random((T, N)) < rng.choice([0.2, 0.5, 1.0]))
    if not time_outs.any():
        t, n = int(rng.integers(T)), int(rng.integers(N))
        dones[t, n] = time_outs[t, n] = True
    gamma, lam = float(rng.uniform(0.8, 1.0)), float(rng.uniform(0.8, 1.0))
    return rewards, values, dones, time_outs, last_values, gamma, lam


OWN_SEEDS = range(10)  # test_time_outs_give_rsl_rls_own_returns_bit_for_bit's cases
TRANSCRIBED_SEEDS = range(10, 50)  # test_time_outs_give_rsl_rls_returns_bit_for_bit's: other cases than those


def test_the_rsl_rl_cases_have_time_outs_everywhere_and_are_not_repeated() -> None:
    """Each case of the two bit-for-bit tests has a time-out; between them, time-outs at the first and the last
    step, in one-step and one-env cases, and dones that are not time-outs; no case is in both tests."""
    assert not set(OWN_SEEDS) & set(TRANSCRIBED_SEEDS)
    cases = [rsl_rl_case(seed) for seed in (*OWN_SEEDS, *TRANSCRIBED_SEEDS)]
    assert all(to.any() for _, _, _, to, _, _, _ in cases), "a case without a time-out"
    seen = {"first step": False, "last step": False, "T == 1": False, "N == 1": False, "done, no time-out": False}
    for _, _, dones, to, _, _, _ in cases:
        seen["first step"] |= bool(to[0].any())
        seen["last step"] |= bool(to[-1].any())
        seen["T == 1"] |= to.shape[0] == 1
        seen["N == 1"] |= to.shape[1] == 1
        seen["done, no time-out"] |= bool((dones & ~to).any())
    assert all(seen.values()), seen


@pytest.mark.parametrize("seed", TRANSCRIBED_SEEDS)
def test_time_outs_give_rsl_rls_returns_bit_for_bit(seed: int) -> None:
    """Against a line-by-line torch transcription of rsl_rl 5.5.1's PPO (tests/_rsl_rl.py): the same float32
    operations in the same order, so the returns are equal, not close; rsl_rl's advantages are returns - values."""
    rewards, values, dones, time_outs, last_values, gamma, lam = rsl_rl_case(seed)
    want_adv, want_ret = _rsl_rl.transcribed(rewards, values, dones, time_outs, last_values, gamma, lam)
    adv, ret = compute_gae(rewards, values, dones, last_values, gamma, lam, time_outs=time_outs)
    assert ret.dtype == np.float32
    np.testing.assert_array_equal(ret, want_ret)
    np.testing.assert_array_equal(ret - values, want_adv)
    np.testing.assert_allclose(adv, want_adv, rtol=0, atol=1e-5)  # A itself, before the round trip through returns


@pytest.mark.parametrize("seed", OWN_SEEDS)
def test_time_outs_give_rsl_rls_own_returns_bit_for_bit(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same against rsl_rl's own PPO.process_env_step and PPO.compute_returns (skipped unless rsl_rl is
    installed; it is not a dependency: `pip install --no-deps rsl-rl-lib` to run it)."""
    rewards, values, dones, time_outs, last_values, gamma, lam = rsl_rl_case(seed)
    want_adv, want_ret = _rsl_rl.real(monkeypatch, rewards, values, dones, time_outs, last_values, gamma, lam)
    adv, ret = compute_gae(rewards, values, dones, last_values, gamma, lam, time_outs=time_outs)
    np.testing.assert_array_equal(ret, want_ret)
    np.testing.assert_array_equal(ret - values, want_adv)
    np.testing.assert_array_equal(want_ret, _rsl_rl.transcribed(rewards, values, dones, time_outs, last_values,
                                                                 gamma, lam)[1])  # the transcription is faithful


def test_float32_trailing_dims_int_masks_and_out_arrays_written_in_place() -> None:
    rewards, values, dones, time_outs, last_values, _ = random_case(5, 12, 4, 0.2, 0.2)
    want, want_ret = gae_loop(rewards, values, dones, time_outs, last_values, 0.9, 0.7, rule="rsl_rl")
    r32, v32, lv32 = rewards.astype(np.float32), values.astype(np.float32), last_values.astype(np.float32)
    adv, ret = compute_gae(r32, v32, dones.astype(np.uint8), lv32, 0.9, 0.7, time_outs=time_outs.astype(np.float32))
    assert adv.dtype == np.float32 and ret.dtype == np.float32
    np.testing.assert_allclose(adv, want, atol=1e-4)
    # rsl_rl's [T, N, 1] layout, with [T, N] masks
    out = (np.full((12, 4, 1), np.nan), np.full((12, 4, 1), np.nan))
    a3, r3 = compute_gae(rewards[..., None], values[..., None], dones, last_values[:, None], 0.9, 0.7,
                         time_outs=time_outs, out=out)
    assert a3 is out[0] and r3 is out[1]
    np.testing.assert_allclose(a3[..., 0], want, atol=1e-9)
    np.testing.assert_allclose(r3[..., 0], want_ret, atol=1e-9)
    before = (rewards.copy(), values.copy())
    compute_gae(rewards, values, dones, last_values, 0.9, 0.7, time_outs=time_outs)
    assert np.array_equal(before[0], rewards) and np.array_equal(before[1], values)  # inputs untouched


def test_bad_shapes_and_out_arrays_are_refused_with_names() -> None:
    r = np.zeros((5, 3))
    with pytest.raises(shmbuf.SchemaError, match=r"last_values has shape \(4,\), expected \(3,\)"):
        compute_gae(r, r, r, np.zeros(4), 0.9, 0.9)
    with pytest.raises(shmbuf.SchemaError, match=r"dones has shape \(3, 5\)"):
        compute_gae(r, r, np.zeros((3, 5)), np.zeros(3), 0.9, 0.9)
    with pytest.raises(shmbuf.SchemaError, match=r"time-major"):
        compute_gae(np.zeros(5), np.zeros(5), np.zeros(5), np.zeros(()), 0.9, 0.9)
    with pytest.raises(shmbuf.UsageError, match="must not overlap"):
        compute_gae(r, r, r, np.zeros(3), 0.9, 0.9, out=(r, np.zeros((5, 3))))
    with pytest.raises(shmbuf.UsageError, match=r"writable \(5, 3\) floating"):
        compute_gae(r, r, r, np.zeros(3), 0.9, 0.9, out=(np.zeros((5, 3), int), np.zeros((5, 3))))
    adv, ret = compute_gae(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(3), 0.9, 0.9)
    assert adv.shape == ret.shape == (0, 3)


def test_normalize_advantages_matches_rsl_rl() -> None:
    a = np.random.default_rng(0).normal(2.0, 3.0, size=(10, 4))
    want = (a - a.mean()) / (a.std(ddof=1) + 1e-8)  # torch.std is unbiased
    got = normalize_advantages(a)
    assert got is a
    np.testing.assert_allclose(got, want, atol=1e-12)


def gae_loop_nd(rewards, values, dones, time_outs, last_values, gamma, lam, time_out_values, rule="gymnasium"):
    """The per-step loop over whole ``[N, K]`` rows, masks of values' full shape ``[T, N, K]`` (one flag per critic head)."""
    T = rewards.shape[0]
    adv = np.zeros(rewards.shape)
    a = np.zeros(rewards.shape[1:])
    next_v = last_values
    for t in reversed(range(T)):
        end = dones[t] | time_outs[t]
        boot = time_outs[t] & ~dones[t] if rule == "gymnasium" else time_outs[t]
        delta = rewards[t] + gamma * ~end * next_v + gamma * np.where(boot, time_out_values[t], 0.0) - values[t]
        a = delta + gamma * lam * ~end * a
        adv[t] = a
        next_v = values[t]
    return adv, adv + values


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 12), N=st.integers(1, 4), K=st.integers(2, 3),
       p_out=st.sampled_from([0.05, 0.3, 1.0]), mask_kind=st.sampled_from(["both", "dones", "time_outs"]),
       with_tov=st.booleans(), flag=st.sampled_from(sorted(RULES)))
def test_full_shape_masks_bootstrap_each_element(seed, T, N, K, p_out, mask_kind, with_tov, flag) -> None:
    """[T, N, K] values with dones and/or time_outs of that full shape (the docstring allows it): each element
    bootstraps on its own flag. (The time-out index once assumed [T, N] masks: wrong advantages or an IndexError.)"""
    rng = np.random.default_rng(seed)
    r, v, tov = (rng.normal(size=(T, N, K)) for _ in range(3))
    lv = rng.normal(size=(N, K))
    d = rng.random((T, N, K)) < 0.2
    to = rng.random((T, N, K)) < p_out
    if mask_kind == "dones":  # [T, N, K] dones, [T, N] time-outs (broadcast over K)
        to = np.repeat(to[:, :, :1], K, axis=2)
    elif mask_kind == "time_outs":
        d = np.repeat(d[:, :, :1], K, axis=2)
    d_in = d[:, :, 0] if mask_kind == "time_outs" else d
    to_in = to[:, :, 0] if mask_kind == "dones" else to
    adv, ret = compute_gae(r, v, d_in, lv, 0.9, 0.95, **{flag: to_in}, time_out_values=tov if with_tov else None)
    want_adv, want_ret = gae_loop_nd(r, v, d, to, lv, 0.9, 0.95, tov if with_tov else v, RULES[flag])
    np.testing.assert_allclose(adv, want_adv, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ret, want_ret, rtol=0, atol=1e-6)


def test_the_reviewers_full_shape_cases() -> None:
    """The two cases that failed: a time-out on one head (max error 0.93) and one past index T*N (IndexError)."""
    rng = np.random.default_rng(0)
    T, N, K = 5, 3, 2
    r, v = rng.normal(size=(T, N, K)), rng.normal(size=(T, N, K))
    lv, tov = rng.normal(size=(N, K)), rng.normal(size=(T, N, K))
    d = np.zeros((T, N, K), bool)
    for at in [(2, 1, 0), (4, 2, 1)]:
        to = np.zeros((T, N, K), bool)
        to[at] = True
        adv, _ = compute_gae(r, v, d, lv, 0.9, 0.95, time_outs=to, time_out_values=tov)
        np.testing.assert_allclose(adv, gae_loop_nd(r, v, d, to, lv, 0.9, 0.95, tov)[0], atol=1e-9)


@pytest.mark.parametrize("setting", ["gamma", "lam"])
@pytest.mark.parametrize("bad", [None, "0.9", -0.1, 1.5, float("nan"), True, np.array([0.9, 0.9])])
def test_gamma_and_lam_must_be_numbers_from_0_to_1(setting, bad) -> None:
    """None once gave NaN everywhere, silently: now a UsageError (a ValueError and a TypeError) naming the setting."""
    r = np.zeros((3, 2))
    kw = {"gamma": 0.99, "lam": 0.95, setting: bad}
    with pytest.raises(shmbuf.UsageError, match=rf"compute_gae\({setting}=\.\.\.\): expected a real number from 0 to 1"):
        compute_gae(r, r, r, np.zeros(2), kw["gamma"], kw["lam"])
    for ok in (0, 1, np.float32(0.5)):
        kw[setting] = ok
        compute_gae(r, r, r, np.zeros(2), kw["gamma"], kw["lam"])
