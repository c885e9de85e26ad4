"""Lending slots to the lanes, and finding the runs of ready slots a zero-copy batch can be.

Once ``get_batch`` has said its size B, slots go out a whole aligned run at a time, each run to the
one lane shortest of slots, so that a writer fills its run in its commit order and a slow writer
delays only its own runs; before that (or with more lanes than B) they go out in cyclic order from
a cursor. The run search hands out an aligned run of ready slots only if that keeps each lane's
commit order. Why, and what was measured: "Making runs: how slots are lent" in docs/design/reader.md.

:class:`Lender` is the reader's; it writes the lent slots into the :class:`~shmbuf._books.SlotBooks`
and pushes them to the lanes' free rings, and reports the lanes whose counters it found corrupt
for the reader to take back.
"""

from __future__ import annotations

import numpy as np

from shmbuf._books import NOT_READY, SLOT_HELD, SLOT_POOL, SLOT_READY, SlotBooks
from shmbuf._errors import SegmentError
from shmbuf._lane import ReaderLane, wake_waiting
from shmbuf._ring import Fence

CYCLE_MASK = 0xFFFFFFFF  # lending rounds are numbered mod 2**32: a slot would have to wait that many to alias


class Lender:
    """Lends pool slots to ``lanes`` (the live lanes by index, which the roster adopts and takes back)
    and searches for runs.

    ``run``: ``get_batch``'s size once it said one (0 before), set with :meth:`batch_size`.
    ``read_cursor``: runs are looked for from here, the end of the last one handed out (the reader
    moves it).
    """

    def __init__(self, books: SlotBooks, sl_fence: Fence):
        self.books = books
        self.lanes: dict[int, ReaderLane] = {}
        self.slots = books.n
        self._sl_fence = sl_fence
        self.cursor = 0  # slots are lent in cyclic order from here: runs of consecutive slots fill together
        self.cycle = 0  # a number per lending round (mod 2**32); each slot's at lending is in books.lent_in
        self.run = 0  # get_batch's size, once it said one: slots are then lent a run at a time
        self.open_end = 0  # the end of the run being lent
        self.read_cursor = 0

    def batch_size(self, size: int) -> None:
        """``get_batch(size)`` with views, a size other than ``run``: lend runs of this size from here on."""
        self.run, self.open_end = size, 0

    def chunk(self) -> int:
        """Slots are lent in chunks of this many (or all that are needed before the reader waits).

        A writer asleep for want of a slot costs a wake-up per lending; lending one slot at a time
        to a writer faster than its reader would pay that per rollout.
        """
        return max(1, min(16, self.slots // (2 * max(1, len(self.lanes)))))

    # -- lending -------------------------------------------------------------

    def feed(self, need: int = 0) -> list[ReaderLane]:
        """Lend pool slots to the lanes, so that they never wait on the reader while it has slots to give;
        return the lanes whose counters were found corrupt (for the reader to take back).

        Once ``get_batch`` has said its size B (and there are no more lanes than B), slots go out a run
        at a time (see ``_feed_runs``): a run that completes is a zero-copy batch. Otherwise they go
        out in cyclic order, fewest-held lanes first, each lane keeping at most
        ``slots // (2 * lanes)`` untaken slots queued (and at least one), so that a writer that goes
        idle can hold only that many, and a writer that arrives later finds slots in the pool.
        Before the reader sleeps for ``need`` more commits it lends past those limits, from any slots,
        until the lanes hold ``need`` between them (writers asleep for want of a slot first): commits
        it waits for must be possible without it.
        """
        lanes = self.lanes
        if not lanes:
            return []
        pool = self.books.where.count(SLOT_POOL)  # books.pool(), inline: this runs at every batch
        if not pool:
            return []
        fed: list[ReaderLane] = []
        corrupt: list[ReaderLane] = []
        if self.run and len(lanes) <= self.run:
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
        return corrupt

    def _feed_runs(self, need: int, fed: list[ReaderLane], corrupt: list[ReaderLane]) -> int:
        """Lend whole runs of ``self.run`` slots, each to one lane that is short of slots (the one with
        fewest untaken first). Return how many slots were lent.

        A run lent to one lane in one piece is filled by that writer in its commit order, and it
        completes whatever the other writers do: a slow or idle writer delays only its own runs, and
        ``in_order`` passes at its first test. A lane is short when it has fewer than ``depth``
        untaken (``slots // (2 * lanes)``, at least one); a lane that does not take its slots (an idle
        writer) stops getting any, so it holds at most one run. A run is opened only when all its
        slots are in the pool; when none is, a short lane gets pool slots in cyclic order, as before
        runs, so that no writer waits for a slot while the pool has one. Before the reader waits
        (``need``) every lane counts as short.
        """
        size = self.run
        lanes = list(self.lanes.values())
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
            first = self._free_run(self.open_end)
            if first < 0:  # no whole run in the pool: the short lanes get what there is
                for lane in short:
                    if not self.books.where.count(SLOT_POOL):
                        break
                    got = self._lend(lane, max(1, depth - queued[lane.index]), fed)
                    if got < 0 and lane not in corrupt:
                        corrupt.append(lane)
                    lent += max(got, 0)
                return lent
            self.open_end = first + size
            self.cycle = (self.cycle + 1) & CYCLE_MASK
            if self._lend_span(lane, first, size, fed) < 0:
                if lane not in corrupt:
                    corrupt.append(lane)  # the run stays in the pool; the reader takes the lane back
                return lent
            lent += size
        return lent

    def _lend(self, lane: ReaderLane, k: int, fed: list[ReaderLane]) -> int:
        """Lend up to ``k`` pool slots to ``lane`` in cyclic order from the cursor, each stretch of consecutive
        ones with a cycle number of its own; return how many, or -1 if the lane's counters are corrupt."""
        where, n = self.books.where, self.slots
        lent, at = 0, self.cursor
        while lent < k:
            first = where.find(SLOT_POOL, at)
            if first < 0:
                first = where.find(SLOT_POOL)
                if first < 0:
                    break
            span = where[first : first + k - lent]
            m = len(span) - len(span.lstrip(b"\0"))  # pool slots in a row from ``first``
            self.cycle = (self.cycle + 1) & CYCLE_MASK
            got = self._lend_span(lane, first, m, fed)
            if got < 0:
                return -1 if not lent else lent
            lent += m
            at = first + m if first + m < n else 0
        self.cursor = at
        return lent

    def _lend_span(self, lane: ReaderLane, first: int, m: int, fed: list[ReaderLane]) -> int:
        """Lend pool slots ``first .. first + m - 1`` to ``lane``, marked with the current cycle; m, or -1 if the
        lane's counters are corrupt (nothing lent)."""
        try:
            lane.lend(self.books.count[first : first + m])
        except SegmentError:
            return -1
        self.books.mark_lent(first, m, lane.index, self.cycle)
        if lane not in fed:
            fed.append(lane)
        return m

    def _free_run(self, start: int) -> int:
        """The first slot of the next aligned run whose slots are all in the pool, from ``start`` round; or -1."""
        size = self.run
        where, run, top = self.books.where, self.books.fill[SLOT_POOL][:size], self.slots - self.slots % size
        for origin in ((start, 0) if start else (0,)):
            first = where.find(run, origin, top)
            while first >= 0 and first % size:
                first = where.find(run, first - first % size + size, top)
            if first >= 0:
                return first
        return -1

    # -- the run search --------------------------------------------------------

    def full_run(self, size: int) -> int:
        """The first slot of an aligned run of ``size`` ready slots that can be handed out in order (see
        ``in_order``), looked for from the end of the last run handed out, round to it; or -1."""
        where, run, n = self.books.where, self.books.fill[SLOT_READY][:size], self.slots
        top = n - n % size
        start = self.read_cursor - self.read_cursor % size
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
                if self.in_order(first, size):
                    return first
                at = first + size
        return -1

    def in_order(self, first: int, size: int) -> bool:
        """May the run be handed out without breaking any lane's commit order? Its rows are in slot order,
        so each lane's rollouts in it must have arrived in slot order, and no ready rollout of that lane
        outside it may be older than one inside (it would be handed out after its successors)."""
        books = self.books
        run = slice(first, first + size)
        inner = books.arrived[run]
        lent_in = books.lent_in[4 * first : 4 * (first + size)]
        # Lent in one turn of the cursor: in slot order, so each lane took them, and committed them, in slot order.
        # Otherwise look at the arrival order, per lane.
        if lent_in != lent_in[:4] * size and _against_arrival(inner, books.lane_of[run]):
            return False
        if books.n_ready == size:
            return True  # nothing ready outside the run
        arrived, top = books.arrived, int(inner.max())
        before, after = arrived[:first], arrived[first + size :]
        if (not len(before) or int(before.min()) > top) and (not len(after) or int(after.min()) > top):
            return True  # everything ready outside is newer than everything inside
        saved = inner.copy()
        arrived[run] = NOT_READY  # the run, hidden for a moment, so that the minima below are outside it
        try:
            lanes_in = books.lane_of[run]
            for lane in set(lanes_in.tolist()):
                theirs = books.lane_of == lane
                oldest = int(arrived[theirs].min())
                newest = int(saved[lanes_in == lane].max())
                # equal: one commit group on both sides of the run's edge; the part before it is older
                if oldest < newest or (oldest == newest and bool((arrived[:first][theirs[:first]] == oldest).any())):
                    return False
        finally:
            arrived[run] = saved
        return True

    def stranded(self, slot: int, size: int) -> bool:
        """Can the oldest ready rollout, in ``slot``, never go out as part of a view? True when it sits past the
        last aligned run (``slots`` not a multiple of ``size``), or when its run is complete and out of order for
        good: a lane's rollouts in it out of their arrival order, or a rollout of the oldest's own lane outside it
        older than one of that lane inside.

        A complete run stays as it is while it is ready. In the second case, the rollout outside sits in a run
        that holds a rollout of the lane newer than the oldest (itself), so that run fails ``in_order`` for as long
        as this one is ready, and the other way round: neither can ever go out in order, and that lane's writer
        starves once its ready rollouts fill the slots. A run out of order only for another lane's older rollout
        outside it may come right once that one goes out: the patience decides for it.
        """
        n = self.slots
        first = slot - slot % size
        if first + size > n - n % size:
            return True
        books = self.books
        if books.where[first : first + size] != books.fill[SLOT_READY][:size]:
            return False
        run = slice(first, first + size)
        arrived, lanes = books.arrived, books.lane_of
        inner, inner_lanes = arrived[run], lanes[run]
        if _against_arrival(inner, inner_lanes):
            return True
        lane = lanes[slot]
        newest = int(inner[inner_lanes == lane].max())
        theirs = lanes == lane
        theirs[run] = False
        return bool(theirs.any()) and int(arrived[theirs].min()) < newest

    def run_possible(self, size: int) -> bool:
        """Can an aligned run of ``size`` slots still fill? Not if each holds a rollout taken with get()."""
        held = self.books.fill[SLOT_HELD][:1]
        where = self.books.where
        return any(held not in where[k : k + size] for k in range(0, self.slots - size + 1, size))


def _against_arrival(arrived: np.ndarray, lanes: np.ndarray) -> bool:
    """Does a run (its slots' arrival numbers and lanes, in slot order) hold some lane's rollouts out of their
    arrival order? Views hand a run out in slot order, so that lane would see them reordered."""
    order = lanes.argsort(kind="stable")
    a, ln = arrived[order], lanes[order]
    return bool(((ln[1:] == ln[:-1]) & (a[1:] < a[:-1])).any())


def _given(lane: ReaderLane) -> int:
    return lane.given


def _hungry(lane: ReaderLane) -> tuple[bool, int]:
    """Writers asleep for want of a slot first, then the lanes holding fewest."""
    return not lane.w[lane.rec.free_wait], lane.given
