"""Actor-side trajectory views: a policy's input at every step, built from view requirements (RLlib's compute-actions views).

The learner builds the same columns from the stored rollout with ``shmbuf.storage.build_views``; the
rule both follow (docs/views.md): the value at step ``t`` is ``data[t + offset]`` of the same episode;
before the episode's first step, RLlib's fill: its first observation for ``obs``, zeros for every other
column (``ViewRequirement(fill="zeros")``: zeros for ``obs`` too). Here each column keeps a ring of its newest values per sub-env,
allocated once, so that a window is a view of the ring (see :class:`_Ring`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

from shmbuf import UsageError

# The step leaves (the columns a view can read, with policy extras); the flags are per step and never observations.
from shmbuf import layout as L

FIRST = "first"  # ViewRequirement.fill_rule's name for RLlib's fill of observations (shmbuf.storage.views.FIRST)


def _item_template(space: Any, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of one sub-env's item from a space-like (gymnasium Space, array); UsageError if it has none."""
    shape = getattr(space, "shape", None)
    dtype = getattr(space, "dtype", None)
    if shape is None or dtype is None:
        raise UsageError(f"{what}: its space {space!r} has no shape and dtype (a Dict or Tuple space?); views of pytree "
                         "actions and extras are not supported: give space= an array-like item (e.g. np.zeros((), np.int64))")
    return tuple(int(d) for d in shape), np.dtype(dtype)


class _Ring:
    """The newest ``L`` values of one array column for every sub-env, each kept twice so that any window is a view.

    ``buf`` is ``(E, 2L, ...)``: the n-th value pushed sits at ``n % L`` and ``n % L + L``, so the newest
    ``L`` values, oldest first, are ``buf[:, p:p + L]`` (``p``: the next write position), a basic slice.
    Position ``p + L - 1`` holds the value at offset ``newest`` (0 for ``obs``, which is pushed before the
    policy acts; -1 for what a step produces). Where a sub-env's episode starts, its rows are zeroed, or with
    ``first`` (an ``obs`` ring under RLlib's fill) filled with the episode's first value at its push, so a
    position before the start reads as the fill value without any mask. Allocated once.
    """

    def __init__(self, num_envs: int, depth: int, item_shape: tuple[int, ...], dtype: Any, newest: int,
                 first: bool = False):
        self.L = depth
        self.newest = newest
        self.buf = np.zeros((num_envs, 2 * depth, *item_shape), dtype)
        self.p = 0
        self.first = first
        self.fresh = np.ones(num_envs, bool) if first else None  # sub-envs whose next push starts an episode

    def push(self, value: Any) -> None:
        """Append one value per sub-env (``(E, ...)``); views handed out before now are stale from here on."""
        L, p = self.L, self.p
        self.buf[:, p] = value
        self.buf[:, p + L] = value
        self.p = (p + 1) % L
        fresh = self.fresh
        if fresh is not None and fresh.any():  # an episode's first value: it is also every position before it
            self.buf[fresh] = np.asarray(value)[fresh][:, None]
            fresh[:] = False

    def clear(self, rows: np.ndarray) -> None:
        """The sub-envs where ``rows`` start a new episode: zero their history (or, with ``first``, fill it with the
        next value pushed)."""
        if self.fresh is not None:
            self.fresh |= rows
        else:
            self.buf[rows] = 0

    def position(self, offset: int) -> int:
        """Index on axis 1 of the value at ``offset`` (at least ``newest - L + 1``)."""
        return self.p + self.L - 1 + offset - self.newest


