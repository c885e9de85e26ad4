"""One POSIX shared-memory object per pipeline: header, lane table, rings, mailboxes, slot table, slot data.

Layout (every region 64-byte aligned, offsets in bytes)::

    0      header    magic, layout version, sizes, owner pid, token; last word: owner's pid namespace
    256    live      closed flag, reader counters (one cache line each side)
    ...    schema    msgpack bytes
    ...    lanes     n_lanes x LANE_BYTES: writer-owned line, reader-owned line, state line
    ...    rings     n_lanes x (ready ring, free ring), n_slots int64 each
    ...    mailboxes n_lanes x MAILBOX_BYTES: msgpack control messages
    ...    slots     n_slots x slot record: generation, state, meta, fill counts
    ...    data      leaf-major: for each leaf, n_slots x leaf.stride bytes

Everything after the header is a pure function of (schema, n_slots, n_lanes):
:func:`plan` computes it, the creator writes it, and an attaching process
recomputes it from those three inputs and refuses the segment unless every
header field and the object's real size agree. So no offset read from shared
memory is ever trusted before it has been checked against the mapping.

Before any of that, the name is checked (:mod:`shmbuf._names`) and the file is
opened through the trust checks (:mod:`shmbuf._trust`); creating, mapping and the
header's common head are :mod:`shmbuf._shm`'s. See docs/design/segment.md.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass

import numpy as np

from shmbuf._errors import SegmentError
from shmbuf._schema import Schema
from shmbuf._shm import PIDNS_OFF
from shmbuf._substrate import (
    ALIGN,
    HEAD,
    HEADER_BYTES,
    PREFIX,
    SHM_DIR,
    WEIGHTS_PREFIX,
    Owner,
    align,
    check_head,
    check_name,
    check_semaphore,
    create_object,
    fmt_bytes,
    map_object,
    new_name,
    open_object,
    path_problem,
    pinned,
    populated,
    sem_name,
    this_process,
    unlink_object,
    unlink_semaphore,
    unmap,
    write_header,
)
from shmbuf._trust import why_untrusted
from shmbuf._validate import int_setting

# With the names that lived here before the substrate was split, still importable from here for
# shmbuf._writer and the tests (new code imports those from shmbuf._substrate).
__all__ = [
    "HEAD", "HEADER_BYTES", "LANE_BYTES", "LAYOUT_VERSION", "LIVE_BYTES", "LIVE_OFF", "MAGIC", "MAILBOX_BYTES",
    "MAILBOX_PAYLOAD_OFF", "MAX_LANES", "MAX_SLOTS", "PIDNS_OFF", "PREFIX", "SHM_DIR", "SLOT_META_WORDS", "S_COMMIT_NS",
    "S_EPOCH", "S_FILL", "S_POLICY", "S_SEQ", "WEIGHTS_PREFIX", "W_BAD_MESSAGES", "W_CLOSED", "W_DELIVERED",
    "W_LANES_RECLAIMED", "W_NEWCOMER", "W_PARTIAL_DROPPED", "W_POOL", "W_READY_DEPTH", "Plan", "Segment", "check_name",
    "check_semaphore", "new_name", "open_object", "path_problem", "pinned", "plan", "read_header", "sem_name",
    "unlink_all", "why_untrusted",
]

MAGIC = b"\x89SHMBUF\n"
LAYOUT_VERSION = 3  # 2: the creator's pid namespace in the header's last word; the lane record's SEEN word;
# 3: the slot record's EPOCH word (a writer of version 2 would leave it stale, so rollout keys could repeat)
# <magic, version, header bytes, total, owner pid, owner start, created ns,
#  n_slots, n_lanes, schema off, schema len, token, schema fingerprint>
_HEADER = struct.Struct("<8sIIQQQQIIQQ16s16s")
LIVE_OFF = 256  # words written after creation: see the W_* indices
LIVE_BYTES = 256
LANE_BYTES = 256
MAILBOX_BYTES = 8192
MAILBOX_PAYLOAD_OFF = 128
SLOT_META_WORDS = 8
MAX_SLOTS = 1 << 20
MAX_LANES = 256

# Live words (index into the int64 word view of the whole segment).
W_CLOSED = LIVE_OFF // 8 + 0  # 0 open, 1 closed by the reader
W_NEWCOMER = LIVE_OFF // 8 + 1  # set by a writer that just took a lane; the reader clears it and scans
W_DELIVERED = LIVE_OFF // 8 + 8  # reader-owned counters start on their own cache line
W_PARTIAL_DROPPED = LIVE_OFF // 8 + 9
W_BAD_MESSAGES = LIVE_OFF // 8 + 10
W_LANES_RECLAIMED = LIVE_OFF // 8 + 11
W_READY_DEPTH = LIVE_OFF // 8 + 12
W_POOL = LIVE_OFF // 8 + 13

# The lane record's words (LANE_BYTES each, one per writer lane) are shmbuf._lane's: its module doc
# says which side stores each.

# Slot record words (relative to the slot's first word), written by the committing writer. It
# stores only what the reader cannot know: the lane and pid follow from the ring the slot
# arrives on, and the slot's generation lives in the reader's own table (word 0 is reserved).
# EPOCH is the writer's claim of its lane (the lane record's EPOCH when it claimed it), so that
# (lane, epoch, seq) names one rollout for the segment's whole life, across writers that come and go.
S_SEQ, S_COMMIT_NS, S_POLICY, S_EPOCH = 1, 2, 3, 4
S_FILL = SLOT_META_WORDS  # one word per timescale


@dataclass(frozen=True)
class Plan:
    """Every offset and size of a segment, derived from (schema, n_slots, n_lanes)."""

    n_slots: int
    n_lanes: int
    schema_off: int
    schema_len: int
    lanes_off: int
    rings_off: int
    ring_bytes: int  # one ring: n_slots int64, aligned
    mbox_off: int
    slots_off: int
    slot_bytes: int
    data_off: int
    leaf_offs: tuple[int, ...]  # absolute offset of each leaf's region, schema order
    total: int

    def lane_word(self, lane: int) -> int:
        return (self.lanes_off + lane * LANE_BYTES) // 8

    def ready_ring_word(self, lane: int) -> int:
        return (self.rings_off + lane * 2 * self.ring_bytes) // 8

    def free_ring_word(self, lane: int) -> int:
        return (self.rings_off + (lane * 2 + 1) * self.ring_bytes) // 8

    def mbox_off_of(self, lane: int) -> int:
        return self.mbox_off + lane * MAILBOX_BYTES

    def slot_word(self, slot: int) -> int:
        return (self.slots_off + slot * self.slot_bytes) // 8


def plan(schema: Schema, n_slots: int, n_lanes: int) -> Plan:
    schema_len = len(schema.to_msgpack())
    schema_off = HEADER_BYTES + LIVE_BYTES
    lanes_off = align(schema_off + schema_len)
    rings_off = lanes_off + n_lanes * LANE_BYTES
    ring_bytes = align(n_slots * 8)
    mbox_off = rings_off + 2 * n_lanes * ring_bytes
    slots_off = mbox_off + n_lanes * MAILBOX_BYTES
    slot_bytes = align((SLOT_META_WORDS + len(schema.timescales)) * 8)
    off = data_off = align(slots_off + n_slots * slot_bytes)
    leaf_offs = []
    for leaf in schema.leaves:
        leaf_offs.append(off)
        off += n_slots * leaf.stride
    total = align(off)
    return Plan(n_slots, n_lanes, schema_off, schema_len, lanes_off, rings_off, ring_bytes, mbox_off, slots_off,
                slot_bytes, data_off, tuple(leaf_offs), total)


class Segment:
    """A mapped shmbuf segment: the mapping, an int64 word view, its checked plan, and its open file.

    ``create`` makes a new one (owner-only, space reserved, pages faulted in);
    ``attach`` opens an existing one by name without following links, refuses
    anything but a 0600 regular file of this user, maps it and checks its
    header against the plan recomputed from the schema it carries. ``close``
    unmaps and closes the file (detach); ``unlink`` removes the name (destroy)
    and is the owner's alone.

    ``fd`` stays open while attached (a writer takes its lane lock on it, and
    the lock dies with it); ``creator`` is the process that made the segment.
    """

    def __init__(self, name: str, mm: mmap.mmap, schema: Schema, p: Plan, owner: bool, fd: int = -1,
                 creator: Owner | None = None):
        self.name = name
        self.mm = mm
        self.schema = schema
        self.plan = p
        self.owner = owner
        self.fd = fd
        self.creator = creator or this_process()
        self.words = memoryview(mm).cast("q")  # read-only when the mapping is
        # Every array on the slots is built on this: it keeps the mapping alive while any of them lives.
        self.base = pinned(mm)
        self._closed = False

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def create(cls, schema: Schema, n_slots: int, n_lanes: int, name: str | None = None, *, keep: bool = False) -> Segment:
        """A new segment; ``keep``: left in /dev/shm if this process dies without unlinking it (``keep_on_crash``)."""
        n_slots = int_setting("shmbuf.create(slots=...)", n_slots, 1, MAX_SLOTS)
        n_lanes = int_setting("shmbuf.create(max_writers=...)", n_lanes, 1, MAX_LANES)
        name = new_name() if name is None else check_name(name)
        p = plan(schema, n_slots, n_lanes)
        fd, mm = create_object(name, p.total, f"{n_slots} slots x {fmt_bytes(p.total / n_slots)} per slot", populate=True,
                               keep=keep)
        me = this_process()
        packed = schema.to_msgpack()
        header = _HEADER.pack(MAGIC, LAYOUT_VERSION, HEADER_BYTES, p.total, me.pid, me.start, time.time_ns(), n_slots,
                              n_lanes, p.schema_off, p.schema_len, name[len(PREFIX):].encode(), schema.fingerprint.encode())
        write_header(mm, header)
        mm[p.schema_off : p.schema_off + len(packed)] = packed
        return cls(name, mm, schema, p, owner=True, fd=fd, creator=me)

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False) -> Segment:
        """Open, check and map the pipeline ``name``; SegmentError (or UsageError for a malformed name) if it is not one.

        The header and schema are checked on a plain mapping; only a segment that passed is
        mapped again with its pages faulted in (not for ``readonly``, which ``shmbuf ls`` uses).
        """
        check_name(name)
        fd, mm = map_object(name, readonly=readonly, min_size=HEADER_BYTES + LIVE_BYTES, what="shmbuf segment")
        try:
            schema, p, creator = read_header(mm, name)
            if not readonly:
                mm = populated(fd, mm)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        return cls(name, mm, schema, p, owner=False, fd=fd, creator=creator)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the file and unmap this process's view (detach); arrays still held keep the mapping until they go."""
        if self._closed:
            return
        self._closed = True
        self.words.release()
        del self.base
        unmap(self.mm)  # arrays on the slots that still exist (see pinned) keep it until the last of them goes
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unlink(self) -> None:
        """Remove the segment's name and its semaphores (destroy). The owner's call alone."""
        unlink_all(self.name, self.plan.n_lanes)

    # -- views --------------------------------------------------------------

    def leaf_view(self, leaf_index: int) -> np.ndarray:
        """The leaf of every slot: shape (n_slots, *leaf.shape), slot stride leaf.stride."""
        leaf = self.schema.leaves[leaf_index]
        strides = (leaf.stride, *np.empty(leaf.shape, leaf.dtype).strides) if leaf.shape else (leaf.stride,)
        return np.ndarray((self.plan.n_slots, *leaf.shape), leaf.dtype, buffer=self.base,
                          offset=self.plan.leaf_offs[leaf_index], strides=strides)

    def bytes_at(self, off: int, n: int) -> bytes:
        return bytes(self.mm[off : off + n])


