"""The :class:`Recorder`: rollouts to a directory, one trajectory (one episode of one sub-env) per directory.

A *trajectory* is one episode of one sub-env of one writer lane (the meaning of rsl_rl's legged-robot forks): its frames are
contiguous in time, it starts at the episode's first step (or where recording began) and ends at
the episode's last step (or where recording stopped, where the lane's sequence had a gap, or where
a new Writer took the lane: seq 0 again). An episode record with neither flag (a soft horizon) is no
end: the env ran on, and so does the trajectory. A truncate-episodes rollout that cuts an episode
hands its frames over to the next rollout of the same lane; the trajectory is published only when
the episode ends.

A trajectory is written under a hidden temporary name, each file fsync'd, and renamed into place
(``os.rename``: atomic on POSIX), so a concurrent reader sees a whole trajectory or none of it. The
format is :mod:`shmbuf.storage._fileformat`'s.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf._closable import Closable
from shmbuf._errors import SchemaError, SegmentError, UsageError
from shmbuf._validate import int_setting
from shmbuf.storage._fileformat import (
    FORMAT,
    KEYS,
    LOCK,
    METADATA,
    TMP_PREFIX,
    TRAJ_DIR,
    TRAJ_INFO,
    VERSION,
    describe,
    flat_leaves,
    fsync_dir,
    index_leaves,
    map_leaves,
    not_regular,
    read_metadata,
    remove_path,
    write_json,
    write_npy,
)
from shmbuf.storage._rollout_units import Unit, rollout_units


class _Open:
    """A stream's (lane, env) trajectory being recorded: frames in memory, spilled to chunk files past a size."""

    def __init__(self, lane: int, env: int, starts_episode: bool):
        self.lane, self.env, self.starts_episode = lane, env, starts_episode
        self.tmp: str | None = None
        self.parts: list[dict[str, np.ndarray]] = []
        self.mem_bytes = 0
        self.chunks: list[tuple[int, int]] = []
        self.n = 0  # frames, spilled or not
        self.spilled = 0
        self.reward = 0.0
        self.soft_horizons = 0  # episode records with neither flag inside it (bookkeeping only: the env ran on)
        self.successor: Any = None  # the obs after the last frame, if no episode end says otherwise


def _drop_unfinished(open_: dict[tuple[int, int], _Open]) -> None:
    """A Recorder dropped without close(): remove the temporary directories of the episodes still running (close()
    publishes or drops them first, and leaves nothing here)."""
    for o in open_.values():
        if o.tmp is not None:
            remove_path(o.tmp)
    open_.clear()


