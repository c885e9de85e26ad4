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

import collections
import os
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
    S_COMMIT_NS, S_FILL, S_POLICY, S_SEQ, W_BAD_MESSAGES, W_CLOSED, W_DELIVERED, W_LANES_RECLAIMED, W_NEWCOMER,
    W_PARTIAL_DROPPED, W_POOL, W_READY_DEPTH, Segment, sem_name, unlink_all,
)

# How often the reader looks at the lane table for writers that came, left or died.
SCAN_INTERVAL = 0.05
LATENCY_WINDOW = 8192
# Where each slot is, in the reader's own books (never in shared memory): its pool, lent to a lane
# (in the free ring, being written, or committed and not yet taken in), ready here, held by the user.
SLOT_POOL, SLOT_LANE, SLOT_READY, SLOT_HELD = 0, 1, 2, 3


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
    that must outlive the rollout. Each access to ``data`` builds new dicts
    (the arrays in them are the slot's views), so what you put into them is
    yours and never seen by the next rollout.

    Metadata: ``lane``, ``pid`` (the writer's), ``seq`` (per lane, from 0),
    ``commit_ns`` (``time.monotonic_ns()`` at commit), ``policy_version``,
    ``fill`` (timescale to how many ``add`` calls it got: a rollout cut
    short shows it here).
    """

    __slots__ = ("_reader", "slot", "generation", "lane", "pid", "seq", "commit_ns", "policy_version", "fill", "__weakref__")

    def __init__(self, reader: Reader, slot: int, generation: int, lane: int, pid: int, seq: int, commit_ns: int,
                 policy_version: int, fill: dict[str, int]):
        self._reader = reader
        self.slot = slot
        self.generation = generation
        self.lane = lane
        self.pid = pid
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
        return f"Rollout(lane={self.lane}, seq={self.seq}, pid={self.pid}, fill={self.fill}, slot={self.slot})"


class Batch:
    """``size`` rollouts gathered leaf by leaf into one buffer: ``data`` leaves have a leading dim ``size``.

    Lifetime: with ``copy=False`` the arrays are the reader's and are refilled
    by the next batch of the same size (the dicts holding them are this
    batch's own); with ``copy=True`` they are yours. The slots themselves
    were released as soon as they were copied.
    Metadata arrays, shape (size,): ``lane``, ``pid``, ``seq``,
    ``commit_ns``, ``policy_version``; ``fill`` maps timescale to counts.
    """

    __slots__ = ("data", "fill", "lane", "pid", "seq", "commit_ns", "policy_version", "size")

    def __init__(self, data: dict[str, Any], meta: np.ndarray, lane: np.ndarray, pid: np.ndarray, schema: Schema):
        self.data = data
        self.size = len(meta)
        self.lane = lane
        self.pid = pid
        # views of ``meta``, which was gathered for this batch alone
        self.seq = meta[:, S_SEQ]
        self.commit_ns = meta[:, S_COMMIT_NS]
        self.policy_version = meta[:, S_POLICY]
        self.fill = {ts.name: meta[:, S_FILL + t] for t, ts in enumerate(schema.timescales)}

    def __repr__(self) -> str:
        return f"Batch(size={self.size}, fill={ {k: v.tolist() for k, v in self.fill.items()} })"


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
        self._state = [SLOT_POOL] * n
        self._owner = [-1] * n
        self._gen = [0] * n
        self._lane_of = [-1] * n  # the lane a ready or held slot came from, and its writer's pid
        self._pid_of = [0] * n
        self._pool = list(range(n - 1, -1, -1))
        self._ready: collections.deque[int] = collections.deque()
        self._lanes: dict[int, ReaderLane] = {}
        self._next_scan = 0.0
        self._held = 0
        # The reader's counters, kept here and only stored to shared memory (for `shmbuf ls`): a
        # word another process scribbled over can neither overflow them nor make stats() lie.
        self._delivered = 0
        self._partial_dropped = 0
        self._bad_messages = 0
        self._lanes_reclaimed = 0
        self._leaf_all = [seg.leaf_view(i) for i in range(len(self.schema.leaves))]
        self._slot_table = np.ndarray((n, self._plan.slot_bytes // 8), np.int64, buffer=seg.mm, offset=self._plan.slots_off)
        self._slot_leaves: dict[int, list[np.ndarray]] = {}  # views of one slot's leaves; never the containers
        self._batch_bufs: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        self._lat = np.zeros(LATENCY_WINDOW, np.int64)
        self._lag = np.zeros(LATENCY_WINDOW, np.int64)  # policy lag of the same rollouts
        self._lat_n = 0
        self._ts_names = [ts.name for ts in self.schema.timescales]
        self._rollout_bytes = sum(lf.nbytes for lf in self.schema.leaves)
        self._w[W_POOL] = n
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
        """The next committed rollout, waiting up to ``timeout`` seconds (None: for ever).

        Raises:
            SlotTimeout: nothing arrived in time (a TimeoutError).
            WriterError: a writer reported an exception (``raise_writer_errors``).
            PipelineClosed: this reader was closed.
        """
        slot = self._next_slot(check_timeout(timeout, "get(timeout=...)"))
        return self._deliver(slot)

    def __iter__(self) -> Iterator[Rollout]:
        """Rollouts for ever, until the reader is closed; release each (or use ``with``)."""
        while not self._closed:
            yield self.get()

    def get_batch(self, batch_size: int, timeout: float | None = None, *, copy: bool = False) -> Batch:
        """Gather ``batch_size`` rollouts into one buffer (one copy per byte) and release their slots.

        Nothing is lost to an exception: slots taken before it are put back, in order, for the next call.
        """
        self._guard()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= self.slots:
            raise UsageError(f"get_batch(batch_size=...): expected an int from 1 to slots={self.slots}, got {batch_size!r}")
        timeout = check_timeout(timeout, "get_batch(timeout=...)")
        deadline = None if timeout is None else time.monotonic() + timeout
        idx, bufs = self._batch_buffer(batch_size)
        taken = 0
        ready = self._ready
        try:
            while taken < batch_size:
                if ready and not (self.errors and self.raise_writer_errors):
                    idx[taken] = ready.popleft()
                else:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    idx[taken] = self._next_slot(left, want=batch_size - taken)
                taken += 1
            for leaf_all, out in zip(self._leaf_all, bufs):
                # mode="clip": the indices are ours and in range; the default "raise" makes numpy gather
                # into a scratch buffer and copy again (measured here: 421 vs 91 us per atari rollout)
                leaf_all.take(idx, axis=0, out=out, mode="clip")
            meta = self._slot_table.take(idx, axis=0, mode="clip")
        except BaseException:
            for k in range(taken):  # put them back at the front, in order: nothing is lost
                ready.appendleft(int(idx[taken - 1 - k]))
            raise
        # The data is in the batch: from here on the slots go back whatever happens.
        slots = idx.tolist()
        lanes = np.array([self._lane_of[s] for s in slots], np.int64)
        pids = np.array([self._pid_of[s] for s in slots], np.int64)
        gen, state, pool = self._gen, self._state, self._pool
        for s in slots:  # _recycle, inline: this loop runs once per rollout
            gen[s] += 1
            state[s] = SLOT_POOL
            pool.append(s)
        self._feed()  # once for the batch: one wake-up per waiting writer, not one per slot
        self._delivered += batch_size
        self._w[W_DELIVERED] = self._delivered
        self._record(time.monotonic_ns() - meta[:, S_COMMIT_NS], meta[:, S_POLICY])
        leaves = [np.array(b) for b in bufs] if copy else bufs
        return Batch(self._unflatten(leaves), meta, lanes, pids, self.schema)

    def batches(self, batch_size: int, *, timeout: float | None = None, copy: bool = False) -> Iterator[Batch]:
        """Batches for ever (until closed). With ``copy=False`` each batch's arrays are valid until the next."""
        while not self._closed:
            yield self.get_batch(batch_size, timeout, copy=copy)

    def dataset_iter(self, batch_size: int, *, copy: bool = False) -> Iterator[Batch]:
        """echo-style name for :meth:`batches`: for users of ``Server.dataset_iter(copy=False)``."""
        return self.batches(batch_size, copy=copy)

    # -- the loop behind get ------------------------------------------------

    def _next_slot(self, timeout: float | None, want: int = 1) -> int:
        self._guard()
        if self.errors and self.raise_writer_errors:
            raise self.errors.pop(0)
        ready = self._ready
        if ready:
            return ready.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._poll()
            if self.errors and self.raise_writer_errors:
                raise self.errors.pop(0)
            # A batch waits for all it wants in one sleep, rather than waking for each rollout.
            if len(ready) >= want:
                return ready.popleft()
            wait = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
            if wait <= 0:
                if ready and want > 1:
                    return ready.popleft()  # the caller's deadline decides what a short batch means
                raise SlotTimeout(f"pipeline {self.name}: no rollout within timeout={timeout} s")
            missing = want - len(ready)
            self._feed(need=missing)  # about to wait: make sure the writers hold enough slots to send it
            if self._arm(missing):
                self._disarm()
                continue  # something came in while we armed: take it in before sleeping
            try:
                self._doorbell.acquire(wait)
            except posix_ipc.BusyError:
                self._next_scan = 0.0  # quiet for a while: look for dead writers now
            finally:
                self._disarm()

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
        if holding:
            quota = -(-want // holding)
            for lane in self._lanes.values():
                if lane.given > 0:
                    lane.arm(min(quota, lane.given))
        self._sl_fence()  # our WAKE_AT stores before our loads of their heads: the writers' fence mirrors it
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
        return len(self._ready)

    def _poll(self) -> None:
        now = time.monotonic()
        w = self._w
        if w[W_NEWCOMER]:  # a writer took a lane: serve it now, not at the next periodic scan
            w[W_NEWCOMER] = 0
            self._next_scan = 0.0
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
            if slots:
                self._accept_many(lane, slots)
            if lane.has_mail():
                self._read_mail(lane)
        if corrupt is not None:  # its counters are scribbled over: take the lane back, slots and all
            for lane in corrupt:
                self._reclaim(lane, died=True, corrupt=True)

    def _accept_many(self, lane: ReaderLane, slots: list[int]) -> None:
        state, owner, lane_of, pid_of, ready = self._state, self._owner, self._lane_of, self._pid_of, self._ready
        i, pid, n = lane.index, lane.pid, self.slots
        for slot in slots:
            if not (0 <= slot < n) or state[slot] != SLOT_LANE or owner[slot] != i:
                self._bad_message()  # a slot this lane never had: refuse it rather than deliver garbage
                continue
            state[slot] = SLOT_READY
            lane_of[slot] = i
            pid_of[slot] = pid
            lane.given -= 1
            ready.append(slot)

    def _deliver(self, slot: int) -> Rollout:
        w = self._w
        row = self._slot_table[slot]
        fill = {name: int(row[S_FILL + t]) for t, name in enumerate(self._ts_names)}
        commit_ns = int(row[S_COMMIT_NS])
        policy = int(row[S_POLICY])
        self._record(time.monotonic_ns() - row[S_COMMIT_NS : S_COMMIT_NS + 1], row[S_POLICY : S_POLICY + 1])
        self._state[slot] = SLOT_HELD
        self._held += 1
        self._delivered += 1
        w[W_DELIVERED] = self._delivered
        return Rollout(self, slot, self._gen[slot], self._lane_of[slot], self._pid_of[slot], int(row[S_SEQ]), commit_ns,
                       policy, fill)

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
        return self._gen[slot]

    def _release(self, r: Rollout) -> None:
        self._check_live(r)
        self._held -= 1
        self._gen[r.slot] += 1  # stale handles to this slot fail to match from now on
        self._state[r.slot] = SLOT_POOL
        self._pool.append(r.slot)
        if len(self._pool) >= self._chunk():
            self._feed()

    def _chunk(self) -> int:
        """Slots are lent in chunks of this many (or all that are needed before the reader waits).

        A writer asleep for want of a slot costs a wake-up per lending; lending one slot at a time
        to a writer faster than its reader would pay that per rollout.
        """
        return max(1, min(16, self.slots // (2 * max(1, len(self._lanes)))))

    def _feed(self, need: int = 0) -> None:
        """Lend pool slots, fewest-held lanes first, keeping each lane's free ring shallow.

        A lane gets at most ``slots // (2 * lanes)`` untaken slots queued (and at least one), so a
        writer that goes idle can hold only that many, and a writer that arrives later finds slots
        in the pool instead of waiting for rollouts to be released. Before the reader sleeps for
        ``need`` more commits it lends past that depth until the lanes hold ``need`` slots between
        them (writers asleep for want of a slot first): commits it waits for must be possible
        without it.
        """
        lanes, pool = self._lanes, self._pool
        if not lanes or not pool:
            return
        order = sorted(lanes.values(), key=_given) if len(lanes) > 1 else lanes.values()
        depth = max(1, self.slots // (2 * len(lanes)))
        fed: list[ReaderLane] = []
        corrupt = None
        for lane in order:
            k = min(depth - lane.queued(), len(pool))
            if k > 0 and not self._lend(lane, k, fed):
                corrupt = [lane] if corrupt is None else [*corrupt, lane]
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
                    k = min(each, short, len(pool))
                    if k > 0 and self._lend(lane, k, fed):
                        short -= k
        wake_waiting(fed, self._sl_fence)
        if corrupt is not None:
            for lane in corrupt:
                self._reclaim(lane, died=True, corrupt=True)

    def _lend(self, lane: ReaderLane, k: int, fed: list[ReaderLane]) -> bool:
        """Move ``k`` pool slots into ``lane``'s free ring; False if its counters are corrupt (nothing lent)."""
        pool = self._pool
        lent = pool[-k:]
        try:
            lane.lend(lent)
        except SegmentError:
            return False
        del pool[-k:]
        state, owner, i = self._state, self._owner, lane.index
        for slot in lent:
            state[slot] = SLOT_LANE
            owner[slot] = i
        if lane not in fed:
            fed.append(lane)
        return True

    # -- lanes: arrivals, departures, deaths --------------------------------

    def _scan_lanes(self) -> None:
        w = self._w
        changed = False
        for rec in self._records:
            st = w[rec.state]
            lane = self._lanes.get(rec.index)
            if st == LANE_ACTIVE:
                if lane is None:
                    self._lanes[rec.index] = ReaderLane(rec, w, self._seg.mm, self._lane_sems[rec.index])
                    changed = True
                elif not self._writer_alive(lane):
                    self._reclaim(lane, died=True)
            elif st == LANE_RETIRED:
                if lane is None:  # retired before we ever saw it: give it a view, then take it back
                    lane = self._lanes[rec.index] = ReaderLane(rec, w, self._seg.mm, self._lane_sems[rec.index])
                self._reclaim(lane, died=False)
        if changed:
            self._feed()
        w[W_READY_DEPTH] = len(self._ready)  # gauges for `shmbuf ls`, refreshed at each scan
        w[W_POOL] = len(self._pool)

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
                slots, corrupt = [], True
            self._accept_many(lane, slots)
        # What the lane still holds is in its free ring, untaken, or in the writer's hands (a partial rollout).
        untaken = lane.untaken()
        mine = [s for s in range(self.slots) if self._state[s] == SLOT_LANE and self._owner[s] == i]
        in_hand = [s for s in mine if s not in untaken]
        w = self._w
        if died and in_hand:
            self._partial_dropped += len(in_hand)
            w[W_PARTIAL_DROPPED] = self._partial_dropped
        del self._lanes[i]
        for s in mine:
            self._owner[s] = -1
            self._state[s] = SLOT_POOL
            self._pool.append(s)
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
        out, k = {}, 0
        for ts in self.schema.timescales:
            n = len(ts.leaves)
            out[ts.name] = optree.tree_unflatten(ts.treespec, leaves[k : k + n])
            k += n
        return out

    def _batch_buffer(self, b: int) -> tuple[np.ndarray, list[np.ndarray]]:
        buf = self._batch_bufs.get(b)
        if buf is None:
            bufs = [np.zeros((b, *lf.shape), lf.dtype) for lf in self.schema.leaves]
            buf = self._batch_bufs[b] = (np.zeros(b, np.intp), bufs)
        return buf

    def _record(self, ns: np.ndarray, policy: np.ndarray) -> None:
        """Latency and policy lag of delivered rollouts, keeping the newest LATENCY_WINDOW (any count)."""
        k = len(ns)
        if k > LATENCY_WINDOW:
            ns, policy = ns[-LATENCY_WINDOW:], policy[-LATENCY_WINDOW:]
            self._lat_n += k - LATENCY_WINDOW
            k = LATENCY_WINDOW
        start = self._lat_n % LATENCY_WINDOW
        n = min(k, LATENCY_WINDOW - start)  # up to the end of the window, then wrap to its start
        self._lat[start : start + n] = ns[:n]
        self._lat[: k - n] = ns[n:]
        if self.policy_version is not None:
            lag = self.policy_version - policy
            self._lag[start : start + n] = lag[:n]
            self._lag[: k - n] = lag[n:]
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
        lat = self._lat[:n] / 1e3
        in_rings = sum(lane.ready.available() for lane in self._lanes.values()) if w is not None else 0
        return {
            "rollouts": self._delivered,
            "bytes": self._delivered * self._rollout_bytes,
            "ready_depth": len(self._ready) + in_rings,
            "latency_us_p50": float(np.percentile(lat, 50)) if n else None,
            "latency_us_p99": float(np.percentile(lat, 99)) if n else None,
            # over the same window, when the learner sets reader.policy_version
            "policy_lag_mean": float(self._lag[:n].mean()) if n and self.policy_version is not None else None,
            "policy_lag_max": int(self._lag[:n].max()) if n and self.policy_version is not None else None,
            "partial_dropped": self._partial_dropped,
            "bad_messages": self._bad_messages,
            "lanes_reclaimed": self._lanes_reclaimed,
            "writers": len(self._lanes),
            # every slot is in exactly one place: the pool, lent to a lane (being written, or
            # committed and not yet taken in), ready here, or held by the user
            "slots": {
                "pool": len(self._pool),
                "lent": sum(lane.given for lane in self._lanes.values()),
                "ready": len(self._ready),
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
        del self._slot_table
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
