"""Closing an object while another thread of the process is blocked in its wait: that wait raises PipelineClosed.

Before, the close freed the POSIX semaphore under the wait (``sem_close`` unmaps it once the process's last
handle goes), and the waiting thread woke on unmapped memory: a SIGSEGV of the whole process, which is how a
training loop's exception ended when a collector's thread still waited (tests/test_user_errors.py). Each test
here starts a thread that blocks in one of the waits, waits (with a deadline) until that thread sits inside it,
closes the object from this thread, and asserts that the waiting thread raised PipelineClosed within a
deadline, the semaphore being let go by the last thread to leave the wait. On the old code these crash the test process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import posix_ipc
import pytest

import shmbuf
import shmbuf.lowlevel
from shmbuf._sem import Sem
from shmbuf._substrate import new_name, sem_name
from tests.conftest import small_example, wait_until

# The innermost Python function of a thread blocked in each wait: shmbuf._sem.Sem.acquire (the old code's own
# frames, for the test to wait the same way on it: Reader._await, InferenceTable._sleep, InferenceClient.call,
# WriterLane.wait).
WAITS = {"acquire", "_await", "_sleep", "call", "wait"}


class Waiter:
    """A thread running ``wait()``; what it raised (or None) once it ended."""

    def __init__(self, wait: Callable[[], Any]):
        self.error: BaseException | None = None
        self.returned = False

        def run() -> None:
            try:
                wait()
                self.returned = True
            except BaseException as exc:  # noqa: BLE001  # the test asserts on what the wait raised
                self.error = exc

        self.thread = threading.Thread(target=run, name="shmbuf-test-waiter", daemon=True)
        self.thread.start()

    def inside(self) -> bool:
        frame = sys._current_frames().get(self.thread.ident or -1)
        return frame is not None and frame.f_code.co_name in WAITS

    def wait_inside(self) -> None:
        wait_until(lambda: self.inside() or not self.thread.is_alive(), 10, "the thread to block in the wait")
        assert self.thread.is_alive(), f"the wait ended before the close: returned={self.returned}, {self.error!r}"

    def raised_closed(self) -> shmbuf.PipelineClosed:
        self.thread.join(10)
        assert not self.thread.is_alive(), "the wait did not end within 10 s of the close"
        assert isinstance(self.error, shmbuf.PipelineClosed), f"the wait ended in {self.error!r} (returned={self.returned})"
        return self.error


@pytest.fixture
def sem() -> Any:
    name = sem_name(new_name(), "r")
    s = Sem.create(name, "test semaphore")
    yield s
    s.close()
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_semaphore_closed_under_a_wait_raises_in_the_waiter_which_frees_it(sem: Sem, timeout: float | None) -> None:
    w = Waiter(lambda: sem.acquire(timeout))
    wait_until(lambda: sem._waiters == 1, 10, "the thread to wait on the semaphore")
    sem.close()
    assert "test semaphore is closed" in str(w.raised_closed())
    with pytest.raises(shmbuf.PipelineClosed):
        sem.acquire(0)
    with pytest.raises(shmbuf.PipelineClosed):
        sem.release()
    with pytest.raises(posix_ipc.ExistentialError, match="closed"):
        sem._sem.acquire(0)  # the waiter, the last to leave the closed Sem, let the semaphore go (sem_close)


def test_a_closed_semaphore_that_nobody_waits_on_is_let_go_at_once() -> None:
    name = sem_name(new_name(), "r")
    s = Sem.create(name, "test semaphore")
    raw = s._sem
    try:
        s.close()
        with pytest.raises(posix_ipc.ExistentialError, match="closed"):
            raw.acquire(0)  # sem_close ran at the close: no thread was inside a wait
    finally:
        posix_ipc.unlink_semaphore(name)


def test_a_semaphore_still_times_out_and_takes_posts(sem: Sem) -> None:
    with pytest.raises(posix_ipc.BusyError):
        sem.acquire(0.01)
    sem.release()
    sem.acquire(0)
    assert not sem.closed


@pytest.mark.parametrize("call", ["get", "get_batch"])
def test_closing_a_reader_under_get_raises_pipeline_closed_there(call: str) -> None:
    reader = shmbuf.create(small_example(), 4)
    try:
        w = Waiter(lambda: reader.get() if call == "get" else reader.get_batch(2))
        w.wait_inside()
        reader.close()
        assert reader.name in str(w.raised_closed())
    finally:
        reader.close()


REQ = {"obs": np.zeros((2, 3), np.float64)}
RESP = {"action": np.zeros((2,), np.int64)}


@pytest.mark.parametrize("idle", [None, 30.0])
def test_closing_an_inference_table_under_take_raises_pipeline_closed_there(idle: float | None) -> None:
    table = shmbuf.lowlevel.InferenceTable(REQ, RESP, 2)
    try:
        w = Waiter(lambda: table.take(2, idle=idle))
        w.wait_inside()
        table.close()
        assert table.name in str(w.raised_closed())
        with pytest.raises(shmbuf.PipelineClosed):
            table.take(2, idle=0)
    finally:
        table.close()


@pytest.mark.parametrize("closed", ["client", "table"])
def test_closing_an_inference_client_or_its_table_under_call_raises_pipeline_closed_there(closed: str) -> None:
    table = shmbuf.lowlevel.InferenceTable(REQ, RESP, 2)
    client = shmbuf.lowlevel.InferenceClient(table.name, 0)
    try:
        w = Waiter(client.call)  # no server: it waits for ever
        w.wait_inside()
        (client if closed == "client" else table).close()
        assert table.name in str(w.raised_closed())
    finally:
        client.close()
        table.close()


def test_closing_a_writer_under_its_wait_for_a_slot_raises_pipeline_closed_there() -> None:
    reader = shmbuf.create(small_example(), 1)
    made = threading.Event()
    box: list[shmbuf.Writer] = []

    def write() -> None:
        writer = shmbuf.Writer(reader.handle, timeout=None)
        box.append(writer)
        made.set()
        writer.send(small_example())  # takes the one slot (lent by the reader's poll below)
        writer.send(small_example())  # waits for a slot: the reader never gives one back

    try:
        w = Waiter(write)
        wait_until(made.is_set, 10, "the writer to attach")
        wait_until(lambda: reader.poll() >= 1 or not w.thread.is_alive(), 10, "the first rollout")
        w.wait_inside()
        box[0].close()
        assert reader.name in str(w.raised_closed())
    finally:
        for writer in box:
            writer.close()
        reader.close()
