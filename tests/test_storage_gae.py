"""compute_gae against the obvious per-step, per-env loop, on random data with terminations and time-outs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.storage.gae import compute_gae, normalize_advantages


def gae_loop(rewards, values, dones, time_outs, last_values, gamma, lam, time_out_values=None):
    """GAE the plain way: one env at a time, one step at a time, backwards."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        a = 0.0
        for t in reversed(range(T)):
            next_v = last_values[n] if t == T - 1 else values[t + 1, n]
            r = rewards[t, n]
            if dones[t, n]:  # terminated: nothing after it
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
       p_out=st.sampled_from([0.0, 0.05, 0.3, 1.0]), with_tov=st.booleans())
def test_gae_equals_the_per_step_loop(seed, T, N, gamma, lam, p_done, p_out, with_tov) -> None:
    rewards, values, dones, time_outs, last_values, tov = random_case(seed, T, N, p_done, p_out)
    tov = tov if with_tov else None
    adv, ret = compute_gae(rewards, values, dones, last_values, gamma, lam, time_outs=time_outs, time_out_values=tov)
    want_adv, want_ret = gae_loop(rewards, values, dones, time_outs, last_values, gamma, lam, tov)
    assert adv.dtype == np.float64 and adv.shape == (T, N)
    np.testing.assert_allclose(adv, want_adv, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ret, want_ret, rtol=0, atol=1e-6)


def test_without_time_outs_it_is_rsl_rls_recursion_and_the_002_time_out_trick_agrees() -> None:
    rewards, values, dones, time_outs, last_values, _ = random_case(3, 30, 5, 0.1, 0.1)
    adv, _ = compute_gae(rewards, values, dones, last_values, 0.99, 0.95)
    np.testing.assert_allclose(adv, gae_loop(rewards, values, dones, np.zeros_like(dones), last_values, 0.99, 0.95)[0],
                               atol=1e-9)
    # 002/rsl_rl fold the time-out bootstrap into the rewards and count time-outs as dones: same result
    folded = rewards + 0.99 * values * (time_outs & ~dones)
    a1, r1 = compute_gae(folded, values, dones | time_outs, last_values, 0.99, 0.95)
    a2, r2 = compute_gae(rewards, values, dones, last_values, 0.99, 0.95, time_outs=time_outs)
    np.testing.assert_allclose(a1, a2, atol=1e-12)
    np.testing.assert_allclose(r1, r2, atol=1e-12)


def test_float32_trailing_dims_int_masks_and_out_arrays_written_in_place() -> None:
    rewards, values, dones, time_outs, last_values, _ = random_case(5, 12, 4, 0.2, 0.2)
    want, want_ret = gae_loop(rewards, values, dones, time_outs, last_values, 0.9, 0.7)
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


def gae_loop_nd(rewards, values, dones, time_outs, last_values, gamma, lam, time_out_values):
    """The per-step loop over whole ``[N, K]`` rows, masks of values' full shape ``[T, N, K]`` (one flag per critic head)."""
    T = rewards.shape[0]
    adv = np.zeros(rewards.shape)
    a = np.zeros(rewards.shape[1:])
    next_v = last_values
    for t in reversed(range(T)):
        end = dones[t] | time_outs[t]
        boot = time_outs[t] & ~dones[t]
        delta = rewards[t] + gamma * ~end * next_v + gamma * np.where(boot, time_out_values[t], 0.0) - values[t]
        a = delta + gamma * lam * ~end * a
        adv[t] = a
        next_v = values[t]
    return adv, adv + values


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 12), N=st.integers(1, 4), K=st.integers(2, 3),
       p_out=st.sampled_from([0.05, 0.3, 1.0]), mask_kind=st.sampled_from(["both", "dones", "time_outs"]),
       with_tov=st.booleans())
def test_full_shape_masks_bootstrap_each_element(seed, T, N, K, p_out, mask_kind, with_tov) -> None:
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
    adv, ret = compute_gae(r, v, d_in, lv, 0.9, 0.95, time_outs=to_in, time_out_values=tov if with_tov else None)
    want_adv, want_ret = gae_loop_nd(r, v, d, to, lv, 0.9, 0.95, tov if with_tov else v)
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
