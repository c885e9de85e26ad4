"""What a writer hands out (a shmbuf Rollout or Batch, a workers CollectedBatch), read as per-lane units.

:func:`rollout_units` checks what :meth:`Recorder.write <shmbuf.storage.recorder.Recorder.write>` is handed
(a bad rollout is named by its lane and seq, before anything is written), then reads it through
:func:`shmbuf.layout.grid`: one unit per rollout of one lane.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import SchemaError, UsageError
from shmbuf.storage._fileformat import flat_leaves, map_leaves

WHERE = "Recorder.write"
EPISODE_FIELDS = L.EpisodeTable.FIELDS  # return, length, terminated, truncated, env, end, final_obs
RECORD_FIELDS = (L.TERMINATED, L.TRUNCATED, L.RETURN, L.LENGTH)  # what a complete-episodes record needs


class Unit(NamedTuple):
    """One rollout of one lane: step leaves ``(n, E, ...)`` (views), its ended episodes, its successor."""

    lane: int
    seq: int | None
    step: dict[str, Any]
    n: int
    E: int
    episodes: list[tuple[int, int, bool, bool, float, int, Any]]  # env, end, terminated, truncated, return, length, final
    bootstrap: Any  # obs tree, leaves (E, ...); None for a complete episode (its successor is its record's final)
    complete: bool  # one whole episode (complete-episodes mode)


def _get(tree: Mapping[str, Any], key: str) -> Any:
    if not isinstance(tree, Mapping):
        raise SchemaError(f"{WHERE}: expected a dict holding {key!r} (the workers rollout layout), got "
                          f"{type(tree).__name__}")
    if key not in tree:
        raise SchemaError(f"{WHERE}: the rollout has no {key!r}; expected the workers rollout layout (step leaves "
                          f"obs, action, reward, terminated[, truncated]; an episode table; bootstrap obs), got "
                          f"{sorted(tree)}")
    return tree[key]


def rollout_units(src: Any) -> list[Unit]:
    """A shmbuf Rollout or Batch, or a workers CollectedBatch (duck-typed: ``.data``, ``.fill``, optional lane/seq).

    Every rollout is checked here, before anything is written: a bad one raises :class:`SchemaError`
    naming the field and the rollout, and nothing of the call is recorded. The batch mode is the
    episode table's: with ``end`` it is truncate-episodes.
    """
    data, fill = getattr(src, "data", None), getattr(src, "fill", None)
    if not isinstance(data, Mapping) or not isinstance(data.get(L.STEP), Mapping):
        raise UsageError(f"{WHERE}: expected a shmbuf Rollout or Batch or a workers CollectedBatch (with .data['step'] "
                         f"and .fill), got {type(src).__name__}")
    step, ep, boot = data[L.STEP], _get(data, L.EPISODE), _get(data, L.BOOTSTRAP)
    for k in (L.OBS, L.ACTION, L.REWARD, L.TERMINATED):
        _get(step, k)
    _get(boot, L.OBS)
    _get(ep, L.TERMINATED)
    _arrays(data)
    _has(step, (L.REWARD,), "step leaf", WHERE)  # summed into each trajectory's reward_sum
    lanes, seqs = getattr(src, "lane", None), getattr(src, "seq", None)
    if fill is None:
        return _concatenated(src, data, lanes, seqs)
    if not isinstance(fill, Mapping) or L.STEP not in fill:
        raise SchemaError(f"{WHERE}: .fill must be a dict with a 'step' count (the rollout's or batch's fill), got {fill!r}")
    batched = np.ndim(fill[L.STEP]) > 0
    B = len(fill[L.STEP]) if batched else 1
    for k, v in fill.items():
        if np.shape(v) != ((B,) if batched else ()):
            raise SchemaError(f"{WHERE}: fill[{k!r}] has shape {np.shape(v)}, fill['step'] {np.shape(fill['step'])}; "
                              "a rollout's counts are scalars, a batch's one per rollout")
    ids = [(_pick(lanes, b, b), _pick(seqs, b, None)) if batched else (_pick(lanes, None, 0), _pick(seqs, None, None))
           for b in range(B)]
    names = [(f"rollout {b} of the batch" if batched else "the rollout") + f" (lane {lane}, seq {seq})"
             for b, (lane, seq) in enumerate(ids)]
    truncate = L.END in ep
    cap, rows = _check_shapes(data, B if batched else None, truncate, f"{WHERE}: {'the batch' if batched else names[0]}")
    for b, name in enumerate(names):
        f = {k: _count(v[b] if batched else v, f"{WHERE}: {name}: fill[{k!r}]") for k, v in fill.items()}
        if not 0 <= f[L.STEP] <= cap:
            raise SchemaError(f"{WHERE}: {name}: fill['step']={f[L.STEP]} is outside the step leaves' capacity 0..{cap}")
        if truncate and not 0 <= f.get(L.EPISODE, 0) <= rows:
            raise SchemaError(f"{WHERE}: {name}: fill['episode']={f[L.EPISODE]} is outside the episode table's capacity "
                              f"0..{rows}")
    g = _grid(data, fill, L.TRUNCATE_EPISODES if truncate else L.COMPLETE_EPISODES)
    if not truncate:  # one episode per rollout; its successor is the rollout's bootstrap obs
        return [_complete(g, ep, (b,), b, 0, int(g.n[b]), ids[b],
                          map_leaves(g.bootstrap[L.OBS], lambda a, b=b: g.as_be(a)[b, 0])) for b in range(B)]
    # the filled rows of the episode table (none without a fill['episode'] count)
    bb, ii = g.filled_rows(rows) if L.EPISODE in fill else (np.zeros(0, np.intp), np.zeros(0, np.intp))
    _check_ends(g, bb, ii, names)
    units = []
    for b in range(B):
        n, mine = int(g.n[b]), bb == b
        units.append(Unit(*ids[b], _steps(g, b, 0, n), n, g.E, _rows(g, bb[mine], ii[mine]),
                          map_leaves(g.bootstrap[L.OBS], lambda a, b=b: g.as_be(a)[b]), False))
    return units


def _grid(src: Any, fill: Mapping[str, Any] | None, batch_mode: str) -> L.Grid:
    """:func:`shmbuf.layout.grid` of what the Recorder is handed; its errors said as the Recorder's (SchemaError)."""
    try:
        return L.grid(src, fill, batch_mode=batch_mode, ref=L.REWARD)
    except (SchemaError, UsageError) as e:
        raise SchemaError(f"{WHERE}: {e}") from None


