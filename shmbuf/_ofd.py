"""Open-file-description locks on single bytes past the end of a shmbuf object: who is alive and holds what.

A lock taken with ``F_OFD_SETLK`` belongs to the open file description, not to the process: the
kernel drops it when the last descriptor of that description closes, which happens when its
process dies however it dies (SIGKILL included). So a held lock says "a live process holds
this", in every pid namespace, and no other process can inherit it by pid reuse. (A forked child
closes its inherited copy at once, see :mod:`shmbuf._fork`.) The bytes sit at :data:`LOCK_BASE`
and after, past the end of any real object, so no lock covers data. Pipelines lock one byte per
lane (:mod:`shmbuf._lane`), replay buffers one per writer slot and one for reservations.

Where the kernel has no OFD locks (not Linux), process-associated ``F_SETLK`` is used instead.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)
GETLK = getattr(fcntl, "F_OFD_GETLK", fcntl.F_GETLK)
FLOCK = struct.Struct("@hhqqi4x")  # struct flock: type, whence, start, len, pid
LOCK_BASE = 1 << 40  # lock bytes sit past the end of any real object
BUSY = (errno.EAGAIN, errno.EACCES)  # what F_SETLK raises for a lock another description holds


def packed(kind: int, byte: int) -> bytes:
    """The ``struct flock`` for ``kind`` (F_WRLCK, F_UNLCK) on one byte: pack it once where an unlock must not fail."""
    return FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


def lock(fd: int, byte: int, kind: int) -> None:
    """Take (F_WRLCK) or drop (F_UNLCK) the lock on ``byte`` without waiting; OSError (errno in BUSY) if it is held."""
    fcntl.fcntl(fd, SETLK, packed(kind, byte))


def apply(fd: int, flock: bytes) -> None:
    """Apply a :func:`packed` lock or unlock without waiting (one C call)."""
    fcntl.fcntl(fd, SETLK, flock)


def held(fd: int, byte: int) -> bool | None:
    """Does another open file description hold a lock on ``byte``? None where the kernel cannot say."""
    try:
        got = fcntl.fcntl(fd, GETLK, packed(fcntl.F_WRLCK, byte))
    except OSError:
        return None
    return FLOCK.unpack(got)[0] != fcntl.F_UNLCK
