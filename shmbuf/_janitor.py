"""The watcher: what a process created in /dev/shm is removed within a second of its death, whatever killed it.

CPython's ``multiprocessing.resource_tracker`` is the model: one small process per owning process,
started at its first object and shared by all of them, told each name as it is created and as the
owner removes it itself, and which removes what is left once the owner is gone, SIGKILL and the OOM
killer included. Both halves of that protocol live here (docs/design/janitor.md):

- **The owner's half** (this module imported as ``shmbuf._janitor``): :func:`watch` right after an
  object is created (its semaphores, all named after it, go with it), :func:`forget` right after the
  owner unlinked it. The first :func:`watch` of a process starts its watcher; while the process owns
  watched objects it also turns an unhandled SIGTERM into a clean exit (:func:`_on_sigterm`).
  ``keep_on_crash=True`` or ``SHMBUF_KEEP_ON_CRASH=1`` leaves an object out of all of it.
- **The watcher's half** (:func:`main`): this file run as a script by a fresh interpreter
  (``python -I -S .../_janitor.py``), so it imports the standard library only, never numpy or the
  rest of shmbuf, and starts in milliseconds. It learns of the owner's death through a pidfd (a
  pipe EOF and a poll of pid and start time where Linux has none).

The words, ASCII lines over a pipe that only the owner writes and only the watcher reads (never pickle)::

    shmbuf-watch 1                    first: magic and version
    + <st_dev> <st_ino> <entry>       the owner created the object /dev/shm/<entry>, this inode
    - <entry>                         the owner removed it itself

Order is what makes it safe. The owner sends ``+`` right after its ``O_EXCL`` create returned and
``-`` only after its own unlink, so at no instant is an object of a live owner unwatched. The
watcher removes an entry only after the owner is gone, and only if it is still a regular file
of this uid with the inode the ``+`` named (a name unlinked and made again by anyone is not it);
then the semaphores named after it (``sem.<entry>-<role>``, regular files of this uid) too. One word
per object, not one per name: a pipeline's 17 semaphores cost the owner nothing more, and each is
covered from the instant it exists, since its object was registered before it was made.

Process shape: the owner starts ``python -I -S _janitor.py`` in a session of its own and waits for
it; that process takes a pidfd of the owner (its parent, so certainly alive then), forks the
watcher and exits. So the watcher is no child that anyone must reap; it is outside the owner's
process group and terminal (Ctrl-C, ``timeout`` and ``kill -- -pgid`` do not reach it), and it
ignores SIGINT, SIGTERM and SIGHUP (a cgroup-wide SIGTERM must not take it down with its owner).
"""

from __future__ import annotations

import os
import select
import signal
import stat
import sys
from typing import Any

# signal's own C half: signal.getsignal and signal.signal wrap every value in an enum, 20 times the cost (~20 us a
# call on a loaded machine), and a loop that creates and closes an object installs and restores the handler each time.
try:
    import _signal as _raw_signal  # type: ignore[import-not-found]  # CPython's, with no stubs
except ImportError:  # pragma: no cover - an interpreter without it: the same functions, slower
    _raw_signal = signal

MAGIC = b"shmbuf-watch 1\n"
KEEP_ENV = "SHMBUF_KEEP_ON_CRASH"
SHM_DIR = "/dev/shm"  # shmbuf._names's, which the watcher (no shmbuf package here) cannot import
# Where Linux has no pidfd: how often the watcher asks whether its owner lives (the 1 s promise holds).
POLL_SECONDS = 0.1
# After reading what the owner sent, the watcher reads again no sooner than this (it still sees the
# owner's death at once): an owner that creates and closes thousands of objects wakes it 20 times a
# second at most, whatever it sends (each wake-up costs the owner a context switch on a busy machine).
# The pipe holds what comes meanwhile: 1 MiB asked for, and even the default 64 KiB holds the words of
# some 700 create+close cycles (90 bytes each), 14,000 a second; past that the owner's write waits.
READ_PAUSE = 0.05
PIPE_BYTES = 1 << 20
# This file, the watcher's program: python -I -S SCRIPT OWNER_PID OWNER_START READ_FD [--poll] (see main).
SCRIPT = os.path.abspath(__file__)
_ENTRY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_ROLE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


def entry_ok(entry: str) -> bool:
    """An entry of /dev/shm the watcher may be told of: a shmbuf object's name (``shmbuf-…``, lowercase letters,
    digits and ``-``), so nothing it removes can lie outside /dev/shm or be another program's."""
    return 7 < len(entry) <= 40 and entry.startswith("shmbuf-") and set(entry) <= _ENTRY_CHARS