def _steps(g: L.Grid, b: int, t0: int, t1: int) -> Any:
    """Rollout ``b``'s steps ``[t0, t1)``: every step leaf as ``(t1 - t0, E, ...)`` (views)."""
    return map_leaves(g.step, lambda a: g.as_bte(a)[b, t0:t1])


def _rows(g: L.Grid, bb: np.ndarray, ii: np.ndarray) -> list[tuple[int, int, bool, bool, float, int, Any]]:
    """Episode-table rows ``(bb, ii)`` as ``(env, end, terminated, truncated, return, length, final obs)``."""
    ep = g.episode
    cols = [g.table(ep[k])[bb, ii].tolist() for k in (L.ENV, L.END, L.TERMINATED, L.TRUNCATED, L.RETURN, L.LENGTH)]
    finals = [map_leaves(ep[L.FINAL_OBS], lambda a, b=b, i=i: g.table(a)[b, i]) for b, i in zip(bb.tolist(), ii.tolist())]
    return [(int(e), int(t), bool(te), bool(tr), float(r), int(n), f) for e, t, te, tr, r, n, f in zip(*cols, finals)]


def _complete(g: L.Grid, ep: Mapping[str, Any], at: tuple[int, ...], b: int, t0: int, t1: int,
              ids: tuple[int, int | None], final: Any) -> Unit:
    """Steps ``[t0, t1)`` of rollout ``b``, one whole episode: its record is ``at`` in the episode record leaves
    ``ep`` (as :meth:`Grid.table` reads them), ``final`` its successor."""
    term, trunc, ret, length = (g.table(ep[k])[at] for k in RECORD_FIELDS)
    episode = (0, t1 - t0 - 1, bool(term), bool(trunc), float(ret), int(length), final)
    return Unit(*ids, _steps(g, b, t0, t1), t1 - t0, 1, [episode], None, True)


