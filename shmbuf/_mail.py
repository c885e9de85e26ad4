"""The reader's mail: writers' control messages (stats, errors) read from their lanes' mailboxes.

A message is decoded by :mod:`shmbuf._control`; one that does not decode, like a commit of a slot
the lane was never lent, is a bad message: refused and counted, and the pipeline goes on.
"""

from __future__ import annotations

from typing import Any

from shmbuf import _control
from shmbuf._errors import WriterError
from shmbuf._lane import ReaderLane
from shmbuf._segment import W_BAD_MESSAGES


class Mail:
    """Reads lanes' mailboxes into ``lane.stats`` and ``errors`` (the reader's list); counts bad messages.

    ``bad_messages`` is kept here and only stored to shared memory (for ``shmbuf ls``): a word another
    process scribbled over can neither overflow it nor make ``stats()`` lie.
    """

    __slots__ = ("_mm", "_w", "bad_messages", "errors")

    def __init__(self, words: memoryview, mm: Any, errors: list[WriterError]):
        self._w = words
        self._mm = mm
        self.errors = errors
        self.bad_messages = 0

    def read(self, lane: ReaderLane) -> None:
        """Take ``lane``'s message (the caller saw ``lane.has_mail()``)."""
        data = lane.take_mail(self._mm, _control.MAX_PAYLOAD)
        try:
            if data is None:
                raise _control.BadMessage("malformed mailbox header")
            msg = _control.decode(data)
        except _control.BadMessage:
            self.bad()
            return
        mtype = msg["type"]
        if mtype == "stats":
            lane.stats = dict(msg["counters"])
        elif mtype == "error":
            self.errors.append(WriterError(
                f"writer on lane {lane.index} (pid {lane.pid}) raised {msg['exc_type']}: {msg['message']}",
                lane=lane.index, pid=lane.pid, kind=msg["exc_type"], remote_traceback=msg["traceback"],
            ))

    def bad(self, k: int = 1) -> None:
        """``k`` bad messages (or commits of slots a lane was never lent): counted."""
        self.bad_messages += k
        self._w[W_BAD_MESSAGES] = self.bad_messages
