"""Complete-episodes rollouts written straight into each sub-env's slot: the actor loop's hot path for that mode.

In complete-episodes mode every sub-env has a writer of its own, and each rollout is one episode of one sub-env.
:class:`SlotEpisodes` serves :class:`workers.ActorLoop` there when observations and actions are arrays and there are
no view requirements (the test is :func:`workers._truncate.usable`, as for truncate-episodes rollouts). Per step: one
policy call and one vector step for all sub-envs (the driver writes the observations into the loop's own buffer),
then, per sub-env, one row store per step leaf into its writer's slot (the slot views are taken once per episode).
An ended episode's record, bootstrap and commit go straight into its slot: no dict is built per step and nothing is
added through ``Writer.add``.

The transitions are the general path's (``ActorLoop._complete``), bit for bit: the same flags (``ActorLoop._flags``),
the same episode records, bootstraps, fills and policy versions, committed in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuf import layout as L
from workers._truncate import OutputCheck, check_extras


class _Episode:
    """One sub-env's slot, as the views its episode is written through (taken when the episode starts)."""

    __slots__ = ("act", "boot", "env_steps", "extras", "obs", "rew", "table", "term", "trunc")

    def __init__(self, view: dict[str, Any]):
        st, bs = view[L.STEP], view[L.BOOTSTRAP]
        self.obs, self.act, self.rew = st[L.OBS], st[L.ACTION], st[L.REWARD]
        self.term, self.trunc = st[L.TERMINATED], st[L.TRUNCATED]
        self.extras = {k: v for k, v in st.items() if k not in L.STEP_KEYS}
        self.table = L.EpisodeTable(view[L.EPISODE])
        self.boot, self.env_steps = bs[L.OBS], bs[L.ENV_STEPS]


class SlotEpisodes:
    """Writes ``loop``'s complete-episodes rollouts into its writers' slots (see the module doc).

    ``cur``: the observations the next step acts on, ``(E, ...)``, the loop's own buffer; ``nxt``: where the driver
    writes the step's next observations (the two swap every step).
    """

    def __init__(self, loop: Any):
        self.loop = loop
        self.E = loop.E
        self.cur = np.array(loop.obs)
        self.nxt = np.empty_like(self.cur)
        self._slots: list[_Episode | None] = [None] * self.E
        self._check = OutputCheck()
        self._act_shape: tuple[int, ...] | None = None

    def _open(self, e: int) -> _Episode:
        """Sub-env ``e``'s slot for a new episode (waiting for a free one, as ``Writer.add`` does)."""
        ep = self._slots[e] = _Episode(self.loop.writers[e].slot())
        if self._act_shape is None:
            self._act_shape = (self.E, *ep.act.shape[1:])
        return ep

    def run(self, until: int | None) -> None:
        """Collect until ``loop.rollouts`` reaches ``until`` (None: until stopped)."""
        loop = self.loop
        E, driver, writers = self.E, loop.driver, loop.writers
        slots, check = self._slots, self._check
        ep_ret, ep_len, ep_version = loop.ep_ret, loop.ep_len, loop.ep_version
        ep_version[:] = loop.version
        envs = range(E)
        while until is None or loop.rollouts < until:
            if loop.should_stop():
                for w in writers:
                    w.reset()
                self._slots[:] = [None] * E
                return
            cur, nxt = self.cur, self.nxt
            rows = [s if s is not None else self._open(e) for e, s in enumerate(slots)]
            action, extras = loop._act(cur)
            assert self._act_shape is not None  # set by the first _open
            action = check(L.ACTION, action, self._act_shape, rows[0].act.dtype)
            if extras or rows[0].extras:
                check_extras(extras, rows[0].extras)
                extras = {k: check(k, v, (E, *rows[0].extras[k].shape[1:]), rows[0].extras[k].dtype)
                          for k, v in extras.items()}
            rew, term, trunc, ended, finals = driver.step_into(action, nxt)
            ep_ret += rew
            ep_len += 1
            loop.env_steps += E
            term, trunc, cut, _ = loop._flags(term, trunc)  # no soft limit in this mode (check_limits)
            lens = ep_len.tolist()
            for e in envs:
                s = rows[e]
                t = lens[e] - 1
                s.obs[t] = cur[e]
                s.act[t] = action[e]
                s.rew[t] = rew[e]
                s.term[t] = term[e]
                s.trunc[t] = trunc[e]
                for k, v in extras.items():
                    s.extras[k][t] = v[e]
            done = term | trunc
            if np.count_nonzero(done):  # a C call; ndarray.any() goes through Python (numpy's _methods)
                # Final observations: the env's for the episodes it ended (their rows of `nxt` are reset already),
                # the rows of `nxt` for the episodes the actor cuts (read before the reset below).
                final_of = dict(zip(ended.tolist(), finals, strict=True)) if len(ended) else {}
                for e in np.flatnonzero(done).tolist():
                    s = rows[e]
                    s.table.write(..., ep_ret[e], lens[e], term[e], trunc[e], e)
                    s.boot[...] = final_of[e] if e in final_of else nxt[e]
                    s.env_steps[...] = loop.env_steps
                    loop._before_commit(writers[e], {L.STEP: lens[e], L.EPISODE: 1})
                    writers[e].commit(int(ep_version[e]), fill={L.STEP: lens[e]})  # the oldest policy in the episode
                    slots[e] = None
                    loop.rollouts += 1
                    loop.episodes += 1
                if cut is not None:
                    driver.reset_rows_into(np.flatnonzero(cut), nxt)
                    loop.cut_episodes += int(cut.sum())
                ep_ret[done] = 0.0
                ep_len[done] = 0
                loop.update_weights()
                ep_version[done] = loop.version
            self.cur, self.nxt = nxt, cur
