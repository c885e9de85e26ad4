"""ActorPool: start N actor processes, watch them, restart a crashed one if asked, stop them all by a deadline.

Each actor runs ``target(ctx, *args, **kwargs)`` in its own process, where
``ctx`` is an :class:`ActorContext`. Between the pool and each actor there is
one ``multiprocessing`` pipe carrying msgpack bytes only (``send_bytes``): the
pool sends ``stop``; the actor sends ``error`` with its exception's type,
message and traceback as text. Nothing on it is ever pickled; the start
method pickles only ``target`` and its arguments, once, to start the process,
and the child unpickles them in this module's code (:mod:`workers._child`), so
that a failure there is reported like any other. An actor that dies without a
word is raised with the last lines of its stderr, which it tees into a ring the
pool reads (bytes in a temp file, :class:`workers._child.StderrTail`).

Inside each actor a small watchdog thread (started by the pool's child
wrapper, never in the learner) waits on the pipe and on a pidfd of the
learner (``os.pidfd_open``, Linux >= 5.3), which becomes readable when the
learner exits. The learner opens that pidfd on itself, so it is certainly
the learner's (no recycled pid), and hands it to the actor as the start
method hands over any fd: inherited under ``fork``, passed with the new
process under ``spawn`` and ``forkserver`` (where the actor's parent is the
fork server, not the learner). If the learner died, the actor exits at once
with code 75 (``EX_TEMPFAIL``) from that thread, even if its main thread
hangs inside an env. Where there is no pidfd, the watchdog polls the
learner's pid every 0.2 s instead (a recycled pid would fool it).

Actors ignore SIGINT: Ctrl-C in a terminal reaches the whole process group,
and it is the learner's job to stop its actors.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import multiprocessing.connection
import os
import select
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import msgpack

import shmbuf
from shmbuf import ActorError, StartTimeout, StateError
from shmbuf.lowlevel import int_setting, timeout_setting
from workers._actor_end import describe_exit, last_words, other_threads, start_timeout_error, where
from workers._child import Payload, StderrTail, load_error, tee_stderr
from workers._lifetime import Lifetime

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

CLOSE_TIMEOUT = 5.0  # what close() gives the actors by default
EXIT_ERROR = 1
EXIT_ORPHANED = 75
WATCH_INTERVAL = 0.2
MAX_TEXT = 16000
_MSG_FIELDS = {"stop": set(), "ready": set(), "error": {"type", "message", "traceback"}}


def _encode(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"kind": kind, **fields}, use_bin_type=True)


def _decode(data: bytes) -> dict[str, Any] | None:
    """A checked message, or None for anything malformed (dropped, never trusted)."""
    if len(data) > 4 * MAX_TEXT:
        return None
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0, max_array_len=16,
                              max_map_len=16)
    except Exception:  # noqa: BLE001  # msgpack raises several unrelated types on garbage
        return None
    if not isinstance(msg, dict):
        return None
    kind = msg.get("kind")
    fields = _MSG_FIELDS.get(kind) if isinstance(kind, str) else None  # an unhashable kind (a list) is garbage too
    if fields is None or set(msg) != fields | {"kind"} or not all(isinstance(msg[f], str) for f in fields):
        return None
    return msg


def _error_of(msg: dict[str, Any], index: int, pid: int | None) -> ActorError:
    """The :class:`ActorError` an actor's ``error`` message stands for."""
    return ActorError(f"actor {index} (pid {pid}) raised {msg['type']}: {msg['message']}", index=index, pid=pid,
                      kind=msg["type"], remote_traceback=msg["traceback"])


class LearnerWatch:
    """In an actor: is the learner still alive? A pidfd of the learner, readable once the learner has exited.

    Made in the learner (:meth:`open`, on itself, so that the pidfd is
    certainly the learner's) and given to the actor in the process's
    arguments: ``fork`` inherits the fd; ``spawn`` and ``forkserver`` pass it
    with the new process, as they pass a ``multiprocessing`` Connection's fd
    (``multiprocessing.reduction.DupFd``). ``fd`` is -1 where ``os.pidfd_open``
    is missing or refused: then the pid alone is checked.
    """

    def __init__(self, pid: int, fd: int):
        self.pid = pid
        self.fd = fd
        self._poll: Any = None

    @classmethod
    def open(cls, pid: int) -> LearnerWatch:
        try:
            return cls(pid, os.pidfd_open(pid))
        except (AttributeError, OSError):  # not Linux >= 5.3 (or seccomp says no)
            return cls(pid, -1)

    def __reduce__(self) -> Any:
        return _rebuild_watch, (self.pid, mp.reduction.DupFd(self.fd) if self.fd >= 0 else None)

    def alive(self) -> bool:
        if self.fd < 0:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)
        return not self._poll.poll(0)

    def waitable(self) -> list[int]:
        """What ``multiprocessing.connection.wait`` can wait on to hear of the learner's exit."""
        return [self.fd] if self.fd >= 0 else []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rebuild_watch(pid: int, dup: Any) -> LearnerWatch:
    return LearnerWatch(pid, dup.detach() if dup is not None else -1)