def role_ok(role: str) -> bool:
    """What follows ``sem.<object>-`` in a semaphore's entry: ``r``, ``f3``, ``s``, ``c12`` (see shmbuf._names)."""
    return 0 < len(role) <= 6 and set(role) <= _ROLE_CHARS


# ====================================================================== the owner's half


def keeping(keep_on_crash: bool) -> bool:
    """Whether an object about to be created is left out of the watch: its ``keep_on_crash``, or
    ``SHMBUF_KEEP_ON_CRASH=1`` (unset, ``""`` or ``0``: watched; anything else is a UsageError naming it).
    Asked once per object by its creator (the environment is read each time: a test may set it)."""
    if keep_on_crash:
        return True
    raw = os.environ.get(KEEP_ENV, "")
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    from shmbuf._errors import UsageError

    raise UsageError(f"{KEEP_ENV}={raw!r}: expected 1 (keep what a process that dies without closing created, for "
                     f"`shmbuf ls` and `shmbuf clean`) or 0 / unset (its watcher removes it)")


class _Owner:
    """This process as an owner: the names it watches (the SIGTERM handler acts while there are some) and its watcher.

    The one instance lives in :data:`_owner`; a forked child drops it (``_after_fork_in_child``) and
    makes its own at its own first object, with its own watcher.
    """

    def __init__(self) -> None:
        import threading

        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.names: dict[str, tuple[int, int]] = {}  # entry -> (st_dev, st_ino), in creation order
        self.fd = -1  # the pipe's write end
        self.pipe: tuple[int, int] = (0, 0)  # its (st_dev, st_ino): a descriptor number reused by another file is not it
        self.watcher = 0  # the watcher's pid (for tests and for `ps`)
        self.broken = ""  # why no watcher could start: then none is tried again in this process

    # -- the pipe -----------------------------------------------------------

    def send(self, line: bytes) -> None:
        """Tell the watcher ``line``; start one (telling it every watched name) if there is none. Holds ``lock``."""
        if self.broken:
            return
        if self.fd >= 0 and self._ours():
            try:
                _write_all(self.fd, line)
                return
            except OSError:  # BrokenPipeError: the watcher is gone (killed by hand); start another
                os.close(self.fd)
        self.fd = -1
        if self.names:
            self._start()

    def _ours(self) -> bool:
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.pipe

    def _start(self) -> None:
        """Start a watcher for this process, with every name watched now already in its pipe."""
        import subprocess

        r, w = os.pipe()  # neither end inherited by exec; a fork's copy of w is closed in the child
        try:
            import fcntl

            fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
        except (ImportError, OSError):
            pass  # the default 64 KiB: the owner may then wait on a slow watcher, never lose a word
        # Everything already watched goes in before the watcher exists, so a death while it starts loses nothing.
        first = MAGIC + b"".join(_plus(e, i) for e, i in self.names.items())
        os.set_blocking(w, False)
        try:
            sent = os.write(w, first)
        except BlockingIOError:
            sent = 0
        os.set_blocking(w, True)
        try:
            from shmbuf._proc import start_time

            argv = [sys.executable, "-I", "-S", SCRIPT, str(self.pid), str(start_time(self.pid)), str(r)]
            if not hasattr(os, "pidfd_open"):
                argv.append("--poll")
            p = subprocess.Popen(argv, pass_fds=(r,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 start_new_session=True)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            os.close(r)
            os.close(w)
            self._give_up(f"{type(exc).__name__}: {exc}")
            return
        os.close(r)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            os.close(w)
            self._give_up("it did not start within 60 s")
            return
        except BaseException:  # a KeyboardInterrupt (or our SIGTERM) while it started: reap it, then raise
            p.kill()
            p.wait()
            os.close(w)
            raise
        if p.returncode != 0 or not out.strip().isdigit():
            os.close(w)
            self._give_up(f"its first process exited with {p.returncode}")
            return
        self.watcher = int(out)
        st = os.fstat(w)
        self.fd, self.pipe = w, (st.st_dev, st.st_ino)
        if sent < len(first):
            _write_all(w, first[sent:])

    def _give_up(self, why: str) -> None:
        import warnings

        self.broken = why
        warnings.warn(f"shmbuf: the watcher that removes this process's shared memory if it dies could not start "
                      f"({why}); close() still removes every object, and `shmbuf clean` what a killed process left",
                      RuntimeWarning, stacklevel=2)

    def _after_fork_in_child(self) -> None:
        """A forked child owns nothing of its parent's: drop the parent's pipe (so the parent's watcher still sees
        EOF when the parent dies) and names, and give SIGTERM back its default."""
        global _owner
        if self.fd >= 0 and self._ours():
            os.close(self.fd)
        self.fd = -1
        _owner = None
        _disarm()


_owner: _Owner | None = None  # this process as an owner (None until its first watched object): see _Owner


def _this_owner() -> _Owner:
    global _owner
    o = _owner
    if o is None or o.pid != os.getpid():  # a pid of its own: a fork that ran no fork hook (os.fork from C)
        if o is not None:
            o._after_fork_in_child()
        o = _owner = _Owner()
        from shmbuf import _fork

        _fork.track(o)
    return o


def _plus(entry: str, ident: tuple[int, int]) -> bytes:
    return b"+ %d %d %s\n" % (ident[0], ident[1], entry.encode())


def _write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)  # whole at once unless more than the pipe holds, or a signal cut it short
    if n < len(data):
        view = memoryview(data)[n:]
        while view:
            view = view[os.write(fd, view):]


