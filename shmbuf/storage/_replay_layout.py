"""A replay buffer's object: its layout, header, writer records and locks, and what ``shmbuf ls`` reads of it.

The object's layout and the writer and sampler protocol over it are in docs/design/replay.md;
:class:`shmbuf.storage.ReplayBuffer` (:mod:`shmbuf.storage.replay`) is the buffer itself.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

from shmbuf._errors import SegmentError, ShmbufError, UsageError
from shmbuf._handle import Handle
from shmbuf._schema import Schema, format_path
from shmbuf._substrate import (
    HEAD,
    HEADER_BYTES,
    LOCK_BASE,
    Owner,
    align,
    check_head,
    check_name,
    held,
    leaf_major,
    map_object,
    open_object,
    unlink_object,
)
from shmbuf.storage._replay_row import ROW

R_MAGIC = b"\x89SHMBUFR"
R_LAYOUT_VERSION = 1
# <the shmbuf head: magic, version, header bytes, total, owner pid, owner start>
# <buffer_size, max_writers, n_leaves, writers off, seq off, schema off, schema len, data off, row bytes, created ns,
#  schema fingerprint>
_HEADER = struct.Struct(HEAD.format + "QII" + "QQQQQQQ" + "16s")
COUNTER_OFF = 256
W_INSERTED = COUNTER_OFF // 8
WRITERS_OFF = 320
RECORD_BYTES = 64
F_FIRST, F_END, F_PID, F_ROWS = 0, 1, 2, 3  # a writer record's words
MAX_ROWS = 1 << 40
MAX_WRITERS = 1024

def record_word(k: int) -> int:
    """The first word of writer slot ``k``'s record."""
    return WRITERS_OFF // 8 + k * (RECORD_BYTES // 8)


def slot_lock(k: int) -> int:
    """The byte whose lock says writer slot ``k`` is held by a live instance (the reservation lock is LOCK_BASE)."""
    return LOCK_BASE + 1 + k


def writer_held(fd: int, k: int, name: str) -> bool:
    """Does a live instance hold writer slot ``k``? OSError naming buffer ``name`` where the kernel cannot say.

    Insert and sample wait while this is True, and a dead holder's lock is gone, so no wait is on a dead process;
    an unanswered question would be waited on for ever (with ``timeout=None``), hence the error.
    """
    got = held(fd, slot_lock(k))
    if got is None:
        raise OSError(f"replay buffer {name}: the kernel could not say whether writer slot {k}'s lock is held "
                      "(F_OFD_GETLK failed on the buffer's descriptor)")
    return got


# ------------------------------------------------------------------ schema and layout


@dataclass(frozen=True)
class ReplayLayout:
    """Every offset of a replay object, from (schema, buffer_size, max_writers): recomputed and compared on attach."""

    buffer_size: int
    max_writers: int
    seq_off: int
    schema_off: int
    schema_len: int
    data_off: int
    leaf_offs: tuple[int, ...]
    row_bytes: int
    total: int

    @staticmethod
    def of(schema: Schema, buffer_size: int, max_writers: int) -> ReplayLayout:
        seq_off = align(WRITERS_OFF + max_writers * RECORD_BYTES)
        schema_off = align(seq_off + buffer_size * 8)
        schema_len = len(schema.to_msgpack())
        data_off = align(schema_off + schema_len)
        offs, off = leaf_major(schema.leaves, buffer_size, data_off)
        row_bytes = sum(lf.nbytes for lf in schema.leaves)
        return ReplayLayout(buffer_size, max_writers, seq_off, schema_off, schema_len, data_off, offs, row_bytes,
                            max(off, HEADER_BYTES))

    def pack(self, schema: Schema, owner: Owner) -> bytes:
        return _HEADER.pack(R_MAGIC, R_LAYOUT_VERSION, HEADER_BYTES, self.total, owner.pid, owner.start, self.buffer_size,
                            self.max_writers, len(schema.leaves), WRITERS_OFF, self.seq_off, self.schema_off,
                            self.schema_len, self.data_off, self.row_bytes, time.time_ns(), schema.fingerprint.encode())