class ActorContext:
    """What an actor process knows about its pool: its index, and whether it was asked to stop.

    Read :attr:`stop_requested` often (it is a plain attribute read); return
    from the target when it is set. An exception raised by the target is sent
    to the learner with its traceback and raised there by the pool.
    """

    def __init__(self, index: int, incarnation: int, conn: Any, learner: LearnerWatch):
        self.index = index
        self.incarnation = incarnation
        self.learner_pid = learner.pid
        self._learner = learner
        self._conn = conn
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # the watchdog's way out: see _end_watch
        self.stop_requested = False

    def learner_alive(self) -> bool:
        return self._learner.alive()

    def ready(self) -> None:
        """Tell the pool this actor is set up (e.g. its Writers are attached): see :meth:`ActorPool.wait_ready`."""
        with self._send_lock:
            try:
                self._conn.send_bytes(_encode("ready"))
            except OSError:
                pass

    def send_error(self, exc: BaseException, message: str | None = None) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if len(tb) > MAX_TEXT:
            tb = "…" + tb[-MAX_TEXT:]
        text = str(exc) if message is None else message
        msg = _encode("error", type=type(exc).__name__, message=text[:2000], traceback=tb)
        with self._send_lock:
            try:
                self._conn.send_bytes(msg)
            except OSError:
                pass  # the learner is gone; nobody is left to tell

    def _watch(self) -> None:
        conn, wake = self._conn, self._wake_r
        learner = self._learner.waitable()
        waitables = [conn, wake, *learner]
        while True:
            try:
                ready = mp.connection.wait(waitables, WATCH_INTERVAL)
                if wake in ready:
                    return  # the actor is leaving (_end_watch): it joins us before it lets go of the pipe and fds
                if conn in ready:
                    msg = _decode(conn.recv_bytes())
                    if msg is not None and msg["kind"] == "stop":
                        self.stop_requested = True
            except (EOFError, OSError):
                self.stop_requested = True  # the pool closed its end: stopping, or gone
                waitables = [wake, *learner]
            if not self._learner.alive():
                os._exit(EXIT_ORPHANED)  # the learner died: leave now, whatever the main thread is doing

    def _end_watch(self, watchdog: threading.Thread) -> None:
        """Stop the watchdog and join it, then close what it waited on (never the other way round)."""
        os.write(self._wake_w, b"x")
        watchdog.join(5 * WATCH_INTERVAL)
        if not watchdog.is_alive():
            os.close(self._wake_r)
        os.close(self._wake_w)


def _child_main(payload: Payload, index: int, incarnation: int, conn: Any, learner: LearnerWatch,
                tail: StderrTail | int) -> None:
    tee_stderr(tail.fd if isinstance(tail, StderrTail) else tail)  # first: what follows may print its death
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = ActorContext(index, incarnation, conn, learner)
    if not ctx.learner_alive():
        os._exit(EXIT_ORPHANED)
    watchdog = threading.Thread(target=ctx._watch, name="shmbuf-actor-watchdog", daemon=True)
    watchdog.start()
    try:
        _run_target(ctx, payload)
    finally:
        ctx._end_watch(watchdog)


def _run_target(ctx: ActorContext, payload: Payload) -> None:
    try:
        target, args, kwargs = payload.load()
    except Exception as exc:  # noqa: BLE001  # anything unpickling raises: reported, then the exit code says so
        traceback.print_exc()  # on the child's stderr, where a failed start always showed
        ctx.send_error(exc, load_error(exc))
        raise SystemExit(EXIT_ERROR) from None
    try:
        target(ctx, *args, **kwargs)
    except shmbuf.PipelineClosed:
        pass  # the learner closed the pipeline: a normal way to be told to stop
    except shmbuf.BrokenPipeline:
        os._exit(EXIT_ORPHANED)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001  # whatever the actor raised goes to the learner, then the exit code says so
        if ctx.stop_requested and isinstance(exc, (BrokenPipeError, EOFError)):
            return
        ctx.send_error(exc)
        raise SystemExit(EXIT_ERROR) from None


