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

from typing import NamedTuple

import numpy as np

from shmbuf._books import NOT_READY, SLOT_HELD, SLOT_LENT, SLOT_POOL, SLOT_READY, SlotBooks
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

    def lends_runs(self) -> bool:
        """Do slots go out a run at a time (:meth:`_feed_runs`): ``get_batch`` said its size B, there are no more
        lanes than B, and no ``max_policy_lag`` spreads each run over the lanes?"""
        return bool(self.run) and len(self.lanes) <= self.run and not self.spread

    def runs_for_all(self) -> bool:
        """Slots go out a run at a time, and there are more runs than writers (``slots // B > lanes``): a run for
        every writer and one for the reader?

        Only then do parts of runs wait for their run (:meth:`_feed_runs`) and ``get_batch`` wait for a run while
        commits come (``shmbuf._handout.decide``'s ``seen``). With fewer, writers share runs, a run takes several
        writers' paces to fill, and both would keep writers waiting: measured with six inference-server workers in
        24 slots of B = 6, the run patience alone cost 13 % of the throughput and the held-back parts starved the
        server of requests (its ``min_batch_size`` lingered out).
        """
        return self.lends_runs() and self.slots // self.run > len(self.lanes)

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

    def feed(self, need: int = 0, mend: bool = False, lacking: bool = False) -> list[ReaderLane]:
        """Lend pool slots to the lanes, so that they never wait on the reader while it has slots to give;
        return the lanes whose counters were found corrupt (for the reader to take back).

        Once ``get_batch`` has said its size B (and there are no more lanes than B), slots go out a run
        at a time (see ``_feed_runs``): a run that completes is a zero-copy batch. The parts of runs a
        gather or a dead writer handed back wait for the rest of their run while there is a run for every
        writer, unless the reader waits for more commits than the lanes hold, or for rollouts it lacks
        (``lacking``) while a writer has nothing queued, or ``mend`` (``Reader.poll()``, a writer in the
        reader's thread) asks. Otherwise they go out in cyclic order, fewest-held lanes first, each lane keeping at most
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
        if self.lends_runs():
            pool -= self._feed_runs(need, mend, lacking, pool, fed, corrupt)
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

    def _feed_runs(self, need: int, mend: bool, lacking: bool, budget: int, fed: list[ReaderLane],
                   corrupt: list[ReaderLane]) -> int:
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
        slots are in the pool. When none is, the pool holds parts of runs (a gather or a dead writer
        handed them back). While there is a run for every writer and one for the reader
        (:meth:`runs_for_all`) they stay there until their runs come back whole, unless the reader is
        about to wait for more commits than the lanes hold (``need``; every lane then counts as short) or
        ``mend`` asks; then, or with fewer runs, a run's holes go to one lane, the run nearest to complete
        and the lane that keeps it in order (:meth:`_mend`), and with no run to mend, pool slots in
        cyclic order.

        Why they wait: lent as they came, in cyclic order, a gather's slots (scattered over every run)
        made runs that filled at two writers' paces and out of their lanes' order, and every later
        batch was gathered too (docs/design/reader.md, "After a gather"; ``make bench-zero-copy``).
        """
        size = self.run
        lanes = list(self.lanes.values())
        depth = max(1, self.slots // (2 * len(lanes)))
        spare = self.runs_for_all()
        plan: _Plan | None = None  # the runs with holes and what each lane holds, made once a feed (see _mend)
        lent = 0
        for _ in range(self.slots // size + 1):  # each turn opens a run, or stops
            queued = {lane.index: lane.queued() for lane in lanes}
            given = sum(lane.given for lane in lanes)
            short = sorted((lane for lane in lanes if queued[lane.index] < depth),
                           key=lambda ln: (queued[ln.index], *_fewest(ln)))
            if not short and given < need:
                short = sorted(lanes, key=_hungry)
            if not short:
                return lent
            lane = short[0]
            first = self._free_run(self.open_end) if size <= budget - lent else -1
            hungry = lacking and not queued[short[0].index]
            if first < 0 and spare and not mend and not hungry and given >= need:
                # Parts of runs only, and nothing waits for them: they wait for their runs. A reader that lacks
                # rollouts gives them to a writer with nothing queued: the slots the others hold may be a paused
                # writer's, and it would wait for them until its timeout (or for ever).
                return lent
            if first < 0:
                if plan is None:
                    plan = self._plan()
                filling = self._mend(plan, short, queued)
                if filling is not None:  # a run's holes, in one piece to one lane (see _mend)
                    lane, holes = filling
                    got = self._lend_slots(lane, holes[: budget - lent], fed)
                    if got > 0:
                        plan.mine[lane.index][holes[:got]] = True
                        plan.held[lane.index] += got
                    if got < 0 and lane not in corrupt:
                        corrupt.append(lane)
                    if got <= 0:
                        return lent
                    lent += got
                    if lent >= budget:
                        return lent
                    continue
            if first < 0:  # no aligned run has a pool slot (or none is allowed): the short lanes get what there is
                for lane in short:
                    if lent >= budget:
                        break
                    got = self._lend(lane, min(max(1, depth - queued[lane.index]), budget - lent), fed)
                    if got < 0 and lane not in corrupt:
                        corrupt.append(lane)
                    lent += max(got, 0)
                return lent
            self.open_end = first + size
            if self._lend_span(lane, first, size, fed) < 0:
                if lane not in corrupt:
                    corrupt.append(lane)  # the run stays in the pool; the reader takes the lane back
                return lent
            lent += size
        return lent

    def _plan(self) -> _Plan:
        """The aligned runs with holes (pool slots), nearest to complete first (no slot held by the reader, fewest
        slots not yet ready, then round from the end of the run lent last), and each lane's slots, ready or lent."""
        books, size = self.books, self.run
        where = books.where
        top = self.slots - self.slots % size
        pool, held, ready_code = (books.fill[c][:1] for c in (SLOT_POOL, SLOT_HELD, SLOT_READY))
        start = self.open_end if self.open_end < top else 0
        runs = []
        for k in range(0, top, size):
            first = (start + k) % top
            run = where[first : first + size]
            if pool in run:
                runs.append(((held in run, size - run.count(ready_code)), first))
        runs.sort(key=lambda r: r[0])  # stable: ties keep the order round from the end of the run lent last
        ready = books.arrived != NOT_READY
        lent = books.wv == SLOT_LENT
        mine = {i: (ready & (books.lane_of == i)) | (lent & (books.ov == i)) for i in self.lanes}
        return _Plan([first for _, first in runs], mine, {i: int(m.sum()) for i, m in mine.items()}, {})

    def _mend(self, plan: _Plan, short: list[ReaderLane], queued: dict[int, int]) -> tuple[ReaderLane, list[int]] | None:
        """The holes (pool slots, ascending) of one run of ``plan``, taken from it, and the lane of ``short`` to fill
        them; None once no run has holes.

        The holes' rollouts will be that lane's newest, in slot order, so the run can go out in order only if
        the lane has nothing in it (ready or lent) after the first hole: such a lane is chosen. Of those, first
        one with nothing queued (it fills them now; another fills them after what it holds, and a lane that holds
        slots it does not take may be a paused writer's), then the one whose slots hold the run back least (the
        run waits for a lane's slots outside it: worst some in it and some outside, whose runs may wait for the
        ones in it; then any outside; best none), then in ``short``'s order. The run: the first of ``plan`` that
        such a lane can fill; if none, the first that no lane can fill in order (else the first), to the first of
        ``short`` (commits the reader waits for come first).
        """
        size, where, pool = self.run, self.books.where, SLOT_POOL
        for k, first in enumerate(plan.firsts):
            can = plan.fits.get(first)
            if can is None:  # which lanes have nothing in the run after its first hole: fixed until the run is mended
                hole = where.find(pool, first, first + size)
                can = plan.fits[first] = {i for i, m in plan.mine.items() if not m[hole : first + size].any()}
            if not can:
                continue
            holes = [i for i in range(first, first + size) if where[i] == pool]
            fits = []
            for n, lane in enumerate(short):
                if lane.index in can:
                    inside = int(plan.mine[lane.index][first : first + size].sum())
                    outside = plan.held[lane.index] > inside
                    fits.append(((queued[lane.index] > 0, outside and inside > 0, outside), n, lane))
            if fits:
                del plan.firsts[k]
                return min(fits, key=lambda fit: fit[:2])[2], holes
        plan.firsts.sort(key=lambda f: bool(plan.fits.get(f)))  # stable: a run no lane can fill in order is given first
        while plan.firsts:
            first = plan.firsts.pop(0)
            holes = [i for i in range(first, first + size) if where[i] == pool]
            if holes:
                return short[0], holes
        return None

    def _lend_slots(self, lane: ReaderLane, slots: list[int], fed: list[ReaderLane]) -> int:
        """Lend ``slots`` (pool slots, ascending) to ``lane``, a stretch of consecutive ones at a time; return how many,
        or -1 if the lane's counters are corrupt and nothing was lent."""
        lent, i = 0, 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            if self._lend_span(lane, slots[i], j - i, fed) < 0:
                return lent if lent else -1
            lent += j - i
            i = j
        return lent

    def _lend(self, lane: ReaderLane, k: int, fed: list[ReaderLane]) -> int:
        """Lend up to ``k`` pool slots to ``lane`` in cyclic order from the cursor, a stretch of consecutive ones at a
        time; return how many, or -1 if the lane's counters are corrupt."""
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
            got = self._lend_span(lane, first, m, fed)
            if got < 0:
                return -1 if not lent else lent
            lent += m
            at = first + m if first + m < n else 0
        self.cursor = at
        return lent

    def _lend_span(self, lane: ReaderLane, first: int, m: int, fed: list[ReaderLane]) -> int:
        """Lend pool slots ``first .. first + m - 1`` to ``lane``, marked with a cycle number of their own (one
        lending round: in_order's first test); m, or -1 if the lane's counters are corrupt (nothing lent)."""
        self.cycle = (self.cycle + 1) & CYCLE_MASK
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


class _Plan(NamedTuple):
    """What mending reads in one feed: the runs with holes, in the order to mend them, each lane's slots (ready from
    it or lent to it) as a mask and a count, and, per run looked at, the lanes that can fill it in order."""

    firsts: list[int]  # the first slot of each run with holes, nearest to complete first
    mine: dict[int, np.ndarray]  # lane -> a mask over the slots
    held: dict[int, int]  # lane -> how many slots its mask holds
    fits: dict[int, set[int]]  # a run's first slot -> the lanes with nothing in it after its first hole
