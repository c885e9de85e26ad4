"""One agent's observation in multi-agent collection: a numpy array, or a dict or tuple of them (a gymnasium ``Dict``
or ``Tuple`` space: PettingZoo classic's ``{"observation": ..., "action_mask": ...}`` is the common case).

A policy's rows of observations are then a tree of the same structure whose leaves are ``(K, ...)`` arrays, one row
per agent (see :mod:`workers._multiagent`), as the single-agent collectors keep a Dict observation (one leaf per
component, :func:`shmbuf.layout.rollout_example`). This module makes the layout example of an agent's observation
(from what the env returned, :func:`obs_example`, or from its space for an agent that joins later,
:func:`space_example`) and stores an agent's observation into its row (:func:`store`). The array case, which is the
multi-agent loop's hot path, keeps its own code (one type check, then plain array stores): the tree helpers
(:func:`zero`, :func:`put`, :func:`take`) branch on ``type(x) is np.ndarray`` first.

Containers are normalised: any mapping is a ``dict`` (optree's leaf order: keys sorted), any tuple a ``tuple``, so
that the example from a reset, from a space and every later observation have one structure whatever mapping class
the env uses. Anything else (a ``Text`` space, a string, an object) is refused with a :class:`shmbuf.UsageError`
naming the agent, its policy and what was received.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optree

from shmbuf import SchemaError, UsageError

LEAF_KINDS = "biufc"  # numpy dtype kinds a leaf may have: bool, int, uint, float, complex
EXPECTED = ("a numpy array (a Box, Discrete, MultiBinary or MultiDiscrete space), or a dict or tuple of them (a Dict or "
            "Tuple space)")


def _at(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path)


def obs_example(obs: Any, who: str, space: Callable[[], Any] | None = None) -> Any:
    """``obs`` (one agent's observation) as a layout example: a copy, mappings as dicts, tuples as tuples, every leaf
    a numpy array of a numeric or bool dtype.

    ``who`` names the agent and its policy in errors; ``space()``, if given, the agent's observation space, named too.

    Raises:
        UsageError: a leaf that is not an array of numbers (a string, None, an object, ragged lists), or a dict key
            that is not a str, naming ``who``, the leaf's path, its type and the space.
    """
    def refuse(path: tuple[Any, ...], what: str) -> UsageError:
        sp = ""
        if space is not None:
            try:
                sp = f" (its observation_space is {space()!r:.120})"
            except Exception:  # noqa: BLE001  # only for the message: an env whose space raises still gets the error
                sp = ""
        return UsageError(f"{who}: expected an observation that is {EXPECTED}, got {what}"
                          f"{' at obs' + _at(path) if path else ''}{sp}")

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(x, Mapping):
            bad = [k for k in x if not isinstance(k, str)]
            if bad:
                raise refuse(path, f"a dict with the key {bad[0]!r} ({type(bad[0]).__name__}; keys must be str)")
            return {k: walk(v, (*path, k)) for k, v in x.items()}
        if isinstance(x, tuple):
            return tuple(walk(v, (*path, i)) for i, v in enumerate(x))
        try:
            a = np.asarray(x)
        except ValueError:  # ragged nested sequences
            raise refuse(path, f"a {type(x).__name__} that is no array") from None
        if a.dtype.kind not in LEAF_KINDS:
            got = type(x).__name__ if type(x) is not np.ndarray else f"an array of dtype {a.dtype}"
            raise refuse(path, got)
        return np.array(a)

    return walk(obs, ())


def space_example(space: Any, who: str) -> Any:
    """Zeros of one observation of ``space``: an array for a space with a shape and a numeric dtype (Box, Discrete,
    MultiBinary, MultiDiscrete), a dict for a gymnasium ``Dict``, a tuple for a ``Tuple``; what an agent absent at
    the first reset is laid out from.

    Raises:
        UsageError: a space of anything else (``Text``, ``Sequence``, ``Graph``, ``OneOf``), naming ``who`` and it.
    """
    try:
        from gymnasium.spaces import Dict, Tuple
    except ImportError:  # spaces of another kind: only their shape and dtype are read
        Dict = Tuple = ()  # isinstance(x, ()) is False

    def walk(sp: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(sp, Dict):
            return {str(k): walk(s, (*path, k)) for k, s in sp.spaces.items()}
        if isinstance(sp, Tuple):
            return tuple(walk(s, (*path, i)) for i, s in enumerate(sp.spaces))
        shape, dtype = getattr(sp, "shape", None), getattr(sp, "dtype", None)
        try:
            dt = np.dtype(dtype) if dtype is not None else None
        except TypeError:
            dt = None
        if shape is None or dt is None or dt.kind not in LEAF_KINDS:
            at = f" (at {_at(path)} of {space!r:.120})" if path else ""
            raise UsageError(f"{who}: its observation_space is {sp!r:.120}{at}; expected {EXPECTED}")
        return np.zeros(tuple(shape), dt)

    return walk(space, ())


def zeros_rows(item: Any, k: int) -> Any:
    """``k`` rows of zeros shaped like ``item`` (an array or a tree of them, no lead dims)."""
    if type(item) is np.ndarray:
        return np.zeros((k, *item.shape), item.dtype)
    return optree.tree_map(lambda a: np.zeros((k, *a.shape), a.dtype), item)


def zero(x: Any) -> None:
    """Every element of ``x`` (an array or a tree of them) set to zero, in place."""
    if type(x) is np.ndarray:
        x[...] = 0
        return
    for a in optree.tree_leaves(x):
        a[...] = 0


def put(dst: Any, idx: Any, src: Any) -> None:
    """``dst[idx] = src`` leaf by leaf, ``src`` of ``dst``'s structure (both the loop's own trees)."""
    if type(dst) is np.ndarray:
        dst[idx] = src
        return
    for d, s in zip(optree.tree_leaves(dst), optree.tree_leaves(src), strict=True):
        d[idx] = s


def take(x: Any, idx: Any) -> Any:
    """``x[idx]`` leaf by leaf."""
    return x[idx] if type(x) is np.ndarray else optree.tree_map(lambda a: a[idx], x)


def store(dst: Any, idx: Any, obs: Any, who: str, *, lead: int = 1) -> None:
    """One agent's observation ``obs``, as the env returned it, into ``dst[idx]`` (``dst`` a tree of dicts and tuples
    of arrays, ``lead`` dims before an observation's own: 1 for rows, 0 for one item), each leaf checked.

    Raises:
        SchemaError: ``obs`` has another structure than ``dst`` (naming the path, what was expected and what came),
            or a leaf of another shape, or of a dtype that does not cast (same kind), naming ``who`` and the leaf.
    """
    def walk(d: Any, o: Any, path: tuple[Any, ...]) -> None:
        if isinstance(d, dict):
            if not isinstance(o, Mapping) or o.keys() != d.keys():
                got = f"a dict with keys {sorted(map(str, o))}" if isinstance(o, Mapping) else type(o).__name__
                raise SchemaError(f"{who}'s observation{' at obs' + _at(path) if path else ''}: expected a dict with keys "
                                  f"{sorted(d)}, got {got}")
            for k, v in d.items():
                walk(v, o[k], (*path, k))
            return
        if isinstance(d, tuple):
            if not isinstance(o, tuple) or len(o) != len(d):
                got = f"a tuple of {len(o)}" if isinstance(o, tuple) else type(o).__name__
                raise SchemaError(f"{who}'s observation{' at obs' + _at(path) if path else ''}: expected a tuple of "
                                  f"{len(d)}, got {got}")
            for i, (v, x) in enumerate(zip(d, o)):
                walk(v, x, (*path, i))
            return
        want = d.shape[lead:]
        if type(o) is not np.ndarray or o.shape != want or o.dtype != d.dtype:
            a = np.asarray(o)
            if a.shape != want or not np.can_cast(a.dtype, d.dtype, "same_kind"):
                raise SchemaError(f"{who}'s observation{' at obs' + _at(path) if path else ''}: expected shape {want} "
                                  f"and dtype {d.dtype}, got shape {a.shape} and dtype {a.dtype}")
        d[idx] = o

    walk(dst, obs, ())


def item_copy(template_rows: Any, obs: Any, who: str) -> Any:
    """A copy of one agent's observation in the structure and dtypes of ``template_rows`` (its policy's rows), checked
    as :func:`store` checks it: a final observation kept past the step."""
    out = optree.tree_map(lambda a: np.empty(a.shape[1:], a.dtype), template_rows)
    store(out, ..., obs, who, lead=0)
    return out
