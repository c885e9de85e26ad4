"""One POSIX shared-memory object per pipeline: header, lane table, rings, mailboxes, slot table, slot data.

Layout (every region 64-byte aligned, offsets in bytes)::

    0      header    magic, layout version, sizes, owner pid, token
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
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np
import posix_ipc

from shmbuf._errors import NoSpace, SegmentError
from shmbuf._proc import start_time
from shmbuf._schema import ALIGN, Schema, _align

PREFIX = "/shmbuf-"
MAGIC = b"\x89SHMBUF\n"
LAYOUT_VERSION = 1
# <magic, version, header bytes, total, owner pid, owner start, created ns,
#  n_slots, n_lanes, schema off, schema len, token, schema fingerprint>
_HEADER = struct.Struct("<8sIIQQQQIIQQ16s16s")
HEADER_BYTES = 256
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

# Lane record words (relative to the lane's first word).
# Line 0, written only by the lane's writer (its ready head counts its commits). L_FREE_WAIT:
# 1 while the writer sleeps for want of a slot, so that the reader posts only then.
L_PID, L_START, L_READY_HEAD, L_FREE_TAIL, L_FREE_WAIT = 0, 1, 2, 3, 4
# Line 1, written only by the reader. L_WAKE_AT: ring the doorbell when the ready head reaches
# this (0: always, the safe default; NEVER: the reader is busy and will look anyway).
L_READY_TAIL, L_FREE_HEAD, L_WAKE_AT = 8, 9, 10
NEVER = 1 << 62
# Line 2, handed over between them (see docs/design/rings.md):
L_STATE, L_EPOCH = 16, 17
# Line 3, the writer's label (written before the lane turns ACTIVE): a length word, then the bytes.
L_LABEL_LEN, L_LABEL = 24, 25
LABEL_BYTES = 48
LANE_FREE, LANE_ACTIVE, LANE_RETIRED = 0, 1, 2

# Slot record words (relative to the slot's first word), written by the committing writer. It
# stores only what the reader cannot know: the lane and pid follow from the ring the slot
# arrives on, and the slot's generation lives in the reader's own table (word 0 is reserved).
S_SEQ, S_COMMIT_NS, S_POLICY = 1, 2, 3
S_FILL = SLOT_META_WORDS  # one word per timescale
SLOT_POOL, SLOT_LANE, SLOT_READY, SLOT_HELD = 0, 1, 2, 3  # the reader's private bookkeeping


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
    lanes_off = _align(schema_off + schema_len)
    rings_off = lanes_off + n_lanes * LANE_BYTES
    ring_bytes = _align(n_slots * 8)
    mbox_off = rings_off + 2 * n_lanes * ring_bytes
    slots_off = mbox_off + n_lanes * MAILBOX_BYTES
    slot_bytes = _align((SLOT_META_WORDS + len(schema.timescales)) * 8)
    off = data_off = _align(slots_off + n_slots * slot_bytes)
    leaf_offs = []
    for leaf in schema.leaves:
        leaf_offs.append(off)
        off += n_slots * leaf.stride
    total = _align(off)
    return Plan(n_slots, n_lanes, schema_off, schema_len, lanes_off, rings_off, ring_bytes, mbox_off, slots_off,
                slot_bytes, data_off, tuple(leaf_offs), total)


def new_name() -> str:
    """``/shmbuf-`` and 16 hex digits (64 random bits): 24 characters, room for suffixes under macOS's 31."""
    return PREFIX + secrets.token_hex(8)


def sem_name(name: str, role: str) -> str:
    """Semaphore names derive from the segment's: ``-r`` the doorbell, ``-f<lane>`` a lane's free count."""
    return f"{name}-{role}"


def _shm_dir_free() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _no_space(name: str, need: int, detail: str) -> NoSpace:
    free = _shm_dir_free()
    have = f"/dev/shm has {_fmt_bytes(free)} free" if free is not None else "shared memory is full"
    return NoSpace(
        f"pipeline {name} needs {_fmt_bytes(need)} of shared memory ({detail}) but {have}. "
        "Use fewer slots or a smaller example, or give /dev/shm more room "
        "(docker run --shm-size=<size>, or: mount -o remount,size=<size> /dev/shm)."
    )


