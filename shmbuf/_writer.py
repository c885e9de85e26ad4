"""The actor side: accumulate a rollout straight into a shared slot, then commit it.

A :class:`Writer` behaves like InstaDeep echo's ``TrajectoryAccumulator``
(same timescale rules, same ``add``/``reset``, the same kinds of error)
except that ``add()`` writes into the shared-memory slot the reader will
read, and ``commit()`` hands the slot over instead of returning a tree to
send. This module is the Writer's lifecycle (attach, claim, add/commit/reset, close); the lane
protocol underneath (claim, wait, publish, mail, retire) is :mod:`shmbuf._lane`'s, the checks and
conversions of what ``add`` is given are :mod:`shmbuf._coerce`'s, and ``add``'s precompiled stores
are :mod:`shmbuf._fastpath`'s.
"""

from __future__ import annotations

import os
import time
from typing import Any, NoReturn

import numpy as np
import optree

from shmbuf import _control, _fork
from shmbuf._closable import Closable
from shmbuf._coerce import coerce_into
from shmbuf._errors import (
    BrokenPipeline,
    PipelineClosed,
    SchemaError,
    SegmentError,
    UsageError,
    WrongProcess,
)
from shmbuf._fastpath import PreparedTimescale, leaf_views, prepare_timescales, slot_views
from shmbuf._handle import Handle, name_of
from shmbuf._lane import WriterLane
from shmbuf._pidwatch import ProcessWatch
from shmbuf._segment import S_COMMIT_NS, S_EPOCH, S_FILL, S_POLICY, S_SEQ, W_CLOSED, Segment
from shmbuf._validate import int_setting, timeout_setting
from shmbuf._writer_hold import BYE_WAIT, Hold, let_go, let_go_in_child, open_lock_fd, open_sem
from shmbuf._writer_text import also_sent, error_report, no_free_slot, timescale_full, unknown_timescale, wrong_process

# How often a writer that is not waiting looks whether the reader still lives: every call looks at
# the closed flag (one load), and at most this often at the reader's process (a few microseconds).
LIVENESS_INTERVAL = 0.25
_now = time.monotonic


