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

Before any of that, the name is checked (:func:`check_name`) and the file is
opened without following links and refused unless it is a regular file of this
user with mode 0600 (:func:`open_object`): /dev/shm is writable by every user,
so what sits under a shmbuf name is input, not ours until checked.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import struct
import time
from dataclasses import dataclass

import numpy as np
import posix_ipc

from shmbuf._errors import NoSpace, SegmentError, UsageError
from shmbuf._proc import PID_MAX, Owner, pid_namespace, start_time, valid_pid
from shmbuf._schema import ALIGN, Schema, _align

PREFIX = "/shmbuf-"
MAGIC = b"\x89SHMBUF\n"
LAYOUT_VERSION = 3  # 2: the creator's pid namespace in the header's last word; the lane record's SEEN word;
# 3: the slot record's EPOCH word (a writer of version 2 would leave it stale, so rollout keys could repeat)
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


# ------------------------------------------------------------ names and files
# /dev/shm is writable by every local user, so whatever sits under a shmbuf name is input to be
# checked, not trusted: its name before it reaches posix_ipc, its file type, owner and mode before
# it is mapped, its header before any offset is used.

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory, and named semaphores as sem.<name>
WEIGHTS_PREFIX = PREFIX + "w"
INFERENCE_PREFIX = PREFIX + "i"
_NAMES = {
    "pipeline": re.compile(r"/shmbuf-[0-9a-f]{16}"),
    "weights": re.compile(r"/shmbuf-w[0-9a-f]{16}"),
    "inference": re.compile(r"/shmbuf-i[0-9a-f]{16}"),
    "any": re.compile(r"/shmbuf-[wi]?[0-9a-f]{16}"),
}
# A pipeline's doorbell (-r) and lanes' free counts (-f<lane>); an inference table's server doorbell (-s)
# and clients' answer counts (-c<client>).
_SEM_NAME = re.compile(r"/shmbuf-[0-9a-f]{16}-(r|f[0-9]{1,3})|/shmbuf-i[0-9a-f]{16}-(s|c[0-9]{1,4})")
# The fields every shmbuf object's header starts with (a pipeline's and a weight broadcast's):
# magic, layout version, header bytes, total bytes, owner pid, owner start time. The creator's
# pid namespace is the header's last word.
HEAD = struct.Struct("<8sIIQQQ")
PIDNS_OFF = HEADER_BYTES - 8
_PIDNS = struct.Struct("<Q")


def check_name(name: object, kind: str = "pipeline") -> str:
    """Return ``name`` if it is a shmbuf name of that kind, else raise UsageError saying what one looks like.

    ``kind``: ``"pipeline"`` (``/shmbuf-`` and 16 lowercase hex digits, what :func:`new_name`
    makes), ``"weights"`` (``/shmbuf-w`` and 16), ``"inference"`` (``/shmbuf-i`` and 16) or ``"any"``. Every name is checked here before it
    reaches posix_ipc or the file system: a NUL byte crashes posix_ipc (SIGSEGV), a ``/`` or more
    than 255 characters is a bare ValueError there, and ``..`` would leave /dev/shm.
    """
    if isinstance(name, str) and _NAMES[kind].fullmatch(name):
        return name
    got = f"{name!r:.80}" if isinstance(name, str) else f"a {type(name).__name__}"
    if kind == "inference":
        raise UsageError(
            f"an inference table name starts with '{INFERENCE_PREFIX}' followed by 16 lowercase hex digits, as "
            f"InferenceTable makes it (table.name); got {got}"
        )
    if kind == "weights":
        raise UsageError(
            f"a weight broadcast name starts with '{WEIGHTS_PREFIX}' followed by 16 lowercase hex digits, as "
            f"WeightPublisher makes it (publisher.name or publisher.handle); got {got}"
        )
    raise UsageError(
        f"a shmbuf pipeline name starts with '{PREFIX}' followed by 16 lowercase hex digits, as shmbuf.create "
        f"makes it (reader.name or reader.handle); got {got}"
    )


def _path(name: str) -> str:
    return f"{SHM_DIR}/{name[1:]}"


def _what(name: str) -> str:
    return "weight broadcast" if name.startswith(WEIGHTS_PREFIX) else "pipeline"


def why_untrusted(st: os.stat_result) -> str:
    """Empty for a regular file of this user's with no group or other permission bits; else what it is.

    That is how shmbuf makes every object (mode 0600), so anything else under a shmbuf name was
    put there by someone else, or changed since. ``st`` comes from lstat (links are reported as
    links) or from fstat of a descriptor opened with O_NOFOLLOW.
    """
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if not stat.S_ISREG(mode):
        return f"not a regular file ({stat.filemode(mode)})"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if mode & 0o077:
        return f"mode {stat.S_IMODE(mode):04o}, open to other users (shmbuf makes its objects 0600)"
    return ""


