"""Reader: zero-copy rollouts and their lifetime, batches, metadata, stats, errors from writers."""

from __future__ import annotations

import functools
import os
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import StaleRollout, WriterError
from tests.conftest import T, small_example


def write(writer: shmbuf.Writer, tag: float, length: int = T) -> None:
    for t in range(length):
        writer.add("step", {"obs": np.full(4, tag, np.float32), "action": np.int64(t), "reward": np.float32(tag),
                            "done": t == length - 1})
    writer.add("episode", {"return": np.array([tag * length], np.float32), "length": np.array([length], np.int32)})
    writer.commit()


def test_rollout_leaves_are_views_of_the_slot_not_copies(pair: Any) -> None:
    reader, writer = pair
    write(writer, 1.0)
    r = reader.get(timeout=5)
    obs = r.data["step"]["obs"]
    assert not obs.flags.owndata
    base = obs
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert type(base) is memoryview and type(base.obj).__name__ == "mmap"  # an export of the segment's own mapping
    assert obs.ctypes.data % 64 == 0  # every leaf of a slot starts on a cache line
    r.release()


def test_released_rollout_raises_stale_instead_of_reading_recycled_data(pair: Any) -> None:
    reader, writer = pair
    write(writer, 1.0)
    r = reader.get(timeout=5)
    kept = r.copy()
    r.release()
    with pytest.raises(StaleRollout, match="was released; its slot .* now belongs to another rollout"):
        _ = r.data
    with pytest.raises(StaleRollout):
        r.release()
    assert r.released
    for _ in range(8):  # recycle the slot a few times
        write(writer, 2.0)
        reader.get(timeout=5).release()
    assert kept["step"]["obs"][0, 0] == 1.0  # the copy is the caller's


def test_with_block_releases(pair: Any) -> None:
    reader, writer = pair
    write(writer, 1.0)
    with reader.get(timeout=5) as r:
        assert r.data["step"]["reward"][0] == 1.0
    assert r.released
    assert reader.stats()["slots"]["held"] == 0


def test_short_rollout_carries_its_fill_and_filled_trims(pair: Any) -> None:
    reader, writer = pair
    write(writer, 3.0, length=5)
    with reader.get(timeout=5) as r:
        assert r.fill == {"episode": 1, "final": 0, "step": 5}
        f = r.filled()
        assert f["step"]["obs"].shape == (5, 4) and f["step"]["done"].tolist() == [False] * 4 + [True]
        assert r.data["step"]["obs"].shape == (T, 4)


def test_metadata(pair: Any) -> None:
    import os

    reader, writer = pair
    before = time.monotonic_ns()
    writer.policy_version = 7
    write(writer, 1.0)
    writer.add("step", {"obs": np.zeros(4, np.float32), "action": np.int64(0), "reward": np.float32(0), "done": False})
    writer.commit(policy_version=9)
    a, b = reader.get(timeout=5), reader.get(timeout=5)
    assert (a.seq, b.seq) == (0, 1)
    assert a.lane == b.lane == writer.lane
    assert a.pid == os.getpid()
    assert (a.policy_version, b.policy_version) == (7, 9)
    assert before <= a.commit_ns <= b.commit_ns <= time.monotonic_ns()
    a.release()
    b.release()


def test_batches_gather_rollouts_and_release_their_slots(pair: Any) -> None:
    reader, writer = pair
    for k in range(3):
        write(writer, float(k), length=T - k)
    reader.poll()
    batch = reader.get_batch(3, timeout=5, zero_copy=False)
    assert not batch.zero_copy
    assert batch.data["step"]["obs"].shape == (3, T, 4)
    assert batch.data["step"]["obs"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert batch.fill["step"].tolist() == [T, T - 1, T - 2]
    assert batch.seq.tolist() == [0, 1, 2]
    assert reader.stats()["slots"]["held"] == 0  # gathered, so released
    first = batch.data["step"]["obs"]
    for k in range(3):
        write(writer, 10.0 + k)
    again = reader.get_batch(3, timeout=5, zero_copy=False)
    assert again.data["step"]["obs"] is first  # copy=False: the same preallocated buffer, refilled
    for k in range(3):
        write(writer, 20.0 + k)
    mine = reader.get_batch(3, timeout=5, copy=True, zero_copy=False)
    assert mine.data["step"]["obs"] is not first and mine.data["step"]["obs"][:, 0, 0].tolist() == [20.0, 21.0, 22.0]


def test_batch_timeout_loses_nothing(pair: Any) -> None:
    reader, writer = pair
    write(writer, 1.0)
    write(writer, 2.0)
    with pytest.raises(shmbuf.SlotTimeout):
        reader.get_batch(3, timeout=0.1)
    write(writer, 3.0)
    batch = reader.get_batch(3, timeout=5)
    assert batch.data["step"]["reward"][:, 0].tolist() == [1.0, 2.0, 3.0]


def test_get_timeout_is_a_timeout_error(pair: Any) -> None:
    reader, _ = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"get\(\) got nothing within timeout=0.2 s; this reader holds no slot; "
                                           "1 writer is attached"):
        reader.get(timeout=0.2)
    assert time.monotonic() - t0 < 10.0  # a liveness bound: the timeout ended the wait


