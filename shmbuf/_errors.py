"""The exception taxonomy.

Every shmbuf error subclasses :class:`ShmbufError` *and* the builtin that a
caller would catch without knowing shmbuf, so ``except ValueError`` still
works for bad input and ``except TimeoutError`` for a wait that ran out.

- :class:`SchemaError` (ValueError): a tree does not match the example.
- :class:`SegmentError` (ValueError): a segment is missing, foreign, corrupt
  or of another layout version.
- :class:`PipelineClosed` (RuntimeError): *you* (or the reader, for a writer)
  closed the pipeline; nothing more will move.
- :class:`BrokenPipeline` (RuntimeError): the other side died; the cause is
  in ``__cause__`` where there is one.
- :class:`SlotTimeout` (TimeoutError): a blocking wait ran out; names the
  pipeline and the setting that bounds it.
- :class:`StaleRollout` (RuntimeError): a rollout handle whose slot was
  released and recycled.
- :class:`WriterError` (RuntimeError): an exception raised in a writer's
  process, delivered to the reader with the remote traceback as text.
- :class:`NoSpace` (OSError): /dev/shm cannot hold the requested segment.
- :class:`UsageError` (ValueError *and* TypeError): an argument or setting
  of the wrong type or out of range (``slots``, ``max_writers``,
  ``batch_size``, ``timeout``, a name, an empty commit); names the setting.
- :class:`TimescaleFull` (IndexError): ``add`` past a timescale's capacity.
- :class:`WrongProcess` (RuntimeError): a Writer, Reader or Rollout used in
  a process it was copied into by ``fork``; make a new one there.
- :class:`UnknownTimescale` (KeyError): ``add`` to a timescale the example
  does not have.
- :class:`ActorError` (RuntimeError): an actor process of a ``workers``
  pool or collector raised (its traceback as text) or died.
- :class:`StartTimeout` (TimeoutError): processes or threads an object
  started did not come up within its ``ready_timeout``. Not a
  :class:`SlotTimeout`: asking again will not help.
- :class:`StateError` (RuntimeError): a call the object cannot take as it
  is (a pool started twice, weights sent to a collector made without a
  weight broadcast, weights every node refused).
- :class:`BufferFull` (RuntimeError) and :class:`BufferEmpty` (SlotTimeout,
  RuntimeError): ``shmbuf.storage.RolloutBuffer`` has no room, or nothing
  stored and no wait asked for (embodichain's RuntimeErrors).

Every exception a user can get from shmbuf, ``shmbuf.storage`` or ``workers``
is defined here.
"""

from __future__ import annotations

import errno
from typing import Any


class ShmbufError(Exception):
    """Base class of every error shmbuf raises on purpose."""


class SchemaError(ShmbufError, ValueError):
    """A tree does not match the pipeline's example (names the leaf path)."""


class SegmentError(ShmbufError, ValueError):
    """A segment is missing, foreign, corrupt or of another layout version."""


class PipelineClosed(ShmbufError, RuntimeError):
    """The pipeline was closed on purpose; nothing more will move through it."""


class BrokenPipeline(ShmbufError, RuntimeError):
    """The process on the other side of the pipeline died."""


class SlotTimeout(ShmbufError, TimeoutError):
    """A blocking wait ran out of time."""


class StaleRollout(ShmbufError, RuntimeError):
    """A rollout handle outlived its slot: it was released and may be reused."""


class WriterError(ShmbufError, RuntimeError):
    """An exception raised inside a writer process, reported to the reader.

    Attributes:
        lane: the writer's lane.
        pid: the writer's process id.
        kind: the remote exception's class name.
        remote_traceback: the remote traceback, as text.
    """

    def __init__(self, message: str, *, lane: int, pid: int, kind: str, remote_traceback: str):
        super().__init__(message)
        self.lane = lane
        self.pid = pid
        self.kind = kind
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        head = super().__str__()
        if self.remote_traceback:
            return f"{head}\n\nRemote traceback (writer pid {self.pid}, lane {self.lane}):\n{self.remote_traceback}"
        return head


class NoSpace(ShmbufError, OSError):
    """/dev/shm (or wherever POSIX shared memory lives) is too small."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.args[1])


class UsageError(ShmbufError, ValueError, TypeError):
    """An argument or setting has the wrong type or value; the message names the setting.

    It is both a ValueError and a TypeError, so that code written against the builtins
    (``except ValueError`` for a bad value, ``except TypeError`` for a bad type) still catches it.
    """


class TimescaleFull(ShmbufError, IndexError):
    """``add`` past a timescale's capacity (echo's IndexError; names timescale, capacity and index)."""


class UnknownTimescale(ShmbufError, KeyError):
    """``add`` to a timescale the example does not have (echo's KeyError; names the known ones)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the whole message
        return str(self.args[0]) if self.args else ""


class WrongProcess(ShmbufError, RuntimeError):
    """A Writer, Reader or Rollout was used in a process that it was copied into by fork."""


def _actor_error(message: str, index: int, pid: int | None, kind: str, exitcode: int | None,
                 remote_traceback: str) -> ActorError:
    return ActorError(message, index=index, pid=pid, kind=kind, exitcode=exitcode, remote_traceback=remote_traceback)


class StartTimeout(ShmbufError, TimeoutError):
    """Processes or threads an object started did not come up within its ``ready_timeout`` (not a SlotTimeout:
    asking again will not help)."""


class StateError(ShmbufError, RuntimeError):
    """A call the object cannot take as it is: a pool started twice, weights sent to a collector made without a
    weight broadcast, weights that every node refused."""


class ActorError(ShmbufError, RuntimeError):
    """An actor process failed: it raised (``remote_traceback`` holds its traceback text) or died.

    Attributes:
        index: the actor's index in the pool.
        pid: its process id.
        kind: the remote exception's class name, or ``"died"``.
        exitcode: the process's exit code (negative: killed by that signal), if it exited.
        remote_traceback: the traceback text from the actor, or "".
    """

    def __init__(self, message: str, *, index: int, pid: int | None, kind: str, exitcode: int | None = None,
                 remote_traceback: str = ""):
        super().__init__(message)
        self.index = index
        self.pid = pid
        self.kind = kind
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only fields: rebuilt through _actor_error, so that an ActorError survives a pickle (Ray
        # carries a node owner's exception to the learner that way; without it Ray gives UnserializableException)
        return _actor_error, (self.args[0] if self.args else "", self.index, self.pid, self.kind, self.exitcode,
                              self.remote_traceback)

    def __str__(self) -> str:
        head = super().__str__()
        if self.remote_traceback:
            return f"{head}\n\nRemote traceback (actor {self.index}, pid {self.pid}):\n{self.remote_traceback}"
        return head


class BufferFull(ShmbufError, RuntimeError):
    """``start_rollout()`` in the learner's process while every slot holds a rollout not yet taken by
    ``get()`` (or held from ``get(flatten=False)``): only this process could free one, so waiting
    would never end. A RuntimeError, as embodichain's "RolloutBuffer already contains a rollout"."""


class BufferEmpty(SlotTimeout, RuntimeError):
    """``get()`` with nothing stored and no wait asked for. A :class:`SlotTimeout` (so a TimeoutError) and a
    RuntimeError, as embodichain's ``RuntimeError("RolloutBuffer is empty.")``: ported ``except`` clauses hold."""
