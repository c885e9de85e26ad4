"""RLlib's ``Policy.postprocess_trajectory`` in the actor: called on every episode piece of a rollout, before its commit.

RLlib calls ``policy.postprocess_trajectory(sample_batch, other_agent_batches, episode)`` at the end of
every rollout fragment and of every episode, so that one call never sees two episodes' data; the columns
it adds (advantages, value targets, ...) travel with the rollout. Here the same: right before a rollout
is committed (:meth:`workers.ActorLoop._before_commit`), the rollout in the writer's slot is cut into
pieces, one per (sub-env, episode piece): a piece ends at a step recorded ``terminated`` or
``truncated``, at a soft horizon (RLlib starts a new episode there too), or at the rollout's last step.
Each piece is handed to the hook as a dict in RLlib's ``SampleBatch`` column names, numpy:

- ``obs``, ``actions``, ``rewards``, ``terminateds``, ``truncateds`` and every policy extra under its own
  name (``vf_preds``, ``action_logp``, ...): views of the slot (an in-place change is stored);
- ``new_obs``: each step's true successor (the episode's final observation where it ended, the
  bootstrap observation at the rollout's last step): a new array, not stored.

The columns the hook adds are written into the slot, as step leaves of the pipeline: a shmbuf pipeline's
layout is fixed before collection, so they are found at set-up (:func:`discover`), by calling the hook
once on a dummy batch, as RLlib does at policy init for the same reason. A column it replaces that is
a step leaf is copied back; ``other_agent_batches`` and ``episode`` are None (one agent; no Episode
object).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

from shmbuf import SchemaError, UsageError
from shmbuf import layout as L
from workers._policy import split_policy_output

METHOD = "postprocess_trajectory"  # RLlib's Policy method
NEW_OBS = "new_obs"
# RLlib's SampleBatch column -> the step leaf it is
RLLIB_COLUMNS = {"obs": L.OBS, "actions": L.ACTION, "rewards": L.REWARD, "terminateds": L.TERMINATED, "truncateds": L.TRUNCATED}
DUMMY_STEPS = 2


@dataclass(frozen=True)
class PostprocessSpec:
    """What an actor needs to postprocess (pickled to it): the hook, and the columns it adds.

    ``hook``: a callable ``(sample_batch, other_agent_batches, episode) -> sample_batch``, or None: the
    actor's own policy's ``postprocess_trajectory``. ``columns``: added column -> (item shape, dtype
    string), as found by :func:`discover`.
    """

    hook: Callable[..., Any] | None
    columns: dict[str, tuple[tuple[int, ...], str]]


def check_setting(postprocess: Any, name: str = "postprocess") -> None:
    """UsageError unless ``postprocess`` is None, a bool, or a callable; ``name``: the setting as the user gave it
    (RLlib's ``postprocess``, or the engine's ``episode_hook``)."""
    if postprocess is not None and not isinstance(postprocess, bool) and not callable(postprocess):
        raise UsageError(f"{name}: expected None (the policy's {METHOD} if it has one), True (it must have one), "
                         f"False (none), or a callable (sample_batch, other_agent_batches, episode) -> sample_batch; "
                         f"got {postprocess!r:.80}")


def resolve(postprocess: Any, policy: Any, name: str = "postprocess") -> Callable[..., Any] | None:
    """The hook a setting names for ``policy``: a callable setting itself, else the policy's method (or None)."""
    check_setting(postprocess, name)
    if postprocess is False:
        return None
    if callable(postprocess) and not isinstance(postprocess, bool):
        return postprocess
    method = getattr(policy, METHOD, None)
    if method is None and postprocess is True:
        raise UsageError(f"{name}=True: the policy ({type(policy).__name__}) has no {METHOD} method; define "
                         f"{METHOD}(self, sample_batch, other_agent_batches=None, episode=None), or pass the function "
                         f"as {name}=")
    if method is not None and not callable(method):
        raise UsageError(f"the policy's {METHOD} is not callable: {method!r:.80}")
    return method


def call_hook(hook: Callable[..., Any], batch: dict[str, Any], others: Any = None, *, who: str = "",
              error: type[Exception] = UsageError) -> Mapping[str, Any]:
    """``hook(batch, others, None)``, checked to return a mapping (``error`` otherwise; ``who`` prefixes the message)."""
    out = hook(batch, others, None)
    if not isinstance(out, Mapping):
        raise error(f"{who}{METHOD} returned {type(out).__name__}; as in RLlib it must return the (postprocessed) "
                    "sample batch, e.g. `return sample_batch`")
    return out


