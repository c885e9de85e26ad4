"""Generalised advantage estimation (GAE), vectorised over envs: one Python step per time step, none per env.

All arrays are time-major: ``rewards``, ``values`` ``[T, N, *rest]`` (``rest`` is usually empty; rsl_rl's
``[T, N, 1]`` works too), the flags ``[T, N]`` (or ``values``' shape), ``last_values`` ``[N, *rest]``.
An episode end at step ``t`` (``dones[t]``, or a time-out) stops both the next value and the advantage of
step ``t + 1`` from flowing back into step ``t``. What differs is the bootstrap, and two conventions name
the flags differently, so there are two keywords; pass one of them (or neither):

- ``time_outs=`` (rsl_rl): ``dones`` marks every episode end, time-outs included (rsl_rl's envs set
  ``dones`` *and* ``time_outs`` at a time limit), and a time-out bootstraps **whatever** ``dones`` **says**:
  ``boot = time_outs``. A time-out not flagged done (rsl_rl's envs never send one) also ends the episode.
- ``truncated=`` (gymnasium): ``dones`` is *terminated* (the MDP ended, the value after it is 0) and
  ``truncated`` a time limit; a step both terminated and truncated counts as terminated:
  ``boot = truncated & ~dones``. This is how shmbuf reads its own actors' ``terminated``/``truncated``
  (``TimeMajorStorage.from_rollout``, and rsl_rl's ``RolloutStorage.from_rollout``, the same).

A bootstrapped step adds ``gamma * tv[t]``, the critic's value of the episode's final observation:
``time_out_values[t]`` where given, else ``values[t]``, which is what rsl_rl does (``rewards += gamma *
values * time_outs``; it is exact only when the final observation's value equals the current one's).

Per step, ``end = dones | time-out flag``, ``boot`` as above::

    delta[t] = (r[t] + gamma * boot[t] * tv[t]) + gamma * (1 - end[t]) * V[t + 1] - V[t]     (V[T] = last_values)
    A[t]     = delta[t] + gamma * lam * (1 - end[t]) * A[t + 1]
    returns  = A + V

in that order of float operations, which is rsl_rl's (its PPO folds ``gamma * V * time_outs`` into the
stored rewards, then runs the same recursion over ``dones``): on float32 data in rsl_rl's convention the
returns are rsl_rl's bit for bit (its advantages are ``returns - values``; these are ``A`` itself). Here
rewards are never modified.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import numpy as np

from shmbuf._errors import SchemaError, UsageError

__all__ = ["compute_gae", "normalize_advantages"]


def _check_shape(name: str, a: np.ndarray, want: tuple[int, ...], alt: tuple[int, ...] | None = None) -> None:
    if a.shape != want and a.shape != alt:
        also = f" or {alt}" if alt is not None and alt != want else ""
        raise SchemaError(f"compute_gae: {name} has shape {a.shape}, expected {want}{also} (time-major [T, N, ...])")


def check_discount(where: str, setting: str, value: Any) -> float:
    """``value`` as a float if it is a real number in [0, 1] (``gamma``, ``lam``); else UsageError naming ``setting``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real) or not 0.0 <= float(value) <= 1.0:
        raise UsageError(f"{where}({setting}=...): expected a real number from 0 to 1, got {value!r:.80}")
    return float(value)


