"""A replay buffer in POSIX shared memory: several actor processes insert rows while the learner samples.

002's ``ReplayBuffer`` (a ring of ``buffer_size`` states and next states, ``insert`` split in two
where a batch wraps round the end, ``num_samples`` that grows to ``buffer_size`` and stays there,
``feed_forward_generator`` sampling uniformly with replacement) generalised to rows that are any
pytree of numpy arrays, and kept in one shared-memory object like a pipeline: the process that
calls :meth:`ReplayBuffer.create` makes it (owner-only, 0600, space reserved, its schema as
msgpack in the header, never pickle); any process of the same user attaches by name
(:meth:`ReplayBuffer.attach`, a :class:`ReplayHandle`, or by pickling the buffer, which carries
the name only). Its name is a pipeline's (``/shmbuf-`` and 16 hex digits) with its own magic in
the header (``\\x89SHMBUFR``), so the segment code's name and file checks apply as they are.

Layout (every region 64-byte aligned, offsets in bytes)::

    0      header    the shmbuf head (magic, layout version, sizes, owner pid and start), buffer_size,
                     max_writers, offsets, row bytes, schema fingerprint; last word: owner's pid namespace
    256    counter   INSERTED: rows handed out so far (the global insert index of the next row)
    320    writers   max_writers x 64 bytes: FIRST, END (the insert in progress), PID, ROWS
    ...    seq       buffer_size int64: one sequence word per row
    ...    schema    msgpack: one row's tree, every leaf with a leading 1
    ...    data      leaf-major: for each leaf, buffer_size rows of that leaf, contiguous

Global insert index ``g`` (0, 1, 2, ... over the buffer's life) goes to row ``g % buffer_size``.

The protocol (writer and sampler halves both live in this module)
------------------------------------------------------------------
Locks are open-file-description locks (``F_OFD_SETLK*``) on bytes past the end of the object,
taken on a descriptor of the buffer's file that each attached instance opens for itself. The
kernel drops such a lock when its holder's description closes, which happens when the process
dies however it dies (SIGKILL included), so no lock here can be left held by a dead process.
(A forked child closes its inherited copy at once, see :mod:`shmbuf._fork`, so it never keeps
a dead parent's lock alive.)

- Writer slot ``k``: a lock on byte ``LOCK_BASE + 1 + k``, held by an inserting instance from its
  first insert until it closes, is collected, or its process dies. The slot's record (``FIRST, END``) says which
  global indices that instance is writing now; ``FIRST == END`` when none.
- Reservation lock: byte ``LOCK_BASE``, held for three stores; waited for by retrying ``F_OFD_SETLK``
  up to ``timeout`` (``F_OFD_SETLKW`` cannot be bounded: a stopped holder would stall everyone).

Insert of ``n`` rows (a batch of ``n > buffer_size`` writes only its last ``buffer_size`` rows: the
earlier ones would be overwritten by the same insert, exactly as in a ring written row by row)::

    take the reservation lock
      g = INSERTED;  we write [first, end) = [max(g, g+n-N), g+n)
      our record: FIRST = first, END = end;  INSERTED = g + n
    release the reservation lock
    wait until no live writer of an earlier insert is still writing one of our rows (below)
    seq[row(i)] = 2i + 1 for i in [first, end)      odd: being written by insert i
    fence
    copy every leaf of the batch into its rows     (at most two slices per leaf: 002's wrap-around split)
    fence
    seq[row(i)] = 2i + 2                            even: row holds insert i, complete
    fence
    FIRST = END                                     our insert is over

Sampler (``sample``, ``feed_forward_generator``)::

    idx = uniform draws in [0, num_samples)
    s1 = seq[idx];  fence;  gather every leaf at idx (one copy);  fence;  s2 = seq[idx]
    a draw is good iff s1 == s2, s1 is even and s1 > 0;  redraw (and re-gather) the others

Why a sample never holds a half-written row nor a mix of two inserts. Stamps are unique: row
``r`` is stamped ``2i+2`` only by insert ``i``, and (below) the inserts that write a row do so
one after another in the order of ``i``, so no value ever comes back (no ABA). Suppose a good
draw of row ``r`` read ``s1 == s2 == 2i+2``. ``s1`` was loaded before any byte of the gather,
and insert ``i`` stored ``2i+2`` after its last byte, so every byte of insert ``i`` is visible
to the gather. If any byte gathered came from a later insert ``j > i`` on row ``r``, that insert
stored the odd ``2j+1`` before that byte, so the load of ``s2``, which comes after the gather,
sees ``2j+1`` or a later stamp, not ``2i+2``: the draw would have been thrown away. A row never
written has seq 0; a row being written, or whose writer died mid-row, is odd: neither is ever
accepted. This is the weight broadcast's sequence lock (:mod:`shmbuf._weights`), per row, with
the same machine argument: each seq word is an aligned 8-byte location, loaded and stored whole
(numpy's int64 copy loops move 8-byte items with single 8-byte accesses, single-copy atomic on
x86-64 and AArch64); on x86-64 (TSO) stores become visible in program order and loads are not
reordered with older loads, and the opaque C calls keep the compiler from moving them; on weakly
ordered CPUs :func:`shmbuf._ring.fence` is a full barrier at each ``fence`` above.

That argument needs one more thing: **at most one insert writes a row at any time**, the
earlier one first. Two inserts on the same row (a live but slow writer lapped by the others a
full ring later) would interleave their stamps and could leave an even stamp over mixed bytes.
So before its first store to the rows, a writer looks at every other writer's record: an
insert earlier than ours whose range shares a row with ours (it can only if it began more than
``buffer_size`` indices before our end: a cheap vectorised test that finds nothing in the usual
case) and whose slot's lock is still held is a live writer still writing there, and we wait
(polling, up to ``timeout`` seconds; then SlotTimeout, nothing written, our places in the ring
skipped and our record cleared). A record whose lock is free belongs to a writer that died:
its rows are odd or hold older complete rows, and we may overwrite them. Every earlier
insert's record was stored under the reservation lock before we took it, so we see it; a
record changes afterwards only from "in progress" to empty, and only after that insert's last
store to its rows (its even stamps, or none if it gave up or was interrupted), so seeing it
empty means that insert will touch its rows no more. We wait only for earlier inserts, so
waits never form a cycle, and a waiting insert holds no lock: inserts on other rows go on, and
a slow writer delays only the inserts that reach its rows (and those that reach theirs).

What an interrupted insert leaves (an exception, KeyboardInterrupt included, anywhere from the
reservation on, or SlotTimeout): its record is cleared in a ``finally``, so no later insert waits
for it; places it reserved but did not write hold their previous rows (or odd stamps, never
sampled), exactly as for a killed writer. What a killed writer leaves: SIGKILL at any point drops both its locks. Killed while holding the
reservation lock, it has reserved nothing (``INSERTED`` is stored last) or its whole range (then
its rows still hold their previous complete rows); killed while copying, its rows are odd and
are never sampled, and the next insert that reaches them overwrites them without waiting (its
slot's lock is gone). Nobody waits on it, and nothing it wrote half is ever read.

Order: concurrent inserts land in the order they took the reservation lock (the order of their
global indices); each batch occupies consecutive rows in ring order, never interleaved with
another, its rows in the batch's order. A row becomes sampleable when its writer stamps it even,
which for a slow writer may be after rows of later inserts became sampleable. No insert is lost:
every reserved row is written by its writer unless the writer dies (or its insert raised
SlotTimeout, which says so), and stays sampleable until a later insert takes the row in ring order. ``num_samples`` is ``min(INSERTED, buffer_size)``: rows
reserved, some of which may still be in flight (the sampler redraws those).

What this does not do: prioritised sampling, sampling without replacement, several samplers
sharing one random stream (each instance has its own generator), growing the buffer, or any
ordering between a sample and an insert that has not returned yet.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import posix_ipc

from shmbuf import _fork
from shmbuf._errors import SchemaError, SegmentError, ShmbufError, SlotTimeout, UsageError
from shmbuf._proc import Owner, pid_namespace, start_time
from shmbuf._ring import fence
from shmbuf._schema import Leaf, Schema, _align, flatten_like, format_path
from shmbuf._segment import (
    HEAD,
    HEADER_BYTES,
    _fmt_bytes,
    check_head,
    check_name,
    create_object,
    map_object,
    new_name,
    open_object,
    pinned,
    stamp_pidns,
)
from shmbuf.storage._torch import to_torch

__all__ = ["ReplayBuffer", "ReplayHandle", "ReplayInfo", "describe", "is_replay"]

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
_TS = "row"  # the schema's single timescale: one row, every leaf with a leading 1

_SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)
_GETLK = getattr(fcntl, "F_OFD_GETLK", fcntl.F_GETLK)
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock: type, whence, start, len, pid
LOCK_BASE = 1 << 40  # lock bytes sit past the end of any real object
_SIGN_OR_ODD = np.int64(-(2**63) + 1)  # 0x8000000000000001
_NONE = np.zeros(0, np.intp)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


_RESERVE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, LOCK_BASE, 1, 0)  # packed once: the unlock must not fail half-way
_UNRESERVE = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, LOCK_BASE, 1, 0)
_BUSY = (errno.EAGAIN, errno.EACCES)


def _lock(fd: int, byte: int, kind: int, cmd: int = _SETLK) -> None:
    fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))


def _held(fd: int, byte: int) -> bool:
    """Does another open file description hold a lock on ``byte``? (True where the kernel cannot say: we wait.)"""
    try:
        got = fcntl.fcntl(fd, _GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError:
        return True
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


# ------------------------------------------------------------------ schema and layout


def _row_schema(example_row: Any) -> Schema:
    """The schema of one row: the row's tree with a leading 1 on every leaf (so always single-item)."""
    paths, leaves, _ = optree.tree_flatten_with_path(example_row)
    if not leaves:
        raise SchemaError("ReplayBuffer: the example row has no array leaves: expected a pytree of numpy arrays, e.g. "
                          "{'obs': np.zeros(64, np.float32), 'reward': np.zeros((), np.float32)}")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, (np.ndarray, np.generic)):
            raise SchemaError(
                f"ReplayBuffer: example row leaf {format_path(path)}: expected a numpy array, got {type(leaf).__name__}; "
                "wrap Python numbers in np.asarray(..., dtype)"
            )
    batch_of_one = optree.tree_map(lambda a: np.asarray(a)[None], example_row)
    return Schema.from_example({_TS: batch_of_one})


