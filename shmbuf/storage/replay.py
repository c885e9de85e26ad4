"""A replay buffer in POSIX shared memory: several actor processes insert rows while the learner samples.

A ring of ``buffer_size`` rows (any pytree of numpy arrays), made by :meth:`ReplayBuffer.create`
and attached to by name from any process of the same user. Inserts reserve rows under a lock and
stamp each row's sequence word odd, then even; samples keep only rows whose stamp was even and
unchanged around the copy. The protocol and why it never returns a torn row: docs/design/replay.md;
the object's layout and header: :mod:`shmbuf.storage._replay_layout`; the object in this process (create,
attach, close, fork): :mod:`shmbuf.storage._replay_object`; the writers' slots, reservation and waits:
:mod:`shmbuf.storage._replay_writers`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree

from shmbuf._errors import SlotTimeout, UsageError
from shmbuf._validate import int_setting
from shmbuf.storage._local_replay import LocalReplayBuffer
from shmbuf.storage._replay_layout import ReplayHandle, ReplayInfo, describe, is_replay
from shmbuf.storage._replay_object import ReplayObject
from shmbuf.storage._torch import to_torch

__all__ = ["LocalReplayBuffer", "ReplayBuffer", "ReplayHandle", "ReplayInfo", "describe", "is_replay"]

_SIGN_OR_ODD = np.int64(-(2**63) + 1)  # 0x8000000000000001
_NONE = np.zeros(0, np.intp)


def _attach_pickled(name: str, timeout: float | None) -> ReplayBuffer:
    return ReplayBuffer.attach(name, timeout=timeout)


# ------------------------------------------------------------------ the buffer

class ReplayBuffer(ReplayObject):
    """A ring of ``buffer_size`` rows in shared memory, inserted into by many processes and sampled uniformly.

    Make one with :meth:`create` (the owner; its ``close()``, ``with`` or collection unlinks it), attach to it in other
    processes with :meth:`attach` (by name or :class:`ReplayHandle`, or pass the buffer itself to a
    ``multiprocessing`` child: pickling carries the name only, and a ``fork``-ed child may keep
    using the copy it inherited). The concurrency protocol: docs/design/replay.md.

    Lifetime: everything :meth:`sample` and :meth:`feed_forward_generator` return is a fresh copy,
    the caller's to keep; nothing hands out a view of the shared rows. One instance is for one
    thread at a time for sampling (its random generator is not thread-safe); inserts through one
    instance are serialised by a lock of its own, and other instances (in this process or others)
    insert concurrently.

    The constructor of rsl_rl's legged-robot forks, ``ReplayBuffer(obs_dim, buffer_size, device)`` (an int first), makes a
    :class:`~shmbuf.storage.lowlevel.LocalReplayBuffer` instead: the forks' in-process ring of ``(state, next_state)``
    pairs with ``insert(states, next_states)`` and ``feed_forward_generator`` yielding them, tensors on ``device``.
    The shared-memory buffer is made only by :meth:`create` and :meth:`attach`, as always.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The constructor proper is internal (create / attach call it with a segment name first); an int first, or
        # obs_dim=, is the forks' ReplayBuffer(obs_dim, buffer_size, device), which is a different object.
        first = args[0] if args else kwargs.get("obs_dim")
        if cls is ReplayBuffer and isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            return LocalReplayBuffer(*args, **kwargs)
        if cls is ReplayBuffer and (not args or not isinstance(first, str)):
            raise UsageError("ReplayBuffer(...): make a shared-memory replay buffer with ReplayBuffer.create(example_row, "
                             "buffer_size) or attach to one with ReplayBuffer.attach(name); ReplayBuffer(obs_dim, "
                             f"buffer_size, device) is the in-process one of rsl_rl's legged-robot forks (obs_dim an int); "
                             f"got {first!r:.80} first")
        return super().__new__(cls)

    def __reduce__(self) -> Any:
        return (_attach_pickled, (self.name, self.timeout))

    # -- insert ---------------------------------------------------------------

    def insert(self, batch: Any) -> int:
        """Write a batch of rows (the row's tree, every leaf with a leading batch dim ``n``); return its first global index.

        The rows go to ``step, step+1, ...`` modulo ``buffer_size``, split in two writes where they
        wrap round the end; a batch longer than ``buffer_size`` leaves only its last
        ``buffer_size`` rows. Dtypes must cast to the row's under numpy's 'same_kind' rule.
        Raises SchemaError (naming the leaf) for a wrong key, shape or dtype, SlotTimeout when
        no writer slot comes free or a live writer still writing the rows we would overwrite does
        not finish within ``timeout``; either way nothing of the batch was written (after the
        second kind its places in the ring were already taken: they are skipped, and ``inserted``
        counts them). OSError naming the buffer, nothing written, if a lock call fails otherwise
        than busy (waiting would not help).
        """
        leaves, n = self._row.check_batch(batch)
        if n == 0:
            return self.inserted
        with self._insert_lock:
            fd = self._descriptor()
            deadline = _deadline(self.timeout)
            writers = self._writers
            writers.claim(fd, deadline)
            try:
                first, end = writers.reserve(fd, n, deadline)
                writers.wait_for_earlier(fd, first, end, deadline)
                self._write(leaves, n, first, end)
            finally:
                # Whatever happened (done, SlotTimeout, a KeyboardInterrupt anywhere from the reservation on):
                # no insert of ours is in progress any more, so no later insert waits for one.
                try:
                    if self._fence:  # the stamps before the record says we are done
                        self._fence()
                finally:
                    writers.finish()  # one store (END is ours alone): the record reads empty
            return end - n

    def _write(self, leaves: list[np.ndarray], n: int, first: int, end: int) -> None:
        """Stamp odd, copy (two slices where the rows wrap), stamp even: the writer half of docs/design/replay.md."""
        seq, f = self._seq, self._fence
        n_rows = self.buffer_size
        m = end - first
        start = first % n_rows
        part = min(m, n_rows - start)
        if len(self._stamps) < m:
            self._stamps = 2 * np.arange(m, dtype=np.int64)
        stamps = self._stamps[:m] + (2 * first + 1)
        if f:  # what we read of the records before our first store to the rows
            f()
        seq[start : start + part] = stamps[:part]
        if m > part:
            seq[: m - part] = stamps[part:]
        if f:  # odd stamps before any byte of the rows
            f()
        self._copy_rows(leaves, start, part, n - m)
        if f:  # every byte before the even stamps
            f()
        stamps += 1
        seq[start : start + part] = stamps[:part]
        if m > part:
            seq[: m - part] = stamps[part:]
        self._writers.wrote(n)

    def _copy_rows(self, leaves: list[np.ndarray], start: int, part: int, skip: int) -> None:
        """Copy the batch (less its first ``skip`` rows) to rows ``start, ...``: ``part`` rows to the end, the rest from row 0."""
        rest = len(leaves[0]) - skip - part
        for dst, x in zip(self._rows, leaves):
            dst[start : start + part] = x[skip : skip + part] if skip or rest else x
            if rest:
                dst[:rest] = x[skip + part :]

    # -- sample ---------------------------------------------------------------

    def sample(self, batch_size: int) -> Any:
        """``batch_size`` rows drawn uniformly with replacement from the complete rows: a tree of fresh arrays (copies).

        Rows being written (or left half-written by a writer that died) are never returned: such
        draws are redrawn, at once while redraws find complete rows, else after a pause while live
        writers are mid-row. UsageError if the buffer holds no row yet, or no complete row and no
        insert under way (its writers died mid-row); SlotTimeout if redraws find no complete row
        for the draws still bad within ``timeout``.
        """
        batch_size = _size("sample(batch_size=...)", batch_size)
        return optree.tree_unflatten(self._treespec, self._gather(batch_size))

    def feed_forward_generator(self, num_mini_batch: int, mini_batch_size: int) -> Iterator[Any]:
        """``num_mini_batch`` samples of ``mini_batch_size`` rows each (the forks' generator; see :meth:`sample`).

        Every batch is a fresh copy. Settings are checked now, not at the first ``next``.
        """
        num_mini_batch = _size("feed_forward_generator(num_mini_batch=...)", num_mini_batch)
        mini_batch_size = _size("feed_forward_generator(mini_batch_size=...)", mini_batch_size)
        self._live_words()
        return (self.sample(mini_batch_size) for _ in range(num_mini_batch))

    def _gather(self, size: int) -> list[np.ndarray]:
        n = self.num_samples
        if n == 0:
            raise UsageError(f"sample: replay buffer {self.name} is empty (num_samples=0): insert rows before sampling")
        idx = self._draw(n, size)
        out = [np.empty((size, *s), dt) for dt, s in self._row.out_specs]
        bad = self._gather_into(out, None, idx)
        deadline = _deadline(self.timeout)
        pause = 0.0
        while bad.size:
            left = bad.size
            idx[bad] = self._draw(self.num_samples, left)
            bad = self._gather_into(out, bad, idx)
            # Fewer bad: redraw the rest at once. None fewer (however many earlier draws were good): find out why.
            pause = 0.0 if bad.size < left else self._no_progress(bad.size, size, deadline, pause)
        return out

    def _no_progress(self, left: int, size: int, deadline: float, pause: float) -> float:
        """A redraw found no complete row for any of the ``left`` draws still bad: raise, or pause; the next pause.

        UsageError if nothing is complete and no insert is under way (its writers died mid-row), SlotTimeout past the
        deadline; a pause (a yield growing to 1 ms) only while a live writer is mid-row. Why: docs/design/replay.md.
        """
        writing = self._inserts_in_progress()
        if not writing and self._none_complete_for_good():
            raise UsageError(f"sample: replay buffer {self.name} has no complete row (its writers died while writing "
                             "its rows): insert rows before sampling")
        if time.monotonic() > deadline:
            raise SlotTimeout(f"sample: {left} of the {size} rows drawn from replay buffer {self.name} were being written "
                              f"(or left half-written by writers that died), and no redraw found complete rows in their "
                              f"place within timeout={self.timeout} s")
        if not writing:
            return 0.0
        time.sleep(pause)
        return min(max(2 * pause, 0.00005), 0.001)

    def _draw(self, n: int, k: int) -> np.ndarray:
        """``k`` indices uniform in [0, n): floor of a 53-bit uniform float times ``n`` (bias below n / 2**53).

        Twice as fast as ``Generator.integers`` for a few hundred draws, whose argument handling dominates.
        """
        idx = (self._rng.random(k) * n).astype(np.intp)
        return np.minimum(idx, n - 1, out=idx)  # r * n may round up to n when r is within 2**-53 of 1

    def _gather_into(self, out: list[np.ndarray], todo: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
        """Copy rows ``idx[todo]`` (all of ``idx`` for None) into ``out[:, todo]`` under the sequence check.

        Returns the positions (into ``idx``) to redraw: rows never written, being written, or
        rewritten during the copy.
        """
        f = self._fence
        at = idx if todo is None else idx[todo]
        s1 = self._seq.take(at)
        if f:  # the sequence words before any byte of the rows
            f()
        for dst, src in zip(out, self._rows):
            if todo is None:
                src.take(at, axis=0, out=dst, mode="clip")  # in range; mode 'raise' would buffer `out`
            else:
                dst[todo] = src.take(at, axis=0)
        if f:  # every byte before the second look at the sequence words
            f()
        s2 = self._seq.take(at)
        # Good: s1 == s2, even and > 0. (s1 - 2) has neither its sign bit nor bit 0 set exactly when s1 is even and >= 2.
        flags = ((s1 - 2) & _SIGN_OR_ODD) | (s1 ^ s2)
        if not np.count_nonzero(flags):
            return _NONE
        bad = np.flatnonzero(flags)
        return bad if todo is None else todo[bad]

    def snapshot(self) -> tuple[Any, np.ndarray]:
        """Copies of rows ``0 .. num_samples-1`` in row order, and a bool mask of the rows that are complete.

        A row is complete when it was fully written by one insert and was not rewritten while it
        was copied (the sampler's check); the others (being written, or left half-written by a
        writer that died) hold bytes that mean nothing. Once the buffer is full the oldest row is
        at :attr:`step`. Everything returned is the caller's.
        """
        n = self.num_samples
        f = self._fence
        s1 = self._seq[:n].copy()
        if f:
            f()
        rows = [src[:n].copy() for src in self._rows]
        if f:
            f()
        s2 = self._seq[:n]
        complete = (s1 == s2) & (s1 > 0) & (s1 % 2 == 0)
        return optree.tree_unflatten(self._treespec, rows), complete

    def _none_complete_for_good(self) -> bool:
        """No row is complete and no insert is under way: seen twice, with the sequence words unchanged in between.

        The caller's look at the records (``_inserts_in_progress`` False) is the first look. An insert
        under way has its record set before it stamps a row, so it shows up either in a record (first
        or second look) or as a changed sequence word between the two looks.
        """
        n = self.num_samples
        before = self._seq[:n].copy()
        if np.any((before > 0) & (before % 2 == 0)) or self._inserts_in_progress():
            return False
        return bool(np.array_equal(before, self._seq[:n]))

    def _inserts_in_progress(self) -> bool:
        """Is any live writer (another instance) in the middle of an insert?"""
        fd = self._descriptor()
        return self._writers.in_progress(fd)

    # -- torch ------------------------------------------------------------------

    to_torch = staticmethod(to_torch)  # shmbuf.storage's one numpy-to-torch (see _torch.py)



def _deadline(timeout: float | None) -> float:
    """The monotonic time a wait bounded by ``timeout`` gives up at (infinity for None: wait for ever)."""
    return math.inf if timeout is None else time.monotonic() + timeout


def _size(setting: str, value: object) -> int:
    return int_setting(setting, value, 1)