def test_a_timeout_with_no_writer_ever_attached_says_so(make_reader: Any) -> None:
    reader = make_reader(small_example(), slots=4, max_writers=1)
    with pytest.raises(shmbuf.SlotTimeout, match="no writer has attached yet .*__main__"):
        reader.get(timeout=0.1)
    with shmbuf.Writer(reader.handle, timeout=2.0):
        reader.poll()
    with pytest.raises(shmbuf.SlotTimeout, match=r"no writer is attached now \(1 came and left\)"):
        reader.get_batch(2, timeout=0.1)


def test_a_get_the_readers_own_batch_starves_raises_at_once(pair: Any) -> None:
    """A kept batch of every slot, then get(): the writers can never fill a slot, so it says so at once."""
    reader, writer = pair
    for k in range(8):
        write(writer, float(k))
        reader.poll()  # one writer may queue only half the slots before the reader lends again
    batch = reader.get_batch(8, timeout=5)
    assert batch.zero_copy
    for timeout in (5.0, None):  # None too: it used to wait for ever
        t0 = time.monotonic()
        with pytest.raises(shmbuf.UsageError, match=r"get\(\) can never be served: this reader itself holds 8 of its "
                                                    r"8 slots: a batch of 8 .*fill at most 0 of its 8 slots"):
            reader.get(timeout=timeout)
        assert time.monotonic() - t0 < 4.0  # at once, not after the 5 s timeout (a generous bound: CI is loaded)
    batch.release()
    write(writer, 9.0)
    with reader.get(timeout=5) as r:  # released: served again
        assert float(r.data["step"]["reward"][0]) == 9.0


def test_unreleased_rollouts_that_leave_too_few_slots_for_a_batch_raise_at_once(pair: Any) -> None:
    reader, writer = pair
    for k in range(6):
        write(writer, float(k))
        reader.poll()
    kept = [reader.get(timeout=5) for _ in range(6)]
    with pytest.raises(shmbuf.UsageError, match=r"get_batch\(4\) can never be served: this reader itself holds 6 of its "
                                                r"8 slots: 6 rollouts from get\(\) not released"):
        reader.get_batch(4, timeout=5)
    kept.pop().release()
    kept.pop().release()
    for k in range(4):
        write(writer, float(10 + k))
        reader.poll()
    batch = reader.get_batch(4, timeout=5)  # 2 released: 4 slots for the writers, enough
    assert batch.data["step"]["reward"][:, 0].tolist() == [10.0, 11.0, 12.0, 13.0]
    for r in kept:
        r.release()


def test_a_slot_timeout_names_what_the_reader_holds(pair: Any) -> None:
    reader, writer = pair
    write(writer, 1.0)
    kept = reader.get(timeout=5)
    with pytest.raises(shmbuf.SlotTimeout, match=r"this reader holds 1 of its 8 slots: 1 rollout from get\(\) not released"):
        reader.get(timeout=0.1)
    kept.release()


def test_mixed_gets_and_batches_with_held_rollouts_never_starve_in_silence(make_reader: Any) -> None:
    """Random get()/get_batch() with rollouts kept for a while: each call is served, or refused at once, never timed out.

    A writer thread commits for ever; the reader keeps some rollouts from get() unreleased and some
    batches alive across get() calls. Whenever the slots it holds leave writers too few for the
    call, the call must raise UsageError at once; otherwise it must be served within its timeout.
    """
    rng = np.random.default_rng(18)
    reader = make_reader(small_example(), slots=8, max_writers=1)
    stop = threading.Event()
    writer = shmbuf.Writer(reader.handle, timeout=5.0)

    def produce() -> None:
        try:
            while not stop.is_set():
                try:
                    write(writer, 1.0)
                except shmbuf.SlotTimeout:
                    continue  # the reader holds every slot for now
        except shmbuf.PipelineClosed:
            pass

    t = threading.Thread(target=produce, daemon=True)
    reader.poll()
    t.start()
    try:
        kept: list[shmbuf.Rollout] = []
        batch = None
        refused = served = 0
        for _ in range(300):
            held = len(kept) + (batch.size if batch is not None and batch.zero_copy and not batch.released else 0)
            if rng.random() < 0.5:
                size = 1
                call: Any = functools.partial(reader.get, timeout=5)
            else:
                size = int(rng.integers(1, 9))
                held -= batch.size if batch is not None and batch.zero_copy and not batch.released else 0  # released first
                call = functools.partial(reader.get_batch, size, timeout=5)
            if 8 - held < size:
                with pytest.raises(shmbuf.UsageError, match="can never be served"):
                    call()
                refused += 1
            else:
                got = call()
                served += 1
                if isinstance(got, shmbuf.Rollout):
                    kept.append(got)
                else:
                    batch = got
            while kept and rng.random() < 0.4:
                kept.pop(int(rng.integers(len(kept)))).release()
            if batch is not None and not batch.released and rng.random() < 0.2:
                batch.release()
        assert refused > 10 and served > 100, (refused, served)  # both sides of the rule were exercised
    finally:
        stop.set()
        reader.close()
        t.join(10)
        assert not t.is_alive()
        writer.close()


