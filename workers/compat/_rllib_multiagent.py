"""RLlib's ``Policy.postprocess_trajectory`` in multi-agent actors, with ``other_agent_batches``.

RLlib (old stack, ``EpisodeV2.postprocess_episode``) calls ``policy.postprocess_trajectory(sample_batch,
other_agent_batches, episode)`` for every agent of an episode at the end of each rollout fragment and of the
episode, ``other_agent_batches`` being ``{other_agent_id: (policy_id, policy, SampleBatch)}``: every other agent
of the same episode with steps in that fragment. Here the same, right before a round's rollouts are committed
(:meth:`workers.MultiAgentLoop._round`): each policy's rows are cut into episode pieces, a row's piece being its
agent's valid steps up to one recorded ``terminated`` or ``truncated``, or to the round's last step, and the hook of
the row's policy is called on each piece with:

- ``sample_batch``: the agent's columns over the piece, as :mod:`workers.compat._rllib_postprocess` gives them (views of the
  slot, ``new_obs`` each step's successor), plus ``t``: each step's env step index within the round;
- ``other_agent_batches``: ``{agent_id: (policy_id, policy, batch)}`` for every other agent of the same env with a
  valid step in the piece's env-step window (``t[0] .. t[-1]``), ``batch`` holding those steps only (copies, taken
  before any hook of the round ran: never a column a hook adds; shared by the calls of that env's agents, as RLlib
  shares them, so read-only for a hook), with its own ``t``, so that ``t`` lines steps up
  across agents as RLlib's ``t`` does (RLlib counts it from the episode's start, here from the round's);
- ``episode``: None (no Episode object).

Every policy's rollout of a round covers the same env steps, so the other agents' data is at hand whatever their
policy: the round's hooks all run before the first of its commits. Complete-episodes rollouts (one agent's episode
each) are held, when a hook is set, until their env's episode is over, as RLlib postprocesses at the episode's end:
then every agent's hook gets every other agent's whole episode of that env episode, ``t`` counting env steps from
the env episode's start (:meth:`MultiAgentPostprocessor.apply_env_episode`), and they are committed. The columns a
hook adds are found at set-up (:func:`discover_policies`, a dummy batch with a dummy batch of every other agent of
an env) and become step leaves of its policy's pipeline. RLlib's ``policies_to_train`` (:func:`trained_policies`)
chooses the policies whose data is kept, and so which get a hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optree

from shmbuf import SchemaError, UsageError
from shmbuf import layout as L
from workers._policy import split_policy_output
from workers.compat._rllib_postprocess import (
    DUMMY_STEPS,
    METHOD,
    NEW_OBS,
    RLLIB_COLUMNS,
    PostprocessSpec,
    added_columns,
    call_hook,
    dummy_batch,
    resolve,
    store,
)
from workers.compat._rllib_postprocess import check_setting as check_one

T_COLUMN = "t"  # RLlib's SampleBatch.T


def check_setting(postprocess: Any, policies: Mapping[Any, Any], name: str = "postprocess") -> None:
    """UsageError unless ``postprocess`` is None, a bool, a callable, or ``{policy_id: one of those}`` of known ids;
    ``name``: the setting as the user gave it."""
    if isinstance(postprocess, dict):
        unknown = sorted(str(pid) for pid in postprocess if pid not in policies)
        if unknown:
            raise UsageError(f"{name}: keyed by policy id; {unknown} are not in policies ({sorted(map(str, policies))})")
        for pid, one in postprocess.items():
            try:
                check_one(one, name)
            except UsageError as exc:
                raise UsageError(f"{name}[{pid!r}]: {exc}") from None
    else:
        check_one(postprocess, name)


def setting_for(postprocess: Any, pid: Any) -> Any:
    """Policy ``pid``'s setting: its entry of a dict (None, its own method if any, when it has none), else the setting."""
    return postprocess.get(pid) if isinstance(postprocess, dict) else postprocess


def _items(example: Mapping[str, Any], lead: int) -> tuple[Any, Any, dict[str, Any]]:
    """One item (no lead dims) of a rollout example's obs, action and extras (step leaves but the flags and valid)."""
    step = example[L.STEP]

    def item(x: Any) -> Any:
        return optree.tree_map(lambda a: np.asarray(a)[(0,) * lead], x)

    extras = {k: item(v) for k, v in step.items() if k not in L.STEP_KEYS and k != L.VALID}
    return item(step[L.OBS]), item(step[L.ACTION]), extras


def _with_t(batch: dict[str, Any], t: np.ndarray) -> dict[str, Any]:
    batch[T_COLUMN] = t
    return batch


