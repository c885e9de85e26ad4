"""The agents' rows and the env driver of multi-agent collection: which row of its policy's rollouts every
``(env, agent)`` takes, and the stepping of PettingZoo parallel envs that writes them (see :mod:`workers._multiagent`,
whose loop uses them, and docs/multiagent.md)."""

from __future__ import annotations

import inspect
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbuf import SchemaError, UsageError
from workers._agent_obs import item_copy, store, zero


def mapping_of(policy_mapping_fn: Callable[..., Any] | None) -> Callable[[Any], Any]:
    """A policy mapping as a function of the agent id alone: :func:`episode_mapping_of`'s, with None for the episode
    (and for the old stack's ``worker``). The mapping is then decided once per agent id (each agent's row is fixed),
    not per episode. None maps every agent to ``"default_policy"`` (RLlib's default policy id).
    """
    call = episode_mapping_of(policy_mapping_fn)
    return lambda agent: call(agent, None)


@dataclass(frozen=True)
class Episode:
    """What a per-episode policy mapping is given as RLlib's ``episode`` argument
    (``MultiAgentCollector(remap_each_episode=True)``): one episode of one env of one actor.

    ``env_index``: the env in the actor; ``count``: that env's episodes before this one in this actor (0, 1, ...);
    ``episode_id``: a 63-bit id drawn from the actor's seed (RLlib's old stack's ``episode.episode_id``); ``id_``: the
    same as a hex string (its new stack's ``episode.id_``).
    """

    env_index: int
    count: int
    episode_id: int

    @property
    def id_(self) -> str:
        return f"{self.episode_id:016x}"