class _Actor:
    __slots__ = ("index", "proc", "pid", "conn", "incarnation", "error", "state", "exitcode", "ready", "tail", "started",
                 "forked_beside")

    def __init__(self, index: int):
        self.index = index
        self.pid: int | None = None
        self.proc: Any = None
        self.conn: Any = None
        self.tail: StderrTail | None = None  # the last lines of its stderr, read if it dies without a word
        self.incarnation = -1
        self.error: ActorError | None = None
        self.state = "new"  # running, done (exited 0), failed, stopped
        self.exitcode: int | None = None
        self.ready = False
        self.started = 0.0  # time.monotonic() when this incarnation was started: ready_timeout counts from here
        self.forked_beside: list[str] = []  # under fork: the learner's other threads at that instant


def restart_or_raise(pool: Any, member: Any, err: ActorError) -> None:
    """A pool's member (an actor, or a :class:`workers.ThreadActorPool` thread) failed with ``err``: record it,
    call the pool's ``on_failure``, then restart the member within the pool's budget, or mark it failed and raise."""
    pool.failures.append(err)
    if pool.on_failure is not None:
        pool.on_failure(member.index)  # before any replacement starts
    if pool.restart and pool.restarts < pool.max_restarts and not pool._stopped:
        pool.restarts += 1
        pool._spawn(member)
        return
    member.state = "failed"
    raise err