def discover_policies(postprocess: Any, policies: Mapping[Any, Any], examples: Mapping[Any, Any], rows: Any, *,
                      batch_mode: str, served: bool = False, name: str = "postprocess") -> dict[Any, PostprocessSpec]:
    """Each hooked policy's :class:`~workers.compat._rllib_postprocess.PostprocessSpec`: its hook called once on a dummy batch of
    :data:`~workers.compat._rllib_postprocess.DUMMY_STEPS` steps of zeros (from ``examples[policy_id]``, the pipelines'
    examples), with ``other_agent_batches`` a dummy batch for every other agent of an env (none in complete-episodes
    mode), as a hook will see them. ``served``: the policies are not in the actors (an own method is refused).

    Raises:
        UsageError: a bad setting; an added column that is not an array with one row per step, or whose name is a
            step leaf; a served policy's own method.
        SchemaError: a hook that does not return a mapping (naming the policy).
    """
    check_setting(postprocess, policies, name)
    lead = 1 if batch_mode == L.COMPLETE_EPISODES else 2
    n = DUMMY_STEPS
    pre = {}
    for pid, ex in examples.items():
        obs, action, extras = _items(ex, lead)
        pre[pid] = (_with_t(dummy_batch(obs, action, extras, n), np.arange(n)), extras)
    specs = {}
    for pid in examples:
        one = setting_for(postprocess, pid)
        hook = resolve(one, policies[pid], name)
        if hook is None:
            continue
        own = not (callable(one) and not isinstance(one, bool))
        if own and served:
            raise UsageError(f"{name}: policy {pid!r} has a {METHOD} method, but with serve=True the policies stay "
                             f"in this process and the hook runs in the actors: pass the hook as a picklable function, "
                             f"{name}={{{pid!r}: fn}}, or {name}={{{pid!r}: False}}")
        # an agent the policy has (a per-episode mapping: one it has in the first episode), and its env's others
        env_i, me = next(((e, a) for (e, a), (p, _) in rows.where.items() if p == pid), rows.policies[pid][0])
        others = {}
        for (e, agent), (other, _) in rows.where.items():
            if lead == 2 and e == env_i and agent != me:
                others[agent] = (other, policies[other], {k: optree.tree_map(np.copy, v) for k, v in pre[other][0].items()})
        batch = {k: optree.tree_map(np.copy, v) for k, v in pre[pid][0].items()}
        given = set(batch)
        who = f"policy {pid!r}: "
        out = call_hook(hook, batch, others, who=who, error=SchemaError)
        columns = added_columns(out, given, pre[pid][1], n, who=who)
        specs[pid] = PostprocessSpec(None if own else hook, columns)
    return specs


def add_columns(examples: dict[Any, Any], specs: Mapping[Any, PostprocessSpec], *, batch_mode: str) -> None:
    """Give each policy's example a step leaf per column its hook adds (zeros, the example's lead dims), in place."""
    for pid, spec in specs.items():
        step = examples[pid][L.STEP]
        lead = np.shape(step[L.TERMINATED])
        assert len(lead) == (1 if batch_mode == L.COMPLETE_EPISODES else 2)  # (T,) or (T, K)
        for k, (shape, dt) in spec.columns.items():
            step[k] = np.zeros((*lead, *shape), np.dtype(dt))


