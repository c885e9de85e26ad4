"""The learner side: create a pipeline, receive rollouts as zero-copy views or gathered batches.

The reader owns the segment and every slot's bookkeeping: which slots sit in
its pool, which it lent to which lane, which are ready and which the user
holds. Writers never decide where a slot goes; they only consume the slots
the reader put in their lane's free ring, and publish them back on the ready
ring. So a writer that dies can only lose what its lane held, and the reader
knows exactly what that was.
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

from shmbuf import _control
from shmbuf._errors import PipelineClosed, SlotTimeout, StaleRollout, WriterError
from shmbuf._handle import Handle
from shmbuf._proc import alive
from shmbuf._ring import Consumer, Producer, fence, store_load_fence
from shmbuf._schema import Schema
from shmbuf._segment import (
    L_FREE_HEAD, L_FREE_TAIL, L_FREE_WAIT, L_LABEL, L_LABEL_LEN, LABEL_BYTES, L_PID, L_READY_HEAD, L_READY_TAIL, L_START, L_STATE, L_WAKE_AT, NEVER,
    LANE_ACTIVE, LANE_FREE, LANE_RETIRED, MAILBOX_PAYLOAD_OFF, S_COMMIT_NS, S_FILL,
    S_POLICY, S_SEQ, SLOT_HELD, SLOT_LANE, SLOT_POOL, SLOT_READY, W_BAD_MESSAGES, W_CLOSED,
    W_DELIVERED, W_LANES_RECLAIMED, W_NEWCOMER, W_PARTIAL_DROPPED, W_POOL, W_READY_DEPTH, Segment, sem_name,
    unlink_all,
)

# How often the reader looks at the lane table for writers that came, left or died.
SCAN_INTERVAL = 0.05
WAIT_SLICE = 0.1

LATENCY_WINDOW = 8192


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
    that must outlive the rollout.

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
        return self._reader._generation_of(self.slot) != self.generation

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.released:
            self.release()

    def __repr__(self) -> str:
        return f"Rollout(lane={self.lane}, seq={self.seq}, pid={self.pid}, fill={self.fill}, slot={self.slot})"


class Batch:
    """``size`` rollouts gathered leaf by leaf into one buffer: ``data`` leaves have a leading dim ``size``.

    Lifetime: with ``copy=False`` the buffer is the reader's and is refilled
    by the next batch of the same size; with ``copy=True`` it is yours. The
    slots themselves were released as soon as they were copied.
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


class _Lane:
    """The reader's private view of one active lane."""

    __slots__ = ("index", "ready", "free", "sem", "pid", "start", "label", "given", "stats", "mbox_word", "wake_word",
                 "free_wait_word", "free_tail_word")

    def __init__(self, index: int, ready: Consumer, free: Producer, sem: posix_ipc.Semaphore, pid: int, start: int,
                 mbox_word: int, lane_word: int):
        self.index = index
        self.mbox_word = mbox_word
        self.wake_word = lane_word + L_WAKE_AT  # the reader's: when to ring the doorbell
        self.free_wait_word = lane_word + L_FREE_WAIT  # the writer's: asleep for want of a slot
        self.free_tail_word = lane_word + L_FREE_TAIL  # the writer's: slots it took from its free ring
        self.ready = ready
        self.free = free
        self.sem = sem
        self.pid = pid
        self.start = start
        self.label = ""
        self.given = 0
        self.stats: dict[str, Any] = {}