def read_layout(mm: mmap.mmap, name: str) -> tuple[Schema, ReplayLayout, Owner]:
    """Check a mapping's header field by field; return its schema, layout and creator, or raise SegmentError."""
    owner = check_head(mm, name, magic=R_MAGIC, version=R_LAYOUT_VERSION, what="shmbuf replay buffer")
    size = len(mm)
    (*_head, buffer_size, max_writers, n_leaves, writers_off, _seq_off, schema_off, schema_len, _data_off, _row_bytes,
     _created, fingerprint) = _HEADER.unpack_from(mm, 0)
    if not (1 <= buffer_size <= MAX_ROWS and 1 <= max_writers <= MAX_WRITERS and writers_off == WRITERS_OFF):
        raise SegmentError(f"{name}: header declares buffer_size {buffer_size}, max_writers {max_writers}: corrupt")
    if not (0 < schema_len <= size and 0 < schema_off <= size - schema_len):
        raise SegmentError(f"{name}: schema at [{schema_off}, +{schema_len}) lies outside the {size}-byte object")
    schema = Schema.from_msgpack(bytes(mm[schema_off : schema_off + schema_len]))
    if schema.fingerprint.encode() != fingerprint:
        raise SegmentError(f"{name}: the schema's fingerprint {schema.fingerprint} is not the header's {fingerprint!r}: corrupt")
    if [ts.name for ts in schema.timescales] != [ROW] or any(lf.shape[:1] != (1,) for lf in schema.leaves):
        raise SegmentError(f"{name}: its schema is not a replay row's ({schema.summary():.200})")
    lay = ReplayLayout.of(schema, buffer_size, max_writers)
    expect = lay.pack(schema, owner)
    got = bytes(mm[: _HEADER.size])
    skip = slice(_HEADER.size - 16 - 8, _HEADER.size - 16)  # created ns: not derived
    if expect[: skip.start] != got[: skip.start] or expect[skip.stop :] != got[skip.stop :] or n_leaves != len(schema.leaves):
        raise SegmentError(f"{name}: header offsets disagree with its schema and sizes (the object is corrupt or foreign)")
    return schema, lay, owner


@dataclass(frozen=True)
class ReplayHandle(Handle):
    """A picklable reference to a replay buffer: its name. ``ReplayBuffer.attach(handle)`` attaches."""


def name_of(target: Any) -> str:
    if isinstance(target, str):
        return check_name(target)
    name = getattr(target, "name", None)
    if isinstance(name, str):
        return check_name(name)
    raise UsageError("ReplayBuffer.attach: expected a replay buffer name, ReplayHandle or ReplayBuffer, "
                     f"got {type(target).__name__}")



# ------------------------------------------------------------------ for shmbuf ls / clean


@dataclass(frozen=True)
class ReplayInfo:
    """What ``shmbuf ls`` shows of a replay buffer. ``writers``: (slot, pid, alive, rows inserted) per claimed slot."""

    name: str
    owner: Owner
    size: int
    buffer_size: int
    max_writers: int
    inserted: int
    schema: str
    writers: tuple[tuple[int, int, bool, int], ...]


def is_replay(name: str) -> bool:
    """Does the object ``name`` start with a replay buffer's magic? Never raises (False for anything unreadable)."""
    try:
        fd, _ = open_object(name, readonly=True)
    except (ShmbufError, OSError):
        return False
    try:
        return os.pread(fd, len(R_MAGIC), 0) == R_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def describe(name: str) -> ReplayInfo:
    """Read a replay buffer's header and writer table without changing anything (a read-only map, nothing faulted in).

    SegmentError (or UsageError for a malformed name) if ``name`` is not a replay buffer.
    """
    check_name(name)
    fd, mm = map_object(name, readonly=True, min_size=HEADER_BYTES + 64, what="shmbuf replay buffer")
    try:
        schema, lay, owner = read_layout(mm, name)
        w = memoryview(mm).cast("q")
        try:
            writers = []
            for k in range(lay.max_writers):
                rec = record_word(k)
                pid = w[rec + F_PID]
                if pid:
                    alive = held(fd, slot_lock(k)) is not False  # where the kernel cannot say: shown alive
                    writers.append((k, int(pid), alive, int(w[rec + F_ROWS])))
            summary = ", ".join(f"{format_path(lf.path[1:])} {lf.dtype} {lf.shape[1:]}" for lf in schema.leaves)
            return ReplayInfo(name, owner, len(mm), lay.buffer_size, lay.max_writers, int(w[W_INSERTED]),
                              f"replay x{lay.buffer_size}: {summary}", tuple(writers))
        finally:
            w.release()
    finally:
        mm.close()
        os.close(fd)


def release(fdbox: list[int], name: str, creator_pid: int) -> None:
    """A ReplayBuffer's release (``close()``, or collection or exit of one never closed): close our descriptor (the kernel
    drops our writer slot's lock with it) and, in the creator's process only, remove the name. The mapping
    goes with the instance's arrays (unmapped when they are freed)."""
    fd, fdbox[0] = fdbox[0], -1
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover - not ours to fail on at exit
            pass
    if creator_pid == os.getpid():
        unlink_object(name)


assert _HEADER.size <= HEADER_BYTES - 8 and RECORD_BYTES % 64 == 0
