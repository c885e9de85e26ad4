"""Reading rollouts back (the learner side's one reading of the layout): :func:`grid` sees a Rollout, a Batch, a
workers CollectedBatch or a data dict with its fill as one :class:`Grid` of ``B`` rollouts x ``T`` steps x ``E``
sub-envs, and :func:`successors` gives every stored step's successor observation in one vectorised pass.
Public through :mod:`shmbuf.layout`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import optree

from shmbuf._errors import SchemaError, UsageError
from shmbuf.layout._keys import (
    BOOTSTRAP,
    COMPLETE_EPISODES,
    END,
    ENV,
    ENV_STEPS,
    EPISODE,
    FINAL_OBS,
    LENGTH,
    OBS,
    STEP,
    TERMINATED,
    TRUNCATE_EPISODES,
    TRUNCATED,
    check_batch_mode,
)


def _count(v: Any, what: str) -> np.ndarray:
    """Fill counts as int64 (a scalar or one per rollout): integral numbers only, else a UsageError naming them."""
    try:
        a = np.asarray(v)
        with np.errstate(invalid="ignore"):  # inf and NaN are refused below, not warned about
            ok = a.dtype.kind in "iu" or (a.dtype.kind == "f" and bool(np.all((np.abs(a) < 2.0**62) & (np.mod(a, 1) == 0))))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UsageError(f"{what}: expected integer counts (the rollout's or batch's fill), got {v!r}")
    return a.astype(np.int64)


def _walk(node: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        node = node[k]
    return node


def _named(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path))


def _cut(tree: Any, n: int, what: str) -> Any:
    """Every leaf's first ``n`` rows (views); a leaf without a leading axis is a SchemaError naming it."""
    def rows(path: tuple[Any, ...], a: Any) -> np.ndarray:
        a = np.asarray(a)
        if a.ndim == 0:
            raise SchemaError(f"{what} leaf {_named(path)!r} is a scalar; expected an array with a leading time (or row) "
                              f"axis")
        return a[:n]
    return optree.tree_map_with_path(rows, tree)