def watch(entry: str, st: os.stat_result, *, keep: bool = False) -> None:
    """The owner just created /dev/shm/``entry`` (its ``fstat``/``lstat`` is ``st``): remove it if this process dies
    without removing it. ``keep`` (what :func:`keeping` said for the object): do nothing."""
    if keep:
        return
    o = _this_owner()
    with o.lock:
        o.names[entry] = (st.st_dev, st.st_ino)
        o.send(_plus(entry, o.names[entry]))
        first = len(o.names) == 1
    if first:
        _arm()


def forget(*entries: str) -> None:
    """The owner removed these entries itself (already gone from /dev/shm): nothing to do for them at its death."""
    o = _owner
    if o is None or o.pid != os.getpid():
        return
    with o.lock:
        gone = [e for e in entries if o.names.pop(e, None) is not None]
        if gone:
            o.send(b"".join(b"- %s\n" % e.encode() for e in gone))
        last = gone and not o.names
    if last:
        _disarm()


def watcher_pid() -> int:
    """The pid of this process's watcher (0 if it has none): for tests and diagnostics."""
    o = _owner
    return o.watcher if o is not None and o.pid == os.getpid() else 0


# -- SIGTERM ------------------------------------------------------------------
#
# A library must not take a signal from its user. So: installed only when the process's first watched
# object is created, only from the main thread, only over SIG_DFL (a handler of the user's, or SIG_IGN,
# is left alone, and one installed later replaces ours and is never touched); put back when the last
# watched object is removed, if it is still ours. While installed, the first SIGTERM raises SystemExit(143)
# in the main thread, so `with` blocks, finally clauses, finalizers and atexit run as for Ctrl-C; a second
# one kills at once. With no watched object left (or in a process it was not installed by) it acts as
# SIG_DFL would. docs/reliability.md ("A dead owner leaves nothing") says it for users.


