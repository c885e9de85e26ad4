"""What a reader says when a get cannot be served: what it holds, and whether any writer ever came.

Words only, for the messages of :class:`shmbuf.UsageError` and :class:`shmbuf.SlotTimeout` raised by
``Reader.get`` and ``Reader.get_batch`` (:mod:`shmbuf._reader`).
"""

from __future__ import annotations

from typing import Any


def asked(size: int) -> str:
    """The call, as the user wrote it: ``get()`` or ``get_batch(size)``."""
    return "get()" if size == 1 else f"get_batch({size})"


def holding(held: int, held_run: tuple[int, int] | None, slots: int) -> str:
    """What the reader holds, in words: the batch not released (``held_run``), and rollouts from get() not released."""
    in_batch = held_run[1] if held_run is not None else 0
    singles = held - in_batch
    parts = []
    if in_batch:
        parts.append(f"a batch of {in_batch} (until batch.release(), its with block, or the next get_batch)")
    if singles:
        parts.append(f"{singles} rollout{'s' if singles != 1 else ''} from get() not released")
    return f"holds {held} of its {slots} slots: " + " and ".join(parts) if parts else "holds no slot"


def why_nothing(roster: Any, holds: str) -> str:
    """The end of a SlotTimeout's message: what the reader holds (:func:`holding`), and whether any writer ever came."""
    lanes = roster.lanes
    if not roster.writers_seen:
        writers = ("no writer has attached yet (did the actor processes start? with spawn or forkserver, "
                   "the code that starts them must sit under `if __name__ == \"__main__\":`)")
    elif not lanes:
        died = f", {roster.lanes_reclaimed} of them died" if roster.lanes_reclaimed else ""
        writers = f"no writer is attached now ({roster.writers_seen} came and left{died})"
    else:
        writers = f"{len(lanes)} writer{'s are' if len(lanes) != 1 else ' is'} attached"
    return f"this reader {holds}; {writers}"
