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

Partial reset (``reset_mask``) and ``metadata["autoreset_mode"]`` came with
gymnasium 1.1. Under 1.0 the masked reset above resets *every* sub-env, so
unfinished episodes would restart unseen; :class:`EnvDriver` refuses a vector
env under gymnasium < 1.1, and one that does not declare its autoreset mode.

Observations: an env may hand back the same buffer every step (gymnasium
vector envs with ``copy=False``, or an env returning its own state array), so
the observation an action was taken on would change under the caller at the
next ``step()``. The driver copies every observation it returns into one of
two preallocated buffers it alternates between: one ``np.copyto`` per step
(the cheapest correct option; writing the step before stepping cannot work,
since reward and flags come from the step and a Writer row is added whole).

The actor loop's hot path uses :meth:`EnvDriver.step_into` instead: it writes each observation into a
buffer the caller gives (a row of the slot), and steps the sub-envs of an unwrapped ``SyncVectorEnv``
itself (docs/design/actor.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from shmbuf import UsageError

PARTIAL_RESET_SINCE = (1, 1)  # gymnasium 1.1.0: reset(options={"reset_mask": ...}) and metadata["autoreset_mode"]


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


def check_partial_reset(env: Any, version: str) -> None:
    """Raise :class:`shmbuf.UsageError` unless ``env`` (a vector env) can reset some sub-envs and says how it autoresets.

    ``version``: the installed gymnasium's version string.
    """
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) < PARTIAL_RESET_SINCE:
        raise UsageError(
            f"gymnasium {version} is installed; its vector envs have no partial reset (reset(options={{'reset_mask': "
            f"...}})), so every episode still running would restart unseen whenever one ends. workers needs gymnasium "
            f">= 1.1: pip install 'gymnasium>=1.1'"
        )
    if "autoreset_mode" not in getattr(env, "metadata", {}):
        raise UsageError(
            f"vector env {type(env).__name__}: metadata has no 'autoreset_mode', so how it resets finished sub-envs is "
            "unknown. Set metadata['autoreset_mode'] to a gymnasium.vector.AutoresetMode (as SyncVectorEnv and "
            "AsyncVectorEnv do) and support reset(options={'reset_mask': mask})"
        )