class Reader:
    """The receiving end of a pipeline; made by :func:`create`, owner of the segment.

    Use it from one thread. Pickling it (e.g. passing it to a child process)
    sends only its :class:`Handle`; the child attaches a :class:`Writer` with it.
    ``close()`` stops the pipeline: every writer's next call raises
    :class:`PipelineClosed`, and the segment and its semaphores are unlinked.
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
        self._w = seg.words
        self._plan = seg.plan
        self._fence = fence()
        self._sl_fence = store_load_fence()
        self._sems: list[posix_ipc.Semaphore] = []
        # Unlink at exit or collection if the user never closes: the owner's duty, in the owner's process only.
        self._finalizer = weakref.finalize(self, _unlink_if_owner, self.name, self.max_writers, self._pid)
        self._doorbell = self._make_sem("r")
        self._lane_sems = [self._make_sem(f"f{i}") for i in range(self.max_writers)]
        n = self.slots
        self._state = [SLOT_POOL] * n
        self._owner = [-1] * n
        self._gen = [0] * n
        self._lane_of = [-1] * n  # the lane a ready or held slot came from, and its writer's pid
        self._pid_of = [0] * n
        self._slot_words = [self._plan.slot_word(i) for i in range(n)]
        self._pool = list(range(n - 1, -1, -1))
        self._ready: collections.deque[int] = collections.deque()
        self._lanes: dict[int, _Lane] = {}
        self._next_scan = 0.0
        self._held = 0
        self._delivered = 0
        self._leaf_all = [seg.leaf_view(i) for i in range(len(self.schema.leaves))]
        self._slot_table = np.ndarray((n, self._plan.slot_bytes // 8), np.int64, buffer=seg.mm, offset=self._plan.slots_off)
        self._trees: dict[int, dict[str, Any]] = {}
        self._batch_bufs: dict[int, tuple[np.ndarray, list[np.ndarray], dict[str, Any]]] = {}
        self._lat = np.zeros(LATENCY_WINDOW, np.int64)
        self._lag = np.zeros(LATENCY_WINDOW, np.int64)  # policy lag of the same rollouts
        self._lat_n = 0
        self._ts_names = [ts.name for ts in self.schema.timescales]
        self._rollout_bytes = sum(lf.nbytes for lf in self.schema.leaves)
        self._w[W_POOL] = n

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

    # -- receiving ----------------------------------------------------------

    def get(self, timeout: float | None = None) -> Rollout:
        """The next committed rollout, waiting up to ``timeout`` seconds (None: for ever).

        Raises:
            SlotTimeout: nothing arrived in time (a TimeoutError).
            WriterError: a writer reported an exception (``raise_writer_errors``).
            PipelineClosed: this reader was closed.
        """
        slot = self._next_slot(timeout)
        return self._deliver(slot)

    def __iter__(self) -> Iterator[Rollout]:
        """Rollouts for ever, until the reader is closed; release each (or use ``with``)."""
        while not self._closed:
            yield self.get()

    def get_batch(self, batch_size: int, timeout: float | None = None, *, copy: bool = False) -> Batch:
        """Gather ``batch_size`` rollouts into one buffer (one copy per byte) and release their slots."""
        if not isinstance(batch_size, int) or not 1 <= batch_size <= self.slots:
            raise ValueError(f"batch_size: expected an int from 1 to slots={self.slots}, got {batch_size!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        idx, bufs, tree = self._batch_buffer(batch_size)
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
        except BaseException:
            for k in range(taken):  # put them back at the front, in order: nothing is lost
                self._ready.appendleft(int(idx[taken - 1 - k]))
            raise
        for leaf_all, out in zip(self._leaf_all, bufs):
            # mode="clip": the indices are ours and in range; the default "raise" makes numpy gather
            # into a scratch buffer and copy again (measured here: 421 vs 91 us per atari rollout)
            leaf_all.take(idx, axis=0, out=out, mode="clip")
        meta = self._slot_table.take(idx, axis=0, mode="clip")
        slots = idx.tolist()
        lanes = np.array([self._lane_of[s] for s in slots], np.int64)
        pids = np.array([self._pid_of[s] for s in slots], np.int64)
        self._record_latencies(time.monotonic_ns() - meta[:, S_COMMIT_NS], meta[:, S_POLICY])
        gen, state, pool = self._gen, self._state, self._pool
        for s in slots:  # _recycle, inline: this loop runs once per rollout
            gen[s] += 1
            state[s] = SLOT_POOL
            pool.append(s)
        self._feed()  # once for the batch: one wake-up per waiting writer, not one per slot
        self._delivered += batch_size
        self._w[W_DELIVERED] = self._delivered
        data = optree.tree_map(np.array, tree) if copy else tree
        return Batch(data, meta, lanes, pids, self.schema)

    def batches(self, batch_size: int, *, timeout: float | None = None, copy: bool = False) -> Iterator[Batch]:
        """Batches for ever (until closed). With ``copy=False`` each batch is valid until the next."""
        while not self._closed:
            yield self.get_batch(batch_size, timeout, copy=copy)

    def dataset_iter(self, batch_size: int, *, copy: bool = False) -> Iterator[Batch]:
        """echo-style name for :meth:`batches`: for users of ``Server.dataset_iter(copy=False)``."""
        return self.batches(batch_size, copy=copy)

    # -- the loop behind get ------------------------------------------------

    def _next_slot(self, timeout: float | None, want: int = 1) -> int:
        if self._closed:
            raise PipelineClosed(f"pipeline {self.name} is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"this Reader belongs to process {self._pid}; in a child, attach a Writer with its handle")
        if self.errors and self.raise_writer_errors:
            raise self.errors.pop(0)
        if self._ready:
            return self._ready.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        ready = self._ready
        while True:
            self._poll()
            if self.errors and self.raise_writer_errors:
                raise self.errors.pop(0)
            # A batch waits for all it wants in one sleep, rather than waking for each rollout.
            if len(ready) >= want:
                return ready.popleft()
            if self._pool:
                self._feed()  # about to wait: top up the lanes first
            wait = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
            if wait <= 0:
                if ready and want > 1:
                    return ready.popleft()  # the caller's deadline decides what a short batch means
                raise SlotTimeout(f"pipeline {self.name}: no rollout within timeout={timeout} s")
            if self._arm(want - len(ready)) and len(ready) >= want:
                continue  # all we want came in while we armed: no sleep
            try:
                self._doorbell.acquire(wait)
            except posix_ipc.BusyError:
                self._next_scan = 0.0  # quiet for a while: look for dead writers now
            finally:
                self._disarm()

    def _arm(self, want: int) -> bool:
        """Ask the writers to ring once ``want`` more rollouts are in; True if some came in meanwhile.

        Each lane gets a quota of ceil(want / lanes): if the lanes together hold ``want``, one of
        them holds its quota, so the reader wakes once per batch rather than once per commit.
        """
        lanes = self._lanes
        if lanes:
            quota = -(-want // len(lanes))
            w = self._w
            for lane in lanes.values():
                w[lane.wake_word] = lane.ready.tail + quota
        self._sl_fence()  # our stores before our loads of the heads: the writers' fence mirrors it
        self._poll()
        return bool(self._ready)

    def _disarm(self) -> None:
        w = self._w
        for lane in self._lanes.values():
            w[lane.wake_word] = NEVER

    def poll(self) -> int:
        """Serve the writers now, without waiting: take in commits and messages, lend free slots,
        notice writers that came, left or died. Return how many rollouts are ready.

        ``get`` and ``get_batch`` do this themselves. Call it when a writer runs
        in the reader's own thread (it gets its first slots here), or when the
        learner is busy for a while and writers should not wait on it.
        """
        if self._closed:
            raise PipelineClosed(f"pipeline {self.name} is closed")
        self._next_scan = 0.0
        self._poll()
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
        for lane in self._lanes.values():
            n = lane.ready.available()
            if n:
                if self._fence:
                    self._fence()
                self._accept_many(lane, lane.ready.pop_many(n))
            mw = lane.mbox_word
            if w[mw + _control.M_POST] != w[mw + _control.M_ACK]:
                self._read_mail(lane)

    def _accept_many(self, lane: _Lane, slots: list[int]) -> None:
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
        sw = self._slot_words[slot]
        w = self._w
        fill = {name: w[sw + S_FILL + t] for t, name in enumerate(self._ts_names)}
        commit_ns = w[sw + S_COMMIT_NS]
        policy = w[sw + S_POLICY]
        self._record_latency(time.monotonic_ns() - commit_ns, policy)
        self._state[slot] = SLOT_HELD
        self._held += 1
        self._delivered += 1
        w[W_DELIVERED] = self._delivered
        return Rollout(self, slot, self._gen[slot], self._lane_of[slot], self._pid_of[slot], w[sw + S_SEQ], commit_ns,
                       policy, fill)

    # -- slots going back ---------------------------------------------------

    def _check_live(self, r: Rollout) -> None:
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
        self._recycle(r.slot)
        if len(self._pool) >= self._chunk():
            self._feed()

    def _chunk(self) -> int:
        """Slots are lent in chunks of this many (or all at once before the reader waits).

        A writer asleep for want of a slot costs a wake-up per lending; lending one slot at a time
        to a writer faster than its reader would pay that per rollout.
        """
        return max(1, min(16, self.slots // (2 * max(1, len(self._lanes)))))

    def _recycle(self, slot: int) -> None:
        """Back to the pool with a new generation (which stale handles fail to match); the caller decides when to lend."""
        self._gen[slot] += 1
        self._state[slot] = SLOT_POOL
        self._pool.append(slot)

    def _feed(self) -> None:
        """Lend pool slots, fewest-held lanes first, keeping each lane's free ring shallow.

        A lane gets at most ``slots // (2 * lanes)`` untaken slots queued (and at least one), so a
        writer that goes idle can hold only that many, and a writer that arrives later finds slots
        in the pool instead of waiting for rollouts to be released.
        """
        lanes = self._lanes
        pool = self._pool
        if not lanes or not pool:
            return
        depth = max(1, self.slots // (2 * len(lanes)))
        w = self._w
        fed = []
        for lane in sorted(lanes.values(), key=_given) if len(lanes) > 1 else lanes.values():
            queued = lane.free.head - w[lane.free_tail_word]
            if queued >= depth:
                continue
            k = min(depth - queued, len(pool))
            lent = pool[-k:]
            del pool[-k:]
            state, owner, i = self._state, self._owner, lane.index
            for slot in lent:
                state[slot] = SLOT_LANE
                owner[slot] = i
            lane.given += k
            lane.free.push_many(lent)
            fed.append(lane)
            if not pool:
                break
        # Wake only a writer that sleeps for want of a slot, once, after every entry is in its ring.
        # Our fence orders the head stores before the flag loads; the writer's orders its flag
        # store before its head load (see Writer._wait_for_slot).
        if fed:
            self._sl_fence()
            for lane in fed:
                if w[lane.free_wait_word]:
                    lane.sem.release()

    # -- lanes: arrivals, departures, deaths --------------------------------

    def _scan_lanes(self) -> None:
        w, p = self._w, self._plan
        changed = False
        for i in range(p.n_lanes):
            lw = p.lane_word(i)
            st = w[lw + L_STATE]
            lane = self._lanes.get(i)
            if st == LANE_ACTIVE:
                if lane is None:
                    self._lanes[i] = self._new_lane(i)
                    changed = True
                elif not alive(lane.pid, lane.start):
                    self._reclaim(lane, died=True)
            elif st == LANE_RETIRED:
                if lane is None:  # retired before we ever saw it: give it a view, then take it back
                    lane = self._lanes[i] = self._new_lane(i)
                self._reclaim(lane, died=False)
        if changed:
            self._feed()
        self._w[W_READY_DEPTH] = len(self._ready)  # gauges for `shmbuf ls`, refreshed at each scan
        self._w[W_POOL] = len(self._pool)

    def _new_lane(self, i: int) -> _Lane:
        w, p = self._w, self._plan
        lw = p.lane_word(i)
        lane = _Lane(
            i,
            Consumer(w, p.ready_ring_word(i), p.n_slots, lw + L_READY_HEAD, lw + L_READY_TAIL),
            Producer(w, p.free_ring_word(i), p.n_slots, lw + L_FREE_HEAD, lw + L_FREE_TAIL),
            self._lane_sems[i], w[lw + L_PID], w[lw + L_START], p.mbox_off_of(i) // 8, lw,
        )
        lane.label = read_label(self._seg.mm, w, lw)
        return lane

    def _reclaim(self, lane: _Lane, died: bool) -> None:
        """Take back a lane whose writer left or died: deliver what it committed, pool what it held."""
        w, p = self._w, self._plan
        i = lane.index
        lw = p.lane_word(i)
        mw = p.mbox_off_of(i) // 8
        if w[mw + _control.M_POST] != w[mw + _control.M_ACK]:
            self._read_mail(lane)
        n = lane.ready.available()
        if n:
            if self._fence:
                self._fence()
            self._accept_many(lane, lane.ready.pop_many(n))
        # What the lane still holds is in its free ring, untaken, or in the writer's hands (a partial rollout).
        tail, head = w[lw + L_FREE_TAIL], w[lw + L_FREE_HEAD]
        untaken = {w[p.free_ring_word(i) + k % p.n_slots] for k in range(tail, head)} if 0 <= head - tail <= p.n_slots else set()
        in_hand = [s for s in range(self.slots) if self._state[s] == SLOT_LANE and self._owner[s] == i and s not in untaken]
        if died and in_hand:
            w[W_PARTIAL_DROPPED] = w[W_PARTIAL_DROPPED] + len(in_hand)
        del self._lanes[i]
        for s in range(self.slots):
            if self._state[s] == SLOT_LANE and self._owner[s] == i:
                self._owner[s] = -1
                self._state[s] = SLOT_POOL
                self._pool.append(s)
        while True:  # drain posts the writer never took
            try:
                lane.sem.acquire(0)
            except posix_ipc.BusyError:
                break
        for word in (L_READY_HEAD, L_READY_TAIL, L_FREE_HEAD, L_FREE_TAIL, L_FREE_WAIT, L_PID, L_START, L_WAKE_AT,
                     L_LABEL_LEN):
            w[lw + word] = 0
        w[mw + _control.M_POST] = 0
        w[mw + _control.M_ACK] = 0
        if died:
            w[W_LANES_RECLAIMED] = w[W_LANES_RECLAIMED] + 1
        w[lw + L_STATE] = LANE_FREE  # last: only now may a new writer take the lane
        self._feed()

    # -- control messages ---------------------------------------------------

    def _read_mail(self, lane: _Lane) -> None:
        w = self._w
        base = self._plan.mbox_off_of(lane.index)
        mw = base // 8
        post = w[mw + _control.M_POST]
        length = w[mw + _control.M_LEN]
        magic = w[mw + _control.M_MAGIC]
        if self._fence:
            self._fence()
        try:
            if magic != _control.MSG_MAGIC:
                raise _control.BadMessage(f"bad magic {magic:#x}")
            if not 0 < length <= _control.MAX_PAYLOAD:
                raise _control.BadMessage(f"length {length} outside 1..{_control.MAX_PAYLOAD}")
            off = base + MAILBOX_PAYLOAD_OFF
            msg = _control.decode(bytes(self._seg.mm[off : off + length]))
        except _control.BadMessage:
            self._bad_message()
            msg = None
        w[mw + _control.M_ACK] = post
        if msg is None:
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
        self._w[W_BAD_MESSAGES] = self._w[W_BAD_MESSAGES] + 1

    # -- views and buffers --------------------------------------------------

    def _tree(self, slot: int) -> dict[str, Any]:
        tree = self._trees.get(slot)
        if tree is None:
            leaves = iter(self._leaf_all)
            tree = self._trees[slot] = {
                ts.name: optree.tree_unflatten(ts.treespec, [next(leaves)[slot, ...] for _ in ts.leaves])
                for ts in self.schema.timescales
            }
        return tree

    def _batch_buffer(self, b: int) -> tuple[np.ndarray, list[np.ndarray], dict[str, Any]]:
        buf = self._batch_bufs.get(b)
        if buf is None:
            tree = self.schema.zeros((b,))
            bufs = [leaf for ts in self.schema.timescales for leaf in optree.tree_leaves(tree[ts.name])]
            buf = self._batch_bufs[b] = (np.zeros(b, np.intp), bufs, tree)
        return buf

    def _record_latency(self, ns: int, policy: int) -> None:
        i = self._lat_n % LATENCY_WINDOW
        self._lat[i] = ns
        if self.policy_version is not None:
            self._lag[i] = self.policy_version - policy
        self._lat_n += 1

    def _record_latencies(self, ns: np.ndarray, policy: np.ndarray) -> None:
        start = self._lat_n % LATENCY_WINDOW
        n = min(len(ns), LATENCY_WINDOW - start)
        self._lat[start : start + n] = ns[:n]
        self._lat[: len(ns) - n] = ns[n:]
        if self.policy_version is not None:
            lag = self.policy_version - policy
            self._lag[start : start + n] = lag[:n]
            self._lag[: len(ns) - n] = lag[n:]
        self._lat_n += len(ns)

    # -- introspection ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: rollouts and bytes delivered, queue depth, commit-to-get latency, losses."""
        w = self._w
        if not self._closed:
            self._poll()
        n = min(self._lat_n, LATENCY_WINDOW)
        lat = self._lat[:n] / 1e3
        in_rings = sum(lane.ready.available() for lane in self._lanes.values()) if not self._closed else 0
        return {
            "rollouts": self._delivered,
            "bytes": self._delivered * self._rollout_bytes,
            "ready_depth": len(self._ready) + in_rings,
            "latency_us_p50": float(np.percentile(lat, 50)) if n else None,
            "latency_us_p99": float(np.percentile(lat, 99)) if n else None,
            # over the same window, when the learner sets reader.policy_version
            "policy_lag_mean": float(self._lag[:n].mean()) if n and self.policy_version is not None else None,
            "policy_lag_max": int(self._lag[:n].max()) if n and self.policy_version is not None else None,
            "partial_dropped": w[W_PARTIAL_DROPPED],
            "bad_messages": w[W_BAD_MESSAGES],
            "lanes_reclaimed": w[W_LANES_RECLAIMED],
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
        if os.getpid() != self._pid:  # a forked copy: the pipeline is not ours to stop
            return
        self._w[W_CLOSED] = 1
        for sem in self._lane_sems:  # wake writers waiting for a slot, so they see the flag now
            sem.release()
        self._doorbell.release()
        self._finalizer()  # unlink names: new attaches fail, current mappings stay valid
        for sem in self._sems:
            sem.close()
        self._sems = []
        self._trees = {}
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


def read_label(mm: Any, w: memoryview, lane_word: int) -> str:
    """A writer's label from its lane record, its length clamped: the bytes are the writer's, not trusted."""
    n = min(max(w[lane_word + L_LABEL_LEN], 0), LABEL_BYTES)
    off = (lane_word + L_LABEL) * 8
    return bytes(mm[off : off + n]).decode(errors="replace")


def _given(lane: _Lane) -> int:
    return lane.given


def _unlink_if_owner(name: str, n_lanes: int, pid: int) -> None:
    if os.getpid() == pid:
        unlink_all(name, n_lanes)
