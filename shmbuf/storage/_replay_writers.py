"""The replay buffer's writers among themselves: writer slots, the reservation, and the wait for an earlier writer.

Each inserting instance holds a writer slot (a lock, and a record of the rows it is writing now); an insert reserves
its rows under one lock, then waits while a live earlier writer is still on any of them. A module of its own because
this protocol is over the writer records and locks alone: the rows' sequence stamps, whose writer and sampler halves
must sit together, stay in :mod:`shmbuf.storage.replay`. Why it is safe: docs/design/replay.md.
"""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np

from shmbuf._errors import SlotTimeout
from shmbuf._substrate import BUSY, LOCK_BASE, apply, lock, packed
from shmbuf.storage import _replay_layout as layout

_RESERVE = packed(fcntl.F_WRLCK, LOCK_BASE)  # packed once: the unlock must not fail half-way
_UNRESERVE = packed(fcntl.F_UNLCK, LOCK_BASE)


class Writers:
    """One ReplayBuffer instance's part in the writer protocol: its writer slot and record, and every writer's records.

    ``w`` is the buffer's word view and ``pin`` its pinned mapping: the records' arrays are views of it, which
    :meth:`close` drops. The buffer's descriptor is passed to each call (a ``fork``-ed child opens its own).
    ``timeout`` only names the setting in errors; every wait ends at the ``deadline`` it is given.
    """

    def __init__(self, name: str, w: memoryview, pin: np.ndarray, lay: layout.ReplayLayout, timeout: float | None):
        self.name = name
        self.buffer_size = lay.buffer_size
        self.max_writers = lay.max_writers
        self.timeout = timeout
        self._w = w
        recs = np.ndarray((lay.max_writers, layout.RECORD_BYTES // 8), np.int64, buffer=pin, offset=layout.WRITERS_OFF)
        self._firsts, self._ends = recs[:, layout.F_FIRST], recs[:, layout.F_END]  # views: every writer's record
        self._slot: int | None = None  # our writer slot, claimed at the first insert
        self._rec = -1  # its record's first word

    def close(self) -> None:
        """Drop the records' views, so that no array of ours keeps the mapping."""
        self._firsts = self._ends = None  # type: ignore[assignment]  # closed: the buffer makes no call after close

    def forget(self) -> None:
        """In a fork-ed child: the slot is the parent's (its lock went with the parent's descriptor)."""
        self._slot, self._rec = None, -1

    def claim(self, fd: int, deadline: float) -> int:
        """Our writer slot (claimed once, held until close or death): a lock on its byte, then its record cleared."""
        if self._slot is not None:
            return self._slot
        w = self._w
        while True:
            for k in range(self.max_writers):
                try:
                    lock(fd, layout.slot_lock(k), fcntl.F_WRLCK)
                except OSError as exc:
                    if exc.errno in BUSY:
                        continue  # a live instance holds it
                    raise self._lock_failed(exc, f"writer slot {k}'s lock") from exc
                rec = layout.record_word(k)
                w[rec + layout.F_FIRST] = w[rec + layout.F_END]  # one store: whatever a dead holder was writing is no one's now
                w[rec + layout.F_PID] = os.getpid()
                w[rec + layout.F_ROWS] = 0
                self._slot, self._rec = k, rec
                return k
            if time.monotonic() > deadline:
                raise SlotTimeout(
                    f"replay buffer {self.name}: all {self.max_writers} writer slots are held by live instances "
                    f"(max_writers={self.max_writers} at ReplayBuffer.create) and none came free within "
                    f"timeout={self.timeout} s; "
                    "close() inserting instances you no longer use, or create the buffer with a larger max_writers"
                )
            time.sleep(0.001)

    def reserve(self, fd: int, n: int, deadline: float) -> tuple[int, int]:
        """Under the reservation lock: take global indices [g, g+n), of which [first, end) are written; record them.

        FIRST is stored before END, so that between the two stores the record reads as empty
        (FIRST >= the old END), never as a range wider than the one being reserved. An exception
        anywhere in here (a KeyboardInterrupt too) leaves the lock released (the unlock is one C
        call on bytes packed in advance) and the record for :meth:`finish` to clear.
        """
        w = self._w
        rec = self._rec
        try:
            self._take_reservation(fd, deadline)
            g = w[layout.W_INSERTED]
            end = g + n
            first = max(g, end - self.buffer_size)
            w[rec + layout.F_FIRST] = first
            w[rec + layout.F_END] = end
            w[layout.W_INSERTED] = end
        finally:
            apply(fd, _UNRESERVE)  # a no-op if we never got it
        return first, end

    def wrote(self, n: int) -> None:
        """Count ``n`` rows written in our record (``shmbuf ls`` shows it)."""
        self._w[self._rec + layout.F_ROWS] += n

    def finish(self) -> None:
        """No insert of ours is in progress any more: one store (END is ours alone), and the record reads empty."""
        w, rec = self._w, self._rec
        w[rec + layout.F_FIRST] = w[rec + layout.F_END]

    def _take_reservation(self, fd: int, deadline: float) -> None:
        """The reservation lock, waited for up to the deadline (then SlotTimeout, nothing reserved).

        Not ``F_OFD_SETLKW``, which cannot be bounded: a holder that is stopped (SIGSTOP, a
        debugger) would stall every inserter past ``timeout``. Its holders keep it for three
        stores, so a busy lock is retried at once a few times (yielding the CPU), then with
        sleeps growing to 1 ms.
        """
        tries, pause = 0, 0.00005
        while True:
            try:
                apply(fd, _RESERVE)
                return
            except OSError as exc:
                if exc.errno not in BUSY:
                    raise self._lock_failed(exc, "the reservation lock") from exc
            tries += 1
            if tries <= 20:
                os.sched_yield()
                continue
            if time.monotonic() > deadline:
                raise SlotTimeout(
                    f"replay buffer {self.name}: the reservation lock (held by another inserting instance for a few "
                    f"stores at a time) was not free within timeout={self.timeout} s; nothing of this batch was written "
                    "and nothing was reserved. Is an inserting process stopped (SIGSTOP, a debugger)?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _lock_failed(self, exc: OSError, what: str) -> OSError:
        """A lock call that failed otherwise than busy: no holder is there to let go, so the kernel's error, naming us."""
        return OSError(exc.errno, f"replay buffer {self.name}: taking {what} failed ({exc.strerror}), not because another "
                                  "instance holds it: waiting would not help")

    def wait_for_earlier(self, fd: int, first: int, end: int, deadline: float) -> None:
        """Return once no live writer of an earlier insert is still writing any of our rows; else SlotTimeout.

        Every earlier insert's record was stored before our reservation (under the lock), so it
        is visible here; a record only ever goes from "in progress" to empty after that. An
        earlier insert can share a row with ours only if it started more than a ring before our
        end (FIRST < end - N): the cheap test that leaves nothing to check in the usual case.
        """
        n_rows = self.buffer_size
        pause = 0.0001
        while True:
            a, b = self._firsts, self._ends
            cand = (a < b) & (a < end - n_rows)
            if not np.count_nonzero(cand):
                return
            who = self._live_overlap(fd, np.flatnonzero(cand), first, end)
            if who is None:
                return
            if time.monotonic() > deadline:
                raise SlotTimeout(
                    f"replay buffer {self.name}: process {who} is still writing rows that this insert would overwrite "
                    f"(a full ring of {n_rows} rows was inserted meanwhile) and did not finish within timeout={self.timeout} s; "
                    "nothing of this batch was written (its places in the ring are skipped). Use a larger buffer_size, "
                    "or find out why that process stalls"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _live_overlap(self, fd: int, cand: np.ndarray, first: int, end: int) -> int | None:
        """The pid of a live writer among slots ``cand`` whose insert in progress shares a row with [first, end), or None."""
        n_rows, mine = self.buffer_size, end - first
        for k in cand.tolist():
            rec = layout.record_word(k)
            a, b = self._w[rec + layout.F_FIRST], self._w[rec + layout.F_END]
            if not a < b:
                continue  # finished since we looked
            shift = (first - a) % n_rows  # ranges of length <= N share a row iff one starts inside the other, mod N
            if (shift < b - a or shift + mine > n_rows) and layout.writer_held(fd, k, self.name):
                return int(self._w[rec + layout.F_PID])
        return None

    def in_progress(self, fd: int) -> bool:
        """Is any live writer (another instance) in the middle of an insert? (The sampler asks, to know whether to wait.)"""
        w = self._w
        for k in range(self.max_writers):
            rec = layout.record_word(k)
            if w[rec + layout.F_FIRST] < w[rec + layout.F_END] and layout.writer_held(fd, k, self.name):
                return True
        return False
