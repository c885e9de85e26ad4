"""Create, map and check a shmbuf object: the code every kind of object (pipeline, weights, inference table,
replay buffer) makes and opens itself with.

Every object is created O_EXCL, mode 0600, with its space reserved; opened through the trust checks
(:mod:`shmbuf._trust`); and its header starts with the same head (:data:`HEAD`), checked by
:func:`check_head` before any other field is read. The table of what each function guarantees is in
docs/design/segment.md.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence

import numpy as np
import posix_ipc

from shmbuf._errors import NoSpace, SegmentError
from shmbuf._janitor import forget, watch
from shmbuf._names import SHM_DIR, check_name, shm_path, what
from shmbuf._proc import PID_MAX, Owner, pid_namespace, valid_pid
from shmbuf._schema import Leaf, _align
from shmbuf._trust import open_object

HEADER_BYTES = 256
# The fields every shmbuf object's header starts with: magic, layout version, header bytes, total
# bytes, owner pid, owner start time. The creator's pid namespace is the header's last word.
HEAD = struct.Struct("<8sIIQQQ")
PIDNS_OFF = HEADER_BYTES - 8
_PIDNS = struct.Struct("<Q")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def create_object(name: str, size: int, detail: str, *, populate: bool = False,
                  keep: bool = False) -> tuple[int, mmap.mmap]:
    """Create a shmbuf object: O_CREAT|O_EXCL, mode 0600, ``size`` bytes reserved, mapped read-write.

    Returns ``(fd, mapping)``, both the caller's. Space is reserved (posix_fallocate), so a
    /dev/shm too small fails here with NoSpace (the sizes and the fix, ``detail`` saying what
    the bytes are for), never with a SIGBUS later. Whatever fails, the name is unlinked first.
    ``populate`` faults every page in now (MAP_POPULATE). Before anything else the name is given
    to this process's watcher (:mod:`shmbuf._janitor`), which removes it and the semaphores named
    after it if the process dies without unlinking it; not with ``keep`` (``keep_on_crash``).
    """
    check_name(name, "any")
    free = _shm_dir_free()
    if free is not None and size > free:
        raise _no_space(name, size, detail)
    path = shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise SegmentError(f"{path} already exists; shmbuf makes a new random name for every object") from None
    except OSError as exc:
        raise SegmentError(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        watch(name[1:], os.fstat(fd), keep=keep)  # first: from here on, the owner's death removes it
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
        forget(name[1:])
        raise
    return fd, mm


def map_object(name: str, *, readonly: bool, min_size: int, what: str) -> tuple[int, mmap.mmap]:
    """:func:`open_object`, then map the whole file; refuse (SegmentError) one under ``min_size`` bytes.

    Returns ``(fd, mapping)``, both the caller's. Nothing is populated: the caller checks the
    header first, so a corrupt size never makes us fault in pages (then :func:`populated`).
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


def populated(fd: int, mm: mmap.mmap) -> mmap.mmap:
    """A read-write mapping of the same object with every page faulted in, in place of ``mm`` (then closed).

    For a header that passed its checks; ``mm`` itself where the platform has no MAP_POPULATE.
    """
    if not _POPULATE:
        return mm
    full = mmap.mmap(fd, len(mm), flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mm.close()
    return full


def leaf_major(leaves: Sequence[Leaf], rows: int, start: int) -> tuple[tuple[int, ...], int]:
    """Offsets of leaf-major regions from ``start``: for each leaf, ``rows`` rows of ``leaf.nbytes`` bytes, each
    region 64-byte aligned; returns the offsets and the (aligned) end. The inference table's and the replay
    buffer's data."""
    offs = []
    off = start
    for lf in leaves:
        offs.append(off)
        off = _align(off + rows * lf.nbytes)
    return tuple(offs), off


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


def write_header(mm: mmap.mmap, header: bytes) -> None:
    """Write a packed header (it starts with :data:`HEAD`) and this process's pid namespace in its last word."""
    assert len(header) <= PIDNS_OFF
    mm[: len(header)] = header
    stamp_pidns(mm)


def stamp_pidns(mm: mmap.mmap) -> None:
    """Write this process's pid namespace into the header's last word (0 where /proc cannot tell)."""
    _PIDNS.pack_into(mm, PIDNS_OFF, pid_namespace())


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


def unmap(mm: mmap.mmap) -> None:
    """Unmap now, unless arrays built on it (:func:`pinned`) still live: then it goes with the last of them."""
    try:
        mm.close()
    except BufferError:
        pass


def unlink_object(name: str) -> None:
    """Remove the object's name (attached processes keep their mapping; new attaches fail); gone already is fine.

    unlink never follows a symbolic link (it removes the link), so this never deletes what a link
    under a shmbuf name points to. This process's watcher is told (after the unlink: never before).
    """
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
    forget(name[1:])


def unlink_semaphore(sem: str) -> None:
    """Remove a semaphore's name; gone already is fine."""
    try:
        posix_ipc.unlink_semaphore(sem)
    except posix_ipc.ExistentialError:
        pass


# ------------------------------------------------------------------ sizes


def _shm_dir_free() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fmt_bytes(n: float) -> str:
    """``n`` bytes as people read them: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _no_space(name: str, need: int, detail: str) -> NoSpace:
    free = _shm_dir_free()
    have = f"/dev/shm has {fmt_bytes(free)} free" if free is not None else "shared memory is full"
    return NoSpace(
        f"{what(name)} {name} needs {fmt_bytes(need)} of shared memory ({detail}) but {have}. "
        "Use fewer slots or a smaller example, or give /dev/shm more room "
        "(docker run --shm-size=<size>, or: mount -o remount,size=<size> /dev/shm)."
    )