def _concatenated(src: Any, data: Mapping[str, Any], lanes: Any, seqs: Any) -> list[Unit]:
    """A complete-episodes CollectedBatch (episodes concatenated, split by ``.lengths``): one unit per episode."""
    if getattr(src, "lengths", None) is None:
        raise SchemaError(f"{WHERE}: the rollout has no .fill and no .lengths; expected a shmbuf Rollout or Batch (fill) "
                          "or a complete-episodes CollectedBatch (lengths)")
    g = _grid(src, None, L.COMPLETE_EPISODES)
    assert g.lengths is not None  # grid read the lengths: fill is None in complete-episodes mode
    R = len(g.lengths)
    _lead_dims(data[L.STEP], (g.T,), L.STEP, WHERE)
    _lead_dims({L.EPISODE: data[L.EPISODE], L.BOOTSTRAP: data[L.BOOTSTRAP]}, (R,), "", f"{WHERE} (one per episode)")
    _same_obs(data[L.STEP][L.OBS], 1, data[L.BOOTSTRAP][L.OBS], 1, "bootstrap obs", WHERE)
    _has(data[L.EPISODE], RECORD_FIELDS, "episode record field", WHERE)
    # episode r's steps end at cumsum(lengths)[r] - 1; its successor is row r of the episode table's final_obs
    ends = np.cumsum(g.lengths)
    starts = ends - g.lengths
    return [_complete(g, data[L.EPISODE], (0, r), 0, int(starts[r]), int(ends[r]), (_pick(lanes, r, r), _pick(seqs, r, None)),
                      map_leaves(g.episode[L.FINAL_OBS], lambda a, r=r: g.table(a)[0, r]))
            for r in range(R)]


# -- checks: what grid does not check, each naming the leaf (and the rollout's lane and seq) ------------------


def _arrays(tree: Any) -> None:
    """Every leaf of ``tree`` is (or reads as) a numpy array of a plain dtype; SchemaError naming the first that is not."""
    for name, leaf in flat_leaves(tree):
        try:
            a = np.asarray(leaf)
        except Exception as e:  # noqa: BLE001  # whatever __array__ raises (a torch tensor needing grad, ...)
            raise SchemaError(f"{WHERE}: leaf {name!r} cannot be read as a numpy array ({type(e).__name__}: {e})") from None
        if a.dtype.hasobject:
            raise SchemaError(f"{WHERE}: leaf {name!r} is {type(leaf).__name__} of dtype {a.dtype}; expected an array of "
                              "numbers or bools (no objects: nothing is pickled)")


def _check_shapes(data: Mapping[str, Any], B: int | None, truncate: bool, where: str) -> tuple[int, int]:
    """The shapes every rollout of a Rollout or Batch (``B`` rollouts; None: one) shares: step leaves ``([B], T, [E],
    ...)``, an episode table (truncate-episodes) or record, final and bootstrap observations shaped like the step obs.
    Returns the step capacity T and the episode table's rows (0 in complete-episodes mode)."""
    batch = () if B is None else (B,)
    if B is not None:
        _lead_dims(data, batch, "", where)
    step, ep, bobs = data[L.STEP], data[L.EPISODE], data[L.BOOTSTRAP][L.OBS]
    lead = np.shape(step[L.REWARD])[len(batch):]
    if len(lead) not in (1, 2) or (not truncate and len(lead) != 1):
        raise SchemaError(f"{where}: step leaf 'reward' has shape {lead}; expected (steps,) or, in "
                          "truncate-episodes mode, (steps, envs)")
    _lead_dims(step, batch + lead, L.STEP, where)
    lead_n = len(batch + lead)
    rows = 0
    if truncate:
        rows = _check_table(ep, len(batch), where)
        _same_obs(step[L.OBS], lead_n, ep[L.FINAL_OBS], len(batch) + 1, "episode final_obs", where)
    else:
        _lead_dims(ep, batch, L.EPISODE, where, exact=True)
        _has(ep, RECORD_FIELDS, "episode record field", where)
    _same_obs(step[L.OBS], lead_n, bobs, lead_n - 1, "bootstrap obs", where)
    if len(lead) == 2:
        _lead_dims(bobs, batch + lead[1:], "bootstrap obs", where)
    return lead[0], rows


def _has(tree: Mapping[str, Any], keys: tuple[str, ...], what: str, where: str) -> None:
    """``tree`` holds an array of numbers or bools (not a subtree) at each of ``keys``."""
    for key in keys:
        v = tree.get(key)
        if v is None or isinstance(v, (Mapping, list, tuple)) or np.asarray(v).dtype.kind not in "biuf":
            got = "nothing" if v is None else type(v).__name__ if isinstance(v, (Mapping, list, tuple)) else \
                f"of dtype {np.asarray(v).dtype}"
            raise SchemaError(f"{where}: {what} {key!r} is {got}; expected an array of numbers or bools")


def _lead_dims(tree: Any, lead: tuple[int, ...], prefix: str, where: str, exact: bool = False) -> None:
    """Every leaf's shape starts with ``lead`` (is exactly ``lead`` with ``exact``); SchemaError naming the first that
    does not."""
    for name, leaf in flat_leaves(tree):
        shape = np.shape(leaf)
        if (shape != lead) if exact else (shape[:len(lead)] != lead):
            path = ".".join(p for p in (prefix, name) if p)
            raise SchemaError(f"{where}: leaf {path!r} has shape {shape}; expected {'' if exact else 'a leading '}{lead}")


