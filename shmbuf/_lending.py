"""Lending slots to the lanes, so that the ready slots form the runs a zero-copy batch can be.

Once ``get_batch`` has said its size B, slots go out a whole aligned run at a time, each run to the
one lane shortest of slots, so that a writer fills its run in its commit order and a slow writer
delays only its own runs; before that (or with more lanes than B) they go out in cyclic order from
a cursor. Which ready run goes out, and when a batch is gathered instead, is the hand-out's
(:mod:`shmbuf._handout`). Why, and what was measured: "Making runs: how slots are lent" in
docs/design/reader.md.

:class:`Lender` is the reader's; it writes the lent slots into the :class:`~shmbuf._books.SlotBooks`
and pushes them to the lanes' free rings, and reports the lanes whose counters it found corrupt
for the reader to take back.
"""

from __future__ import annotations

from shmbuf._books import SLOT_POOL, SlotBooks
from shmbuf._errors import SegmentError
from shmbuf._lane import ReaderLane, wake_waiting
from shmbuf._ring import Fence

CYCLE_MASK = 0xFFFFFFFF  # lending rounds are numbered mod 2**32: a slot would have to wait that many to alias


class Lender:
    """Lends pool slots to ``lanes`` (the live lanes by index, which the roster adopts and takes back).

    ``run``: ``get_batch``'s size once it said one (0 before), set with :meth:`batch_size`.
    """

    def __init__(self, books: SlotBooks, sl_fence: Fence):
        self.books = books
        self.lanes: dict[int, ReaderLane] = {}
        self.slots = books.n
        self._sl_fence = sl_fence
        self.cursor = 0  # slots are lent in cyclic order from here: runs of consecutive slots fill together
        self.cycle = 0  # a number per lending round (mod 2**32); each slot's at lending is in books.lent_in
        self.turns = 0  # lendings so far (each lane keeps the count at its last, ReaderLane.turn): ties go round
        self.run = 0  # get_batch's size, once it said one: slots are then lent a run at a time
        self.open_end = 0  # the end of the run being lent
        # A reader with a max_policy_lag: slots go out in cyclic order even once get_batch said its size, so that
        # every batch's run is spread over the lanes (each lane a part of it, in its commit order) instead of a run
        # a lane: a batch is then as old as one rollout of each writer, not as several rollouts of one.
        self.spread = False

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

    def allowance(self) -> int:
        """How many more slots may be lent now: every slot in the pool. The one place a pacing rule goes.

        ``feed`` lends at most this many per call, whichever way it lends (runs, cyclic, or for a wait), so
        a rule that keeps at most N slots lent to the writers at once (``max_policy_lag``) is
        ``min(pool, N - lent)`` here, with N given to the Lender at construction; a batch size above N is
        then one more NEVER in the hand-out's ``never()`` (the writers could never fill it).
        """
        return self.books.where.count(SLOT_POOL)  # books.pool(), inline: this runs at every batch

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
        pool = self.allowance()  # what may still be lent in this call, whichever way below
        if not pool:
            return []
        fed: list[ReaderLane] = []
        corrupt: list[ReaderLane] = []
        if self.run and len(lanes) <= self.run and not self.spread:
            pool -= self._feed_runs(need, pool, fed, corrupt)
        else:
            order = sorted(lanes.values(), key=_fewest) if len(lanes) > 1 else lanes.values()
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

    def _feed_runs(self, need: int, budget: int, fed: list[ReaderLane], corrupt: list[ReaderLane]) -> int:
        """Lend whole runs of ``self.run`` slots, each to one lane that is short of slots (the one with
        fewest untaken first, then fewest lent in all, then the one lent to longest ago), at most ``budget``
        slots in all (:meth:`allowance`). Return how many were lent.

        The last two keys break ties. Without them a tie went to the lane adopted first, and when each feed
        had one run to give (the reader releasing a batch of B while the rest of the slots sat ready) and
        the older writer had taken all its slots by then, as a writer keeping pace does, a writer that
        arrived later (an actor's replacement) tied with it at every feed and never got a slot.

        A run lent to one lane in one piece is filled by that writer in its commit order, and it
        completes whatever the other writers do: a slow or idle writer delays only its own runs, and
        the hand-out's ``in_order`` passes at its first test. A lane is short when it has fewer than ``depth``
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
            short = sorted((lane for lane in lanes if queued[lane.index] < depth),
                           key=lambda ln: (queued[ln.index], *_fewest(ln)))
            if not short and sum(lane.given for lane in lanes) < need:
                short = sorted(lanes, key=_hungry)
            if not short:
                return lent
            lane = short[0]
            first = self._free_run(self.open_end) if size <= budget - lent else -1
            if first < 0:  # no whole run in the pool (or allowed): the short lanes get what there is
                for lane in short:
                    if lent >= budget:
                        break
                    got = self._lend(lane, min(max(1, depth - queued[lane.index]), budget - lent), fed)
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
        self.turns += 1
        lane.turn = self.turns
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


def _fewest(lane: ReaderLane) -> tuple[int, int]:
    """The lanes holding fewest first; of those, the one lent to longest ago (a newcomer first)."""
    return lane.given, lane.turn


def _hungry(lane: ReaderLane) -> tuple[bool, int]:
    """Writers asleep for want of a slot first, then the lanes holding fewest."""
    return not lane.w[lane.rec.free_wait], lane.given
