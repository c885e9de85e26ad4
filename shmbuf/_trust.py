"""Trust checks on what sits in /dev/shm: only a regular file of this user with mode 0600 is shmbuf's.

/dev/shm is writable by every local user, so whatever sits under a shmbuf name is input to be
checked, not trusted: its name before it reaches posix_ipc (:mod:`shmbuf._names`), its file type,
owner and mode before it is mapped (here), its header before any offset is used (:mod:`shmbuf._shm`).
See docs/design/segment.md.
"""

from __future__ import annotations

import os
import stat

from shmbuf._errors import SegmentError
from shmbuf._names import check_name, check_sem_name, sem_path, shm_path, what


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


def refused(path: str, why: str) -> SegmentError:
    """The error for a file shmbuf will not use: where it is, and what it is."""
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
    path = shm_path(name)
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SegmentError(f"no {what(name)} named {name!r}: it was never created, or its owner closed it") from None
    except OSError as exc:  # a link (ELOOP), a directory opened for writing (EISDIR), a socket (ENXIO), ...
        raise refused(path, path_problem(path) or exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        why = why_untrusted(st)
        if why:
            raise refused(path, why)
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
    path = sem_path(check_sem_name(sem))
    why = path_problem(path)
    if why:
        raise refused(path, why)
