"""What the pool says about an actor process that ended, or that never finished starting.

An actor that exits is described by its exit (:func:`describe_exit`) and the last lines of its stderr
(:func:`last_words`). A replacement that is still running but has not called ``ctx.ready()`` within the pool's
``ready_timeout`` is a failed start (:func:`start_timeout_error`): the pool kills it, and the error says what the
process was doing when it was given up on (each thread's kernel state and wait channel, from /proc, read before the
kill), what it printed, and, for a process forked from a learner that ran other threads, which ones: a fork copies
the locks those threads held at that instant, and a child that then takes one waits for ever.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from shmbuf import ActorError

MAX_THREADS_SHOWN = 8  # the threads of a stuck child a start-timeout message lists (state and wait channel each)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def last_words(a: Any) -> str:
    """The end of a died actor's ActorError: the last lines of its stderr, or that it died before reaching the pool's
    code (``a``: the pool's record of the actor, with its ``tail``)."""
    if a.tail is None:
        return ""
    if not a.tail.started():
        return (" (it died while starting, before it reached the pool's code: under spawn and forkserver the child "
                "imports the main module first, and an error there is printed on its stderr only)")
    text = a.tail.tail()
    return f". The last lines of its stderr:\n{text}" if text else ""


def other_threads() -> list[str]:
    """The names of this process's Python threads but the calling one (what a fork now would copy mid-step)."""
    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me]


def where(pid: int) -> str:
    """A live process's threads, each as ``tid state wchan`` (Linux /proc), or "" where /proc cannot say."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return ""
    out = []
    for tid in tids[:MAX_THREADS_SHOWN]:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read().strip() or "-"
        except (OSError, IndexError):
            continue
        out.append(f"{tid} {state} {wchan}")
    more = f", and {len(tids) - MAX_THREADS_SHOWN} more" if len(tids) > MAX_THREADS_SHOWN else ""
    return "; ".join(out) + more


def start_timeout_error(a: Any, ready_timeout: float, start_method: str, seen: str) -> ActorError:
    """The failure of actor ``a`` (running, not ready ``ready_timeout`` s after it was started): ``seen`` is
    :func:`where` of its process before the pool killed it."""
    life = "its replacement" if a.incarnation > 0 else "it"
    msg = (f"actor {a.index} (pid {a.pid}) did not start within ready_timeout={ready_timeout:g} s: {life} never "
           f"called ctx.ready(), and was killed")
    if seen:
        msg += f". Its threads (tid, state, kernel wait channel) were: {seen}"
    if start_method == "fork" and a.forked_beside:
        shown = ", ".join(a.forked_beside[:MAX_THREADS_SHOWN])
        msg += (f". It was forked (start_method='fork') while the learner ran other threads ({shown}): a forked "
                "child that takes a lock one of them held at that instant waits for ever; use "
                "start_method='forkserver' or 'spawn', which start a process without copying the learner's threads")
    if a.tail is not None and not a.tail.started():
        msg += " (it never reached the pool's code: under spawn and forkserver the child imports the main module first)"
    else:
        msg += last_words(a)  # the last lines of its stderr, if it wrote any
    return ActorError(msg, index=a.index, pid=a.pid, kind="start_timeout")
