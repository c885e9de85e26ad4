"""Defects that review and hostile testing found in the reader, the writer and their lane protocol.

Each test here failed on the code before the fix; the docstring says how.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import posix_ipc
import pytest

import shmbuf
from shmbuf import _segment
from shmbuf._lane import WAIT_SLICE
from tests.conftest import small_example, wait_until
from tests.helpers import step, write

FORK = mp.get_context("fork")


# ------------------------------------------------------------ data integrity


def test_rollout_data_gives_every_access_its_own_containers(pair: Any) -> None:
    """Before: data returned one cached dict per slot, so a user's edit reached the next rollout on that slot."""
    reader, writer = pair
    write(writer, 1.0)
    with reader.get(timeout=5) as r:
        d = r.data
        d["step"]["obs"] = np.zeros(99)  # the user's own dict: replace a leaf, add keys
        d["step"]["mine"] = 1
        d["extra"] = {}
        again = r.data
        assert again["step"]["obs"].shape == (16, 4) and "mine" not in again["step"] and "extra" not in again
        assert again["step"]["obs"] is not d["step"]["obs"]
    for k in range(8):  # every slot comes round again: none carries the edit
        write(writer, 2.0 + k)
        with reader.get(timeout=5) as r:
            assert r.data["step"]["obs"].shape == (16, 4) and "mine" not in r.data["step"]
            assert r.data["step"]["obs"][0, 0] == 2.0 + k


def test_batch_data_gives_every_batch_its_own_containers(pair: Any) -> None:
    """Before: the batch's tree was cached with its buffer, so an edited dict was handed out again."""
    reader, writer = pair
    write(writer, 1.0)
    write(writer, 2.0)
    b = reader.get_batch(2, timeout=5, zero_copy=False)
    obs = b.data["step"]["obs"]
    b.data["step"]["obs"] = "replaced"
    b.data["step"]["mine"] = 1
    write(writer, 3.0)
    write(writer, 4.0)
    b2 = reader.get_batch(2, timeout=5, zero_copy=False)
    assert b2.data["step"]["obs"] is obs  # the same preallocated array, refilled (copy=False)...
    assert "mine" not in b2.data["step"] and b2.data["step"]["obs"][:, 0, 0].tolist() == [3.0, 4.0]  # ...in new dicts