def _on_sigterm(signum: int, frame: Any) -> None:
    o = _owner
    _raw_signal.signal(_raw_signal.SIGTERM, _raw_signal.SIG_DFL)  # whatever happens next, a second SIGTERM kills
    if o is None or o.pid != os.getpid() or not o.names:  # nothing of ours to close: die as SIG_DFL would have
        os.kill(os.getpid(), signal.SIGTERM)
    raise SystemExit(128 + signum)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _arm() -> None:
    if not _main_thread():
        return
    try:
        if _raw_signal.getsignal(_raw_signal.SIGTERM) == _raw_signal.SIG_DFL:
            _raw_signal.signal(_raw_signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main interpreter
        pass


def _disarm() -> None:
    if not _main_thread():
        return  # left installed: with nothing watched it acts as SIG_DFL
    try:
        if _raw_signal.getsignal(_raw_signal.SIGTERM) is _on_sigterm:
            _raw_signal.signal(_raw_signal.SIGTERM, _raw_signal.SIG_DFL)
    except ValueError:
        pass


# ====================================================================== the watcher's half


def main(argv: list[str]) -> int:
    """``_janitor.py OWNER_PID OWNER_START READ_FD [--poll]``: become the watcher of OWNER_PID (see the module doc)."""
    owner, start, fd = int(argv[1]), int(argv[2]), int(argv[3])
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    pidfd = -1
    if "--poll" not in argv and hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(owner)
        except OSError:
            pidfd = -1
    # Until we fork, the owner is our parent: if it still is, the pidfd is certainly the owner's.
    gone = os.getppid() != owner
    child = os.fork()
    if child:
        os.write(1, b"%d\n" % child)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # the owner's read of our pid ends with the middle process
    os.close(devnull)
    os.chdir("/")  # hold no directory busy
    os.set_blocking(fd, False)
    return _Watcher(owner, start, fd, pidfd).run(gone)


class _Watcher:
    """The watcher's state: the owner, its pipe, and the entries it registered (``+``) and not yet removed (``-``)."""

    def __init__(self, owner: int, start: int, fd: int, pidfd: int):
        self.owner, self.start, self.fd, self.pidfd = owner, start, fd, pidfd
        self.names: dict[str, tuple[int, int]] = {}
        self.buf = b""
        self.greeted = False
        self.eof = False
        self.foreign = False  # the stream did not start with MAGIC: trust nothing in it
        self._alive: Any = None

    def run(self, gone: bool) -> int:
        death = select.poll()  # the owner's pidfd alone
        words = select.poll()  # the pipe, and the pidfd if there is one
        words.register(self.fd, select.POLLIN)
        if self.pidfd >= 0:
            death.register(self.pidfd, select.POLLIN)
            words.register(self.pidfd, select.POLLIN)
        while not gone:
            self.read()
            if self.foreign or (self.eof and not self.names):
                return 0  # nothing is watched, and nothing more can come
            gone = self.wait(death, words)
        self.read()  # what the owner sent before it died is in the pipe still
        if not self.foreign:
            self.remove()
        return 0

    def wait(self, death: Any, words: Any) -> bool:
        """Sleep until the owner sent words or died; True once it is gone. Words are read at most every
        READ_PAUSE (the owner's death is seen at once all the same)."""
        if self.pidfd >= 0:
            if self.eof:
                death.poll()
                return True
            if any(f == self.pidfd for f, _ in words.poll()):
                return True
            return bool(death.poll(READ_PAUSE * 1000))
        # No pidfd: pid and start time every POLL_SECONDS, and at once when the pipe says something (or ends).
        if self.eof:
            death.poll(POLL_SECONDS * 1000)  # registered to nothing: a sleep
        elif words.poll(POLL_SECONDS * 1000):
            death.poll(READ_PAUSE * 1000)
        return not self.owner_alive()

    def owner_alive(self) -> bool:
        """Without a pidfd: pid and start time, by shmbuf's one reader of /proc/<pid>/stat (loaded by path: we are
        not shmbuf's package here)."""
        if self._alive is None:
            import importlib.util

            spec = importlib.util.spec_from_file_location("_shmbuf_proc", os.path.join(os.path.dirname(SCRIPT), "_proc.py"))
            assert spec is not None and spec.loader is not None
            proc = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = proc  # dataclasses looks the module up while it builds Owner
            spec.loader.exec_module(proc)
            self._alive = proc.alive
        return bool(self._alive(self.owner, self.start))

    def read(self) -> None:
        """Take in every whole line in the pipe now; note EOF."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > 4096:  # no word is this long: not our owner's stream
            self.foreign = True
        for line in lines:
            self.take(line)

    def take(self, line: bytes) -> None:
        if not self.greeted:
            self.greeted = True
            self.foreign = line + b"\n" != MAGIC
            return
        if self.foreign:
            return
        parts = line.decode("ascii", "replace").split(" ")
        if len(parts) == 4 and parts[0] == "+" and parts[1].isdigit() and parts[2].isdigit() and entry_ok(parts[3]):
            self.names[parts[3]] = (int(parts[1]), int(parts[2]))
        elif len(parts) == 2 and parts[0] == "-":
            self.names.pop(parts[1], None)

    def remove(self) -> None:
        """Unlink each object still registered that is still the very file registered, and its semaphores; say
        what went, on stderr."""
        uid = os.getuid()
        try:
            listing = os.listdir(SHM_DIR) if self.names else []
        except OSError:
            listing = []
        objects, sems = [], 0
        for entry, ident in self.names.items():
            now = _ours(entry, uid)
            if now is not None and now != ident:
                continue  # not the file the owner made: that name was unlinked and made again, and so are its semaphores
            # The object itself, or nothing where it was: another remover (the owner's own close, `shmbuf clean`) may
            # have been stopped after the object and before its semaphores (names with the owner's random token).
            head = f"sem.{entry}-"
            for e in listing:
                if e.startswith(head) and role_ok(e[len(head):]) and _ours(e, uid) and _unlink(e):
                    sems += 1
            if now is not None and _unlink(entry):
                objects.append("/" + entry)
        if objects:
            try:
                os.write(2, (f"shmbuf: process {self.owner} ended without removing {len(objects)} shared-memory "
                             f"object(s); its watcher removed them (and {sems} semaphore(s)): {' '.join(objects)}. "
                             f"{KEEP_ENV}=1 keeps them for a post-mortem\n").encode())
            except OSError:
                pass


def _ours(entry: str, uid: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of /dev/shm/``entry`` if it is a regular file of ``uid`` (never following a link), else None."""
    try:
        st = os.lstat(f"{SHM_DIR}/{entry}")
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) and st.st_uid == uid else None


def _unlink(entry: str) -> bool:
    try:
        os.unlink(f"{SHM_DIR}/{entry}")
    except OSError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv))