def read_header(mm: mmap.mmap, name: str) -> tuple[Schema, Plan, Owner]:
    """Check a mapping's header field by field; return its schema, plan and creator, or raise SegmentError."""
    size = len(mm)
    creator = check_head(mm, name, magic=MAGIC, version=LAYOUT_VERSION, what="shmbuf segment")
    (_magic, _version, _hbytes, _total, _pid, _start, _created, n_slots, n_lanes, schema_off, schema_len,
     _token, fingerprint) = _HEADER.unpack_from(mm, 0)
    if not (1 <= n_slots <= MAX_SLOTS and 1 <= n_lanes <= MAX_LANES):
        raise SegmentError(f"{name}: header declares {n_slots} slots and {n_lanes} lanes (limits {MAX_SLOTS}, {MAX_LANES})")
    if schema_off != HEADER_BYTES + LIVE_BYTES or not 0 < schema_len <= size - schema_off:
        raise SegmentError(f"{name}: schema at [{schema_off}, +{schema_len}) lies outside the {size}-byte segment")
    schema = Schema.from_msgpack(bytes(mm[schema_off : schema_off + schema_len]))
    if schema.fingerprint.encode() != fingerprint:
        raise SegmentError(f"{name}: the schema's fingerprint {schema.fingerprint} is not the header's {fingerprint!r}: corrupt")
    p = plan(schema, n_slots, n_lanes)
    if p.total != size or p.schema_len != schema_len:
        raise SegmentError(f"{name}: the schema and counts call for {p.total} bytes, the segment has {size}")
    return schema, p, creator


def unlink_all(name: str, n_lanes: int) -> None:
    """Remove a segment and every semaphore named after it; what is already gone is fine (never follows a link)."""
    check_name(name)
    for s in [sem_name(name, "r")] + [sem_name(name, f"f{i}") for i in range(n_lanes)]:
        unlink_semaphore(s)
    unlink_object(name)


assert ALIGN == 64
assert _HEADER.format.startswith(HEAD.format) and _HEADER.size <= PIDNS_OFF  # the shared head, then room for pidns
