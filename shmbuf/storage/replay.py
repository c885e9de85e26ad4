"""A replay buffer in POSIX shared memory: several actor processes insert rows while the learner samples.

A ring of ``buffer_size`` rows (any pytree of numpy arrays), made by :meth:`ReplayBuffer.create`
and attached to by name from any process of the same user. Inserts reserve rows under a lock and
stamp each row's sequence word odd, then even; samples keep only rows whose stamp was even and
unchanged around the copy. The protocol and why it never returns a torn row: docs/design/replay.md;
the object's layout and header: :mod:`shmbuf.storage._replay_layout`; the writers' slots, reservation
and waits: :mod:`shmbuf.storage._replay_writers`.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree

from shmbuf._errors import SegmentError, SlotTimeout, UsageError
from shmbuf._schema import Schema
from shmbuf._substrate import (
    HEADER_BYTES,
    Closable,
    Owner,
    create_object,
    fence,
    fmt_bytes,
    keeping,
    map_object,
    new_name,
    open_object,
    pinned,
    populated,
    this_process,
    track,
    unlink_object,
    unmap,
    write_header,
)
from shmbuf._validate import int_setting, timeout_setting
from shmbuf.storage import _replay_layout as layout
from shmbuf.storage._local_replay import LocalReplayBuffer
from shmbuf.storage._replay_layout import ReplayHandle, ReplayInfo, describe, is_replay
from shmbuf.storage._replay_row import ROW, Row, row_schema
from shmbuf.storage._replay_writers import Writers
from shmbuf.storage._torch import to_torch

__all__ = ["LocalReplayBuffer", "ReplayBuffer", "ReplayHandle", "ReplayInfo", "describe", "is_replay"]

_SIGN_OR_ODD = np.int64(-(2**63) + 1)  # 0x8000000000000001
_NONE = np.zeros(0, np.intp)


def _attach_pickled(name: str, timeout: float | None) -> ReplayBuffer:
    return ReplayBuffer.attach(name, timeout=timeout)


# ------------------------------------------------------------------ the buffer

class ReplayBuffer(Closable):
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

    _kind = "replay buffer"

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

    def __init__(self, name: str, mm: Any, fd: int, schema: Schema, lay: layout.ReplayLayout, owner: bool, creator: Owner,
                 timeout: float | None, seed: int | None):
        self.name = name
        self.schema = schema
        self.buffer_size = lay.buffer_size
        self.max_writers = lay.max_writers
        self.timeout = timeout
        self.creator = creator
        self._lay = lay
        self._mm = mm
        self._fdbox = [fd]  # our descriptor, shared with the finalizer (a fork-ed child swaps in its own)
        self._ino = os.fstat(fd).st_ino
        self._owner = owner
        self._pid = os.getpid()
        self._closed = False
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._w = memoryview(mm).cast("q")
        pin = pinned(mm)  # every array below keeps the mapping alive while it lives
        self._seq = np.ndarray((lay.buffer_size,), np.int64, buffer=pin, offset=lay.seq_off)
        ts = schema.by_name[ROW]
        self._row = Row(ts)  # the row's contract: what a batch is checked against
        self._treespec = ts.treespec
        self._rows = [np.ndarray((lay.buffer_size, *lf.shape[1:]), lf.dtype, buffer=pin, offset=off)
                      for lf, off in zip(ts.leaves, lay.leaf_offs)]
        self._writers = Writers(name, self._w, pin, lay, timeout)  # our writer slot (claimed at the first insert), the records
        self._stamps = np.zeros(0, np.int64)  # 2 * arange(m), grown to the largest batch: stamps are this + 2*first + 1
        self._insert_lock = threading.Lock()
        self._fence = fence()
        # Release at collection or exit if never closed: the descriptor (and our writer slot's lock with it), and
        # in the creator's process the name. Without it every instance dropped unclosed kept a writer slot live
        # (max_writers of them and inserts time out) and a creator that forgot `with` left the object in /dev/shm.
        self._lifetime(layout.release, self._fdbox, name, os.getpid() if owner else 0,
                       unlink=functools.partial(unlink_object, name) if owner else None)
        track(self)

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def create(cls, example_row: Any, buffer_size: int, *, max_writers: int = 64, timeout: float | None = 10.0,
               seed: int | None = None, keep_on_crash: bool = False) -> ReplayBuffer:
        """Make a new buffer of ``buffer_size`` rows shaped like ``example_row`` (one row: a pytree of numpy arrays).

        ``max_writers``: how many instances may insert at once (each takes a writer slot at its
        first insert, until it closes, is collected, or its process dies). ``timeout``: the longest
        any insert or sample waits (for a writer slot, for the reservation lock, for a live writer
        still writing rows about to be overwritten, for a complete row to sample) and ``close()``
        waits for an insert in another thread; past it, SlotTimeout. ``None`` waits for ever: every
        one of these waits is on a live process (a dead one's locks are gone), and what cannot wait
        raises. ``seed``: this instance's
        sampling generator. Space is reserved now (NoSpace if /dev/shm is too small).

        The creator's ``close()`` (or a ``with`` block's end) unlinks the name, and so does the
        collection of a creator never closed, or the creator's exit: only in the creating process
        (a ``fork``-ed child's copy never unlinks). A creator killed outright (SIGKILL included) has
        it removed by its watcher within a second, unless ``keep_on_crash``: then it stays for
        ``shmbuf ls`` and ``shmbuf clean`` (docs/reliability.md).
        """
        buffer_size = int_setting("ReplayBuffer: buffer_size", buffer_size, 1, layout.MAX_ROWS)
        max_writers = int_setting("ReplayBuffer: max_writers", max_writers, 1, layout.MAX_WRITERS)
        timeout = timeout_setting("ReplayBuffer: timeout", timeout)  # one rule; why None is safe: docs/design/replay.md
        schema = row_schema(example_row)
        lay = layout.ReplayLayout.of(schema, buffer_size, max_writers)
        name = new_name()
        fd, mm = create_object(name, lay.total, f"a replay buffer of {buffer_size} rows x {fmt_bytes(lay.row_bytes)}",
                               populate=True, keep=keeping(keep_on_crash))
        try:
            me = this_process()
            write_header(mm, lay.pack(schema, me))
            mm[lay.schema_off : lay.schema_off + lay.schema_len] = schema.to_msgpack()
            return cls(name, mm, fd, schema, lay, True, me, timeout, seed)
        except BaseException:
            mm.close()
            os.close(fd)
            unlink_object(name)
            raise

    @classmethod
    def attach(cls, target: Any, *, timeout: float | None = 10.0, seed: int | None = None) -> ReplayBuffer:
        """Attach to an existing buffer by name, :class:`ReplayHandle` or buffer; SegmentError if it is not one.

        The object is opened without following links and refused unless it is a 0600 regular
        file of this user; every header field is checked against the schema it carries before
        any view is made. ``close()`` (or collection) detaches; only the creator unlinks.
        """
        name = layout.name_of(target)
        timeout = timeout_setting("ReplayBuffer: timeout", timeout)  # one rule; why None is safe: docs/design/replay.md
        fd, mm = map_object(name, readonly=False, min_size=HEADER_BYTES + 64, what="shmbuf replay buffer")
        try:
            schema, lay, creator = layout.read_layout(mm, name)
            mm = populated(fd, mm)
            return cls(name, mm, fd, schema, lay, False, creator, timeout, seed)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    @property
    def handle(self) -> ReplayHandle:
        return ReplayHandle(self.name)

    def __reduce__(self) -> Any:
        return (_attach_pickled, (self.name, self.timeout))

    def __exit__(self, *exc: object) -> None:
        if self._owner and self._pid == os.getpid():
            self.unlink()
        self.close()

    @property
    def _fd(self) -> int:
        return self._fdbox[0]

    @_fd.setter
    def _fd(self, fd: int) -> None:
        self._fdbox[0] = fd

    def close(self) -> None:
        """Detach: give up the writer slot, unmap, close the file; in the creator's process, also unlink the name
        (as a Reader does: processes attached keep their mapping, new attaches fail). Idempotent.

        An insert through this instance in another thread is waited for (up to ``timeout``, then
        SlotTimeout and nothing is closed): closing under it would drop its writer slot mid-copy.
        An instance that is never closed is released the same way when it is collected, or at exit.
        """
        if self._closed:
            return
        if not self._insert_lock.acquire(timeout=-1 if self.timeout is None else self.timeout):
            raise SlotTimeout(f"replay buffer {self.name}: close() waited timeout={self.timeout} s for an insert through this "
                              "instance (in another thread) to finish; nothing was closed. Stop inserting, then close")
        try:
            if self._closed:
                return
            self._closed = True
            self._rows = []
            self._seq = None  # type: ignore[assignment]  # closed: the views go, so that no array of ours keeps the mapping
            self._writers.close()
            self._w.release()
            unmap(self._mm)  # we hand out no views; were there one, the mapping would go with it (pinned)
            super().close()  # closes the file (dropping our writer slot's lock); the creator's process unlinks
        finally:
            self._insert_lock.release()

    def _after_fork_in_child(self) -> None:
        """In a fork-ed child: drop the parent's descriptor (and with it any claim on the parent's locks)."""
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = -1
        self._writers.forget()
        self._owner = False
        self._insert_lock = threading.Lock()  # the parent's may have been held by one of its threads
        if self._seed is None:
            self._rng = np.random.default_rng()  # else parent and child would draw the same rows

    def _descriptor(self) -> int:
        """Our own open file description of the object: reopened in a fork-ed child, checked to be the same file."""
        if self._closed:
            raise UsageError(f"replay buffer {self.name} is closed in this process")
        if self._fd < 0:
            fd, _ = open_object(self.name, readonly=False)
            if os.fstat(fd).st_ino != self._ino:
                os.close(fd)
                raise SegmentError(f"replay buffer {self.name} was removed (another object now has its name)")
            self._fd = fd
            self._pid = os.getpid()
        return self._fd

    # -- counters -----------------------------------------------------------

    @property
    def inserted(self) -> int:
        """Rows handed out to inserts so far, over the buffer's life (the global index of the next row)."""
        return int(self._live_words()[layout.W_INSERTED])

    @property
    def num_samples(self) -> int:
        """Rows that can be sampled: grows with the inserts up to ``buffer_size`` and stays there (the forks' name)."""
        return min(self.inserted, self.buffer_size)

    @property
    def step(self) -> int:
        """The row the next insert starts at (the forks' write index)."""
        return self.inserted % self.buffer_size

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_samples}/{self.buffer_size} rows, step {self.step}"
        row = ", ".join(f"{n} {dt} {s}" for n, (dt, s) in zip(self._row.names, self._row.out_specs))
        return f"ReplayBuffer({self.name}, {state}; row: {row})"

    def _live_words(self) -> memoryview:
        if self._closed:
            raise UsageError(f"replay buffer {self.name} is closed in this process")
        return self._w

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