def _flags(step: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    try:
        term, trunc = np.asarray(step[TERMINATED]), np.asarray(step[TRUNCATED])
    except KeyError:
        raise SchemaError(f"the step leaves need {TERMINATED!r} and {TRUNCATED!r} (episode boundaries); there is "
                          f"{sorted(step)}") from None
    if term.shape != trunc.shape:
        raise SchemaError(f"step leaves {TERMINATED!r} {term.shape} and {TRUNCATED!r} {trunc.shape} differ in shape")
    return term, trunc


class Grid:
    """A rollout, a batch of rollouts or a collector batch, read as one grid of ``B`` rollouts x ``T`` steps x ``E``
    sub-envs (what :func:`grid` returns; the learner side's one reading of the layout).

    Attributes:
        step, episode, bootstrap: the rollout's trees. A single rollout's step leaves and episode table are cut
            to its fill (views), so that its ``T`` is its stored steps; a batch keeps its capacity ``T`` and its
            padding rows (``n`` says where each rollout's steps end).
        batch_mode: :data:`TRUNCATE_EPISODES` or :data:`COMPLETE_EPISODES`.
        batched: the source has a leading ``B`` (a Batch or a truncate-episodes CollectedBatch).
        vector: the source's step leaves have an env dim ``E`` (else ``E == 1``, added by :meth:`as_bte`).
        B, T, E: the grid's shape; ``capacity`` is the source's own T (a single rollout's before the cut).
        n: ``(B,)`` int64, stored steps per rollout.
        k: ``(B,)`` int64, filled episode-table rows per rollout, or None when the fill does not say
            (complete-episodes rollouts, whose episode record is one item; a batch's fill without ``episode``).
        lengths: a complete-episodes CollectedBatch (every episode's steps concatenated, ``(N, ...)``): its
            episode lengths; it is then one rollout of ``T = N`` steps (``B = E = 1``) whose episode table is
            made from the lengths (``end``: each episode's last step, ``env`` 0) and the bootstrap rows
            (``final_obs``: each episode's successor; ``bootstrap`` holds the last one). Else None.

    Views: :meth:`as_bte`, :meth:`as_be`, :meth:`from_bte` and :meth:`table` only add or drop unit axes, so they
    return views; :meth:`successors` returns a new array (or writes into ``out``). Lifetime: the views are the
    source's own (valid until the Rollout is released, or until the reader or Collector refills its batch
    buffer).
    """

    def __init__(self, step: Mapping[str, Any], episode: Any, bootstrap: Any, *, batch_mode: str, batched: bool,
                 vector: bool, B: int, T: int, E: int, n: np.ndarray, k: np.ndarray | None, capacity: int,
                 lengths: np.ndarray | None = None):
        self.step, self.episode, self.bootstrap = step, episode, bootstrap
        self.batch_mode, self.batched, self.vector = batch_mode, batched, vector
        self.B, self.T, self.E, self.n, self.k, self.capacity, self.lengths = B, T, E, n, k, capacity, lengths
        self._done: np.ndarray | None = None

    @property
    def name(self) -> str:
        return "the batch" if self.batched else "the rollout"

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading dims of a step leaf in the source's own layout: ``([B], T, [E])``."""
        return ((self.B,) if self.batched else ()) + (self.T,) + ((self.E,) if self.vector else ())

    def _lead_names(self) -> str:
        return ("B, " if self.batched else "") + "T" + (", E" if self.vector else "")

    def at(self, b: int, t: int, e: int) -> str:
        """A grid position as a message says it: ``rollout b of the batch, step t, env e``."""
        return (f"rollout {b} of the batch, " if self.batched else "") + f"step {t}" + (f", env {e}" if self.vector else "")

    def as_bte(self, x: Any, what: str = "a step leaf") -> np.ndarray:
        """A step leaf ``([B], T, [E], ...)`` as ``(B, T, E, ...)``, a view; SchemaError (saying ``what``) if its
        leading dims are not the grid's."""
        x = np.asarray(x)
        if x.shape[: len(self.lead)] != self.lead:
            raise SchemaError(f"{what} has shape {x.shape}; expected it to start with {self.lead} ({self._lead_names()})")
        if not self.batched:
            x = x[None]
        return x if self.vector else np.expand_dims(x, 2)

    def as_be(self, x: Any) -> np.ndarray:
        """A per-rollout leaf ``([B], [E], ...)`` (bootstrap) as ``(B, E, ...)``, a view."""
        x = np.asarray(x)
        if not self.batched:
            x = x[None]
        return x if self.vector else np.expand_dims(x, 1)

    def table(self, x: Any) -> np.ndarray:
        """An episode-table leaf ``([B], M, ...)`` as ``(B, M, ...)``, a view."""
        return np.asarray(x) if self.batched else np.asarray(x)[None]

    def from_bte(self, y: np.ndarray) -> np.ndarray:
        """Undo :meth:`as_bte` on a result ``(B, T, E, ...)``: the source's layout ``([B], T, [E], ...)``, a view."""
        if not self.vector:
            y = y[:, :, 0]
        return y if self.batched else y[0]

    @property
    def done(self) -> np.ndarray:
        """``(B, T, E)`` bool: the step ended its episode (terminated or truncated); False past each rollout's fill."""
        if self._done is None:
            term, trunc = _flags(self.step)
            stored = np.arange(self.T)[None, :, None] < self.n[:, None, None]
            self._done = self.as_bte(term | trunc, f"step leaf {TERMINATED!r}") & stored
        return self._done

    def filled_rows(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``(b, i)``: every filled episode-table row (row ``i`` of rollout ``b``), rollout by rollout, in table order.

        ``rows``: how many rows the table has; a fill counting more is a SchemaError, no fill count a UsageError.
        """
        if self.k is None:
            raise UsageError(f"fill has no 'episode' count for {self.name}: pass the whole fill (e.g. batch.fill), so "
                             "that only the filled rows of the episode table are read")
        if (self.k > rows).any():
            raise SchemaError(f"the episode table has {rows} rows, fewer than the {int(self.k.max())} episodes "
                              f"fill['episode'] counts; {END}, {ENV} and {FINAL_OBS} need a row per ended episode")
        b, i = np.nonzero(np.arange(rows)[None, :] < self.k[:, None])
        return b, i

    def successors(self, path: tuple[Any, ...] = (), *, out: np.ndarray | None = None) -> np.ndarray:
        """The successor observation of every step, ``(B, T, E, ...)``, for the obs leaf at ``path`` inside ``obs``.

        Step t's successor is ``obs[t + 1]``, the bootstrap obs at each rollout's last stored step, and the
        episode table's final obs where an episode ended before that; rows past a rollout's fill are zeros.
        One vectorised pass: a shifted copy, then scatters of the bootstrap rows and of the final observations.
        ``out``: a ``(B, T, E, ...)`` array (or view) to write into instead of a new one.
        """
        where = _named((OBS, *path))
        try:
            x = _walk(self.step[OBS], path)
        except (KeyError, IndexError, TypeError):
            raise SchemaError(f"{self.name} has no step leaf {where!r}") from None
        xc = self.as_bte(x, f"step leaf {where!r}")
        try:
            b = np.asarray(_walk(self.bootstrap[OBS], path)) if isinstance(self.bootstrap, Mapping) else None
        except (KeyError, IndexError, TypeError):
            b = None
        if b is None:
            raise SchemaError(f"the successor of a rollout's last step is data[{BOOTSTRAP!r}][{where!r}], which "
                              f"{self.name} does not have")
        want = ((self.B,) if self.batched else ()) + ((self.E,) if self.vector else ()) + xc.shape[3:]
        if b.shape != want:
            raise SchemaError(f"the bootstrap obs has shape {b.shape}; expected {want} (the step obs's shape without T)")
        if out is None:
            out = np.empty(xc.shape, xc.dtype)
        elif out.shape != xc.shape:
            raise UsageError(f"successors(out=...): expected shape {xc.shape} (B, T, E, ...), got {out.shape}")
        T, n = self.T, self.n
        out[:, :-1] = xc[:, 1:]
        rows = np.flatnonzero(n > 0)
        out[rows, n[rows] - 1] = self.as_be(b)[rows]
        if (n < T).any():
            out[np.arange(T)[None, :] >= n[:, None]] = 0  # padding: zeros, not stale data
        interior = self.done & (np.arange(T)[None, :, None] < (n - 1)[:, None, None])
        if not interior.any():
            return out
        at = self.at(*(int(v[0]) for v in np.nonzero(interior)))
        if self.batch_mode == COMPLETE_EPISODES and self.lengths is None:
            raise SchemaError(f"{self.name} is said to be complete-episodes (one episode per rollout), but an episode "
                              f"ends at {at}, before its last stored step; pass batch_mode={TRUNCATE_EPISODES!r}")
        self._final_obs(path, out, interior, at)
        return out

    def _final_obs(self, path: tuple[Any, ...], out: np.ndarray, interior: np.ndarray, at: str) -> None:
        """Write each episode's final observation (the episode table's ``final_obs``) as its last step's successor."""
        ep = self.episode
        if not isinstance(ep, Mapping) or not all(k in ep for k in (END, ENV, FINAL_OBS)):
            raise SchemaError(f"an episode ends at {at} inside {self.name}; its successor is the episode table's "
                              f"{FINAL_OBS} (data[{EPISODE!r}] with {END}, {ENV}, {FINAL_OBS}), which is missing")
        end, env = self.table(ep[END]), self.table(ep[ENV])
        for name, v in ((END, end), (ENV, env)):
            if v.dtype.kind not in "iu":
                raise SchemaError(f"the episode table's {name!r} has dtype {v.dtype}; expected integers (step and env "
                                  f"indices)")
        try:
            final = self.table(_walk(ep[FINAL_OBS], path))
        except (KeyError, IndexError, TypeError):
            raise SchemaError(f"the episode table's {FINAL_OBS} has no leaf {_named(path)!r}") from None
        if final.shape[2:] != out.shape[3:]:
            raise SchemaError(f"the episode table's {FINAL_OBS} has item shape {final.shape[2:]}, the step obs "
                              f"{out.shape[3:]}")
        b, i = self.filled_rows(min(end.shape[1], env.shape[1], final.shape[1]))
        te, ee = end[b, i].astype(np.int64), env[b, i].astype(np.int64)
        bad = (te < 0) | (te >= self.n[b]) | (ee < 0) | (ee >= self.E)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise SchemaError(f"episode table row {int(i[j])}" + (f" of rollout {int(b[j])}" if self.batched else "")
                              + f" has {END}={int(te[j])}, {ENV}={int(ee[j])}, outside the stored steps "
                              f"0..{int(self.n[b[j]]) - 1} and envs 0..{self.E - 1}")
        has = np.zeros(interior.shape, bool)
        has[b, te, ee] = True
        missing = interior & ~has
        if missing.any():
            at = self.at(*(int(v[0]) for v in np.nonzero(missing)))
            raise SchemaError(f"an episode ends at {at} but the episode table has no row for it, so its final "
                              f"observation is unknown (is the fill's 'episode' count right?)")
        sel = te < self.n[b] - 1  # an episode that ended at the last stored step: the bootstrap row, already written
        out[b[sel], te[sel], ee[sel]] = final[b[sel], i[sel]]


def _is_batch(data: Mapping[str, Any], batch_mode: str) -> bool:
    """Whether ``data`` (without ``fill``) is a batch: its per-rollout leaves have a leading B."""
    boot, ep = data.get(BOOTSTRAP), data.get(EPISODE)
    if isinstance(boot, Mapping) and ENV_STEPS in boot:
        return np.ndim(boot[ENV_STEPS]) == 1
    if isinstance(ep, Mapping) and LENGTH in ep:
        return np.ndim(ep[LENGTH]) == (2 if batch_mode == TRUNCATE_EPISODES else 1)
    return False


def grid(data: Any, fill: Mapping[str, Any] | None = None, *, batch_mode: str | None = None,
         ref: str = TERMINATED) -> Grid:
    """Read a rollout, a batch or a collector batch as a :class:`Grid` of ``(B, T, E, ...)``.

    Args:
        data: a shmbuf ``Rollout`` or ``Batch``, a workers ``CollectedBatch`` (anything with ``.data`` and
            ``.fill``, optionally ``.batch_mode`` and ``.lengths``), or the data dict itself: one rollout
            (step leaves ``(T, [E], ...)``) or a batch (``(B, T, [E], ...)``, with ``fill``).
        fill: the rollout's or batch's fill (``{"step": n, "episode": k}``, one count per rollout for a
            batch); None: the object's own, or (a dict) every row of a single rollout. A batch needs it,
            so that padding is never read as data.
        batch_mode: None: the object's own, else :data:`TRUNCATE_EPISODES`.
        ref: the step leaf (``"a/b"`` walks nested dicts) whose leading dims say ``[B]``, ``T`` and ``[E]``.

    Raises:
        UsageError: not a rollout in this layout, a bad fill or batch mode, a batch without its fill.
        SchemaError: leaves that do not fit the layout (naming them).
    """
    lengths = None
    if not isinstance(data, Mapping) and hasattr(data, "data"):
        obj = data
        data = obj.data
        if fill is None:
            fill = getattr(obj, "fill", None)
        if batch_mode is None:
            batch_mode = getattr(obj, "batch_mode", None)
        if fill is None and batch_mode == COMPLETE_EPISODES:
            lengths = getattr(obj, "lengths", None)
    batch_mode = TRUNCATE_EPISODES if batch_mode is None else batch_mode
    check_batch_mode(batch_mode)
    if not isinstance(data, Mapping) or not isinstance(data.get(STEP), Mapping):
        raise UsageError(f"expected a rollout in the workers layout (a dict with data[{STEP!r}], or a shmbuf Rollout, "
                         f"Batch or workers CollectedBatch), got {type(data).__name__}")
    step, episode, boot = data[STEP], data.get(EPISODE), data.get(BOOTSTRAP)
    if lengths is not None:
        return _concatenated(step, episode, boot, lengths)
    if fill is not None and (not isinstance(fill, Mapping) or STEP not in fill):
        raise UsageError(f"fill: expected the rollout's or batch's fill (a dict with {STEP!r}), got {fill!r}")
    batched = np.ndim(fill[STEP]) > 0 if fill is not None else _is_batch(data, batch_mode)
    if batched and fill is None:
        raise UsageError("data is a batch of rollouts (its bootstrap/episode leaves have a leading B) and fill=None: "
                         "pass fill=batch.fill (or the Batch/CollectedBatch itself), so that padding past each "
                         "rollout's fill is never read as data")
    try:
        x = np.asarray(_walk(step, tuple(ref.split("/"))))
    except (KeyError, IndexError, TypeError):
        raise SchemaError(f"the step leaves have no {ref!r}; there is {sorted(step)}") from None
    if x.ndim - batched not in (1, 2):
        want = "(B, T) or (B, T, E)" if batched else "(T,) or (T, E)"
        raise SchemaError(f"step leaf {ref!r} has shape {x.shape}; expected {want}")
    vector = x.ndim - batched == 2
    E = int(x.shape[-1]) if vector else 1
    k = None
    if not batched:
        cap = int(x.shape[0])
        n = cap if fill is None else int(_count(fill[STEP], "fill['step']"))
        if not 0 <= n <= cap:
            raise UsageError(f"fill['step']={n} is outside the rollout's capacity 0..{cap}")
        step = _cut(step, n, "step")
        if isinstance(episode, Mapping) and batch_mode == TRUNCATE_EPISODES and END in episode:
            if fill is not None and EPISODE in fill:
                m = int(_count(fill[EPISODE], "fill['episode']"))
                rows = len(np.asarray(episode[END]))
                if not 0 <= m <= rows:
                    raise UsageError(f"fill['episode']={m} is outside the episode table's capacity 0..{rows}")
                episode = _cut(episode, m, "episode")
            k = np.array([len(np.asarray(episode[END]))])
        return Grid(step, episode, boot, batch_mode=batch_mode, batched=False, vector=vector, B=1, T=n, E=E,
                    n=np.array([n]), k=k, capacity=cap)
    B, T = int(x.shape[0]), int(x.shape[1])
    assert fill is not None  # a batch without its fill was refused above
    n_ = _count(fill[STEP], "fill['step']").reshape(-1)
    if n_.shape != (B,) or (n_ < 0).any() or (n_ > T).any():
        raise UsageError(f"fill['step'] {n_.tolist()} does not fit the batch: expected {B} counts in 0..{T}")
    if EPISODE in fill:
        k = _count(fill[EPISODE], "fill['episode']").reshape(-1)
        if k.shape != (B,) or (k < 0).any():
            raise UsageError(f"fill['episode'] {k.tolist()} does not fit the batch: expected {B} counts >= 0")
    return Grid(step, episode, boot, batch_mode=batch_mode, batched=True, vector=vector, B=B, T=T, E=E, n=n_, k=k,
                capacity=T)


def _concatenated(step: Mapping[str, Any], episode: Any, boot: Any, lengths: Any) -> Grid:
    """A complete-episodes CollectedBatch as one long rollout (see :class:`Grid`'s ``lengths``)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 1).any():
        raise SchemaError(f"lengths {lengths.tolist()!r}: expected the episode lengths (ints >= 1) of a complete-episodes "
                          f"batch")
    lengths = lengths.astype(np.int64)
    term, trunc = _flags(step)
    N, R = int(lengths.sum()), len(lengths)
    if term.shape != (N,):
        raise SchemaError(f"step leaf {TERMINATED!r} has shape {term.shape}; a complete-episodes batch of lengths "
                          f"summing to {N} has ({N},)")
    ends = np.cumsum(lengths) - 1
    done = term | trunc
    marked = np.zeros(N, bool)
    marked[ends] = True
    if (done != marked).any():
        t = int(np.flatnonzero(done != marked)[0])
        raise SchemaError(f"step {t} {'ends' if done[t] else 'does not end'} an episode, but the batch's lengths say "
                          f"otherwise; a complete-episodes batch ends each episode exactly at its last step")
    table: dict[str, Any] = {END: ends.astype(np.int32), ENV: np.zeros(R, np.int32)}
    if isinstance(boot, Mapping) and OBS in boot and R:
        for leaf in optree.tree_leaves(boot[OBS]):
            if np.shape(leaf)[:1] != (R,):
                raise SchemaError(f"the bootstrap obs has shape {np.shape(leaf)}; expected ({R}, ...) (one row per "
                                  f"episode)")
        table[FINAL_OBS] = boot[OBS]
        boot = {OBS: optree.tree_map(lambda a: np.asarray(a)[-1], boot[OBS])}
    g = Grid(step, table, boot, batch_mode=COMPLETE_EPISODES, batched=False, vector=False, B=1, T=N, E=1,
             n=np.array([N]), k=np.array([R]), capacity=N, lengths=lengths)
    g._done = done[None, :, None]
    return g


def successors(data: Any, fill: Mapping[str, Any] | None = None, *, batch_mode: str | None = None) -> Any:
    """The successor observation of every stored transition, shaped like ``data["step"]["obs"]``.

    ``data``, ``fill`` and ``batch_mode`` as :func:`grid` takes them (a single rollout: ``rollout.filled()``,
    or ``rollout.data`` with ``fill``; a batch or a collector batch). Step t's successor is ``obs[t+1]``,
    except where step t ended an episode (its final observation, from the episode table) and at a
    rollout's last stored step (``bootstrap.obs``). A single rollout gives ``(n, [E], ...)`` (its stored
    steps), a batch ``(B, T, [E], ...)`` (zeros past each fill), a complete-episodes collector batch
    ``(N, ...)``; a dict observation gives a dict. New arrays, built without a Python loop over steps or
    episodes (:meth:`Grid.successors`).
    """
    g = grid(data, fill, batch_mode=batch_mode)
    if OBS not in g.step:
        raise SchemaError(f"the step leaves have no {OBS!r}; there is {sorted(g.step)}")
    paths, _, spec = optree.tree_flatten_with_path(g.step[OBS])
    return optree.tree_unflatten(spec, [g.from_bte(g.successors(tuple(p))) for p in paths])