def default_start_method() -> str:
    """forkserver where the platform has it (Python 3.14's default on Linux), else spawn."""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class ActorPool:
    """N actor processes running ``target(ctx, *args, **kwargs)``.

    Args:
        target: a picklable callable (a module-level function) run in each actor.
        num_actors: how many.
        args, kwargs: passed to ``target`` after ``ctx``; the same for every
            actor (``ctx.index`` tells them apart). Pickled once per start.
        start_method: ``"forkserver"`` (default where available), ``"spawn"``,
            or ``"fork"`` (fast; only safe before the learner starts threads).
        restart: restart an actor that failed (raised or died), up to
            ``max_restarts`` times in all; its error is kept in :attr:`failures`.
        max_restarts: the budget for ``restart``.
        name: process name prefix.
        on_failure: called with an actor's index when it failed, before its replacement starts
            (the inference collector retires the actor's client slot there).
        ready_timeout: None (the default), or seconds: a replacement (``restart``) that has not called
            ``ctx.ready()`` this long after it was started is a failed start: :meth:`check` kills it and restarts
            it within the budget, or raises :class:`ActorError` (``kind="start_timeout"``) saying what its
            threads were waiting on and the last lines of its stderr. The collectors pass theirs. The first
            start is what :meth:`wait_ready` awaits (its timeout, :class:`shmbuf.StartTimeout`).

    :meth:`check` (call it often, e.g. between batches) raises the first
    failure that is not restarted, as :class:`ActorError` with the actor's
    traceback. :meth:`close` stops all within one deadline; so does dropping the
    pool, or the interpreter's exit (before ``multiprocessing`` joins its
    children: :mod:`workers._lifetime`). A context manager.
    """

    def __init__(self, target: Callable[..., Any], num_actors: int, *, args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None, start_method: str | None = None, restart: bool = False,
                 max_restarts: int = 3, name: str = "shmbuf-actor", on_failure: Callable[[int], None] | None = None,
                 ready_timeout: float | None = None):
        num_actors = int_setting("num_actors", num_actors)
        self.ready_timeout = timeout_setting("ActorPool(ready_timeout=...)", ready_timeout)
        method = start_method or default_start_method()
        if method not in mp.get_all_start_methods():
            raise shmbuf.UsageError(f"start_method: expected one of {mp.get_all_start_methods()}, got {method!r}")
        self.target = target
        self.num_actors = num_actors
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.start_method = method
        self.restart = restart
        self.max_restarts = max_restarts
        self.restarts = 0
        self.name = name
        self.on_failure = on_failure
        self.failures: list[ActorError] = []
        # cast: typeshed's get_context(str) is a BaseContext, which has no Process; method is one of these three
        self._ctx = cast("ForkContext | ForkServerContext | SpawnContext", mp.get_context(method))
        self._pid = os.getpid()
        self._actors = [_Actor(i) for i in range(num_actors)]
        self._started = False
        self._stopped = False
        # The actors are stopped at close, when the pool is dropped, or at exit (before multiprocessing joins them)
        self._life = Lifetime(self, CLOSE_TIMEOUT)
        self._life.hold("actors", functools.partial(_stop_if_started, self._actors))
        self._life.arm()

    # -- starting -----------------------------------------------------------

    def start(self) -> ActorPool:
        if self._started:
            # no ShmbufError fits: it must stay a RuntimeError, and UsageError is a ValueError
            raise StateError("this ActorPool was already started")
        self._started = True
        try:
            for a in self._actors:
                self._spawn(a)
        except BaseException:
            self.close(timeout=2.0)
            raise
        return self

    def _spawn(self, a: _Actor) -> None:
        here, there = self._ctx.Pipe(duplex=True)
        learner = LearnerWatch.open(self._pid)  # taken here, where the learner is certainly alive
        tail = StderrTail()
        a.incarnation += 1
        p = self._ctx.Process(
            target=_child_main,
            args=(Payload((self.target, self.args, self.kwargs)), a.index, a.incarnation, there, learner, tail),
            name=f"{self.name}-{a.index}",
            daemon=False,  # an actor may start processes of its own (e.g. an AsyncVectorEnv)
        )
        beside = other_threads() if self.start_method == "fork" else []  # for a start timeout's message
        try:
            p.start()
        except BaseException:
            tail.close()
            raise
        finally:
            there.close()  # the child has its own copies of both fds now
            learner.close()
        a.proc, a.pid, a.conn, a.state, a.error, a.exitcode, a.ready = p, p.pid, here, "running", None, None, False
        a.tail, a.started, a.forked_beside = tail, time.monotonic(), beside

    # -- watching -----------------------------------------------------------

    @property
    def pids(self) -> list[int | None]:
        return [a.pid for a in self._actors]

    @property
    def states(self) -> list[str]:
        return [a.state for a in self._actors]

    def alive(self) -> int:
        """How many actors are running."""
        return sum(1 for a in self._actors if a.proc is not None and a.state == "running" and a.proc.is_alive())

    def sentinels(self) -> list[int]:
        """Process sentinels and pipes of running actors, for ``multiprocessing.connection.wait``."""
        out = []
        for a in self._actors:
            if a.state == "running":
                out += [a.proc.sentinel, a.conn]
        return out

    def check(self, timeout: float = 0.0) -> None:
        """Take in actors' messages and exits (waiting up to ``timeout`` for one); restart or raise failures.

        Raises:
            ActorError: an actor failed and was not restarted (raised once per failure).
        """
        if timeout > 0:
            ready = self.sentinels()
            if ready:
                mp.connection.wait(ready, timeout)
        for a in self._actors:
            if a.state != "running":
                continue
            _drain(a)
            if a.proc.exitcode is None:
                if not a.ready and a.incarnation and self.ready_timeout is not None and \
                        time.monotonic() - a.started > self.ready_timeout:  # a replacement that never got ready
                    self._start_failed(a)
                continue
            a.proc.join(0)
            _drain(a)
            a.exitcode = a.proc.exitcode
            if a.exitcode == 0 and a.error is None:
                a.state = "done"
                self._close_actor(a)
                continue
            err = a.error or ActorError(f"actor {a.index} (pid {a.pid}) died: {describe_exit(a.exitcode)}, without "
                                        f"reporting an exception{last_words(a)}", index=a.index, pid=a.pid,
                                        kind="died", exitcode=a.exitcode)
            err.exitcode = a.exitcode
            self._close_actor(a)
            restart_or_raise(self, a, err)

    def _start_failed(self, a: _Actor) -> None:
        """Actor ``a`` did not call ``ctx.ready()`` within ``ready_timeout``: kill it, then restart or raise."""
        seen = where(a.pid) if a.pid is not None else ""  # what it waits on, before the kill ends it
        a.proc.kill()
        a.proc.join(CLOSE_TIMEOUT)  # SIGKILL: it goes at once, wherever it waits (D state aside)
        _drain(a)
        a.exitcode = a.proc.exitcode
        err = start_timeout_error(a, cast(float, self.ready_timeout), self.start_method, seen)
        err.exitcode = a.exitcode
        self._close_actor(a)
        restart_or_raise(self, a, err)

    def wait_ready(self, timeout: float = 60.0, *, interrupted: Callable[[], bool] | None = None) -> None:
        """Wait until every running actor called ``ctx.ready()``; raise its failure if one fails first.

        The collector uses it so that the reader first meets all writer lanes
        at once and shares its slots among them. ``interrupted``: asked every 0.1 s; True ends the wait
        with :class:`shmbuf.PipelineClosed` (the collector's close, from another thread).
        """
        deadline = time.monotonic() + timeout
        while True:
            if interrupted is not None and interrupted():
                raise shmbuf.PipelineClosed("the wait for the actors to start was interrupted: the collector is closing")
            self.check()
            if all(a.ready for a in self._actors if a.state == "running"):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [a.index for a in self._actors if a.state == "running" and not a.ready]
                # not SlotTimeout (no ShmbufError fits yet): a node owner's batch loop in workers._ray takes a
                # SlotTimeout as 'nothing yet, ask again', and a start that never comes must not be retried so
                raise StartTimeout(f"actors {waiting} were not ready within {timeout} s")
            self.check(timeout=min(left, 0.1))

    def _close_actor(self, a: _Actor) -> None:
        _close_conn(a)
        try:
            a.proc.close()
        except ValueError:
            pass  # still running: left to stop()

    # -- stopping -----------------------------------------------------------

    def close(self, timeout: float | None = None) -> dict[int, int | None]:
        """Stop every actor within ``timeout`` seconds in all (None: 5 s): ask, then SIGTERM, then SIGKILL.

        The first half of the budget is for actors to return from their
        target; at 80 % the rest get SIGTERM; at 100 % SIGKILL (and are reaped).
        Returns ``{index: exitcode}``. Errors reported meanwhile go to :attr:`failures`.
        """
        self._stopped = True
        if self._pid != os.getpid():
            return {}
        codes = _stop_all(self._actors, CLOSE_TIMEOUT if timeout is None else timeout)
        for a in self._actors:
            if a.state == "running":
                a.state = "stopped"
                if a.error is not None:
                    self.failures.append(a.error)
        self._life.close(0.0)  # the actors are stopped: nothing is left to let go at exit
        return codes

    def __enter__(self) -> ActorPool:
        if not self._started:
            self.start()
        return self

    def stop(self, timeout: float | None = None) -> dict[int, int | None]:
        """Deprecated name of :meth:`close` (CHANGELOG.md: one verb, ``close``, ends every object)."""
        warnings.warn("ActorPool.stop() is now ActorPool.close() (CHANGELOG.md)", DeprecationWarning, stacklevel=2)
        return self.close(timeout)

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ActorPool({self.name!r}, {self.num_actors} actors, {self.start_method}, states={self.states})"


