"""The writers the reader serves: lanes adopted, their commits and mail taken in, departures and deaths.

The lane protocol itself (adopt, lend, wake, take commits and mail, free) is :mod:`shmbuf._lane`'s;
:class:`Roster` is the reader's list of live lanes and what it does with them: scan the lane table
for writers that came, left or died, take in each lane's commits (into the
:class:`~shmbuf._books.SlotBooks`) and mail, take back a lane whose writer left, died or scribbled
over it, and ask the writers to ring the reader's doorbell (``arm``) before it sleeps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuf._books import SLOT_POOL, SlotBooks
from shmbuf._errors import SegmentError
from shmbuf._lane import LANE_ACTIVE, LANE_RETIRED, ReaderLane, Record, lane_held
from shmbuf._lending import Lender
from shmbuf._mail import Mail
from shmbuf._proc import alive
from shmbuf._ring import Fence
from shmbuf._segment import W_LANES_RECLAIMED, W_PARTIAL_DROPPED, W_POOL, W_READY_DEPTH, Segment
from shmbuf._sem import Sem


class Roster:
    """The reader's live lanes (``lanes``, by index) and its counters of writers seen, lanes reclaimed
    and partial rollouts dropped (each kept here and only stored to shared memory, for ``shmbuf ls``).

    ``lanes`` is the lender's dict: what the roster adopts, the lender lends to. :meth:`feed` lends
    (and takes back the lanes found corrupt); the roster feeds after it adopts or reclaims a lane.
    """

    def __init__(self, seg: Segment, books: SlotBooks, mail: Mail, lender: Lender, lane_sems: list[Sem],
                 sl_fence: Fence):
        self._seg = seg
        self._w = seg.words
        # The words as an int64 array, for bulk ring work (deleted when the reader closes).
        self._wn = np.ndarray((seg.plan.total // 8,), np.int64, buffer=seg.base)
        self._books = books
        self._mail = mail
        self._lane_sems = lane_sems
        self._sl_fence = sl_fence
        self._lender = lender
        self._records = [Record(seg.plan, i) for i in range(seg.plan.n_lanes)]
        self.lanes = lender.lanes
        self.writers_seen = 0  # lanes taken since creation: a timeout with none says no writer ever came
        self.lanes_reclaimed = 0
        self.partial_dropped = 0

    # -- arrivals, departures, deaths -----------------------------------------

    def scan(self) -> None:
        """Look at the lane table: adopt lanes writers took, take back those whose writer left or died."""
        w = self._w
        changed = False
        for rec in self._records:
            st = w[rec.state]
            lane = self.lanes.get(rec.index)
            if st == LANE_ACTIVE:
                if lane is None:
                    self._adopt(rec)
                    changed = True
                elif not self._writer_alive(lane):
                    self.reclaim(lane, died=True)
            elif st == LANE_RETIRED:
                if lane is None:  # retired before we ever saw it: give it a view, then take it back
                    lane = self._adopt(rec)
                self.reclaim(lane, died=False)
        if changed:
            self.feed()
        w[W_READY_DEPTH] = self._books.n_ready  # gauges for `shmbuf ls`, refreshed at each scan
        w[W_POOL] = self._books.where.count(SLOT_POOL)

    def _adopt(self, rec: Record) -> ReaderLane:
        """A lane a writer took: the reader's view of it, counted (a timeout with none says no writer ever came)."""
        lane = self.lanes[rec.index] = ReaderLane(rec, self._w, self._wn, self._seg.mm, self._lane_sems[rec.index])
        self.writers_seen += 1
        return lane

    def _writer_alive(self, lane: ReaderLane) -> bool:
        """The lane's lock says (see ``_lane.lane_held``); pid and start time only where it cannot."""
        held = lane_held(self._seg.fd, lane.index)
        return alive(lane.pid, lane.start) if held is None else held

    def reclaim(self, lane: ReaderLane, died: bool, corrupt: bool = False) -> None:
        """Take back a lane whose writer left, died, or scribbled over it: deliver what it committed,
        pool what it held. A corrupt lane's commits are not trusted: they go back to the pool too."""
        i = lane.index
        books = self._books
        if not corrupt:
            if lane.has_mail():
                self._mail.read(lane)
            try:
                slots = lane.take_commits()
            except SegmentError:
                slots, corrupt = None, True
            if slots is not None:
                self._accept(lane, slots)
        # What the lane still holds is in its free ring, untaken, or in the writer's hands (a partial rollout).
        untaken = lane.untaken()
        mine = books.lent_to(i)
        in_hand = [s for s in mine.tolist() if s not in untaken]
        w = self._w
        if died and in_hand:
            self.partial_dropped += len(in_hand)
            w[W_PARTIAL_DROPPED] = self.partial_dropped
        del self.lanes[i]
        books.wv[mine] = SLOT_POOL
        if corrupt:
            self._mail.bad()
        if died:
            self.lanes_reclaimed += 1
            w[W_LANES_RECLAIMED] = self.lanes_reclaimed
        lane.free_lane(taken_back=corrupt)
        self.feed()

    def feed(self, need: int = 0, mend: bool = False, lacking: bool = False) -> None:
        """Lend pool slots to the lanes (see :meth:`Lender.feed`), and take back the lanes found corrupt."""
        for lane in self._lender.feed(need, mend, lacking):
            if lane.index in self.lanes:
                self.reclaim(lane, died=True, corrupt=True)

    # -- commits and mail ----------------------------------------------------

    def take_in(self) -> None:
        """Every lane's commits (ready from now on) and mail; a lane whose counters are scribbled over is taken back."""
        corrupt = None
        books = self._books
        for lane in self.lanes.values():
            try:
                slots = lane.take_commits()
            except SegmentError:
                corrupt = [lane] if corrupt is None else [*corrupt, lane]
                continue
            if slots is not None:
                refused = books.accept(lane, slots)  # _accept, inline: this runs on every get and get_batch
                if refused:
                    self._mail.bad(refused)
            if lane.has_mail():
                self._mail.read(lane)
        if corrupt is not None:  # its counters are scribbled over: take the lane back, slots and all
            for lane in corrupt:
                self.reclaim(lane, died=True, corrupt=True)

    def _accept(self, lane: ReaderLane, raw: bytes) -> None:
        refused = self._books.accept(lane, raw)
        if refused:  # slots it was never lent: a bad message each
            self._mail.bad(refused)

    # -- the doorbell ------------------------------------------------------------

    def arm(self, want: int) -> bool:
        """Ask the writers to ring once ``want`` more rollouts are in; True if some are already published.

        Only lanes holding slots can commit, and lane ``i`` can commit at most ``given_i`` before the
        reader lends again, so its quota is ``min(ceil(want / L), given_i)`` over the ``L`` lanes
        that hold any. Then ``want`` commits, however they are spread over those lanes, bring at
        least one lane to its quota: the reader wakes once per batch, and never waits out a slice
        for commits that did arrive.
        """
        holding = 0
        for lane in self.lanes.values():
            if lane.given > 0:
                holding += 1
        if not holding:
            return False
        quota = -(-want // holding)
        for lane in self.lanes.values():
            if lane.given > 0:
                lane.arm(min(quota, lane.given))
        self._sl_fence()  # our WAKE_AT stores before our loads of their heads: the writers' fence mirrors it
        # Anything published since the last look: take it in rather than sleep. (A lane at its quota must
        # not be slept on: it may have passed the quota before it saw our WAKE_AT, and not rung. Sleeping
        # on fewer commits than that was measured: a context switch costs more than a turn of the loop.)
        for lane in self.lanes.values():
            if lane.given > 0 and lane.ready.available():
                return True
        return False

    def disarm(self) -> None:
        for lane in self.lanes.values():
            lane.disarm()

    def given(self) -> int:
        """Slots lent to the lanes and not yet back as commits."""
        return sum(lane.given for lane in self.lanes.values())

    def writer_stats(self) -> dict[int, dict[str, Any]]:
        """Each writer's last reported counters, with its label and pid."""
        return {lane.index: dict(lane.stats, label=lane.label, pid=lane.pid) for lane in self.lanes.values()}

    def close(self) -> None:
        """Drop every view of the segment's words (the reader is closing)."""
        for lane in self.lanes.values():
            lane.wn = None  # type: ignore[assignment]  # closed: no lane is lent to again
        del self._wn
