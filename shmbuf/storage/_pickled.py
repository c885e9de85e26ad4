"""The recordings of rsl_rl's legged-robot forks (their ``DemonstrationSaver``: pickled trajectories), read only
when asked to, and converted once into shmbuf's format (:mod:`shmbuf.storage._fileformat`).

Their layout, as their saver writes it and their ``RolloutDataset`` reads it::

    save_dir/
        metadata.json                      config, env, policy, ...; obs_segments and obs_disassemble_mapping
                                           when observations were stored by component
        trajectory_<k>/                    one trajectory (an episode, or its part still running at the end)
            traj_<a:06d>_<b:06d>.pickle    frames [a, b): a pickled dict of numpy arrays

Each pickle holds ``privileged_observations [n, P]``, ``actions [n, A]``, ``rewards [n, 1]``, ``dones [n, 1]``
(uint8; every episode end), ``values [n, 1]``, optionally ``timeouts [n]`` (bool), and either ``observations``
(``[n, O]``, which the forks' saver wraps in a 1-tuple) or ``obs_<component>`` per ``metadata.json``'s
``obs_segments`` (``normalized_image`` components stored as uint8, decompressed as the forks do: ``/ 255``).

Unpickling runs code chosen by whoever wrote the file: nothing here reads a pickle unless
``allow_pickle=True`` says the files are trusted; even then only numpy arrays, dicts and tuples are
unpickled (any other global is refused).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from shmbuf._errors import SegmentError, UsageError

TRAJ_002 = re.compile(r"^trajectory_(\d+)$")
CHUNK_002 = re.compile(r"^traj_(\d+)_(\d+)\.pickle$")
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("collections", "OrderedDict"),
}


def refuse_pickle(src: str, what: str) -> UsageError:
    return UsageError(
        f"{what}: {src} is a pickled recording (an rsl_rl fork's traj_*.pickle files). Unpickling runs whatever code "
        "the file's author put in it, so it is never done by default. If you trust these files, convert them once with "
        f"`shmbuf convert --allow-pickle {src} <new dir>` (then read the new directory), or pass allow_pickle=True")


def is_pickled_recording(path: str) -> bool:
    """Does ``path`` hold fork-style trajectories (a ``trajectory_<k>`` directory with ``traj_<a>_<b>.pickle`` files)?"""
    try:
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                if TRAJ_002.match(d) and any(CHUNK_002.match(f) for f in os.listdir(os.path.join(root, d))):
                    return True
    except OSError:
        return False
    return False


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: only numpy arrays, dicts and tuples are read")
        return super().find_class(module, name)


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = _ArraysOnly(io.BytesIO(f.read())).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise SegmentError(f"{path}: cannot be read as an rsl_rl fork's pickled trajectory ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise SegmentError(f"{path}: expected a pickled dict of arrays (an rsl_rl fork's trajectory), got {type(data).__name__}")
    out = {}
    for k, v in data.items():
        if isinstance(v, tuple) and len(v) == 1:  # the forks' saver writes `observations = (array,)` (a trailing comma)
            v = v[0]
        if not isinstance(v, np.ndarray) or v.dtype.hasobject:
            raise SegmentError(f"{path}: {k!r} is a {type(v).__name__}, expected a numeric numpy array")
        out[str(k)] = v
    return out


def _segments(meta: dict[str, Any] | None) -> tuple[list[tuple[str, int]], dict[str, str]] | None:
    if not meta or "obs_segments" not in meta:
        return None
    segs = [(str(k), int(np.prod(v))) for k, v in meta["obs_segments"].items()]
    return segs, dict(meta.get("obs_disassemble_mapping") or {})


def _observation(data: dict[str, Any], segs: Any, path: str) -> Any:
    """``[n, O]``, or a dict of components ``[n, size]`` in ``obs_segments`` order, decompressed as the forks do."""
    if "observations" in data:
        return data.pop("observations")
    if segs is None:
        raise SegmentError(f"{path}: no 'observations' and no obs_segments in metadata.json to assemble them from")
    order, mapping = segs
    obs = {}
    for name, size in order:
        key = "obs_" + name
        if key not in data:
            raise SegmentError(f"{path}: missing {key!r} (metadata.json's obs_segments names it)")
        x = data.pop(key)
        how = mapping.get(name)
        if how == "normalized_image":
            x = x.astype(np.float32) / 255
        elif how is not None:
            raise SegmentError(f"{path}: component {name!r} is compressed as {how!r}, which this reader does not know")
        obs[name] = x.reshape(len(x), size)
    return obs


def read_pickled_recording(src: str | os.PathLike[str], *, allow_pickle: bool = False
                           ) -> tuple[dict[str, Any] | None, Iterator[tuple[str, dict[str, Any]]]]:
    """``(metadata, trajectories)`` of a fork recording: each trajectory ``(its directory, arrays)`` with its chunks
    joined in frame order, oldest directory first (the forks' order: modification time).

    .. warning:: This unpickles files. Unpickling runs code chosen by whoever wrote them: pass
       ``allow_pickle=True`` only for files you trust (yours); the default refuses. Even then only numpy arrays,
       dicts and tuples are unpickled.
    """
    src = os.fspath(src)
    if allow_pickle is not True:
        raise refuse_pickle(src, "read_pickled_recording")
    if not os.path.isdir(src):
        raise UsageError(f"read_pickled_recording: {src} is not a directory")
    meta = None
    dirs = []
    for root, subdirs, files in os.walk(src):
        if meta is None and "metadata.json" in files:
            try:
                with open(os.path.join(root, "metadata.json")) as f:
                    meta = json.load(f)
            except (OSError, ValueError) as e:
                raise SegmentError(f"{os.path.join(root, 'metadata.json')}: cannot be read as JSON ({e})") from None
        for d in subdirs:
            m = TRAJ_002.match(d)
            if m and any(CHUNK_002.match(f) for f in os.listdir(os.path.join(root, d))):
                p = os.path.join(root, d)
                dirs.append((os.path.getmtime(p), int(m.group(1)), p))
    dirs.sort()
    return meta, _trajectories([p for _, _, p in dirs], _segments(meta))


def _trajectories(dirs: list[str], segs: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in dirs:
        chunks = sorted((int(m.group(1)), int(m.group(2)), name) for name in os.listdir(d) if (m := CHUNK_002.match(name)))
        starts = [a for a, _, _ in chunks]
        ends = [0] + [b for _, b, _ in chunks[:-1]]
        if starts != ends:
            raise SegmentError(f"{d}: its chunks {[c for _, _, c in chunks]} do not cover frames 0..{chunks[-1][1]} "
                               "without gaps")
        parts = []
        for a, b, name in chunks:
            path = os.path.join(d, name)
            data = _load(path)
            data["observations"] = _observation(data, segs, path)
            for k in ("actions", "rewards", "dones"):
                if k not in data:
                    raise SegmentError(f"{path}: missing {k!r} (an rsl_rl fork's trajectory has actions, rewards, dones, ...)")
            for k, v in data.items():
                n = len(next(iter(v.values()))) if isinstance(v, dict) else len(v)
                if n != b - a:
                    raise SegmentError(f"{path}: {k!r} has {n} frames, its name says {b - a}")
            parts.append(data)
        keys = set(parts[0])
        if any(set(p) != keys for p in parts):
            raise SegmentError(f"{d}: its chunks hold different fields")
        joined: dict[str, Any] = {}
        for k in keys:
            if isinstance(parts[0][k], dict):
                joined[k] = {c: np.concatenate([p[k][c] for p in parts]) for c in parts[0][k]}
            else:
                joined[k] = np.concatenate([p[k] for p in parts])
        yield d, joined


class _Trajectory:
    """One of the forks' trajectories as a truncate-episodes rollout of one env in the workers layout, for a Recorder."""

    def __init__(self, arrays: dict[str, Any], lane: int):
        obs = arrays["observations"]
        n = len(arrays["rewards"])

        def env(x: np.ndarray) -> np.ndarray:  # (n, ...) -> (n, 1, ...)
            return np.asarray(x)[:, None]

        def last(x: np.ndarray, i: int) -> np.ndarray:
            return np.asarray(x)[i][None]

        dones = np.asarray(arrays["dones"]).reshape(n) != 0
        timeouts = None if "timeouts" not in arrays else np.asarray(arrays["timeouts"]).reshape(n) != 0
        truncated = np.zeros(n, bool) if timeouts is None else timeouts & dones
        terminated = dones & ~truncated
        step: dict[str, Any] = {
            "obs": {k: env(v) for k, v in obs.items()} if isinstance(obs, dict) else env(obs),
            "action": env(arrays["actions"]),
            "reward": env(np.asarray(arrays["rewards"], np.float32).reshape(n)),
            "terminated": env(terminated),
        }
        if timeouts is not None:
            step["truncated"] = env(truncated)
        if "privileged_observations" in arrays:
            step["privileged_observations"] = env(arrays["privileged_observations"])
        if "values" in arrays:
            step["value"] = env(np.asarray(arrays["values"]).reshape(n))
        ends = np.flatnonzero(dones)
        k = len(ends)
        rewards = step["reward"][:, 0].astype(np.float64)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64) if k else np.zeros(0, np.int64)

        def final(i: int) -> Any:
            # The forks do not record the observation after an episode's last frame: its last frame stands in for it.
            return {c: last(v, i) for c, v in obs.items()} if isinstance(obs, dict) else last(obs, i)

        finals = [final(int(e)) for e in ends] or [final(n - 1)]
        final_obs = {c: np.concatenate([f[c] for f in finals]) for c in obs} if isinstance(obs, dict) \
            else np.concatenate(finals)
        rows = max(k, 1)
        self.data = {
            "step": step,
            "episode": {"return": np.array([rewards[s:e + 1].sum() for s, e in zip(starts, ends)] or [0.0])[:rows],
                        "length": np.array([e + 1 - s for s, e in zip(starts, ends)] or [0], np.int64)[:rows],
                        "terminated": np.array([terminated[e] for e in ends] or [False])[:rows],
                        "truncated": np.array([truncated[e] for e in ends] or [False])[:rows],
                        "env": np.zeros(rows, np.int32), "end": np.array(ends.tolist() or [0], np.int32)[:rows],
                        "final_obs": final_obs},
            "bootstrap": {"obs": final(n - 1)},
        }
        self.fill = {"step": n, "episode": k, "bootstrap": 1}
        self.lane, self.seq = lane, 0


