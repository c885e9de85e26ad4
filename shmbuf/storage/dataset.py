"""The :class:`RolloutDataset` of rsl_rl's legged-robot forks over a directory a
:class:`~shmbuf.storage.recorder.Recorder` wrote: per-env trajectory cursors, batches of :class:`FileTransition`.

Trajectory files are read as read-only memory maps (:func:`~shmbuf.storage._fileformat.load_npy`); a
batch copies what it takes from them. numpy only; torch is imported when ``device=`` or
:meth:`RolloutDataset.torch_dataset` asks for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from shmbuf import layout as L
from shmbuf._closable import Closable
from shmbuf._errors import SegmentError, SlotTimeout, UsageError
from shmbuf._validate import int_setting, timeout_setting
from shmbuf.storage._file_base import RolloutFileBase
from shmbuf.storage._fileformat import (
    CHUNK_DIR,
    KEYS,
    METADATA,
    TRAJ_DIR,
    TRAJ_INFO,
    build,
    checked_info,
    few,
    load_npy,
    map_leaves,
    read_json,
    read_metadata,
)
from shmbuf.storage._pickled import convert_pickled_recording, is_pickled_recording, refuse_pickle
from shmbuf.storage._torch import to_torch


def get_frame_range(name: str) -> tuple[int, int]:
    """The forks' ``get_frame_range``: ``(start, end)`` (end exclusive) from ``traj_100_200`` or ``trajectory_100_200``."""
    m = TRAJ_DIR.match(name) or CHUNK_DIR.match(os.path.basename(name).split(".")[0])
    if m is None:
        raise UsageError(f"get_frame_range: {name!r} is not named traj_<start>_<end> or trajectory_<start>_<end>")
    return int(m.group(1)), int(m.group(2))


class _Traj:
    """One published trajectory, its files memory-mapped (loaded when an env is given it)."""

    def __init__(self, path: str, meta: dict[str, Any], obs_files: list[str]):
        self.path = path
        info_path = os.path.join(path, TRAJ_INFO)
        try:
            self.info = checked_info(read_json(info_path), info_path)
        except FileNotFoundError:
            raise SegmentError(f"{info_path}: missing; {path} is not a whole trajectory") from None
        self.length = self.info["length"]
        try:
            names = os.listdir(path)
        except OSError as e:
            raise SegmentError(f"{path}: cannot be listed ({e})") from None
        chunks, odd = [], []
        for name in names:
            m = CHUNK_DIR.match(name)
            if m:
                chunks.append((int(m.group(1)), int(m.group(2)), name))
            elif name.startswith("traj_"):
                odd.append(name)
        if odd:
            raise SegmentError(f"{path}: {few(odd)} look like chunk directories but are not named traj_<a>_<b> as a "
                               "Recorder writes them; they would be skipped. Rename them, or move them out")
        chunks.sort()
        edges = [0] + [c[1] for c in chunks]
        if not chunks or [c[0] for c in chunks] != edges[:-1] or edges[-1] != self.length or any(a >= b for a, b, _ in chunks):
            raise SegmentError(f"{path}: its chunks {[c[2] for c in chunks]} do not cover frames 0..{self.length} "
                               f"(trajectory.json) without gaps")
        self.starts = np.asarray([c[0] for c in chunks], np.int64)
        self.data: dict[str, list[np.ndarray]] = {}
        for lf in meta["leaves"]:
            dt, shape = np.dtype(lf["dtype"]), tuple(lf["shape"])
            self.data[lf["file"]] = [load_npy(os.path.join(path, c, lf["file"] + ".npy"), dt, (b - a, *shape))
                                     for a, b, c in chunks]
        shapes = {lf["file"]: (np.dtype(lf["dtype"]), tuple(lf["shape"])) for lf in meta["leaves"]}
        self.final = {f: load_npy(os.path.join(path, "final_" + f + ".npy"), *shapes[f]) for f in obs_files}
        self.ends_episode = self.info["ends_episode"]
        # A boundary the step leaves do not show: a trajectory cut short by the recording, or one whose last frame
        # has neither flag (an episode truncated in a recording without a truncated field; a soft horizon recorded
        # by an older Recorder). Readers mark it as a timeout (the forks' done, play's truncated): never run on across it.
        flags = [self.data[f][-1][-1] for f in (meta["keys"].get(L.TERMINATED), meta["keys"].get(L.TRUNCATED))
                 if f in self.data]
        self.unflagged_end = not self.ends_episode or not any(bool(np.any(x != 0)) for x in flags)

    def copy(self, file: str, a: int, b: int, out: np.ndarray) -> None:
        """Rows [a, b) of ``file`` into ``out`` (len b - a), across chunks."""
        parts, starts = self.data[file], self.starts
        k = int(np.searchsorted(starts, a, side="right")) - 1
        i = 0
        while a < b:
            lo = int(starts[k])
            x = parts[k]
            take = min(b, lo + len(x)) - a
            out[i:i + take] = x[a - lo:a - lo + take]
            a += take
            i += take
            k += 1

    def copy_next(self, file: str, a: int, b: int, out: np.ndarray) -> None:
        """The successors of rows [a, b): rows a+1..b, row ``length`` being the final observation.

        A recorded trajectory read across its chunk files, not :func:`shmbuf.layout.successors`: on disk there is
        no episode table or bootstrap to scatter, only the trajectory's final observation.
        """
        stop = min(b + 1, self.length)
        if a + 1 < stop:
            self.copy(file, a + 1, stop, out[: stop - a - 1])
        if b == self.length:
            out[-1] = self.final[file]


