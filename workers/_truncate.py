"""Truncate-episodes rollouts written straight into the writer's slot: the actor loop's hot path.

:class:`SlotRollouts` serves :class:`workers.ActorLoop` when the observations and actions are arrays
(the common case; a dict or tuple observation, or view requirements, take the loop's general path
through ``Writer.add``). Per step it makes one copy of each observation byte, from what the env
returns into the slot row the policy reads next (``EnvDriver.step_into``), and a few row stores:
the action, each extra, the reward and the flags. Episodes that end are written to the episode table
in one store per leaf, however many end. Nothing between steps is looked up again: the slot's views are
taken once per rollout. What it costs and what was measured: docs/design/actor.md.

The transitions are the general path's, bit for bit: the same flags (``ActorLoop._truncate_flags``), the same
episode records in the same order, the same bootstrap (the successor of the last step).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuf import SchemaError
from shmbuf import layout as L


def usable(loop: Any, slot: dict[str, Any]) -> bool:
    """Can ``loop`` write its rollouts through :class:`SlotRollouts`? Array observations and actions, no view
    requirements (the policy then gets the bare observation, a row of the slot)."""
    step = slot[L.STEP]
    return (loop.views is None and type(loop.obs) is np.ndarray and type(step[L.OBS]) is np.ndarray
            and type(step[L.ACTION]) is np.ndarray)


class OutputCheck:
    """Checks what the policy returns against the slot leaves it is stored into; remembers each dtype it passed."""

    def __init__(self) -> None:
        self._ok: set[Any] = set()  # (leaf, dtype) pairs checked against the slot's

    def __call__(self, name: str, got: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """``got`` as an array that a slot leaf of ``shape`` and ``dtype`` takes as it is: that shape, a dtype that
        casts to it (``same_kind``); else SchemaError naming the leaf, what was expected and what came."""
        a = got if type(got) is np.ndarray else np.asarray(got)
        if a.shape != shape:
            raise SchemaError(f"policy output '{name}': expected shape {shape} (one row per sub-env), got {a.shape}")
        key = (name, a.dtype)
        if key not in self._ok:
            if not np.can_cast(a.dtype, dtype, "same_kind"):
                raise SchemaError(f"policy output '{name}': expected dtype {dtype} (or one that casts to it "
                                  f"safely), got {a.dtype}")
            self._ok.add(key)
        return a


def check_extras(extras: dict[str, Any], leaves: Any) -> None:
    """SchemaError unless the policy's extras are the pipeline's extra step leaves, by name."""
    if extras.keys() != leaves.keys():
        raise SchemaError(f"policy extras: expected {sorted(leaves)} (the pipeline's step leaves), got {sorted(extras)}")


class SlotRollouts:
    """Writes ``loop``'s truncate-episodes rollouts into its writer's slots (see the module doc).

    ``carry``: the observation the next rollout starts from, ``(E, ...)``, the loop's own buffer (the
    slot it was read into is the reader's once committed).
    """

    def __init__(self, loop: Any):
        self.loop = loop
        self.E = loop.E
        self.carry = np.array(loop.obs)  # (E, ...): the driver's reset observation, batched
        self.obs_shape = self.carry.shape
        self._check = OutputCheck()

    def _rows(self, a: np.ndarray, lead: int) -> np.ndarray:
        """A slot leaf as ``(lead, E, ...)``: a single env's leaves have no env dim; add one (a view)."""
        return a.reshape((lead, 1, *a.shape[1:])) if self.loop.single else a

    def rollout(self) -> bool:
        """One rollout into the writer's slot, committed; False if the loop was asked to stop (nothing committed)."""
        loop = self.loop
        if loop.should_stop():  # before waiting for a slot: a stop asked meanwhile is not kept waiting
            return False
        w = loop.writers[0]
        driver = loop.driver
        T, E, M = loop.T, self.E, loop.max_episodes
        view = w.slot()  # the slot first, then the weights: what was published while this waited for it is taken
        loop.update_weights()
        st, bs = view[L.STEP], view[L.BOOTSTRAP]
        obs_s = self._rows(st[L.OBS], T)
        act_s, rew_s = self._rows(st[L.ACTION], T), self._rows(st[L.REWARD], T)
        term_s, trunc_s = self._rows(st[L.TERMINATED], T), self._rows(st[L.TRUNCATED], T)
        extra_s = {k: self._rows(v, T) for k, v in st.items() if k not in L.STEP_KEYS}
        table = L.EpisodeTable(view[L.EPISODE])
        final_obs = table.final_obs  # (M, ...): an array, as the observations are (see usable)
        assert final_obs is not None  # a truncate-episodes table has one
        carry = self.carry
        obs_s[0] = carry
        ep_ret, ep_len = loop.ep_ret, loop.ep_len
        n_ep = 0
        last_ends: np.ndarray | None = None  # the sub-envs whose episode ended at the rollout's last step
        t = 0
        for t in range(T):
            if loop.should_stop():
                w.reset()
                return False
            action, extras = loop._act(obs_s[t])
            act_s[t] = self._check(L.ACTION, action, act_s.shape[1:], act_s.dtype)
            if extras or extra_s:
                check_extras(extras, extra_s)
                for k, dst in extra_s.items():
                    dst[t] = self._check(k, extras[k], dst.shape[1:], dst.dtype)
            nxt = obs_s[t + 1] if t + 1 < T else carry
            rew, term, trunc, ended, finals = driver.step_into(action, nxt)
            ep_ret += rew
            ep_len += 1
            loop.env_steps += E
            term, trunc, cut, soft, last = loop._truncate_flags(t, n_ep, term, trunc)
            rew_s[t] = rew
            term_s[t] = term
            trunc_s[t] = trunc
            done = term | trunc
            ends = done if soft is None else done | soft
            last_ends = None
            if np.count_nonzero(ends):  # a C call; ndarray.any() goes through Python (numpy's _methods)
                idx = np.flatnonzero(ends)
                k = len(idx)
                # Final observations: the env's, for the episodes it ended (those rows of `nxt` are reset already);
                # the rows of `nxt` for the episodes the actor ends (cut: reset below) or marks (soft: not reset).
                table.write(slice(n_ep, n_ep + k), ep_ret[idx], ep_len[idx], term[idx], trunc[idx], idx, t,
                            finals if len(ended) == k else nxt[idx])
                if 0 < len(ended) < k:
                    final_obs[n_ep + np.searchsorted(idx, ended)] = finals
                last_ends = idx
                n_ep += k
                loop.episodes += k
                ep_ret[ends] = 0.0
                ep_len[ends] = 0
            if soft is not None:
                loop.soft_horizons += int(soft.sum())
            if cut is not None:
                driver.reset_rows_into(np.flatnonzero(cut), nxt)
                loop.cut_episodes += int(cut.sum())
            if (last or n_ep + E > M) and t < T - 1:
                break  # the next step could overflow the episode table: commit short
        # The bootstrap: the successor of the last step (an ended episode's final observation), and the next
        # rollout starts from the observation after it.
        nxt = obs_s[t + 1] if t + 1 < T else carry
        boot = bs[L.OBS].reshape(self.obs_shape)
        boot[...] = nxt
        if last_ends is not None:
            k = len(last_ends)
            boot[last_ends] = final_obs[n_ep - k : n_ep]
        if nxt is not carry:
            carry[...] = nxt
        bs[L.ENV_STEPS][...] = loop.env_steps
        fill = {L.STEP: t + 1, L.EPISODE: n_ep}
        loop._before_commit(w, fill)
        w.commit(loop.version, fill=fill)
        loop.rollouts += 1
        return True
