"""A writer lane: the protocol between one writer and the reader, both halves in one place.

A pipeline has ``max_writers`` lanes. Each is a 256-byte record in the
segment, two rings of slot indices (:mod:`shmbuf._ring`), an 8 KiB mailbox
and a semaphore. A writer process claims a lane, takes free slots from the
lane's free ring, publishes committed ones on its ready ring, and posts
control messages in its mailbox. The reader adopts the lane, lends it slots,
takes its commits and messages, and takes the lane back when the writer
leaves or dies.

The record's words, and who stores each (the other side only loads it)::

    line 0 (writer)  PID, START       who holds the lane (stored before ACTIVE)
                     READY_HEAD       commits published on the ready ring
                     FREE_TAIL        slots taken from the free ring
                     FREE_WAIT        1 while the writer sleeps for want of a slot
    line 1 (reader)  READY_TAIL       commits taken in
                     FREE_HEAD        slots lent
                     WAKE_AT          ring the doorbell when READY_HEAD reaches this
                     SEEN             the EPOCH the reader adopted (the writer has been served)
    line 2 (handed)  STATE            FREE -> ACTIVE (writer, under its lock) -> RETIRED (writer)
                                      -> FREE (reader, after it took everything back)
                     EPOCH            claims so far (writer, before ACTIVE); the reader bumps
                                      it when it takes back a lane whose writer is still alive
    line 3 (writer)  LABEL_LEN, LABEL a short text for ``shmbuf ls``

Mailbox: POST and LEN and MAGIC (writer), ACK (reader, own cache line), and
the msgpack payload from byte 128.

Keys
----
EPOCH is never reset: :meth:`ReaderLane.free_lane` zeroes every other word of
the record and leaves it, and only goes up (a claim bumps it under the lane's
lock, after it saw STATE == FREE; the reader bumps it only before it stores
FREE). So two claims of one lane never hold the same EPOCH in one segment's
life. The writer keeps the EPOCH of its claim and stores it in the slot record
of every rollout it commits (``S_EPOCH``, next to ``S_SEQ``, before the ring's
fence that publishes the slot), and counts ``seq`` from 0 per claim: so
``(lane, epoch, seq)`` names one rollout for the segment's whole life, though a
writer that replaces a dead one on its lane counts ``seq`` from 0 again.

Ordering (each arrow is "visible before"; see docs/design/rings.md)
-------------------------------------------------------------------
What the machine guarantees, and why *fence* is needed only off x86-64 while the
store-load fence of *Waking* is needed everywhere: docs/design/memory-ordering.md.

- **Claim.** The writer stores PID, START, LABEL and EPOCH, *fence*, then
  STATE = ACTIVE. The reader loads STATE, *fence*, then PID and START. So a
  reader that sees ACTIVE sees who holds the lane, never a previous holder's
  pid (which would make it reclaim a live lane, or trust a dead one).
- **Reclaim.** The reader zeroes the counters and the mailbox, *fence*,
  then STATE = FREE. A writer loads STATE == FREE, takes the lock, loads
  STATE again, *fence*, then loads the counters. So a new writer never starts
  from the previous writer's counters.
- **Mailbox.** The writer loads ACK == POST, *fence* (its later payload stores
  must not pass that load), stores the payload, LEN, MAGIC, *fence*, then
  POST + 1. The reader loads POST, *fence*, loads LEN, MAGIC and the payload,
  *fence* (its loads must complete before the writer may reuse the box), then
  ACK = POST.
- **Rings.** In :mod:`shmbuf._ring`: payload, entry, *fence*, head; head,
  *fence*, entry, payload.
- **Waking** (store-load: a full barrier on every CPU).
  The reader stores WAKE_AT, *store-load fence*, loads READY_HEAD; the
  writer stores READY_HEAD, *store-load fence*, loads WAKE_AT. Whichever
  runs second sees the other's store, so a commit that reaches the quota
  either rings the doorbell or is seen by the reader before it sleeps. The
  same pair for slots: the writer stores FREE_WAIT = 1, *fence*, loads
  FREE_HEAD; the reader stores FREE_HEAD, *fence*, loads FREE_WAIT.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import posix_ipc

from shmbuf._errors import PipelineClosed, SlotTimeout
from shmbuf._ofd import LOCK_BASE, held, lock
from shmbuf._proc import start_time
from shmbuf._ring import Consumer, Fence, Producer, bump, fence, store_load_fence
from shmbuf._segment import MAILBOX_PAYLOAD_OFF, W_CLOSED, W_NEWCOMER, Plan
from shmbuf._sem import Sem
from shmbuf._validate import timeout_setting

# Blocking waits sleep in slices this long, so that a dead peer or a closed pipeline is noticed
# within one slice (the reliability promise is 2 s). Writer and reader both use it.
WAIT_SLICE = 0.1

# The record's words, relative to the lane's first word (the table in the module doc).
L_PID, L_START, L_READY_HEAD, L_FREE_TAIL, L_FREE_WAIT = 0, 1, 2, 3, 4  # line 0: the writer's
L_READY_TAIL, L_FREE_HEAD, L_WAKE_AT, L_SEEN = 8, 9, 10, 11  # line 1: the reader's
L_STATE, L_EPOCH = 16, 17  # line 2: handed over
L_LABEL_LEN, L_LABEL = 24, 25  # line 3: the writer's label, a length word then the bytes
LABEL_BYTES = 48
LANE_FREE, LANE_ACTIVE, LANE_RETIRED = 0, 1, 2
NEVER = 1 << 62  # WAKE_AT while the reader is awake: it will look anyway, so commits post nothing

# Mailbox words (relative to the mailbox's first word).
M_POST, M_LEN, M_MAGIC, M_ACK = 0, 1, 2, 8
MSG_MAGIC = 0x53424D5300000001  # "SBMS", version 1

def check_timeout(value: Any, setting: str) -> float | None:
    """A wait's bound, by the one rule of :func:`shmbuf._validate.timeout_setting` (kept for its importers)."""
    return timeout_setting(setting, value)