class FileTransition(NamedTuple):
    """One batch of :meth:`RolloutDataset.get_batch`: leaves ``(E, ...)``, or ``(T, E, ...)`` with transitions per env.

    ``observation``/``next_observation``: the recorded observation tree (an array, or a dict/tuple
    of components reassembled per metadata.json; one array with ``concat_obs=True``).
    ``next_observation`` is the true successor: the next frame, or at a trajectory's last frame
    its final observation. ``done`` (the forks'): True at the first frame an env reads of each
    trajectory, where the episode ended (terminated or truncated), and where a trajectory ran out
    cut short. ``timeout``: truncated, or cut short; None if the recording has no truncated field.
    ``terminated``: as recorded (the MDP ended). ``first``: the first frame an env reads of its
    trajectory. ``extras``: the other step leaves (policy extras), by name.
    """

    observation: Any
    action: Any
    reward: np.ndarray
    done: np.ndarray
    timeout: np.ndarray | None
    next_observation: Any
    terminated: np.ndarray
    first: np.ndarray
    extras: dict[str, Any]


class _Handler:
    __slots__ = ("cursor", "fresh", "traj")

    def __init__(self, traj: _Traj, cursor: int):
        self.traj, self.cursor, self.fresh = traj, cursor, True


class RolloutDataset(RolloutFileBase, Closable):
    """The legged-robot forks' RolloutDataset over a directory a :class:`Recorder` wrote: per-env trajectory cursors,
    batches of transitions.

    shmbuf's subclass of :class:`~shmbuf.storage.files.RolloutFileBase`: its :meth:`get_buffer` is the raw per-leaf
    buffer that :meth:`fill_transition` fills, and :meth:`get_batch` makes a :class:`FileTransition` of it.
    :meth:`get_transition_batch` gives ``(s, a, r, d, info)`` (the forks' base gives ``(buffer, infos)``).

    Args:
        data_dir: the recording (it may still be being written).
        num_envs: E: how many trajectories are read side by side (one handler and cursor per env).
        dataset_loops: passes over the trajectories before :class:`StopIteration` (0 or less: for
            ever). Each new pass rescans the directory, so it takes in what a running Recorder added.
        random_shuffle_traj_order: hand trajectories out in a random order (a new one each pass).
        keep_latest_n_trajs: use only the newest N trajectories by modification time (0: all), and
            wait until there are N.
        starting_frame_range: ``(lo, hi)``: an env starts each new trajectory at a frame drawn
            uniformly from ``[lo, hi)``, clipped to the trajectory (``lo`` to at most its last frame,
            ``hi`` to at most its length, and at least ``lo + 1``).
        device: None: numpy outputs. A torch device (``"cpu"``, ``"cuda"``): torch tensors there.
        obs_key: the step leaf that is the observation.
        concat_obs: reassemble a dict/tuple observation as one array: every component flattened to
            ``(..., -1)`` and concatenated in metadata.json's order (the forks' ``assemble_obs_components``).
        seed: for shuffling and starting frames.
        wait_timeout: how long to wait for enough trajectories (``max(num_envs, keep_latest_n_trajs)``)
            before :class:`shmbuf.SlotTimeout` (None: for ever).
        poll_interval: how often to rescan while waiting.
        allow_pickle: ``data_dir`` may be the forks' own recording (pickled trajectories): it is converted once into a
            temporary shmbuf recording (removed with this dataset) and read from there. **Unsafe for files you do
            not trust**: unpickling runs code chosen by whoever wrote them. Off by default; a pickled recording is
            then refused, naming ``shmbuf convert --allow-pickle`` (convert once, keep the result).

    Each batch is new arrays, the caller's to keep (the forks refill one buffer). ``close()`` (or a ``with`` block)
    removes the converted copy of a pickled recording; so does dropping the dataset, or exit.
    """

    _has_names = False

    def __init__(self, data_dir: str | os.PathLike[str], num_envs: int, dataset_loops: int = 1,
                 random_shuffle_traj_order: bool = False, keep_latest_n_trajs: int = 0,
                 starting_frame_range: Sequence[int] = (0, 1), device: Any = None, *, obs_key: str = L.OBS,
                 concat_obs: bool = False, seed: Any = None, wait_timeout: float | None = 60.0,
                 poll_interval: float = 0.2, allow_pickle: bool = False):
        num_envs = int_setting("RolloutDataset(num_envs=...)", num_envs)
        keep_latest_n_trajs = int_setting("RolloutDataset(keep_latest_n_trajs=...)", keep_latest_n_trajs, 0)
        if isinstance(dataset_loops, bool) or not isinstance(dataset_loops, (int, np.integer)):
            raise UsageError(f"RolloutDataset(dataset_loops=...): expected an int (0 or less: loop for ever), got "
                             f"{dataset_loops!r}")
        r = tuple(starting_frame_range) if isinstance(starting_frame_range, (Sequence, np.ndarray)) else ()
        if len(r) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in r) \
                or not 0 <= r[0] < r[1]:
            raise UsageError(f"RolloutDataset(starting_frame_range=...): expected (lo, hi) ints with 0 <= lo < hi, got "
                             f"{starting_frame_range!r}")
        wait_timeout = timeout_setting("RolloutDataset(wait_timeout=...)", wait_timeout)
        # Not a timeout (None and 0 mean nothing here): how often a wait rescans the directory.
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float, np.integer, np.floating)) \
                or not poll_interval > 0:
            raise UsageError(f"RolloutDataset(poll_interval=...): expected seconds > 0, got {poll_interval!r}")
        if not isinstance(obs_key, str):
            raise UsageError(f"RolloutDataset(obs_key=...): expected a step leaf name (str), got {obs_key!r}")
        self.data_dir = self.name = os.fspath(data_dir)
        self.source_dir = self.data_dir
        if allow_pickle is True and is_pickled_recording(self.data_dir):
            self.data_dir = tempfile.mkdtemp(prefix="shmbuf-converted-")
            self._own("converted copy", shutil.rmtree, self.data_dir, True)
            convert_pickled_recording(self.source_dir, self.data_dir, allow_pickle=True, fsync=False)
        self.num_envs = int(num_envs)
        self.dataset_loops = int(dataset_loops)
        self.random_shuffle_traj_order = bool(random_shuffle_traj_order)
        self.keep_latest_n_trajs = int(keep_latest_n_trajs)
        self.starting_frame_range = (int(r[0]), int(r[1]))
        self.device = device
        self.obs_key = obs_key
        self.concat_obs = bool(concat_obs)
        self.wait_timeout = wait_timeout
        self.poll_interval = float(poll_interval)
        self.rng = np.random.default_rng(seed)
        self.metadata: dict[str, Any] | None = None
        self.all_available_trajectory_dirs: list[str] = []
        self.unused_trajectory_idxs: list[int] = []
        self.num_dataset_looped = 0
        self.all_env_ids = np.arange(self.num_envs)
        self._handlers: list[_Handler | None] = [None] * self.num_envs
        self._initialized = False

    get_frame_range = staticmethod(get_frame_range)
    Transition = FileTransition  # the forks' RolloutDataset.Transition (its fields: FileTransition's docstring)

    # -- the directory --------------------------------------------------------------------------------

    def _scan(self) -> list[str] | None:
        """Published trajectories, oldest first by mtime; None if there is no metadata.json yet (an empty directory)."""
        try:
            names = os.listdir(self.data_dir)
        except FileNotFoundError:
            return None
        except OSError as e:  # NotADirectoryError, PermissionError, ...
            raise SegmentError(f"RolloutDataset: {self.data_dir} cannot be listed ({e}); give the directory a Recorder "
                               "wrote") from None
        trajs, foreign, odd = [], [], []
        for name in names:
            if name == METADATA or name.startswith("."):
                continue
            path = os.path.join(self.data_dir, name)
            m = TRAJ_DIR.match(name)
            if m and os.path.isdir(path):
                try:
                    trajs.append((os.stat(path).st_mtime_ns, int(m.group(1)), path))
                except FileNotFoundError:  # removed since the listing: it is not there to read
                    pass
            else:
                foreign.append(name)
                if name.startswith("trajectory_"):
                    odd.append(name)
        if odd and is_pickled_recording(self.data_dir):
            raise refuse_pickle(self.data_dir, "RolloutDataset")
        if METADATA not in names:
            if trajs:
                raise SegmentError(f"{os.path.join(self.data_dir, METADATA)}: missing, though the directory holds "
                                   f"{len(trajs)} trajectories; it says what their files hold (restore it, or record again)")
            if foreign:
                raise SegmentError(f"{self.data_dir}: not a shmbuf rollout directory (no {METADATA}); it holds "
                                   f"{sorted(foreign)[:5]}{' ...' if len(foreign) > 5 else ''}")
            return None
        if odd:
            # The rule: a name that starts like a trajectory's must be one (trajectory_<F0>_<F1>, a directory), or the
            # data under it would be skipped without a word; a Recorder never publishes any other (it renames whole
            # trajectories into place). Other names are left alone: notes, plots, a README.
            raise SegmentError(f"{self.data_dir}: {few(odd)} look like trajectories but are not trajectory_<F0>_<F1> "
                               "directories as a Recorder publishes them, so they cannot be read and would be skipped. "
                               "Rename them (trajectory_<first frame>_<end frame>), or move them out of the directory")
        if self.metadata is None:
            meta = read_metadata(self.data_dir)
            self.metadata = meta
            self._setup_fields(meta)
        trajs.sort()
        return [p for _, _, p in trajs]

    def _setup_fields(self, meta: dict[str, Any]) -> None:
        self._leaves = {lf["file"]: lf for lf in meta["leaves"]}
        fields = {k: d for k, d in meta["fields"]["items"]}
        recorded = meta["keys"].get(L.OBS) or L.OBS
        if self.obs_key != recorded:
            what = "is one of the recording's step leaves, but" if self.obs_key in fields else "is not a step leaf " \
                f"of the recording ({sorted(fields)}), and"
            raise UsageError(f"RolloutDataset(obs_key={self.obs_key!r}): it {what} a Recorder records the successor "
                             f"(final_obs*.npy, next_observation) of {recorded!r} only; use obs_key={recorded!r} and read "
                             f"{self.obs_key!r} from the batch's extras")
        self._fields = fields
        self._obs_files = [f for f in self._leaves if self._leaves[f]["path"][0] == self.obs_key]
        keys = meta.get("keys", KEYS)
        self._timeout_key = keys.get(L.TRUNCATED)
        self._term_key = keys.get(L.TERMINATED) or L.TERMINATED
        self._reserved = {self.obs_key, L.ACTION, L.REWARD, self._term_key, self._timeout_key}

    def read_dataset_directory(self) -> bool:
        """Rescan ``data_dir`` (the forks' name): True, with a fresh pool of unused trajectories, if there are enough."""
        found = self._scan()
        if found is None:
            self._have = 0
            return False
        self._have = len(found)
        if len(found) < self._need():
            return False
        if self.keep_latest_n_trajs:
            found = found[-self.keep_latest_n_trajs:]
        self.all_available_trajectory_dirs = found
        idx = list(range(len(found)))
        if self.random_shuffle_traj_order:
            idx = [int(i) for i in self.rng.permutation(len(found))]
        self.unused_trajectory_idxs = idx
        return True

    def _need(self) -> int:
        return max(self.num_envs, self.keep_latest_n_trajs, 1)

    def _wait_for_trajectories(self) -> None:
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        while not self.read_dataset_directory():
            if deadline is not None and time.monotonic() >= deadline:
                what = "does not exist yet" if not os.path.isdir(self.data_dir) else (
                    f"holds {self._have} complete trajector{'y' if self._have == 1 else 'ies'}")
                raise SlotTimeout(
                    f"RolloutDataset: {self.data_dir} {what}; {self._need()} needed (num_envs={self.num_envs}, "
                    f"keep_latest_n_trajs={self.keep_latest_n_trajs}), still short after wait_timeout="
                    f"{self.wait_timeout} s. Record more (a Recorder publishes a trajectory when its episode ends), "
                    "lower num_envs, or raise wait_timeout")
            time.sleep(self.poll_interval)

    # -- handlers ---------------------------------------------------------------------------------------

    def reset(self, env_ids: Any = None) -> None:
        """All envs (None): rescan (waiting for enough trajectories) and give every env a new one. Else
        refresh those envs only."""
        if env_ids is None or not self._initialized:
            self.reset_all()
            return
        self.refresh_handlers(env_ids)

    def reset_all(self) -> None:
        self._wait_for_trajectories()
        self.num_dataset_looped = 0
        self._handlers = [None] * self.num_envs
        self._initialized = True
        self.refresh_handlers(None)

    def refresh_handlers(self, env_ids: Any = None) -> None:
        """Give each env in ``env_ids`` (None: all) the next unused trajectory (the forks'; looping as :meth:`_next_traj`)."""
        ids = self.all_env_ids if env_ids is None else np.asarray(env_ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise UsageError(f"RolloutDataset.reset(env_ids=...): expected None or env indices (ints), got {env_ids!r}")
        for e in ids.tolist():
            if not 0 <= e < self.num_envs:
                raise UsageError(f"RolloutDataset.reset(env_ids=...): env {e} is not in 0..{self.num_envs - 1}")
            self._next_traj(e)

    def _next_traj(self, e: int) -> _Handler:
        if not self.unused_trajectory_idxs:
            self.num_dataset_looped += 1
            if 0 < self.dataset_loops <= self.num_dataset_looped or not self.read_dataset_directory():
                raise StopIteration
        i = self.unused_trajectory_idxs.pop(0)
        assert self.metadata is not None, "_scan reads metadata.json before it lists any trajectory"
        traj = _Traj(self.all_available_trajectory_dirs[i], self.metadata, self._obs_files)
        lo, hi = self.starting_frame_range
        lo = min(lo, traj.length - 1)
        hi = max(lo + 1, min(hi, traj.length))
        h = self._handlers[e] = _Handler(traj, int(self.rng.integers(lo, hi)))
        return h

    # -- batches -------------------------------------------------------------------------------------

    def _alloc(self, n: int) -> dict[str, np.ndarray]:
        E = self.num_envs
        out = {f: np.empty((n, E, *lf["shape"]), lf["dtype"]) for f, lf in self._leaves.items()}
        for f in self._obs_files:
            out["next:" + f] = np.empty((n, E, *self._leaves[f]["shape"]), self._leaves[f]["dtype"])
        for k in ("first", "cut"):
            out[k] = np.zeros((n, E), bool)
        return out

    def _fill(self, out: dict[str, np.ndarray], n: int, ends: list[tuple[int, int, _Traj]] | None = None,
              envs: Any = None) -> None:
        """Rows [0, n) of every env (or of ``envs``) into ``out`` (``(n, E, ...)`` arrays), advancing the cursors."""
        files = list(self._leaves)
        for e in (range(self.num_envs) if envs is None else envs):
            i = 0
            while i < n:
                h = self._handlers[e]
                if h is None or h.cursor >= h.traj.length:
                    h = self._next_traj(e)  # StopIteration when the passes are done
                t, c = h.traj, h.cursor
                run = min(n - i, t.length - c)
                for f in files:
                    t.copy(f, c, c + run, out[f][i:i + run, e])
                for f in self._obs_files:
                    t.copy_next(f, c, c + run, out["next:" + f][i:i + run, e])
                if h.fresh:
                    out["first"][i, e] = True
                    h.fresh = False
                if c + run == t.length:
                    if t.unflagged_end:
                        out["cut"][i + run - 1, e] = True
                    if ends is not None:
                        ends.append((e, i + run - 1, t))
                h.cursor = c + run
                i += run

    def _flags(self, out: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        term = out[self._term_key] != 0
        timeout = None
        if self._timeout_key is not None:
            # The forks' time_outs: ends to bootstrap. rsl_rl's rule bootstraps a time-out whatever dones says, so a step the
            # recording marks both terminated and truncated (gymnasium: terminated wins) is no time-out here.
            timeout = ((out[self._timeout_key] != 0) | out["cut"]) & ~term
        done = out["first"] | term | out["cut"] | (timeout if timeout is not None else False)
        return term, done, timeout

    def _obs(self, out: dict[str, np.ndarray], prefix: str) -> Any:
        tree = build(self._fields[self.obs_key], lambda f: out[prefix + f])
        if self.concat_obs:
            parts = [out[prefix + f] for f in self._obs_files]
            lead = parts[0].shape[:2]
            tree = np.concatenate([p.reshape(*lead, -1) for p in parts], axis=-1)
        return tree

    def get_buffer(self, num_transitions_per_env: int | None = None) -> dict[str, np.ndarray]:
        """The raw buffer (RolloutFileBase's): one ``(n, E, ...)`` array per recorded leaf file (n = 1 without
        ``num_transitions_per_env``), ``"next:<file>"`` for the next observations, ``"first"`` and ``"cut"`` flags.
        :meth:`get_batch` is the way to read: it makes a :class:`FileTransition` of such a buffer. Resets first if
        nothing was read yet (the leaves come from the recording's metadata.json)."""
        if num_transitions_per_env is not None:
            int_setting("get_buffer(num_transitions_per_env=...) (None: one transition)", num_transitions_per_env)
        if not self._initialized:
            self.reset()
        return self._alloc(1 if num_transitions_per_env is None else int(num_transitions_per_env))

    def fill_transition(self, buffer: dict[str, np.ndarray], env_ids: Any = None) -> None:
        """Fill every row of a :meth:`get_buffer` buffer for the envs in ``env_ids`` (None: all), advancing their
        cursors (RolloutFileBase's; :class:`StopIteration` when the passes are done)."""
        ids = None if env_ids is None else [int(e) for e in np.asarray(env_ids).reshape(-1)]
        for e in ids or ():
            if not 0 <= e < self.num_envs:
                raise UsageError(f"RolloutDataset.fill_transition(env_ids=...): env {e} is not in 0..{self.num_envs - 1}")
        if not self._initialized:
            self.reset()
        self._fill(buffer, len(buffer["first"]), envs=ids)

    def get_batch(self, num_transitions_per_env: int | None = None) -> FileTransition:
        """The next transition of every env (``(E, ...)``), or the next ``num_transitions_per_env`` (``(T, E, ...)``, time-major).

        An env whose trajectory runs out takes the next unused one; when none is left, a new pass
        starts (``dataset_loops``) or :class:`StopIteration` is raised (the rows of this unfinished
        batch are dropped). The first call resets (waiting for enough trajectories).
        """
        if num_transitions_per_env is not None:
            int_setting("get_batch(num_transitions_per_env=...) (None: one transition, no time dim)", num_transitions_per_env)
        if not self._initialized:
            self.reset()
        n = 1 if num_transitions_per_env is None else int(num_transitions_per_env)
        out = self._alloc(n)
        self._fill(out, n)
        b = self._transition(out)
        if num_transitions_per_env is None:
            b = FileTransition._make(map_leaves(x, lambda a: a[0]) if x is not None else None for x in b)
        return b if self.device is None else to_torch(b, self.device)

    def _transition(self, out: dict[str, np.ndarray]) -> FileTransition:
        term, done, timeout = self._flags(out)
        extras = {k: build(d, lambda f: out[f]) for k, d in self._fields.items() if k not in self._reserved}
        return FileTransition(self._obs(out, ""), build(self._fields[L.ACTION], lambda f: out[f]), out[L.REWARD], done,
                          timeout, self._obs(out, "next:"), term, out["first"], extras)

    def get_transition_batch(self) -> tuple[Any, Any, Any, Any, dict[str, Any]]:  # type: ignore[override]  # shmbuf's 5-tuple, kept
        """One step of every env, like a vector env's step: ``(s, a, r, d, info)``.

        ``info``: ``next_observation``, ``terminated``, ``first``, the extras, and ``time_outs``
        where the recording has a timeout (truncated) field.
        """
        b = self.get_batch()
        info: dict[str, Any] = {"next_observation": b.next_observation, L.TERMINATED: b.terminated, "first": b.first,
                                **b.extras}
        if b.timeout is not None:
            info["time_outs"] = b.timeout
        return b.observation, b.action, b.reward, b.done, info

    def __iter__(self) -> RolloutDataset:
        self.reset()
        return self

    def __next__(self) -> FileTransition:
        return self.get_batch()

    def torch_dataset(self, num_transitions_per_env: int | None = None) -> Any:
        """A ``torch.utils.data.IterableDataset`` of :meth:`get_batch` results as tensors (on ``device`` if given).

        Use it with ``DataLoader(ds, batch_size=None)`` (the batches are already batched) and
        ``num_workers=0``: each worker process would read the same trajectories again.
        Iterating it resets this dataset; the iteration ends at :class:`StopIteration`.
        """
        import torch.utils.data

        outer = self

        class RolloutIterableDataset(torch.utils.data.IterableDataset[FileTransition]):
            def __iter__(self) -> Iterator[FileTransition]:
                outer.reset()
                while True:
                    try:
                        b = outer.get_batch(num_transitions_per_env)
                    except StopIteration:
                        return
                    yield b if outer.device is not None else to_torch(b)

        return RolloutIterableDataset()

    def __repr__(self) -> str:
        return (f"RolloutDataset({self.data_dir!r}, num_envs={self.num_envs}, "
                f"trajectories={len(self.all_available_trajectory_dirs)}, looped={self.num_dataset_looped})")

