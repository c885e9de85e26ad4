"""The words of a Writer's refusals: an unknown timescale, a full one, no free slot in time, a forked copy.

Kept apart from :mod:`shmbuf._writer` so that its hot path reads as a hot path; each function builds the
exception (or its text) that the Writer raises.
"""

from __future__ import annotations

import traceback
from typing import Any

from shmbuf import _control
from shmbuf._errors import TimescaleFull, UnknownTimescale, WrongProcess
from shmbuf._fastpath import PreparedTimescale


def unknown_timescale(timescale: Any, known: list[str]) -> UnknownTimescale:
    return UnknownTimescale(f"Unknown timescale {timescale!r}. Known: {known}")


def timescale_full(ts: PreparedTimescale, i: int) -> TimescaleFull:
    what = "steps" if ts.buffered else "item (it is single-item)"
    return TimescaleFull(
        f"Timescale '{ts.spec.name}' is full: it holds {ts.capacity} {what}, and add() was called for index {i}. "
        "commit() (or reset()) starts the next rollout"
    )


def no_free_slot(name: str, timeout: float | None, served: bool) -> str:
    """SlotTimeout's text: whether the reader has served this writer yet says which advice fits."""
    where = f"pipeline {name}: no free slot within Writer(timeout={timeout})"
    if not served:
        return (f"{where}, and the reader has not served this writer yet: it lends slots only inside get, "
                "get_batch, batches and poll. Have the learner call reader.poll() (or start reading) sooner, "
                "or give the Writer a longer timeout")
    return (f"{where}: the reader is not releasing rollouts as fast as writers commit them, or there are "
            "too few slots (shmbuf.create(slots=...))")


def wrong_process(made_in: int, now_in: int) -> WrongProcess:
    return WrongProcess(
        f"this Writer was made in process {made_in} and copied into {now_in} by fork; "
        "make a new Writer in this process from the pipeline's handle"
    )


def error_report(exc: BaseException) -> bytes:
    """The "error" message that report_error posts: type, message and traceback as text (msgpack)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _control.encode("error", exc_type=type(exc).__name__, message=str(exc), traceback=tb)


def also_sent(name: str, lane: int) -> str:
    """The note on an exception that leaves a ``with Writer`` block and reached the reader: it goes on up, and the
    process that dies of it prints it too (multiprocessing does), so say where else it went, so that two tracebacks
    do not read as two failures."""
    return f"(shmbuf: also sent to the learner, which raises it as WriterError from pipeline {name}, lane {lane})"