class MultiAgentPostprocessor:
    """A multi-agent actor's postprocessing (see the module doc): each hooked policy's hook and added columns.

    Args:
        specs: ``{policy_id: PostprocessSpec}`` from :func:`discover_policies` (a policy absent has no hook).
        policies: the loop's policies (``spec.hook`` None: the policy's own ``postprocess_trajectory``; every
            policy is the ``policy`` of its agents' entries in ``other_agent_batches``).
        rows: the loop's :class:`workers._agent_rows.AgentRows`.
        batch_mode: the pipelines'.
    """

    def __init__(self, specs: Mapping[Any, PostprocessSpec], policies: Mapping[Any, Any], rows: Any, *, batch_mode: str):
        unknown = sorted(str(pid) for pid in specs if pid not in rows.policies)
        if unknown:
            raise UsageError(f"postprocess: {unknown} are not policies of this loop ({sorted(map(str, rows.policies))})")
        self.hooks: dict[Any, Callable[..., Any]] = {}
        for pid, spec in specs.items():
            hook = spec.hook if spec.hook is not None else resolve(True, policies[pid])
            assert hook is not None  # resolve(True, ...) raises rather than give None
            self.hooks[pid] = hook
        self.columns = {pid: {k: (shape, np.dtype(dt)) for k, (shape, dt) in spec.columns.items()}
                        for pid, spec in specs.items()}
        self.policies = policies
        self.rows = rows
        self.mode = batch_mode
        # the added columns' values until the hook fills them: zeros, as many rows as a policy call may have
        self._zeros = {pid: {k: np.zeros((len(rows.policies[pid]), *shape), dt) for k, (shape, dt) in cols.items()}
                       for pid, cols in self.columns.items() if cols}
        # per env: its (agent, policy, row), to find an agent's others
        self._env_agents: dict[int, list[tuple[Any, Any, int]]] = {}
        for (e, agent), homes in rows.homes().items():  # a per-episode mapping: a row in every policy
            for pid, row in homes:
                self._env_agents.setdefault(e, []).append((agent, pid, row))
        self.calls = 0

    def wrap(self, calls: Mapping[Any, Callable[[Any], Any]]) -> dict[Any, Callable[[Any], Any]]:
        """The loop's numpy policies, those whose hook adds columns returning zeros for them as extras: the step leaves
        are written from the first step, and the hook overwrites them before the commit."""
        out = dict(calls)
        for pid, zeros in self._zeros.items():
            def policy(x: Any, call: Callable[[Any], Any] = calls[pid], zeros: dict[str, np.ndarray] = zeros) -> Any:
                action, extras = split_policy_output(call(x))
                n = np.shape(action)[0]
                return action, {**extras, **{k: z[:n] for k, z in zeros.items()}}

            out[pid] = policy
        return out

    def _given(self, pid: Any, step: Mapping[str, Any]) -> dict[str, str]:
        """Policy ``pid``'s columns given to a hook (RLlib's names and every extra): column -> step leaf."""
        cols = self.columns.get(pid, {})
        return {**RLLIB_COLUMNS, **{k: k for k in step if k not in L.STEP_KEYS and k != L.VALID and k not in cols}}

    def apply_round(self, views: Mapping[Any, Mapping[str, Any]], fills: Mapping[Any, Mapping[str, int]]) -> None:
        """Postprocess a round's rollouts (``views``: each policy's writer's slot views, filled as ``fills`` say), in
        place: every hooked policy's rows, piece by piece, with the other agents of the same env."""
        pre: dict[Any, tuple[dict[str, Any], np.ndarray]] = {}  # every policy's columns before any hook, and valid
        for pid, view in views.items():
            cols = self._columns(pid, view, fills[pid], L.TRUNCATE_EPISODES)
            pre[pid] = (cols, np.asarray(view[L.STEP][L.VALID][: int(fills[pid][L.STEP])]))
        windows: dict[tuple[int, int, int], dict[Any, Any]] = {}
        for pid, hook in self.hooks.items():
            step = views[pid][L.STEP]
            given = self._given(pid, step)
            cols, valid = pre[pid]
            done = np.asarray(step[L.TERMINATED][: len(valid)]) | np.asarray(step[L.TRUNCATED][: len(valid)])
            for row, (env_i, me) in enumerate(self.rows.policies[pid]):
                for t0, t1 in _pieces(valid[:, row], done[:, row]):
                    def piece(x: Any, t0: int = t0, t1: int = t1, row: int = row) -> Any:
                        return x[t0:t1, row]

                    batch: dict[str, Any] = {name: optree.tree_map(piece, step[leaf]) for name, leaf in given.items()}
                    batch[NEW_OBS] = optree.tree_map(lambda x: np.array(piece(x)), cols[NEW_OBS])  # its own: not
                    # the copy other agents' batches are cut from (a hook may write it)
                    batch[T_COLUMN] = np.arange(t0, t1)
                    self._call(pid, hook, step, given, batch, self._others(pre, env_i, me, t0, t1, windows), piece,
                               t1 - t0)

    def _others(self, pre: Mapping[Any, tuple[dict[str, Any], np.ndarray]], env_i: int, me: Any, t0: int, t1: int,
                windows: dict[tuple[int, int, int], dict[Any, Any]]) -> dict[Any, tuple[Any, Any, dict[str, Any]]]:
        """RLlib's ``other_agent_batches``: every other agent of env ``env_i`` with valid steps in ``t0 .. t1 - 1``,
        ``{agent: (policy_id, policy, batch of those steps)}``. The batches of a window are made once a round (in
        ``windows``) and shared by the calls of the agents of that env and window, as RLlib shares its batches."""
        every = windows.get((env_i, t0, t1))
        if every is None:
            every = windows[(env_i, t0, t1)] = {}
            for agent, pid, row in self._env_agents[env_i]:
                cols, valid = pre[pid]
                ts = t0 + np.flatnonzero(valid[t0:t1, row])
                if not len(ts):
                    continue

                def at(x: Any, ts: np.ndarray = ts, row: int = row) -> Any:
                    return x[ts, row]

                batch = {name: at(v) if type(v) is np.ndarray else optree.tree_map(at, v) for name, v in cols.items()}
                batch[T_COLUMN] = ts
                every[agent] = (pid, self.policies[pid], batch)
        return {agent: v for agent, v in every.items() if agent != me}

    def apply_env_episode(self, episodes: list[tuple[Any, Any, Mapping[str, Any], int, int]]) -> None:
        """Postprocess the agents' complete episodes of one env episode, in place: ``episodes`` is ``[(policy_id,
        agent, slot view, steps, first env step), ...]``, every agent of that env episode, and each hooked one's hook
        gets the others' whole episodes as ``other_agent_batches`` (copies, taken before any hook ran), ``t`` the env
        step from the env episode's start."""
        pre = []
        for pid, agent, view, n, t0 in episodes:
            cols = self._columns(pid, view, {L.STEP: n}, L.COMPLETE_EPISODES)
            cols[T_COLUMN] = t0 + np.arange(n)
            pre.append((agent, (pid, self.policies[pid], cols)))
        for pid, agent, view, n, t0 in episodes:
            hook = self.hooks.get(pid)
            if hook is None or not n:
                continue
            step = view[L.STEP]
            given = self._given(pid, step)

            def piece(x: Any, n: int = n) -> Any:
                return x[:n]

            batch: dict[str, Any] = {name: optree.tree_map(piece, step[leaf]) for name, leaf in given.items()}
            batch[NEW_OBS] = L.successors(view, {L.STEP: n}, batch_mode=L.COMPLETE_EPISODES)
            batch[T_COLUMN] = t0 + np.arange(n)
            self._call(pid, hook, step, given, batch, {a: v for a, v in pre if a != agent}, piece, n)

    def _columns(self, pid: Any, view: Mapping[str, Any], fill: Mapping[str, int], batch_mode: str) -> dict[str, Any]:
        """Policy ``pid``'s columns of a filled slot ``view`` as a hook sees them (each step's successor as
        ``new_obs``), copies taken before any hook runs: what ``other_agent_batches`` are cut from."""
        n = int(fill[L.STEP])
        step = view[L.STEP]
        cols: dict[str, Any] = {name: optree.tree_map(lambda x: np.array(x[:n]), step[leaf])
                                for name, leaf in self._given(pid, step).items()}
        cols[NEW_OBS] = L.successors(view, fill, batch_mode=batch_mode)
        return cols

    def _call(self, pid: Any, hook: Callable[..., Any], step: Mapping[str, Any], given: dict[str, str],
              batch: dict[str, Any], others: dict[Any, Any], piece: Callable[[Any], Any], n: int) -> None:
        """Call policy ``pid``'s hook on ``batch`` (``n`` steps, cut from ``step`` by ``piece``) and store the columns
        it adds or replaces back into the slot."""
        passed = dict(batch)
        who = f"policy {pid!r}: "
        out = call_hook(hook, batch, others, who=who, error=SchemaError)
        self.calls += 1
        store(self.columns[pid], step, out, passed, given, piece, n, who=who, derived=(NEW_OBS, T_COLUMN))


