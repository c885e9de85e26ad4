"""The learner side: create a pipeline, receive rollouts as zero-copy views or gathered batches.

The reader owns the segment and every slot's bookkeeping: which slots sit in
its pool, which it lent to which lane, which are ready and which the user
holds. Writers never decide where a slot goes; they only consume the slots
the reader put in their lane's free ring, and publish them back on the ready
ring. So a writer that dies can only lose what its lane held, and the reader
knows exactly what that was.

:class:`Reader` is the public face and the wait behind ``get`` and ``get_batch``; it holds its parts: the slot
books (:mod:`shmbuf._books`), the hand-out (:mod:`shmbuf._handout`: what goes out, as views, gathered or not
yet, and building it), the lender (:mod:`shmbuf._lending`), the roster of lanes (:mod:`shmbuf._roster`, on
:mod:`shmbuf._lane`'s protocol), the mail (:mod:`shmbuf._mail`) and the latency window
(:mod:`shmbuf._latency`); the words of a wait that cannot be served are :mod:`shmbuf._reader_text`'s. What it
hands out, :class:`Rollout` and :class:`Batch`, and the loan they hold instead of the reader, are in
:mod:`shmbuf._rollout`.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import posix_ipc

from shmbuf import _fork
from shmbuf._books import SlotBooks
from shmbuf._closable import Closable
from shmbuf._errors import PipelineClosed, SlotTimeout, UsageError, WriterError
from shmbuf._handle import Handle
from shmbuf._handout import GATHER, NEVER, TIMEOUT, VIEWS, Decision, Handout, decide, never
from shmbuf._janitor import keeping
from shmbuf._lane import WAIT_SLICE
from shmbuf._latency import LatencyWindow
from shmbuf._lending import Lender
from shmbuf._mail import Mail
from shmbuf._reader_text import asked, holding, why_nothing
from shmbuf._ring import store_load_fence
from shmbuf._rollout import Batch, Rollout, forked_copy
from shmbuf._roster import Roster
from shmbuf._schema import Schema
from shmbuf._segment import W_CLOSED, W_NEWCOMER, W_POOL, Segment, sem_name, unlink_all
from shmbuf._sem import Sem, UseLock
from shmbuf._validate import timeout_setting

# How often the reader looks at the lane table for writers that came, left or died.
SCAN_INTERVAL = 0.05


def create(example: Any, slots: int, *, max_writers: int = 16, raise_writer_errors: bool = True,
           keep_on_crash: bool = False) -> Reader:
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
        keep_on_crash: if this process dies without closing, leave the segment for
            ``shmbuf ls`` (its watcher removes it within 1 s otherwise; docs/reliability.md).

    The segment is created owner-only (0600), its space reserved and its
    pages faulted in now; a /dev/shm too small fails here with the sizes.
    """
    schema = Schema.from_example(example)
    seg = Segment.create(schema, slots, max_writers, keep=keeping(keep_on_crash))
    try:
        return Reader(seg, raise_writer_errors=raise_writer_errors)
    except BaseException:
        seg.close()
        seg.unlink()
        raise