class _View:
    """One requirement over one leaf ring: its offsets, and how to read them (a view, or a take into ``out``)."""

    def __init__(self, ring: _Ring, offsets: tuple[int, ...], windowed: bool):
        self.ring = ring
        self.offsets = offsets
        self.windowed = windowed
        first = offsets[0]
        self.contiguous = offsets == tuple(range(first, first + len(offsets)))
        self.rel = np.asarray(offsets, np.intp) - offsets[0]
        self.idx = np.empty(len(offsets), np.intp)
        self.out = None
        if windowed and not self.contiguous:
            b = ring.buf
            self.out = np.empty((b.shape[0], len(offsets), *b.shape[2:]), b.dtype)

    def read(self) -> np.ndarray:
        """``(E, ...)`` or ``(E, W, ...)``: a view of the ring (int shifts, ranges) or ``out`` (other lists)."""
        ring = self.ring
        start = ring.position(self.offsets[0])
        if not self.windowed:
            return ring.buf[:, start]
        if self.contiguous:
            return ring.buf[:, start : start + len(self.offsets)]
        np.add(self.rel, start, out=self.idx)
        return np.take(ring.buf, self.idx, axis=1, out=self.out, mode="clip")  # clip: indices are in range; no buffering


class ActorViews:
    """The policy's input dict under view requirements, from per-sub-env history rings (RLlib's compute-actions views).

    For every requirement ``name -> ViewRequirement(data_col, shift)``: the column at the current step
    ``t`` plus each offset, batched over sub-envs: ``(E, ...)`` for an int shift, ``(E, W, ...)`` for a
    list or a range (the offsets on the new axis, in their order). A position before the sub-env's
    episode start holds RLlib's fill (:meth:`ViewRequirement.fill_rule`): the episode's first observation
    for ``obs``, zeros (:meth:`ViewRequirement.fill_value`) for every other column; never the previous
    episode's data.
    Episodes start where the *recorded* ``terminated | truncated`` was set (what :meth:`advance` gets),
    so the learner building views from the stored rollout with the same requirements finds the same
    boundaries; a soft horizon is no boundary (nothing is recorded there).
    A requirement's ``batch_repeat_value`` (RLlib's) shapes learner-side training columns only: the
    input is built at every step whatever it says, as RLlib builds its compute-actions views.

    Columns: ``obs`` (offsets ``<= 0``: 0 is the observation the policy acts on), and ``action``,
    ``reward``, ``terminated``, ``truncated`` or a policy extra (offsets ``<= -1``: step ``t``'s own
    value is what the policy is computing). Their item shape and dtype: ``obs`` from the first
    observation; ``reward`` float32, the flags bool (as stored); ``action`` from the requirement's
    ``space`` or the env's action space, an extra from its requirement's ``space`` (needed before the
    policy's first output); both are checked against that first output.

    Memory: one ring per column (per leaf for pytree observations) of ``2 * depth`` items per sub-env,
    depth the column's largest look-back, allocated once. Per step: one push per column (two copies of
    a row), zeroing the rows of sub-envs whose episode ended.

    Lifetime: what :meth:`inputs` returns are views of the rings (int shifts, ranges) or a preallocated
    array (non-contiguous lists), valid until the next :meth:`advance`, i.e. during the policy's call:
    copy what the policy keeps.
    """

    def __init__(self, requirements: Any, obs: Any, num_envs: int, action_space: Any = None):
        self.requirements = check_view_requirements(requirements)
        self.E = int(num_envs)
        # one set of rings per (column, fill rule): obs under RLlib's fill ("first") and under "zeros" differ
        self._ring_of = {key: (vr.column(key), vr.fill_rule(key)) for key, vr in self.requirements.items()}
        depth: dict[tuple[str, str], int] = {}
        space: dict[str, Any] = {}
        for key, vr in self.requirements.items():
            rk = self._ring_of[key]
            depth[rk] = max(depth.get(rk, 0), -min(vr.offsets))
            if vr.space is not None and rk[0] not in space:
                space[rk[0]] = vr.space
        self.columns = sorted(depth)
        self._checked = False
        self._origin = {col: "its requirement's space=" if col in space else "the env's action space" for col, _ in depth}
        self.rings: dict[tuple[str, str], tuple[Any, list[_Ring]]] = {}
        for col, rule in self.columns:
            self.rings[col, rule] = self._make_rings(col, depth[col, rule], obs,
                                                     space.get(col, action_space if col == L.ACTION else None), rule)
        for key, vr in self.requirements.items():
            self._check_fill(key, vr)
        self.views = {key: [_View(r, vr.offsets, vr.windowed) for r in self.rings[self._ring_of[key]][1]]
                      for key, vr in self.requirements.items()}
        for rk in self.rings:
            if rk[0] == L.OBS:
                self._push(rk, obs)

    def _make_rings(self, col: str, depth: int, obs: Any, space: Any, rule: str) -> tuple[Any, list[_Ring]]:
        E = self.E
        if col == L.OBS:
            leaves, spec = optree.tree_flatten(obs)
            return spec, [_Ring(E, depth + 1, np.shape(a)[1:], np.asarray(a).dtype, 0, first=rule == FIRST)
                          for a in leaves]
        shape: tuple[int, ...]
        dtype: np.dtype[Any]
        if col == L.REWARD:
            shape, dtype = (), np.dtype(np.float32)
        elif col in L.FLAG_KEYS:
            shape, dtype = (), np.dtype(bool)
        elif space is None:
            what = "the env's action space" if col == L.ACTION else "space="
            raise UsageError(f"view column {col!r}: its item shape and dtype are needed before the policy's first output, "
                             f"and there is no {what}: give the requirement space= (one sub-env's item, e.g. a gymnasium "
                             "Space or np.zeros((), np.float32))")
        else:
            shape, dtype = _item_template(space, f"view column {col!r}")
        leaf: Any = np.zeros(())  # Any: optree's PyTree annotation does not take an ndarray, though a leaf is one
        _, spec = optree.tree_flatten(leaf)
        return spec, [_Ring(E, depth, shape, dtype, -1)]

    def _check_fill(self, key: str, vr: Any) -> None:
        """The requirement's fill (its ``space``) fits the column: ``fill_value`` raises if its shape does not."""
        for ring in self.rings[self._ring_of[key]][1]:
            vr.fill_value(ring.buf.dtype, ring.buf.shape[2:])

    def _push(self, rk: tuple[str, str], value: Any) -> None:
        rings = self.rings[rk][1]
        if len(rings) == 1 and type(value) is np.ndarray:
            rings[0].push(value)
            return
        for ring, leaf in zip(rings, optree.tree_leaves(value), strict=True):
            ring.push(leaf)

    def inputs(self) -> dict[str, Any]:
        """The policy's input at the current step (see the class doc for shapes and lifetime)."""
        out: dict[str, Any] = {}
        for key, views in self.views.items():
            spec = self.rings[self._ring_of[key]][0]
            if len(views) == 1 and spec.num_leaves == 1 and spec.num_nodes == 1:
                out[key] = views[0].read()
            else:
                out[key] = optree.tree_unflatten(spec, [v.read() for v in views])
        return out

    def _check_output(self, values: dict[str, Any], extras: dict[str, Any]) -> None:
        """The first output's actions and extras have the shape and dtype the rings were made for."""
        for col, rule in self.columns:
            if col in (L.OBS, L.REWARD, *L.FLAG_KEYS):
                continue
            ring = self.rings[col, rule][1][0]
            if col not in values:
                raise UsageError(f"view column {col!r} is not a step leaf and the policy returned no extra of that name "
                                 f"(its extras: {sorted(extras)}); a view reads one of "
                                 f"{list(L.STEP_KEYS)} or a policy extra")
            got = np.asarray(values[col])
            want_shape, want_dtype = ring.buf.shape[2:], ring.buf.dtype
            if got.shape[1:] != want_shape or got.dtype != want_dtype:
                src = self._origin[col]
                raise UsageError(f"view column {col!r}: the policy returned items of {got.dtype} {got.shape[1:]}, but the "
                                 f"fill before its first output was {want_dtype} {want_shape} (from {src}); give the "
                                 f"requirement space= of the policy's own item (e.g. np.zeros({got.shape[1:]}, np.{got.dtype}))"
                                 f" or make the policy return {want_dtype} {want_shape}")
        self._checked = True

    def advance(self, action: Any, extras: dict[str, Any], reward: np.ndarray, terminated: np.ndarray,
                truncated: np.ndarray, next_obs: Any) -> None:
        """Record a step (its recorded values, ``(E, ...)`` each), start the episodes that ended, then take ``next_obs``."""
        OBS = L.OBS  # called every step: the keys as locals
        values = {L.ACTION: action, L.REWARD: reward, L.TERMINATED: terminated, L.TRUNCATED: truncated, **extras}
        if not self._checked:
            self._check_output(values, extras)
        for rk in self.columns:
            if rk[0] != OBS:
                self._push(rk, values[rk[0]])
        ended = terminated | truncated
        if ended.any():
            for _, rings in self.rings.values():
                for ring in rings:
                    ring.clear(ended)
        for rk in self.columns:
            if rk[0] == OBS:
                self._push(rk, next_obs)


