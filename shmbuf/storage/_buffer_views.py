"""The ``[num_envs, T+1]`` rollout buffer's transitions and minibatches: :func:`transition_view` (the padding row
dropped, next observations aligned, views) and :func:`iterate_minibatches` (shuffled rows of a flattened rollout).

Both take numpy dicts (shmbuf's own API) or TensorDicts (embodichain's) and give back the same kind. torch and
tensordict are imported only on the TensorDict / device paths.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf._errors import SchemaError, UsageError
from shmbuf._validate import int_setting
from shmbuf.storage._common import generator
from shmbuf.storage._torch import to_torch

DEFAULT_OBS_FIELDS = (L.OBS, "value")
INDICES = "_indices"  # the key iterate_minibatches adds (embodichain's name)


# -- torch / tensordict, only on these paths ---------------------------------


def torch_device(device: Any, where: str) -> Any:
    """``device`` (a ``str`` or ``torch.device``) as a ``torch.device``; UsageError naming ``where`` otherwise."""
    if isinstance(device, bool) or not isinstance(device, str) and type(device).__name__ != "device":
        raise UsageError(f"{where}: expected a device (a str such as 'cpu' or 'cuda:0', or a torch.device), "
                         f"got {device!r}")
    try:
        import torch
    except ImportError:
        raise UsageError(f"{where}: a device gives torch tensors, and torch is not installed (pip install torch); "
                         "leave the device out for numpy arrays") from None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"{where}: {device!r} is not a torch device ({exc})") from None


def tensordict_class(where: str) -> Any:
    """tensordict's ``TensorDict``; UsageError naming tensordict if it is not installed."""
    try:
        from tensordict import TensorDict
    except ImportError:
        raise UsageError(f"{where}: with a device the rollouts are TensorDicts (embodichain's types), and tensordict is "
                         "not installed (pip install tensordict); leave the device out for dicts of numpy arrays") from None
    return TensorDict


def is_tensordict(x: Any) -> bool:
    """Whether ``x`` is a TensorDict (without importing tensordict: one that exists has been imported)."""
    mod = sys.modules.get("tensordict")
    return mod is not None and isinstance(x, mod.TensorDictBase)


def as_tensordict(arrays: Mapping[str, np.ndarray], batch: tuple[int, ...], device: Any, where: str) -> Any:
    """A TensorDict of ``arrays`` with batch shape ``batch``: ``torch.from_numpy`` (on the CPU the tensors ARE the
    arrays' memory), then moved to ``device`` (a copy anywhere else)."""
    td_cls = tensordict_class(where)
    import torch

    tensors = {k: torch.from_numpy(v if v.flags.writeable else np.array(v)) for k, v in arrays.items()}
    return td_cls(tensors, batch_size=list(batch), device=device)


# -- transition_view ---------------------------------------------------------


def _flat(x: np.ndarray, copy: bool) -> np.ndarray:
    """``[N, T, ...]`` -> ``[N*T, ...]``: numpy's reshape (a view when it can be one), or always a new array."""
    shape = (x.shape[0] * x.shape[1], *x.shape[2:])
    if not copy:
        return x.reshape(shape)
    out = np.empty(shape, x.dtype)
    out.reshape(x.shape)[...] = x
    return out


def _transitions(arrays: Mapping[str, Any], obs_fields: tuple[str, ...]) -> tuple[dict[str, Any], int, int]:
    """The ``[:, :T]`` (and ``next_x = x[:, 1:]``) slices of ``[N, T+1]`` arrays or tensors, with N and T."""
    if not arrays:
        raise SchemaError("transition_view(): the rollout has no fields")
    for k, v in arrays.items():
        if len(v.shape) < 2:
            raise SchemaError(f"transition_view(): field {k!r} has shape {tuple(v.shape)}; expected batch shape "
                              "[num_envs, T+1]")
    n = next(iter(arrays.values())).shape[0]
    t1 = max(v.shape[1] for v in arrays.values())
    t = t1 - 1
    if t < 1:
        raise SchemaError(f"transition_view(): the rollout has {t1} time rows; expected T+1 >= 2")
    out: dict[str, Any] = {}
    for k, v in arrays.items():
        if v.shape[0] != n or v.shape[1] not in (t, t1) or (k in obs_fields and v.shape[1] != t1):
            want = f"[{n}, {t1}, ...]" if k in obs_fields else f"[{n}, {t1}, ...] or [{n}, {t}, ...]"
            kind = "observation-aligned " if k in obs_fields else ""
            raise SchemaError(f"transition_view(): {kind}field {k!r}: expected batch shape {want}, got {tuple(v.shape)}")
        out[k] = v[:, :t]
        if k in obs_fields:
            if f"next_{k}" in arrays:
                raise SchemaError(f"transition_view(): field 'next_{k}' clashes with the next_{k} made of observation-aligned "
                                  f"field {k!r}; rename it, or leave {k!r} out of obs_fields")
            out[f"next_{k}"] = v[:, 1:]
    return out, n, t