def _drain(a: _Actor) -> None:
    """Take in every message an actor has sent: ``ready``, and its first ``error`` (kept in ``a.error``)."""
    try:
        while a.conn.poll(0):
            msg = _decode(a.conn.recv_bytes())
            if msg is not None and msg["kind"] == "ready":
                a.ready = True
            elif msg is not None and msg["kind"] == "error" and a.error is None:
                a.error = _error_of(msg, a.index, a.pid)
    except (EOFError, OSError, ValueError):  # ValueError: the pipe is closed already
        pass


def _close_conn(a: _Actor) -> None:
    try:
        a.conn.close()
    except OSError:
        pass
    if a.tail is not None:
        a.tail.close()
        a.tail = None


def _stop_if_started(actors: list[_Actor], timeout: float) -> None:
    """The pool's release (its lifetime's): stop the actors still running, within ``timeout``."""
    if any(a.proc is not None and a.state == "running" for a in actors):
        _stop_all(actors, timeout)


def _stop_all(actors: list[_Actor], timeout: float) -> dict[int, int | None]:
    t0 = time.monotonic()
    deadline = t0 + timeout
    running = [a for a in actors if a.proc is not None and a.state == "running"]
    for a in running:
        try:
            a.conn.send_bytes(_encode("stop"))
        except (OSError, ValueError):
            pass

    def wait_until(t: float) -> list[_Actor]:
        left = [a for a in running if a.proc.exitcode is None]
        while left:
            remaining = t - time.monotonic()
            if remaining <= 0:
                break
            mp.connection.wait([a.proc.sentinel for a in left], remaining)
            left = [a for a in left if a.proc.exitcode is None]
        return left

    left = wait_until(t0 + 0.5 * timeout)
    for a in left:
        a.proc.terminate()
    left = wait_until(t0 + 0.8 * timeout)
    for a in left:
        a.proc.kill()
    wait_until(deadline)
    codes: dict[int, int | None] = {}
    for a in running:
        _drain(a)  # keep an error reported on the way out
        a.exitcode = codes[a.index] = a.proc.exitcode
        _close_conn(a)
        if a.proc.exitcode is not None:
            a.proc.join(0)
            a.proc.close()
    return codes
