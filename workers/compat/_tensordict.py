"""A collector batch as a TorchRL ``TensorDict``: TorchRL's keys over the batch's own arrays.

:func:`to_tensordict` turns a :class:`workers.CollectedBatch` (from :class:`workers.Collector` or the
batched-inference collector: same class, same layout) into the layout TorchRL's collectors produce and its
loss modules and value estimators read, so that ``ClipPPOLoss`` or ``GAE`` run on it unchanged::

    observation                 (*batch, ...)   the observation the action was taken on
    action                      (*batch, ...)
    <extra>                     (*batch, ...)   each policy extra (log-prob, value, ...) under its own name
    policy_version              (*batch,)       the weights version that chose each action
    next/observation            (*batch, ...)   the successor: obs[t + 1], the final obs at an episode's end,
                                                the bootstrap obs at a rollout's last stored step
    next/reward                 (*batch, 1)
    next/terminated             (*batch, 1)
    next/truncated              (*batch, 1)
    next/done                   (*batch, 1)     terminated | truncated
    collector/traj_ids          (*batch,)       int64, one id per trajectory in this batch; -1 on padding
    collector/mask              (*batch,)       truncate-episodes only: False on padding (steps past a fill)

``*batch`` is ``(B, T)`` (single envs), ``(B, E, T)`` (vector envs) or ``(N,)`` (complete-episodes, every
episode's steps concatenated, as TorchRL's ``traj_format="cat"``): time last, as TorchRL has it. A dict
observation gives one root entry per key (as TorchRL's gym wrappers do), and each under ``next``. The names
are TorchRL 0.14's: ``policy_version`` at the root (its ``AsyncBatchedCollector`` and ``track_policy_version``
put it there), ``("collector", "traj_ids")`` -1 and ``("collector", "mask")`` False on invalid frames.
torch and tensordict are imported when the function is called.

What this does not do: move to a device (``td.to(device)`` copies), number trajectories across batches
(ids restart at 0 in each batch), or add TorchRL's root ``done``/``terminated``/``truncated`` (the flags of
the observation itself; no loss module reads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import optree

from shmbuf import SchemaError, UsageError
from shmbuf import layout as L

# TorchRL's entry names for the flags: TorchRL's words (they happen to be the layout's too), so spelled here.
FLAGS = ("terminated", "truncated")
RESERVED = (*L.STEP_KEYS, "policy_version")  # step leaves with a TorchRL name of their own


def _imports() -> tuple[Any, Any, Any]:
    try:
        import torch
        from tensordict import TensorDict

        from shmbuf.storage import to_torch
    except ImportError as e:
        raise UsageError(f"to_tensordict needs tensordict and torch ({e}): pip install tensordict") from e
    return torch, TensorDict, to_torch


def _paths(tree: Any, what: str) -> tuple[list[tuple[str, ...]], list[np.ndarray], Any]:
    """Leaves of ``tree`` with their key paths; an array is one leaf at ``()``. Dict keys must be strings."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    for p in paths:
        if not all(isinstance(k, str) for k in p):
            raise UsageError(f"{what}: a TensorDict key is made of strings, and leaf {'/'.join(map(str, p))!r} sits under "
                             f"a list or tuple index; use a dict")
    return [tuple(p) for p in paths], [np.asarray(x) for x in leaves], spec


def _same_tree(spec: Any, tree: Any, what: str) -> None:
    got = optree.tree_structure(tree)
    if got != spec:
        raise SchemaError(f"{what}: expected the step observation's structure {spec}, got {got}")