def path_problem(path: str) -> str | None:
    """lstat ``path``: None if it does not exist, "" if it is a file shmbuf could have made, else what it is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return why_untrusted(st)


def _refused(path: str, why: str) -> SegmentError:
    return SegmentError(
        f"{path} is {why}: shmbuf uses only regular files of its own user with mode 0600, so it will not touch "
        "this one (remove it by hand if you know what it is)"
    )


def open_object(name: str, *, readonly: bool) -> tuple[int, int]:
    """Open a shmbuf object's file without following a link or blocking; return ``(fd, size)``.

    The descriptor is the caller's to close. Refused with SegmentError saying what was found: a
    missing name, a symbolic link, a directory, a FIFO or other special file, a file of another
    uid, a file open to group or others. Once a file passed, /dev/shm's sticky bit keeps other
    users from renaming or replacing it, so the check holds for as long as we use it.
    """
    check_name(name, "any")
    path = _path(name)
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SegmentError(f"no {_what(name)} named {name!r}: it was never created, or its owner closed it") from None
    except OSError as exc:  # a link (ELOOP), a directory opened for writing (EISDIR), a socket (ENXIO), ...
        raise _refused(path, path_problem(path) or exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        why = why_untrusted(st)
        if why:
            raise _refused(path, why)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def check_semaphore(sem: str) -> None:
    """Refuse (SegmentError, naming it) a semaphore file that shmbuf could not have made; a missing one is fine.

    Call it just before ``posix_ipc.Semaphore(sem)`` opens an existing semaphore: sem_open would
    follow a link, and block or fail oddly on a FIFO or directory. A missing semaphore is left
    for sem_open to report.
    """
    if not (isinstance(sem, str) and _SEM_NAME.fullmatch(sem)):
        raise UsageError(f"expected a shmbuf semaphore name ('{PREFIX}' + 16 hex digits + '-r' or '-f<lane>'), got {sem!r:.80}")
    path = f"{SHM_DIR}/sem.{sem[1:]}"
    why = path_problem(path)
    if why:
        raise _refused(path, why)


def create_object(name: str, size: int, detail: str, *, populate: bool = False) -> tuple[int, mmap.mmap]:
    """Create a shmbuf object: O_CREAT|O_EXCL, mode 0600, ``size`` bytes reserved, mapped read-write.

    Returns ``(fd, mapping)``, both the caller's. Space is reserved (posix_fallocate), so a
    /dev/shm too small fails here with NoSpace (the sizes and the fix, ``detail`` saying what
    the bytes are for), never with a SIGBUS later. Whatever fails, the name is unlinked first.
    ``populate`` faults every page in now (MAP_POPULATE).
    """
    check_name(name, "any")
    free = _shm_dir_free()
    if free is not None and size > free:
        raise _no_space(name, size, detail)
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise SegmentError(f"{path} already exists; shmbuf makes a new random name for every object") from None
    except OSError as exc:
        raise SegmentError(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise _no_space(name, size, detail) from exc
        # MAP_POPULATE faults every page in now, so no actor pays first-touch
        # faults (~1.4 GB/s here, against ~10+ GB/s warm) inside a rollout.
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0),
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)  # ours: we made it (O_EXCL), and the sticky bit keeps others from replacing it
        raise
    return fd, mm


def map_object(name: str, *, readonly: bool, min_size: int, what: str) -> tuple[int, mmap.mmap]:
    """:func:`open_object`, then map the whole file; refuse (SegmentError) one under ``min_size`` bytes.

    Returns ``(fd, mapping)``, both the caller's. Nothing is populated: the caller checks the
    header first, so a corrupt size never makes us fault in pages.
    """
    fd, size = open_object(name, readonly=readonly)
    try:
        if size < min_size:
            raise SegmentError(f"{name}: {size} bytes is too small to be a {what}")
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except (OSError, ValueError, OverflowError) as exc:
            raise SegmentError(f"{name}: its {size} bytes cannot be mapped ({exc})") from None
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def check_head(mm: mmap.mmap, name: str, *, magic: bytes, version: int, what: str) -> Owner:
    """Check the fields every shmbuf header starts with; return the creator. SegmentError on any mismatch.

    Magic and layout version, the header's size, its total against the object's real size, and
    the owner pid against what a pid can be (a larger one made ``os.kill`` raise OverflowError).
    """
    size = len(mm)
    if size < HEADER_BYTES:
        raise SegmentError(f"{name}: {size} bytes is too small to be a {what}")
    got_magic, got_version, hbytes, total, pid, start = HEAD.unpack_from(mm, 0)
    if got_magic != magic:
        raise SegmentError(f"{name}: not a {what} (magic {got_magic!r}, expected {magic!r})")
    if got_version != version:
        raise SegmentError(
            f"{name}: layout version {got_version}, this shmbuf reads version {version}; "
            "use the same shmbuf version in every process of a pipeline"
        )
    if hbytes != HEADER_BYTES or total != size:
        raise SegmentError(f"{name}: header says {hbytes}-byte header and {total} bytes in all, the object has {size} bytes")
    if not valid_pid(pid):
        raise SegmentError(f"{name}: the header's owner pid {pid} is no process id (1 to {PID_MAX}): corrupt")
    (pidns,) = _PIDNS.unpack_from(mm, PIDNS_OFF)
    return Owner(pid, start, pidns)


def pinned(mm: mmap.mmap) -> np.ndarray:
    """The whole mapping as one uint8 array that keeps ``mm`` mapped while it, or any array built on it, lives.

    Build every array on a mapping from this (``np.ndarray(shape, dtype, buffer=pinned(mm), ...)``),
    never from ``mm`` itself: numpy 2 takes no buffer export for ``np.ndarray(buffer=mm)``, so
    ``mm.close()`` succeeds under such arrays and reading one later is a segfault. ``np.frombuffer``
    holds an export, and every view built on this array (a slice, a reshape, ``torch.from_numpy``)
    keeps it as its base, so ``mm.close()`` raises BufferError while any of them lives: the memory
    is unmapped with the last array, and a late read reads the last data, never unmapped memory.
    """
    return np.frombuffer(mm, np.uint8)


def stamp_pidns(mm: mmap.mmap) -> None:
    """Write this process's pid namespace into the header's last word (0 where /proc cannot tell)."""
    _PIDNS.pack_into(mm, PIDNS_OFF, pid_namespace())


def _count(setting: str, value: object, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= top:
        raise UsageError(f"shmbuf.create({setting}=...): expected an int from 1 to {top}, got {value!r:.80}")
    return int(value)


# ------------------------------------------------------------------ sizes


def _shm_dir_free() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
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
        f"{_what(name)} {name} needs {_fmt_bytes(need)} of shared memory ({detail}) but {have}. "
        "Use fewer slots or a smaller example, or give /dev/shm more room "
        "(docker run --shm-size=<size>, or: mount -o remount,size=<size> /dev/shm)."
    )


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
        self.creator = creator or Owner(os.getpid(), start_time(os.getpid()), pid_namespace())
        self.words = memoryview(mm).cast("q")  # read-only when the mapping is
        # Every array on the slots is built on this: it keeps the mapping alive while any of them lives.
        self.base = pinned(mm)
        self._closed = False

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def create(cls, schema: Schema, n_slots: int, n_lanes: int, name: str | None = None) -> Segment:
        n_slots = _count("slots", n_slots, MAX_SLOTS)
        n_lanes = _count("max_writers", n_lanes, MAX_LANES)
        name = new_name() if name is None else check_name(name)
        p = plan(schema, n_slots, n_lanes)
        fd, mm = create_object(name, p.total, f"{n_slots} slots x {_fmt_bytes(p.total / n_slots)} per slot", populate=True)
        me = Owner(os.getpid(), start_time(os.getpid()), pid_namespace())
        packed = schema.to_msgpack()
        header = _HEADER.pack(MAGIC, LAYOUT_VERSION, HEADER_BYTES, p.total, me.pid, me.start, time.time_ns(), n_slots,
                              n_lanes, p.schema_off, p.schema_len, name[len(PREFIX):].encode(), schema.fingerprint.encode())
        mm[: len(header)] = header
        _PIDNS.pack_into(mm, PIDNS_OFF, me.pidns)
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
            if not readonly and _POPULATE:
                full = mmap.mmap(fd, len(mm), flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                mm.close()
                mm = full
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        return cls(name, mm, schema, p, owner=False, fd=fd, creator=creator)

    def close(self) -> None:
        """Close the file and unmap this process's view (detach); arrays still held keep the mapping until they go."""
        if self._closed:
            return
        self._closed = True
        self.words.release()
        del self.base
        try:
            self.mm.close()
        except BufferError:
            pass  # arrays on the slots still exist (see pinned): the mapping goes with the last of them
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
    """Remove a segment and every semaphore named after it; what is already gone is fine.

    unlink never follows a symbolic link (it removes the link), so this never deletes what a
    link under one of these names points to.
    """
    check_name(name)
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
assert _HEADER.format.startswith(HEAD.format) and _HEADER.size <= PIDNS_OFF  # the shared head, then room for pidns