def check_view_requirements(requirements: Any) -> dict[str, Any]:
    """The requirements as a dict, checked for acting: UsageError naming the requirement otherwise.

    The actor builds the input at step ``t``, before the step is taken: an offset must be ``<= 0`` for
    ``obs`` and ``<= -1`` for every other column (step ``t``'s action, reward and flags do not exist
    yet). Positive offsets (``shift=+1``: the next observation) are for the learner side only.
    """
    if not isinstance(requirements, dict) or not requirements:
        raise UsageError(f"view_requirements: expected a non-empty dict name -> shmbuf.storage.views.ViewRequirement "
                         f"(or None for the bare observation), got {requirements!r}")
    for key, vr in requirements.items():
        if not isinstance(key, str):
            raise UsageError(f"view_requirements: keys are the policy's input names (str), got {key!r}")
        if not all(hasattr(vr, a) for a in ("offsets", "windowed", "column", "fill_value", "fill_rule", "space")):
            raise UsageError(f"view_requirements[{key!r}]: expected a shmbuf.storage.views.ViewRequirement, got "
                             f"{type(vr).__name__}")
        col = vr.column(key)
        if not isinstance(col, str) or not col:
            raise UsageError(f"view_requirements[{key!r}]: its column must be a step leaf name, got {col!r}")
        vr.fill_rule(key)  # a UsageError for fill="first" on a column other than obs
        if col.startswith("obs/"):
            raise UsageError(f"view_requirements[{key!r}]: column {col!r} is a learner-side path into a dict observation; "
                             "the actor side takes the whole 'obs' (its views keep the observation's structure, one view "
                             "per component)")
        ahead = [o for o in vr.offsets if o > 0]
        if ahead:
            raise UsageError(f"view_requirements[{key!r}] (column {col!r}, shift={vr.shift!r}): offset {ahead[0]} is after "
                             "the step the policy acts on, which the actor cannot know yet; positive shifts (e.g. the next "
                             "observation) are for the learner side: leave this one out of the actor's requirements")
        if col != L.OBS and 0 in vr.offsets:
            raise UsageError(f"view_requirements[{key!r}] (column {col!r}, shift={vr.shift!r}): offset 0 is this step's own "
                             f"{col}, which the policy is computing (only 'obs' is known at offset 0); use shift=-1 for the "
                             "previous one")
        if col in ("actions", "rewards", "dones", "new_obs", "next_obs"):
            name = {"actions": "'action'", "rewards": "'reward'", "dones": "'terminated' or 'truncated'",
                    "new_obs": "'obs' with shift=1 (learner side)", "next_obs": "'obs' with shift=1 (learner side)"}[col]
            raise UsageError(f"view_requirements[{key!r}]: column {col!r} is RLlib's name; the workers step leaf is {name}")
    return dict(requirements)
