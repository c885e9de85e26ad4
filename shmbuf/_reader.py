"""The learner side: create a pipeline, receive rollouts as zero-copy views or gathered batches.

The reader owns the segment and every slot's bookkeeping: which slots sit in
its pool, which it lent to which lane, which are ready and which the user
holds. Writers never decide where a slot goes; they only consume the slots
the reader put in their lane's free ring, and publish them back on the ready
ring. So a writer that dies can only lose what its lane held, and the reader
knows exactly what that was. The lane protocol itself (adopt, lend, wake,
take commits and mail, free) is :mod:`shmbuf._lane`'s; this module is its user.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree
import posix_ipc

from shmbuf import _control, _fork
from shmbuf._errors import PipelineClosed, SegmentError, SlotTimeout, StaleRollout, UsageError, WriterError, WrongProcess
from shmbuf._handle import Handle
from shmbuf._lane import LANE_ACTIVE, LANE_RETIRED, WAIT_SLICE, ReaderLane, Record, check_timeout, lane_held, wake_waiting
from shmbuf._proc import alive
from shmbuf._ring import store_load_fence
from shmbuf._schema import Schema
from shmbuf._segment import (
    S_COMMIT_NS, S_EPOCH, S_FILL, S_POLICY, S_SEQ, W_BAD_MESSAGES, W_CLOSED, W_DELIVERED, W_LANES_RECLAIMED, W_NEWCOMER,
    W_PARTIAL_DROPPED, W_POOL, W_READY_DEPTH, Segment, sem_name, unlink_all,
)

# How often the reader looks at the lane table for writers that came, left or died.
SCAN_INTERVAL = 0.05
LATENCY_WINDOW = 8192
# Where each slot is, in the reader's own books (never in shared memory), one byte per slot: its pool,
# ready here, held by the user (a Rollout or a zero-copy Batch), or lent to a lane (in its free ring,
# being written, or committed and not yet taken in; which lane is the slot's byte in ``_owner``).
SLOT_POOL, SLOT_READY, SLOT_HELD, SLOT_LENT = 0, 1, 2, 3
NOT_READY = np.iinfo(np.int64).max  # the arrival number of a slot that is not ready
# get_batch() with enough rollouts ready but no run of consecutive slots complete (and in order) waits
# for one at least this long (longer if the batch itself took longer to arrive), then gathers.
RUN_PATIENCE = 0.02
_BYTEORDER = sys.byteorder
CYCLE_MASK = 0xFFFFFFFF  # lending rounds are numbered mod 2**32: a slot would have to wait that many to alias
NO_VERSION = np.iinfo(np.int64).min  # the learner's policy version, where it had not set one


def create(example: Any, slots: int, *, max_writers: int = 16, raise_writer_errors: bool = True) -> Reader:
    """Create a pipeline laid out from ``example`` with ``slots`` rollout slots; return its reader.

    Args:
        example: a dict of timescales (see :class:`Schema`): ``{"step": {...
            leading dim T...}, "episode": {...}}``.
        slots: how many rollouts can be in flight (being written, ready, or
            held by you) at once. Writers wait when all are in use.
        max_writers: writer lanes; each writer process or thread takes one.
        raise_writer_errors: re-raise a writer's reported exception
            (:class:`WriterError`) from the next ``get``; else collect them
            in :attr:`Reader.errors`.

    The segment is created owner-only (0600), its space reserved and its
    pages faulted in now; a /dev/shm too small fails here with the sizes.
    """
    schema = Schema.from_example(example)
    seg = Segment.create(schema, slots, max_writers)
    try:
        return Reader(seg, raise_writer_errors=raise_writer_errors)
    except BaseException:
        seg.close()
        seg.unlink()
        raise


class Rollout:
    """One committed rollout, its leaves zero-copy views into the slot.

    Lifetime: ``data`` (and every array taken from it) is a view of shared
    memory that stays valid until this rollout is released, by
    :meth:`release` or by leaving its ``with`` block. After that the slot is
    handed to a writer and overwritten; ``data`` then raises
    :class:`StaleRollout`, but arrays you took out earlier cannot know, so
    do not keep them: use :meth:`copy` (or ``np.array(leaf)``) for anything
    that must outlive the rollout. Reading a kept array is never a crash:
    it keeps the shared memory mapped while it lives, even past the reader's
    ``close()``, and shows whatever the slot holds by then. Each access to ``data`` builds new dicts
    (the arrays in them are the slot's views), so what you put into them is
    yours and never seen by the next rollout.

    Metadata: ``lane``, ``pid`` (the writer's), ``epoch`` (which claim of the lane
    its writer held: a writer that replaces another on a lane gets a new one),
    ``seq`` (per writer, from 0), so ``(lane, epoch, seq)`` names this rollout
    alone for the pipeline's whole life; ``commit_ns`` (``time.monotonic_ns()`` at commit), ``policy_version``,
    ``fill`` (timescale to how many ``add`` calls it got: a rollout cut
    short shows it here).
    """

    __slots__ = ("_reader", "slot", "generation", "lane", "pid", "epoch", "seq", "commit_ns", "policy_version", "fill",
                 "__weakref__")

    def __init__(self, reader: Reader, slot: int, generation: int, lane: int, pid: int, epoch: int, seq: int,
                 commit_ns: int, policy_version: int, fill: dict[str, int]):
        self._reader = reader
        self.slot = slot
        self.generation = generation
        self.lane = lane
        self.pid = pid
        self.epoch = epoch
        self.seq = seq
        self.commit_ns = commit_ns
        self.policy_version = policy_version
        self.fill = fill

    @property
    def data(self) -> dict[str, Any]:
        """The whole slot as a tree shaped like the example (buffered leaves at full capacity)."""
        self._reader._check_live(self)
        return self._reader._tree(self.slot)

    def __getitem__(self, timescale: str) -> Any:
        return self.data[timescale]

    def filled(self) -> dict[str, Any]:
        """Like :attr:`data`, with each buffered timescale cut to its fill count (still views)."""
        data = self.data
        out = {}
        for ts in self._reader.schema.timescales:
            n = self.fill[ts.name]
            out[ts.name] = optree.tree_map(lambda a, n=n: a[:n], data[ts.name]) if ts.buffered else data[ts.name]
        return out

    def copy(self) -> dict[str, Any]:
        """An independent copy of :meth:`filled`, safe to keep after release."""
        return optree.tree_map(np.array, self.filled())

    def release(self) -> None:
        """Give the slot back to the writers. Releasing twice raises :class:`StaleRollout`."""
        self._reader._release(self)

    @property
    def released(self) -> bool:
        """True once released, or once the reader was closed (the slot is gone either way)."""
        return self._reader.closed or self._reader._generation_of(self.slot) != self.generation

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.released:
            return
        if exc is None:
            self.release()
            return
        try:  # the body's exception is the one to see; a failed release must not replace it
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Rollout(lane={self.lane}, epoch={self.epoch}, seq={self.seq}, pid={self.pid}, fill={self.fill}, "
                f"slot={self.slot})")


class Batch:
    """``size`` rollouts, every leaf with a leading dim ``size``: views of consecutive slots, or gathered.

    ``zero_copy`` says which. True: the rollouts sat in one aligned run of ``size`` consecutive
    slots (slots ``k*size .. k*size + size - 1``), so each leaf is a view of shared memory and
    nothing was copied. False: they were gathered leaf by leaf into a buffer (one copy per byte),
    and their slots were released at once. ``Reader.get_batch(view=False)`` always gathers.

    Lifetime (``copy=False``): a batch lasts until :meth:`release`, the end of its ``with`` block,
    or the reader's next ``get_batch`` (or ``batches`` step), which releases it. A zero-copy batch
    holds its slots until then, and no writer writes a slot a batch holds. After that ``data``
    raises :class:`StaleRollout`; arrays taken out earlier cannot know, so copy what must live
    longer (``copy=True`` gives a batch whose arrays are yours, never stale). A kept array stays
    readable, never a crash: it keeps the memory mapped while it lives, past the reader's close. The dicts in ``data``
    are this batch's own. Metadata arrays, shape (size,), are copies and stay valid: ``lane``,
    ``pid``, ``epoch``, ``seq``, ``commit_ns``, ``policy_version``; ``fill`` maps timescale to
    counts. Row ``i``'s ``(lane[i], epoch[i], seq[i])`` names its rollout alone (see :class:`Rollout`).
    """

    __slots__ = ("_data", "_reader", "_token", "_meta", "_schema", "zero_copy", "lane", "pid", "size")

    def __init__(self, data: dict[str, Any], meta: np.ndarray, lane: np.ndarray, pid: np.ndarray, schema: Schema,
                 reader: Reader | None, token: int, zero_copy: bool):
        self._data = data
        self._reader = reader  # None: the arrays are the caller's (copy=True), nothing to release
        self._token = token
        self._meta = meta  # copied for this batch alone; the fields below are views of it
        self._schema = schema
        self.zero_copy = zero_copy
        self.size = len(meta)
        self.lane = lane
        self.pid = pid

    @property
    def epoch(self) -> np.ndarray:
        return self._meta[:, S_EPOCH]

    @property
    def seq(self) -> np.ndarray:
        return self._meta[:, S_SEQ]

    @property
    def commit_ns(self) -> np.ndarray:
        return self._meta[:, S_COMMIT_NS]

    @property
    def policy_version(self) -> np.ndarray:
        return self._meta[:, S_POLICY]

    @property
    def fill(self) -> dict[str, np.ndarray]:
        return {ts.name: self._meta[:, S_FILL + t] for t, ts in enumerate(self._schema.timescales)}

    @property
    def data(self) -> dict[str, Any]:
        """The batch as a tree shaped like the example, each leaf ``(size, ...)``."""
        if self._reader is not None:
            self._reader._check_batch(self)
        return self._data

    def __getitem__(self, timescale: str) -> Any:
        return self.data[timescale]

    def release(self) -> None:
        """Give the batch's slots back now rather than at the next ``get_batch``. Twice raises :class:`StaleRollout`."""
        reader = self._reader
        if reader is None:
            return  # copy=True: the arrays are yours and the slots went back already
        reader._check_batch(self)
        reader._end_batch()

    @property
    def released(self) -> bool:
        """True once released (by :meth:`release`, the next ``get_batch``, or the reader's close)."""
        reader = self._reader
        return reader is not None and (reader._closed or reader._batch_token != self._token)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.released:
            return
        try:  # the body's exception is the one to see; a failed release must not replace it
            self.release()
        except Exception:
            if exc is None:
                raise

    def __repr__(self) -> str:
        kind = "zero-copy" if self.zero_copy else "gathered"
        return f"Batch(size={self.size}, {kind}, fill={ {k: v.tolist() for k, v in self.fill.items()} })"


class Reader:
    """The receiving end of a pipeline; made by :func:`create`, owner of the segment.

    Use it from one thread. Pickling it (e.g. passing it to a child process)
    sends only its :class:`Handle`; the child attaches a :class:`Writer` with it.
    ``close()`` stops the pipeline: every writer's next call raises
    :class:`PipelineClosed`, and the segment and its semaphores are unlinked.
    A Reader that is garbage-collected (or still open at exit) without
    ``close()`` stops the pipeline the same way.
    """

    def __init__(self, seg: Segment, *, raise_writer_errors: bool = True):
        self._seg = seg
        self.name = seg.name
        self.schema = seg.schema
        self.slots = seg.plan.n_slots
        self.max_writers = seg.plan.n_lanes
        self.raise_writer_errors = raise_writer_errors
        self.errors: list[WriterError] = []
        # The learner's current policy version, if it sets one: stats() then reports policy lag
        # (this minus the version each delivered rollout was collected with).
        self.policy_version: int | None = None
        self._pid = os.getpid()
        self._closed = False
        self._foreign = False
        self._w = seg.words
        self._plan = seg.plan
        self._sl_fence = store_load_fence()
        self._sems: list[posix_ipc.Semaphore] = []
        self._doorbell = self._make_sem("r")
        self._lane_sems = [self._make_sem(f"f{i}") for i in range(self.max_writers)]
        # Stop the pipeline at collection or exit if the user never closes: the owner's duty, in the owner's process only.
        self._finalizer = weakref.finalize(self, _stop, seg.words, list(self._sems), self.name, self.max_writers, self._pid)
        n = self.slots
        self._records = [Record(self._plan, i) for i in range(self.max_writers)]
        # The slot books, one array entry per slot, so that a batch's bookkeeping is a few numpy
        # operations rather than a loop (see "Where each slot is" in docs/design/reader.md).
        # Bytes, so that checking or setting a run of slots is one bytes operation, not a loop or a ufunc.
        self._where = bytearray(n)  # SLOT_POOL, SLOT_READY, SLOT_HELD or SLOT_LENT
        self._owner = bytearray(n)  # the lane a SLOT_LENT slot is lent to
        self._wv = np.frombuffer(self._where, np.uint8)  # the same books for numpy (gathers, reclaims)
        self._ov = np.frombuffer(self._owner, np.uint8)
        self._fill_bytes = {code: bytes([code]) * n for code in (SLOT_POOL, SLOT_READY, SLOT_HELD, SLOT_LENT)}
        self._lane_bytes: dict[int, bytes] = {}
        self._gen = np.zeros(n, np.int64)  # renewed at every release: a stale handle stops matching
        self._releases = 0
        self._arrived = np.full(n, NOT_READY, np.int64)  # a ready slot's arrival number (FIFO), else NOT_READY
        self._lane_of = np.full(n, -1, np.int64)  # the lane a ready or held slot came from, and its writer's pid
        self._pid_of = np.zeros(n, np.int64)
        self._count = np.arange(n, dtype=np.int64)
        self._count_bytes = self._count.tobytes()  # slot i's index at bytes 8i..8i+8: a run of commits, as the ring holds it
        self._arrivals = 0
        self._read_cursor = 0  # runs are looked for from the end of the last one handed out
        self._n_ready = 0
        self._held = 0
        self._cursor = 0  # slots are lent in cyclic order from here: runs of consecutive slots fill together
        self._cycle = 0  # a number per lending round (mod 2**32); each slot's at lending, 4 bytes a slot
        self._lent_in = bytearray(4 * n)
        self._run = 0  # get_batch's size, once it said one: slots are then lent a run at a time
        self._open_end = 0  # the end of the run being lent
        self._lanes: dict[int, ReaderLane] = {}
        self._next_scan = 0.0
        # The batch handed out last: its token (a Batch is live while it matches), and the run of slots it holds.
        self._batch_token = 0
        self._held_run: tuple[int, int] | None = None
        self._batches = {"views": 0, "gathered": 0}
        self._why = ""  # why _await chose to gather: stats()["gathered_why"] counts each reason
        self._gathered_why: dict[str, int] = {}
        # The reader's counters, kept here and only stored to shared memory (for `shmbuf ls`): a
        # word another process scribbled over can neither overflow them nor make stats() lie.
        self._delivered = 0
        self._partial_dropped = 0
        self._bad_messages = 0
        self._lanes_reclaimed = 0
        self._writers_seen = 0  # lanes taken since creation: a timeout with none says no writer ever came
        self._wn = np.ndarray((self._plan.total // 8,), np.int64, buffer=seg.base)  # the words, for bulk ring work
        self._leaf_all = [seg.leaf_view(i) for i in range(len(self.schema.leaves))]
        self._slot_table = np.ndarray((n, self._plan.slot_bytes // 8), np.int64, buffer=seg.base, offset=self._plan.slots_off)
        self._slot_leaves: dict[int, list[np.ndarray]] = {}  # views of one slot's leaves; never the containers
        self._batch_bufs: dict[int, list[np.ndarray]] = {}
        # The newest LATENCY_WINDOW rollouts delivered: commit time, time delivered, policy version they were
        # collected with, and the learner's version when delivered (NO_VERSION: it had not set one).
        self._commit = np.zeros(LATENCY_WINDOW, np.int64)
        self._got = np.zeros(LATENCY_WINDOW, np.int64)
        self._policy = np.zeros(LATENCY_WINDOW, np.int64)
        self._version = np.full(LATENCY_WINDOW, NO_VERSION, np.int64)
        self._lat_n = 0
        self._ts_names = [ts.name for ts in self.schema.timescales]
        self._shapes = []  # per timescale: (name, treespec, first leaf, (key, leaf index) pairs for a plain dict)
        first = 0
        for ts in self.schema.timescales:
            n = len(ts.leaves)
            template = optree.tree_unflatten(ts.treespec, list(range(first, first + n)))
            plain = type(template) is dict and all(type(v) is int for v in template.values())
            self._shapes.append((ts.name, ts.treespec, first, tuple(template.items()) if plain else None))
            first += n
        self._rollout_bytes = sum(lf.nbytes for lf in self.schema.leaves)
        self._w[W_POOL] = self.slots  # every slot starts in the pool (`shmbuf ls` reads this)
        _fork.track(self)

    def _make_sem(self, role: str) -> posix_ipc.Semaphore:
        sem = posix_ipc.Semaphore(sem_name(self.name, role), posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self._sems.append(sem)
        return sem

    @property
    def handle(self) -> Handle:
        """A picklable reference (the name) for other processes: ``Writer(reader.handle)``."""
        return Handle(self.name)

    def __reduce__(self) -> Any:
        return (Handle, (self.name,))

    def _after_fork_in_child(self) -> None:
        self._foreign = True

    def _guard(self) -> None:
        if self._foreign:
            raise WrongProcess(f"this Reader belongs to process {self._pid}, and this is a copy made by fork in "
                               f"{os.getpid()}; in a child, attach a Writer with the reader's handle")
        if self._closed:
            raise PipelineClosed(f"pipeline {self.name} is closed")

    # -- receiving ----------------------------------------------------------

    def get(self, timeout: float | None = None) -> Rollout:
        """The next committed rollout (the oldest ready), waiting up to ``timeout`` seconds (None: for ever).

        Raises:
            SlotTimeout: nothing arrived in time (a TimeoutError); the message says what this reader
                holds and whether any writer ever attached.
            UsageError: at once, when this reader itself holds every slot (a kept batch, rollouts
                not released), so no writer could ever fill one: ``get()`` does not end a batch.
            WriterError: a writer reported an exception (``raise_writer_errors``).
            PipelineClosed: this reader was closed.
        """
        self._guard()
        timeout = check_timeout(timeout, "get(timeout=...)")
        self._await(1, False, None if timeout is None else time.monotonic() + timeout, timeout)
        slot = int(self._arrived.argmin())
        self._arrived[slot] = NOT_READY
        self._n_ready -= 1
        return self._deliver(slot)

    def __iter__(self) -> Iterator[Rollout]:
        """Rollouts for ever, until the reader is closed; release each (or use ``with``)."""
        while not self._closed:
            yield self.get()

    def get_batch(self, batch_size: int, timeout: float | None = None, *, copy: bool = False,
                  view: bool = True) -> Batch:
        """``batch_size`` rollouts, each leaf ``(batch_size, ...)``: zero-copy where they sit in consecutive slots.

        Args:
            batch_size: from 1 to ``slots``.
            timeout: seconds to wait for the batch (None: for ever); :class:`SlotTimeout` after that.
            copy: give the batch arrays of its own (one copy), never stale; its slots go back at once.
            view: True (the default): views of shared memory when ``batch_size`` ready rollouts fill
                one aligned run of slots (``k * batch_size`` to ``k * batch_size + batch_size - 1``)
                and handing them out keeps every lane's commit order; else gathered with one copy per
                byte (``batch.zero_copy`` says which). False: always gathered.

        The batch this reader handed out before is released first (see :class:`Batch` for the
        lifetime). Rollouts from :meth:`get` that are not released still hold their slots: if they
        leave the writers fewer than ``batch_size``, this raises UsageError at once. Nothing is lost
        to an exception: until the batch is built, its rollouts stay
        ready for the next call.
        """
        self._guard()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= self.slots:
            raise UsageError(f"get_batch(batch_size=...): expected an int from 1 to slots={self.slots}, got {batch_size!r}")
        if view is not True and view is not False:
            raise UsageError(f"get_batch(view=...): expected True (views where the rollouts sit in a run of slots) "
                             f"or False (always gathered), got {view!r}")
        timeout = check_timeout(timeout, "get_batch(timeout=...)")
        if view and batch_size != self._run:
            self._run, self._open_end = batch_size, 0  # lend runs of this size from here on
        self._end_batch()
        first = self._await(batch_size, view, None if timeout is None else time.monotonic() + timeout, timeout)
        # From here to the return nothing waits or calls out: the slots change hands in one piece.
        if first >= 0:
            return self._view_batch(first, batch_size, copy)
        return self._gather_batch(batch_size, copy)

    def batches(self, batch_size: int, *, timeout: float | None = None, copy: bool = False,
                view: bool = True) -> Iterator[Batch]:
        """Batches for ever (until closed); each is released when the next is taken (see :class:`Batch`)."""
        while not self._closed:
            yield self.get_batch(batch_size, timeout, copy=copy, view=view)

    def dataset_iter(self, batch_size: int, *, copy: bool = False) -> Iterator[Batch]:
        """echo-style name for :meth:`batches`: for users of ``Server.dataset_iter(copy=False)``."""
        return self.batches(batch_size, copy=copy)

    # -- batches ------------------------------------------------------------

    def _view_batch(self, first: int, size: int, copy: bool) -> Batch:
        """Hand out slots ``first .. first + size - 1`` (all ready) as one batch of views."""
        run = slice(first, first + size)
        leaves = [leaf_all[run] for leaf_all in self._leaf_all]  # new views: a batch's are its own to reshape
        if copy:
            leaves = [np.array(leaf) for leaf in leaves]
        meta = self._slot_table[run].copy()
        lanes, pids = self._lane_of[run].copy(), self._pid_of[run].copy()
        data = self._unflatten(leaves)
        # Everything that can fail is done: the slots change hands.
        self._arrived[run] = NOT_READY
        self._n_ready -= size
        self._read_cursor = first + size if first + size < self.slots else 0
        self._batches["views"] += 1
        self._delivered_batch(meta)
        if copy:
            self._held += size
            self._release_run(first, size)
            self._feed()
            return Batch(data, meta, lanes, pids, self.schema, None, 0, False)
        self._where[run] = self._fill_bytes[SLOT_HELD][:size]
        self._held += size
        self._held_run = (first, size)
        return Batch(data, meta, lanes, pids, self.schema, self, self._batch_token, True)

    def _gather_batch(self, size: int, copy: bool) -> Batch:
        """Copy the ``size`` oldest ready rollouts into a buffer, leaf by leaf, and release their slots."""
        idx = np.argsort(self._arrived, kind="stable")[:size]  # every ready slot is older than every other
        if copy:
            leaves = [leaf_all.take(idx, axis=0, mode="clip") for leaf_all in self._leaf_all]
        else:
            leaves = self._batch_buffer(size)
            for leaf_all, out in zip(self._leaf_all, leaves):
                # mode="clip": the indices are ours and in range; the default "raise" makes numpy gather
                # into a scratch buffer and copy again (measured here: 421 vs 91 us per atari rollout)
                leaf_all.take(idx, axis=0, out=out, mode="clip")
        meta = self._slot_table.take(idx, axis=0, mode="clip")
        lanes, pids = self._lane_of[idx], self._pid_of[idx]
        data = self._unflatten(leaves)
        # The data is in the batch: the slots go back.
        self._arrived[idx] = NOT_READY
        self._n_ready -= size
        self._releases += 1
        self._gen[idx] = self._releases
        self._wv[idx] = SLOT_POOL
        self._batches["gathered"] += 1
        self._gathered_why[self._why] = self._gathered_why.get(self._why, 0) + 1
        self._delivered_batch(meta)
        self._feed()  # once for the batch: one wake-up per waiting writer, not one per slot
        if copy:
            return Batch(data, meta, lanes, pids, self.schema, None, 0, False)
        return Batch(data, meta, lanes, pids, self.schema, self, self._batch_token, False)

    def _delivered_batch(self, meta: np.ndarray) -> None:
        self._delivered += len(meta)
        self._w[W_DELIVERED] = self._delivered
        self._record(meta[:, S_COMMIT_NS], meta[:, S_POLICY])

    def _end_batch(self) -> None:
        """The batch handed out last is over: stale from now on, and the run of slots it held goes back."""
        self._batch_token += 1
        run = self._held_run
        if run is not None:
            self._held_run = None
            self._release_run(*run)
            self._feed()

    def _release_run(self, first: int, size: int) -> None:
        self._releases += 1
        self._gen[first : first + size] = self._releases  # a value no handle was given: stale handles stop matching
        self._where[first : first + size] = self._fill_bytes[SLOT_POOL][:size]
        self._held -= size

    def _check_batch(self, b: Batch) -> None:
        """Raise unless ``b`` is the batch handed out last and still held (``_check_live``'s twin for batches)."""
        if b._token == self._batch_token and not self._closed and not self._foreign:
            return
        if self._foreign:
            self._guard()
        if self._closed:
            raise StaleRollout(f"pipeline {self.name} is closed; the batch of {b.size} is gone")
        raise StaleRollout(
            f"this batch of {b.size} was released (by release(), its with block, or the reader's next get_batch); "
            "its slots now belong to other rollouts. Use get_batch(copy=True), or copy what you keep, to use data "
            "past that."
        )

    def _full_run(self, size: int) -> int:
        """The first slot of an aligned run of ``size`` ready slots that can be handed out in order (see
        ``_in_order``), looked for from the end of the last run handed out, round to it; or -1."""
        where, run, n = self._where, self._fill_bytes[SLOT_READY][:size], self.slots
        top = n - n % size
        start = self._read_cursor - self._read_cursor % size
        start = start if start < top else 0
        for lo, hi in ((start, top), (0, start)):
            at = lo
            while at < hi:
                first = where.find(run, at, hi)
                if first < 0:
                    break
                if first % size:  # not aligned: the next place an aligned run could start
                    at = first - first % size + size
                    continue
                if self._in_order(first, size):
                    return first
                at = first + size
        return -1

    def _in_order(self, first: int, size: int) -> bool:
        """May the run be handed out without breaking any lane's commit order? Its rows are in slot order,
        so each lane's rollouts in it must have arrived in slot order, and no ready rollout of that lane
        outside it may be older than one inside (it would be handed out after its successors)."""
        run = slice(first, first + size)
        inner = self._arrived[run]
        lent_in = self._lent_in[4 * first : 4 * (first + size)]
        # Lent in one turn of the cursor: in slot order, so each lane took them, and committed them, in slot order.
        # Otherwise look at the arrival order, per lane.
        if lent_in != lent_in[:4] * size:
            lanes = self._lane_of[run]
            order = lanes.argsort(kind="stable")
            a, ln = inner[order], lanes[order]
            if bool(((ln[1:] == ln[:-1]) & (a[1:] < a[:-1])).any()):
                return False
        if self._n_ready == size:
            return True  # nothing ready outside the run
        arrived, top = self._arrived, int(inner.max())
        before, after = arrived[:first], arrived[first + size :]
        if (not len(before) or int(before.min()) > top) and (not len(after) or int(after.min()) > top):
            return True  # everything ready outside is newer than everything inside
        saved = inner.copy()
        arrived[run] = NOT_READY  # the run, hidden for a moment, so that the minima below are outside it
        try:
            lanes_in = self._lane_of[run]
            for lane in set(lanes_in.tolist()):
                theirs = self._lane_of == lane
                oldest = int(arrived[theirs].min())
                newest = int(saved[lanes_in == lane].max())
                # equal: one commit group on both sides of the run's edge; the part before it is older
                if oldest < newest or (oldest == newest and bool((arrived[:first][theirs[:first]] == oldest).any())):
                    return False
        finally:
            arrived[run] = saved
        return True

    def _run_possible(self, size: int) -> bool:
        """Can an aligned run of ``size`` slots still fill? Not if each holds a rollout taken with get()."""
        held = self._fill_bytes[SLOT_HELD][:1]
        where = self._where
        return any(held not in where[k : k + size] for k in range(0, self.slots - size + 1, size))

    # -- the wait behind get and get_batch ------------------------------------

    def _await(self, size: int, view: bool, deadline: float | None, timeout: float | None) -> int:
        """Serve the writers and sleep until ``size`` rollouts can be handed out.

        Returns the first slot of a run of ``size`` ready slots to hand out as views, or -1 to
        gather the ``size`` oldest. ``view``: as in :meth:`get_batch` (``get`` passes False).
        With enough rollouts ready but no run complete (or none that keeps every lane's order),
        it waits for one for as long as the batch took to arrive (at least ``RUN_PATIENCE``), then
        gathers: a slow or hung writer delays a batch at most that much.
        """
        t_call = time.monotonic()
        patience_end = None
        if self.slots - self._held < size:
            raise UsageError(f"pipeline {self.name}: {self._asked(size)} can never be served: this reader itself "
                             f"{self._holding()}, so the writers can fill at most {self.slots - self._held} of its "
                             f"{self.slots} slots. Release what you hold first (batch.release(), rollout.release(), "
                             "or a with block), or copy what must outlive it (rollout.copy(), get_batch(copy=True))")
        while True:
            self._poll()
            if self.errors and self.raise_writer_errors:
                raise self.errors.pop(0)
            want = size - self._n_ready
            now = None
            if want <= 0:
                if not view:
                    self._why = "view=False"
                    return -1
                first = self._full_run(size)
                if first >= 0:
                    return first
                if not self._run_possible(size):
                    self._why = "every run held a rollout taken with get()"
                    return -1  # no run can fill: gather now
                if SLOT_LENT not in self._where:
                    self._why = "no run was ready in order, and no writer held a slot to complete one"
                    return -1  # no commit can arrive: gather now
                now = time.monotonic()
                if patience_end is None:
                    patience_end = now + max(RUN_PATIENCE, now - t_call)
                elif now >= patience_end:
                    self._why = "no run was ready in order within the patience"
                    return -1
                # A run is filling: the next one in order (after the last handed out) lacks this many.
                nxt = self._where[self._read_cursor : self._read_cursor + size]
                want = max(1, size - nxt.count(SLOT_READY)) if len(nxt) == size else 1
            if now is None:
                now = time.monotonic()
            wait = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - now)
            if wait <= 0:
                if want <= 0 or patience_end is not None:
                    self._why = "the timeout came with enough rollouts ready but no run ready in order"
                    return -1  # enough are ready: the deadline decides for a gather, not a timeout
                raise SlotTimeout(f"pipeline {self.name}: {self._asked(size)} got nothing within timeout={timeout} s; "
                                  f"{self._why_nothing()}")
            if patience_end is not None:
                wait = max(0.0, min(wait, patience_end - now))
            self._feed(need=want)  # about to wait: make sure the writers hold enough slots to send it
            if self._arm(want):
                self._disarm()
                continue  # something came in while we armed: take it in before sleeping
            try:
                self._doorbell.acquire(wait)
            except posix_ipc.BusyError:
                if wait >= WAIT_SLICE:
                    self._next_scan = 0.0  # quiet for a while: look for dead writers now
            finally:
                self._disarm()

    @staticmethod
    def _asked(size: int) -> str:
        return "get()" if size == 1 else f"get_batch({size})"

    def _holding(self) -> str:
        """What this reader holds, in words: the batch not released, and rollouts from get() not released."""
        in_batch = self._held_run[1] if self._held_run is not None else 0
        singles = self._held - in_batch
        parts = []
        if in_batch:
            parts.append(f"a batch of {in_batch} (until batch.release(), its with block, or the next get_batch)")
        if singles:
            parts.append(f"{singles} rollout{'s' if singles != 1 else ''} from get() not released")
        return f"holds {self._held} of its {self.slots} slots: " + " and ".join(parts) if parts else "holds no slot"

    def _why_nothing(self) -> str:
        """The end of a SlotTimeout's message: what the reader holds, and whether any writer ever came."""
        if not self._writers_seen:
            writers = ("no writer has attached yet (did the actor processes start? with spawn or forkserver, "
                       "the code that starts them must sit under `if __name__ == \"__main__\":`)")
        elif not self._lanes:
            died = f", {self._lanes_reclaimed} of them died" if self._lanes_reclaimed else ""
            writers = f"no writer is attached now ({self._writers_seen} came and left{died})"
        else:
            writers = f"{len(self._lanes)} writer{'s are' if len(self._lanes) != 1 else ' is'} attached"
        return f"this reader {self._holding()}; {writers}"

    def _arm(self, want: int) -> bool:
        """Ask the writers to ring once ``want`` more rollouts are in; True if some are already published.

        Only lanes holding slots can commit, and lane ``i`` can commit at most ``given_i`` before the
        reader lends again, so its quota is ``min(ceil(want / L), given_i)`` over the ``L`` lanes
        that hold any. Then ``want`` commits, however they are spread over those lanes, bring at
        least one lane to its quota: the reader wakes once per batch, and never waits out a slice
        for commits that did arrive.
        """
        holding = 0
        for lane in self._lanes.values():
            if lane.given > 0:
                holding += 1
        if not holding:
            return False
        quota = -(-want // holding)
        for lane in self._lanes.values():
            if lane.given > 0:
                lane.arm(min(quota, lane.given))
        self._sl_fence()  # our WAKE_AT stores before our loads of their heads: the writers' fence mirrors it
        # Anything published since the last look: take it in rather than sleep. (A lane at its quota must
        # not be slept on: it may have passed the quota before it saw our WAKE_AT, and not rung. Sleeping
        # on fewer commits than that was measured: a context switch costs more than a turn of the loop.)
        for lane in self._lanes.values():
            if lane.given > 0 and lane.ready.available():
                return True
        return False

    def _disarm(self) -> None:
        for lane in self._lanes.values():
            lane.disarm()

    def poll(self) -> int:
        """Serve the writers now, without waiting: take in commits and messages, lend free slots,
        notice writers that came, left or died. Return how many rollouts are ready.

        ``get`` and ``get_batch`` do this themselves. Call it when a writer runs
        in the reader's own thread (it gets its first slots here), or when the
        learner is busy for a while and writers should not wait on it.
        """
        self._guard()
        self._next_scan = 0.0
        self._poll()
        self._feed()
        return self._n_ready

    def _poll(self) -> None:
        w = self._w
        if w[W_NEWCOMER]:  # a writer took a lane: serve it now, not at the next periodic scan
            w[W_NEWCOMER] = 0
            self._next_scan = 0.0
        now = time.monotonic()
        if now >= self._next_scan:
            self._scan_lanes()
            self._next_scan = now + SCAN_INTERVAL
        corrupt = None
        for lane in self._lanes.values():
            try:
                slots = lane.take_commits()
            except SegmentError:
                corrupt = [lane] if corrupt is None else [*corrupt, lane]
                continue
            if slots is not None:
                self._accept(lane, slots)
            if lane.has_mail():
                self._read_mail(lane)
        if corrupt is not None:  # its counters are scribbled over: take the lane back, slots and all
            for lane in corrupt:
                self._reclaim(lane, died=True, corrupt=True)

    def _accept(self, lane: ReaderLane, raw: bytes) -> None:
        """Make ``lane``'s committed slots (``raw``: native int64s) ready, refusing any it was never lent
        (a bad message each)."""
        k = len(raw) // 8
        n = self.slots
        i = lane.index
        first = int.from_bytes(raw[:8], _BYTEORDER, signed=True)
        # The fast path, for a lane that behaves: a run of consecutive slots (slots are lent in
        # cyclic order, and a writer commits them in the order it took them), every one lent to it.
        if (0 <= first and first + k <= n and raw == self._count_bytes[8 * first : 8 * (first + k)]
                and self._where[first : first + k] == self._fill_bytes[SLOT_LENT][:k]
                and self._owner[first : first + k] == self._lane_mark(i)[:k]):
            run = slice(first, first + k)
            self._where[run] = self._fill_bytes[SLOT_READY][:k]
            # One number for the run: its slots are in commit order, so ties go by slot (argmin, a stable sort).
            self._arrived[run] = self._arrivals
            self._lane_of[run] = i
            self._pid_of[run] = lane.pid
            self._arrivals += k
            self._n_ready += k
            lane.given -= k
            return
        where, owner = self._where, self._owner
        for slot in np.frombuffer(raw, np.int64).tolist():  # one by one, refusing what is not the lane's to publish
            if not (0 <= slot < n) or where[slot] != SLOT_LENT or owner[slot] != i:
                self._bad_message()
                continue
            where[slot] = SLOT_READY
            self._arrived[slot] = self._arrivals
            self._lane_of[slot] = i
            self._pid_of[slot] = lane.pid
            self._arrivals += 1
            self._n_ready += 1
            lane.given -= 1

    def _lane_mark(self, i: int) -> bytes:
        """``slots`` bytes of value ``i``: what ``_owner`` holds over a run lent to lane ``i``."""
        mark = self._lane_bytes.get(i)
        if mark is None:
            mark = self._lane_bytes[i] = bytes([i]) * self.slots
        return mark

    def _deliver(self, slot: int) -> Rollout:
        w = self._w
        row = self._slot_table[slot]
        fill = {name: int(row[S_FILL + t]) for t, name in enumerate(self._ts_names)}
        commit_ns = int(row[S_COMMIT_NS])
        policy = int(row[S_POLICY])
        self._record(row[S_COMMIT_NS : S_COMMIT_NS + 1], row[S_POLICY : S_POLICY + 1])
        self._where[slot] = SLOT_HELD
        self._held += 1
        self._delivered += 1
        w[W_DELIVERED] = self._delivered
        return Rollout(self, slot, int(self._gen[slot]), int(self._lane_of[slot]), int(self._pid_of[slot]),
                       int(row[S_EPOCH]), int(row[S_SEQ]), commit_ns, policy, fill)

    # -- slots going back ---------------------------------------------------

    def _check_live(self, r: Rollout) -> None:
        if self._foreign:
            self._guard()
        if self._closed:
            raise StaleRollout(f"pipeline {self.name} is closed; rollout lane={r.lane} seq={r.seq} is gone")
        if self._gen[r.slot] != r.generation:
            raise StaleRollout(
                f"rollout lane={r.lane} seq={r.seq} was released; its slot {r.slot} now belongs to another rollout. "
                "Use rollout.copy() to keep data past release()."
            )

    def _generation_of(self, slot: int) -> int:
        return int(self._gen[slot])

    def _release(self, r: Rollout) -> None:
        self._check_live(r)
        self._release_run(r.slot, 1)  # stale handles to this slot fail to match from now on
        if self._where.count(SLOT_POOL) >= self._chunk():
            self._feed()

    def _chunk(self) -> int:
        """Slots are lent in chunks of this many (or all that are needed before the reader waits).

        A writer asleep for want of a slot costs a wake-up per lending; lending one slot at a time
        to a writer faster than its reader would pay that per rollout.
        """
        return max(1, min(16, self.slots // (2 * max(1, len(self._lanes)))))

    def _feed(self, need: int = 0) -> None:
        """Lend pool slots to the lanes, so that they never wait on the reader while it has slots to give.

        Once ``get_batch`` has said its size B (and there are no more lanes than B), slots go out a run
        at a time (see ``_feed_runs``): a run that completes is a zero-copy batch. Otherwise they go
        out in cyclic order, fewest-held lanes first, each lane keeping at most
        ``slots // (2 * lanes)`` untaken slots queued (and at least one), so that a writer that goes
        idle can hold only that many, and a writer that arrives later finds slots in the pool.
        Before the reader sleeps for ``need`` more commits it lends past those limits, from any slots,
        until the lanes hold ``need`` between them (writers asleep for want of a slot first): commits
        it waits for must be possible without it.
        """
        lanes = self._lanes
        if not lanes:
            return
        pool = self._where.count(SLOT_POOL)
        if not pool:
            return
        fed: list[ReaderLane] = []
        corrupt: list[ReaderLane] = []
        if self._run and len(lanes) <= self._run:
            pool -= self._feed_runs(need, fed, corrupt)
        else:
            order = sorted(lanes.values(), key=_given) if len(lanes) > 1 else lanes.values()
            depth = max(1, self.slots // (2 * len(lanes)))
            for lane in order:
                k = min(depth - lane.queued(), pool)
                if k > 0:
                    got = self._lend(lane, k, fed)
                    if got < 0:
                        corrupt.append(lane)
                    pool -= max(got, 0)
                if not pool:
                    break
        if need > 0 and pool:
            short = need
            for lane in lanes.values():
                short -= lane.given
            if short > 0:
                order = sorted(lanes.values(), key=_hungry)
                each = -(-short // len(order))
                for lane in order:
                    k = min(each, short, pool)
                    if k > 0:
                        got = self._lend(lane, k, fed)
                        if got > 0:
                            pool -= got
                            short -= got
        wake_waiting(fed, self._sl_fence)
        for lane in corrupt:
            if lane.index in self._lanes:
                self._reclaim(lane, died=True, corrupt=True)

    def _feed_runs(self, need: int, fed: list[ReaderLane], corrupt: list[ReaderLane]) -> int:
        """Lend whole runs of ``self._run`` slots, each to one lane that is short of slots (the one with
        fewest untaken first). Return how many slots were lent.

        A run lent to one lane in one piece is filled by that writer in its commit order, and it
        completes whatever the other writers do: a slow or idle writer delays only its own runs, and
        ``_in_order`` passes at its first test. A lane is short when it has fewer than ``depth``
        untaken (``slots // (2 * lanes)``, at least one); a lane that does not take its slots (an idle
        writer) stops getting any, so it holds at most one run. A run is opened only when all its
        slots are in the pool; when none is, a short lane gets pool slots in cyclic order, as before
        runs, so that no writer waits for a slot while the pool has one. Before the reader waits
        (``need``) every lane counts as short.
        """
        size = self._run
        lanes = list(self._lanes.values())
        depth = max(1, self.slots // (2 * len(lanes)))
        lent = 0
        for _ in range(self.slots // size + 1):  # each turn opens a run, or stops
            queued = {lane.index: lane.queued() for lane in lanes}
            short = sorted((lane for lane in lanes if queued[lane.index] < depth), key=lambda ln: queued[ln.index])
            if not short and sum(lane.given for lane in lanes) < need:
                short = sorted(lanes, key=_hungry)
            if not short:
                return lent
            lane = short[0]
            first = self._free_run(self._open_end)
            if first < 0:  # no whole run in the pool: the short lanes get what there is
                for lane in short:
                    if not self._where.count(SLOT_POOL):
                        break
                    got = self._lend(lane, max(1, depth - queued[lane.index]), fed)
                    if got < 0 and lane not in corrupt:
                        corrupt.append(lane)
                    lent += max(got, 0)
                return lent
            self._open_end = first + size
            self._cycle = (self._cycle + 1) & CYCLE_MASK
            if self._lend_span(lane, first, size, fed) < 0:
                if lane not in corrupt:
                    corrupt.append(lane)  # the run stays in the pool; _feed takes the lane back
                return lent
            lent += size
        return lent

    def _lend(self, lane: ReaderLane, k: int, fed: list[ReaderLane]) -> int:
        """Lend up to ``k`` pool slots to ``lane`` in cyclic order from the cursor, each stretch of consecutive
        ones with a cycle number of its own; return how many, or -1 if the lane's counters are corrupt."""
        where, n = self._where, self.slots
        lent, at = 0, self._cursor
        while lent < k:
            first = where.find(SLOT_POOL, at)
            if first < 0:
                first = where.find(SLOT_POOL)
                if first < 0:
                    break
            span = where[first : first + k - lent]
            m = len(span) - len(span.lstrip(b"\0"))  # pool slots in a row from ``first``
            self._cycle = (self._cycle + 1) & CYCLE_MASK
            got = self._lend_span(lane, first, m, fed)
            if got < 0:
                return -1 if not lent else lent
            lent += m
            at = first + m if first + m < n else 0
        self._cursor = at
        return lent

    def _lend_span(self, lane: ReaderLane, first: int, m: int, fed: list[ReaderLane]) -> int:
        """Lend pool slots ``first .. first + m - 1`` to ``lane``, marked with the current cycle; m, or -1 if the
        lane's counters are corrupt (nothing lent)."""
        try:
            lane.lend(self._count[first : first + m])
        except SegmentError:
            return -1
        self._where[first : first + m] = self._fill_bytes[SLOT_LENT][:m]
        self._owner[first : first + m] = self._lane_mark(lane.index)[:m]
        self._lent_in[4 * first : 4 * (first + m)] = self._cycle.to_bytes(4, "little") * m
        if lane not in fed:
            fed.append(lane)
        return m

    def _free_run(self, start: int) -> int:
        """The first slot of the next aligned run whose slots are all in the pool, from ``start`` round; or -1."""
        size = self._run
        where, run, top = self._where, self._fill_bytes[SLOT_POOL][:size], self.slots - self.slots % size
        for origin in ((start, 0) if start else (0,)):
            first = where.find(run, origin, top)
            while first >= 0 and first % size:
                first = where.find(run, first - first % size + size, top)
            if first >= 0:
                return first
        return -1

    # -- lanes: arrivals, departures, deaths --------------------------------

    def _scan_lanes(self) -> None:
        w = self._w
        changed = False
        for rec in self._records:
            st = w[rec.state]
            lane = self._lanes.get(rec.index)
            if st == LANE_ACTIVE:
                if lane is None:
                    self._adopt(rec)
                    changed = True
                elif not self._writer_alive(lane):
                    self._reclaim(lane, died=True)
            elif st == LANE_RETIRED:
                if lane is None:  # retired before we ever saw it: give it a view, then take it back
                    lane = self._adopt(rec)
                self._reclaim(lane, died=False)
        if changed:
            self._feed()
        w[W_READY_DEPTH] = self._n_ready  # gauges for `shmbuf ls`, refreshed at each scan
        w[W_POOL] = self._where.count(SLOT_POOL)

    def _adopt(self, rec: Record) -> ReaderLane:
        """A lane a writer took: the reader's view of it, counted (a timeout with none says no writer ever came)."""
        lane = self._lanes[rec.index] = ReaderLane(rec, self._w, self._wn, self._seg.mm, self._lane_sems[rec.index])
        self._writers_seen += 1
        return lane

    def _writer_alive(self, lane: ReaderLane) -> bool:
        """The lane's lock says (see ``_lane.lane_held``); pid and start time only where it cannot."""
        held = lane_held(self._seg.fd, lane.index)
        return alive(lane.pid, lane.start) if held is None else held

    def _reclaim(self, lane: ReaderLane, died: bool, corrupt: bool = False) -> None:
        """Take back a lane whose writer left, died, or scribbled over it: deliver what it committed,
        pool what it held. A corrupt lane's commits are not trusted: they go back to the pool too."""
        i = lane.index
        if not corrupt:
            if lane.has_mail():
                self._read_mail(lane)
            try:
                slots = lane.take_commits()
            except SegmentError:
                slots, corrupt = None, True
            if slots is not None:
                self._accept(lane, slots)
        # What the lane still holds is in its free ring, untaken, or in the writer's hands (a partial rollout).
        untaken = lane.untaken()
        mine = np.flatnonzero((self._wv == SLOT_LENT) & (self._ov == i))
        in_hand = [s for s in mine.tolist() if s not in untaken]
        w = self._w
        if died and in_hand:
            self._partial_dropped += len(in_hand)
            w[W_PARTIAL_DROPPED] = self._partial_dropped
        del self._lanes[i]
        self._wv[mine] = SLOT_POOL
        if corrupt:
            self._bad_message()
        if died:
            self._lanes_reclaimed += 1
            w[W_LANES_RECLAIMED] = self._lanes_reclaimed
        lane.free_lane(taken_back=corrupt)
        self._feed()

    # -- control messages ---------------------------------------------------

    def _read_mail(self, lane: ReaderLane) -> None:
        data = lane.take_mail(self._seg.mm, _control.MAX_PAYLOAD)
        try:
            if data is None:
                raise _control.BadMessage("malformed mailbox header")
            msg = _control.decode(data)
        except _control.BadMessage:
            self._bad_message()
            return
        mtype = msg["type"]
        if mtype == "stats":
            lane.stats = dict(msg["counters"])
        elif mtype == "error":
            self.errors.append(WriterError(
                f"writer on lane {lane.index} (pid {lane.pid}) raised {msg['exc_type']}: {msg['message']}",
                lane=lane.index, pid=lane.pid, kind=msg["exc_type"], remote_traceback=msg["traceback"],
            ))

    def _bad_message(self) -> None:
        self._bad_messages += 1
        self._w[W_BAD_MESSAGES] = self._bad_messages

    # -- views and buffers --------------------------------------------------

    def _tree(self, slot: int) -> dict[str, Any]:
        """New containers around the slot's (cached) leaf views."""
        leaves = self._slot_leaves.get(slot)
        if leaves is None:
            leaves = self._slot_leaves[slot] = [leaf_all[slot, ...] for leaf_all in self._leaf_all]
        return self._unflatten(leaves)

    def _unflatten(self, leaves: list[np.ndarray]) -> dict[str, Any]:
        """New containers, shaped like the example, around ``leaves`` (every leaf of every timescale, in order)."""
        out = {}
        for name, spec, first, keys in self._shapes:
            if keys is not None:  # a plain dict of leaves: its keys, in the example's order, and their leaves
                out[name] = {key: leaves[i] for key, i in keys}
            else:
                out[name] = optree.tree_unflatten(spec, leaves[first : first + spec.num_leaves])
        return out

    def _batch_buffer(self, b: int) -> list[np.ndarray]:
        bufs = self._batch_bufs.get(b)
        if bufs is None:
            bufs = self._batch_bufs[b] = [np.zeros((b, *lf.shape), lf.dtype) for lf in self.schema.leaves]
        return bufs

    def _record(self, commit_ns: np.ndarray, policy: np.ndarray) -> None:
        """Commit time and policy version of delivered rollouts, with the time and the learner's version at
        delivery, keeping the newest LATENCY_WINDOW (any count). Latency and lag are worked out in stats():
        here it is copies and stores only."""
        k = len(commit_ns)
        if k > LATENCY_WINDOW:
            commit_ns, policy = commit_ns[-LATENCY_WINDOW:], policy[-LATENCY_WINDOW:]
            self._lat_n += k - LATENCY_WINDOW
            k = LATENCY_WINDOW
        now = time.monotonic_ns()
        version = NO_VERSION if self.policy_version is None else self.policy_version
        start = self._lat_n % LATENCY_WINDOW
        n = min(k, LATENCY_WINDOW - start)  # up to the end of the window, then wrap to its start
        for at, part in ((slice(start, start + n), slice(0, n)), (slice(0, k - n), slice(n, k))):
            if part.start == part.stop:
                break
            self._commit[at] = commit_ns[part]
            self._policy[at] = policy[part]
            self._got[at] = now
            self._version[at] = version
        self._lat_n += k

    # -- introspection ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: rollouts and bytes delivered, queue depth, commit-to-get latency, losses."""
        if self._foreign:
            self._guard()
        w = self._w if not self._closed else None
        if w is not None:
            self._poll()
        n = min(self._lat_n, LATENCY_WINDOW)
        lat = (self._got[:n] - self._commit[:n]) / 1e3
        known = self._version[:n] != NO_VERSION
        lag = (self._version[:n] - self._policy[:n])[known] if n and self.policy_version is not None else None
        in_rings = sum(lane.ready.available() for lane in self._lanes.values()) if w is not None else 0
        return {
            "rollouts": self._delivered,
            "bytes": self._delivered * self._rollout_bytes,
            "ready_depth": self._n_ready + in_rings,
            "latency_us_p50": float(np.percentile(lat, 50)) if n else None,
            "latency_us_p99": float(np.percentile(lat, 99)) if n else None,
            # over the same window, when the learner sets reader.policy_version
            "policy_lag_mean": float(lag.mean()) if lag is not None and len(lag) else None,
            "policy_lag_max": int(lag.max()) if lag is not None and len(lag) else None,
            "partial_dropped": self._partial_dropped,
            "bad_messages": self._bad_messages,
            "lanes_reclaimed": self._lanes_reclaimed,
            "writers": len(self._lanes),
            # batches handed out as views of consecutive slots, and gathered (see Reader.get_batch)
            "batches": dict(self._batches),
            # why the gathered ones were gathered, counted: a zero-copy batch needs B ready slots in a run, in each
            # lane's order (mixing get() and get_batch() scatters the slots among the writers: see docs/design/reader.md)
            "gathered_why": dict(self._gathered_why),
            # every slot is in exactly one place: the pool, lent to a lane (being written, or
            # committed and not yet taken in), ready here, or held by the user (rollouts and a zero-copy batch)
            "slots": {
                "pool": self._where.count(SLOT_POOL),
                "lent": sum(lane.given for lane in self._lanes.values()),
                "ready": self._n_ready,
                "held": self._held,
            },
            "writer_stats": {lane.index: dict(lane.stats, label=lane.label, pid=lane.pid) for lane in self._lanes.values()},
        }

    # -- closing ------------------------------------------------------------

    def close(self) -> None:
        """Stop the pipeline (writers' next call raises PipelineClosed), unlink it, unmap it."""
        if self._closed:
            return
        self._closed = True
        if self._foreign:  # a forked copy: the pipeline is not ours to stop
            return
        self._finalizer()  # stop, wake every writer, unlink names: new attaches fail, current mappings stay valid
        for sem in self._sems:
            sem.close()
        self._sems = []
        self._slot_leaves = {}
        self._batch_bufs = {}
        self._leaf_all = []
        self._held_run = None
        for lane in self._lanes.values():
            lane.wn = None
        del self._slot_table, self._wn
        self._seg.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._lanes)} writers"
        return f"Reader({self.name!r}, slots={self.slots}, {state}, {self.schema!r})"


def _given(lane: ReaderLane) -> int:
    return lane.given



def _hungry(lane: ReaderLane) -> tuple[bool, int]:
    """Writers asleep for want of a slot first, then the lanes holding fewest."""
    return not lane.w[lane.rec.free_wait], lane.given


def _stop(words: memoryview, sems: list[posix_ipc.Semaphore], name: str, n_lanes: int, pid: int) -> None:
    """Close the pipeline for its writers and remove its names: ``close()``, or the finalizer of a Reader never closed.

    Writers see the closed word at their next call, and the posts wake those asleep for a slot or
    a lane now rather than at their next 0.1 s look.
    """
    if os.getpid() != pid:
        return
    try:
        words[W_CLOSED] = 1
        for sem in sems:
            sem.release()
    except (ValueError, posix_ipc.Error):
        pass  # already released by an earlier close: the names below are what is left to do
    unlink_all(name, n_lanes)