class Segment:
    """A mapped shmbuf segment: the mapping, an int64 word view, and its checked plan.

    ``create`` makes a new one (owner-only, space reserved, pages faulted in);
    ``attach`` maps an existing one by name and checks its header against the
    plan recomputed from the schema it carries. ``close`` unmaps (detach);
    ``unlink`` removes the name (destroy) and is the owner's alone.
    """

    def __init__(self, name: str, mm: mmap.mmap, schema: Schema, p: Plan, owner: bool):
        self.name = name
        self.mm = mm
        self.schema = schema
        self.plan = p
        self.owner = owner
        self.words = memoryview(mm).cast("q")  # read-only when the mapping is
        self._closed = False

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def create(cls, schema: Schema, n_slots: int, n_lanes: int, name: str | None = None) -> Segment:
        if not isinstance(n_slots, int) or not 1 <= n_slots <= MAX_SLOTS:
            raise ValueError(f"slots: expected an int from 1 to {MAX_SLOTS}, got {n_slots!r}")
        if not isinstance(n_lanes, int) or not 1 <= n_lanes <= MAX_LANES:
            raise ValueError(f"max_writers: expected an int from 1 to {MAX_LANES}, got {n_lanes!r}")
        name = name or new_name()
        if not name.startswith(PREFIX) or len(name) > 24:
            raise ValueError(f"name: expected '{PREFIX}' and up to 16 more characters, got {name!r}")
        p = plan(schema, n_slots, n_lanes)
        free = _shm_dir_free()
        if free is not None and p.total > free:
            raise _no_space(name, p.total, f"{n_slots} slots x {_fmt_bytes(p.total / n_slots)} per slot")
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        try:
            try:
                os.posix_fallocate(shm.fd, 0, p.total)
            except OSError as exc:
                raise _no_space(name, p.total, f"{n_slots} slots") from exc
            # MAP_POPULATE faults every page in now, so no actor pays first-touch
            # faults (~1.4 GB/s here, against ~10+ GB/s warm) inside a rollout.
            mm = mmap.mmap(shm.fd, p.total, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        packed = schema.to_msgpack()
        header = _HEADER.pack(MAGIC, LAYOUT_VERSION, HEADER_BYTES, p.total, os.getpid(), start_time(os.getpid()),
                              time.time_ns(), n_slots, n_lanes, p.schema_off, p.schema_len, name[len(PREFIX):].encode(),
                              schema.fingerprint.encode())
        mm[: len(header)] = header
        mm[p.schema_off : p.schema_off + len(packed)] = packed
        return cls(name, mm, schema, p, owner=True)

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False) -> Segment:
        if not isinstance(name, str) or not name.startswith(PREFIX):
            raise SegmentError(f"expected a shmbuf pipeline name starting with '{PREFIX}', got {name!r}")
        try:
            shm = posix_ipc.SharedMemory(name, 0)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"no pipeline named {name!r}: it was never created, or its owner closed it") from None
        except posix_ipc.PermissionsError:
            raise SegmentError(f"pipeline {name!r} belongs to another user (segments are owner-only, mode 0600)") from None
        try:
            size = os.fstat(shm.fd).st_size
            if size < HEADER_BYTES + LIVE_BYTES:
                raise SegmentError(f"{name}: {size} bytes is too small to be a shmbuf segment")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | (0 if readonly else _POPULATE), prot=prot)
        finally:
            shm.close_fd()
        try:
            schema, p = read_header(mm, name)
        except BaseException:
            mm.close()
            raise
        return cls(name, mm, schema, p, owner=False)

    def close(self) -> None:
        """Unmap this process's view (detach). Views still held elsewhere keep the mapping alive."""
        if self._closed:
            return
        self._closed = True
        self.words.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # numpy views of the slots still exist; the mapping goes when they do

    def unlink(self) -> None:
        """Remove the segment's name and its semaphores (destroy). The owner's call alone."""
        unlink_all(self.name, self.plan.n_lanes)

    # -- views --------------------------------------------------------------

    def leaf_view(self, leaf_index: int) -> np.ndarray:
        """The leaf of every slot: shape (n_slots, *leaf.shape), slot stride leaf.stride."""
        leaf = self.schema.leaves[leaf_index]
        strides = (leaf.stride, *np.empty(leaf.shape, leaf.dtype).strides) if leaf.shape else (leaf.stride,)
        return np.ndarray((self.plan.n_slots, *leaf.shape), leaf.dtype, buffer=self.mm,
                          offset=self.plan.leaf_offs[leaf_index], strides=strides)

    def bytes_at(self, off: int, n: int) -> bytes:
        return bytes(self.mm[off : off + n])


def read_header(mm: mmap.mmap, name: str) -> tuple[Schema, Plan]:
    """Check a mapping's header field by field; return its schema and plan, or raise SegmentError."""
    size = len(mm)
    try:
        (magic, version, hbytes, total, _pid, _start, _created, n_slots, n_lanes, schema_off, schema_len,
         _token, fingerprint) = _HEADER.unpack_from(mm, 0)
    except struct.error:
        raise SegmentError(f"{name}: header is truncated") from None
    if magic != MAGIC:
        raise SegmentError(f"{name}: not a shmbuf segment (magic {magic!r}, expected {MAGIC!r})")
    if version != LAYOUT_VERSION:
        raise SegmentError(
            f"{name}: layout version {version}, this shmbuf reads version {LAYOUT_VERSION}; "
            "use the same shmbuf version in every process of a pipeline"
        )
    if hbytes != HEADER_BYTES or total != size:
        raise SegmentError(f"{name}: header says {hbytes}-byte header and {total} bytes in all, the object has {size} bytes")
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
    return schema, p


def header_fields(mm: mmap.mmap) -> dict[str, int | bytes]:
    """The raw header fields (for ``shmbuf ls``); call read_header first to trust them."""
    keys = ("magic", "version", "header_bytes", "total", "owner_pid", "owner_start", "created_ns", "n_slots",
            "n_lanes", "schema_off", "schema_len", "token", "fingerprint")
    return dict(zip(keys, _HEADER.unpack_from(mm, 0)))


def unlink_all(name: str, n_lanes: int) -> None:
    """Remove a segment and every semaphore named after it; what is already gone is fine."""
    names = [sem_name(name, "r")] + [sem_name(name, f"f{i}") for i in range(n_lanes)]
    for s in names:
        try:
            posix_ipc.unlink_semaphore(s)
        except posix_ipc.ExistentialError:
            pass
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
assert ALIGN == 64