def _pieces(valid: np.ndarray, done: np.ndarray) -> list[tuple[int, int]]:
    """A row's episode pieces, ``(t0, t1)`` for steps ``t0 .. t1 - 1``: its runs of valid steps, each cut after a step
    recorded terminated or truncated."""
    out = []
    t0 = prev = -1
    for t in np.flatnonzero(valid).tolist():
        if t0 >= 0 and t != prev + 1:  # a gap without an end (the loop never makes one: an agent leaves by ending)
            out.append((t0, prev + 1))
            t0 = -1
        if t0 < 0:
            t0 = t
        if done[t]:
            out.append((t0, t + 1))
            t0 = -1
        prev = t
    if t0 >= 0:
        out.append((t0, prev + 1))
    return out


def trained_policies(policies_to_train: Any, pids: list[Any], name: str = "policies_to_train") -> list[Any]:
    """The policy ids ``policies_to_train`` selects from ``pids`` (RLlib's setting: None, ids, or ``id -> bool``;
    ``name``: the setting as the user gave it, RLlib's ``policies_to_train`` or the engine's ``trained``).

    Raises:
        UsageError: an id that is not a policy, a function that is not one of an id, or none selected.
    """
    if policies_to_train is None:
        return list(pids)
    if callable(policies_to_train):
        try:
            chosen = [pid for pid in pids if policies_to_train(pid, None)]  # RLlib's (policy_id, batch)
        except TypeError:
            chosen = [pid for pid in pids if policies_to_train(pid)]
    elif isinstance(policies_to_train, (list, tuple, set, frozenset)):
        unknown = sorted(str(pid) for pid in policies_to_train if pid not in pids)
        if unknown:
            raise UsageError(f"{name}: {unknown} are not in policies ({sorted(map(str, pids))})")
        chosen = [pid for pid in pids if pid in policies_to_train]
    else:
        raise UsageError(f"{name}: expected policy ids or a function of one, got {policies_to_train!r:.80}")
    if not chosen:
        raise UsageError(f"{name}: no policy selected (policies: {sorted(map(str, pids))}); a collector "
                                "with nothing to hand out has nothing to do")
    return chosen
