"""What a writer hands out (a shmbuf Rollout or Batch, a workers CollectedBatch), read as per-lane units.

:func:`rollout_units` is the Recorder's adapter of a rollout or batch to one unit per rollout of one lane,
each checked before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from shmbuf._errors import SchemaError, UsageError
from shmbuf.layout import (
    ACTION, BOOTSTRAP, END, ENV, EPISODE, FINAL_OBS, LENGTH, OBS, RETURN, REWARD, STEP, TERMINATED, TRUNCATED,
)
from shmbuf.storage._fileformat import flat_leaves, index_leaves, map_leaves


class Unit(NamedTuple):
    """One rollout of one lane: step leaves ``(n, E, ...)`` (views), its ended episodes, its successor."""

    lane: int
    seq: int | None
    step: dict[str, Any]
    n: int
    E: int
    episodes: list[tuple[int, int, bool, bool, float, int, Any]]  # env, end, terminated, truncated, return, length, final
    bootstrap: Any  # obs tree, leaves (E, ...)
    complete: bool  # one whole episode (complete-episodes mode)


def _get(tree: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(tree, Mapping):
        raise SchemaError(f"{where}: expected a dict holding {key!r} (the workers rollout layout), got "
                          f"{type(tree).__name__}")
    if key not in tree:
        raise SchemaError(f"{where}: the rollout has no {key!r}; expected the workers rollout layout (step leaves "
                          f"obs, action, reward, terminated[, truncated]; an episode table; bootstrap obs), got "
                          f"{sorted(tree)}")
    return tree[key]


def rollout_units(src: Any) -> list[Unit]:
    """A shmbuf Rollout or Batch, or a workers CollectedBatch (duck-typed: ``.data``, ``.fill``, optional lane/seq).

    Every rollout is checked here, before anything is written: a bad one raises :class:`SchemaError`
    naming the field and the rollout, and nothing of the call is recorded.
    """
    data, fill = getattr(src, "data", None), getattr(src, "fill", None)
    where = "Recorder.write"
    if not isinstance(data, Mapping) or not isinstance(data.get(STEP), Mapping):
        raise UsageError(f"{where}: expected a shmbuf Rollout or Batch or a workers CollectedBatch (with .data['step'] "
                         f"and .fill), got {type(src).__name__}")
    step, ep, boot = data[STEP], _get(data, EPISODE, where), _get(data, BOOTSTRAP, where)
    for k in (OBS, ACTION, REWARD, TERMINATED):
        _get(step, k, where)
    bobs = _get(boot, OBS, where)
    _get(ep, TERMINATED, where)
    _arrays(data, where)
    lanes, seqs = getattr(src, "lane", None), getattr(src, "seq", None)
    truncate = END in ep
    if fill is None:  # a complete-episodes CollectedBatch: episodes concatenated, split by lengths
        lengths = _lengths(src, step, where)
        _lead_dims(step, (len(np.asarray(step[REWARD])),), STEP, where)
        _lead_dims({EPISODE: ep, BOOTSTRAP: boot}, (len(lengths),), "", f"{where} (one per episode)")
        _same_obs(step[OBS], 1, bobs, 1, "bootstrap obs", where)
        out, o = [], 0
        for b, n in enumerate(lengths.tolist()):
            sl = slice(o, o + n)
            o += n
            out.append(_complete_unit(map_leaves(step, lambda a, sl=sl: np.asarray(a)[sl][:, None]), n, index_leaves(ep, b),
                                      index_leaves(bobs, b), _pick(lanes, b, b), _pick(seqs, b, None)))
        return out
    if not isinstance(fill, Mapping) or STEP not in fill:
        raise SchemaError(f"{where}: .fill must be a dict with a 'step' count (the rollout's or batch's fill), got {fill!r}")
    batched = np.ndim(fill[STEP]) > 0
    B = len(fill[STEP]) if batched else 1
    for k, v in fill.items():
        if np.shape(v) != ((B,) if batched else ()):
            raise SchemaError(f"{where}: fill[{k!r}] has shape {np.shape(v)}, fill['step'] {np.shape(fill['step'])}; "
                              "a rollout's counts are scalars, a batch's one per rollout")
    if batched:
        _lead_dims(data, (B,), "", f"{where} (a batch of {B})")
    subs = []
    for b in range(B):
        lane, seq = (_pick(lanes, b, b), _pick(seqs, b, None)) if batched else (_pick(lanes, None, 0), _pick(seqs, None, None))
        name = (f"rollout {b} of the batch" if batched else "the rollout") + f" (lane {lane}, seq {seq})"
        counts = {k: _count(v[b] if batched else v, f"{where}: {name}: fill[{k!r}]") for k, v in fill.items()}
        subs.append((index_leaves(data, b) if batched else data, counts, lane, seq, name))
    out = []
    for d, f, lane, seq, name in subs:
        n = f[STEP]
        st = d[STEP]
        lead = np.shape(st[REWARD])
        if len(lead) not in (1, 2) or (not truncate and len(lead) != 1):
            raise SchemaError(f"{where}: {name}: step leaf 'reward' has shape {lead}; expected (steps,) or, in "
                              "truncate-episodes mode, (steps, envs)")
        _lead_dims(st, lead, STEP, f"{where}: {name}")
        cap = lead[0]
        if not 0 <= n <= cap:
            raise SchemaError(f"{where}: {name}: fill['step']={n} is outside the step leaves' capacity 0..{cap}")
        if not truncate:
            _lead_dims(d[EPISODE], (), EPISODE, f"{where}: {name}", exact=True)
            _same_obs(st[OBS], 1, d[BOOTSTRAP][OBS], 0, "bootstrap obs", f"{where}: {name}")
            out.append(_complete_unit(map_leaves(st, lambda a, n=n: np.asarray(a)[:n][:, None]), n, d[EPISODE],
                                      d[BOOTSTRAP][OBS], lane, seq))
            continue
        vector = np.ndim(st[REWARD]) == 2
        step_v = map_leaves(st, (lambda a, n=n: np.asarray(a)[:n]) if vector else (lambda a, n=n: np.asarray(a)[:n, None]))
        E = np.shape(st[REWARD])[1] if vector else 1
        e_tab = d[EPISODE]
        k = f.get(EPISODE, 0)
        _check_episodes(e_tab, k, n, E, f"{where}: {name}")
        _same_obs(st[OBS], len(lead), e_tab[FINAL_OBS], 1, "episode final_obs", f"{where}: {name}")
        _same_obs(st[OBS], len(lead), d[BOOTSTRAP][OBS], len(lead) - 1, "bootstrap obs", f"{where}: {name}")
        if vector:
            _lead_dims(d[BOOTSTRAP][OBS], (E,), "bootstrap obs", f"{where}: {name}")
        eps = [(int(e_tab[ENV][i]), int(e_tab[END][i]), bool(e_tab[TERMINATED][i]), bool(e_tab[TRUNCATED][i]),
                float(e_tab[RETURN][i]), int(e_tab[LENGTH][i]), index_leaves(e_tab[FINAL_OBS], i)) for i in range(k)]
        bo = d[BOOTSTRAP][OBS]
        out.append(Unit(lane, seq, step_v, n, E, eps, bo if vector else map_leaves(bo, lambda a: np.asarray(a)[None]), False))
    return out


EPISODE_FIELDS = (RETURN, LENGTH, TERMINATED, TRUNCATED, ENV, END, FINAL_OBS)


def _arrays(tree: Any, where: str) -> None:
    """Every leaf of ``tree`` is (or reads as) a numpy array of a plain dtype; SchemaError naming the first that is not."""
    for name, leaf in flat_leaves(tree):
        try:
            a = np.asarray(leaf)
        except Exception as e:  # noqa: BLE001  # whatever __array__ raises (a torch tensor needing grad, ...)
            raise SchemaError(f"{where}: leaf {name!r} cannot be read as a numpy array ({type(e).__name__}: {e})") from None
        if a.dtype.hasobject:
            raise SchemaError(f"{where}: leaf {name!r} is {type(leaf).__name__} of dtype {a.dtype}; expected an array of "
                              "numbers or bools (no objects: nothing is pickled)")


def _lead_dims(tree: Any, lead: tuple[int, ...], prefix: str, where: str, exact: bool = False) -> None:
    """Every leaf's shape starts with ``lead`` (is exactly ``lead`` with ``exact``); SchemaError naming the first that does not."""
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
    """A fill count: an integral number (a Python or numpy int, or a whole float); SchemaError naming it otherwise."""
    a = np.asarray(v)
    if a.ndim == 0 and a.dtype.kind in "iu":
        return int(a)
    if a.ndim == 0 and a.dtype.kind == "f" and float(a).is_integer():
        return int(a)
    raise SchemaError(f"{what}: expected an integer count, got {v!r}")


