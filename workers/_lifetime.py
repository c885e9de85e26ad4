"""One lifetime contract for every owner in workers: ``close(timeout=None)``, and what it holds let go in reverse.

An owner (a collector, a pool, a Ray node) makes a :class:`Lifetime` first thing and, as it gets each thing it
holds (a pipeline, a weight broadcast, an inference server, a pool of actors, a thread), registers how to let it go:
``lifetime.hold(name, release)``, ``release(timeout)`` taking the seconds left of the owner's budget. Its
``close(timeout=None)`` is :meth:`Lifetime.close`: every release, once, newest first, within one budget (None: the
owner's default). The same runs, once, if the owner is dropped without ``close()`` (one ``weakref.finalize``) and
at interpreter exit. Nothing else ends an owner: no ``__del__``, no second finalizer.

Order is the contract. An owner registers what it must let go *first* last, so that an object that owns a thread
stops and joins it before what the thread waits on is released (docs/workers.md, "Shutting down"): a collector
holds its pipelines, then its placements, then its pool, then "wake the writers" (its pipelines closed again, early,
so that an actor waiting for a slot sees it within 0.1 s), then its inference servers' stop; :meth:`close` runs them
the other way round.

At exit the order holds too. :meth:`Lifetime.arm` (called once the owner holds everything, at the end of its
construction) registers an ``atexit`` hook, which runs before the hooks registered earlier: the finalizers of
shmbuf's own objects (``weakref.finalize``'s hook is registered when the process's first finalizer is made, at the
latest by the owner's own pipeline) and ``multiprocessing``'s, which joins the actor processes (a pool's actors are
stopped before multiprocessing waits for them). A process started by ``multiprocessing`` runs no ``atexit`` hook:
it ends in ``multiprocessing``'s own exit function, which joins its children, so the same hook is registered there
too (an exit-priority entry of ``multiprocessing.util``'s, run before that join); whichever runs first lets go,
once. Nothing is held but a weak reference: an owner dropped without
``close()`` is collected, and its releases run then. A child forked from the owner's process releases nothing of
its parent's.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.util
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Lifetime"]

Release = Callable[[float], None]
# multiprocessing's exit function runs its finalizers of priority >= 0, highest first, before it joins the children
EXIT_PRIORITY = 10


def _release_all(held: list[tuple[str, Release]], budget: list[float | None], default: float, pid: int,
                 errors: list[BaseException], unhook: list[Callable[[], None]]) -> None:
    """Run the releases newest first within ``budget[0]`` seconds (None: ``default``); what they raise goes to
    ``errors`` (the first is raised by :meth:`Lifetime.close`, and nowhere at collection or exit). First the exit
    hooks of :meth:`Lifetime.arm` are taken off (``unhook``), however this runs: at close, when the owner is
    collected, or at exit: a dropped owner leaves nothing registered."""
    while unhook:
        unhook.pop()()
    if os.getpid() != pid:  # a forked child: what is held is its parent's
        return
    seconds = default if budget[0] is None else budget[0]
    end = time.monotonic() + seconds
    while held:
        _name, release = held.pop()
        try:
            release(max(0.0, end - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001  # every release runs; Lifetime.close raises the first afterwards
            errors.append(exc)


class Lifetime:
    """What one owner holds, let go newest first, once: at :meth:`close`, when the owner is collected, or at exit.

    ``owner``: the object whose lifetime this is (held weakly); ``default``: its budget in seconds when ``close``
    is given None. The releases must not refer to ``owner`` (they would keep it alive).
    """

    __slots__ = ("_budget", "_errors", "_finalizer", "_held", "_unhook")

    def __init__(self, owner: Any, default: float):
        self._held: list[tuple[str, Release]] = []
        self._budget: list[float | None] = [None]  # the budget close() was given, read by the finalizer
        self._errors: list[BaseException] = []
        self._unhook: list[Callable[[], None]] = []  # how to take off the exit hooks of arm()
        self._finalizer = weakref.finalize(owner, _release_all, self._held, self._budget, default, os.getpid(),
                                           self._errors, self._unhook)
        self._finalizer.atexit = False  # at exit, the hook of arm() runs it, in its place among the atexit hooks

    def hold(self, name: str, release: Release, *, last: bool = False) -> None:
        """Register ``release(seconds_left)``, to run before everything registered earlier (``last``: after
        everything, as if it had been registered first)."""
        if last:
            self._held.insert(0, (name, release))
        else:
            self._held.append((name, release))

    def arm(self) -> None:
        """Let go at interpreter exit, before what was made until now (see the module doc). Once, at the end of the
        owner's construction."""
        finalizer = self._finalizer

        def at_exit() -> None:
            finalizer()

        atexit.register(at_exit)
        # a process multiprocessing started exits through its exit function (no atexit), which joins the children
        mp_hook = multiprocessing.util.Finalize(None, at_exit, exitpriority=EXIT_PRIORITY)
        self._unhook += [functools.partial(atexit.unregister, at_exit), mp_hook.cancel]

    @property
    def alive(self) -> bool:
        """Not let go yet."""
        return self._finalizer.alive

    def close(self, timeout: float | None = None) -> None:
        """Let go of everything held, newest first, within ``timeout`` seconds in all (None: the owner's default);
        then raise the first error a release raised (every release ran). Once: later calls do nothing."""
        self._budget[0] = timeout
        self._finalizer()
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            raise error