def test_writer_error_is_raised_in_the_reader_with_its_traceback(pair: Any) -> None:
    reader, writer = pair

    def failing() -> None:
        raise ZeroDivisionError("env exploded")

    try:
        failing()
    except ZeroDivisionError as exc:
        assert writer.report_error(exc)
    with pytest.raises(WriterError, match="raised ZeroDivisionError: env exploded") as info:
        reader.get(timeout=5)
    assert info.value.kind == "ZeroDivisionError"
    assert "in failing" in info.value.remote_traceback
    write(writer, 1.0)  # the pipeline goes on
    reader.get(timeout=5).release()


def test_reader_pickles_to_its_handle_and_a_name_is_enough(pair: Any) -> None:
    reader, _ = pair
    h = pickle.loads(pickle.dumps(reader))
    assert h == reader.handle == shmbuf.Handle(reader.name)
    w2 = shmbuf.Writer(reader.name)
    assert w2.schema == reader.schema
    w2.close()


def test_stats(pair: Any) -> None:
    reader, writer = pair
    t0 = time.monotonic_ns()
    for _ in range(3):
        write(writer, 1.0)
    reader.get(timeout=5).release()
    span_us = (time.monotonic_ns() - t0) / 1000
    s = reader.stats()
    assert s["rollouts"] == 1 and s["ready_depth"] == 2 and s["writers"] == 1
    assert s["bytes"] == sum(lf.nbytes for lf in reader.schema.leaves)
    # commit to delivery lies inside the span measured around the writes and the get (µs, not ns or s)
    assert 0 < s["latency_us_p50"] <= s["latency_us_p99"] <= span_us
    assert s["slots"]["pool"] + s["slots"]["lent"] + s["slots"]["ready"] + s["slots"]["held"] == reader.slots


def test_writer_threads_in_the_reader_process(make_reader: Any) -> None:
    reader = make_reader(small_example(), slots=4, max_writers=4)
    n = 300
    errors: list[BaseException] = []

    def run(tag: int) -> None:
        try:
            with shmbuf.Writer(reader.handle, timeout=10) as w:
                for seq in range(n):
                    write(w, float(tag * 10000 + seq), length=2)
        except BaseException as exc:  # noqa: BLE001  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(3 * n):
        with reader.get(timeout=10) as r:
            v = int(r.data["step"]["obs"][0, 0])
            seen[v // 10000].append(v % 10000)
    for th in threads:
        th.join(10)
    assert not errors
    assert all(seen[k] == list(range(n)) for k in seen)


def test_a_reader_closed_is_closed(pair: Any) -> None:
    reader, _ = pair
    reader.close()
    assert reader.closed
    with pytest.raises(shmbuf.PipelineClosed):
        reader.get(timeout=0)


def test_shmbuf_ls_counts_every_slot_of_a_new_pipeline_in_the_pool(make_reader: Any) -> None:
    """It showed the last timescale's leaf count (a loop variable reused) until the reader first lent slots."""
    from shmbuf import _admin

    reader = make_reader(small_example(), slots=8, max_writers=2)  # 3 timescales; 'final' has 2 leaves
    found = [f for f in _admin.scan() if f.name == reader.name]
    assert len(found) == 1 and found[0].pool == 8


def test_unlink_removes_the_names_at_once_and_the_writers_attached_keep_going(pair: Any) -> None:
    """Reader.unlink() (the owned-object base's destroy verb): new writers cannot attach, attached ones keep writing;
    close() after it is still the full stop. Only the creating process may unlink."""
    reader, writer = pair
    reader.unlink()
    assert not os.path.exists("/dev/shm" + reader.name)
    with pytest.raises(shmbuf.SegmentError):
        shmbuf.Writer(reader.handle, timeout=1)
    write(writer, 3.0)
    with reader.get(timeout=5) as r:
        assert r.data["step"]["reward"][0] == 3.0
    pid = os.fork()
    if pid == 0:  # the child: not the creator
        try:
            reader.unlink()
            os._exit(1)
        except shmbuf.UsageError:
            os._exit(0)
        except BaseException:  # noqa: BLE001  # any other outcome is the failure the exit status reports
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    reader.close()
    with pytest.raises(shmbuf.PipelineClosed):
        write(writer, 4.0)