def _lengths(src: Any, step: Any, where: str) -> np.ndarray:
    """A complete-episodes CollectedBatch's episode lengths, checked to cover its concatenated step leaves."""
    lengths = getattr(src, "lengths", None)
    if lengths is None:
        raise SchemaError(f"{where}: the rollout has no .fill and no .lengths; expected a shmbuf Rollout or Batch (fill) "
                          "or a complete-episodes CollectedBatch (lengths)")
    a = np.asarray(lengths)
    cap = len(np.asarray(step[REWARD]))
    if a.ndim != 1 or a.dtype.kind not in "iu" or (a < 0).any() or int(a.sum()) > cap:
        raise SchemaError(f"{where}: .lengths {a.tolist()!r} must be episode lengths >= 0 summing to at most the step "
                          f"leaves' {cap} rows")
    return a.astype(np.int64)


def _check_episodes(e_tab: Any, k: int, n: int, E: int, where: str) -> None:
    """The first ``k`` rows of a truncate-episodes episode table fit the rollout: fields present, rows there, ends
    at stored steps (``0 <= end < n``) of existing envs (``0 <= env < E``)."""
    if not isinstance(e_tab, Mapping):
        raise SchemaError(f"{where}: data['episode'] must be a dict (the episode table), got {type(e_tab).__name__}")
    for key in EPISODE_FIELDS:
        if key not in e_tab:
            raise SchemaError(f"{where}: the episode table has no {key!r}; the workers truncate-episodes layout has "
                              f"{list(EPISODE_FIELDS)}, got {sorted(e_tab)}")
        if key != FINAL_OBS and np.ndim(e_tab[key]) != 1:
            raise SchemaError(f"{where}: episode table field {key!r} has shape {np.shape(e_tab[key])}; expected one "
                              "value per row (rows,)")
    for name, leaf in flat_leaves(e_tab[FINAL_OBS]):
        if np.ndim(leaf) < 1:
            raise SchemaError(f"{where}: episode table field 'final_obs' leaf {name!r} has shape {np.shape(leaf)}; "
                              "expected (rows, ...)")
    rows = min(len(np.asarray(x)) if np.ndim(x) else 0 for x in [e_tab[f] for f in EPISODE_FIELDS[:-1]]
               + [leaf for _, leaf in flat_leaves(e_tab[FINAL_OBS])])
    if not 0 <= k <= rows:
        raise SchemaError(f"{where}: fill['episode']={k} is outside the episode table's capacity 0..{rows}")
    end = np.asarray(e_tab[END])[:k]
    env = np.asarray(e_tab[ENV])[:k]
    for field, v, hi in ((END, end, n), (ENV, env, E)):
        if v.dtype.kind not in "iu":
            raise SchemaError(f"{where}: episode table field {field!r} has dtype {v.dtype}; expected integers")
        bad = np.flatnonzero((v < 0) | (v >= hi))
        if len(bad):
            i = int(bad[0])
            what = f"the stored steps 0..{n - 1} (fill['step']={n})" if field == END else f"the envs 0..{E - 1}"
            raise SchemaError(f"{where}: episode table row {i} has {field}={int(v[i])}, outside {what}")


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
    raise SchemaError(f"Recorder.write: the rollout's lane/seq{where} is {arr!r}; expected an int (one per rollout of "
                      "a batch), as a shmbuf Rollout, Batch or CollectedBatch gives")


def _complete_unit(step: Any, n: int, ep: Any, bobs: Any, lane: int, seq: int | None) -> Unit:
    episode = (0, n - 1, bool(ep[TERMINATED]), bool(ep[TRUNCATED]), float(ep[RETURN]), int(ep[LENGTH]), bobs)
    return Unit(lane, seq, step, n, 1, [episode], map_leaves(bobs, lambda a: np.asarray(a)[None]), True)

