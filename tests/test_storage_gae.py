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
