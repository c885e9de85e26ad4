"""Lifecycle guarantees of docs/reliability.md that the tests cited there did not hold: each test here fails on
the bug named in its docstring (planted in a copy of the repo to check)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import shmbuf
from tests.conftest import small_example
from tests.helpers import step as _step
from tests.helpers import write as _write


def _reaped_pid() -> int:
    """The pid of a process that has exited and been reaped: what a pid from another namespace looks like here."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


def test_a_writer_whose_pid_means_nothing_here_from_the_start_keeps_its_lane(make_reader: Any) -> None:
    """A writer in another pid namespace records, when it claims its lane, a pid that means nothing (or someone
    else) in the reader's: the reader must judge it by its lane lock from its first sight of the lane.

    test_hardening's test of this overwrites the pid after the reader adopted the lane, and the reader reads the
    pid only at adoption: a reader that judged writers by pid passed it. Here the pid is wrong before adoption.
    """
    reader = make_reader(small_example(), slots=8, max_writers=2)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    try:
        bogus = _reaped_pid()
        writer._w[writer._lane.rec.pid] = bogus  # before the reader has seen the lane
        for _ in range(3):
            reader._next_scan = 0.0  # a scan of the lane table at every poll
            reader.poll()
        s = reader.stats()
        assert s["writers"] == 1 and s["lanes_reclaimed"] == 0, f"the live writer's lane was taken back: {s}"
        assert s["writer_stats"][writer.lane]["pid"] == bogus  # the reader took the lane in with that pid
        _write(writer, 1.0)
        _write(writer, 2.0)
        assert [float(reader.get(timeout=5).data["step"]["obs"][0, 0]) for _ in range(2)] == [1.0, 2.0]
        assert reader.stats()["partial_dropped"] == 0
    finally:
        writer.close()


class _Unprintable(Exception):
    """An exception whose message cannot be made: reporting it to the reader fails inside report_error."""

    def __str__(self) -> str:
        raise RuntimeError("this exception has no message")


def test_a_failure_to_report_the_users_exception_never_replaces_it(make_reader: Any) -> None:
    """Leaving a ``with Writer`` block by an exception reports it to the reader; when the report itself fails
    (here str(exc) raises), the user's exception still propagates and the Writer is closed.

    test_hardening's test of this sends only messages that report_error can encode, so an ``__exit__`` that let a
    failed report propagate passed it.
    """
    reader = make_reader(small_example(), slots=4, max_writers=1)
    w = shmbuf.Writer(reader.handle, timeout=2.0)
    reader.poll()
    try:
        with w:
            w.add("step", _step(1.0))
            raise _Unprintable()
    except _Unprintable:
        pass  # the user's own exception, not the RuntimeError from reporting it
    assert w._closed
    reader.poll()  # takes the retired lane back
    shmbuf.Writer(reader.handle, timeout=2.0).close()  # the only lane came back: the block closed the Writer


def _names_of(pipeline: str) -> set[str]:
    tail = pipeline[1:]
    return {e for e in os.listdir("/dev/shm") if e == tail or e.startswith(f"sem.{tail}-")}


def test_only_the_owner_unlinks_a_writers_close_leaves_the_pipeline_to_the_next(make_reader: Any) -> None:
    """"Detach" and "destroy" are different verbs: a Writer's close() releases its mapping and lane; the segment
    and its semaphores stay until the reader closes, and then all go.

    The cited test closes the reader with writers attached and checks only that the names are gone at the end, so a
    Writer.close() that unlinked the pipeline too passed it.
    """
    reader = make_reader(small_example(), slots=4, max_writers=2)
    names = _names_of(reader.name)
    assert reader.name[1:] in names and f"sem.{reader.name[1:]}-r" in names and len(names) == 1 + 1 + 2
    with shmbuf.Writer(reader.handle, timeout=2.0) as w:
        reader.poll()
        _write(w, 1.0)
    assert _names_of(reader.name) == names  # a writer's close unlinks nothing
    with reader.get(timeout=5) as r:
        assert float(r.data["step"]["obs"][0, 0]) == 1.0
    with shmbuf.Writer(reader.handle, timeout=2.0) as w2:  # the next writer attaches by name
        reader.poll()
        _write(w2, 2.0)
    with reader.get(timeout=5) as r:
        assert float(r.data["step"]["obs"][0, 0]) == 2.0
    assert _names_of(reader.name) == names
    reader.close()
    assert _names_of(reader.name) == set()  # the owner's close removes every name