def _flag_leaves(step: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    term, trunc = np.asarray(step[L.TERMINATED]), np.asarray(step[L.TRUNCATED])
    if term.shape != trunc.shape:
        raise SchemaError(f"step leaves 'terminated' {term.shape} and 'truncated' {trunc.shape} differ in shape")
    return term, trunc


def _names(step: Mapping[str, Any], obs_paths: list[tuple[str, ...]], rename: Mapping[str, str]) -> dict[str, str]:
    """Default root name -> the name to use; checks ``rename`` names known entries and makes no clash."""
    obs_names = ["observation"] if obs_paths == [()] else sorted({p[0] for p in obs_paths})
    extras = [k for k in step if k not in RESERVED]
    known = [*obs_names, "action", *extras, "policy_version", "reward", "done", *FLAGS]
    if not isinstance(rename, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rename.items()):
        raise UsageError(f"rename: expected a dict of entry name -> new name (strings), got {rename!r}")
    unknown = sorted(set(rename) - set(known))
    if unknown:
        raise UsageError(f"rename: {unknown} name no entry of this batch; the entries are {known}")
    names = {k: rename.get(k, k) for k in known}
    root = [names[k] for k in (*obs_names, "action", *extras, "policy_version")]
    nxt = [names[k] for k in (*obs_names, "reward", "done", *FLAGS)]
    for where, got in (("the root", root + ["next", "collector"]), ("'next'", nxt)):
        dup = sorted({n for n in got if got.count(n) > 1})
        if dup:
            raise UsageError(f"rename: {dup} would name two entries of {where} (from {known}); give distinct names")
    return names


def _next_obs(g: L.Grid, path: tuple[str, ...], leaf: np.ndarray) -> np.ndarray:
    """``next/observation`` of one obs leaf in TorchRL order, a new array (:meth:`shmbuf.layout.Grid.successors`:
    one vectorised pass). Vector envs: allocated ``(B, E, T, ...)`` and written through a ``(B, T, E, ...)`` view,
    so that the tensor is contiguous in TorchRL's order."""
    if not (g.batched and g.vector):
        return g.from_bte(g.successors(path))
    out = np.empty((g.B, g.E, g.T, *leaf.shape[3:]), leaf.dtype)
    g.successors(path, out=np.swapaxes(out, 1, 2))
    return out


def _traj_ids(done_c: np.ndarray, filled: np.ndarray, vector: bool) -> np.ndarray:
    """One id per trajectory (a run of steps of one sub-env ending at a done or at the rollout's last stored step),
    numbered in TorchRL order; -1 on padding. ``done_c``: ``(B, T, E)``, ``filled``: ``(B, T)``."""
    d = np.moveaxis(done_c, 2, 1)  # (B, E, T)
    f = np.broadcast_to(filled[:, None, :], d.shape)
    starts = np.zeros(d.shape, bool)
    starts[..., 0] = True
    starts[..., 1:] = d[..., :-1]
    starts &= f
    ids = np.cumsum(starts.reshape(-1), dtype=np.int64).reshape(d.shape) - 1
    ids[~f] = -1
    return ids if vector else ids[:, 0]


class _Parts(NamedTuple):
    """What differs between the two batch modes; arrays in the batch's layout unless said otherwise."""

    batch_size: tuple[int, ...]
    vector: bool  # step leaves (B, T, E, ...), shown as (B, E, T, ...)
    truncated: np.ndarray  # the step leaf, or a copy with short rollouts' cuts marked
    done: np.ndarray
    traj_ids: np.ndarray  # TorchRL order
    mask: np.ndarray | None  # TorchRL order
    version: np.ndarray | None  # TorchRL order: from batch.policy_version (per rollout)


def _truncated(batch: Any, g: L.Grid, term: np.ndarray, trunc: np.ndarray) -> _Parts:
    B, T, E, vector, n = g.B, g.T, g.E, g.vector, g.n
    short = np.flatnonzero((n > 0) & (n < T))
    if short.size:  # mark each cut (see to_tensordict's doc): on a copy, never in the batch
        trunc = trunc.copy()
        last = n[short] - 1
        g.as_bte(trunc)[short, last] |= ~g.as_bte(term)[short, last]
    filled = np.arange(T)[None, :] < n[:, None]
    done = term | trunc
    order = (B, E, T) if vector else (B, T)
    mask = np.ascontiguousarray(np.broadcast_to(filled[:, None, :], order)) if vector else filled
    version = None
    if batch.policy_version is not None:
        pv = np.asarray(batch.policy_version, np.int64).reshape(B, *(1,) * (len(order) - 1))
        version = np.ascontiguousarray(np.broadcast_to(pv, order))
    return _Parts(tuple(order), vector, trunc, done, _traj_ids(g.as_bte(done), filled, vector), mask, version)


def _complete(batch: Any, g: L.Grid, term: np.ndarray, trunc: np.ndarray) -> _Parts:
    """A complete-episodes batch: steps concatenated, ``(N, ...)``, one episode per ``batch.lengths`` entry."""
    lengths = g.lengths
    if lengths is None:  # grid() reads them only from a complete-episodes batch with no fill
        raise UsageError("a complete-episodes batch needs batch.lengths (each episode's length) and no fill, got "
                         f"lengths=None, fill={getattr(batch, 'fill', None)!r:.80}")
    R, N = len(lengths), g.T
    version = None
    if batch.policy_version is not None:
        version = np.repeat(np.asarray(batch.policy_version, np.int64).reshape(R), lengths)
    traj = np.repeat(np.arange(R, dtype=np.int64), lengths)
    return _Parts((N,), False, trunc, term | trunc, traj, None, version)


def to_tensordict(batch: Any, /, *, rename: Mapping[str, str] | None = None) -> Any:
    """The batch in TorchRL's layout, a ``tensordict.TensorDict`` over the batch's own arrays (see the module doc).

    Args:
        batch: a :class:`workers.CollectedBatch` (truncate- or complete-episodes).
        rename: ``{entry name: new name}`` for root entries and their ``next`` twins: ``"observation"`` (or a dict
            observation's keys), ``"action"``, a policy extra, ``"reward"``, ``"done"``, ``"terminated"``,
            ``"truncated"``, ``"policy_version"``; e.g. ``{"logp": "action_log_prob", "value": "state_value"}``
            for the names ``ClipPPOLoss`` reads by default.

    Views and copies (CPU): ``observation``, ``action``, the extras, ``policy_version`` (when the batch has it as
    a step leaf), ``next/reward``, ``next/terminated`` and ``next/truncated`` share memory with the batch's arrays
    (``torch.from_numpy``; vector envs: a permuted view, ``(B, T, E)`` seen as ``(B, E, T)``; the flags and the
    reward get their trailing 1 as a view). New arrays: ``next/observation`` (its values at episode ends and at
    rollout ends are not in the step leaf: built in one vectorised pass, a shifted copy plus scatters of the
    bootstrap rows and the episode table's final observations, no Python loop), ``next/done`` (computed), the
    ``collector`` entries, and ``policy_version`` when it comes from the per-rollout ``batch.policy_version``
    (each rollout of :class:`workers.Collector` is collected by one weights version). A read-only array is
    copied (torch cannot share it read-only).

    Short rollouts (truncate-episodes, ``fill < T``): steps past the fill are padding (``collector/mask``
    False, ``traj_ids`` -1, ``next/observation`` zeros). So that a value estimator over the time axis never
    reads padding as the continuation, the last stored step of a short rollout is marked ``truncated`` (and
    ``done``) unless it was terminated, as TorchRL's ``set_truncated`` does at a rollout's end: its
    ``next/observation`` is the true successor, so GAE bootstraps from it. ``next/truncated`` is then a copy.
    Select ``td[td["collector", "mask"]]`` (a copy) before a loss when there is padding.

    Lifetime: the views are valid as long as the batch's arrays: with ``Collector(copy=False)`` (the default)
    until the next batch is taken, which overwrites them in place; keep ``td.clone()`` (or use
    ``copy=True``) for what must live longer. Writing into a view writes into the batch.

    Raises:
        shmbuf.UsageError: tensordict or torch is missing, a bad ``rename``, a batch without its counts.
        shmbuf.SchemaError: leaves whose shapes do not fit the workers rollout layout.
    """
    torch, TensorDict, to_torch = _imports()
    mode = getattr(batch, "batch_mode", None)
    data = getattr(batch, "data", None)
    if mode not in L.BATCH_MODES or not isinstance(data, Mapping) or L.STEP not in data:
        raise UsageError(f"to_tensordict: expected a workers.CollectedBatch (with data['step'] and a batch_mode), got "
                         f"{type(batch).__name__} with batch_mode={mode!r}")
    step = data[L.STEP]
    missing = [k for k in (L.OBS, L.ACTION, L.REWARD, *L.FLAG_KEYS) if k not in step]
    if missing:
        raise SchemaError(f"step leaves {missing} are missing; the workers rollout layout has obs, action, reward, "
                          f"terminated, truncated (and policy extras), got {sorted(step)}")
    obs_paths, obs_leaves, obs_spec = _paths(step[L.OBS], "obs")
    names = _names(step, obs_paths, dict(rename or {}))
    _same_tree(obs_spec, data[L.BOOTSTRAP][L.OBS], "bootstrap obs")
    fill = batch.fill
    if mode == L.TRUNCATE_EPISODES:
        if not isinstance(fill, Mapping) or L.STEP not in fill or L.EPISODE not in fill:
            raise UsageError(f"a truncate-episodes batch needs batch.fill with 'step' and 'episode' counts, got {fill!r}")
        _same_tree(obs_spec, data[L.EPISODE][L.FINAL_OBS], "episode final_obs")
    g = L.grid(batch)
    term, trunc = _flag_leaves(step)
    parts = _truncated(batch, g, term, trunc) if mode == L.TRUNCATE_EPISODES else _complete(batch, g, term, trunc)
    nexts = [_next_obs(g, p, o) for p, o in zip(obs_paths, obs_leaves, strict=True)]

    def tl(x: Any) -> Any:  # a step leaf with time last: (B, T, E, ...) -> (B, E, T, ...) as a view
        t = to_torch(np.asarray(x))
        return t.transpose(1, 2) if parts.vector else t

    td = TensorDict({}, batch_size=list(parts.batch_size))
    for p, o, nx in zip(obs_paths, obs_leaves, nexts, strict=True):
        key = (names["observation"],) if p == () else (names[p[0]], *p[1:])
        td.set(key, tl(o))
        td.set(("next", *key), torch.from_numpy(nx))
    for name in [L.ACTION, *(k for k in step if k not in RESERVED)]:
        for p, leaf in zip(*_paths(step[name], name)[:2]):
            td.set((names[name], *p), tl(leaf))
    if "policy_version" in step:
        td.set(names["policy_version"], tl(step["policy_version"]))
    elif parts.version is not None:
        td.set(names["policy_version"], torch.from_numpy(parts.version))
    td.set(("next", names["reward"]), tl(step[L.REWARD]).unsqueeze(-1))
    td.set(("next", names["done"]), tl(parts.done).unsqueeze(-1))
    td.set(("next", names["terminated"]), tl(term).unsqueeze(-1))
    td.set(("next", names["truncated"]), tl(parts.truncated).unsqueeze(-1))
    td.set(("collector", "traj_ids"), torch.from_numpy(parts.traj_ids))
    if parts.mask is not None:
        td.set(("collector", "mask"), torch.from_numpy(parts.mask))
    return td
