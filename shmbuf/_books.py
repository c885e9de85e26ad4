"""The reader's slot books: where each slot is, in the reader's own memory (never in shared memory).

One byte per slot says where it is (:data:`SLOT_POOL`, :data:`SLOT_READY`, :data:`SLOT_HELD`,
:data:`SLOT_LENT`), one more which lane a lent slot is lent to, and four the lending round it was
lent in; checking or setting a run of slots is one bytes comparison or slice store, not a loop or a
ufunc (see "The books" in docs/design/reader.md). Arrival order (FIFO), generation (stale handles),
lane and writer pid are int64 arrays, one entry per slot.

The books only record; who lends (:mod:`shmbuf._lending`) and who hands out
(:mod:`shmbuf._reader`) decide.
"""

from __future__ import annotations

import sys

import numpy as np

from shmbuf._lane import ReaderLane

# Where each slot is, one byte per slot: the reader's pool, ready here, held by the user (a Rollout or a
# zero-copy Batch), or lent to a lane (in its free ring, being written, or committed and not yet taken in;
# which lane is the slot's byte in ``owner``).
SLOT_POOL, SLOT_READY, SLOT_HELD, SLOT_LENT = 0, 1, 2, 3
NOT_READY = np.iinfo(np.int64).max  # the arrival number of a slot that is not ready
_BYTEORDER = sys.byteorder


