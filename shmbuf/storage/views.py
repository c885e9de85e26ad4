"""Trajectory views: RLlib's view requirements over shmbuf rollouts (shifts, windows, episode boundaries).

A :class:`ViewRequirement` says which column a model wants and at which time offsets: ``shift=-1``
the previous step's value (the previous action, the previous reward), ``shift=+1`` the next one
(the next observation), a list of ints or a range string (``"-3:0"``: the last four observations) an
extra axis of several offsets. A position before the start of its episode never holds data from the
previous episode: as RLlib's ``AgentCollector`` fills it, an observation column holds the episode's first
observation (a frame stack at an episode's start repeats it) and every other column holds zeros (of the
column's dtype, or of ``space``'s); ``ViewRequirement(fill="zeros")`` gives zeros for observations too.

This module holds the requirement itself, which the learner side (building columns from rollouts)
and the actor side (``workers``: building a policy's input at every step) share, so that both read
the same offsets with the same meaning, and the learner side: :func:`build_views` (RLlib's
``build_for_training``: the columns of a rollout or batch, vectorised) and :class:`MaskedView` (its
zero-copy form). Only shift-0 columns (and the mask form) are views of the rollout; every other shift is
a copy, because fill values and successor observations are not in the step leaf (docs/views.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, NamedTuple, NoReturn

import numpy as np
import optree
from numpy.lib.stride_tricks import as_strided

from shmbuf import layout as L
from shmbuf._errors import SchemaError, UsageError
from shmbuf.storage._common import leaf_at

_RANGE = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*$")
FIRST, ZEROS = "first", "zeros"  # ViewRequirement(fill=...): what a position before an episode's start holds
FILL_RULES = (None, FIRST, ZEROS)


def parse_shift(shift: Any) -> tuple[tuple[int, ...], bool]:
    """``(offsets, windowed)``: the time offsets a shift names, and whether it adds an axis.

    ``0`` or ``-1`` (an int): one offset, no extra axis. ``[-2, -1]`` (a list or tuple of ints): those
    offsets, an extra axis in that order. ``"-50:-1"``: every offset from -50 to -1, both ends
    included (RLlib's meaning), an extra axis of 50.
    """
    if isinstance(shift, (bool, np.bool_)):
        raise UsageError("ViewRequirement(shift=...): expected an int, a list of ints or a range string like '-3:0', "
                         f"got {shift!r}")
    if isinstance(shift, (int, np.integer)):
        return (int(shift),), False
    if isinstance(shift, str):
        m = _RANGE.match(shift)
        if not m:
            raise UsageError(f"ViewRequirement(shift=...): a range string is 'start:stop' with both ends included, e.g. "
                             f"'-50:-1', got {shift!r}")
        a, b = int(m.group(1)), int(m.group(2))
        if b < a:
            raise UsageError(f"ViewRequirement(shift={shift!r}): the range's end {b} is before its start {a}")
        return tuple(range(a, b + 1)), True
    if isinstance(shift, (list, tuple)) and shift and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in shift):
        return tuple(int(s) for s in shift), True
    raise UsageError(f"ViewRequirement(shift=...): expected an int, a non-empty list of ints or a range string like "
                     f"'-3:0', got {shift!r}")


@dataclass(frozen=True)
class ViewRequirement:
    """One column of a view: which data, at which time offsets, filled how before an episode's start.

    Args:
        data_col: the column the view reads (a step leaf of the rollout, e.g. ``"obs"``,
            ``"action"``, ``"reward"``); None: the key the requirement is stored under.
        shift: an int (``0`` as is, ``-1`` the previous step, ``+1`` the next), a list of ints (an
            extra axis, in that order), or a range string ``"a:b"`` (every offset from a to b, both
            included: an extra axis of ``b - a + 1``).
        space: anything with ``shape`` and ``dtype`` (a gymnasium Space, a numpy array) whose zeros
            fill positions before an episode's start; None: zeros of the column's own dtype.
        used_for_training: False leaves the column out of the train batch (it is still built for
            the policy's input on the actor side).
        batch_repeat_value: RLlib's (attention nets and RNN state inputs): in a learner-side view,
            the column holds one row every ``batch_repeat_value`` steps of each episode piece (the
            view at the piece's steps 0, k, 2k, ...; a piece restarts at every episode start and at
            the rollout's first step), instead of one row per step. 1 (the default): every step. The
            actor side builds every step's input whatever it is (RLlib's compute-actions views too).
        index, used_for_compute_actions: RLlib's, accepted at their defaults (None, True) only: a
            UsageError says why otherwise.
        fill: what a position before the episode's start holds. None (the default): RLlib's rule, the
            episode's first observation for an ``obs`` column (``"first"``) and zeros for every other
            column (``"zeros"``, as RLlib's prev-actions and prev-rewards). ``"zeros"``: zeros for ``obs``
            too (what some models were trained on). ``"first"`` is for ``obs`` columns only (the first
            value of another column is not known at the episode's first step, where the actor acts).
    """

    data_col: str | None = None
    shift: int | list[int] | tuple[int, ...] | str = 0
    space: Any = None
    used_for_training: bool = True
    batch_repeat_value: int = 1
    index: None = None
    used_for_compute_actions: bool = True
    fill: str | None = None
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    windowed: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.data_col is not None and not isinstance(self.data_col, str):
            raise UsageError(f"ViewRequirement(data_col=...): expected a column name (str) or None, got {self.data_col!r}")
        if not isinstance(self.used_for_training, bool):
            raise UsageError(f"ViewRequirement(used_for_training=...): expected a bool, got {self.used_for_training!r}")
        if self.space is not None and not (hasattr(self.space, "shape") and hasattr(self.space, "dtype")):
            raise UsageError(f"ViewRequirement(space=...): expected something with shape and dtype (a gymnasium Space), "
                             f"got {type(self.space).__name__}")
        if self.index is not None:
            raise UsageError(f"ViewRequirement(index={self.index!r}): RLlib's absolute-position index is not supported "
                             "(RLlib marks it unused); use shift= for positions relative to each step")
        if self.used_for_compute_actions is not True:
            raise UsageError(f"ViewRequirement(used_for_compute_actions={self.used_for_compute_actions!r}): the actor "
                             "builds every requirement it is given; leave a learner-only column out of "
                             "Collector(view_requirements=...) and pass it to build_views only")
        brv = self.batch_repeat_value
        if isinstance(brv, (bool, np.bool_)) or not isinstance(brv, (int, np.integer)) or brv < 1:
            raise UsageError(f"ViewRequirement(batch_repeat_value=...): expected an int >= 1 (repeat the view every that "
                             f"many steps; 1: every step), got {brv!r}")
        object.__setattr__(self, "batch_repeat_value", int(brv))
        if self.fill not in FILL_RULES:
            raise UsageError(f"ViewRequirement(fill=...): expected None (RLlib's rule: the first observation for obs, "
                             f"zeros elsewhere), 'first' or 'zeros', got {self.fill!r}")
        offsets, windowed = parse_shift(self.shift)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "windowed", windowed)

    def column(self, key: str) -> str:
        """The data column this requirement reads when it is stored under ``key``."""
        return self.data_col if self.data_col is not None else key

    def fill_rule(self, key: str) -> str:
        """``"first"`` or ``"zeros"``: what this requirement, stored under ``key``, holds before an episode's start."""
        col = self.column(key)
        is_obs = col == L.OBS or col.startswith(L.OBS + "/")
        if self.fill == FIRST and not is_obs:
            raise UsageError(f"ViewRequirement(fill='first') on column {col!r}: only observations repeat their first "
                             "value (RLlib's rule); other columns' first value is not known at the episode's first "
                             "step. Use fill=None or 'zeros'")
        return self.fill if self.fill is not None else FIRST if is_obs else ZEROS

    def fill_value(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """What a position before the episode's start holds: zeros of ``space`` (cast to the column), or of the column."""
        if self.space is not None and tuple(self.space.shape) != tuple(shape):
            raise UsageError(f"ViewRequirement(space=...): its shape {tuple(self.space.shape)} is not the column's "
                             f"item shape {tuple(shape)}")
        return np.zeros(shape, dtype)


# -- learner side: columns from a rollout or a batch of rollouts ---------------------------------------

# RLlib's SampleBatch column names a user may try as a data_col, and what shmbuf calls them (for error hints).
RLLIB_NAMES = {
    "obs": L.OBS, "new_obs": f"{L.OBS} (with shift=1)", "next_obs": f"{L.OBS} (with shift=1)", "actions": L.ACTION,
    "prev_actions": f"{L.ACTION} (with shift=-1)", "rewards": L.REWARD, "prev_rewards": f"{L.REWARD} (with shift=-1)",
    "terminateds": L.TERMINATED, "truncateds": L.TRUNCATED, "dones": f"{L.TERMINATED} and {L.TRUNCATED}",
}


class MaskedView(NamedTuple):
    """The zero-copy form of a column (``build_views(..., mask=True)``).

    ``values``: a read-only numpy view of the step leaf (a tree of views for a subtree column), shaped
    ``([B], S, [E], [W], ...)``: row ``i`` is the view at step ``steps.start + i``. Only the steps whose
    every offset lies inside the stored rows are covered (``shift=-1``: steps 1..T-1; ``"-3:0"``: 3..T-1;
    ``shift=1``: 0..T-2). ``valid``: bool, ``([B], S, [E], [W])``, True where the position is data of that
    step's own episode (and the step is a stored one, not padding past ``fill``). Where it is False,
    ``values`` shows the neighbouring episode's data or padding: mask it, never read it as data.
    ``steps``: the rollout's steps the rows stand for.
    """

    values: Any
    valid: np.ndarray
    steps: slice


def _fail(kind: type[Exception], msg: str) -> NoReturn:
    raise kind(f"build_views: {msg}")


@dataclass
class _Lanes:
    """A rollout or a batch as :func:`shmbuf.layout.grid` reads it, with where each step's episode starts and ends.

    ``start``/``end`` (B, T, E): the first and last step of each step's episode inside this rollout (``start``
    may be negative with a previous rollout: its rows are then at -n_prev..-1).
    """

    g: L.Grid
    start: np.ndarray
    end: np.ndarray
    name: str
    prev: _Lanes | None = None


@contextmanager
def _said_here(context: str = "") -> Iterator[None]:
    """shmbuf.layout's errors (which cannot know the column) said as build_views' own, with ``context`` in front."""
    try:
        yield
    except (SchemaError, UsageError) as e:
        raise type(e)(f"build_views: {context}{e}") from None


def _lanes(data: Any, fill: Any, batch_mode: str | None, name: str | None = None) -> _Lanes:
    """Read the layout (:func:`shmbuf.layout.grid`), and where each step's episode starts and ends."""
    with _said_here():
        g = L.grid(data, fill, batch_mode=batch_mode)
        done = g.done
    start, end = _bounds(done, g.n)
    return _Lanes(g, start, end, g.name if name is None else name)


def _bounds(done: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and last step of each step's episode within the rollout: ``(B, T, E)`` each, no Python loop over steps."""
    T = done.shape[1]
    t = np.broadcast_to(np.arange(T)[None, :, None], done.shape)
    begins = np.zeros_like(done)
    begins[:, 1:] = done[:, :-1]
    start = np.maximum.accumulate(np.where(begins, t, 0), axis=1)
    last = np.broadcast_to((n - 1)[:, None, None], done.shape)
    ends_at = np.where(done, t, T)
    end = np.minimum.accumulate(ends_at[:, ::-1], axis=1)[:, ::-1]
    return start, np.minimum(end, last)


def _attach_prev(lanes: _Lanes, prev: _Lanes) -> None:
    """Let steps whose episode began before this rollout reach back into ``prev`` (the previous rollout of each lane).

    Rows of ``prev`` count as steps ``-n_prev .. -1``; the first episode segment of each lane starts where its
    episode started in ``prev`` if that episode did not end at ``prev``'s last step (else at 0, exactly).
    """
    g, pg = lanes.g, prev.g
    if (pg.batched, pg.B, pg.vector, pg.E) != (g.batched, g.B, g.vector, g.E):
        def shown(x: L.Grid) -> str:
            return f"batch={x.batched}, B={x.B}, E={x.E if x.vector else None}"
        _fail(UsageError, f"prev: expected the previous rollout(s) of the same lane(s), laid out like this one "
                          f"({shown(g)}); got {shown(pg)}")
    rows = np.arange(pg.B)
    last = np.maximum(pg.n - 1, 0)
    cont = (pg.n > 0)[:, None] & ~pg.done[rows, last]  # (B, E): the episode runs on into this rollout
    began = np.where(cont, prev.start[rows, last] - pg.n[:, None], 0)  # (B, E), in this rollout's steps
    first_segment = lanes.start == 0
    lanes.start = np.where(first_segment, began[:, None, :], lanes.start)
    _check_continues(lanes, prev, cont)
    lanes.prev = prev


def _check_continues(lanes: _Lanes, prev: _Lanes, cont: np.ndarray) -> None:
    """Where an episode runs on from ``prev``, its bootstrap observation is this rollout's first one, bit for bit."""
    try:
        obs = leaf_at(lanes.g.step, L.OBS, "")
        boot = leaf_at(prev.g.bootstrap, L.OBS, "") if isinstance(prev.g.bootstrap, Mapping) else None
    except KeyError:
        return
    if boot is None:
        return
    here = (lanes.g.n > 0)[:, None] & cont
    for a, b in zip(optree.tree_leaves(obs), optree.tree_leaves(boot), strict=False):
        first, succ = lanes.g.as_bte(a)[:, 0], prev.g.as_be(b)
        if first.shape != succ.shape or first.dtype != succ.dtype:
            _fail(UsageError, f"prev: its bootstrap obs {succ.shape[2:]} {succ.dtype} does not match this rollout's obs "
                              f"{first.shape[2:]} {first.dtype}: not the previous rollout of the same lane")
        for bb, e in zip(*np.nonzero(here), strict=True):
            if first[bb, e].tobytes() != succ[bb, e].tobytes():
                where = (f"rollout {bb} of the batch, " if lanes.g.batched else "") + (f"env {e}, " if lanes.g.vector else "")
                _fail(UsageError, f"prev: {where}its episode runs on (not done at prev's last step) but prev's bootstrap "
                                  f"obs is not this rollout's first obs: prev is not the previous rollout of this lane "
                                  f"(pass the rollout with the same lane and seq - 1, or prev=None)")


def _check_requirements(view_requirements: Any) -> dict[str, ViewRequirement]:
    if not isinstance(view_requirements, Mapping):
        _fail(UsageError, f"view_requirements: expected a dict of column name -> ViewRequirement, got "
                          f"{type(view_requirements).__name__}")
    for key, req in view_requirements.items():
        if not isinstance(key, str):
            _fail(UsageError, f"view_requirements: column names are str, got {key!r}")
        if not isinstance(req, ViewRequirement):
            _fail(UsageError, f"view_requirements[{key!r}]: expected a ViewRequirement, got {type(req).__name__}")
    return dict(view_requirements)


def _walk(node: Any, keys: Any) -> Any:
    for k in keys:
        node = node[k]
    return node


def _fill_for(req: ViewRequirement, key: str, path: tuple[Any, ...], dtype: np.dtype, item: tuple[int, ...]) -> np.ndarray:
    """The requirement's fill value for one leaf of its column; a space that does not fit names the column."""
    where = f"column {key!r}" + (f" (leaf {'/'.join(map(str, path))})" if path else "")
    r = req
    if req.space is not None and path:
        try:  # a Dict space over a subtree column: its sub-space for this leaf
            r = replace(req, space=_walk(req.space, path))
        except (KeyError, IndexError, TypeError, UsageError):
            _fail(UsageError, f"{where}: space {req.space!r} has no sub-space at {'/'.join(map(str, path))}; for a column "
                              f"that is a dict of leaves, give a Dict space with the same keys (or space=None)")
    if r.space is not None and getattr(r.space, "shape", None) is None:
        _fail(UsageError, f"{where}: space {r.space!r} has no shape; give the leaf's own space (or space=None)")
    try:
        return r.fill_value(dtype, item)
    except UsageError as e:
        _fail(UsageError, f"{where}: {e}")


def _leaf_of(lanes: _Lanes, key: str, keys: tuple[Any, ...], x: Any) -> np.ndarray:
    """``x`` as an array, checked to be a step leaf of ``lanes`` (its leading dims are the grid's)."""
    x = np.asarray(x)
    with _said_here(f"column {key!r}: "):
        lanes.g.as_bte(x, f"step leaf {'/'.join(map(str, keys))!r}")
    return x


def _gather(lanes: _Lanes, key: str, req: ViewRequirement, keys: tuple[Any, ...], x: np.ndarray) -> np.ndarray:
    """The copied form of one leaf: ``(B, T, E, W, ...)`` with every position the value at ``t + offset`` of its step's
    episode, or the fill value (before the episode's start, past its end, past the rollout, on padding rows)."""
    g = lanes.g
    B, T, E = g.done.shape
    xc = g.as_bte(x)
    item = xc.shape[3:]
    fill = _fill_for(req, key, keys[len(req.column(key).split("/")):], x.dtype, item)
    offs = np.asarray(req.offsets, np.int64)
    is_obs = keys[0] == L.OBS
    src = np.arange(T)[None, :, None, None] + offs[None, None, None, :]  # (1, T, 1, W)
    stored = (np.arange(T)[None, :] < g.n[:, None])[:, :, None, None]
    valid = stored & (src >= lanes.start[..., None]) & (src <= lanes.end[..., None] + (offs > 0) * is_obs)
    bi, ei = np.arange(B)[:, None, None, None], np.arange(E)[None, None, :, None]
    out = xc[bi, np.clip(src, 0, max(T - 1, 0)), ei] if T else np.zeros((B, 0, E, len(offs)) + item, x.dtype)
    ahead = offs > 0
    if is_obs and ahead.any() and T:
        with _said_here(f"column {key!r}: "):  # the next observation is the successor of the step before it
            succ = g.successors(keys[1:])
        out[:, :, :, ahead] = succ[bi, np.clip(src[..., ahead] - 1, 0, T - 1), ei]
    if lanes.prev is not None and (offs < 0).any():
        _from_prev(lanes, key, keys, out, src, valid, item, x.dtype)
    out[~valid] = fill
    if (offs < 0).any() and req.fill_rule(key) == FIRST:
        _repeat_first(lanes, key, keys, xc, out, stored & (src < lanes.start[..., None]))
    return out


def _prev_leaf(lanes: _Lanes, key: str, keys: tuple[Any, ...], item: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``prev``'s step leaf at ``keys`` as ``(B, T, E, ...)``, checked to match this rollout's."""
    prev = lanes.prev
    assert prev is not None  # called only when lanes.prev is set
    try:
        p = np.asarray(_walk(prev.g.step, keys))
    except (KeyError, IndexError, TypeError):
        _fail(SchemaError, f"column {key!r}: prev has no step leaf {'/'.join(map(str, keys))!r}")
    p = _leaf_of(prev, key, keys, p)
    pc = prev.g.as_bte(p)
    if pc.shape[3:] != item or pc.dtype != dtype:
        _fail(SchemaError, f"column {key!r}: prev's leaf is {pc.shape[3:]} {pc.dtype}, this rollout's {item} {dtype}")
    return pc


def _from_prev(lanes: _Lanes, key: str, keys: tuple[Any, ...], out: np.ndarray, src: np.ndarray, valid: np.ndarray,
               item: tuple[int, ...], dtype: np.dtype) -> None:
    """Positions before this rollout's first step, of an episode that ran on from ``prev``: read from ``prev``."""
    pc = _prev_leaf(lanes, key, keys, item, dtype)
    b, t, e, w = np.nonzero(valid & (src < 0))
    out[b, t, e, w] = pc[b, lanes.prev.g.n[b] + src[0, t, 0, w], e]  # type: ignore[union-attr]  # set: see _prev_leaf


def _repeat_first(lanes: _Lanes, key: str, keys: tuple[Any, ...], xc: np.ndarray, out: np.ndarray,
                  before: np.ndarray) -> None:
    """RLlib's rule for observations (``fill="first"``): positions ``before`` their episode's start hold its first
    observation: the earliest row of the episode the learner has (this rollout's, or ``prev``'s where the episode
    ran on from it; a rollout that starts mid-episode without ``prev`` counts its first step as the start)."""
    b, t, e, w = np.nonzero(before)
    s = lanes.start[b, t, e]
    own = s >= 0
    out[b[own], t[own], e[own], w[own]] = xc[b[own], s[own], e[own]]
    if not own.all():
        prev = lanes.prev
        assert prev is not None  # a negative start comes only from _attach_prev
        pc = _prev_leaf(lanes, key, keys, xc.shape[3:], xc.dtype)
        b, t, e, w, s = b[~own], t[~own], e[~own], w[~own], s[~own]
        out[b, t, e, w] = pc[b, prev.g.n[b] + s, e]


def _masked_valid(lanes: _Lanes, offs: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    t = np.arange(lo, hi)
    src = t[None, :, None, None] + np.asarray(offs)[None, None, None, :]
    stored = (t[None, :] < lanes.g.n[:, None])[:, :, None, None]
    return stored & (src >= lanes.start[:, lo:hi, :, None]) & (src <= lanes.end[:, lo:hi, :, None])


def _masked_leaf(lanes: _Lanes, key: str, req: ViewRequirement, x: np.ndarray, lo: int, S: int) -> np.ndarray:
    """The view form of one leaf: ``(B, S, E, [W], ...)``, rows of steps ``lo .. lo + S - 1``; never a copy."""
    xc = lanes.g.as_bte(x)
    offs = req.offsets
    if not req.windowed:
        return xc[:, lo + offs[0]: lo + offs[0] + S]
    d = offs[1] - offs[0] if len(offs) > 1 else 0
    if any(b - a != d for a, b in pairwise(offs)):
        _fail(UsageError, f"column {key!r}: mask=True gives views, and offsets {list(offs)} are not evenly spaced, so no "
                          f"stride reaches them; use a range string or an evenly spaced list, or mask=False (a copy)")
    base = xc[:, lo + offs[0]:] if S > 0 else xc
    sB, sT, sE = xc.strides[:3]
    return as_strided(base, shape=(xc.shape[0], S, xc.shape[2], len(offs)) + xc.shape[3:],
                      strides=(sB, sT, sE, d * sT) + xc.strides[3:], writeable=False)


def _column(lanes: _Lanes, key: str, req: ViewRequirement, mask: bool) -> Any:
    g = lanes.g
    col = req.column(key)
    try:
        sub = leaf_at(g.step, col, f"{lanes.name}'s step leaves")
    except KeyError as e:
        hint = f"; RLlib's {col!r} is shmbuf's {RLLIB_NAMES[col]}" if col in RLLIB_NAMES and RLLIB_NAMES[col] != col else ""
        _fail(SchemaError, f"column {key!r} reads {col!r}, but {e.args[0]}{hint}")
    paths, leaves, spec = optree.tree_flatten_with_path(sub)
    prefix = tuple(col.split("/"))
    leaves = [_leaf_of(lanes, key, prefix + p, x) for p, x in zip(paths, leaves, strict=True)]
    for p, x in zip(paths, leaves, strict=True):  # a space that does not fit is an error in every form
        _fill_for(req, key, p, x.dtype, x.shape[len(g.lead):])
    offs = req.offsets
    if req.batch_repeat_value > 1:
        if mask:
            _fail(UsageError, f"column {key!r}: batch_repeat_value={req.batch_repeat_value} picks rows at each episode "
                              "piece's steps 0, k, 2k, ..., which no stride reaches; use mask=False (a copy)")
        outs = [_repeated(lanes, req, _gather(lanes, key, req, prefix + p, x)) for p, x in zip(paths, leaves, strict=True)]
        return optree.tree_unflatten(spec, outs)
    if mask:
        lo, hi = max(0, -min(offs)), g.T - max(0, max(offs))
        S = max(hi - lo, 0)
        valid = _masked_valid(lanes, offs, lo, lo + S)
        vals = [g.from_bte(_masked_leaf(lanes, key, req, x, lo, S)) for x in leaves]
        valid = g.from_bte(valid if req.windowed else valid[:, :, :, 0])
        return MaskedView(optree.tree_unflatten(spec, vals), valid, slice(lo, lo + S))
    if all(o == 0 for o in offs):
        return optree.tree_unflatten(spec, [_same(g, req, x) for x in leaves])
    outs = []
    for p, x in zip(paths, leaves, strict=True):
        y = _gather(lanes, key, req, prefix + p, x)
        outs.append(g.from_bte(y if req.windowed else y[:, :, :, 0]))
    return optree.tree_unflatten(spec, outs)


def _repeated(lanes: _Lanes, req: ViewRequirement, y: np.ndarray) -> np.ndarray:
    """RLlib's ``batch_repeat_value``: of a gathered ``(B, T, E, W, ...)`` column, the rows at steps 0, k, 2k, ... of
    each episode piece (a piece starts at its episode's start or at the rollout's first step), as ``(R, [W], ...)``:
    lane-major (rollout b, then sub-env e, then time), the order RLlib concatenates its per-episode batches in."""
    g = lanes.g
    B, T, E = g.done.shape
    t = np.arange(T)[None, :, None]
    piece = np.maximum(lanes.start, 0)
    keep = (t < g.n[:, None, None]) & ((t - piece) % req.batch_repeat_value == 0)
    rows = np.moveaxis(y, 2, 1)[keep.transpose(0, 2, 1)]  # (R, W, ...)
    return rows if req.windowed else rows[:, 0]


def _same(g: L.Grid, req: ViewRequirement, x: np.ndarray) -> np.ndarray:
    """Offsets that are all 0: the leaf itself (shift=0), or a read-only window of it with a zero stride (a view)."""
    if not req.windowed:
        return x
    k = len(g.lead)
    return as_strided(x, shape=x.shape[:k] + (len(req.offsets),) + x.shape[k:], strides=x.strides[:k] + (0,) + x.strides[k:],
                      writeable=False)


def build_views(data: Any, view_requirements: Mapping[str, ViewRequirement], *, fill: Mapping[str, Any] | None = None,
                batch_mode: str | None = None, for_training: bool = True, prev: Any = None,
                mask: bool = False, rewards_and_dones: bool = False) -> dict[str, Any]:
    """The columns ``view_requirements`` ask for, built from one rollout or a batch of rollouts (RLlib's train batch).

    Args:
        data: one rollout in the workers layout (``rollout.filled()``, or ``rollout.data`` with ``fill``;
            step leaves ``(T, [E], ...)``), a batch (leaves ``(B, T, [E], ...)`` with ``fill``), or the
            ``shmbuf.Rollout`` / ``shmbuf.Batch`` / ``workers.CollectedBatch`` itself (its ``fill`` and
            ``batch_mode`` are then used).
        view_requirements: column name -> :class:`ViewRequirement` (``data_col`` is a step leaf, ``"a/b"``
            walks nested dicts; a column that is a dict of leaves gives a dict of results).
        fill: the rollout's or batch's ``fill`` (``{"step": n, "episode": k}``, per rollout for a batch):
            required for a batch, so that padding past a rollout's fill is never read as data.
        batch_mode: ``"truncate_episodes"`` or ``"complete_episodes"`` (None: the source's own, else truncate).
        for_training: leave out columns with ``used_for_training=False``.
        prev: truncate-episodes only: the previous rollout of the same lane (for a batch, a batch whose row
            b is the previous rollout of row b's lane), in the same forms as ``data``. Positions before this
            rollout's first step are then read from it where the episode ran on from it; without it they
            hold the fill value (see docs/views.md: the one place the learner sees less than the actor did).
        mask: return :class:`MaskedView` ``(values, valid, steps)`` per column: views only, never a copy.
        rewards_and_dones: RLlib's train batch always holds the rewards and the done flags, whether the
            requirements ask for them or not; True does the same: the result also has ``reward``,
            ``terminated``, ``truncated`` (shift-0 columns: views of the step leaves) and ``done``
            (``terminated | truncated``, a new array), unless a requirement already uses that name.

    Returns:
        ``{name: array}``; a single rollout gives ``(n, [E], [W], ...)`` (its stored steps), a batch
        ``(B, T, [E], [W], ...)`` (rows past a rollout's fill are padding). ``W``: the window axis of a
        list or range shift, right after the time/batch axes, in the order of the offsets. A column with
        ``batch_repeat_value=k > 1`` is ``(R, [W], ...)`` instead: one row per k steps of each episode
        piece, lane-major (rollout, sub-env, time); see :class:`ViewRequirement`.

    Views and copies: a column whose offsets are all 0 (``shift=0``) is the step leaf itself, a view of
    the slot (``[0, 0]``-like windows: a read-only zero-stride view); every other shift is a new array
    (a position before an episode's start must hold the fill value, and the next observation at an episode's
    end comes from the episode table or the bootstrap leaf, neither of which a stride can reach). With
    ``mask=True`` every column is a view.

    Lifetime: views are valid while their source is: until the Rollout is released, or until the reader or
    Collector refills its batch buffer (``copy=False``). Copies are yours.
    """
    lanes = _lanes(data, fill, batch_mode)
    reqs = _check_requirements(view_requirements)
    if not isinstance(for_training, bool) or not isinstance(mask, bool):
        _fail(UsageError, f"for_training and mask are bools, got for_training={for_training!r}, mask={mask!r}")
    if prev is not None:
        if lanes.g.batch_mode != L.TRUNCATE_EPISODES:
            _fail(UsageError, "prev: only truncate-episodes rollouts start mid-episode; a complete-episodes rollout "
                              "starts at its episode's start, so there is nothing before it to read")
        if mask:
            _fail(UsageError, "prev with mask=True: a view cannot span two rollouts; use one or the other")
        _attach_prev(lanes, _lanes(prev, None, L.TRUNCATE_EPISODES, "prev"))
    if not isinstance(rewards_and_dones, bool):
        _fail(UsageError, f"rewards_and_dones: expected a bool, got {rewards_and_dones!r}")
    if rewards_and_dones:
        kept = {k: ViewRequirement(k) for k in (L.REWARD, L.TERMINATED, L.TRUNCATED) if k not in reqs}
        reqs = {**reqs, **kept}
    out = {key: _column(lanes, key, req, mask) for key, req in reqs.items() if req.used_for_training or not for_training}
    if rewards_and_dones and DONE not in out:
        out[DONE] = _done_column(lanes, mask)
    return out


DONE = "done"  # terminated | truncated: RLlib's dones


def _done_column(lanes: _Lanes, mask: bool) -> Any:
    """``terminated | truncated`` in the source's layout (as the flag columns are), or its MaskedView."""
    g = lanes.g
    flags = []
    for k in (L.TERMINATED, L.TRUNCATED):
        try:
            flags.append(np.asarray(leaf_at(g.step, k, f"{lanes.name}'s step leaves")))
        except KeyError as e:
            _fail(SchemaError, f"rewards_and_dones=True: {e.args[0]}")
    done = flags[0] | flags[1]
    if not mask:
        return done
    B, T, E = g.done.shape
    stored = np.broadcast_to(np.arange(T)[None, :, None] < g.n[:, None, None], (B, T, E))
    return MaskedView(done, g.from_bte(np.ascontiguousarray(stored)), slice(0, T))
