"""One stepping interface over a gymnasium env or vector env, with every autoreset mode made honest.

:class:`EnvDriver` always speaks in batches of ``E`` sub-environments (a plain
``gymnasium.Env`` is a batch of one) and returns, for every step, the
observation the policy acts on next *and* the true successor observation of
the transition just taken. The two differ only where an episode ended: there
the successor is the episode's final observation and the next observation is
the first one of a new episode.

Gymnasium 1.x vector envs autoreset in one of three modes, read from
``env.metadata["autoreset_mode"]``:

- ``NEXT_STEP`` (the default): the step that ends an episode returns its final
  observation; the *next* ``step()`` ignores that sub-env's action, resets it
  and returns the reset observation with reward 0 and no termination. That
  step belongs to no transition. We never let it happen: right after a step
  that ended episodes we reset exactly those sub-envs with
  ``reset(options={"reset_mask": done})``, which clears the pending autoreset,
  so every later ``step()`` is a real transition for every sub-env.
- ``DISABLED``: the same masked reset is what the mode asks of its user.
- ``SAME_STEP``: the env already reset and put the final observation in
  ``info["final_obs"]``; we take it from there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree


def _is_arr(x: Any) -> bool:
    return type(x) is np.ndarray


def tree_copy(x: Any) -> Any:
    return x.copy() if _is_arr(x) else optree.tree_map(np.array, x)


def tree_index(x: Any, i: Any) -> Any:
    return x[i] if _is_arr(x) else optree.tree_map(lambda a: a[i], x)


def tree_batch1(x: Any) -> Any:
    """Add a leading batch dim of 1."""
    if _is_arr(x):
        return x[None]
    return optree.tree_map(lambda a: np.asarray(a)[None], x)


def tree_set(dst: Any, i: Any, src: Any) -> None:
    if _is_arr(dst):
        dst[i] = src
        return
    for d, s in zip(optree.tree_leaves(dst), optree.tree_leaves(src), strict=True):
        d[i] = s


def autoreset_mode(env: Any) -> str:
    """'next_step', 'same_step' or 'disabled' for a vector env (gymnasium < 1.1 knows only next_step)."""
    mode = getattr(env, "metadata", {}).get("autoreset_mode", "NextStep")
    value = getattr(mode, "value", mode)
    return {"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"}.get(str(value), "next_step")


def is_vector_env(env: Any) -> bool:
    import gymnasium

    return isinstance(env, gymnasium.vector.VectorEnv)


class EnvDriver:
    """Batched ``reset``/``step``/``reset_some`` over a gymnasium Env or VectorEnv (see the module doc)."""

    def __init__(self, env: Any):
        self.env = env
        self.vector = is_vector_env(env)
        self.num_envs = int(env.num_envs) if self.vector else 1
        self.mode = autoreset_mode(env) if self.vector else "manual"

    def reset(self, seed: int | None = None) -> Any:
        obs, _ = self.env.reset(seed=seed)
        return obs if self.vector else tree_batch1(obs)

    def step(self, action: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, Any]:
        """``(next_obs, reward, terminated, truncated, successor)``, each batched over sub-envs."""
        if not self.vector:
            a = tree_index(action, 0)
            o, r, te, tr, _ = self.env.step(a)
            succ = tree_batch1(o)
            nobs = succ
            if te or tr:
                o, _ = self.env.reset()
                nobs = tree_batch1(o)
            return nobs, np.array([r], np.float64), np.array([te], bool), np.array([tr], bool), succ
        o, r, te, tr, info = self.env.step(action)
        te = np.asarray(te, bool)
        tr = np.asarray(tr, bool)
        done = te | tr
        if not done.any():
            return o, np.asarray(r), te, tr, o
        if self.mode == "same_step":
            succ = tree_copy(o)
            final = info["final_obs"]
            for e in np.flatnonzero(done):
                tree_set(succ, e, final[e])
            return o, np.asarray(r), te, tr, succ
        succ = tree_copy(o)  # the reset below may write into the env's own observation buffer
        nobs, _ = self.env.reset(options={"reset_mask": done})
        return nobs, np.asarray(r), te, tr, succ

    def reset_some(self, mask: np.ndarray, obs: Any) -> Any:
        """Reset the sub-envs where ``mask`` (episodes cut by the actor); return ``obs`` with those rows replaced."""
        if not self.vector:
            o, _ = self.env.reset()
            return tree_batch1(o)
        nobs, _ = self.env.reset(options={"reset_mask": np.asarray(mask, bool)})
        return nobs

    def close(self) -> None:
        self.env.close()
