"""Multi-agent collection: PettingZoo parallel envs, each policy's agents as the rows of its rollouts.

A PettingZoo ``ParallelEnv`` steps every live agent at once and speaks in dicts keyed by agent id; agents may
join and leave mid-episode. A policy mapping (RLlib's ``policy_mapping_fn``) sends each agent id to a policy
id, and each policy gets a pipeline of its own, laid out from its own spaces (:func:`multiagent_examples`),
so that agents of different shapes never share a slot layout.

**Rows.** Every ``(env, agent)`` pair of ``possible_agents`` has a fixed row in its policy's rollouts
(:class:`AgentRows`): a policy's rollout is the truncate-episodes layout of :mod:`shmbuf.layout` with its
rows in place of sub-envs, ``(T, K, ...)`` for ``K`` rows, plus the step leaf :data:`VALID` (bool): the row's
agent acted at that step. An agent's transitions are therefore contiguous in time in its row; an agent that
leaves ends its stream there (an episode record with its own return, length, flags, final observation and
``env`` = the row); one that joins starts its stream at the next step (its row holds zeros and ``valid``
False while it is away). When an env's last agent leaves, the env is reset and its agents start new streams.
The bootstrap of a row is the successor of its last stored step, as for a sub-env. An agent's observation is an
array, or a dict or tuple of arrays (a Dict or Tuple space, e.g. PettingZoo classic's ``observation`` + ``action_mask``):
its policy's rows are then a tree of the same structure, and the policy is called with it (see
:mod:`workers._agent_obs`).

**Counting** (``count_by``, RLlib's ``count_steps_by``): with ``"env_steps"`` a rollout is ``rollout_len`` env steps; with
``"agent_steps"`` it ends after the env step at which the agent steps of all policies together reach
``rollout_len`` (RLlib's check, made after each env step, so it may go over by one step's agents). Every
policy's rollout of a round covers the same env steps, and every policy commits one rollout per round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import optree

from shmbuf import SchemaError, UsageError
from shmbuf import layout as L
from workers._agent_obs import obs_example, put, space_example, take
from workers._agent_rows import AgentRows, Episode, ParallelDriver, agents_of
from workers._policy import apply_weights, as_numpy_policy, split_policy_output
from workers._truncate import OutputCheck, check_extras
from workers._views import ActorViews, check_view_requirements
from workers.compat import rllib
from workers.compat._rllib_multiagent import MultiAgentPostprocessor

ENV_STEPS_COUNT = "env_steps"
AGENT_STEPS_COUNT = "agent_steps"
COUNT_STEPS_BY = (ENV_STEPS_COUNT, AGENT_STEPS_COUNT)


def multiagent_examples(envs: Sequence[Any], policies: dict[Any, Any], policy_mapping_fn: Callable[..., Any] | None,
                        *, rollout_len: int, seed: int | None = None, batch_mode: str = L.TRUNCATE_EPISODES,
                        extra_leaves: dict[str, Any] | None = None,
                        view_requirements: dict[Any, Any] | None = None,
                        remap_each_episode: bool = False) -> tuple[dict[Any, Any], AgentRows]:
    """Each policy's rollout example (schema) and the rows, from one reset of ``envs`` and one call of each policy.

    Truncate-episodes: :func:`shmbuf.layout.rollout_example` with ``num_envs`` = the policy's rows and the
    :data:`VALID` step leaf. Complete-episodes: one agent's episode per rollout, the single-env
    complete-episodes layout (every stored step is valid). ``extra_leaves``: step leaves every policy's
    rollouts get besides the policy's extras (one item each, e.g. the served policies' ``policy_version``).
    ``view_requirements``: ``{policy_id: {name: ViewRequirement}}``: those policies are probed with the input
    dict of an episode's first step, as the loop will call them. ``remap_each_episode``: the mapping is RLlib's
    per-episode one, every policy has a row for every ``(env, agent)`` (see :class:`workers._agent_rows.AgentRows`),
    and each policy is laid out from an agent the mapping sends to it (in the first of :data:`PROBE_EPISODES`
    episodes that sends one; else from the first agent).
    Raises UsageError for a policy id the mapping names that ``policies`` lacks (or the other way round),
    SchemaError for extras that clash with the layout.
    """
    L.check_batch_mode(batch_mode)
    agents = agents_of(envs[0])
    rows = AgentRows(agents, len(envs), policy_mapping_fn, remap_ids=list(policies) if remap_each_episode else None)
    missing = sorted(map(str, set(rows.policies) - set(policies)))
    if missing:
        raise UsageError(f"policies: policy_mapping_fn maps agents to {missing}, which policies= does not have "
                         f"(it has {sorted(map(str, policies))})")
    unused = sorted(map(str, set(policies) - set(rows.policies)))
    if unused:
        raise UsageError(f"policies: {unused} get no agent from policy_mapping_fn (agents: "
                         f"{dict((str(a), str(p)) for a, p in rows.policy_of.items())})")
    first: dict[Any, Any] = {}  # each policy's observation example: an array, or a dict or tuple of them
    for i, env in enumerate(envs):
        obs, _ = env.reset(seed=None if seed is None else seed + i)
        for agent, o in obs.items():
            pid = rows.where[(i, agent)][0]
            if pid not in first:
                first[pid] = obs_example(o, f"envs[{i}]: agent {agent!r} (policy {pid!r})",
                                         partial(env.observation_space, agent))
    examples = {}
    for pid, agent_rows in rows.policies.items():
        env_i, agent = agent_rows[0] if not rows.remap else (0, _probe_agent(rows, agents, pid))
        if pid not in first:  # none of its agents is there at the reset: laid out from one's space
            first[pid] = space_example(envs[env_i].observation_space(agent), f"envs[{env_i}]: agent {agent!r} "
                                       f"(policy {pid!r}, absent at the first reset)")
        x: Any = optree.tree_map(lambda a: a[None], first[pid])
        reqs = (view_requirements or {}).get(pid)
        if reqs is not None:
            x = ActorViews(reqs, x, 1, envs[env_i].action_space(agent)).inputs()
        action, extras = split_policy_output(as_numpy_policy(policies[pid])(x))
        action = np.asarray(action)
        if L.VALID in extras:
            raise SchemaError(f"policy {pid!r}: the extra '{L.VALID}' clashes with the multi-agent step leaf of that name")
        ex = {k: np.array(np.asarray(v)[0]) for k, v in extras.items()}
        for k, v in (extra_leaves or {}).items():
            if k in ex:
                raise UsageError(f"policy {pid!r} returns an extra named {k!r}, which the collector stores itself; "
                                 "rename it")
            ex[k] = v
        if batch_mode == L.COMPLETE_EPISODES:
            examples[pid] = L.rollout_example(first[pid], np.array(action[0]), rollout_len=rollout_len, extras=ex,
                                            batch_mode=L.COMPLETE_EPISODES)
            continue
        ex[L.VALID] = np.zeros((), bool)
        examples[pid] = L.rollout_example(first[pid], np.array(action[0]), rollout_len=rollout_len,
                                        num_envs=len(agent_rows), extras=ex)
    return examples, rows


PROBE_EPISODES = 64  # (per-episode mapping) episodes the mapping is asked about, to lay each policy out from its agents


def _probe_agent(rows: AgentRows, agents: list[Any], pid: Any) -> Any:
    """(Per-episode mapping) An agent the mapping sends to ``pid`` in one of the first probe episodes; else the first."""
    for k in range(PROBE_EPISODES):
        for agent in agents:
            if rows.episode_mapping(agent, Episode(0, k, k)) == pid:
                return agent
    return agents[0]


class _PolicyRollout:
    """One policy's slot in a round, as the views the loop writes through."""

    def __init__(self, view: dict[str, Any]):
        st, bs = view[L.STEP], view[L.BOOTSTRAP]
        self.obs, self.act, self.rew = st[L.OBS], st[L.ACTION], st[L.REWARD]
        self.term, self.trunc, self.valid = st[L.TERMINATED], st[L.TRUNCATED], st.get(L.VALID)
        self.extras = {k: v for k, v in st.items() if k not in L.STEP_KEYS and k != L.VALID}
        self.table = L.EpisodeTable(view[L.EPISODE])
        self.boot, self.env_steps = bs[L.OBS], bs[L.ENV_STEPS]
        self.n_ep = 0
        self.last_ends: list[int] = []


