"""A replay buffer's shared object in this process: made (:meth:`ReplayObject.create`) or attached to
(:meth:`ReplayObject.attach`), mapped into the views the protocol works on, counted, and released (``close()``,
collection, exit, a ``fork``-ed child's own descriptor). The protocol over those views, insert and sample with the
rows' sequence stamps, is :class:`shmbuf.storage.replay.ReplayBuffer`'s; the object's layout and header:
:mod:`shmbuf.storage._replay_layout`. Why it is safe: docs/design/replay.md.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, TypeVar

import numpy as np

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
from shmbuf.storage._replay_layout import ReplayHandle
from shmbuf.storage._replay_row import ROW, Row, row_schema
from shmbuf.storage._replay_writers import Writers

_R = TypeVar("_R", bound="ReplayObject")


class ReplayObject(Closable):
    """The object under a :class:`~shmbuf.storage.replay.ReplayBuffer`: its mapping and views (the rows, their sequence
    words, the writer records), its lifecycle and its counters. See ``ReplayBuffer`` for what a user calls."""

    _kind = "replay buffer"

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
    def create(cls: type[_R], example_row: Any, buffer_size: int, *, max_writers: int = 64, timeout: float | None = 10.0,
               seed: int | None = None, keep_on_crash: bool = False) -> _R:
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
    def attach(cls: type[_R], target: Any, *, timeout: float | None = 10.0, seed: int | None = None) -> _R:
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

    def close(self, timeout: float | None = None) -> None:
        """Detach: give up the writer slot, unmap, close the file; in the creator's process, also unlink the name
        (as a Reader does: processes attached keep their mapping, new attaches fail). Idempotent.

        An insert through this instance in another thread is waited for (up to ``timeout`` seconds, by default
        the buffer's own ``timeout``; then SlotTimeout and nothing is closed): closing under it would drop its
        writer slot mid-copy.
        An instance that is never closed is released the same way when it is collected, or at exit.
        """
        wait = self.timeout if timeout is None else timeout_setting(f"{type(self).__name__}.close(timeout=...)", timeout)
        if self._closed:
            return
        if not self._insert_lock.acquire(timeout=-1 if wait is None else wait):
            raise SlotTimeout(f"replay buffer {self.name}: close() waited timeout={wait} s for an insert through this "
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
        return f"{type(self).__name__}({self.name}, {state}; row: {row})"

    def _live_words(self) -> memoryview:
        if self._closed:
            raise UsageError(f"replay buffer {self.name} is closed in this process")
        return self._w