class Reader(Closable):
    """The receiving end of a pipeline; made by :func:`create`, owner of the segment.

    Use it from one thread. Pickling it (e.g. passing it to a child process)
    sends only its :class:`Handle`; the child attaches a :class:`Writer` with it.
    ``close()`` stops the pipeline: every writer's next call raises
    :class:`PipelineClosed`, and the segment and its semaphores are unlinked.
    A Reader that is garbage-collected (or still open at exit) without
    ``close()`` stops the pipeline the same way (the one lifetime mechanism of
    :class:`shmbuf._closable.Closable`). ``unlink()`` removes the names alone,
    at once: writers attached keep going, new ones cannot attach.
    """

    _kind = "pipeline"

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
        self._max_lag: int | None = None  # see max_policy_lag
        self._pid = os.getpid()
        self._closed = False
        self._foreign = False
        self._w = seg.words
        self._plan = seg.plan
        self._sl_fence = store_load_fence()
        self._use = UseLock()  # a close from another thread, under get's wait (shmbuf._sem)
        self._sems: list[Sem] = []  # filled one by one: a failure leaves what was made for create() to unlink
        for role in ["r", *(f"f{i}" for i in range(self.max_writers))]:
            self._sems.append(Sem.create(sem_name(self.name, role), f"pipeline {self.name}"))
        self._doorbell, *lane_sems = self._sems
        # Stop the pipeline at collection or exit if the user never closes: the owner's duty, in the owner's process only.
        self._lifetime(_stop, seg.words, list(self._sems), self.name, self.max_writers, self._pid,
                       unlink=functools.partial(unlink_all, self.name, self.max_writers))
        # The parts (see "Where it lives" in docs/design/reader.md): where each slot is; the mail; the lanes
        # and what comes in from them; lending; the latency of what was delivered; the hand-out (what goes out,
        # and the loan its rollouts and batches hold).
        self._books = SlotBooks(self.slots)
        self._mail = Mail(seg.words, seg.mm, self.errors)
        self._lender = Lender(self._books, self._sl_fence)
        self._roster = Roster(seg, self._books, self._mail, self._lender, lane_sems, self._sl_fence)
        self._latency = LatencyWindow()
        self._handout = Handout(seg, self._books, self._latency, self._roster.feed, self._lender.chunk)
        self._next_scan = 0.0
        self._rollout_bytes = sum(lf.nbytes for lf in self.schema.leaves)
        self._w[W_POOL] = self.slots  # every slot starts in the pool (`shmbuf ls` reads this)
        _fork.track(self)

    @property
    def max_policy_lag(self) -> int | None:
        """The oldest rollouts this reader hands out: with ``policy_version`` set, a ready rollout committed with a
        version below ``policy_version - max_policy_lag`` is given back to the writers unread (its slot is free
        again; ``stats()["stale_dropped"]`` counts them), so every rollout ``get`` and ``get_batch`` hand out has
        a lag of at most this. None (the default): every rollout goes out, whatever its version."""
        return self._max_lag

    @max_policy_lag.setter
    def max_policy_lag(self, lag: int | None) -> None:
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise UsageError(f"max_policy_lag: expected None or an int >= 0 (policy versions), got {lag!r}")
        self._max_lag = lag
        self._lender.spread = lag is not None  # each batch's run spread over the writers (shmbuf._lending)

    @property
    def stale_dropped(self) -> int:
        """Ready rollouts given back unread as older than ``max_policy_lag`` allowed (also in ``stats()``)."""
        return self._handout.stale_dropped

    @property
    def handle(self) -> Handle:
        """A picklable reference (the name) for other processes: ``Writer(reader.handle)``."""
        return Handle(self.name)

    def __reduce__(self) -> Any:
        return (Handle, (self.name,))

    def _after_fork_in_child(self) -> None:
        self._foreign = True
        self._handout.loan.foreign = True

    def _guard(self) -> None:
        if self._foreign:
            raise forked_copy(self._pid)
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
            PipelineClosed: this reader was closed (by another thread too, while this waited).
        """
        timeout = timeout_setting("get(timeout=...)", timeout)
        with self._use:
            self._guard()
            self._await(1, False, None if timeout is None else time.monotonic() + timeout, timeout)
            return self._handout.rollout(self._books.take_oldest(), self.policy_version)

    def __iter__(self) -> Iterator[Rollout]:
        """Rollouts for ever, until the reader is closed; release each (or use ``with``)."""
        while not self._closed:
            yield self.get()

    def get_batch(self, batch_size: int, timeout: float | None = None, *, copy: bool = False,
                  zero_copy: bool = True, view: bool | None = None) -> Batch:
        """``batch_size`` rollouts, each leaf ``(batch_size, ...)``: zero-copy where they sit in consecutive slots.

        Args:
            batch_size: from 1 to ``slots``.
            timeout: seconds to wait for the batch (None: for ever); :class:`SlotTimeout` after that.
            copy: give the batch arrays of its own (one copy), never stale; its slots go back at once.
            zero_copy: True (the default): views of shared memory when ``batch_size`` ready rollouts fill
                one aligned run of slots (``k * batch_size`` to ``k * batch_size + batch_size - 1``)
                and handing them out keeps every lane's commit order; else gathered with one copy per
                byte (``batch.zero_copy`` says which). False: always gathered.
            view: the old name of ``zero_copy`` (deprecated: "view" names numpy views and trajectory views).

        The batch this reader handed out before is released first (see :class:`Batch` for the
        lifetime). Rollouts from :meth:`get` that are not released still hold their slots: if they
        leave the writers fewer than ``batch_size``, this raises UsageError at once. Nothing is lost
        to an exception: until the batch is built, its rollouts stay
        ready for the next call.
        """
        self._guard()
        # Not _validate.int_setting: this message names the bound as slots=N, and callers match on it.
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= self.slots:
            raise UsageError(f"get_batch(batch_size=...): expected an int from 1 to slots={self.slots}, got {batch_size!r}")
        if view is not None:
            warnings.warn("get_batch(view=...) is now get_batch(zero_copy=...) (CHANGELOG.md)", DeprecationWarning,
                          stacklevel=2)
            if zero_copy is not True and zero_copy != view:  # zero_copy=False given beside view=True: say so
                raise UsageError(f"get_batch: zero_copy={zero_copy!r} and its old name view={view!r} disagree; "
                                 "pass zero_copy= alone")
            zero_copy = view
        if zero_copy is not True and zero_copy is not False:
            raise UsageError(f"get_batch(zero_copy=...): expected True (views where the rollouts sit in a run of slots) "
                             f"or False (always gathered), got {zero_copy!r}")
        timeout = timeout_setting("get_batch(timeout=...)", timeout)
        with self._use:
            self._guard()  # again: closed by another thread since the first look
            if zero_copy and batch_size != self._lender.run:
                self._lender.batch_size(batch_size)  # lend runs of this size from here on
            handout = self._handout
            handout.loan.end_batch()
            d = self._await(batch_size, zero_copy, None if timeout is None else time.monotonic() + timeout, timeout)
            # From here to the return nothing waits or calls out: the slots change hands in one piece.
            if d.act == VIEWS:
                return handout.views(d.first, batch_size, copy, self.policy_version)
            return handout.gather(batch_size, copy, d.why, self.policy_version)

    def batches(self, batch_size: int, *, timeout: float | None = None, copy: bool = False,
                zero_copy: bool = True) -> Iterator[Batch]:
        """Batches for ever (until closed); each is released when the next is taken (see :class:`Batch`)."""
        while not self._closed:
            yield self.get_batch(batch_size, timeout, copy=copy, zero_copy=zero_copy)

    def dataset_iter(self, batch_size: int, *, copy: bool = False) -> Iterator[Batch]:
        """echo-style name for :meth:`batches`: for users of ``Server.dataset_iter(copy=False)``."""
        return self.batches(batch_size, copy=copy)

    # -- the wait behind get and get_batch ------------------------------------

    def _await(self, size: int, zero_copy: bool, deadline: float | None, timeout: float | None) -> Decision:
        """Serve the writers and sleep until ``size`` rollouts can be handed out; return how (VIEWS or GATHER).

        What goes out, and when to stop waiting, is :func:`shmbuf._handout.decide`'s, from the books: this
        loop takes in what the writers sent, raises what the decision cannot serve, lends what a wait needs,
        and sleeps on the doorbell. ``zero_copy``: as in :meth:`get_batch` (``get`` passes False).
        """
        books, handout, roster = self._books, self._handout, self._roster
        since = time.monotonic()
        patience_end, seen, patience = None, -1, 0.0
        if never(books, size):
            raise self._never(size)
        while True:
            self._poll()
            if self.errors and self.raise_writer_errors:
                raise self.errors.pop(0)
            if self._max_lag is not None and self.policy_version is not None and books.n_ready:
                if handout.drop_stale(self.policy_version - self._max_lag):
                    roster.feed()  # the writers may have waited for those slots
            now = time.monotonic()
            d = decide(books, size, zero_copy=zero_copy, cursor=handout.cursor, now=now, since=since,
                       deadline=deadline, patience_end=patience_end, head=handout.head,
                       seen=seen if self._lender.runs_for_all() else -1, patience=patience)
            handout.head = d.head
            act = d.act
            if act == VIEWS or act == GATHER:
                return d
            if act == TIMEOUT:
                raise SlotTimeout(f"pipeline {self.name}: {asked(size)} got nothing within timeout={timeout} s; "
                                  f"{why_nothing(roster, holding(books.held, handout.loan.held_run, self.slots))}")
            if act == NEVER:
                raise self._never(size)
            patience_end, seen, patience = d.patience_end, d.seen, d.patience
            # About to wait: make sure the writers hold enough slots to send it (for rollouts it lacks, not a run:
            # lacking, so that a writer with nothing queued gets slots the pool keeps for runs).
            roster.feed(need=d.want, lacking=d.patience_end is None)
            if roster.arm(d.want):
                roster.disarm()
                continue  # something came in while we armed: take it in before sleeping
            woke = self._use.sleep(self._doorbell, d.sleep)
            if self._closed:  # by another thread, while we slept: nothing of ours is left to touch
                raise PipelineClosed(f"pipeline {self.name} was closed while this waited")
            roster.disarm()
            if not woke and d.sleep >= WAIT_SLICE:
                self._next_scan = 0.0  # quiet for a while: look for dead writers now

    def _never(self, size: int) -> UsageError:
        held = self._books.held
        return UsageError(f"pipeline {self.name}: {asked(size)} can never be served: this reader itself "
                          f"{holding(held, self._handout.loan.held_run, self.slots)}, so the writers can fill at most "
                          f"{self.slots - held} of its {self.slots} slots. Release what you hold first "
                          "(batch.release(), rollout.release(), or a with block), or copy what must outlive it "
                          "(rollout.copy(), get_batch(copy=True))")

    def poll(self) -> int:
        """Serve the writers now, without waiting: take in commits and messages, lend free slots,
        notice writers that came, left or died. Return how many rollouts are ready.

        ``get`` and ``get_batch`` do this themselves. Call it when a writer runs
        in the reader's own thread (it gets its first slots here), or when the
        learner is busy for a while and writers should not wait on it. It lends
        every free slot, parts of runs too, which ``get_batch`` keeps back until
        their run is whole (docs/design/reader.md, "Making runs").
        """
        self._guard()
        self._next_scan = 0.0
        self._poll()
        self._roster.feed(mend=True)  # parts of runs too: a writer in this thread cannot wait for the next get_batch
        return self._books.n_ready

    def _poll(self) -> None:
        w = self._w
        if w[W_NEWCOMER]:  # a writer took a lane: serve it now, not at the next periodic scan
            w[W_NEWCOMER] = 0
            self._next_scan = 0.0
        now = time.monotonic()
        if now >= self._next_scan:
            self._roster.scan()
            self._next_scan = now + SCAN_INTERVAL
        self._roster.take_in()

    # -- introspection ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: rollouts and bytes delivered, queue depth, commit-to-get latency, losses."""
        if self._foreign:
            self._guard()
        w = self._w if not self._closed else None
        if w is not None:
            self._poll()
        books, roster, handout = self._books, self._roster, self._handout
        in_rings = sum(lane.ready.available() for lane in roster.lanes.values()) if w is not None else 0
        return {
            "rollouts": handout.delivered,
            "bytes": handout.delivered * self._rollout_bytes,
            "ready_depth": books.n_ready + in_rings,
            # latency_us_p50/p99, and policy_lag_mean/max when the learner sets reader.policy_version
            **self._latency.summary(self.policy_version),
            "partial_dropped": roster.partial_dropped,
            # ready rollouts given back unread, older than max_policy_lag allowed
            "stale_dropped": self.stale_dropped,
            "bad_messages": self._mail.bad_messages,
            "lanes_reclaimed": roster.lanes_reclaimed,
            "writers": len(roster.lanes),
            # batches handed out as views of consecutive slots, and gathered (see Reader.get_batch)
            "batches": dict(handout.batches),
            # why the gathered ones were gathered, counted: a zero-copy batch needs B ready slots in a run, in each
            # lane's order (mixing get() and get_batch() scatters the slots among the writers: see docs/design/reader.md)
            "gathered_why": dict(handout.gathered_why),
            # every slot is in exactly one place: the pool, lent to a lane (being written, or
            # committed and not yet taken in), ready here, or held by the user (rollouts and a zero-copy batch)
            "slots": {
                "pool": books.pool(),
                "lent": roster.given(),
                "ready": books.n_ready,
                "held": books.held,
            },
            "writer_stats": roster.writer_stats(),
        }

    # -- closing ------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop the pipeline (writers' next call raises PipelineClosed), unlink it, unmap it; from any thread (a
        ``get``/``get_batch`` waiting in another raises PipelineClosed). It waits for nothing: ``timeout`` is
        accepted (every shmbuf close takes it) and checked."""
        timeout_setting("Reader.close(timeout=...)", timeout)
        with self._use:
            if self._closed:
                return
            self._closed = True
            self._handout.loan.closed = True
            if not self._foreign:  # a forked copy: the pipeline is not ours to stop
                self._let_go()

    def _let_go(self) -> None:
        super().close()  # stop, wake every writer, unlink names: new attaches fail, current mappings stay valid
        for sem in self._sems:
            sem.close()
        self._sems = []
        self._handout.close()
        self._roster.close()
        self._seg.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._roster.lanes)} writers"
        return f"Reader({self.name!r}, slots={self.slots}, {state}, {self.schema!r})"


def _stop(words: memoryview, sems: list[Sem], name: str, n_lanes: int, pid: int) -> None:
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
    except (ValueError, posix_ipc.Error, PipelineClosed):
        pass  # already released by an earlier close: the names below are what is left to do
    unlink_all(name, n_lanes)