class SlotBooks:
    """Every slot's place, arrival, generation, lane and pid; counts of ready and held slots.

    Attributes the reader, the lender and the roster read (and the lender writes, when it lends):
    ``where`` and ``owner`` (bytearrays), ``wv`` and ``ov`` (the same as numpy arrays), ``lent_in``
    (4 bytes a slot: the lending round, little-endian), ``arrived`` (a ready slot's arrival number,
    else NOT_READY), ``lane_of`` and ``pid_of`` (of a ready or held slot), ``gen`` (renewed at every
    release: a stale handle stops matching), ``count`` (slot numbers, for lending), ``fill`` (``n``
    bytes of each SLOT_* code, to slice), ``n_ready`` and ``held``.
    """

    __slots__ = (
        "_count_bytes",
        "_lane_bytes",
        "arrivals",
        "arrived",
        "count",
        "fill",
        "gen",
        "held",
        "lane_of",
        "lent_in",
        "n",
        "n_ready",
        "ov",
        "owner",
        "pid_of",
        "releases",
        "where",
        "wv",
    )

    def __init__(self, n: int):
        self.n = n
        self.where = bytearray(n)  # SLOT_POOL, SLOT_READY, SLOT_HELD or SLOT_LENT
        self.owner = bytearray(n)  # the lane a SLOT_LENT slot is lent to
        self.wv = np.frombuffer(self.where, np.uint8)  # the same books for numpy (gathers, reclaims)
        self.ov = np.frombuffer(self.owner, np.uint8)
        self.fill = {code: bytes([code]) * n for code in (SLOT_POOL, SLOT_READY, SLOT_HELD, SLOT_LENT)}
        self._lane_bytes: dict[int, bytes] = {}
        self.gen = np.zeros(n, np.int64)
        self.releases = 0
        self.arrived = np.full(n, NOT_READY, np.int64)
        self.lane_of = np.full(n, -1, np.int64)
        self.pid_of = np.zeros(n, np.int64)
        self.count = np.arange(n, dtype=np.int64)
        self._count_bytes = self.count.tobytes()  # slot i's index at bytes 8i..8i+8: a run of commits, as the ring holds it
        self.arrivals = 0
        self.n_ready = 0
        self.held = 0
        self.lent_in = bytearray(4 * n)  # the lending round each slot was lent in (see _lending)

    def pool(self) -> int:
        """How many slots are in the pool."""
        return self.where.count(SLOT_POOL)

    def lane_mark(self, i: int) -> bytes:
        """``n`` bytes of value ``i``: what ``owner`` holds over a run lent to lane ``i``."""
        mark = self._lane_bytes.get(i)
        if mark is None:
            mark = self._lane_bytes[i] = bytes([i]) * self.n
        return mark

    def mark_lent(self, first: int, m: int, lane: int, cycle: int) -> None:
        """Slots ``first .. first + m - 1`` are lent to ``lane`` in lending round ``cycle``."""
        self.where[first : first + m] = self.fill[SLOT_LENT][:m]
        self.owner[first : first + m] = self.lane_mark(lane)[:m]
        self.lent_in[4 * first : 4 * (first + m)] = cycle.to_bytes(4, "little") * m

    def lent_to(self, lane: int) -> np.ndarray:
        """The slots lent to ``lane``."""
        return np.flatnonzero((self.wv == SLOT_LENT) & (self.ov == lane))

    def accept(self, lane: ReaderLane, raw: bytes) -> int:
        """Make ``lane``'s committed slots (``raw``: native int64s) ready; return how many it was never
        lent, refused (the caller counts them as bad messages)."""
        k = len(raw) // 8
        n = self.n
        i = lane.index
        first = int.from_bytes(raw[:8], _BYTEORDER, signed=True)
        # The fast path, for a lane that behaves: a run of consecutive slots (slots are lent in
        # cyclic order, and a writer commits them in the order it took them), every one lent to it.
        if (0 <= first and first + k <= n and raw == self._count_bytes[8 * first : 8 * (first + k)]
                and self.where[first : first + k] == self.fill[SLOT_LENT][:k]
                and self.owner[first : first + k] == self.lane_mark(i)[:k]):
            run = slice(first, first + k)
            self.where[run] = self.fill[SLOT_READY][:k]
            # One number for the run: its slots are in commit order, so ties go by slot (argmin, a stable sort).
            self.arrived[run] = self.arrivals
            self.lane_of[run] = i
            self.pid_of[run] = lane.pid
            self.arrivals += k
            self.n_ready += k
            lane.given -= k
            return 0
        where, owner = self.where, self.owner
        refused = 0
        for slot in np.frombuffer(raw, np.int64).tolist():  # one by one, refusing what is not the lane's to publish
            if not (0 <= slot < n) or where[slot] != SLOT_LENT or owner[slot] != i:
                refused += 1
                continue
            where[slot] = SLOT_READY
            self.arrived[slot] = self.arrivals
            self.lane_of[slot] = i
            self.pid_of[slot] = lane.pid
            self.arrivals += 1
            self.n_ready += 1
            lane.given -= 1
        return refused

    def take_oldest(self) -> int:
        """The oldest ready slot, no longer ready (``get``: the caller holds it with :meth:`hold`)."""
        slot = int(self.arrived.argmin())
        self.arrived[slot] = NOT_READY
        self.n_ready -= 1
        return slot

    def hold(self, slot: int) -> None:
        self.where[slot] = SLOT_HELD
        self.held += 1

    def oldest(self, size: int) -> np.ndarray:
        """The ``size`` oldest ready slots, oldest first (every ready slot is older than every other)."""
        return np.argsort(self.arrived, kind="stable")[:size]

    def take_run(self, first: int, size: int) -> None:
        """Ready slots ``first .. first + size - 1`` are handed out: no longer ready."""
        self.arrived[first : first + size] = NOT_READY
        self.n_ready -= size

    def hold_run(self, first: int, size: int) -> None:
        self.where[first : first + size] = self.fill[SLOT_HELD][:size]
        self.held += size

    def release_run(self, first: int, size: int) -> None:
        """Held slots ``first .. first + size - 1`` go back to the pool, with a new generation."""
        self.releases += 1
        self.gen[first : first + size] = self.releases  # a value no handle was given: stale handles stop matching
        self.where[first : first + size] = self.fill[SLOT_POOL][:size]
        self.held -= size

    def release_ready(self, idx: np.ndarray) -> None:
        """Ready slots ``idx`` (gathered into a batch) go back to the pool, with a new generation."""
        self.arrived[idx] = NOT_READY
        self.n_ready -= len(idx)
        self.releases += 1
        self.gen[idx] = self.releases
        self.wv[idx] = SLOT_POOL
