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
The bootstrap of a row is the successor of its last stored step, as for a sub-env.

**Counting** (RLlib's ``count_steps_by``): with ``"env_steps"`` a rollout is ``rollout_len`` env steps; with
``"agent_steps"`` it ends after the env step at which the agent steps of all policies together reach
``rollout_len`` (RLlib's check, made after each env step, so it may go over by one step's agents). Every
policy's rollout of a round covers the same env steps, and every policy commits one rollout per round.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shmbuf import SchemaError, UsageError
from shmbuf.layout import (
    ACTION,
    BOOTSTRAP,
    END,
    ENV,
    ENV_STEPS,
    EPISODE,
    FINAL_OBS,
    LENGTH,
    OBS,
    RETURN,
    REWARD,
    STEP,
    TERMINATED,
    TRUNCATED,
    VALID,
    rollout_example,
)
from workers._actor import apply_weights, as_numpy_policy, split_policy_output
from workers._truncate import OutputCheck, check_extras

ENV_STEPS_COUNT = "env_steps"
AGENT_STEPS_COUNT = "agent_steps"
COUNT_STEPS_BY = (ENV_STEPS_COUNT, AGENT_STEPS_COUNT)


def mapping_of(policy_mapping_fn: Callable[..., Any] | None) -> Callable[[Any], Any]:
    """A policy mapping as a function of the agent id alone.

    RLlib's ``policy_mapping_fn(agent_id, episode, **kwargs)`` is called with ``episode=None``: the mapping is
    decided once per agent id (each agent's row is fixed), not per episode. None maps every agent to
    ``"default_policy"`` (RLlib's default policy id).
    """
    if policy_mapping_fn is None:
        return lambda agent: "default_policy"
    if not callable(policy_mapping_fn):
        raise UsageError(f"policy_mapping_fn: expected a function of the agent id, got {policy_mapping_fn!r}")
    try:
        params = inspect.signature(policy_mapping_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with the agent id alone
        return policy_mapping_fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(positional) >= 2:
        return lambda agent: policy_mapping_fn(agent, None)
    return policy_mapping_fn


class AgentRows:
    """The fixed row of every ``(env, agent)`` in its policy's rollouts (see the module doc).

    ``policies``: ``{policy_id: [(env_index, agent_id), ...]}``, each list in row order (env by env, agents
    in ``possible_agents`` order); ``where``: ``{(env_index, agent_id): (policy_id, row)}``.
    """

    def __init__(self, possible_agents: Sequence[Any], num_envs: int, policy_mapping_fn: Callable[..., Any] | None):
        if not possible_agents:
            raise UsageError("possible_agents: expected the env's agent ids (PettingZoo's env.possible_agents), got none")
        mapping = mapping_of(policy_mapping_fn)
        self.policy_of = {agent: mapping(agent) for agent in possible_agents}
        self.policies: dict[Any, list[tuple[int, Any]]] = {}
        self.where: dict[tuple[int, Any], tuple[Any, int]] = {}
        for i in range(num_envs):
            for agent in possible_agents:
                pid = self.policy_of[agent]
                rows = self.policies.setdefault(pid, [])
                self.where[(i, agent)] = (pid, len(rows))
                rows.append((i, agent))

    def __repr__(self) -> str:
        return f"AgentRows({ {pid: len(rows) for pid, rows in self.policies.items()} })"


def _agents_of(env: Any) -> list[Any]:
    agents = getattr(env, "possible_agents", None)
    if agents is None:
        raise UsageError(f"{type(env).__name__}: expected a PettingZoo ParallelEnv (with possible_agents), got an env "
                         "without them")
    return list(agents)


class ParallelDriver:
    """Steps PettingZoo parallel envs for :class:`MultiAgentLoop`, writing each policy's rows where it is told.

    Observations must be arrays (one per agent, the shape and dtype its policy's rows have).
    """

    def __init__(self, envs: Sequence[Any], rows: AgentRows):
        self.envs = list(envs)
        self.rows = rows
        self.where = rows.where
        agents = _agents_of(self.envs[0])
        for i, env in enumerate(self.envs[1:], 1):
            if _agents_of(env) != agents:
                raise UsageError(f"envs[{i}].possible_agents: expected {agents} (every env of an actor has the same "
                                 f"agents), got {_agents_of(env)}")

    def _place(self, i: int, obs: dict[Any, Any], out: dict[Any, np.ndarray], valid: dict[Any, np.ndarray],
               skip: Any = ()) -> None:
        for agent, o in obs.items():
            if agent in skip:
                continue
            pid, row = self._row(i, agent)
            dst = out[pid]
            if np.shape(o) != dst.shape[1:] or not np.can_cast(np.asarray(o).dtype, dst.dtype, "same_kind"):
                raise SchemaError(f"envs[{i}]: agent {agent!r}'s observation: expected shape {dst.shape[1:]} and dtype "
                                  f"{dst.dtype} (policy {pid!r}'s rows), got shape {np.shape(o)} and dtype "
                                  f"{np.asarray(o).dtype}")
            dst[row] = o
            valid[pid][row] = True

    def _row(self, i: int, agent: Any) -> tuple[Any, int]:
        try:
            return self.where[(i, agent)]
        except KeyError:
            raise UsageError(f"envs[{i}]: agent {agent!r} is not in the env's possible_agents") from None

    def reset(self, seed: int | None, out: dict[Any, np.ndarray], valid: dict[Any, np.ndarray]) -> None:
        """Reset every env (env ``i`` with ``seed + i``) and write its agents' first observations into ``out``."""
        for pid in out:
            out[pid][...] = 0
            valid[pid][...] = False
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=None if seed is None else seed + i)
            self._place(i, obs, out, valid)

    def step(self, actions: dict[Any, np.ndarray], valid: dict[Any, np.ndarray], out: dict[Any, np.ndarray],
             out_valid: dict[Any, np.ndarray], rew: dict[Any, np.ndarray], term: dict[Any, np.ndarray],
             trunc: dict[Any, np.ndarray]) -> dict[Any, dict[int, Any]]:
        """Step every env with the actions of its live agents (the ``valid`` rows of ``actions``).

        Writes, per policy: ``rew``/``term``/``trunc`` of the rows that acted (zero elsewhere); ``out`` and
        ``out_valid``, the rows' observations and liveness for the next step (a row whose agent left is zeros;
        an env whose agents all left is reset, its agents' rows hold their first observations). Returns, per
        policy, ``{row: final observation}`` of the rows whose stream ended.
        """
        for pid in out:
            out[pid][...] = 0
            out_valid[pid][...] = False
            rew[pid][...] = 0
            term[pid][...] = False
            trunc[pid][...] = False
        finals: dict[Any, dict[int, Any]] = {pid: {} for pid in out}
        for i, env in enumerate(self.envs):
            live = list(env.agents)
            acts = {}
            for agent in live:
                pid, row = self._row(i, agent)
                if not valid[pid][row]:
                    raise UsageError(f"envs[{i}]: agent {agent!r} is live, but it was in no observation the env "
                                     "returned, so it has nothing to act on")
                acts[agent] = actions[pid][row]
            obs, r, te, tr, _ = env.step(acts)
            for agent in acts:
                pid, row = self.where[(i, agent)]
                try:
                    rew[pid][row], term[pid][row], trunc[pid][row] = r[agent], te[agent], tr[agent]
                except KeyError as exc:
                    raise UsageError(f"envs[{i}].step: expected a reward, a termination and a truncation for every "
                                     f"agent that acted, got none for {exc.args[0]!r}") from None
                if te[agent] or tr[agent]:
                    if agent not in obs:
                        raise UsageError(f"envs[{i}].step: agent {agent!r} ended without a final observation")
                    finals[pid][row] = np.array(obs[agent])
                elif agent not in obs:
                    raise UsageError(f"envs[{i}].step: agent {agent!r} goes on without an observation")
            ended = {a for a in acts if te[a] or tr[a]}
            self._place(i, obs, out, out_valid, skip=ended)
            if not env.agents:  # the env's episode is over: its agents start again
                obs, _ = env.reset()
                self._place(i, obs, out, out_valid)
        return finals


def _array_obs(pid: Any, obs: Any) -> np.ndarray:
    if type(obs) is not np.ndarray:
        raise UsageError(f"policy {pid!r}: multi-agent observations must be numpy arrays (one per agent), got "
                         f"{type(obs).__name__}")
    return obs


def multiagent_examples(envs: Sequence[Any], policies: dict[Any, Any], policy_mapping_fn: Callable[..., Any] | None,
                        *, rollout_len: int, seed: int | None = None) -> tuple[dict[Any, Any], AgentRows]:
    """Each policy's rollout example (schema) and the rows, from one reset of ``envs`` and one call of each policy.

    The example is :func:`shmbuf.layout.rollout_example` in truncate-episodes mode with ``num_envs`` = the
    policy's rows and the :data:`VALID` step leaf. Raises UsageError for a policy id the mapping names
    that ``policies`` lacks (or the other way round), SchemaError for extras that clash with the layout.
    """
    rows = AgentRows(_agents_of(envs[0]), len(envs), policy_mapping_fn)
    missing = sorted(map(str, set(rows.policies) - set(policies)))
    if missing:
        raise UsageError(f"policies: policy_mapping_fn maps agents to {missing}, which policies= does not have "
                         f"(it has {sorted(map(str, policies))})")
    unused = sorted(map(str, set(policies) - set(rows.policies)))
    if unused:
        raise UsageError(f"policies: {unused} get no agent from policy_mapping_fn (agents: "
                         f"{dict((str(a), str(p)) for a, p in rows.policy_of.items())})")
    first: dict[Any, np.ndarray] = {}
    for i, env in enumerate(envs):
        obs, _ = env.reset(seed=None if seed is None else seed + i)
        for agent, o in obs.items():
            first.setdefault(rows.policy_of[agent], _array_obs(rows.policy_of[agent], np.asarray(o)))
    examples = {}
    for pid, agent_rows in rows.policies.items():
        if pid not in first:
            env_i, agent = agent_rows[0]
            space = envs[env_i].observation_space(agent)
            first[pid] = np.zeros(space.shape, space.dtype)
        action, extras = split_policy_output(as_numpy_policy(policies[pid])(first[pid][None]))
        action = np.asarray(action)
        if VALID in extras:
            raise SchemaError(f"policy {pid!r}: the extra '{VALID}' clashes with the multi-agent step leaf of that name")
        ex = {k: np.array(np.asarray(v)[0]) for k, v in extras.items()}
        ex[VALID] = np.zeros((), bool)
        examples[pid] = rollout_example(first[pid], np.array(action[0]), rollout_len=rollout_len,
                                        num_envs=len(agent_rows), extras=ex)
    return examples, rows


class _PolicyRollout:
    """One policy's slot in a round, as the views the loop writes through."""

    def __init__(self, view: dict[str, Any]):
        st, ep, bs = view[STEP], view[EPISODE], view[BOOTSTRAP]
        self.obs, self.act, self.rew = st[OBS], st[ACTION], st[REWARD]
        self.term, self.trunc, self.valid = st[TERMINATED], st[TRUNCATED], st[VALID]
        self.extras = {k: v for k, v in st.items() if k not in (OBS, ACTION, REWARD, TERMINATED, TRUNCATED, VALID)}
        self.ep = ep
        self.boot, self.env_steps = bs[OBS], bs[ENV_STEPS]
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
        writers: ``{policy_id: Writer}`` on each policy's pipeline (:func:`multiagent_examples`).
        rollout_len: env steps (or, counting agent steps, agent steps) per rollout; the pipelines' T.
        policy_mapping_fn: agent id -> policy id (RLlib's, see :func:`mapping_of`); None: one policy,
            ``"default_policy"``.
        count_steps_by: ``"env_steps"`` or ``"agent_steps"`` (RLlib's ``count_steps_by``).
        weights: ``{policy_id: WeightSubscriber}`` for the policies whose weights are broadcast, polled at round
            boundaries (see :func:`workers.ActorLoop`'s ``weights``); each policy's rollouts carry its own version.
        should_stop: checked every step; a partial round is then dropped.
    """

    def __init__(self, envs: Any, policies: dict[Any, Any], writers: dict[Any, Any], *, rollout_len: int,
                 policy_mapping_fn: Callable[..., Any] | None = None, count_steps_by: str = ENV_STEPS_COUNT,
                 seed: int | None = None, weights: dict[Any, Any] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        if count_steps_by not in COUNT_STEPS_BY:
            raise UsageError(f"count_steps_by: expected one of {COUNT_STEPS_BY}, got {count_steps_by!r}")
        self.envs = list(envs) if isinstance(envs, (list, tuple)) else [envs]
        if not self.envs:
            raise UsageError("envs: expected a PettingZoo ParallelEnv or a list of them, got an empty list")
        self.rows = AgentRows(_agents_of(self.envs[0]), len(self.envs), policy_mapping_fn)
        if set(writers) != set(self.rows.policies) or set(policies) != set(self.rows.policies):
            want = sorted(map(str, self.rows.policies))
            raise UsageError(f"policies and writers: expected one of each for the policies {want}, got policies "
                             f"{sorted(map(str, policies))} and writers {sorted(map(str, writers))}")
        self.driver = ParallelDriver(self.envs, self.rows)
        self.policies = policies
        self._calls = {pid: as_numpy_policy(p) for pid, p in policies.items()}
        self.writers = writers
        self.T = rollout_len
        self.count_agent_steps = count_steps_by == AGENT_STEPS_COUNT
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
        self._cur: dict[Any, np.ndarray] | None = None
        self._seed = seed

    def _buffers(self, slots: dict[Any, _PolicyRollout]) -> None:
        """The loop's own buffers, shaped from the first round's slots: observations and liveness (current and
        next), rewards, flags, episode returns and lengths per row."""
        K = {pid: s.valid.shape[1] for pid, s in slots.items()}
        self._cur = {pid: np.zeros(s.obs.shape[1:], s.obs.dtype) for pid, s in slots.items()}
        self._nxt = {pid: np.zeros_like(a) for pid, a in self._cur.items()}
        self._valid = {pid: np.zeros(k, bool) for pid, k in K.items()}
        self._nvalid = {pid: np.zeros(k, bool) for pid, k in K.items()}
        self._rew = {pid: np.zeros(k, np.float64) for pid, k in K.items()}
        self._term = {pid: np.zeros(k, bool) for pid, k in K.items()}
        self._trunc = {pid: np.zeros(k, bool) for pid, k in K.items()}
        self._act = {pid: np.zeros(s.act.shape[1:], s.act.dtype) for pid, s in slots.items()}
        self.ep_ret = {pid: np.zeros(k, np.float64) for pid, k in K.items()}
        self.ep_len = {pid: np.zeros(k, np.int64) for pid, k in K.items()}
        self.driver.reset(self._seed, self._cur, self._valid)

    def update_weights(self) -> None:
        """Give each policy with a broadcast its newest weights, if newer ones were published."""
        for pid, sub in self.weights.items():
            got = sub.poll()
            if got is not None:
                version, params = got
                apply_weights(self.policies[pid], params)
                self.versions[pid] = version

    def run(self, max_rounds: int | None = None) -> int:
        """Collect until ``max_rounds`` more rounds (one rollout per policy each) were committed (None: until
        stopped); return how many."""
        start = self.rounds
        while max_rounds is None or self.rounds - start < max_rounds:
            if not self._round():
                break
        return self.rounds - start

    def _act_rows(self, pid: Any, s: _PolicyRollout, t: int, obs: np.ndarray, valid: np.ndarray) -> None:
        """Call policy ``pid`` on its live rows and store its action (and extras) rows; the others stay zero."""
        act = self._act[pid]
        act[...] = 0
        live = np.flatnonzero(valid)
        if len(live):
            every = len(live) == len(valid)
            action, extras = split_policy_output(self._calls[pid](obs if every else obs[live]))
            a = self._check(f"{pid}/{ACTION}", action, (len(live), *act.shape[1:]), act.dtype)
            if every:
                act[...] = a
            else:
                act[live] = a
            if extras or s.extras:
                check_extras(extras, s.extras)
                for k, dst in s.extras.items():
                    v = self._check(f"{pid}/{k}", extras[k], (len(live), *dst.shape[2:]), dst.dtype)
                    dst[t] = 0
                    dst[t][live] = v
        elif s.extras:
            for dst in s.extras.values():
                dst[t] = 0
        s.act[t] = act

    def _round(self) -> bool:
        """One rollout per policy, committed; False if the loop was asked to stop (nothing committed)."""
        if self.should_stop():
            return False
        self.update_weights()
        slots = {pid: _PolicyRollout(w.slot()) for pid, w in self.writers.items()}
        if self._cur is None:
            self._buffers(slots)
        assert self._cur is not None  # set just above
        steps_here = 0
        t = 0
        for t in range(self.T):
            if self.should_stop():
                for w in self.writers.values():
                    w.reset()
                return False
            cur, nxt, valid, nvalid = self._cur, self._nxt, self._valid, self._nvalid
            for pid, s in slots.items():
                s.obs[t] = cur[pid]
                s.valid[t] = valid[pid]
                self._act_rows(pid, s, t, cur[pid], valid[pid])
            finals = self.driver.step(self._act, valid, nxt, nvalid, self._rew, self._term, self._trunc)
            self.env_steps += len(self.envs)
            for pid, s in slots.items():
                v = valid[pid]
                n = int(np.count_nonzero(v))
                steps_here += n
                self.agent_steps += n
                rew, term, trunc = self._rew[pid], self._term[pid], self._trunc[pid]
                s.rew[t] = rew
                s.term[t] = term
                s.trunc[t] = trunc
                ep_ret, ep_len = self.ep_ret[pid], self.ep_len[pid]
                ep_ret[v] += rew[v]
                ep_len[v] += 1
                s.last_ends = sorted(finals[pid])
                for row in s.last_ends:
                    k = s.n_ep
                    ep = s.ep
                    ep[RETURN][k], ep[LENGTH][k] = ep_ret[row], ep_len[row]
                    ep[TERMINATED][k], ep[TRUNCATED][k] = term[row], trunc[row]
                    ep[ENV][k], ep[END][k] = row, t
                    ep[FINAL_OBS][k] = finals[pid][row]
                    s.n_ep += 1
                    ep_ret[row] = 0.0
                    ep_len[row] = 0
                self.episodes += len(s.last_ends)
            self._cur, self._nxt, self._valid, self._nvalid = nxt, cur, nvalid, valid
            if self.count_agent_steps and steps_here >= self.T:
                break
        for pid, s in slots.items():
            s.boot[...] = self._cur[pid]  # the next observations: each live row's successor of its last step
            if s.last_ends:  # rows whose stream ended at the last step: their final observations
                k = len(s.last_ends)
                s.boot[s.last_ends] = s.ep[FINAL_OBS][s.n_ep - k : s.n_ep]
            s.env_steps[...] = self.env_steps
            self.writers[pid].commit(self.versions[pid], fill={STEP: t + 1, EPISODE: s.n_ep})
        self.rounds += 1
        return True