class Recorder(Closable):
    """Writes rollouts to ``data_dir``, one trajectory (one episode of one sub-env) per directory.

    Args:
        data_dir: created if missing. A directory that already holds recordings is continued (same
            fields, checked against its metadata.json; the frame counter goes on from the newest).
        fsync: fsync every file and directory before the rename that publishes a trajectory, so a
            power cut leaves whole trajectories or none. The rename alone already makes a trajectory
            appear whole to other processes; ``fsync=False`` only gives up durability.
        chunk_bytes: an episode's frames are kept in memory until it ends or they reach this size;
            then they go to a chunk file (``traj_<a>_<b>``) inside the trajectory's temporary
            directory. Bounds the memory per sub-env; most episodes end up as one chunk.
        keep_partial: on :meth:`close`, publish the episodes still running as trajectories cut short
            (``trajectory.json`` ``ends_episode: false``); False discards them.

    One Recorder at a time per directory (an flock on ``data_dir/.recorder.lock``); a second one
    raises :class:`UsageError`.

    :meth:`write` copies what it keeps: the rollout (or batch) may be released as soon as it returns.

    A Recorder dropped without :meth:`close` (or still open at exit) releases the directory's lock and removes
    the temporary directories of its unfinished episodes; only :meth:`close` publishes them.
    """

    _has_names = False

    def __init__(self, data_dir: str | os.PathLike[str], *, fsync: bool = True, chunk_bytes: int = 16 << 20,
                 keep_partial: bool = True):
        chunk_bytes = int_setting("Recorder(chunk_bytes=...)", chunk_bytes)
        self.data_dir = os.fspath(data_dir)
        self.fsync, self.chunk_bytes, self.keep_partial = bool(fsync), chunk_bytes, bool(keep_partial)
        try:
            os.makedirs(self.data_dir, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UsageError(f"Recorder(data_dir={self.data_dir!r}): it (or a parent) exists and is not a directory; "
                             "give a directory to record into (created if missing)") from None
        lock = os.path.join(self.data_dir, LOCK)
        try:
            self._lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:  # ELOOP: a symlink; EISDIR; EACCES
            raise SegmentError(f"{lock}: cannot be opened as the Recorder's lock file ({e}); remove it") from None
        try:
            mode = os.fstat(self._lock).st_mode
            if not stat.S_ISREG(mode):
                raise not_regular(lock, mode)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise UsageError(f"Recorder({self.data_dir!r}): another Recorder is writing into this directory; use one "
                             "Recorder per directory (give each its own data_dir)") from None
        except BaseException:
            os.close(self._lock)
            raise
        self.name = self.data_dir
        self._own("the directory's lock", os.close, self._lock)
        self._closed = False
        self._token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp_count = 0
        self._open: dict[tuple[int, int], _Open] = {}
        self._own("unfinished episodes", _drop_unfinished, self._open)  # released before the lock
        self._seen: dict[tuple[int, int], int | None] = {}  # (lane, env): seq of its last rollout written
        self.metadata: dict[str, Any] | None = None
        self.frames = 0  # the frame counter: frames published so far (continued from the directory)
        self.trajectories = 0  # trajectories this Recorder published
        try:
            self._resume()
        except BaseException:
            self.close()
            raise

    def _resume(self) -> None:
        """Remove what a crashed recorder left half-written (we hold the lock: nobody else writes), continue the counter."""
        for name in os.listdir(self.data_dir):
            if name.startswith(TMP_PREFIX):
                remove_path(os.path.join(self.data_dir, name))
            m = TRAJ_DIR.match(name)
            if m:
                self.frames = max(self.frames, int(m.group(2)))
        path = os.path.join(self.data_dir, METADATA)
        if os.path.exists(path):
            self.metadata = read_metadata(self.data_dir)

    # -- metadata ---------------------------------------------------------------------------------

    def _metadata_for(self, unit: Unit) -> dict[str, Any]:
        leaves: list[dict[str, Any]] = []
        where = "Recorder.write"
        item = map_leaves(unit.step, lambda a: np.asarray(a)[0, 0] if unit.n else np.zeros(np.shape(a)[2:], np.asarray(a).dtype))
        fields = describe(item, (), leaves, where)
        obs = unit.step[L.OBS]
        components = None
        if isinstance(obs, (Mapping, list, tuple)):
            components = [{"name": lf["file"].split(".", 1)[1], **lf} for lf in leaves if lf["path"][0] == L.OBS]
        return {"format": FORMAT, "version": VERSION, "fields": fields, "leaves": leaves, "obs_components": components,
                "keys": {k: (v if v in unit.step else None) for k, v in KEYS.items()},
                "trajectory": "one episode of one sub-env of one writer lane; frames [a, b) in traj_<a>_<b>"}

    def _check_metadata(self, unit: Unit) -> None:
        want = self._metadata_for(unit)
        if self.metadata is None:
            tmp = os.path.join(self.data_dir, f"{TMP_PREFIX}{self._token}-{METADATA}")
            write_json(tmp, want, self.fsync)
            os.rename(tmp, os.path.join(self.data_dir, METADATA))
            if self.fsync:
                fsync_dir(self.data_dir)
            self.metadata = want
            return
        have = {lf["file"]: lf for lf in self.metadata["leaves"]}
        got = {lf["file"]: lf for lf in want["leaves"]}
        for name in sorted(set(have) | set(got)):
            a, b = have.get(name), got.get(name)
            if a is None or b is None or a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
                def show(x: Any) -> str:
                    return "absent" if x is None else f"dtype {x['dtype']}, shape {tuple(x['shape'])}"
                raise SchemaError(f"Recorder.write: step leaf {name!r} is {show(b)} in this rollout, but {show(a)} in "
                                  f"{os.path.join(self.data_dir, METADATA)}; record into a new data_dir")
        if want["fields"] != self.metadata["fields"]:
            raise SchemaError(f"Recorder.write: the step tree's structure differs from {os.path.join(self.data_dir, METADATA)}"
                              "; record into a new data_dir")

    # -- writing ------------------------------------------------------------------------------------

    def write(self, rollout_or_batch: Any) -> int:
        """Record a rollout or a batch of them; return how many trajectories this call published.

        Accepts a ``shmbuf.Rollout`` or ``shmbuf.Batch`` in the workers layout (truncate- or
        complete-episodes; a single env or a vector of them) or a workers ``CollectedBatch``. Streams
        are told apart by writer lane (``.lane``; the batch position where there is none) and sub-env.
        A lane whose sequence number (``.seq``) skips ends its open trajectory there, cut short.
        """
        if self._closed:
            raise UsageError(f"Recorder({self.data_dir!r}) is closed")
        units = rollout_units(rollout_or_batch)
        before = self.trajectories
        for u in units:
            if u.n == 0:
                continue
            self._check_metadata(u)
            if u.complete:
                o = _Open(u.lane, 0, True)
                self._append(o, u, 0, 0, u.n)
                _, _, term, trunc, ret, length, final = u.episodes[0]
                self._publish(o, final, term, trunc, ret, length, True)
            else:
                self._truncated(u)
        return self.trajectories - before

    def _truncated(self, u: Unit) -> None:
        """Split each sub-env's frames of a truncate-episodes rollout into trajectories at its episode ends.

        A trajectory keeps only its last frame's successor: the ended episode's final_obs, or (still open) the
        rollout's bootstrap row, each one row of the unit. This is trajectory bookkeeping across rollouts, not
        :meth:`shmbuf.layout.Grid.successors`, which builds every step's successor.
        """
        ends: dict[int, list[tuple[int, bool, bool, float, int, Any]]] = {}
        for env, end, term, trunc, ret, length, final in u.episodes:
            ends.setdefault(env, []).append((end, term, trunc, ret, length, final))
        for e in range(u.E):
            key = (u.lane, e)
            o = self._open.get(key)
            last = self._seen.get(key, -1)
            # Frame 0 of this rollout starts an episode if the lane's stream starts here (seq 0, or no seq
            # to say otherwise), or if we saw the lane's previous rollout and nothing of it is still open.
            follows = u.seq is None or u.seq == 0 or (last is not None and u.seq == last + 1)
            if o is not None and (u.seq == 0 or not follows):
                # seq 0: a new Writer took the lane (an actor restart), its first frame is a new episode's; a gap:
                # the lane's frames in between are missing. Either way what we hold cannot be continued.
                self._cut(key)
                o = None
            self._seen[key] = u.seq
            start = 0
            for end, term, trunc, ret, length, final in sorted(ends.get(e, []), key=lambda x: x[0]):
                if o is None:
                    o = _Open(u.lane, e, starts_episode=start > 0 or follows)
                if not (term or trunc):
                    # A soft horizon (workers' soft_horizon): a return/length record only, the env was not reset and
                    # the stored steps have no boundary here; the trajectory runs on, as views and the actor see it.
                    o.soft_horizons += 1
                    continue
                self._append(o, u, e, start, end + 1)
                self._open.pop(key, None)
                self._publish(o, final, term, trunc, ret, length, True)
                o, start = None, end + 1
            if start < u.n:
                if o is None:
                    o = _Open(u.lane, e, starts_episode=start > 0 or follows)
                self._append(o, u, e, start, u.n)
                o.successor = map_leaves(index_leaves(u.bootstrap, e), np.array)
                self._open[key] = o

    def _append(self, o: _Open, u: Unit, e: int, a: int, b: int) -> None:
        part = {name: np.array(np.asarray(leaf)[a:b, e]) for name, leaf in flat_leaves(u.step)}
        o.parts.append(part)
        o.n += b - a
        o.reward += float(np.sum(part[L.REWARD], dtype=np.float64))
        o.mem_bytes += sum(x.nbytes for x in part.values())
        if o.mem_bytes >= self.chunk_bytes:
            self._spill(o)

    def _tmpdir(self, o: _Open) -> str:
        if o.tmp is None:
            self._tmp_count += 1
            o.tmp = os.path.join(self.data_dir, f"{TMP_PREFIX}{self._token}-{self._tmp_count}")
            os.mkdir(o.tmp)
        return o.tmp

    def _spill(self, o: _Open) -> None:
        """Write the frames held in memory as one chunk directory ``traj_<a>_<b>`` of the temporary trajectory."""
        if not o.parts:
            return
        a, b = o.spilled, o.n
        chunk = os.path.join(self._tmpdir(o), f"traj_{a:06d}_{b:06d}")
        os.mkdir(chunk)
        for name in o.parts[0]:
            write_npy(os.path.join(chunk, name + ".npy"), np.concatenate([p[name] for p in o.parts]), self.fsync)
        if self.fsync:
            fsync_dir(chunk)
        o.chunks.append((a, b))
        o.spilled = b
        o.parts, o.mem_bytes = [], 0

    def _publish(self, o: _Open, final: Any, terminated: bool, truncated: bool, ret: float, length: int,
                 ends_episode: bool) -> None:
        """Finish a trajectory: last chunk, final observation, trajectory.json, then one rename makes it visible."""
        self._spill(o)
        tmp = self._tmpdir(o)
        for name, leaf in flat_leaves({L.FINAL_OBS: final}):
            write_npy(os.path.join(tmp, name + ".npy"), np.asarray(leaf), self.fsync)
        f0, f1 = self.frames, self.frames + o.n
        info = {"length": o.n, L.ENV: o.env, "lane": o.lane, L.TERMINATED: bool(terminated), L.TRUNCATED: bool(truncated),
                "starts_episode": o.starts_episode, "ends_episode": bool(ends_episode),
                "episode_return": float(ret), "episode_length": int(length), "reward_sum": o.reward,
                "soft_horizons": o.soft_horizons,
                "frames": [f0, f1], "chunks": [list(c) for c in o.chunks]}
        write_json(os.path.join(tmp, TRAJ_INFO), info, self.fsync)
        if self.fsync:
            fsync_dir(tmp)
        os.utime(tmp)  # the directory's mtime is its publication time (keep_latest_n_trajs sorts by it)
        os.rename(tmp, os.path.join(self.data_dir, f"trajectory_{f0:012d}_{f1:012d}"))
        if self.fsync:
            fsync_dir(self.data_dir)
        o.tmp = None
        self.frames = f1
        self.trajectories += 1

    def _cut(self, key: tuple[int, int]) -> None:
        o = self._open.pop(key)
        if self.keep_partial and o.successor is not None:
            # Not an episode end: the final observation is the true next one (the rollout's bootstrap).
            self._publish(o, o.successor, False, False, o.reward, o.n, False)
        elif o.tmp is not None:
            remove_path(o.tmp)

    def close(self, timeout: float | None = None) -> None:
        """Publish (``keep_partial``) or drop the episodes still running, and release the directory's lock. Waits for
        nothing (``timeout``: accepted, as by every shmbuf close, and checked)."""
        if self._closed:
            return
        self._closed = True
        try:
            for key in list(self._open):
                self._cut(key)
        finally:
            super().close(timeout)

    def __repr__(self) -> str:
        return f"Recorder({self.data_dir!r}, frames={self.frames}, trajectories={self.trajectories})"
