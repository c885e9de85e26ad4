"""What a Writer holds, and its release: the lane, the lane lock's descriptor, the semaphores, the reader watch, the
segment, acquired one by one as a :class:`shmbuf.Writer` attaches and let go of in one place.

The Writer (:mod:`shmbuf._writer`) registers :func:`let_go` with :class:`shmbuf._closable.Closable` as soon as the
segment is attached; it runs once: at ``close()``, when the Writer is collected, or at interpreter exit. The
:class:`Hold` never refers to the Writer (the finalizer keeps it alive until it runs). See docs/design/writer.md,
"Lifetime".
"""

from __future__ import annotations

import os

import posix_ipc

from shmbuf import _control, _segment
from shmbuf._errors import PipelineClosed, SegmentError
from shmbuf._lane import WriterLane
from shmbuf._pidwatch import ProcessWatch
from shmbuf._segment import W_CLOSED, Segment, sem_name
from shmbuf._sem import Sem

# How long the bye waits at most for the reader to take an earlier message from the mailbox.
BYE_WAIT = 0.2


class Hold:
    """What a Writer holds and its release lets go of, shared by the Writer and its finalizer.

    It never refers to the Writer (the finalizer keeps it alive until it runs). Filled in as the
    Writer acquires each piece; ``reason`` is the bye's text: close()'s, else "garbage collected"
    (a Writer dropped, or still open at exit), None for a Writer() that failed after its claim;
    ``bye_wait`` the most the bye waits (``close(timeout=...)`` lowers it).
    """

    __slots__ = ("bye_wait", "lane", "lock_fd", "pid", "reason", "seg", "sems", "watch", "words")

    def __init__(self, seg: Segment):
        self.seg = seg
        self.words = seg.words
        self.pid = os.getpid()
        self.reason: str | None = "garbage collected"
        self.bye_wait = BYE_WAIT
        self.sems: list[Sem] = []
        self.lock_fd = -1
        self.watch: ProcessWatch | None = None
        self.lane: WriterLane | None = None

    def reader_gone(self) -> bool:
        """The reader closed the pipeline or its process died (what a post gives up on)."""
        watch = self.watch
        return bool(self.words[W_CLOSED]) or (watch is not None and not watch.alive())


def let_go(hold: Hold) -> None:
    """A Writer's release (Closable's finalizer): at close(), at its collection, or at exit if never closed.

    Says bye and gives the lane back (unless the pipeline is closed), then closes the reader watch,
    the semaphores, the lane lock's descriptor (which drops the lock) and the segment. Bounded, so
    exit cannot hang on it: the bye waits at most ``hold.bye_wait`` (0.2 s) for the reader to take an
    earlier message (less once ``reader_gone``), and nothing else waits. In a forked child it does
    nothing: the lane, its lock and its semaphores are the parent's (see :func:`let_go_in_child`).
    """
    if os.getpid() != hold.pid:
        return
    lane, hold.lane = hold.lane, None
    if lane is not None:
        try:
            if hold.reason is None:  # claimed, then Writer() failed: hand the lane back for the reader to reclaim
                lane.retire()
            elif not hold.words[W_CLOSED]:
                lane.post(_control.encode("bye", reason=hold.reason[:200]), hold.bye_wait, hold.reader_gone)
                lane.retire()
        except Exception:  # noqa: BLE001  # closing must not raise because the reader went first
            pass
    if hold.watch is not None:
        hold.watch.close()
    for sem in hold.sems:
        try:
            sem.close()
        except posix_ipc.Error:
            pass
    hold.sems = []
    if hold.lock_fd >= 0:
        os.close(hold.lock_fd)  # drops the lane lock
        hold.lock_fd = -1
    hold.seg.close()  # arrays on the slots that still live keep the mapping until they go


def let_go_in_child(hold: Hold) -> None:
    """In a child that inherited the Writer by fork: close this process's copies of what is the parent's (the
    reader watch, the lane lock's descriptor), so the lane is free as soon as the parent lets it go."""
    if hold.watch is not None:
        hold.watch.close()
    if hold.lock_fd >= 0:
        try:
            os.close(hold.lock_fd)  # our copy: while it is open, the lane's lock outlives the parent's writer
        except OSError:
            pass
        hold.lock_fd = -1


def open_lock_fd(name: str, seg: Segment) -> int:
    """A descriptor of the segment that only this Writer holds, for its lane lock.

    An open-file-description lock lives as long as any descriptor of that description, and
    ``mmap`` keeps a ``dup`` of the descriptor it mapped; locking through the mapping's own
    description would let a forked child's copy of the mapping keep the lane locked. So the
    lock gets a description of its own, checked to be the file we mapped.
    """
    fd, _ = _segment.open_object(name, readonly=False)
    try:
        a, b = os.fstat(fd), os.fstat(seg.fd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            raise SegmentError(f"pipeline {name} was replaced while this Writer attached to it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_sem(hold: Hold, name: str, role: str) -> Sem:
    """Open the pipeline's semaphore ``role`` ("r": the doorbell, "f<i>": lane i's) into ``hold``."""
    sname = sem_name(name, role)
    _segment.check_semaphore(sname)  # a symlink, a FIFO or another user's file under the name: refused before sem_open
    try:
        sem = Sem.open(sname, f"pipeline {name}")
    except posix_ipc.ExistentialError:
        raise PipelineClosed(f"pipeline {name} is closed (its semaphores are gone)") from None
    except (posix_ipc.Error, OSError, ValueError) as exc:
        raise SegmentError(f"pipeline {name}: semaphore {sname} cannot be opened: {exc}") from None
    hold.sems.append(sem)
    return sem
