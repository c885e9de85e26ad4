"""Sem: a POSIX semaphore that a close in another thread cannot free under a wait.

posix_ipc's ``Semaphore.close()`` is ``sem_close``: when it drops the process's last reference to the
semaphore, glibc unmaps it at once, and a thread asleep in ``sem_timedwait`` on it wakes on unmapped
memory (SIGSEGV). That is what a shutdown did when it closed a reader, an inference table or a client
while a thread of the same process still waited on it: a background collection thread, an inference
server, an env-worker thread, or any of them at interpreter exit, when the finalizers of objects never
closed run while daemon threads still wait.

So every semaphore shmbuf opens is a :class:`Sem`, whose :meth:`Sem.close` marks it closed and lets the
semaphore go (``sem_close``) at once if no thread of this process waits on it; else it posts once, to wake
the waiter now, and the last thread to leave :meth:`Sem.acquire` lets it go. Never a close under a wait, and
no ``__del__``: the owner's close (its finalizer, for an owner never closed) closes each of its Sems. A small
lock orders the count of waiters against the close (made anew in a forked child). A wait that starts on a
closed Sem, or wakes to find it closed, raises :class:`PipelineClosed`; so does a post (posix_ipc refuses a
closed semaphore: ``ExistentialError``, never a wild access). The post at close is safe because each of
shmbuf's semaphores has one waiting party by design (the reader on its doorbell, a writer on its lane's, the
server on the table's, a client on its own), and every one of them takes a wake-up as "look again".

A Sem keeps the semaphore valid; the object around it (a reader, a table, a client) has more that a close
releases (its mapping's words, its views). :class:`UseLock` covers those: the object's blocking calls hold
it except while they sleep on a Sem, and its close takes it, so a close from another thread runs only
while the call sleeps, and the call, waking, sees the object closed and raises before it touches anything.
"""

from __future__ import annotations

import threading
from typing import Any

import posix_ipc

from shmbuf import _fork
from shmbuf._errors import PipelineClosed

# A wait without a timeout sleeps in slices this long, so that a close whose wake-up post another
# process took is still seen.
CLOSE_SLICE = 0.1


class Sem:
    """One named POSIX semaphore of this process, safe to :meth:`close` while other threads wait on it.

    ``what`` names its object in the :class:`PipelineClosed` message ("pipeline /shmbuf-...").
    """

    __slots__ = ("__weakref__", "_closed", "_count_lock", "_sem", "_waiters", "name", "what")

    def __init__(self, sem: posix_ipc.Semaphore, what: str):
        self._sem = sem
        self.name: str = sem.name
        self.what = what
        self._waiters = 0  # threads inside acquire: the last to leave a closed Sem lets the semaphore go
        self._closed = False
        self._count_lock = threading.Lock()  # orders _waiters against close (held for a few bytecodes, never a wait)
        _fork.track(self)

    @classmethod
    def create(cls, name: str, what: str) -> Sem:
        """Create the semaphore ``name`` (it must not exist), owner-only, at 0."""
        return cls(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0), what)

    @classmethod
    def open(cls, name: str, what: str) -> Sem:
        """Open the existing semaphore ``name`` (posix_ipc.ExistentialError if there is none)."""
        return cls(posix_ipc.Semaphore(name), what)

    @property
    def closed(self) -> bool:
        return self._closed

    def _error(self) -> PipelineClosed:
        return PipelineClosed(f"{self.what} is closed")

    def acquire(self, timeout: float | None) -> None:
        """Take one post, waiting up to ``timeout`` seconds (None: until a post or :meth:`close`).

        Raises:
            posix_ipc.BusyError: no post came in time (as posix_ipc's own).
            PipelineClosed: the Sem was closed before the wait, or during it (by any thread).
        """
        with self._count_lock:
            if self._closed:
                raise self._error()
            self._waiters += 1
        try:
            if timeout is None:
                while not self._closed:
                    try:
                        self._sem.acquire(CLOSE_SLICE)
                        break
                    except posix_ipc.BusyError:
                        pass
            else:
                self._sem.acquire(timeout)
        except posix_ipc.BusyError:
            if not self._closed:
                raise
        finally:
            with self._count_lock:
                self._waiters -= 1
                last = self._closed and not self._waiters
            if last:
                self._let_go()
        if self._closed:
            raise self._error()

    def release(self) -> None:
        """Post once. Raises PipelineClosed once closed."""
        if self._closed:
            raise self._error()
        try:
            self._sem.release()
        except posix_ipc.ExistentialError:  # closed by another thread since the test above
            raise self._error() from None

    def close(self) -> None:
        """Mark it closed (idempotent); let the semaphore go now, or wake the thread waiting on it, which does."""
        with self._count_lock:
            if self._closed:
                return
            self._closed = True
            waiting = self._waiters
        if waiting:
            try:
                self._sem.release()
            except posix_ipc.Error:
                pass
        else:
            self._let_go()

    def _let_go(self) -> None:
        try:
            self._sem.close()
        except posix_ipc.Error:  # closed already
            pass

    def _after_fork_in_child(self) -> None:
        self._count_lock = threading.Lock()  # a thread of the parent may have held it at the fork

    def unlink(self) -> None:
        """Remove the name (posix_ipc.ExistentialError if it is gone); this process's handle stays usable."""
        posix_ipc.unlink_semaphore(self.name)

    def __repr__(self) -> str:
        return f"Sem({self.name!r}, {'closed' if self._closed else 'open'})"


class UseLock:
    """Held by an object's blocking calls except while they :meth:`sleep`, and by its close (see the module doc).

    Reentrant, so that a close from the calling thread itself (a signal handler's) does not deadlock; made anew
    in a child forked while another thread held it.
    """

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _fork.track(self)

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def sleep(self, sem: Sem, timeout: float | None) -> bool:
        """Let go of the lock and wait on ``sem``; False if the wait timed out. The caller holds the lock (once)
        and, when this returns or raises, holds it again: it then checks whether its object was closed meanwhile."""
        self._lock.release()
        try:
            sem.acquire(timeout)
            return True
        except posix_ipc.BusyError:
            return False
        finally:
            self._lock.acquire()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.RLock()
