"""Is a process we depend on still there? A pidfd watch, with pid and start time where Linux has no pidfd."""

from __future__ import annotations

import os
import select
from typing import Any

from shmbuf._proc import Owner


class ProcessWatch:
    """Watches one process (a pipeline's reader, an inference table's owner) for its exit.

    A pidfd where Linux has one (>= 5.3): it cannot be fooled by a reused pid, and asking costs
    one poll() with no allocation. Else the pid and start time (:meth:`Owner.alive`). A process
    in another pid namespace cannot be judged by its pid at all: it counts as alive (``Owner``).
    :meth:`close` releases the pidfd; the watch then asks by pid.
    """

    __slots__ = ("_poll", "fd", "owner")

    def __init__(self, owner: Owner):
        self.owner, self.fd = owner, -1
        self._poll: Any = None
        if owner.elsewhere or not hasattr(os, "pidfd_open") or not owner.alive():
            return
        try:
            self.fd = os.pidfd_open(owner.pid)
        except OSError:
            return
        if not owner.alive():  # the pid was reused between the two looks: it is not the process we met
            self.close()
            return
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def alive(self) -> bool:
        if self._poll is not None:
            return not self._poll.poll(0)  # readable once the process has exited
        return self.owner.alive()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._poll = None