def dummy_batch(obs: Any, action: Any, extras: Mapping[str, Any], n: int = DUMMY_STEPS) -> dict[str, Any]:
    """A batch of ``n`` steps of zeros in RLlib's column names, from one item of each step leaf (no episode end)."""
    def rows(x: Any) -> Any:
        return optree.tree_map(lambda a: np.zeros((n, *np.shape(a)), np.asarray(a).dtype), x)

    batch: dict[str, Any] = {"obs": rows(obs), "actions": rows(action), "rewards": np.zeros(n, np.float32),
                             "terminateds": np.zeros(n, bool), "truncateds": np.zeros(n, bool), NEW_OBS: rows(obs)}
    batch.update({k: rows(v) for k, v in extras.items()})
    return batch


def added_columns(out: Mapping[str, Any], given: set[str], extras: Mapping[str, Any], n: int, *,
                  who: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """The columns a hook added to a dummy batch of ``n`` steps (``given``: its columns), as (item shape, dtype).

    Raises:
        UsageError: an added column that is not a numeric array with one row per step, or whose name is a step
            leaf or a policy extra.
    """
    columns: dict[str, tuple[tuple[int, ...], str]] = {}
    for k, v in out.items():
        if k in given:
            continue
        if not isinstance(k, str) or not k or "/" in k:
            raise UsageError(f"{who}{METHOD} added column {k!r}: a column name is a non-empty str without '/'")
        if k in L.STEP_KEYS or k in extras:
            raise UsageError(f"{who}{METHOD} added column {k!r}, which is already a step leaf; rename it")
        a = np.asarray(v)
        if a.ndim < 1 or a.shape[0] != n or a.dtype.kind not in "biufc":
            raise UsageError(f"{who}{METHOD} added column {k!r}: expected a numeric array with one row per step "
                             f"({n} on the dummy batch), got {a.dtype} {a.shape}")
        columns[k] = (tuple(a.shape[1:]), a.dtype.str)
    return columns


def discover(postprocess: Any, policy: Any, probed: Mapping[str, Any], name: str = "postprocess") -> PostprocessSpec | None:
    """Call the hook once on a dummy batch of :data:`DUMMY_STEPS` steps built from the probe's templates (zeros,
    no episode end) and return the columns it adds, or None when there is no hook.

    Raises:
        UsageError: a bad setting; an added column that is not an array with one row per step, or whose
            name is a step leaf or a policy extra.
    """
    hook = resolve(postprocess, policy, name)
    if hook is None:
        return None
    extras = dict(probed.get("extras") or {})
    batch = dummy_batch(probed[L.OBS], probed[L.ACTION], extras)
    given = set(batch)
    columns = added_columns(call_hook(hook, batch), given, extras, DUMMY_STEPS)
    return PostprocessSpec(hook if callable(postprocess) and not isinstance(postprocess, bool) else None, columns)


def template(spec: PostprocessSpec) -> dict[str, np.ndarray]:
    """One item of each added column (no env dim): the extras they add to the pipeline's example."""
    return {k: np.zeros(shape, np.dtype(dt)) for k, (shape, dt) in spec.columns.items()}


class Postprocessor:
    """An actor's postprocessing: the hook, the added columns, and how its rollouts are laid out.

    Args:
        spec: from :func:`discover` (in the process that made the pipeline).
        policy: the actor's policy (its ``postprocess_trajectory`` when ``spec.hook`` is None).
        num_envs, vector: the actor's sub-envs, and whether the step leaves have an env dim.
        batch_mode: the pipeline's.
    """

    def __init__(self, spec: PostprocessSpec, policy: Any, *, num_envs: int, vector: bool, batch_mode: str):
        hook = spec.hook if spec.hook is not None else resolve(True, policy)
        assert hook is not None  # resolve(True, ...) raises rather than give None
        self.hook = hook
        self.columns = {k: (shape, np.dtype(dt)) for k, (shape, dt) in spec.columns.items()}
        self.E = num_envs
        self.vector = vector
        self.mode = batch_mode
        # what the policy's extras carry for the added columns until the hook fills them (one row per sub-env)
        self._zeros = {k: np.zeros((num_envs, *shape), dt) for k, (shape, dt) in self.columns.items()}
        self.calls = 0

    def with_placeholders(self, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``call`` (a numpy policy) whose extras also hold zeros for the added columns: the step leaves exist
        from the first step, and the hook overwrites them before the commit."""
        zeros = self._zeros

        def policy(obs: Any) -> Any:
            action, extras = split_policy_output(call(obs))
            return action, {**extras, **zeros}

        return policy

    def pieces(self, tree: Mapping[str, Any], fill: Mapping[str, int]) -> list[tuple[int, int, int]]:
        """``(env, t0, t1)`` of every episode piece of the rollout, steps ``t0 .. t1 - 1``, env by env in time order."""
        n = int(fill[L.STEP])
        if self.mode == L.COMPLETE_EPISODES:
            return [(0, 0, n)] if n else []
        step = tree[L.STEP]
        done = np.asarray(step[L.TERMINATED])[:n] | np.asarray(step[L.TRUNCATED])[:n]
        done = done.reshape(n, -1)
        ep = tree[L.EPISODE]
        k = int(fill[L.EPISODE])
        soft = ~(np.asarray(ep[L.TERMINATED])[:k] | np.asarray(ep[L.TRUNCATED])[:k])
        ends = done.copy()
        ends[np.asarray(ep[L.END])[:k][soft], np.asarray(ep[L.ENV])[:k][soft]] = True
        out = []
        for e in range(ends.shape[1]):
            t0 = 0
            for t in np.flatnonzero(ends[:, e]).tolist():
                out.append((e, t0, t + 1))
                t0 = t + 1
            if t0 < n:
                out.append((e, t0, n))
        return out

    def apply(self, tree: Mapping[str, Any], fill: Mapping[str, int]) -> None:
        """Postprocess the rollout in ``tree`` (the writer's slot views), filled as ``fill`` says, in place."""
        step = tree[L.STEP]
        new_obs = L.successors(tree, fill, batch_mode=self.mode)
        given = {**RLLIB_COLUMNS, **{k: k for k in step if k not in L.STEP_KEYS and k not in self.columns}}
        for e, t0, t1 in self.pieces(tree, fill):
            def piece(x: Any, e: int = e, t0: int = t0, t1: int = t1) -> Any:
                return x[t0:t1, e] if self.vector else x[t0:t1]

            batch = {name: optree.tree_map(piece, step[leaf]) for name, leaf in given.items()}
            batch[NEW_OBS] = optree.tree_map(piece, new_obs)
            passed = dict(batch)
            out = call_hook(self.hook, batch)
            self.calls += 1
            store(self.columns, step, out, passed, given, piece, t1 - t0)


def store(columns: Mapping[str, tuple[tuple[int, ...], np.dtype]], step: Mapping[str, Any], out: Mapping[str, Any],
          passed: Mapping[str, Any], given: Mapping[str, str], piece: Callable[[Any], Any], length: int, *,
          who: str = "", derived: tuple[str, ...] = (NEW_OBS,)) -> None:
    """Check every column of a hook's output ``out`` to store, then write them all into the step leaves ``step``
    (``piece`` selects a piece's steps of a leaf, as views): the added ``columns``, and the replaced step leaves
    (``given``: column -> step leaf; ``passed``: what the hook was given; ``derived``: columns given but not stored).
    ``who`` prefixes the messages."""
    todo = []
    for k, (shape, dt) in columns.items():
        if k not in out:
            raise SchemaError(f"{who}{METHOD} did not add column {k!r} on this piece of {length} steps; it added it at "
                              "set-up (the pipeline has it as a step leaf): add it on every call")
        todo.append((k, piece(step[k]), checked(k, out[k], (length, *shape), dt, who=who)))
    for k, v in out.items():
        if k in columns or (k in passed and v is passed[k]):
            continue
        if k in derived:
            raise UsageError(f"{who}{METHOD} replaced {k!r}: it is derived from obs and the episode table, not "
                             "stored; change 'obs' instead, or add a column of your own")
        if k not in given:
            raise SchemaError(f"{who}{METHOD} added column {k!r}, which it did not add at set-up (on the dummy batch): "
                              "the pipeline's layout has no room for it; add it on every call, the first included")
        dst = optree.tree_map(piece, step[given[k]])
        if isinstance(dst, np.ndarray):
            todo.append((k, dst, checked(k, v, dst.shape, dst.dtype, who=who)))
    for _, dst, x in todo:
        dst[...] = x


def checked(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype, *, who: str = "") -> np.ndarray:
    """``value`` as an array, SchemaError unless it has ``shape`` and casts to ``dtype``."""
    a = np.asarray(value)
    if a.shape != shape or not np.can_cast(a.dtype, dtype, "same_kind"):
        raise SchemaError(f"{who}{METHOD}: column {name!r}: expected {dtype} {shape} (one row per step of the piece), "
                          f"got {a.dtype} {a.shape}")
    return a
