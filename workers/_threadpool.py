"""ThreadActorPool: ActorPool's interface over threads of this process, for envs too cheap to earn a process.

The inference collector's ``env_backend="threading"``: each env worker is a
thread running the same target as a process would (``target(ctx, *args)``),
with the same context (``index``, ``incarnation``, ``stop_requested``,
``ready()``) and the same failure reports (:class:`workers.ActorError` with
the traceback). What threads cannot do: be killed. :meth:`close` asks, and a
thread still inside a hung env step at the deadline is left running (a
daemon thread) and reported in :attr:`ThreadActorPool.hung`.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import shmbuf
from shmbuf.lowlevel import int_setting
from workers._lifetime import Lifetime
from workers._pool import ActorError, restart_or_raise


class ThreadContext:
    """What an env-worker thread knows about its pool: as :class:`workers.ActorContext`."""

    def __init__(self, index: int, incarnation: int):
        self.index = index
        self.incarnation = incarnation
        self.stop_requested = False
        self.is_ready = False

    def ready(self) -> None:
        self.is_ready = True

    def learner_alive(self) -> bool:
        return True  # the learner is this process


class _Worker:
    __slots__ = ("index", "thread", "ctx", "error", "state", "incarnation")

    def __init__(self, index: int):
        self.index = index
        self.thread: threading.Thread | None = None
        self.ctx: ThreadContext | None = None
        self.error: ActorError | None = None
        self.state = "new"
        self.incarnation = -1


class ThreadActorPool:
    """N threads running ``target(ctx, *args)``; the subset of :class:`workers.ActorPool` the collectors use."""

    def __init__(self, target: Callable[..., Any], num_actors: int, *, args: tuple[Any, ...] = (), restart: bool = False,
                 max_restarts: int = 3, name: str = "shmbuf-env", on_failure: Callable[[int], None] | None = None):
        num_actors = int_setting("num_actors", num_actors)
        self.target = target
        self.num_actors = num_actors
        self.args = tuple(args)
        self.restart = restart
        self.max_restarts = max_restarts
        self.restarts = 0
        self.name = name
        self.on_failure = on_failure
        self.failures: list[ActorError] = []
        self.hung: list[int] = []
        self._workers = [_Worker(i) for i in range(num_actors)]
        self._stopped = False
        # The threads are asked to stop and joined at close, when the pool is dropped, or at exit
        self._life = Lifetime(self, 5.0)
        self._life.hold("threads", functools.partial(_stop_threads, self._workers))

    def start(self) -> ThreadActorPool:
        for w in self._workers:
            self._spawn(w)
        self._life.arm()
        return self

    def _spawn(self, w: _Worker) -> None:
        w.incarnation += 1
        w.ctx = ThreadContext(w.index, w.incarnation)
        w.error = None
        w.thread = threading.Thread(target=self._main, args=(w, w.ctx), name=f"{self.name}-{w.index}", daemon=True)
        w.state = "running"
        w.thread.start()

    def _main(self, w: _Worker, ctx: ThreadContext) -> None:
        try:
            self.target(ctx, *self.args)
        except (shmbuf.PipelineClosed, shmbuf.BrokenPipeline):
            pass  # the collector closed the pipeline or the table: told to stop
        except BaseException as exc:  # noqa: BLE001  # the thread's end: kept as the worker's ActorError for check()
            if ctx.stop_requested:
                return
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            w.error = ActorError(f"env worker {w.index} (thread) raised {type(exc).__name__}: {exc}", index=w.index,
                                 pid=None, kind=type(exc).__name__, remote_traceback=tb)

    @property
    def pids(self) -> list[int | None]:
        return [None] * self.num_actors

    @property
    def states(self) -> list[str]:
        return [w.state for w in self._workers]

    def alive(self) -> int:
        return sum(1 for w in self._workers if w.state == "running" and w.thread is not None and w.thread.is_alive())

    def check(self, timeout: float = 0.0) -> None:
        """Take in finished threads; restart or raise (:class:`workers.ActorError`) failures."""
        if timeout > 0:
            time.sleep(min(timeout, 0.01))
        for w in self._workers:
            if w.state != "running" or w.thread is None or w.thread.is_alive():
                continue
            if w.error is None:
                w.state = "done"
                continue
            restart_or_raise(self, w, w.error)

    def wait_ready(self, timeout: float = 60.0, *, interrupted: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if interrupted is not None and interrupted():
                raise shmbuf.PipelineClosed("the wait for the env worker threads to start was interrupted: the "
                                            "collector is closing")
            self.check()
            if all(w.ctx is not None and w.ctx.is_ready for w in self._workers if w.state == "running"):
                return
            if time.monotonic() > deadline:
                waiting = [w.index for w in self._workers
                           if w.state == "running" and not (w.ctx is not None and w.ctx.is_ready)]
                # not SlotTimeout (no ShmbufError fits yet): a node owner's batch loop in workers._ray takes a
                # SlotTimeout as 'nothing yet, ask again', and a start that never comes must not be retried so
                raise shmbuf.StartTimeout(f"env worker threads {waiting} were not ready within {timeout} s")
            time.sleep(0.005)

    def close(self, timeout: float | None = None) -> dict[int, int | None]:
        """Ask every thread to stop and wait up to ``timeout`` s in all (None: 5 s); a thread still running is left in
        :attr:`hung`."""
        self._stopped = True
        _stop_threads(self._workers, 5.0 if timeout is None else timeout)
        for w in self._workers:
            if w.thread is not None:
                if w.thread.is_alive():
                    self.hung.append(w.index)
                elif w.state == "running":
                    w.state = "stopped"
                    if w.error is not None:
                        self.failures.append(w.error)
        self._life.close(0.0)  # the threads are stopped (or hung): nothing is left to let go at exit
        return {w.index: None for w in self._workers}


def _stop_threads(workers: list[_Worker], timeout: float) -> None:
    """Ask every thread to stop and join them within ``timeout`` s in all (the pool's lifetime's release too)."""
    for w in workers:
        if w.ctx is not None:
            w.ctx.stop_requested = True
    deadline = time.monotonic() + timeout
    for w in workers:
        if w.thread is not None:
            w.thread.join(max(0.0, deadline - time.monotonic()))
