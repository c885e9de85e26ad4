"""What a forked child inherits and must not use: writers, readers and their rollouts belong to one process.

``fork`` copies every object, file descriptor and mapping of the parent. A
Writer copied into a child would share the parent's lane (one rollout with
two processes' data) and keep the lane's lock alive after the parent let it
go; a Reader copied into a child could release slots the parent still holds.
So every Writer and Reader registers here, and right after a fork the child
tells each of them that it is now a foreign copy (``_after_fork_in_child``):
they drop what is the parent's (the lock's file descriptor, the slot in
hand) and refuse every call with :class:`shmbuf.WrongProcess`.

This is the one piece of module state in shmbuf: ``os.register_at_fork``
can only be given a function, never taken back, so the function looks
objects up in a weak set instead of holding them.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_live: weakref.WeakSet[Any] = weakref.WeakSet()


def track(obj: Any) -> None:
    """Tell ``obj._after_fork_in_child()`` when this process forks (the child calls it)."""
    _live.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_live):
        try:
            obj._after_fork_in_child()
        except Exception:  # noqa: BLE001  # pragma: no cover - a child must start whatever a copied object does
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