@dataclass(frozen=True)
class _Layout:
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
    def of(schema: Schema, buffer_size: int, max_writers: int) -> _Layout:
        seq_off = _align(WRITERS_OFF + max_writers * RECORD_BYTES)
        schema_off = _align(seq_off + buffer_size * 8)
        schema_len = len(schema.to_msgpack())
        off = data_off = _align(schema_off + schema_len)
        offs = []
        for lf in schema.leaves:
            offs.append(off)
            off = _align(off + buffer_size * lf.nbytes)
        row_bytes = sum(lf.nbytes for lf in schema.leaves)
        return _Layout(buffer_size, max_writers, seq_off, schema_off, schema_len, data_off, tuple(offs), row_bytes,
                       max(_align(off), HEADER_BYTES))

    def pack(self, schema: Schema, owner: Owner) -> bytes:
        return _HEADER.pack(R_MAGIC, R_LAYOUT_VERSION, HEADER_BYTES, self.total, owner.pid, owner.start, self.buffer_size,
                            self.max_writers, len(schema.leaves), WRITERS_OFF, self.seq_off, self.schema_off,
                            self.schema_len, self.data_off, self.row_bytes, time.time_ns(), schema.fingerprint.encode())


def _int_setting(setting: str, value: object, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= top:
        raise UsageError(f"ReplayBuffer: {setting}: expected an int from 1 to {top}, got {value!r:.80}")
    return int(value)


def _timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise UsageError(f"ReplayBuffer: timeout: expected a number of seconds > 0, got {value!r:.80}")
    return float(value)


def _read_layout(mm: mmap.mmap, name: str) -> tuple[Schema, _Layout, Owner]:
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
    if [ts.name for ts in schema.timescales] != [_TS] or any(lf.shape[:1] != (1,) for lf in schema.leaves):
        raise SegmentError(f"{name}: its schema is not a replay row's ({schema.summary():.200})")
    lay = _Layout.of(schema, buffer_size, max_writers)
    expect = lay.pack(schema, owner)
    got = bytes(mm[: _HEADER.size])
    skip = slice(_HEADER.size - 16 - 8, _HEADER.size - 16)  # created ns: not derived
    if expect[: skip.start] != got[: skip.start] or expect[skip.stop :] != got[skip.stop :] or n_leaves != len(schema.leaves):
        raise SegmentError(f"{name}: header offsets disagree with its schema and sizes (the object is corrupt or foreign)")
    return schema, lay, owner


@dataclass(frozen=True)
class ReplayHandle:
    """A picklable reference to a replay buffer: its name. ``ReplayBuffer.attach(handle)`` attaches."""

    name: str

    def __post_init__(self) -> None:
        check_name(self.name)


def _name_of(target: Any) -> str:
    if isinstance(target, str):
        return check_name(target)
    name = getattr(target, "name", None)
    if isinstance(name, str):
        return check_name(name)
    raise UsageError(f"ReplayBuffer.attach: expected a replay buffer name, ReplayHandle or ReplayBuffer, got {type(target).__name__}")


def _attach_pickled(name: str, timeout: float) -> ReplayBuffer:
    return ReplayBuffer.attach(name, timeout=timeout)


# ------------------------------------------------------------------ the buffer


class ReplayBuffer:
    """A ring of ``buffer_size`` rows in shared memory, inserted into by many processes and sampled uniformly.

    Make one with :meth:`create` (the owner; its ``close()``, ``with`` or collection unlinks it), attach to it in other
    processes with :meth:`attach` (by name or :class:`ReplayHandle`, or pass the buffer itself to a
    ``multiprocessing`` child: pickling carries the name only, and a ``fork``-ed child may keep
    using the copy it inherited). See the module doc for the concurrency protocol.

    Lifetime: everything :meth:`sample` and :meth:`feed_forward_generator` return is a fresh copy,
    the caller's to keep; nothing hands out a view of the shared rows. One instance is for one
    thread at a time for sampling (its random generator is not thread-safe); inserts through one
    instance are serialised by a lock of its own, and other instances (in this process or others)
    insert concurrently.
    """

    def __init__(self, name: str, mm: mmap.mmap, fd: int, schema: Schema, lay: _Layout, owner: bool, creator: Owner,
                 timeout: float, seed: int | None):
        self.name = name
        self.schema = schema
        self.buffer_size = lay.buffer_size
        self.max_writers = lay.max_writers
        self.timeout = timeout
        self.creator = creator
        self._lay = lay
        self._mm = mm
        self._fdbox = [fd]  # our descriptor, shared with the finalizer (a fork-ed child swaps in its own)
        self._ino = os.fstat(fd).st_ino
        self._owner = owner
        self._pid = os.getpid()
        self._closed = False
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._w = memoryview(mm).cast("q")
        pin = pinned(mm)  # every array below keeps the mapping alive while it lives
        self._seq = np.ndarray((lay.buffer_size,), np.int64, buffer=pin, offset=lay.seq_off)
        ts = schema.by_name[_TS]
        self._treespec = ts.treespec
        self._structure = ts.structure
        self._leaves: tuple[Leaf, ...] = ts.leaves
        self._row_shapes = tuple(lf.shape[1:] for lf in ts.leaves)
        self._names = tuple(format_path(lf.path[1:]) for lf in ts.leaves)
        self._out_specs = tuple((lf.dtype, lf.shape[1:]) for lf in ts.leaves)
        self._checks = tuple((lf.dtype, lf.shape[1:], 1 + len(lf.shape[1:])) for lf in ts.leaves)
        self._rows = [np.ndarray((lay.buffer_size, *lf.shape[1:]), lf.dtype, buffer=pin, offset=off)
                      for lf, off in zip(ts.leaves, lay.leaf_offs)]
        self._slot: int | None = None  # our writer slot, claimed at the first insert
        self._rec = -1  # its record's first word
        self._recs = np.ndarray((lay.max_writers, RECORD_BYTES // 8), np.int64, buffer=pin, offset=WRITERS_OFF)
        self._firsts, self._ends = self._recs[:, F_FIRST], self._recs[:, F_END]  # views: every writer's record
        self._stamps = np.zeros(0, np.int64)  # 2 * arange(m), grown to the largest batch: stamps are this + 2*first + 1
        self._insert_lock = threading.Lock()
        self._fence = fence()
        # Release at collection or exit if never closed: the descriptor (and our writer slot's lock with it), and
        # in the creator's process the name. Without it every instance dropped unclosed kept a writer slot live
        # (max_writers of them and inserts time out) and a creator that forgot `with` left the object in /dev/shm.
        self._finalizer = weakref.finalize(self, _release, self._fdbox, name, os.getpid() if owner else 0)
        _fork.track(self)

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def create(cls, example_row: Any, buffer_size: int, *, max_writers: int = 64, timeout: float = 10.0,
               seed: int | None = None) -> ReplayBuffer:
        """Make a new buffer of ``buffer_size`` rows shaped like ``example_row`` (one row: a pytree of numpy arrays).

        ``max_writers``: how many instances may insert at once (each takes a writer slot at its
        first insert, until it closes, is collected, or its process dies). ``timeout``: the longest
        any insert or sample waits (for a writer slot, for the reservation lock, for a live writer
        still writing rows about to be overwritten, for a complete row to sample) and ``close()``
        waits for an insert in another thread; past it, SlotTimeout. ``seed``: this instance's
        sampling generator. Space is reserved now (NoSpace if /dev/shm is too small).

        The creator's ``close()`` (or a ``with`` block's end) unlinks the name, and so does the
        collection of a creator never closed, or the creator's exit: only in the creating process
        (a ``fork``-ed child's copy never unlinks). A creator killed outright leaves the object for
        ``shmbuf clean``.
        """
        buffer_size = _int_setting("buffer_size", buffer_size, MAX_ROWS)
        max_writers = _int_setting("max_writers", max_writers, MAX_WRITERS)
        timeout = _timeout(timeout)
        schema = _row_schema(example_row)
        lay = _Layout.of(schema, buffer_size, max_writers)
        name = new_name()
        fd, mm = create_object(name, lay.total, f"a replay buffer of {buffer_size} rows x {_fmt_bytes(lay.row_bytes)}",
                               populate=True)
        try:
            me = Owner(os.getpid(), start_time(os.getpid()), pid_namespace())
            mm[: _HEADER.size] = lay.pack(schema, me)
            stamp_pidns(mm)
            mm[lay.schema_off : lay.schema_off + lay.schema_len] = schema.to_msgpack()
            return cls(name, mm, fd, schema, lay, True, me, timeout, seed)
        except BaseException:
            mm.close()
            os.close(fd)
            _unlink(name)
            raise

    @classmethod
    def attach(cls, target: Any, *, timeout: float = 10.0, seed: int | None = None) -> ReplayBuffer:
        """Attach to an existing buffer by name, :class:`ReplayHandle` or buffer; SegmentError if it is not one.

        The object is opened without following links and refused unless it is a 0600 regular
        file of this user; every header field is checked against the schema it carries before
        any view is made. ``close()`` (or collection) detaches; only the creator unlinks.
        """
        name = _name_of(target)
        timeout = _timeout(timeout)
        fd, mm = map_object(name, readonly=False, min_size=HEADER_BYTES + 64, what="shmbuf replay buffer")
        try:
            schema, lay, creator = _read_layout(mm, name)
            if _POPULATE:
                full = mmap.mmap(fd, len(mm), flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                mm.close()
                mm = full
            return cls(name, mm, fd, schema, lay, False, creator, timeout, seed)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    @property
    def handle(self) -> ReplayHandle:
        return ReplayHandle(self.name)

    def __reduce__(self) -> Any:
        return (_attach_pickled, (self.name, self.timeout))

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._owner and self._pid == os.getpid():
            self.unlink()
        self.close()

    @property
    def _fd(self) -> int:
        return self._fdbox[0]

    @_fd.setter
    def _fd(self, fd: int) -> None:
        self._fdbox[0] = fd

    def close(self) -> None:
        """Detach: give up the writer slot, unmap, close the file; in the creator's process, also unlink the name
        (as a Reader does: processes attached keep their mapping, new attaches fail). Idempotent.

        An insert through this instance in another thread is waited for (up to ``timeout``, then
        SlotTimeout and nothing is closed): closing under it would drop its writer slot mid-copy.
        An instance that is never closed is released the same way when it is collected, or at exit.
        """
        if self._closed:
            return
        if not self._insert_lock.acquire(timeout=self.timeout):
            raise SlotTimeout(f"replay buffer {self.name}: close() waited timeout={self.timeout} s for an insert through this "
                              "instance (in another thread) to finish; nothing was closed. Stop inserting, then close")
        try:
            if self._closed:
                return
            self._closed = True
            self._rows = []
            self._seq = self._recs = self._firsts = self._ends = None  # type: ignore[assignment]
            self._w.release()
            try:
                self._mm.close()
            except BufferError:  # pragma: no cover - we hand out no views; the mapping would go with the last one (pinned)
                pass
            self._finalizer()  # closes the file (dropping our writer slot's lock); the creator's process unlinks
        finally:
            self._insert_lock.release()

    def unlink(self) -> None:
        """Remove the buffer's name now (``close()`` does it too, in the creator's process); attached processes keep
        their mapping, new attaches fail. The creator's call alone."""
        if not self._owner or self._pid != os.getpid():
            raise UsageError(f"replay buffer {self.name}: only the process that created it unlinks it; call close() to detach")
        _unlink(self.name)

    def _after_fork_in_child(self) -> None:
        """In a fork-ed child: drop the parent's descriptor (and with it any claim on the parent's locks)."""
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = -1
        self._slot, self._rec = None, -1
        self._owner = False
        self._insert_lock = threading.Lock()  # the parent's may have been held by one of its threads
        if self._seed is None:
            self._rng = np.random.default_rng()  # else parent and child would draw the same rows

    def _descriptor(self) -> int:
        """Our own open file description of the object: reopened in a fork-ed child, checked to be the same file."""
        if self._closed:
            raise UsageError(f"replay buffer {self.name} is closed in this process")
        if self._fd < 0:
            fd, _ = open_object(self.name, readonly=False)
            if os.fstat(fd).st_ino != self._ino:
                os.close(fd)
                raise SegmentError(f"replay buffer {self.name} was removed (another object now has its name)")
            self._fd = fd
            self._pid = os.getpid()
        return self._fd

    # -- counters -----------------------------------------------------------

    @property
    def inserted(self) -> int:
        """Rows handed out to inserts so far, over the buffer's life (the global index of the next row)."""
        return int(self._live_words()[W_INSERTED])

    @property
    def num_samples(self) -> int:
        """Rows that can be sampled: grows with the inserts up to ``buffer_size`` and stays there (002's name)."""
        return min(self.inserted, self.buffer_size)

    @property
    def step(self) -> int:
        """The row the next insert starts at (002's write index)."""
        return self.inserted % self.buffer_size

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_samples}/{self.buffer_size} rows, step {self.step}"
        return f"ReplayBuffer({self.name}, {state}; row: {', '.join(f'{n} {lf.dtype} {s}' for n, lf, s in zip(self._names, self._leaves, self._row_shapes))})"

    def _live_words(self) -> memoryview:
        if self._closed:
            raise UsageError(f"replay buffer {self.name} is closed in this process")
        return self._w

    # -- insert ---------------------------------------------------------------

    def insert(self, batch: Any) -> int:
        """Write a batch of rows (the row's tree, every leaf with a leading batch dim ``n``); return its first global index.

        The rows go to ``step, step+1, ...`` modulo ``buffer_size``, split in two writes where they
        wrap round the end; a batch longer than ``buffer_size`` leaves only its last
        ``buffer_size`` rows. Dtypes must cast to the row's under numpy's 'same_kind' rule.
        Raises SchemaError (naming the leaf) for a wrong key, shape or dtype, SlotTimeout when
        no writer slot comes free or a live writer still writing the rows we would overwrite does
        not finish within ``timeout``; either way nothing of the batch was written (after the
        second kind its places in the ring were already taken: they are skipped, and ``inserted``
        counts them).
        """
        leaves, n = self._check_batch(batch)
        if n == 0:
            return self.inserted
        with self._insert_lock:
            fd = self._descriptor()
            deadline = time.monotonic() + self.timeout
            self._claim_slot(fd, deadline)
            w, rec = self._w, self._rec
            try:
                first, end = self._reserve(fd, n, deadline)
                self._wait_for_earlier(fd, first, end, deadline)
                self._write(leaves, n, first, end)
            finally:
                # Whatever happened (done, SlotTimeout, a KeyboardInterrupt anywhere from the reservation on):
                # no insert of ours is in progress any more, so no later insert waits for one.
                try:
                    if self._fence:  # the stamps before the record says we are done
                        self._fence()
                finally:
                    w[rec + F_FIRST] = w[rec + F_END]  # one store (END is ours alone): the record reads empty
            return end - n

    def _check_batch(self, batch: Any) -> tuple[list[np.ndarray], int]:
        """The batch's leaves in schema order, as arrays, and its row count; SchemaError naming the first bad leaf."""
        got, spec = optree.tree_flatten(batch)
        if spec != self._treespec:  # not the example's exact containers: walk and compare (names what differs)
            got = []
            try:
                flatten_like(self._structure, batch, (), got)
            except SchemaError as exc:
                raise SchemaError(f"insert: the batch is not shaped like the row: {exc}") from None
        n = -1
        for i, (x, (dtype, shape, ndim)) in enumerate(zip(got, self._checks)):
            if type(x) is not np.ndarray:
                got[i] = x = self._as_array(i, x)
            xs = x.shape
            if len(xs) != ndim or xs[1:] != shape or (x.dtype is not dtype and x.dtype != dtype):
                self._refuse(i, x)
            if n != xs[0]:
                if n >= 0:
                    raise SchemaError(f"insert: leaf {self._names[i]}: batch dim {xs[0]}, but leaf {self._names[0]} has {n}; "
                                      "every leaf of a batch must have the same leading dim")
                n = xs[0]
        return got, n

    def _as_array(self, i: int, x: Any) -> np.ndarray:
        try:
            return np.asarray(x)
        except Exception as exc:  # noqa: BLE001  # a torch tensor that requires grad or lives on a GPU, ...
            raise SchemaError(f"insert: leaf {self._names[i]}: could not read a {type(x).__name__} as an array ({exc}); "
                              "pass CPU arrays (for torch: tensor.detach().cpu())") from None

    def _refuse(self, i: int, x: np.ndarray) -> None:
        """Raise SchemaError for leaf ``i`` unless only its dtype differs and casts under 'same_kind' (then return)."""
        dtype, shape, ndim = self._checks[i]
        name = self._names[i]
        if x.ndim != ndim or x.shape[1:] != shape:
            want = "(" + ", ".join(["n", *map(str, shape)]) + ("," if not shape else "") + ")"
            raise SchemaError(f"insert: leaf {name}: expected shape {want} (a leading batch dim n, then the row's "
                              f"{shape}), got {x.shape}")
        if not np.can_cast(x.dtype, dtype, casting="same_kind"):
            raise SchemaError(f"insert: leaf {name}: expected dtype {dtype} (or one that casts to it under numpy's "
                              f"'same_kind' rule), got {x.dtype}")

    def _claim_slot(self, fd: int, deadline: float) -> int:
        """Our writer slot (claimed once, held until close or death): a lock on its byte, then its record cleared."""
        if self._slot is not None:
            return self._slot
        w = self._live_words()
        while True:
            for k in range(self.max_writers):
                try:
                    _lock(fd, LOCK_BASE + 1 + k, fcntl.F_WRLCK)
                except OSError:
                    continue  # a live instance holds it
                rec = WRITERS_OFF // 8 + k * (RECORD_BYTES // 8)
                w[rec + F_FIRST] = w[rec + F_END]  # one store: whatever a dead holder was writing is no one's now
                w[rec + F_PID] = os.getpid()
                w[rec + F_ROWS] = 0
                self._slot, self._rec = k, rec
                return k
            if time.monotonic() > deadline:
                raise SlotTimeout(
                    f"replay buffer {self.name}: all {self.max_writers} writer slots are held by live instances "
                    f"(max_writers={self.max_writers} at ReplayBuffer.create) and none came free within timeout={self.timeout} s; "
                    "close() inserting instances you no longer use, or create the buffer with a larger max_writers"
                )
            time.sleep(0.001)

    def _reserve(self, fd: int, n: int, deadline: float) -> tuple[int, int]:
        """Under the reservation lock: take global indices [g, g+n), of which [first, end) are written; record them.

        FIRST is stored before END, so that between the two stores the record reads as empty
        (FIRST >= the old END), never as a range wider than the one being reserved. An exception
        anywhere in here (a KeyboardInterrupt too) leaves the lock released (the unlock is one C
        call on bytes packed in advance) and the record for ``insert`` to clear.
        """
        w = self._w
        rec = self._rec
        try:
            self._take_reservation(fd, deadline)
            g = w[W_INSERTED]
            end = g + n
            first = max(g, end - self.buffer_size)
            w[rec + F_FIRST] = first
            w[rec + F_END] = end
            w[W_INSERTED] = end
        finally:
            fcntl.fcntl(fd, _SETLK, _UNRESERVE)  # a no-op if we never got it
        return first, end

    def _take_reservation(self, fd: int, deadline: float) -> None:
        """The reservation lock, waited for up to the deadline (then SlotTimeout, nothing reserved).

        Not ``F_OFD_SETLKW``, which cannot be bounded: a holder that is stopped (SIGSTOP, a
        debugger) would stall every inserter past ``timeout``. Its holders keep it for three
        stores, so a busy lock is retried at once a few times (yielding the CPU), then with
        sleeps growing to 1 ms.
        """
        tries, pause = 0, 0.00005
        while True:
            try:
                fcntl.fcntl(fd, _SETLK, _RESERVE)
                return
            except OSError as exc:
                if exc.errno not in _BUSY:
                    raise
            tries += 1
            if tries <= 20:
                os.sched_yield()
                continue
            if time.monotonic() > deadline:
                raise SlotTimeout(
                    f"replay buffer {self.name}: the reservation lock (held by another inserting instance for a few "
                    f"stores at a time) was not free within timeout={self.timeout} s; nothing of this batch was written "
                    "and nothing was reserved. Is an inserting process stopped (SIGSTOP, a debugger)?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _wait_for_earlier(self, fd: int, first: int, end: int, deadline: float) -> None:
        """Return once no live writer of an earlier insert is still writing any of our rows; else SlotTimeout.

        Every earlier insert's record was stored before our reservation (under the lock), so it
        is visible here; a record only ever goes from "in progress" to empty after that. An
        earlier insert can share a row with ours only if it started more than a ring before our
        end (FIRST < end - N): the cheap test that leaves nothing to check in the usual case.
        """
        n_rows = self.buffer_size
        pause = 0.0001
        while True:
            a, b = self._firsts, self._ends
            cand = (a < b) & (a < end - n_rows)
            if not np.count_nonzero(cand):
                return
            cand = np.flatnonzero(cand)
            who = self._live_overlap(fd, cand, first, end)
            if who is None:
                return
            if time.monotonic() > deadline:
                raise SlotTimeout(
                    f"replay buffer {self.name}: process {who} is still writing rows that this insert would overwrite "
                    f"(a full ring of {n_rows} rows was inserted meanwhile) and did not finish within timeout={self.timeout} s; "
                    "nothing of this batch was written (its places in the ring are skipped). Use a larger buffer_size, "
                    "or find out why that process stalls"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _live_overlap(self, fd: int, cand: np.ndarray, first: int, end: int) -> int | None:
        """The pid of a live writer among slots ``cand`` whose insert in progress shares a row with [first, end), or None."""
        n_rows, mine = self.buffer_size, end - first
        for k in cand.tolist():
            rec = WRITERS_OFF // 8 + k * (RECORD_BYTES // 8)
            a, b = self._w[rec + F_FIRST], self._w[rec + F_END]
            if not a < b:
                continue  # finished since we looked
            shift = (first - a) % n_rows  # ranges of length <= N share a row iff one starts inside the other, mod N
            if (shift < b - a or shift + mine > n_rows) and _held(fd, LOCK_BASE + 1 + k):
                return int(self._w[rec + F_PID])
        return None

    def _write(self, leaves: list[np.ndarray], n: int, first: int, end: int) -> None:
        """Stamp odd, copy (two slices where the rows wrap), stamp even: the module doc's writer half."""
        seq, f = self._seq, self._fence
        n_rows = self.buffer_size
        m = end - first
        start = first % n_rows
        part = min(m, n_rows - start)
        if len(self._stamps) < m:
            self._stamps = 2 * np.arange(m, dtype=np.int64)
        stamps = self._stamps[:m] + (2 * first + 1)
        if f:  # what we read of the records before our first store to the rows
            f()
        seq[start : start + part] = stamps[:part]
        if m > part:
            seq[: m - part] = stamps[part:]
        if f:  # odd stamps before any byte of the rows
            f()
        self._copy_rows(leaves, start, part, n - m)
        if f:  # every byte before the even stamps
            f()
        stamps += 1
        seq[start : start + part] = stamps[:part]
        if m > part:
            seq[: m - part] = stamps[part:]
        self._w[self._rec + F_ROWS] += n

    def _copy_rows(self, leaves: list[np.ndarray], start: int, part: int, skip: int) -> None:
        """Copy the batch (less its first ``skip`` rows) to rows ``start, ...``: ``part`` rows to the end, the rest from row 0."""
        rest = len(leaves[0]) - skip - part
        for dst, x in zip(self._rows, leaves):
            dst[start : start + part] = x[skip : skip + part] if skip or rest else x
            if rest:
                dst[:rest] = x[skip + part :]

    # -- sample ---------------------------------------------------------------

    def sample(self, batch_size: int) -> Any:
        """``batch_size`` rows drawn uniformly with replacement from the complete rows: a tree of fresh arrays (copies).

        Rows being written (or left half-written by a writer that died) are never returned: such
        draws are redrawn. UsageError if the buffer holds no row yet; SlotTimeout if no draw
        finds a complete row within ``timeout`` (every row in flight).
        """
        batch_size = _size("sample(batch_size=...)", batch_size)
        return optree.tree_unflatten(self._treespec, self._gather(batch_size))

    def feed_forward_generator(self, num_mini_batch: int, mini_batch_size: int) -> Iterator[Any]:
        """``num_mini_batch`` samples of ``mini_batch_size`` rows each (002's generator; see :meth:`sample`).

        Every batch is a fresh copy. Settings are checked now, not at the first ``next``.
        """
        num_mini_batch = _size("feed_forward_generator(num_mini_batch=...)", num_mini_batch)
        mini_batch_size = _size("feed_forward_generator(mini_batch_size=...)", mini_batch_size)
        self._live_words()
        return (self.sample(mini_batch_size) for _ in range(num_mini_batch))

    def _gather(self, size: int) -> list[np.ndarray]:
        n = self.num_samples
        if n == 0:
            raise UsageError(f"sample: replay buffer {self.name} is empty (num_samples=0): insert rows before sampling")
        idx = self._draw(n, size)
        out = [np.empty((size, *s), dt) for dt, s in self._out_specs]
        bad = self._gather_into(out, None, idx)
        deadline = time.monotonic() + self.timeout
        while bad.size:
            if time.monotonic() > deadline:
                raise SlotTimeout(f"sample: no complete row of replay buffer {self.name} was found within "
                                  f"timeout={self.timeout} s: every row drawn was being written")
            if bad.size == size and not self._any_complete(self.num_samples):
                if self._none_complete_for_good():
                    raise UsageError(f"sample: replay buffer {self.name} has no complete row (its writers died while writing "
                                     "its rows): insert rows before sampling")
                time.sleep(0.0005)  # every row is being written right now: let the writers finish
            idx[bad] = self._draw(self.num_samples, bad.size)
            bad = self._gather_into(out, bad, idx)
        return out

    def _draw(self, n: int, k: int) -> np.ndarray:
        """``k`` indices uniform in [0, n): floor of a 53-bit uniform float times ``n`` (bias below n / 2**53).

        Twice as fast as ``Generator.integers`` for a few hundred draws, whose argument handling dominates.
        """
        idx = (self._rng.random(k) * n).astype(np.intp)
        return np.minimum(idx, n - 1, out=idx)  # r * n may round up to n when r is within 2**-53 of 1

    def _gather_into(self, out: list[np.ndarray], todo: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
        """Copy rows ``idx[todo]`` (all of ``idx`` for None) into ``out[:, todo]`` under the sequence check.

        Returns the positions (into ``idx``) to redraw: rows never written, being written, or
        rewritten during the copy.
        """
        f = self._fence
        at = idx if todo is None else idx[todo]
        s1 = self._seq.take(at)
        if f:  # the sequence words before any byte of the rows
            f()
        for dst, src in zip(out, self._rows):
            if todo is None:
                src.take(at, axis=0, out=dst, mode="clip")  # in range; mode 'raise' would buffer `out`
            else:
                dst[todo] = src.take(at, axis=0)
        if f:  # every byte before the second look at the sequence words
            f()
        s2 = self._seq.take(at)
        # Good: s1 == s2, even and > 0. (s1 - 2) has neither its sign bit nor bit 0 set exactly when s1 is even and >= 2.
        flags = ((s1 - 2) & _SIGN_OR_ODD) | (s1 ^ s2)
        if not np.count_nonzero(flags):
            return _NONE
        bad = np.flatnonzero(flags)
        return bad if todo is None else todo[bad]

    def snapshot(self) -> tuple[Any, np.ndarray]:
        """Copies of rows ``0 .. num_samples-1`` in row order, and a bool mask of the rows that are complete.

        A row is complete when it was fully written by one insert and was not rewritten while it
        was copied (the sampler's check); the others (being written, or left half-written by a
        writer that died) hold bytes that mean nothing. Once the buffer is full the oldest row is
        at :attr:`step`. Everything returned is the caller's.
        """
        n = self.num_samples
        f = self._fence
        s1 = self._seq[:n].copy()
        if f:
            f()
        rows = [src[:n].copy() for src in self._rows]
        if f:
            f()
        s2 = self._seq[:n]
        complete = (s1 == s2) & (s1 > 0) & (s1 % 2 == 0)
        return optree.tree_unflatten(self._treespec, rows), complete

    def _none_complete_for_good(self) -> bool:
        """No row is complete and no insert is under way: seen twice, with the sequence words unchanged in between.

        An insert under way has its record set before it stamps a row, so it shows up either in
        a record (first or second look) or as a changed sequence word between the two looks.
        """
        n = self.num_samples
        if self._inserts_in_progress():
            return False
        before = self._seq[:n].copy()
        if np.any((before > 0) & (before % 2 == 0)) or self._inserts_in_progress():
            return False
        return bool(np.array_equal(before, self._seq[:n]))

    def _inserts_in_progress(self) -> bool:
        """Is any live writer (another instance) in the middle of an insert?"""
        fd, w = self._descriptor(), self._live_words()
        for k in range(self.max_writers):
            rec = WRITERS_OFF // 8 + k * (RECORD_BYTES // 8)
            if w[rec + F_FIRST] < w[rec + F_END] and _held(fd, LOCK_BASE + 1 + k):
                return True
        return False

    def _any_complete(self, n: int) -> bool:
        s = self._seq[:n]
        return bool(np.any((s > 0) & (s % 2 == 0)))

    # -- torch ------------------------------------------------------------------

    to_torch = staticmethod(to_torch)  # shmbuf.storage's one numpy-to-torch (see _torch.py)


def _size(setting: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise UsageError(f"{setting}: expected an int >= 1, got {value!r:.80}")
    return int(value)


def _release(fdbox: list[int], name: str, creator_pid: int) -> None:
    """``close()``'s last step, or the finalizer of an instance never closed: close our descriptor (the kernel
    drops our writer slot's lock with it) and, in the creator's process only, remove the name. The mapping
    goes with the instance's arrays (unmapped when they are freed)."""
    fd, fdbox[0] = fdbox[0], -1
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover - not ours to fail on at exit
            pass
    if creator_pid == os.getpid():
        _unlink(name)


def _unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


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
        schema, lay, owner = _read_layout(mm, name)
        w = memoryview(mm).cast("q")
        try:
            writers = []
            for k in range(lay.max_writers):
                rec = WRITERS_OFF // 8 + k * (RECORD_BYTES // 8)
                pid = w[rec + F_PID]
                if pid:
                    writers.append((k, int(pid), _held(fd, LOCK_BASE + 1 + k), int(w[rec + F_ROWS])))
            summary = ", ".join(f"{format_path(lf.path[1:])} {lf.dtype} {lf.shape[1:]}" for lf in schema.leaves)
            return ReplayInfo(name, owner, len(mm), lay.buffer_size, lay.max_writers, int(w[W_INSERTED]),
                              f"replay x{lay.buffer_size}: {summary}", tuple(writers))
        finally:
            w.release()
    finally:
        mm.close()
        os.close(fd)


assert _HEADER.size <= HEADER_BYTES - 8 and RECORD_BYTES % 64 == 0