class EnvDriver:
    """Batched ``reset``/``step``/``reset_some`` over a gymnasium Env or VectorEnv (see the module doc).

    Lifetime of what it returns: the observation from ``reset``, ``step``
    (``next_obs``) or ``reset_some`` is a driver buffer, valid until the
    second driver call after the one that returned it (so it survives the
    ``step`` it is acted on). A successor that differs from ``next_obs`` (an
    episode ended) is a fresh array, the caller's to keep.

    Raises:
        shmbuf.UsageError: a vector env without partial reset (gymnasium < 1.1,
            or no declared autoreset mode).
    """

    def __init__(self, env: Any):
        self.env = env
        self.vector = is_vector_env(env)
        self.num_envs = int(env.num_envs) if self.vector else 1
        if self.vector:
            import gymnasium

            check_partial_reset(env, gymnasium.__version__)
        self.mode = autoreset_mode(env) if self.vector else "manual"
        self._bufs: list[Any] = [None, None]
        self._flip = 0
        # Sub-envs this driver steps and resets itself, one call each (a plain env; the sub-envs of an unwrapped
        # SyncVectorEnv): None where the vector env must do it (see "Stepping sub-envs" in docs/design/actor.md).
        self.sub_envs: list[Any] | None = None
        if not self.vector:
            self.sub_envs = [env]
        elif _steps_in_python(env):
            self.sub_envs = list(env.envs)
        E = self.num_envs
        self._rew = np.zeros(E, np.float64)
        self._term = np.zeros(E, bool)
        self._trunc = np.zeros(E, bool)

    def _own(self, o: Any) -> Any:
        """Copy ``o`` (batched) into the next of the driver's two buffers, and return that buffer."""
        self._flip ^= 1
        buf = self._bufs[self._flip]
        if buf is None:
            buf = self._bufs[self._flip] = tree_copy(o)
        elif _is_arr(buf):
            np.copyto(buf, o)
        else:
            for d, s in zip(optree.tree_leaves(buf), optree.tree_leaves(o), strict=True):
                np.copyto(d, s)
        return buf

    def reset(self, seed: int | None = None) -> Any:
        obs, _ = self.env.reset(seed=seed)
        return self._own(obs if self.vector else tree_batch1(obs))

    def step(self, action: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, Any]:
        """``(next_obs, reward, terminated, truncated, successor)``, each batched over sub-envs."""
        if not self.vector:
            a = tree_index(action, 0)
            o, r, te, tr, _ = self.env.step(a)
            rte, rtr = np.array([te], bool), np.array([tr], bool)
            if not (te or tr):
                nobs = self._own(tree_batch1(o))
                return nobs, np.array([r], np.float64), rte, rtr, nobs
            succ = tree_copy(tree_batch1(o))  # the reset below may write into the env's own observation
            o, _ = self.env.reset()
            return self._own(tree_batch1(o)), np.array([r], np.float64), rte, rtr, succ
        o, r, te, tr, info = self.env.step(action)
        te = np.asarray(te, bool)
        tr = np.asarray(tr, bool)
        done = te | tr
        if not done.any():
            nobs = self._own(o)
            return nobs, np.asarray(r), te, tr, nobs
        succ = tree_copy(o)  # same-step: the final rows go in below; next-step: the reset may overwrite o
        if self.mode == "same_step":
            final = info["final_obs"]  # gymnasium's info key (same-step autoreset), not shmbuf.layout.FINAL_OBS
            for e in np.flatnonzero(done):
                tree_set(succ, e, final[e])
            return self._own(o), np.asarray(r), te, tr, succ
        nobs, _ = self.env.reset(options={"reset_mask": done})
        return self._own(nobs), np.asarray(r), te, tr, succ

    def reset_some(self, mask: np.ndarray, obs: Any) -> Any:
        """Reset the sub-envs where ``mask`` (episodes cut by the actor); return ``obs`` with those rows replaced.

        The result is a driver buffer (see the class doc); ``obs`` is not changed.
        """
        if not self.vector:
            o, _ = self.env.reset()
            return self._own(tree_batch1(o))
        nobs, _ = self.env.reset(options={"reset_mask": np.asarray(mask, bool)})
        return self._own(nobs)

    # -- writing into the caller's buffer: the actor loop's hot path ---------------------------------------------

    def step_into(self, action: Any, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Step every sub-env and write what each returns into ``out`` (``(E, ...)``): one copy per observation byte.

        Returns ``(reward, terminated, truncated, ended, finals)``: ``ended`` the sub-envs whose episode
        ended (indices, ascending), already reset, their rows of ``out`` the first observation of the new
        episode; ``finals`` their final observations (``(len(ended), ...)``, the caller's). The three
        arrays of flags and rewards are the driver's, overwritten at the next call.
        Observations must be arrays (not dicts or tuples): :meth:`step` takes any observation.
        """
        envs = self.sub_envs
        if envs is None:
            return self._step_vector_into(action, out)
        rew, term, trunc = self._rew, self._term, self._trunc
        if len(envs) == 1 and not self.vector:
            o, r, te, tr, _ = envs[0].step(action[0])
            out[0] = o
            rew[0], term[0], trunc[0] = r, te, tr
        else:
            # The actions as SyncVectorEnv.step passes them (iterating the batched array); its per-step info merge,
            # concatenation and copy are skipped: each observation goes straight to its row. Rewards and flags go in
            # one store each (measured: half the overhead of three item stores per sub-env).
            res = [env.step(a) for env, a in zip(envs, action, strict=True)]
            for i, step in enumerate(res):
                out[i] = step[0]
            rew[:] = [step[1] for step in res]
            term[:] = [step[2] for step in res]
            trunc[:] = [step[3] for step in res]
        done = term | trunc
        if not np.count_nonzero(done):  # a C call; ndarray.any() goes through Python (numpy's _methods)
            return rew, term, trunc, _NONE, _NONE
        ended = np.flatnonzero(done)
        finals = out[ended]  # a copy (fancy indexing): the rows are overwritten by the resets below
        for i in ended.tolist():
            o, _ = envs[i].reset()
            out[i] = o
        return rew, term, trunc, ended, finals

    def _step_vector_into(self, action: Any, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                             np.ndarray]:
        """:meth:`step_into` through the vector env's own step and masked reset (an AsyncVectorEnv, a wrapped one)."""
        o, r, te, tr, info = self.env.step(action)
        rew, term, trunc = self._rew, self._term, self._trunc
        rew[:], term[:], trunc[:] = r, te, tr
        done = term | trunc
        if not done.any():
            out[...] = o
            return rew, term, trunc, _NONE, _NONE
        ended = np.flatnonzero(done)
        if self.mode == "same_step":
            final = info["final_obs"]  # gymnasium's info key (same-step autoreset), not shmbuf.layout.FINAL_OBS
            finals = np.stack([np.asarray(final[i]) for i in ended.tolist()]).astype(out.dtype, copy=False)
            out[...] = o
            return rew, term, trunc, ended, finals
        finals = np.array(o[ended], dtype=out.dtype)  # the reset below may write into the env's own observation
        nobs, _ = self.env.reset(options={"reset_mask": done})
        out[...] = nobs
        return rew, term, trunc, ended, finals

    def reset_rows_into(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Reset the sub-envs ``rows`` (indices: episodes the actor cut) and write their new observations into ``out``."""
        envs = self.sub_envs
        if envs is not None:
            for i in rows.tolist():
                o, _ = envs[i].reset()
                out[i] = o
            return
        mask = np.zeros(self.num_envs, bool)
        mask[rows] = True
        nobs, _ = self.env.reset(options={"reset_mask": mask})
        out[rows] = np.asarray(nobs)[rows]

    def close(self) -> None:
        self.env.close()


class SyncVectorOf:
    """A picklable env factory: a gymnasium ``SyncVectorEnv`` of the envs ``fns`` make (next-step autoreset, which
    the driver takes over: it steps an unwrapped SyncVectorEnv's sub-envs itself)."""

    def __init__(self, fns: tuple[Callable[[], Any], ...]):
        self.fns = fns

    def __call__(self) -> Any:
        import gymnasium

        return gymnasium.vector.SyncVectorEnv(list(self.fns), autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)

    def __repr__(self) -> str:
        return f"SyncVectorOf({len(self.fns)} envs)"


def split_among(env_fns: tuple[Callable[[], Any], ...], n: int, setting: str) -> tuple[SyncVectorOf, ...]:
    """``env_fns`` in ``n`` even shares, in order, each a factory of one ``SyncVectorEnv``; UsageError naming
    ``setting`` when they do not split evenly (every actor's rollouts hold the same number of envs)."""
    if len(env_fns) % n:
        raise UsageError(f"{setting}={n}: the {len(env_fns)} env factories must split evenly among the {n} processes "
                         f"(each one's rollouts hold the same number of envs); give a divisor of {len(env_fns)}")
    k = len(env_fns) // n
    return tuple(SyncVectorOf(tuple(env_fns[i * k : (i + 1) * k])) for i in range(n))


_NONE = np.zeros(0, np.int64)  # no sub-env ended: an empty index array (never written)


def _steps_in_python(env: Any) -> bool:
    """Can the driver step ``env``'s sub-envs itself, with the same transitions? An unwrapped ``SyncVectorEnv``:
    it steps them one by one in this process, and the driver does just that, minus the info merge and the copies.

    A subclass or a vector wrapper may change what a step does, and an AsyncVectorEnv steps in its workers: those
    are stepped through their own ``step``."""
    import gymnasium

    return type(env) is gymnasium.vector.SyncVectorEnv and isinstance(getattr(env, "envs", None), list)