def test_get_batch_above_the_latency_window_delivers_and_loses_no_slot(make_reader: Any) -> None:
    """Before: a batch over 8,192 rollouts failed in latency bookkeeping after its slots were taken, losing them all."""
    ex = {"step": {"x": np.zeros((2,), np.int32)}}
    n = 8200
    reader = make_reader(ex, slots=n, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    try:
        t0 = time.monotonic()
        for _ in range(2):
            reader.poll()  # the writer runs in this thread: lend it slots (half of them at a time)
            for k in range(n // 2):
                writer.add("step", {"x": np.int32(k)})
                writer.commit()
        batch = reader.get_batch(n, timeout=10)
        elapsed_us = (time.monotonic() - t0) * 1e6
        assert batch.size == n and batch.seq.tolist() == list(range(n))
        assert batch.zero_copy and reader.stats()["slots"]["held"] == n  # every slot, in order: one run
        batch.release()
        s = reader.stats()
        assert s["slots"]["held"] == s["slots"]["ready"] == 0 and s["slots"]["pool"] + s["slots"]["lent"] == n
        # commit-to-get latencies of this batch's last 8,192: inside the span that held every commit and the get
        assert 0 < s["latency_us_p50"] <= s["latency_us_p99"] <= elapsed_us, (s, elapsed_us)
    finally:
        writer.close()


def test_a_failure_during_get_batch_puts_every_taken_slot_back(pair: Any, monkeypatch: Any) -> None:
    reader, writer = pair
    for k in range(3):
        write(writer, float(k))
    reader.poll()

    bufs = reader._handout.batch_buffer(3)
    monkeypatch.setattr(reader._handout, "leaf_all", [_Exploding(v) for v in reader._handout.leaf_all])
    for view in (False, True):  # a gather, and a run of views (whose leaf views are made from _leaf_all)
        with pytest.raises(MemoryError):
            reader.get_batch(3, timeout=5, zero_copy=view)
    monkeypatch.undo()
    assert bufs is reader._handout.batch_buffer(3)
    assert reader.stats()["slots"]["ready"] == 3
    batch = reader.get_batch(3, timeout=5)
    assert batch.data["step"]["obs"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]  # all three, in order


class _Exploding:
    def __init__(self, a: np.ndarray):
        self.a = a

    def take(self, *a: Any, **kw: Any) -> None:
        raise MemoryError("while gathering")

    def __getitem__(self, key: Any) -> None:
        raise MemoryError("while making views")


def test_a_python_int_that_does_not_fit_the_leaf_is_refused(make_reader: Any) -> None:
    """Before: 300 into an int8 leaf was stored as 44 (wrapped); -1 into uint8 as 255."""
    ex = {"step": {"a": np.zeros((4,), np.int8), "u": np.zeros((4,), np.uint8), "f": np.zeros((4,), np.float32)}}
    reader = make_reader(ex, slots=2, max_writers=1)
    with shmbuf.Writer(reader.handle, timeout=2.0) as w:
        reader.poll()
        w.add("step", {"a": 5, "u": 3, "f": 2})  # Python ints that fit: fine, any integer or float leaf
        with pytest.raises(shmbuf.SchemaError, match=r"leaf step/a: 300 does not fit dtype int8 \(-128\.\.127\)"):
            w.add("step", {"a": 300, "u": 0, "f": 0.0})
        with pytest.raises(shmbuf.SchemaError, match=r"leaf step/u: -1 does not fit dtype uint8"):
            w.add("step", {"a": 0, "u": -1, "f": 0.0})
        with pytest.raises(shmbuf.SchemaError, match=r"leaf step/a: expected dtype int8 .*got Python float 1.5"):
            w.add("step", {"a": 1.5, "u": 0, "f": 0.0})
        w.commit()
        with reader.get(timeout=5) as r:
            assert r.fill["step"] == 1  # the refused adds wrote nothing
            assert (int(r.data["step"]["a"][0]), int(r.data["step"]["u"][0]), float(r.data["step"]["f"][0])) == (5, 3, 2.0)


def test_torch_tensors_are_accepted_and_a_tensor_that_needs_grad_gets_a_clear_error(make_reader: Any) -> None:
    torch = pytest.importorskip("torch")
    ex = {"step": {"obs": np.zeros((2, 3), np.float32)}}
    reader = make_reader(ex, slots=2, max_writers=1)
    with shmbuf.Writer(reader.handle, timeout=2.0) as w:
        reader.poll()
        w.add("step", {"obs": torch.arange(3, dtype=torch.float32)})
        with pytest.raises(shmbuf.SchemaError, match=r"leaf step/obs: could not read a Tensor .*detach\(\)"):
            w.add("step", {"obs": torch.zeros(3, requires_grad=True)})
        w.commit()
        with reader.get(timeout=5) as r:
            assert r.data["step"]["obs"][0].tolist() == [0.0, 1.0, 2.0] and r.fill["step"] == 1


# --------------------------------------------------------------------- fork


def _in_child(target: Any, *args: Any) -> int:
    """Run ``target`` in a forked child; return its exit code (0: returned; 1: raised)."""
    p = FORK.Process(target=target, args=args, daemon=True)
    p.start()
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)
        raise AssertionError("the forked child hung")
    return p.exitcode


def test_a_forked_copy_of_a_writer_cannot_add_or_commit_into_the_parents_rollout(pair: Any) -> None:
    """Before: a child that inherited a Writer mid-rollout could add and commit through the parent's lane."""
    reader, writer = pair
    writer.add("step", step(1.0))

    def child() -> None:
        for call in (lambda: writer.add("step", step(9.0)), writer.commit, writer.reset,
                     lambda: writer.send(reader.schema.zeros())):
            try:
                call()
            except shmbuf.WrongProcess:
                continue
            os._exit(5)  # the call went through
        os._exit(0)

    assert _in_child(child) == 0
    writer.add("step", step(1.0, 1))
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.fill["step"] == 2 and r.data["step"]["obs"][:2, 0].tolist() == [1.0, 1.0]  # the parent's data alone
    assert reader.poll() == 0  # and nothing from the child


def test_a_forked_copy_of_a_rollout_cannot_release_the_parents_slot(pair: Any) -> None:
    """Before: the child's release went through its copy of the reader's books... and any copy of the
    reader could be used in the child."""
    reader, writer = pair
    write(writer, 1.0)
    r = reader.get(timeout=5)

    def child() -> None:
        for call in (r.release, lambda: r.data, lambda: reader.get(timeout=0), reader.poll, lambda: reader.get_batch(1)):
            try:
                call()
            except shmbuf.WrongProcess:
                continue
            os._exit(5)
        os._exit(0)

    assert _in_child(child) == 0
    assert r.data["step"]["obs"][0, 0] == 1.0  # still the parent's, still valid
    r.release()


def test_a_forked_child_does_not_keep_the_parents_lane_locked(make_reader: Any) -> None:
    """Before: the child's copy of the lock's descriptor kept the lane locked after the parent closed its
    writer, so with one lane no new writer could attach until the child exited."""
    reader = make_reader(small_example(), slots=4, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    go_r, go_w = os.pipe()

    def child() -> None:
        os.close(go_w)
        os.read(go_r, 1)  # hold everything inherited until the parent says so
        os._exit(0)

    p = FORK.Process(target=child, daemon=True)
    p.start()
    try:
        os.close(go_r)
        writer.close()
        reader.poll()  # takes the retired lane back
        w2 = shmbuf.Writer(reader.handle, timeout=3.0)  # the one lane, while the child still lives
        assert w2.lane == 0
        w2.close()
    finally:
        os.close(go_w)
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


# ------------------------------------------------------------------ liveness


def _batch_writer(name: str, tag: int, n: int) -> None:
    with shmbuf.Writer(name, timeout=30) as w:
        for seq in range(n):
            w.add("step", step(float(tag), seq))
            w.commit()


class _CountingDoorbell:
    """A reader's doorbell that counts the waits that ran out a whole slice with nothing ringing it."""

    def __init__(self, bell: Any):
        self.bell = bell
        self.slices = 0

    def acquire(self, timeout: float | None = None) -> Any:
        try:
            return self.bell.acquire(timeout)
        except posix_ipc.BusyError:
            if timeout is not None and timeout >= WAIT_SLICE:
                self.slices += 1
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bell, name)


def test_batches_as_large_as_the_pipeline_run_at_full_speed(make_reader: Any, procs: Any) -> None:
    """Before: get_batch(B) with B above about slots/2 waited out a 0.1 s slice on every batch
    (the reader's wake-up quota was more than it lent each writer): 200 batches took over 20 s.

    Counted, not timed: how many of the reader's waits ran out a whole slice unrung (one per batch before the
    fix). A writer the machine descheduled can cost one now and then; a quarter of the batches is far above that.
    """
    slots, batches = 16, 200
    reader = make_reader(small_example(), slots=slots, max_writers=2)
    per_writer = slots * batches // 2
    for tag in range(2):
        procs(_batch_writer, reader.name, tag, per_writer, method="fork")
    reader.get_batch(slots, timeout=30)  # both writers are up
    bell = reader._doorbell = _CountingDoorbell(reader._doorbell)
    try:
        for _ in range(batches - 1):
            reader.get_batch(slots, timeout=30)
    finally:
        reader._doorbell = bell.bell
    assert bell.slices <= (batches - 1) // 4, f"{bell.slices} of {batches - 1} batches of {slots} waited out a slice"


def test_poll_lends_slots_every_time(make_reader: Any) -> None:
    """Before: poll() lent only at its first sight of a lane, so a writer served by poll() alone got half
    the slots and then timed out, with the other half idle in the reader's pool."""
    reader = make_reader(small_example(), slots=8, max_writers=2)
    with shmbuf.Writer(reader.handle, timeout=0.5) as w:
        for _ in range(4):  # the learner holds every rollout (trains on them later) and only polls
            reader.poll()
            write(w, 1.0)
        assert reader.poll() == 4
        for _ in range(4):
            write(w, 2.0)  # the second half of the slots, lent by the poll above
        assert reader.poll() == 8


def test_a_writer_that_starts_first_is_told_the_reader_has_not_polled(make_reader: Any) -> None:
    """Before: it waited, then timed out blaming slow releases."""
    reader = make_reader(small_example(), slots=4, max_writers=2)
    with shmbuf.Writer(reader.handle, timeout=0.3) as w:
        with pytest.raises(shmbuf.SlotTimeout, match="the reader has not served this writer yet: it lends slots only inside get"):
            w.add("step", step(1.0))


def _waiting_writer(name: str) -> None:
    """Waits (timeout=None) for a slot the reader will never lend: only a stop can end it."""
    with shmbuf.Writer(name, timeout=None) as w:
        while True:
            write(w, 1.0)


def _wait_for_writers(reader: shmbuf.Reader, n: int) -> None:
    wait_until(lambda: reader.stats()["writers"] == n, 10, f"{n} writer lane(s)")


def test_a_reader_collected_without_close_stops_its_writers(procs: Any) -> None:
    """Before: collecting the Reader unlinked the names but never told the writers, so a writer with
    timeout=None (what workers uses) waited for ever."""
    reader = shmbuf.create(small_example(), slots=2, max_writers=1)
    name = reader.name
    try:
        p = procs(_waiting_writer, name, method="fork")
        _wait_for_writers(reader, 1)
    finally:
        del reader  # the last reference: no close()
        gc.collect()
    p.join(5)
    assert p.exitcode == 0  # left its with block quietly, on PipelineClosed
    assert not [e for e in os.listdir("/dev/shm") if name[1:] in e]


def _reader_process(conn: Any) -> None:
    reader = shmbuf.create(small_example(), slots=4, max_writers=1)
    conn.send_bytes(reader.name.encode())
    while True:
        reader.poll()
        time.sleep(0.01)


def test_a_writer_mid_rollout_learns_within_2_s_that_the_reader_died(procs: Any) -> None:
    """Before: add() never looked at the reader, so a writer filling a long rollout kept writing for as
    long as the rollout lasted after the reader was SIGKILLed."""
    rx, tx = FORK.Pipe(duplex=False)
    p = procs(_reader_process, tx, method="fork")
    assert rx.poll(10)
    name = rx.recv_bytes().decode()
    try:
        ex_writer = shmbuf.Writer(name, timeout=5)
        try:
            ex_writer.add("step", step(1.0))  # holds a slot now: every later add writes into it, no waiting
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            t0 = time.monotonic()
            with pytest.raises(shmbuf.BrokenPipeline, match="died"):
                while time.monotonic() - t0 < 5:
                    ex_writer.reset()
                    for t in range(15):
                        ex_writer.add("step", step(1.0, t))
            assert time.monotonic() - t0 < 2.0
        finally:
            ex_writer.close()
    finally:
        _segment.unlink_all(name, 1)  # its owner was killed: we remove what it left


def test_report_error_fits_any_message_in_the_mailbox_and_never_masks_the_users_exception(pair: Any) -> None:
    """Before: text was trimmed by characters against a limit in bytes, so a long non-ASCII message raised
    inside report_error, and Writer.__exit__ then skipped close() and replaced the user's exception."""
    reader, writer = pair
    assert writer.report_error(ValueError("é" * 20000))
    with pytest.raises(shmbuf.WriterError, match="raised ValueError: …?éé") as info:
        reader.get(timeout=5)
    assert info.value.remote_traceback.rstrip().endswith("é" * 100)  # the end of the text is what is kept
    w2 = shmbuf.Writer(reader.handle, timeout=2.0)
    with pytest.raises(KeyError, match="the user's own"):
        with w2:
            raise KeyError("the user's own " + "ü" * 30000)
    assert w2._closed
    with pytest.raises(shmbuf.WriterError, match="KeyError"):
        reader.get(timeout=5)


# ------------------------------------------------------- after close, and bad settings


def test_every_writer_call_after_close_raises_pipeline_closed(pair: Any) -> None:
    """Before: add() after close() mid-rollout raised a memoryview ValueError."""
    reader, writer = pair
    writer.add("step", step(1.0))
    writer.close()
    for call in (lambda: writer.add("step", step(1.0)), writer.commit, writer.reset,
                 lambda: writer.send(reader.schema.zeros())):
        with pytest.raises(shmbuf.PipelineClosed, match="was closed"):
            call()
    assert writer.report_error(ValueError("x")) is False


def test_commit_after_the_reader_closed_says_so(pair: Any) -> None:
    """Before: an add refused because the reader closed left no slot, and the commit then said "empty rollout"."""
    reader, writer = pair
    reader.close()
    with pytest.raises(shmbuf.PipelineClosed):
        writer.add("step", step(1.0))
    with pytest.raises(shmbuf.PipelineClosed, match="closed by its reader"):
        writer.commit()


def test_reader_calls_after_close(pair: Any) -> None:
    """Before: get_batch after close() raised AttributeError (with rollouts still ready), and leaving a
    rollout's with block after close() replaced the body's exception with StaleRollout."""
    reader, writer = pair
    write(writer, 1.0)
    write(writer, 2.0)
    reader.poll()
    r = reader.get(timeout=5)
    with pytest.raises(ZeroDivisionError):
        with r:
            reader.close()
            raise ZeroDivisionError
    for call in (lambda: reader.get_batch(1), lambda: reader.get(timeout=0), reader.poll):
        with pytest.raises(shmbuf.PipelineClosed):
            call()
    assert r.released


def test_bad_reader_settings_are_usage_errors(pair: Any) -> None:
    reader, writer = pair
    for bad in (0, True, 9, 2.0, "4"):
        with pytest.raises(shmbuf.UsageError, match=r"get_batch\(batch_size=...\): expected an int from 1 to slots=8"):
            reader.get_batch(bad)
    for bad in (-1, "1", True):
        with pytest.raises(shmbuf.UsageError, match="timeout"):
            reader.get(timeout=bad)
    with pytest.raises(shmbuf.UsageError, match=r"Writer\(timeout=...\)"):
        shmbuf.Writer(reader.handle, timeout=-1)
    with pytest.raises(shmbuf.UsageError, match="commit of an empty rollout"):
        writer.commit()
    with pytest.raises(shmbuf.UnknownTimescale, match="Unknown timescale 'nope'"):
        writer.add("nope", {})


def _forever_actor(name: str) -> None:
    """The README's actor shape: a with block around a while-True loop."""
    with shmbuf.Writer(name, timeout=None) as w:
        t = 0
        while True:
            w.add("step", step(1.0, t % 16))
            t += 1
            if t % 16 == 0:
                w.commit()


def test_a_while_true_actor_ends_cleanly_when_the_learner_closes(make_reader: Any, procs: Any) -> None:
    """Before: the with block re-raised PipelineClosed, so every such actor died with a traceback and exit code 1."""
    reader = make_reader(small_example(), slots=4, max_writers=1)
    p = procs(_forever_actor, reader.name, method="fork")
    reader.get(timeout=10).release()
    reader.close()
    p.join(5)
    assert p.exitcode == 0


# ------------------------------------------------------------- corrupt lanes


def test_a_lane_with_scribbled_counters_is_taken_back_and_its_writer_told(pair: Any) -> None:
    """Before: the reader raised a plain RuntimeError from every get once one lane's ring was scribbled over."""
    reader, writer = pair
    write(writer, 1.0)
    rec = writer._lane.rec
    writer._w[rec.ready_head] = 10**12  # another process of ours wrote nonsense into the lane
    with pytest.raises(shmbuf.SlotTimeout):
        reader.get(timeout=0.2)  # the lane is dropped, the pipeline goes on
    s = reader.stats()
    assert s["bad_messages"] >= 1 and s["lanes_reclaimed"] == 1 and s["writers"] == 0
    assert s["slots"]["pool"] == reader.slots  # every slot back
    writer._next_check = 0.0
    with pytest.raises(shmbuf.BrokenPipeline, match="took lane .* back"):
        write(writer, 2.0)
    w2 = shmbuf.Writer(reader.handle, timeout=2.0)  # a new writer gets a lane and works
    reader.poll()
    write(w2, 3.0)
    with reader.get(timeout=5) as r:
        assert r.data["step"]["obs"][0, 0] == 3.0
    w2.close()


def test_a_live_writer_whose_pid_means_nothing_here_keeps_its_lane(pair: Any) -> None:
    """Before: the reader judged writers by pid, so a writer in another pid namespace (a container sharing
    /dev/shm) looked dead and had its lane and slots taken back while it wrote. The lane lock decides now."""
    reader, writer = pair
    write(writer, 1.0)
    writer._w[writer._lane.rec.pid] = 4_000_000  # no such process in this namespace
    for _ in range(3):
        reader._next_scan = 0.0
        reader.poll()
    s = reader.stats()
    assert s["writers"] == 1 and s["lanes_reclaimed"] == 0
    write(writer, 2.0)
    assert [reader.get(timeout=5).data["step"]["obs"][0, 0] for _ in range(2)] == [1.0, 2.0]