def episode_mapping_of(policy_mapping_fn: Callable[..., Any] | None) -> Callable[[Any, Episode | None], Any]:
    """A policy mapping called as RLlib calls it, once per agent per episode: ``fn(agent_id, episode)`` (None for any
    further required positional argument, e.g. the old stack's ``worker``); a function of the agent id alone (and no
    ``episode`` keyword) gets the agent id."""
    if policy_mapping_fn is None:
        return lambda agent, episode: "default_policy"
    if not callable(policy_mapping_fn):
        raise UsageError(f"policy_mapping_fn: expected a function of the agent id (and the episode), got "
                         f"{policy_mapping_fn!r}")
    try:
        params = list(inspect.signature(policy_mapping_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called with the agent id alone
        return lambda agent, episode: policy_mapping_fn(agent)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2:
        rest = (None,) * sum(1 for p in positional[2:] if p.default is p.empty)
        return lambda agent, episode: policy_mapping_fn(agent, episode, *rest)
    if any(p.name == "episode" or p.kind == p.VAR_KEYWORD for p in params):
        return lambda agent, episode: policy_mapping_fn(agent, episode=episode)
    return lambda agent, episode: policy_mapping_fn(agent)


class AgentRows:
    """The row of every ``(env, agent)`` in its policy's rollouts (see the module doc).

    ``policies``: ``{policy_id: [(env_index, agent_id), ...]}``, each list in row order (env by env, agents
    in ``possible_agents`` order); ``where``: ``{(env_index, agent_id): (policy_id, row)}``.

    ``remap_ids`` (a per-episode mapping, ``MultiAgentCollector(remap_each_episode=True)``): every one of these
    policies has a row for every ``(env, agent)``, the same row in each; ``where`` is then the mapping of each env's
    current episode, set by :meth:`assign` when the episode starts (before that, the mapping of an episode 0 with
    id 0), and an agent's stream in a policy's row holds the episodes it was mapped to that policy.
    """

    def __init__(self, possible_agents: Sequence[Any], num_envs: int, policy_mapping_fn: Callable[..., Any] | None,
                 *, remap_ids: Sequence[Any] | None = None):
        if not possible_agents:
            raise UsageError("possible_agents: expected the env's agent ids (PettingZoo's env.possible_agents), got none")
        self.remap = remap_ids is not None
        self.policies: dict[Any, list[tuple[int, Any]]] = {}
        self.where: dict[tuple[int, Any], tuple[Any, int]] = {}
        if remap_ids is not None:
            if not remap_ids:
                raise UsageError("remap_each_episode: expected the policies an agent may be mapped to, got none")
            self.episode_mapping = episode_mapping_of(policy_mapping_fn)
            pairs = [(i, agent) for i in range(num_envs) for agent in possible_agents]
            self.policies = {pid: list(pairs) for pid in remap_ids}
            self.row_of = {pair: k for k, pair in enumerate(pairs)}
            self._env_rows = [[(agent, self.row_of[(i, agent)]) for agent in possible_agents] for i in range(num_envs)]
            for i in range(num_envs):
                self.assign(i, Episode(i, 0, 0))
            self.policy_of = {agent: self.where[(0, agent)][0] for agent in possible_agents}  # env 0's first episode
            return
        mapping = mapping_of(policy_mapping_fn)
        self.policy_of = {agent: mapping(agent) for agent in possible_agents}
        for i in range(num_envs):
            for agent in possible_agents:
                pid = self.policy_of[agent]
                rows = self.policies.setdefault(pid, [])
                self.where[(i, agent)] = (pid, len(rows))
                rows.append((i, agent))

    def assign(self, i: int, episode: Episode) -> dict[Any, tuple[Any, int]]:
        """(Per-episode mapping) Map env ``i``'s agents for ``episode``: ``where`` updated, and env ``i``'s ``{agent:
        (policy_id, row)}`` returned.

        Raises:
            UsageError: the mapping names a policy that has no rows (not one of ``remap_ids``).
        """
        out = {}
        for agent, row in self._env_rows[i]:
            pid = self.episode_mapping(agent, episode)
            if pid not in self.policies:
                raise UsageError(f"policy_mapping_fn({agent!r}, episode {episode.count} of env {i}) returned {pid!r}, "
                                 f"which is not one of the policies {sorted(map(str, self.policies))}")
            out[agent] = self.where[(i, agent)] = (pid, row)
        return out

    def homes(self) -> dict[tuple[int, Any], list[tuple[Any, int]]]:
        """Every ``(env, agent)``'s rows: ``[(policy_id, row), ...]``, one per policy it may be mapped to."""
        if not self.remap:
            return {k: [v] for k, v in self.where.items()}
        return {pair: [(pid, row) for pid in self.policies] for pair, row in self.row_of.items()}

    def __repr__(self) -> str:
        return f"AgentRows({ {pid: len(rows) for pid, rows in self.policies.items()} }{', remapped' if self.remap else ''})"


def agents_of(env: Any) -> list[Any]:
    agents = getattr(env, "possible_agents", None)
    if agents is None:
        raise UsageError(f"{type(env).__name__}: expected a PettingZoo ParallelEnv (with possible_agents), got an env "
                         "without them")
    return list(agents)


class ParallelDriver:
    """Steps PettingZoo parallel envs for :class:`MultiAgentLoop`, writing each policy's rows where it is told.

    Observations are arrays (one per agent, the shape and dtype its policy's rows have), or dicts or tuples of them
    (a Dict or Tuple space: the policy's rows are then a tree of the same structure, see :mod:`workers._agent_obs`).
    """

    def __init__(self, envs: Sequence[Any], rows: AgentRows, seed: int | None = None):
        self.envs = list(envs)
        self.rows = rows
        self._episodes = [0] * len(self.envs)  # (per-episode mapping) each env's episodes started
        self._ids = random.Random(seed)  # (per-episode mapping) the episodes' ids
        self.reset_envs: list[int] = []  # the envs the last step() reset (their episode was over)
        agents = agents_of(self.envs[0])
        for i, env in enumerate(self.envs[1:], 1):
            if agents_of(env) != agents:
                raise UsageError(f"envs[{i}].possible_agents: expected {agents} (every env of an actor has the same "
                                 f"agents), got {agents_of(env)}")
        # per env: agent -> (policy, row); and the last step's live agents grouped by policy (see _plan)
        self._at = [{agent: rows.where[(i, agent)] for agent in agents} for i in range(len(self.envs))]
        self._plans: list[Any] = [None] * len(self.envs)

    def _new_episode(self, i: int) -> None:
        """Env ``i`` starts an episode: with a per-episode mapping, its agents are mapped again (and its plans go)."""
        if not self.rows.remap:
            return
        self._at[i] = self.rows.assign(i, Episode(i, self._episodes[i], self._ids.getrandbits(63)))
        self._episodes[i] += 1
        self._plans[i] = None

    def _row(self, i: int, agent: Any) -> tuple[Any, int]:
        try:
            return self._at[i][agent]
        except KeyError:
            raise UsageError(f"envs[{i}]: agent {agent!r} is not in the env's possible_agents") from None

    def _place(self, i: int, obs: dict[Any, Any], out: dict[Any, Any], valid: dict[Any, np.ndarray],
               skip: Any = ()) -> None:
        at = self._at[i]
        for agent, o in obs.items():
            if agent in skip:
                continue
            pid, row = at[agent] if agent in at else self._row(i, agent)
            dst = out[pid]
            if type(dst) is not np.ndarray:  # a tree of rows (a Dict or Tuple space): each leaf checked and stored
                store(dst, row, o, f"envs[{i}]: agent {agent!r} (policy {pid!r})")
                valid[pid][row] = True
                continue
            # An array of the rows' exact shape and dtype goes in as it is; anything else is checked first.
            if type(o) is not np.ndarray or o.shape != dst.shape[1:] or o.dtype != dst.dtype:
                if np.shape(o) != dst.shape[1:] or not np.can_cast(np.asarray(o).dtype, dst.dtype, "same_kind"):
                    raise SchemaError(f"envs[{i}]: agent {agent!r}'s observation: expected shape {dst.shape[1:]} and "
                                      f"dtype {dst.dtype} (policy {pid!r}'s rows), got shape {np.shape(o)} and dtype "
                                      f"{np.asarray(o).dtype}")
            dst[row] = o
            valid[pid][row] = True

    def _plan(self, i: int, live: list[Any]) -> tuple[dict[Any, tuple[tuple[Any, ...], Any, Any]], Any]:
        """Env ``i``'s live agents grouped by policy, ``{policy: (agents, rows, get)}`` (``get(d)``: the tuple of
        ``d[agent]`` for those agents, in order), and their names as a set: made again only when the live agents
        change (agents join or leave), else the last step's."""
        cached = self._plans[i]
        if cached is not None and cached[0] == live:
            return cached[1], cached[2]
        at = self._at[i]
        groups: dict[Any, tuple[list[Any], list[int]]] = {}
        for agent in live:
            pid, row = at[agent] if agent in at else self._row(i, agent)
            g = groups.setdefault(pid, ([], []))
            g[0].append(agent)
            g[1].append(row)
        plan = {pid: (tuple(agents), _rows_index(rows), _getter(agents)) for pid, (agents, rows) in groups.items()}
        names = {a for a in live}
        self._plans[i] = (list(live), plan, names)
        return plan, names

    def _place_plan(self, plan: dict[Any, tuple[tuple[Any, ...], Any, Any]], obs: dict[Any, Any],
                    out: dict[Any, Any], valid: dict[Any, np.ndarray], i: int) -> None:
        """Every live agent's observation into its row, one store per policy (the checked path for anything else)."""
        for pid, (agents, rows, get) in plan.items():
            dst = out[pid]
            if type(dst) is not np.ndarray:  # a tree of rows: agent by agent
                self._place(i, {a: obs[a] for a in agents}, out, valid)
                continue
            try:  # one array of the policy's observations: its shape and dtype are the rows' only if each one's are
                stacked = np.array(get(obs))
            except ValueError:  # observations of different shapes: the checked path names the agent
                stacked = None
            if stacked is None or stacked.shape[1:] != dst.shape[1:] or stacked.dtype != dst.dtype:
                self._place(i, {a: obs[a] for a in agents}, out, valid)
                continue
            dst[rows] = stacked
            valid[pid][rows] = True

    def reset(self, seed: int | None, out: dict[Any, Any], valid: dict[Any, np.ndarray]) -> None:
        """Reset every env (env ``i`` with ``seed + i``) and write its agents' first observations into ``out``."""
        for pid in out:
            zero(out[pid])
            valid[pid][...] = False
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=None if seed is None else seed + i)
            self._new_episode(i)
            self._place(i, obs, out, valid)

    def step(self, actions: dict[Any, np.ndarray], valid: dict[Any, np.ndarray], out: dict[Any, Any],
             out_valid: dict[Any, np.ndarray], rew: dict[Any, np.ndarray], term: dict[Any, np.ndarray],
             trunc: dict[Any, np.ndarray]) -> dict[Any, dict[int, Any]]:
        """Step every env with the actions of its live agents (the ``valid`` rows of ``actions``).

        Writes, per policy: ``rew``/``term``/``trunc`` of the rows that acted (zero elsewhere); ``out`` and
        ``out_valid``, the rows' observations and liveness for the next step (a row whose agent left is zeros;
        an env whose agents all left is reset, its agents' rows hold their first observations). Returns, per
        policy, ``{row: final observation}`` of the rows whose stream ended.
        """
        for pid, o in out.items():
            if type(o) is np.ndarray:  # the common case, without a call
                o[...] = 0
            else:  # a Dict or Tuple observation: leaf by leaf
                zero(o)
            out_valid[pid][...] = False
            rew[pid][...] = 0
            term[pid][...] = False
            trunc[pid][...] = False
        finals: dict[Any, dict[int, Any]] = {pid: {} for pid in out}
        self.reset_envs = []
        # policies with a row not live: checked env by env (count_nonzero: a bool array's cheapest reduction)
        away = {pid for pid, v in valid.items() if np.count_nonzero(v) != len(v)}
        for i, env in enumerate(self.envs):
            plan, names = self._plan(i, env.agents)
            acts: dict[Any, Any] = {}
            for pid, (agents, rows, _) in plan.items():
                if pid in away:
                    ok = valid[pid][rows]
                    if not ok.all():
                        agent = agents[int(np.flatnonzero(~ok)[0])]
                        raise UsageError(f"envs[{i}]: agent {agent!r} is live, but it was in no observation the env "
                                         "returned, so it has nothing to act on")
                acts.update(zip(agents, actions[pid][rows]))
            obs, r, te, tr, _ = env.step(acts)
            ended: set[Any] = set()
            for pid, (agents, rows, get) in plan.items():
                try:
                    rew[pid][rows] = get(r)
                    te_p = get(te)
                    tr_p = get(tr)
                except KeyError as exc:
                    raise UsageError(f"envs[{i}].step: expected a reward, a termination and a truncation for every "
                                     f"agent that acted, got none for {exc.args[0]!r}") from None
                ended_p = any(te_p), any(tr_p)
                if ended_p[0]:  # else the rows keep the zeros (False) they were given above
                    term[pid][rows] = te_p
                if ended_p[1]:
                    trunc[pid][rows] = tr_p
                if ended_p[0] or ended_p[1]:
                    row_ids = range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()
                    for a, row, x, y in zip(agents, row_ids, te_p, tr_p, strict=True):
                        if x or y:
                            if a not in obs:
                                raise UsageError(f"envs[{i}].step: agent {a!r} ended without a final observation")
                            dst = out[pid]
                            finals[pid][row] = (np.array(obs[a]) if type(dst) is np.ndarray else
                                                item_copy(dst, obs[a], f"envs[{i}]: agent {a!r} (policy {pid!r})"))
                            ended.add(a)
            if not ended and obs.keys() == names:  # the same agents go on: each policy's rows in one store
                self._place_plan(plan, obs, out, out_valid, i)
            else:
                if not all(a in obs for a in acts if a not in ended):
                    gone = [a for a in acts if a not in ended and a not in obs]
                    raise UsageError(f"envs[{i}].step: agent {gone[0]!r} goes on without an observation")
                self._place(i, obs, out, out_valid, skip=ended)
            if not env.agents:  # the env's episode is over: its agents start again
                self.reset_envs.append(i)
                obs, _ = env.reset()
                self._new_episode(i)
                self._place(i, obs, out, out_valid)
        return finals


def _getter(agents: list[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """``d -> (d[a] for a in agents)`` as a tuple, in one C call (``operator.itemgetter``; KeyError names the agent
    missing, as ``d[a]`` does)."""
    if len(agents) == 1:
        agent = agents[0]
        return lambda d: (d[agent],)
    return operator.itemgetter(*agents)


def _rows_index(rows: list[int]) -> Any:
    """Rows as an index: a slice where they are consecutive (one env's agents of one policy usually are: views and
    plain stores instead of gathers and scatters), else an index array."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return np.array(rows, np.intp)