def convert_pickled_recording(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, allow_pickle: bool = False,
                              fsync: bool = True) -> int:
    """Convert a fork recording (pickled trajectories) in ``src`` into a shmbuf recording in ``dst`` (a new or empty
    directory), once; return how many trajectories were written. ``shmbuf convert --allow-pickle SRC DST`` runs it.

    .. warning:: This unpickles ``src``'s files: unpickling runs code chosen by whoever wrote them. Pass
       ``allow_pickle=True`` only for files you trust; the default refuses. The result is plain ``.npy`` files,
       read from then on without pickle.

    Each of the forks' trajectories becomes one env's stream, split into episodes at its ``dones``: ``terminated`` is
    ``dones`` without ``timeouts``, ``truncated`` is ``timeouts`` (only if the forks recorded them); ``obs`` is the
    observation (or the dict of its ``obs_segments`` components, decompressed), ``privileged_observations`` and
    ``value`` are kept as step leaves (a RolloutDataset gives them in ``extras``). A trajectory that did not end an
    episode is published cut short (``ends_episode: false``). The forks do not record the observation after an
    episode's last frame: the last frame's own observation stands in for it (``next_observation`` there is that
    stand-in; mask it with ``done``, as the forks' own next observation there is the next trajectory's first).
    """
    from shmbuf.storage.recorder import Recorder

    src, dst = os.fspath(src), os.fspath(dst)
    if allow_pickle is not True:
        raise refuse_pickle(src, "convert_pickled_recording")
    if os.path.isdir(dst) and os.listdir(dst):
        raise UsageError(f"convert_pickled_recording: {dst} is not empty; convert into a new (or empty) directory")
    _, trajs = read_pickled_recording(src, allow_pickle=True)
    count = 0
    with Recorder(dst, fsync=fsync) as rec:
        for lane, (_, arrays) in enumerate(trajs):
            rec.write(_Trajectory(arrays, lane))
            if (lane, 0) in rec._open:  # still running when the recording stopped: publish it cut short now, in the forks' order
                rec._cut((lane, 0))
            count += 1
    if count == 0:
        raise UsageError(f"convert_pickled_recording: {src} holds no rsl_rl fork's trajectory "
                         "(trajectory_<k>/traj_<a>_<b>.pickle)")
    return count