class MultiAgentLoop:
    """Drives PettingZoo parallel envs with one policy per policy id, writing each policy's rollouts through its
    own :class:`shmbuf.Writer` (see the module doc).

    Args:
        envs: a ParallelEnv or a list of them (several envs per actor), each with the same ``possible_agents``.
        policies: ``{policy_id: policy}``, each a callable ``obs -> action`` or ``-> (action, extras)`` on the
            batch of its live agents' observations (``(n, ...)``), or a torch module (see :class:`ActorLoop`).
            Each is called once per env step, over all its live agents of all envs.
        writers: ``{policy_id: Writer}`` on each policy's pipeline (:func:`multiagent_examples`);
            complete-episodes: ``{policy_id: [Writer, ...]}``, one per row of the policy.
        rollout_len: env steps (or, counting agent steps, agent steps) per rollout; the pipelines' T.
            Complete-episodes: the most steps an agent's episode may take (a longer one is a UsageError:
            an agent cannot be reset alone, so its episode cannot be cut as a sub-env's is).
        batch_mode: ``"truncate_episodes"`` (rounds of T env steps, every row of every policy) or
            ``"complete_episodes"`` (each rollout one agent's whole episode, committed when it ends).
        policy_mapping_fn: agent id -> policy id (RLlib's, see :func:`workers._agent_rows.mapping_of`); None: one policy,
            ``"default_policy"``.
        count_by: ``"env_steps"`` or ``"agent_steps"`` (RLlib's ``count_steps_by``, accepted under that name).
        weights: ``{policy_id: WeightSubscriber}`` for the policies whose weights are broadcast, polled at round
            boundaries (see :func:`workers.ActorLoop`'s ``weights``); each policy's rollouts carry its own version.
        should_stop: checked every step; a partial round is then dropped.
        every_row: call each policy on all its rows, live or not (an agent away has zeros), not only on the live
            ones: what a policy answered by an inference server needs (its request has a fixed shape).
        view_requirements: ``{policy_id: {name: ViewRequirement}}`` (RLlib's per-policy view requirements):
            those policies are called with a dict of views of their agents' streams instead of the bare
            observations (see :class:`workers.ActorViews`; rows in place of sub-envs, one agent's stream per
            row: an agent that joins starts with zeros behind it).
        episode_hook: (RLlib's ``postprocess``, accepted under that name) ``{policy_id: PostprocessSpec}``
            (:func:`workers.compat.rllib.discover_policies`; ``MultiAgentCollector(episode_hook=...)`` makes it):
            RLlib's ``postprocess_trajectory`` with
            ``other_agent_batches`` on every agent's episode pieces before a round's commits (complete-episodes:
            on every agent episode of an env episode when it is over, before their commits), its added columns
            written into the slots (see
            workers/compat/_rllib_multiagent.py).
        remap_each_episode: call ``policy_mapping_fn(agent_id, episode)`` at every env's episode start, as RLlib does
            (``episode`` a :class:`workers.lowlevel.Episode`), instead of once per agent id: every policy has a
            row for every ``(env, agent)``, and an agent's steps of an episode go to the row of the policy it was
            mapped to for that episode (its rows in the other policies are not valid meanwhile).

    A policy without a broadcast that knows which weights version answered it (``policy_version``, as
    :class:`workers.RemotePolicy` has) stamps its rollouts with that version.
    """

    def __init__(self, envs: Any, policies: dict[Any, Any], writers: dict[Any, Any], *, rollout_len: int,
                 policy_mapping_fn: Callable[..., Any] | None = None, count_by: str = ENV_STEPS_COUNT,
                 seed: int | None = None, weights: dict[Any, Any] | None = None,
                 should_stop: Callable[[], bool] | None = None, batch_mode: str = L.TRUNCATE_EPISODES,
                 every_row: bool = False, view_requirements: dict[Any, Any] | None = None,
                 episode_hook: dict[Any, Any] | None = None, remap_each_episode: bool = False, **rllib_names: Any):
        L.check_batch_mode(batch_mode)
        self.mode = batch_mode
        self.every_row = every_row
        names: dict[str, str] = {}
        given = rllib.translate(rllib_names, rllib.ALIASES, names, framework="RLlib")
        for k, v in given.items():  # RLlib's count_steps_by and postprocess
            if k == "count_by" and count_by == ENV_STEPS_COUNT:
                count_by = v
            elif k == "episode_hook" and episode_hook is None:
                episode_hook = v
            else:
                raise UsageError(f"MultiAgentLoop({names.get(k, k)}=...): not a setting of MultiAgentLoop, or given twice")
        if count_by not in COUNT_STEPS_BY:
            raise UsageError(f"{names.get('count_by', 'count_by')}: expected one of {COUNT_STEPS_BY}, got {count_by!r}")
        self.envs = list(envs) if isinstance(envs, (list, tuple)) else [envs]
        if not self.envs:
            raise UsageError("envs: expected a PettingZoo ParallelEnv or a list of them, got an empty list")
        self.rows = AgentRows(agents_of(self.envs[0]), len(self.envs), policy_mapping_fn,
                              remap_ids=list(policies) if remap_each_episode else None)
        if set(writers) != set(self.rows.policies) or set(policies) != set(self.rows.policies):
            want = sorted(map(str, self.rows.policies))
            raise UsageError(f"policies and writers: expected one of each for the policies {want}, got policies "
                             f"{sorted(map(str, policies))} and writers {sorted(map(str, writers))}")
        if batch_mode == L.COMPLETE_EPISODES:
            for pid, ws in writers.items():
                n_rows = len(self.rows.policies[pid])
                if not isinstance(ws, (list, tuple)) or len(ws) != n_rows:
                    raise UsageError(f"writers[{pid!r}]: complete-episodes rollouts need one writer per row of the policy "
                                     f"({n_rows}: {self.rows.policies[pid]}), got {ws!r:.80}")
        self.view_requirements = dict(view_requirements or {})
        unknown_vr = sorted(map(str, set(self.view_requirements) - set(self.rows.policies)))
        if unknown_vr:
            raise UsageError(f"view_requirements: keyed by policy id; {unknown_vr} are not policies of this loop "
                             f"({sorted(map(str, self.rows.policies))})")
        for reqs in self.view_requirements.values():
            check_view_requirements(reqs)
        self._views: dict[Any, ActorViews] = {}
        self.driver = ParallelDriver(self.envs, self.rows, seed)
        self.policies = policies
        self._calls = {pid: as_numpy_policy(p) for pid, p in policies.items()}
        self.postprocess = None
        if episode_hook:  # the hooks' added columns are zeros until the hooks fill them before the commits
            self.postprocess = MultiAgentPostprocessor(episode_hook, policies, self.rows, batch_mode=batch_mode)
            self._calls = self.postprocess.wrap(self._calls)
        self.writers = writers
        self.T = rollout_len
        self.count_agent_steps = count_by == AGENT_STEPS_COUNT
        self.should_stop = should_stop or (lambda: False)
        self.weights = dict(weights or {})
        unknown = sorted(map(str, set(self.weights) - set(self.rows.policies)))
        if unknown:
            raise UsageError(f"weights: {unknown} are not policies of this loop ({sorted(map(str, self.rows.policies))})")
        self.versions = dict.fromkeys(self.rows.policies, 0)
        self.env_steps = 0
        self.agent_steps = 0
        self.rounds = 0
        self.episodes = 0
        self._check = OutputCheck()
        self._cur: dict[Any, Any] | None = None  # each policy's rows of observations: an array, or a tree of them
        self._seed = seed

    def _buffers(self, slots: dict[Any, _PolicyRollout], rows: dict[Any, int], lead: int) -> None:
        """The loop's own buffers, shaped from the first slots (their leaves have ``lead`` leading dims, 2 for a
        round's ``(T, K)``, 1 for one agent's episode): observations and liveness (current and next), actions and
        extras, rewards, flags, episode returns and lengths per row."""
        def per_row(a: np.ndarray, k: int) -> np.ndarray:
            return np.zeros((k, *a.shape[lead:]), a.dtype)

        # observations: an array per policy, or a tree of them (a Dict or Tuple space, see workers._agent_obs)
        cur: dict[Any, Any] = {pid: optree.tree_map(partial(per_row, k=rows[pid]), s.obs) for pid, s in slots.items()}
        self._cur = cur
        self._nxt = {pid: optree.tree_map(np.zeros_like, a) for pid, a in cur.items()}
        self._act = {pid: per_row(s.act, rows[pid]) for pid, s in slots.items()}
        self._ext = {pid: {k: per_row(v, rows[pid]) for k, v in s.extras.items()} for pid, s in slots.items()}
        self._valid = {pid: np.zeros(k, bool) for pid, k in rows.items()}
        self._nvalid = {pid: np.zeros(k, bool) for pid, k in rows.items()}
        self._rew = {pid: np.zeros(k, np.float64) for pid, k in rows.items()}
        self._term = {pid: np.zeros(k, bool) for pid, k in rows.items()}
        self._trunc = {pid: np.zeros(k, bool) for pid, k in rows.items()}
        self.ep_ret = {pid: np.zeros(k, np.float64) for pid, k in rows.items()}
        self.ep_len = {pid: np.zeros(k, np.int64) for pid, k in rows.items()}
        self.driver.reset(self._seed, self._cur, self._valid)
        for pid, reqs in self.view_requirements.items():
            env_i, agent = self.rows.policies[pid][0]
            self._views[pid] = ActorViews(reqs, self._cur[pid], rows[pid], self.envs[env_i].action_space(agent))

    def _advance_views(self) -> None:
        """Record the step just taken in each policy's views (rows in place of sub-envs), then the next observations."""
        for pid, views in self._views.items():
            views.advance(self._act[pid], self._ext[pid], self._rew[pid].astype(np.float32), self._term[pid],
                          self._trunc[pid], self._nxt[pid])

    def update_weights(self) -> None:
        """Give each policy with a broadcast its newest weights, if newer ones were published; a policy without one
        that knows the version of its last answer (``policy_version``) stamps rollouts with that."""
        for pid, sub in self.weights.items():
            got = sub.poll()
            if got is not None:
                version, params = got
                apply_weights(self.policies[pid], params)
                self.versions[pid] = version
        for pid, policy in self.policies.items():
            v = getattr(policy, "policy_version", None) if pid not in self.weights else None
            if v is not None and v > self.versions[pid]:
                self.versions[pid] = int(v)

    def run(self, max_rounds: int | None = None) -> int:
        """Collect until ``max_rounds`` more rounds (one rollout per policy each; complete-episodes: agent episodes,
        one rollout each) were committed (None: until stopped); return how many."""
        start = self.rounds
        if self.mode == L.COMPLETE_EPISODES:
            self._complete(None if max_rounds is None else start + max_rounds)
            return self.rounds - start
        while max_rounds is None or self.rounds - start < max_rounds:
            if not self._round():
                break
        return self.rounds - start

    def _act_policy(self, pid: Any, obs: Any, valid: np.ndarray, n_live: int | None = None) -> None:
        """Call policy ``pid`` once on its live rows (``n_live`` of them, if the caller counted them): their actions
        and extras into the loop's buffers (``_act``, ``_ext``), zeros in the other rows."""
        act, ext = self._act[pid], self._ext[pid]
        k = len(valid)
        if n_live is None:
            n_live = int(np.count_nonzero(valid))
        every = self.every_row or n_live == k
        if not every:  # rows of agents away hold zeros
            act[...] = 0
            for dst in ext.values():
                dst[...] = 0
            if not n_live:
                return
        n = k if every else n_live
        views = self._views.get(pid)
        x: Any = obs if views is None else views.inputs()
        if not every:
            live = np.flatnonzero(valid)
            x = take(x, live) if views is None else {name: take(v, live) for name, v in x.items()}
        action, extras = split_policy_output(self._calls[pid](x))
        a = self._check(f"{pid}/{L.ACTION}", action, (n, *act.shape[1:]), act.dtype)
        if every:
            act[...] = a
        else:
            act[live] = a
        if extras or ext:
            check_extras(extras, ext)
            for name, dst in ext.items():
                v = self._check(f"{pid}/{name}", extras[name], (n, *dst.shape[1:]), dst.dtype)
                if every:
                    dst[...] = v
                else:
                    dst[live] = v
        if self.every_row and n_live < k:  # the rows of agents away keep zeros, as without a server
            away = ~valid
            act[away] = 0
            for dst in ext.values():
                dst[away] = 0

    def _round(self) -> bool:
        """One rollout per policy, committed; False if the loop was asked to stop (nothing committed)."""
        if self.should_stop():
            return False
        slots = {pid: _PolicyRollout(w.slot()) for pid, w in self.writers.items()}
        self.update_weights()  # after the slots: what was published while this waited for them is taken
        if self._cur is None:
            self._buffers(slots, {pid: len(rows) for pid, rows in self.rows.policies.items()}, 2)
        assert self._cur is not None  # set just above
        steps_here = 0
        t = 0
        for t in range(self.T):
            if self.should_stop():
                for w in self.writers.values():
                    w.reset()
                return False
            cur, nxt, valid, nvalid = self._cur, self._nxt, self._valid, self._nvalid
            live = {}
            for pid, s in slots.items():
                v = valid[pid]
                live[pid] = n = int(np.count_nonzero(v))
                o = cur[pid]
                if type(o) is np.ndarray:  # the common case, without a call
                    s.obs[t] = o
                else:  # a Dict or Tuple observation: leaf by leaf
                    put(s.obs, t, o)
                s.valid[t] = v
                self._act_policy(pid, cur[pid], v, n)
                s.act[t] = self._act[pid]
                for k, dst in s.extras.items():
                    dst[t] = self._ext[pid][k]
            finals = self.driver.step(self._act, valid, nxt, nvalid, self._rew, self._term, self._trunc)
            self.env_steps += len(self.envs)
            if self._views:
                self._advance_views()
            for pid, s in slots.items():
                n = live[pid]
                steps_here += n
                self.agent_steps += n
                rew, term, trunc = self._rew[pid], self._term[pid], self._trunc[pid]
                s.rew[t] = rew
                s.term[t] = term
                s.trunc[t] = trunc
                ep_ret, ep_len = self.ep_ret[pid], self.ep_len[pid]
                if n == len(rew):  # every row acted: no gather
                    ep_ret += rew
                    ep_len += 1
                else:
                    v = valid[pid]
                    ep_ret[v] += rew[v]
                    ep_len[v] += 1
                ends = finals[pid]
                s.last_ends = sorted(ends) if ends else []
                for row in s.last_ends:
                    s.table.write(s.n_ep, ep_ret[row], ep_len[row], term[row], trunc[row], row, t, ends[row])
                    s.n_ep += 1
                    ep_ret[row] = 0.0
                    ep_len[row] = 0
                self.episodes += len(s.last_ends)
            self._cur, self._nxt, self._valid, self._nvalid = nxt, cur, nvalid, valid
            if self.count_agent_steps and steps_here >= self.T:
                break
        for pid, s in slots.items():
            s.valid[t + 1 :] = False  # a round ended early (agent steps): no row past the fill is valid, whatever the
            # slot held before (a reused slot keeps an older rollout's rows, and a loss masks by valid)
            put(s.boot, ..., self._cur[pid])  # the next observations: each live row's successor of its last step
            if s.last_ends:  # rows whose stream ended at the last step: their final observations
                k = len(s.last_ends)
                put(s.boot, s.last_ends, take(s.table.final_obs, slice(s.n_ep - k, s.n_ep)))
            s.env_steps[...] = self.env_steps
        if self.postprocess is not None:  # every policy's hooks, with the other agents' data, before any commit
            self.postprocess.apply_round({pid: w.slot() for pid, w in self.writers.items()},
                                         {pid: {L.STEP: t + 1, L.EPISODE: s.n_ep} for pid, s in slots.items()})
        for pid, s in slots.items():
            self.writers[pid].commit(self.versions[pid], fill={L.STEP: t + 1, L.EPISODE: s.n_ep})
        self.rounds += 1
        return True

    # -- complete-episodes: one agent's episode per rollout ------------------------------------------------------

    def _complete(self, until: int | None) -> None:
        """Agent episodes, each written into its row's writer's slot as it goes and committed when it ends."""
        rows = {pid: len(r) for pid, r in self.rows.policies.items()}
        open_: dict[Any, list[_PolicyRollout | None]] = {pid: [None] * k for pid, k in rows.items()}
        if self._cur is None:
            first = {pid: _PolicyRollout(ws[0].slot()) for pid, ws in self.writers.items()}
            for ws in self.writers.values():
                ws[0].reset()  # the slot stays claimed for its row's first episode; nothing was written
            self._buffers(first, rows, 1)
        assert self._cur is not None  # set just above
        self.update_weights()
        ep_version = {pid: np.full(k, self.versions[pid], np.int64) for pid, k in rows.items()}
        # With a postprocess hook, ended agent episodes are held until their env's episode is over (the hooks then
        # see one another's): per env, [(policy, row, steps)], and each row's first env step within its env episode.
        hold = self.postprocess is not None
        held: dict[int, list[tuple[Any, int, int]]] = {i: [] for i in range(len(self.envs))}
        env_t = [0] * len(self.envs)
        first_t = {pid: np.zeros(k, np.int64) for pid, k in rows.items()}

        def release(i: int) -> None:
            """Postprocess env ``i``'s held agent episodes together, then commit them."""
            eps = held[i]
            assert self.postprocess is not None  # held only with a hook
            self.postprocess.apply_env_episode([(pid, self.rows.policies[pid][row][1], self.writers[pid][row].slot(), n,
                                                 int(first_t[pid][row])) for pid, row, n in eps])
            for pid, row, n in eps:
                self.writers[pid][row].commit(int(ep_version[pid][row]), fill={L.STEP: n})
                self.rounds += 1
            held[i] = []

        while until is None or self.rounds < until:
            if self.should_stop():
                for ws in self.writers.values():
                    for w in ws:
                        w.reset()
                return
            cur, nxt, valid, nvalid = self._cur, self._nxt, self._valid, self._nvalid
            for pid in rows:
                self._act_policy(pid, cur[pid], valid[pid])
            finals = self.driver.step(self._act, valid, nxt, nvalid, self._rew, self._term, self._trunc)
            self.env_steps += len(self.envs)
            self._advance_views()
            for pid, slots in open_.items():
                v = valid[pid]
                live = np.flatnonzero(v).tolist()
                self.agent_steps += len(live)
                rew, term, trunc, act, ext = self._rew[pid], self._term[pid], self._trunc[pid], self._act[pid], self._ext[pid]
                ep_ret, ep_len = self.ep_ret[pid], self.ep_len[pid]
                ep_ret[v] += rew[v]
                ep_len[v] += 1
                for row in live:
                    s = slots[row]
                    if s is None:  # the agent's episode starts: its rollout carries the version acting now
                        env_i = self.rows.policies[pid][row][0]
                        if hold and any(p == pid and r == row for p, r, _ in held[env_i]):
                            release(env_i)  # back in the same env episode: its last episode's slot is committed first
                        s = slots[row] = _PolicyRollout(self.writers[pid][row].slot())
                        ep_version[pid][row] = self.versions[pid]
                        first_t[pid][row] = env_t[env_i]
                    t = int(ep_len[row]) - 1
                    if t >= self.T or (t == self.T - 1 and row not in finals[pid]):
                        env_i, agent = self.rows.policies[pid][row]
                        raise UsageError(f"envs[{env_i}]: the episode of agent {agent!r} outlasted rollout_len={self.T}: "
                                         "complete-episodes rollouts hold an agent's whole episode, and an agent cannot "
                                         "be reset alone to cut it; give a rollout_len of at least its longest episode "
                                         "(the env's max_cycles), or use batch_mode='truncate_episodes'")
                    put(s.obs, t, take(cur[pid], row))
                    s.act[t] = act[row]
                    s.rew[t] = rew[row]
                    s.term[t] = term[row]
                    s.trunc[t] = trunc[row]
                    for k, dst in s.extras.items():
                        dst[t] = ext[k][row]
                for row in sorted(finals[pid]):
                    s = slots[row]
                    assert s is not None  # the row acted at this step: opened above
                    s.table.write(..., ep_ret[row], ep_len[row], term[row], trunc[row], row)
                    put(s.boot, ..., finals[pid][row])
                    s.env_steps[...] = self.env_steps
                    if hold:
                        held[self.rows.policies[pid][row][0]].append((pid, row, int(ep_len[row])))
                    else:
                        self.writers[pid][row].commit(int(ep_version[pid][row]), fill={L.STEP: int(ep_len[row])})
                        self.rounds += 1
                    slots[row] = None
                    ep_ret[row] = 0.0
                    ep_len[row] = 0
                    self.episodes += 1
            for i in range(len(self.envs)):
                if i in self.driver.reset_envs:  # its episode is over: every agent of it has ended
                    env_t[i] = 0
                    if held[i]:
                        release(i)
                else:
                    env_t[i] += 1
            self._cur, self._nxt, self._valid, self._nvalid = nxt, cur, nvalid, valid
            if any(finals.values()):
                self.update_weights()  # at episode ends, as the single-agent complete-episodes loop does