class Record:
    """The absolute word indices of one lane's record, rings and mailbox: computed once per lane."""

    __slots__ = ("index", "pid", "start", "ready_head", "free_tail", "free_wait", "ready_tail", "free_head",
                 "wake_at", "seen", "state", "epoch", "label_len", "label_byte", "ready_ring", "free_ring", "cap",
                 "mbox_byte", "post", "length", "magic", "ack")

    def __init__(self, plan: Plan, lane: int):
        lw = plan.lane_word(lane)
        self.index = lane
        self.pid, self.start = lw + L_PID, lw + L_START
        self.ready_head, self.free_tail, self.free_wait = lw + L_READY_HEAD, lw + L_FREE_TAIL, lw + L_FREE_WAIT
        self.ready_tail, self.free_head = lw + L_READY_TAIL, lw + L_FREE_HEAD
        self.wake_at, self.seen = lw + L_WAKE_AT, lw + L_SEEN
        self.state, self.epoch = lw + L_STATE, lw + L_EPOCH
        self.label_len, self.label_byte = lw + L_LABEL_LEN, (lw + L_LABEL) * 8
        self.ready_ring, self.free_ring, self.cap = plan.ready_ring_word(lane), plan.free_ring_word(lane), plan.n_slots
        self.mbox_byte = plan.mbox_off_of(lane)
        mw = self.mbox_byte // 8
        self.post, self.length, self.magic, self.ack = mw + M_POST, mw + M_LEN, mw + M_MAGIC, mw + M_ACK


def read_label(mm: Any, w: memoryview, rec: Record) -> str:
    """A writer's label, its length clamped: the bytes are the writer's, not trusted."""
    n = min(max(w[rec.label_len], 0), LABEL_BYTES)
    return bytes(mm[rec.label_byte : rec.label_byte + n]).decode(errors="replace")


def _lock(fd: int, lane: int, kind: int) -> None:
    lock(fd, LOCK_BASE + lane, kind)  # lane locks sit on bytes past the end of any real segment