def transition_view(rollout: Mapping[str, Any], flatten: bool = False, *, obs_fields: tuple[str, ...] = DEFAULT_OBS_FIELDS,
                    copy: bool = False) -> Any:
    """The transitions of a ``[num_envs, T+1]`` rollout: the padding row dropped, next observations aligned.

    For each field ``x`` of batch shape ``[N, T+1]``: an observation-aligned one (in ``obs_fields``)
    gives ``x = x[:, :T]`` and ``next_x = x[:, 1:]``; any other gives ``x[:, :T]`` (its row T is
    padding). A field already of batch shape ``[N, T]`` (e.g. an ``advantage`` you computed) is taken
    as it is. T+1 is the largest second dim among the fields; observation-aligned fields must have it.

    Types follow the input: a dict of arrays gives a dict of numpy arrays; a TensorDict (embodichain's
    rollout, e.g. from ``RolloutBuffer(..., device).get(flatten=False)``) gives a TensorDict of batch
    shape ``[N, T]`` (``[N*T]`` flattened) on the rollout's device, the same fields as the dict form.

    Views and copies: with ``flatten=False`` every result is a view of ``rollout``'s array (a
    slice; nothing is copied). With ``flatten=True`` each is reshaped to ``[N*T, ...]``, which is a
    view only where numpy can merge the two axes without copying: for a ``[:, :T]`` or ``[:, 1:]``
    slice of an ``[N, T+1]`` array, only when ``N == 1`` or ``T == 1`` (otherwise the rows of one env
    are not a stride apart from the next env's: the padding row sits between them), and for a
    C-contiguous ``[N, T]`` field always; everything else is copied. ``copy=True`` copies every field
    (``get(flatten=True)`` does, so the slot can be released). A TensorDict follows torch's reshape
    rules, the same ones.
    """
    if is_tensordict(rollout):
        return _transition_tensordict(rollout, flatten, obs_fields, copy)
    arrays = {k: np.asarray(v) if not isinstance(v, np.ndarray) else v for k, v in rollout.items()}
    out, _, _ = _transitions(arrays, obs_fields)
    if flatten:
        out = {k: _flat(v, copy) for k, v in out.items()}
    elif copy:
        out = {k: np.array(v) for k, v in out.items()}
    return out


def _transition_tensordict(rollout: Any, flatten: bool, obs_fields: tuple[str, ...], copy: bool) -> Any:
    if len(rollout.batch_size) < 2:
        raise SchemaError(f"transition_view(): the TensorDict has batch shape {list(rollout.batch_size)}; expected "
                          "[num_envs, T+1]")
    out, n, t = _transitions({k: rollout.get(k) for k in rollout.keys()}, obs_fields)
    td = type(rollout)(out, batch_size=[n, t], device=rollout.device)
    if flatten:
        td = td.reshape(n * t)
    return td.clone() if copy else td


# -- iterate_minibatches -----------------------------------------------------


def iterate_minibatches(rollout: Mapping[str, Any], batch_size: int, device: Any = None, *,
                        rng: Any = None) -> Iterator[Any]:
    """Shuffled minibatches of a flattened rollout (every field ``[M, ...]``): each of the M rows exactly once.

    Each batch is new arrays (numpy fancy indexing copies), ``batch_size`` rows (the last may be
    fewer), plus ``"_indices"``: which rows of ``rollout`` it holds (embodichain's key). ``rng``: a
    ``np.random.Generator``, a seed, or None (fresh entropy). ``device`` (embodichain's third
    argument, positional or keyword): if given, each batch comes as torch tensors on it
    (:func:`to_torch`). A TensorDict rollout of batch shape ``[M]`` (embodichain's) gives TensorDicts of
    batch shape ``[batch_size]``, cloned, ``"_indices"`` a torch tensor, moved to ``device`` if given.
    Arguments are checked now, not at the first ``next`` (SchemaError for the rollout, UsageError
    naming ``batch_size``, ``device`` or ``rng``).
    """
    batch_size = int_setting("iterate_minibatches(batch_size=...)", batch_size, 1)
    dev = None if device is None else torch_device(device, "iterate_minibatches(device=...)")
    if is_tensordict(rollout):
        return _td_minibatches(rollout, batch_size, generator(rng, "iterate_minibatches(rng=...)"), dev)
    arrays = {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in rollout.items()}
    if not arrays:
        raise SchemaError("iterate_minibatches(): the rollout has no fields")
    sizes = {k: v.shape[0] if v.ndim else None for k, v in arrays.items()}
    m = next(iter(sizes.values()))
    bad = {k: s for k, s in sizes.items() if s != m or s is None}
    if bad:
        raise SchemaError(f"iterate_minibatches(): every field must share the leading dim (a flattened rollout: "
                          f"get(flatten=True) or transition_view(..., flatten=True)); got {sizes}")
    assert m is not None  # a 0-d field (size None) would be in `bad`
    gen = generator(rng, "iterate_minibatches(rng=...)")
    return _minibatches(arrays, m, batch_size, gen, dev)


def _minibatches(arrays: dict[str, np.ndarray], m: int, batch_size: int, gen: np.random.Generator,
                 device: Any) -> Iterator[dict[str, Any]]:
    perm = gen.permutation(m)
    for start in range(0, m, batch_size):
        idx = perm[start : start + batch_size]
        batch: dict[str, Any] = {k: v[idx] for k, v in arrays.items()}
        batch[INDICES] = idx
        yield batch if device is None else to_torch(batch, device)


def _td_minibatches(rollout: Any, batch_size: int, gen: np.random.Generator, device: Any) -> Iterator[Any]:
    if len(rollout.batch_size) != 1:
        raise SchemaError(f"iterate_minibatches(): the TensorDict has batch shape {list(rollout.batch_size)}; expected a "
                          "flattened rollout [M] (get(flatten=True) or transition_view(..., flatten=True))")
    import torch

    perm = torch.from_numpy(gen.permutation(int(rollout.batch_size[0])))
    return _td_batches(rollout, perm, batch_size, device)


def _td_batches(rollout: Any, perm: Any, batch_size: int, device: Any) -> Iterator[Any]:
    for start in range(0, perm.shape[0], batch_size):
        idx = perm[start : start + batch_size]
        batch = rollout[idx.to(rollout.device) if rollout.device is not None else idx].clone()
        batch[INDICES] = idx.to(batch.device) if batch.device is not None else idx
        yield batch if device is None else batch.to(device)