def _mask(name: str, a: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` as a bool array broadcastable against ``shape`` (``[T, N]`` gets trailing axes added, as a view)."""
    a = np.asarray(a)
    _check_shape(name, a, shape[:2], shape)
    if a.dtype != np.bool_:
        a = a != 0
    return a.reshape(a.shape + (1,) * (len(shape) - a.ndim))


def _outputs(out: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], dtype: np.dtype,
             inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    if out is None:
        return np.empty(shape, dtype), np.empty(shape, dtype)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, np.ndarray) for o in out)):
        raise UsageError("compute_gae(out=...): expected a tuple (advantages, returns) of numpy arrays, "
                         f"got {type(out).__name__}")
    for name, o in zip(("advantages", "returns"), out):
        if o.shape != shape or not np.can_cast(dtype, o.dtype, "same_kind") or not o.flags.writeable:
            raise UsageError(f"compute_gae(out=...): {name} must be a writable {shape} floating array, "
                             f"got {o.shape} {o.dtype}{'' if o.flags.writeable else ' (read-only)'}")
    if np.may_share_memory(out[0], out[1]) or any(np.may_share_memory(o, i) for o in out for i in inputs):
        raise UsageError("compute_gae(out=...): the output arrays must not overlap each other or the inputs")
    return out


def compute_gae(rewards: Any, values: Any, dones: Any, last_values: Any, gamma: float, lam: float, *,
                time_outs: Any = None, truncated: Any = None, time_out_values: Any = None,
                out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages and returns (see the module doc for the formula); returns ``(advantages, returns)``.

    Args:
        rewards, values: ``[T, N, *rest]``, float32 or float64 (the result has their common float type).
        dones: ``[T, N]`` (or ``values``' shape): bool, or numbers where nonzero means true. With
            ``time_outs`` (rsl_rl) every episode end; with ``truncated`` (gymnasium) terminated only.
        last_values: ``[N, *rest]``: the critic's value of the observation after the last step.
        gamma, lam: discount and GAE lambda: real numbers from 0 to 1 (else UsageError naming the setting).
        time_outs: like ``dones``, rsl_rl's flag: the episode hit its time limit; such a step
            bootstraps **whatever** ``dones`` **says** (rsl_rl sets both at a time-out).
        truncated: like ``dones``, gymnasium's flag: the episode was cut by a time limit; such a step
            bootstraps unless ``dones`` (terminated) is also set. Give ``time_outs`` or ``truncated``, not both
            (UsageError); neither: no time-outs.
        time_out_values: like ``values``: at each bootstrapped step, the value of the episode's final
            observation (read only there; None: use ``values``).
        out: ``(advantages, returns)`` arrays to write into (e.g. a storage's own), instead of new ones.

    Allocates one ``[T, N]`` scratch array (the per-step factors) besides the outputs, and index arrays for
    the bootstrapped steps; the loop over T writes in place. Inputs are never modified.
    """
    gamma = check_discount("compute_gae", "gamma", gamma)
    lam = check_discount("compute_gae", "lam", lam)
    if time_outs is not None and truncated is not None:
        raise UsageError("compute_gae: got both time_outs= (rsl_rl: a time-out bootstraps whatever dones says) "
                         "and truncated= (gymnasium: terminated wins); pass the one whose convention your flags follow")
    rewards = np.asarray(rewards)
    values = np.asarray(values)
    if values.ndim < 2:
        raise SchemaError(f"compute_gae: values has shape {values.shape}, expected time-major [T, N, ...]")
    shape = values.shape
    T = shape[0]
    _check_shape("rewards", rewards, shape)
    last_values = np.asarray(last_values)
    _check_shape("last_values", last_values, shape[1:])
    dtype = np.result_type(rewards.dtype, values.dtype, last_values.dtype, np.float32)
    if not np.issubdtype(dtype, np.floating):
        raise SchemaError(f"compute_gae: rewards and values must be real numbers, got {rewards.dtype} and {values.dtype}")
    done = _mask("dones", dones, shape)
    inputs = (rewards, values, last_values)
    end = done
    boot = None
    if time_outs is not None:
        boot = _mask("time_outs", time_outs, shape)  # rsl_rl: whatever dones says
        end = done | boot
    elif truncated is not None:
        to = _mask("truncated", truncated, shape)
        end = done | to
        boot = to & ~done  # gymnasium: a step both terminated and truncated is terminated
    tv = values if time_out_values is None else np.asarray(time_out_values)
    _check_shape("time_out_values", tv, shape)
    adv, ret = _outputs(out, shape, dtype, inputs)
    if T == 0:
        return adv, ret

    g = np.asarray(gamma, dtype)
    # cont[t] = gamma * (1 - end[t]): what carries V[t+1] and A[t+1] back into step t
    cont = np.multiply(~end, g, dtype=dtype)
    # delta, written into adv: (r + cont * V_next) - V; rsl_rl's order of operations, so float32 results match it
    np.multiply(cont[:-1], values[1:], out=adv[:-1])
    np.multiply(cont[-1], last_values, out=adv[-1])
    at = None
    if boot is not None:
        # time-outs are few: index them rather than pass over every step (and never read tv elsewhere)
        if boot.shape == shape:  # a mask per element (e.g. per critic head): index every axis
            at = np.unravel_index(np.flatnonzero(boot), shape)
        else:  # one flag per step and env ([T, N, 1, ...]): index [t, n] and take the trailing axes whole
            at = np.unravel_index(np.flatnonzero(boot), shape[:2])  # 2-d np.nonzero is ten times slower
        next_part = adv[at]  # cont * V_next at the bootstrapped steps (a copy)
    adv += rewards
    adv -= values
    if at is not None:
        # rsl_rl folds gamma * V into the reward first: ((r + gamma * tv) + cont * V_next) - V
        adv[at] = ((rewards[at] + g * tv[at]) + next_part) - values[at]
    cont *= lam
    tmp = ret[0]  # one row of scratch for the recursion
    for t in range(T - 2, -1, -1):
        np.multiply(cont[t], adv[t + 1], out=tmp)
        np.add(adv[t], tmp, out=adv[t])
    np.add(adv, values, out=ret)
    return adv, ret


def normalize_advantages(advantages: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """``(A - mean) / (std + eps)`` in place, over the whole array, as rsl_rl does (std with Bessel's correction)."""
    n = advantages.size
    mean = advantages.mean()
    std = advantages.std(ddof=1) if n > 1 else 0.0
    advantages -= mean
    advantages /= std + eps
    return advantages