def lane_held(fd: int, lane: int) -> bool | None:
    """Does a writer's process still hold the lane's lock? None where the kernel cannot say.

    This is the reader's test of a writer's life. The kernel drops the lock when the last
    descriptor of the writer's description closes, which is when its process exits (the
    descriptor is close-on-exec, and a forked child closes its copy at once). Unlike a pid, it
    means the same thing in every pid namespace, and no other process can inherit it by reuse.
    """
    return held(fd, LOCK_BASE + lane)


# ------------------------------------------------------------------ writer half


class WriterLane:
    """The writer's half: claim, take slots, publish commits, post messages, retire.

    Args to :meth:`claim`: ``reader_alive`` is called between waits, and
    raises :class:`BrokenPipeline` when the reader's process is gone.
    """

    __slots__ = ("name", "rec", "w", "mm", "fd", "doorbell", "sem", "ready", "free", "epoch", "_fence", "_sl_fence")

    def __init__(self, name: str, rec: Record, w: memoryview, mm: Any, fd: int, doorbell: Sem,
                 sem: Sem):
        self.name = name
        self.rec = rec
        self.w = w
        self.mm = mm
        self.fd = fd
        self.doorbell = doorbell
        self.sem = sem
        self._fence: Fence | None = fence()
        self._sl_fence = store_load_fence()
        if self._fence:  # STATE == FREE was loaded (under our lock) before the counters below
            self._fence()
        self.ready = Producer(w, rec.ready_ring, rec.cap, rec.ready_head, rec.ready_tail)
        self.free = Consumer(w, rec.free_ring, rec.cap, rec.free_head, rec.free_tail)
        self.epoch = w[rec.epoch]

    @classmethod
    def claim(cls, name: str, plan: Plan, w: memoryview, mm: Any, fd: int, doorbell: Sem,
              open_sem: Callable[[int], Sem], label: str, timeout: float | None,
              reader_alive: Callable[[], None]) -> WriterLane:
        """Take a free lane: an open-file-description lock on the lane's byte of ``fd``, which dies with us.

        Raises PipelineClosed, SlotTimeout (every lane taken), BrokenPipeline (the reader died).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        f = fence()
        pid = os.getpid()
        while True:
            for lane in range(plan.n_lanes):
                rec = Record(plan, lane)
                if w[rec.state] != LANE_FREE:
                    continue
                try:
                    _lock(fd, lane, fcntl.F_WRLCK)
                except OSError:
                    continue  # another writer holds it
                if w[rec.state] != LANE_FREE:  # retired by its writer between our look and our lock
                    _lock(fd, lane, fcntl.F_UNLCK)
                    continue
                try:
                    sem = open_sem(lane)
                except BaseException:
                    _lock(fd, lane, fcntl.F_UNLCK)
                    raise
                w[rec.pid] = pid
                w[rec.start] = start_time(pid)
                raw = str(label).encode()[:LABEL_BYTES]
                mm[rec.label_byte : rec.label_byte + len(raw)] = raw
                w[rec.label_len] = len(raw)
                bump(w, rec.epoch)
                if f:  # who holds the lane before the lane says it is held
                    f()
                w[rec.state] = LANE_ACTIVE
                # Tell the reader now rather than at its next periodic scan: it lends slots only to
                # lanes it knows. A flag, not a count: at worst a second newcomer waits for that scan.
                w[W_NEWCOMER] = 1
                doorbell.release()
                return cls(name, rec, w, mm, fd, doorbell, sem)
            if w[W_CLOSED]:
                raise PipelineClosed(f"pipeline {name} is closed")
            if deadline is not None and time.monotonic() >= deadline:
                raise SlotTimeout(
                    f"pipeline {name}: all {plan.n_lanes} writer lanes are taken (max_writers={plan.n_lanes} at "
                    f"shmbuf.create) and none came free within Writer(timeout={timeout})"
                )
            reader_alive()
            time.sleep(0.01)

    # -- per rollout ----------------------------------------------------------

    def publish(self, slot: int) -> None:
        """Put a committed slot on the ready ring and ring the doorbell if the reader asked for it.

        The caller stored the slot's data and metadata first; the ring's fence orders them before
        the head that publishes the entry.
        """
        ready = self.ready
        ready.push(slot)
        self._sl_fence()  # our head store before our load of WAKE_AT (see Waking)
        if self.w[self.rec.wake_at] <= ready.head:
            self.doorbell.release()

    def take(self) -> int:
        """The next lent slot; call after :meth:`has_free` (or :meth:`wait`) said there is one."""
        if self._fence:  # FREE_HEAD before the entry it covers
            self._fence()
        return self.free.pop()

    def has_free(self) -> bool:
        return self.free.available() > 0

    def wait(self, deadline: float | None, on_slice: Callable[[], None], never_served: Callable[[], str]) -> None:
        """Sleep until the reader lends a slot; ``on_slice`` runs between sleeps (closed? reader alive?)."""
        w, flag = self.w, self.rec.free_wait
        try:
            while True:
                wait = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
                if wait <= 0:
                    raise SlotTimeout(never_served())
                # Say we sleep, then look once more (see Waking in the module doc).
                w[flag] = 1
                self._sl_fence()
                if self.free.available() > 0:
                    return
                try:
                    self.sem.acquire(wait)  # a spare post from an earlier round only means one more look
                except posix_ipc.BusyError:
                    pass
                w[flag] = 0
                on_slice()
                if self.free.available() > 0:
                    return
        finally:
            w[flag] = 0

    def served(self) -> bool:
        """True once the reader has adopted this claim of the lane (it lends slots only after that)."""
        return self.w[self.rec.seen] == self.epoch

    def taken_back(self) -> bool:
        """True if the reader took the lane back from us (it found the lane's words corrupt)."""
        return self.w[self.rec.epoch] != self.epoch

    # -- messages and leaving -------------------------------------------------

    def post(self, payload: bytes, wait: float, gone: Callable[[], bool]) -> bool:
        """Put one message in the mailbox; False if the reader did not take the last one within
        ``wait`` seconds, or ``gone()`` said the reader closed the pipeline or died."""
        w, rec = self.w, self.rec
        deadline = time.monotonic() + wait
        checked = time.monotonic()
        while w[rec.ack] != w[rec.post]:
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - checked > WAIT_SLICE or w[W_CLOSED]:
                if gone():
                    return False
                checked = now
            time.sleep(0.001)
        if self._fence:  # the reader's ACK before our payload stores
            self._fence()
        off = rec.mbox_byte + MAILBOX_PAYLOAD_OFF
        self.mm[off : off + len(payload)] = payload
        w[rec.length] = len(payload)
        w[rec.magic] = MSG_MAGIC
        if self._fence:  # payload, length and magic before the count that publishes them
            self._fence()
        bump(w, rec.post)
        self.doorbell.release()
        return True

    def retire(self) -> None:
        """Hand the lane back; the reader delivers what was committed and takes back the rest."""
        if self._fence:  # every commit and message before the state that says we are gone
            self._fence()
        self.w[self.rec.state] = LANE_RETIRED
        self.doorbell.release()


# ------------------------------------------------------------------ reader half


class ReaderLane:
    """The reader's half of one active lane: adopt, take commits and mail, lend slots, wake, free."""

    __slots__ = ("rec", "w", "wn", "ready", "free", "sem", "pid", "start", "label", "given", "turn", "stats", "_fence")

    def __init__(self, rec: Record, w: memoryview, wn: np.ndarray, mm: Any, sem: Sem):
        self.rec = rec
        self.w = w
        self.wn = wn  # the same words as an int64 array: slots are taken and lent in bulk
        self._fence = fence()
        if self._fence:  # STATE == ACTIVE (our caller's load) before who holds the lane
            self._fence()
        self.ready = Consumer(w, rec.ready_ring, rec.cap, rec.ready_head, rec.ready_tail)
        self.free = Producer(w, rec.free_ring, rec.cap, rec.free_head, rec.free_tail)
        self.sem = sem
        self.pid = w[rec.pid]
        self.start = w[rec.start]
        self.label = read_label(mm, w, rec)
        self.given = 0  # slots lent and not yet back as commits (in the ring, or in the writer's hands)
        self.turn = 0  # the lender's count of lendings when it last lent to this lane (0: never): ties go round
        self.stats: dict[str, Any] = {}
        w[rec.seen] = w[rec.epoch]

    @property
    def index(self) -> int:
        return self.rec.index

    def take_commits(self) -> bytes | None:
        """Every slot the writer published since the last call, as raw native int64s (checked by the
        caller), or None."""
        n = self.ready.available()
        if not n:
            return None
        if self._fence:  # READY_HEAD before the entries and the slot data it covers
            self._fence()
        return self.ready.pop_many(n)

    def queued(self) -> int:
        """Slots lent and not yet taken by the writer."""
        return self.free.head - self.w[self.rec.free_tail]

    def untaken(self) -> set[int]:
        """The slots still in the free ring (for reclaiming); empty if the counters are corrupt."""
        w, rec = self.w, self.rec
        tail, head = w[rec.free_tail], self.free.head
        if not 0 <= head - tail <= rec.cap:
            return set()
        return {w[rec.free_ring + k % rec.cap] for k in range(tail, head)}

    def lend(self, slots: np.ndarray) -> None:
        self.free.push_many(self.wn, slots)
        self.given += len(slots)

    def arm(self, quota: int) -> None:
        """Ask for the doorbell once ``quota`` more commits are published (caller fences, then looks)."""
        self.w[self.rec.wake_at] = min(self.ready.tail + quota, 2**63 - 1)  # a tail scribbled to the top of int64

    def disarm(self) -> None:
        self.w[self.rec.wake_at] = NEVER

    def has_mail(self) -> bool:
        return self.w[self.rec.post] != self.w[self.rec.ack]

    def take_mail(self, mm: Any, max_len: int) -> bytes | None:
        """The mailbox's payload (None if its header is malformed), and the ACK that frees the box."""
        w, rec = self.w, self.rec
        post = w[rec.post]
        if self._fence:  # POST before the length, magic and payload it publishes
            self._fence()
        length, magic = w[rec.length], w[rec.magic]
        data = None
        if magic == MSG_MAGIC and 0 < length <= max_len:
            off = rec.mbox_byte + MAILBOX_PAYLOAD_OFF
            data = bytes(mm[off : off + length])
        if self._fence:  # our loads of the payload before the ACK that lets the writer reuse the box
            self._fence()
        w[rec.ack] = post
        return data

    def free_lane(self, taken_back: bool) -> None:
        """Reset the record for the next writer, then mark it FREE (the last store).

        ``taken_back``: the writer may still be alive (the lane was corrupt); bump EPOCH so that it
        learns at its next commit or wait that the lane is no longer its own.
        """
        w, rec = self.w, self.rec
        while True:  # drain posts the writer never took
            try:
                self.sem.acquire(0)
            except posix_ipc.BusyError:
                break
        for word in (rec.ready_head, rec.ready_tail, rec.free_head, rec.free_tail, rec.free_wait, rec.pid, rec.start,
                     rec.wake_at, rec.seen, rec.label_len, rec.post, rec.ack):
            w[word] = 0
        if taken_back:
            bump(w, rec.epoch)
        if self._fence:  # the reset words before the state that lets a new writer read them
            self._fence()
        w[rec.state] = LANE_FREE


def wake_waiting(lanes: list[ReaderLane], sl_fence: Fence) -> None:
    """After lending to ``lanes``: post the semaphore of each whose writer sleeps for want of a slot.

    One store-load fence for all: our FREE_HEAD stores before our loads of FREE_WAIT (see Waking).
    """
    if not lanes:
        return
    sl_fence()
    for lane in lanes:
        if lane.w[lane.rec.free_wait]:
            lane.sem.release()