class Writer(Closable):
    """Fills shared slots of a pipeline, one rollout at a time.

    Args:
        pipeline: the pipeline's :class:`Handle`, its name, or the :class:`Reader`
            (in the reader's own process, e.g. for threads).
        example: optional. When given, it must describe exactly the pipeline's
            schema (checked by fingerprint; the error names the first differing
            leaf), and its container types are used for :meth:`send`.
        timeout: how long ``add``/``commit``/``send`` may wait for a free slot
            before raising :class:`SlotTimeout`; ``None`` waits for ever (still
            noticing a closed pipeline or a dead reader within 0.1 s).
        label: a short text shown by ``shmbuf ls`` and in the reader's stats.

    ``lane`` and ``epoch`` say which lane this Writer claimed and which claim of it this is
    (the lane's claims so far, never reused in the pipeline's life); :meth:`commit` returns
    ``seq``, counted from 0 per Writer. The reader gives each rollout all three: ``(lane, epoch,
    seq)`` names one rollout for the pipeline's whole life, across writers that replace
    others on a lane.

    Rules: echo's ``TrajectoryAccumulator``'s. ``add(ts, tree)`` writes one
    item into the next index of a buffered timescale; a single-item
    timescale holds one item, so its one ``add`` writes the whole leaf and a
    second one before ``commit``/``reset`` raises :class:`TimescaleFull`
    (an IndexError naming timescale, capacity and index). Dtypes cast under
    numpy's ``same_kind`` rule (float64 into float32 yes, float into int no);
    a Python number must fit the leaf's dtype (300 into int8 is refused, as
    numpy's own assignment refuses it). Shapes must be the item shape (or,
    echo-style, with a leading 1); no other broadcasting. Anything with
    ``__array__`` (a CPU torch tensor, a JAX array) is read through it. A
    failed ``add`` writes nothing.

    Stopping: when the reader closes the pipeline, every call raises
    :class:`PipelineClosed`, and leaving a ``with Writer(...)`` block because
    of it is quiet (the exception is swallowed), so ``while True`` actor
    loops end cleanly. Any other exception leaving the block is reported to
    the reader (raised there as :class:`WriterError`) and propagates.

    A Writer belongs to the process and thread that made it; it is not
    picklable (pass the handle and make a Writer in the child), and a copy
    inherited through ``fork`` raises :class:`WrongProcess`.

    Lifetime (:class:`shmbuf._closable.Closable`'s one mechanism): a Writer
    dropped without ``close()``, or still open at interpreter exit, gives its
    lane back as ``close(reason="garbage collected")`` would. That cannot hang
    exit: the bye message waits at most 0.2 s for the reader, nothing else waits.
    A forked child's copy never gives back the parent's lane.
    """

    _kind = "pipeline"

    def __init__(self, pipeline: Handle | str | Any, example: Any = None, *, timeout: float | None = 30.0,
                 label: str = ""):
        self.timeout = timeout_setting("Writer(timeout=...)", timeout)
        self.name = name_of(pipeline)
        self._pid = os.getpid()
        self._closed = False
        self._foreign = False
        self._reader_closed = False
        self._lane: WriterLane | None = None
        self._slot = -1
        self.lane = -1
        self.epoch = 0
        seg = Segment.attach(self.name)
        self._seg: Segment | None = seg
        self._hold = Hold(seg)
        self._lifetime(let_go, self._hold)
        try:
            self._setup(seg, example, label)
        except BaseException:
            self._close(None)  # no bye; a lane claimed goes back for the reader to reclaim
            raise
        _fork.track(self)

    def _setup(self, seg: Segment, example: Any, label: str) -> None:
        self.schema = schema = seg.schema
        self._ts = prepare_timescales(schema, example, f"pipeline {self.name}")
        self._ts_list = list(self._ts.values())
        self._w = seg.words
        self._plan = p = seg.plan
        hold = self._hold
        self._reader_watch = hold.watch = ProcessWatch(seg.creator)
        self._next_check = 0.0
        doorbell = open_sem(hold, self.name, "r")
        if self._w[W_CLOSED]:
            raise PipelineClosed(f"pipeline {self.name} is closed")
        hold.lock_fd = open_lock_fd(self.name, seg)
        self._lane = hold.lane = WriterLane.claim(self.name, p, self._w, seg.mm, hold.lock_fd, doorbell,
                                                  lambda i: open_sem(hold, self.name, f"f{i}"), label, self.timeout,
                                                  self._check_reader)
        self.lane = self._lane.rec.index
        self.epoch = self._lane.epoch
        self._leaf_views = leaf_views(self._ts_list, seg.leaf_view)  # per timescale, each leaf's view of every slot
        # Per slot, built on its first use and then reused: per timescale, each leaf's array view and
        # (for add's fast path) its flat memoryview, or None (see shmbuf._fastpath.slot_views).
        self._slot_views: dict[int, tuple[list[list[np.ndarray]], list[list[memoryview | None]]]] = {}
        self._cur: list[list[np.ndarray]] = []
        self._cur_mv: list[list[memoryview | None]] = []
        self._fill = [0] * len(schema.timescales)
        self._direct = False  # slot() handed out the views: commit counts every timescale full
        self._seq = 0
        self.policy_version = 0
        self._counts = {"commits": 0, "wait_s": 0.0, "waits": 0}

    # -- set-up and tear-down -----------------------------------------------

    def close(self, timeout: float | str | None = None, *, reason: str = "closed") -> None:
        """Give the lane back, telling the reader ``reason`` (a "bye"). A rollout started and not committed is dropped.

        ``timeout``: the most seconds the bye waits for the reader to take an earlier message from the mailbox
        (None: 0.2 s, the most it ever waits). ``close("why")``, the older positional form, is ``close(reason="why")``.
        """
        if isinstance(timeout, str):  # the older close(reason) form
            reason, timeout = timeout, None
        t = timeout_setting("Writer.close(timeout=...)", timeout)
        if t is not None and not self._closed:
            self._hold.bye_wait = min(BYE_WAIT, t)
        self._close(str(reason))

    def _close(self, reason: str | None) -> None:
        """close(), and a Writer() that failed (``reason`` None: no bye): drop the views, then run the release."""
        if self._closed:
            return
        self._closed = True
        self._slot = -1
        if self._foreign:
            return  # the lane, its lock and its semaphores are the parent's (see _after_fork_in_child)
        self._hold.reason = reason
        self._lane = None
        # Before the release, not after as Closable's subclasses drop views: the release closes the segment,
        # and it is unmapped at once only if no view of it lives (else it goes with the last view).
        self._forget_views()
        self._slot_views = {}
        self._leaf_views = []
        super().close()  # let_go: bye, retire, then everything held
        self._seg = None

    def _after_fork_in_child(self) -> None:
        """In a child that inherited this Writer by fork: let go of what is the parent's."""
        self._foreign = True
        self._slot = -1
        self._forget_views()
        let_go_in_child(self._hold)

    def __exit__(  # type: ignore[override]  # a bool, not Closable's None: it ends the block quietly on a reader's close
        self, exc_type: Any, exc: BaseException | None, tb: Any
    ) -> bool:
        """Close; report an exception to the reader; swallow PipelineClosed raised because the reader closed."""
        try:
            if exc is not None and not isinstance(exc, (PipelineClosed, BrokenPipeline, WrongProcess, KeyboardInterrupt)):
                try:
                    if self.report_error(exc) and hasattr(exc, "add_note"):
                        exc.add_note(also_sent(self.name, self.lane))
                except Exception:  # noqa: BLE001  # the user's exception is the one that matters
                    pass
        finally:
            self.close()
        return isinstance(exc, PipelineClosed) and self._reader_closed

    def __reduce__(self) -> Any:
        raise UsageError(
            "a shmbuf Writer belongs to the process that made it; pass the pipeline's handle "
            "(reader.handle) to the other process and make a Writer there"
        )

    # -- the hot path -------------------------------------------------------

    def add(self, timescale: str, data: Any) -> None:
        """Write one item of ``timescale`` into the current slot (claiming a slot first if needed).

        Raises:
            UnknownTimescale: a KeyError naming the known timescales.
            TimescaleFull: an IndexError naming timescale, capacity and index.
            SchemaError: wrong keys, dtype, shape or value (names the leaf path).
            SlotTimeout, PipelineClosed, BrokenPipeline, WrongProcess: see :meth:`commit`.
        """
        ts = self._ts.get(timescale)
        if ts is None:
            self._unknown(timescale)
        i = self._fill[ts.index]
        if i >= ts.capacity:
            self._full(ts, i)
        if self._slot < 0:
            self._claim_slot()
        elif self._w[W_CLOSED] or _now() >= self._next_check:
            self._guard()
        store = ts.store
        if store is not None and type(data) is dict and len(data) == len(ts.scratch):
            t = ts.index
            store.fn(data, i, self._cur[t], self._cur_mv[t])  # checks every leaf, then stores them all
            self._fill[t] = i + 1
            return
        vals = ts.scratch
        coerce_into(vals, ts.spec, ts.keys, ts.treespec, data, whole=False)  # checks every leaf before any store
        if ts.buffered:
            for dst, x in zip(self._cur[ts.index], vals):
                dst[i] = x
        else:
            for dst, x in zip(self._cur[ts.index], vals):
                dst[...] = x
        self._fill[ts.index] = i + 1

    def commit(self, policy_version: int | None = None, *, fill: dict[str, int] | None = None) -> int:
        """Publish the current slot to the reader; return the rollout's sequence number (from 0 per Writer).

        Records how far each timescale was filled, so a rollout cut short is
        delivered with its real length. The next ``add`` claims a new slot.
        After :meth:`slot`, every timescale counts as full unless ``fill``
        (timescale to count, at most its capacity) says otherwise.

        Raises:
            UsageError: nothing was added since the last commit (a ValueError).
            PipelineClosed: the reader closed the pipeline, or this Writer was closed.
            BrokenPipeline: the reader's process died.
            WrongProcess: this Writer was inherited through fork.
        """
        if fill is not None or self._direct:
            self._set_fill(fill)
        if self._slot < 0 or not any(self._fill):
            self._guard()
            raise UsageError(f"commit of an empty rollout on pipeline {self.name}: nothing was added since the last commit")
        w = self._w
        if w[W_CLOSED] or _now() >= self._next_check:
            self._guard()
        slot = self._slot
        sw = self._plan.slot_word(slot)
        seq = self._seq
        w[sw + S_SEQ] = seq
        w[sw + S_EPOCH] = self.epoch
        w[sw + S_POLICY] = self.policy_version if policy_version is None else policy_version
        for t, n in enumerate(self._fill):
            w[sw + S_FILL + t] = n
            self._fill[t] = 0
        w[sw + S_COMMIT_NS] = time.monotonic_ns()
        self._lane.publish(slot)  # type: ignore[union-attr]  # _guard passed: the lane is ours
        self._slot = -1
        self._direct = False
        self._seq = seq + 1
        self._counts["commits"] += 1
        return seq

    def slot(self) -> dict[str, Any]:
        """The current slot as a tree shaped like the example, of writable views: write into it in place.

        For actors that produce whole arrays (a vector env's observations, a policy's batched
        outputs): write them straight into shared memory, with no ``add`` per step and no copy
        in between, then :meth:`commit`, which publishes every timescale as full (pass ``fill``
        to say otherwise). Claims a slot first if none is held (waiting like ``add``).

        Lifetime: the views are this slot's until :meth:`commit` (or :meth:`close`); after that the
        slot belongs to the reader, and writing through a view you kept would change a rollout
        the learner may be reading. Take the views again after each commit.
        """
        if self._slot < 0:
            self._claim_slot()
        else:
            self._guard()
        self._direct = True
        out, views = {}, self._cur
        for ts in self._ts_list:
            out[ts.spec.name] = optree.tree_unflatten(ts.treespec, views[ts.index])
        return out

    def reset(self) -> None:
        """Forget what was added since the last commit (e.g. an aborted episode); keep the slot."""
        if self._foreign or self._closed:
            self._guard()
        for t in range(len(self._fill)):
            self._fill[t] = 0
        self._direct = False

    def _set_fill(self, fill: dict[str, int] | None) -> None:
        """Fill counts for a commit after slot(): every timescale full, or what ``fill`` says (checked first)."""
        counts = [ts.capacity for ts in self._ts_list] if self._direct else list(self._fill)
        for name, n in (fill or {}).items():
            ts = self._ts.get(name)
            if ts is None:
                self._unknown(name)
            counts[ts.index] = int_setting(f"commit(fill=...): timescale '{name}'", n, 0, ts.capacity)
        self._fill[:] = counts

    def send(self, tree: Any, policy_version: int | None = None) -> int:
        """Write a whole, already built rollout and commit it (echo's ``client.send(buf.build())``, one call).

        Every timescale must be present with the example's structure; buffered
        timescales count as full.
        """
        self._guard()
        if self._slot >= 0 and any(self._fill):
            raise UsageError(
                f"send() while a rollout is being built with add() on pipeline {self.name}; commit() or reset() it first"
            )
        if type(tree) is not dict or len(tree) != len(self._ts) or tree.keys() != self._ts.keys():
            got = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
            raise SchemaError(f"send: expected a dict with timescales {sorted(self._ts)}, got {got}")
        for ts in self._ts_list:  # check everything before writing anything
            coerce_into(ts.scratch, ts.spec, ts.keys, ts.treespec, tree[ts.spec.name], whole=True)
        if self._slot < 0:
            self._claim_slot()
        for ts in self._ts_list:
            vals = ts.scratch
            for j, dst in enumerate(self._cur[ts.index]):
                dst[...] = vals[j]  # dtype already checked against 'same_kind'
                vals[j] = None  # hold no reference to the caller's arrays
            self._fill[ts.index] = ts.capacity
        return self.commit(policy_version)

    # -- slots, and whether anyone is still listening -----------------------

    def _claim_slot(self) -> None:
        self._guard()
        lane = self._lane
        assert lane is not None  # _guard raised otherwise
        if not lane.has_free():
            t0 = _now()
            self._counts["waits"] += 1
            try:
                lane.wait(None if self.timeout is None else t0 + self.timeout, self._guard, self._timeout_message)
            except ValueError:
                if self._closed or self._hold.seg.closed:  # closed by another thread (or at exit) under the wait
                    raise PipelineClosed(f"this Writer of pipeline {self.name} was closed while it waited for a "
                                         "slot") from None
                raise
            finally:
                self._counts["wait_s"] += _now() - t0
        slot = lane.take()
        if not 0 <= slot < self._plan.n_slots:
            raise SegmentError(f"pipeline {self.name}: the free ring of lane {self.lane} holds slot {slot}, outside "
                               f"0..{self._plan.n_slots - 1}: the segment is corrupt")
        self._slot = slot
        views = self._slot_views.get(slot)
        if views is None:
            views = self._slot_views[slot] = slot_views(self._ts_list, self._leaf_views, slot)
        self._cur, self._cur_mv = views

    def _forget_views(self) -> None:
        """Drop every reference to the current slot's views (the mapping cannot be closed while one lives)."""
        self._cur = []
        self._cur_mv = []

    def _guard(self) -> None:
        """Raise if this Writer can do nothing more: forked copy, closed, pipeline closed, reader dead, lane lost."""
        if self._foreign:
            raise wrong_process(self._pid, os.getpid())
        if self._closed or self._lane is None:
            raise PipelineClosed(f"this Writer of pipeline {self.name} was closed (Writer.close()); make a new one")
        if self._w[W_CLOSED]:
            self._reader_closed = True
            raise PipelineClosed(f"pipeline {self.name} was closed by its reader; this writer can do nothing more")
        now = _now()
        if now >= self._next_check:
            self._check_reader()
            if self._lane.taken_back():
                raise BrokenPipeline(f"pipeline {self.name}: the reader took lane {self.lane} back (it found the "
                                     "lane's words corrupt); this writer can do nothing more")
            self._next_check = now + LIVENESS_INTERVAL

    def _check_reader(self) -> None:
        if not self._reader_watch.alive():
            raise BrokenPipeline(f"pipeline {self.name}: the reader's process (pid {self._reader_watch.owner.pid}) died")

    def _timeout_message(self) -> str:
        return no_free_slot(self.name, self.timeout, self._lane is None or self._lane.served())

    # -- control messages ---------------------------------------------------

    def report_error(self, exc: BaseException, timeout: float = 10.0) -> bool:
        """Send an exception (with its traceback, as text) to the reader, which raises it as WriterError.

        Waits up to ``timeout`` seconds for the reader to take a message still in the mailbox (it
        does at its next get, get_batch or poll). False if it did not, closed the pipeline, or died.
        """
        if self._closed or self._foreign or self._lane is None or self._hold.reader_gone():
            return False  # (a closed pipeline's mailbox would take the message, and nobody would read it)
        return self._lane.post(error_report(exc), timeout, self._hold.reader_gone)

    def stats(self) -> dict[str, float]:
        """This writer's counters, a copy: ``commits``, ``waits`` (for a free slot) and ``wait_s`` (seconds spent so).
        :meth:`send_stats` posts them to the reader (``reader.stats()["writer_stats"]``)."""
        return dict(self._counts)

    def send_stats(self) -> bool:
        """Send this writer's counters to the reader (shown in ``reader.stats()``)."""
        if self._closed or self._foreign or self._lane is None:
            return False
        return self._lane.post(_control.encode("stats", counters=self.stats()), 0.0, self._hold.reader_gone)

    # -- errors, the slow way -----------------------------------------------

    def _unknown(self, timescale: Any) -> NoReturn:
        raise unknown_timescale(timescale, list(self._ts))

    def _full(self, ts: PreparedTimescale, i: int) -> NoReturn:
        raise timescale_full(ts, i)