def _same_obs(obs: Any, obs_lead: int, other: Any, other_lead: int, what: str, where: str) -> None:
    """``other`` (final or bootstrap observations) has the step obs tree's leaves, with the same item shapes."""
    a = {k: np.shape(v)[obs_lead:] for k, v in flat_leaves(obs)}
    b = {k: np.shape(v)[other_lead:] for k, v in flat_leaves(other)}
    if a != b:
        raise SchemaError(f"{where}: {what} has leaves {b}; expected the step obs tree's {a} (item shapes)")


def _count(v: Any, what: str) -> int:
    """A fill count: an integral number (a Python or numpy int, or a whole float); SchemaError naming it otherwise.

    Per rollout, so that the error names it; and before :func:`shmbuf.layout.grid` reads the fill, whose own
    check of the counts lets numpy warn on an infinite or huge float (a RuntimeWarning, an error under the tests).
    """
    a = np.asarray(v)
    if a.ndim == 0 and a.dtype.kind in "iu":
        return int(a)
    if a.ndim == 0 and a.dtype.kind == "f" and float(a).is_integer():
        return int(a)
    raise SchemaError(f"{what}: expected an integer count, got {v!r}")


def _check_table(e_tab: Any, nb: int, where: str) -> int:
    """A truncate-episodes episode table (``nb`` leading batch dims): fields present, one value per row, ends and envs
    integers. Returns its rows."""
    if not isinstance(e_tab, Mapping):
        raise SchemaError(f"{where}: data['episode'] must be a dict (the episode table), got {type(e_tab).__name__}")
    for key in EPISODE_FIELDS:
        if key not in e_tab:
            raise SchemaError(f"{where}: the episode table has no {key!r}; the workers truncate-episodes layout has "
                              f"{list(EPISODE_FIELDS)}, got {sorted(e_tab)}")
        if key != L.FINAL_OBS and np.ndim(e_tab[key]) != nb + 1:
            raise SchemaError(f"{where}: episode table field {key!r} has shape {np.shape(e_tab[key])[nb:]}; expected "
                              "one value per row (rows,)")
    for name, leaf in flat_leaves(e_tab[L.FINAL_OBS]):
        if np.ndim(leaf) < nb + 1:
            raise SchemaError(f"{where}: episode table field 'final_obs' leaf {name!r} has shape {np.shape(leaf)[nb:]}; "
                              "expected (rows, ...)")
    for key in (L.END, L.ENV):
        dtype = np.asarray(e_tab[key]).dtype
        if dtype.kind not in "iu":
            raise SchemaError(f"{where}: episode table field {key!r} has dtype {dtype}; expected integers")
    return min(np.shape(x)[nb] for x in [e_tab[f] for f in EPISODE_FIELDS[:-1]]
               + [leaf for _, leaf in flat_leaves(e_tab[L.FINAL_OBS])])


def _check_ends(g: L.Grid, bb: np.ndarray, ii: np.ndarray, names: list[str]) -> None:
    """The filled episode-table rows ``(bb, ii)`` end at stored steps (``0 <= end < n``) of existing envs
    (``0 <= env < E``); SchemaError naming the first row that does not, and its rollout."""
    n = g.n[bb]
    for key, hi in ((L.END, n), (L.ENV, np.full(len(bb), g.E))):
        v = g.table(g.episode[key])[bb, ii]
        bad = np.flatnonzero((v < 0) | (v >= hi))
        if len(bad):
            j = int(bad[0])
            b, nj = int(bb[j]), int(n[j])
            what = f"the stored steps 0..{nj - 1} (fill['step']={nj})" if key == L.END else f"the envs 0..{g.E - 1}"
            raise SchemaError(f"{WHERE}: {names[b]}: episode table row {int(ii[j])} has {key}={int(v[j])}, outside {what}")


def _pick(arr: Any, b: int | None, default: Any) -> Any:
    """Rollout metadata (lane, seq) of batch position ``b`` (None: a single rollout), or ``default`` without it."""
    if arr is None:
        return default
    try:
        v = np.asarray(arr if b is None else np.asarray(arr)[b])
        if v.ndim == 0 and v.dtype.kind in "iu":
            return int(v)
    except (IndexError, TypeError, ValueError):
        pass
    where = "" if b is None else f"[{b}]"
    raise SchemaError(f"{WHERE}: the rollout's lane/seq{where} is {arr!r}; expected an int (one per rollout of "
                      "a batch), as a shmbuf Rollout, Batch or CollectedBatch gives")
