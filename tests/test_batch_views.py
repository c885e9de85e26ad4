"""Zero-copy batches: when get_batch hands out views, how long they live, and that nothing is lost or overwritten."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import StaleRollout

T = 8
EX = {"step": {"x": np.zeros((T, 3), np.float32)}, "tag": {"writer": np.zeros((), np.int64), "k": np.zeros((), np.int64)}}


def send(w: shmbuf.Writer, writer: int, k: int) -> None:
    """A rollout whose every value says who wrote it and which it is: 1000 * writer + k."""
    w.send({"step": {"x": np.full((T, 3), 1000 * writer + k, np.float32)},
            "tag": {"writer": np.array(writer), "k": np.array(k)}})


def check_rows(batch: shmbuf.Batch) -> list[tuple[int, int]]:
    """Each row's data matches its tag; return the tags."""
    d = batch.data
    tags = list(zip(d["tag"]["writer"].tolist(), d["tag"]["k"].tolist()))
    for i, (wr, k) in enumerate(tags):
        assert (d["step"]["x"][i] == 1000 * wr + k).all(), f"row {i} holds another rollout's data"
    return tags


@pytest.fixture
def one_writer(make_reader: Any) -> Any:
    """A pipeline of 8 slots and one Writer in this thread (lent slots as each test polls)."""
    reader = make_reader(EX, slots=8, max_writers=1)
    w = shmbuf.Writer(reader, timeout=2.0)
    yield reader, w
    w.close()


def fill(reader: shmbuf.Reader, w: shmbuf.Writer, first: int, n: int = 4) -> None:
    """Lend the writer slots (it runs in this thread) and send rollouts ``first .. first + n - 1`` of writer 0."""
    reader.poll()
    for k in range(first, first + n):
        send(w, 0, k)


def test_the_old_name_view_still_works_with_a_warning(one_writer: Any) -> None:
    """``get_batch(view=...)`` was renamed ``zero_copy=`` (CHANGELOG.md); the old keyword keeps its meaning for now."""
    reader, w = one_writer
    fill(reader, w, 0)
    with pytest.warns(DeprecationWarning, match=r"get_batch\(view=\.\.\.\) is now get_batch\(zero_copy=\.\.\.\)"):
        b = reader.get_batch(4, timeout=5, view=False)
    assert not b.zero_copy and check_rows(b) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    with pytest.warns(DeprecationWarning), pytest.raises(shmbuf.UsageError, match="disagree"):
        reader.get_batch(4, timeout=5, zero_copy=False, view=True)  # not a silent override of zero_copy=False


def _is_view_of_the_segment(reader: shmbuf.Reader, a: np.ndarray) -> bool:
    return any(np.shares_memory(a, leaf) for leaf in reader._handout.leaf_all)


def test_a_run_of_consecutive_slots_is_handed_out_as_views(one_writer: Any) -> None:
    reader, w = one_writer
    fill(reader, w, 0)
    b = reader.get_batch(4, timeout=5)
    assert b.zero_copy and _is_view_of_the_segment(reader, b.data["step"]["x"])
    assert check_rows(b) == [(0, 0), (0, 1), (0, 2), (0, 3)] and b.seq.tolist() == [0, 1, 2, 3]
    assert reader.stats()["slots"]["held"] == 4 and reader.stats()["batches"] == {"views": 1, "gathered": 0}
    fill(reader, w, 4)
    g = reader.get_batch(4, timeout=5, zero_copy=False)
    assert not g.zero_copy and not _is_view_of_the_segment(reader, g.data["step"]["x"])
    assert check_rows(g) == [(0, 4), (0, 5), (0, 6), (0, 7)] and reader.stats()["slots"]["held"] == 0
    fill(reader, w, 8)
    c = reader.get_batch(4, timeout=5, copy=True)
    assert check_rows(c) == [(0, 8), (0, 9), (0, 10), (0, 11)] and reader.stats()["slots"]["held"] == 0
    assert not _is_view_of_the_segment(reader, c.data["step"]["x"]) and not c.released
    c.release()  # copy=True: the arrays are yours, nothing to give back
    assert check_rows(c)


def test_a_released_batch_raises_on_access_and_on_a_second_release(one_writer: Any) -> None:
    reader, w = one_writer
    fill(reader, w, 0)
    with reader.get_batch(4, timeout=5) as b:
        assert b.zero_copy and not b.released
    assert b.released and reader.stats()["slots"]["held"] == 0  # the with block gave the slots back
    with pytest.raises(StaleRollout, match="batch of 4 was released"):
        _ = b.data
    with pytest.raises(StaleRollout):
        b["step"]
    with pytest.raises(StaleRollout):
        b.release()
    assert b.seq.tolist() == [0, 1, 2, 3]  # the metadata are copies: still there
    # The next get_batch releases the batch before it, views and gathered alike.
    for view in (True, False):
        fill(reader, w, 10)
        first = reader.get_batch(4, timeout=5, zero_copy=view)
        _ = first.data
        fill(reader, w, 20)
        reader.get_batch(4, timeout=5, zero_copy=view).release()
        assert first.released
        with pytest.raises(StaleRollout):
            _ = first.data
    fill(reader, w, 30)
    last = reader.get_batch(4, timeout=5)
    w.close()
    reader.close()
    assert last.released
    with pytest.raises(StaleRollout, match="closed"):
        _ = last.data


def test_a_timed_out_get_batch_has_still_released_the_batch_before_it(one_writer: Any) -> None:
    reader, w = one_writer
    fill(reader, w, 0)
    b = reader.get_batch(4, timeout=5)
    with pytest.raises(shmbuf.SlotTimeout):
        reader.get_batch(4, timeout=0.05)
    assert b.released and reader.stats()["slots"]["held"] == 0


def _writer_proc(name: str, writer: int, n: int) -> None:
    with shmbuf.Writer(name, timeout=20.0) as w:
        for k in range(n):
            send(w, writer, k)


@pytest.mark.parametrize("view", [True, False])
def test_every_rollout_is_delivered_exactly_once_and_intact(make_reader: Any, procs: Any, view: bool) -> None:
    n, writers, size = 400, 2, 8
    reader = make_reader(EX, slots=32, max_writers=writers)
    for i in range(writers):
        procs(_writer_proc, reader.name, i, n)
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + 60
    while len(seen) < n * writers:
        assert time.monotonic() < deadline, f"only {len(seen)} of {n * writers} rollouts in 60 s"
        b = reader.get_batch(size, timeout=10, zero_copy=view)
        if not view:
            assert not b.zero_copy
        seen += check_rows(b)
    assert sorted(seen) == [(i, k) for i in range(writers) for k in range(n)]  # none lost, none twice
    per_writer = {i: [k for wr, k in seen if wr == i] for i in range(writers)}
    assert all(ks == sorted(ks) for ks in per_writer.values())  # each writer's commit order, views or gathered
    st = reader.stats()
    assert st["batches"]["views"] + st["batches"]["gathered"] == n * writers // size
    if view:
        assert st["batches"]["views"] > 0
    s = st["slots"]
    assert s["pool"] + s["lent"] + s["ready"] + s["held"] == 32


SPAWN = mp.get_context("spawn")


def _flood(name: str, writer: int, stop: Any) -> None:
    """Send as fast as slots come until ``stop`` is set (or 120 s have passed: a test that died meanwhile)."""
    end = time.monotonic() + 120
    k = 0
    with shmbuf.Writer(name, timeout=20.0) as w:
        while not stop.is_set() and time.monotonic() < end:
            send(w, writer, k)
            k += 1


def drain_until_writers_leave(reader: shmbuf.Reader, timeout: float = 60) -> None:
    """Take and release rollouts until every writer has left (so that they exit cleanly); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while reader.stats()["writers"]:
        assert time.monotonic() < deadline, f"the writers were still attached {timeout} s after they were stopped"
        try:
            reader.get(timeout=0.2).release()
        except shmbuf.SlotTimeout:
            pass


def test_no_writer_writes_a_slot_a_held_batch_covers(make_reader: Any, procs: Any) -> None:
    """Two writers keep committing while the learner holds a zero-copy batch and takes rollouts one by one."""
    reader = make_reader(EX, slots=16, max_writers=2)
    stop = SPAWN.Event()
    for i in range(2):
        procs(_flood, reader.name, i, stop)
    for _ in range(100):  # the first batches may be gathered while the writers start
        b = reader.get_batch(4, timeout=10)
        if b.zero_copy:
            break
    assert b.zero_copy
    before = {k: np.array(v) for k, v in b.data["step"].items()}
    tags = check_rows(b)
    turned = 0
    deadline = time.monotonic() + 60  # a hang's deadline: 200 rollouts take well under a second here
    while turned < 200:  # every other slot (12 of them) is written and read again, many times
        assert time.monotonic() < deadline, f"the writers committed only {turned} rollouts beside the held batch in 60 s"
        with reader.get(timeout=10) as r:
            assert (r.data["step"]["x"] == 1000 * int(r.data["tag"]["writer"]) + int(r.data["tag"]["k"])).all()
            turned += 1
        assert reader.stats()["slots"]["held"] == 4
    stop.set()
    for k, v in b.data["step"].items():
        assert (v == before[k]).all(), "a writer wrote into a slot the held batch covers"
    assert check_rows(b) == tags
    b.release()
    drain_until_writers_leave(reader)


def test_a_hung_writer_delays_a_default_batch_only_briefly(make_reader: Any) -> None:
    """A writer that holds a slot in the middle of a run and never commits: get_batch gathers the rest
    rather than wait for that run."""
    reader = make_reader(EX, slots=8, max_writers=2)
    hung = shmbuf.Writer(reader, timeout=2.0)
    busy = shmbuf.Writer(reader, timeout=2.0)
    try:
        reader.poll()
        hung.add("step", {"x": np.zeros(3, np.float32)})  # takes its first lent slot and stops there
        for k in range(4):
            if k % 2 == 0:
                reader.poll()  # the writers run in this thread: lend them slots (2 per lane at a time)
            send(busy, 1, k)
        # 4 ready, but each run of 4 slots has one the hung writer holds or may write
        t0 = time.monotonic()
        b = reader.get_batch(4, timeout=60)
        # The patience rule ends this wait in about RUN_PATIENCE (0.02 s); without it, the wait would last the whole
        # timeout and then gather. Half the timeout tells the two apart on any machine.
        assert time.monotonic() - t0 < 30, "get_batch waited out its timeout: the patience rule did not end the wait"
        assert check_rows(b) == [(1, 0), (1, 1), (1, 2), (1, 3)]
    finally:
        hung.close()
        busy.close()


def test_a_run_whose_last_slot_is_still_being_written_is_never_handed_out(make_reader: Any) -> None:
    """Writer A has committed the first three slots of its run and is mid-write of the last one when the learner
    asks for a batch, with enough rollouts ready (B's first one besides A's three). The run search must see the
    last slot is not ready: the batch is the four oldest committed rollouts, gathered, and A's rollout in that slot
    comes out once, whole, when A commits it. (Handed out as views, the batch's last row would be A's half-written
    slot, and A's commit of it refused: a slot the user holds.)"""
    from shmbuf._books import SLOT_LENT, SLOT_READY

    reader = make_reader(EX, slots=8, max_writers=2)  # runs of 4: slots 0-3 and 4-7
    a = shmbuf.Writer(reader, timeout=2.0)
    b = shmbuf.Writer(reader, timeout=2.0)
    try:
        with pytest.raises(shmbuf.SlotTimeout):
            reader.get_batch(4, timeout=0)  # says the batch size: from now on each lane is lent a whole run
        reader.poll()  # A (the first lane) gets run 0-3, B run 4-7
        for k in range(3):
            send(a, 0, k)
        a.add("step", {"x": np.full(3, 3.0, np.float32)})  # rollout 3 of A, in the run's last slot: mid-write
        send(b, 1, 0)
        reader.poll()
        # The situation under test: A's run is ready but for its last slot, which A holds.
        assert reader._books.where[:4] == bytes([SLOT_READY] * 3 + [SLOT_LENT]), "the set-up did not make the situation"
        batch = reader.get_batch(4, timeout=5)
        tags = list(zip(batch.data["tag"]["writer"].tolist(), batch.data["tag"]["k"].tolist()))
        assert tags == [(0, 0), (0, 1), (0, 2), (1, 0)], f"the batch holds a slot still being written: rows {tags}"
        assert check_rows(batch) == tags and not batch.zero_copy  # gathered: no run was whole
        for _ in range(T - 1):
            a.add("step", {"x": np.full(3, 3.0, np.float32)})
        a.add("tag", {"writer": np.array(0), "k": np.array(3)})
        a.commit()  # into the slot the batch did not take
        with reader.get(timeout=5) as r:
            assert (int(r.data["tag"]["writer"]), int(r.data["tag"]["k"])) == (0, 3)
            assert (r.data["step"]["x"] == 3.0).all()
        assert reader.stats()["bad_messages"] == 0  # A's commit of that slot was taken, not refused
    finally:
        a.close()
        b.close()


def test_a_run_is_never_lent_while_a_writer_is_still_writing_its_last_slot(make_reader: Any) -> None:
    """Writer W is mid-write of slot 3, the last of run 0-3, whose other slots are back in the pool, when the
    learner asks for a batch and that call lends writer A its next run. A run is lent only when every slot of it
    is in the pool: A gets run 4-7, the batch after is its views, and W's rollout comes out once, whole. (Lent
    0-3, A would fill slot 3 under W, the batch would go out as views of 0-3 while W still writes slot 3, and W's
    commit would be refused: a slot the learner holds.)"""
    from shmbuf._books import SLOT_LENT, SLOT_POOL

    reader = make_reader(EX, slots=16, max_writers=2)  # runs of 4; each lane queues up to 4 slots, lent a run at a time
    w = shmbuf.Writer(reader, timeout=2.0)  # the first lane: lent run 0-3 first
    a = shmbuf.Writer(reader, timeout=2.0)
    try:
        with pytest.raises(shmbuf.SlotTimeout):
            reader.get_batch(4, timeout=0)  # says the batch size: from now on slots are lent a run at a time
        reader.poll()  # W: run 0-3, A: run 4-7
        for k in range(3):
            send(w, 0, k)
        w.add("step", {"x": np.full(3, 3.0, np.float32)})  # W's rollout 3, in slot 3: mid-write from here on
        for k in range(4):
            send(a, 1, k)
        reader.poll()  # W: run 8-11, A: run 12-15
        for _ in range(3):
            reader.get(timeout=5).release()  # W's three: slots 0-2 back in the pool (3 < 4: nothing lent on them)
        for k in range(4, 8):
            send(a, 1, k)  # A's queue is empty now: the next lending gives it a run
        first = reader.get_batch(4, timeout=5)  # A's 0-3, views of 4-7
        assert first.zero_copy and check_rows(first) == [(1, k) for k in range(4)]
        # The situation under test: run 0-3 is in the pool but for slot 3, which W is writing.
        assert reader._books.where[:4] == bytes([SLOT_POOL] * 3 + [SLOT_LENT]), "the set-up did not make the situation"
        second = reader.get_batch(4, timeout=5)  # releases 4-7 and lends A a run, then hands out A's 4-7 (12-15)
        assert check_rows(second) == [(1, k) for k in range(4, 8)]
        for k in range(8, 12):
            send(a, 1, k)
        third = reader.get_batch(4, timeout=5)
        assert third.zero_copy and check_rows(third) == [(1, k) for k in range(8, 12)]
        held = np.array(third.data["step"]["x"])
        for _ in range(T - 1):
            w.add("step", {"x": np.full(3, 3.0, np.float32)})
        w.add("tag", {"writer": np.array(0), "k": np.array(3)})
        w.commit()
        assert (third.data["step"]["x"] == held).all(), "W wrote into a slot of the batch the learner holds"
        third.release()
        with reader.get(timeout=5) as r:
            assert (int(r.data["tag"]["writer"]), int(r.data["tag"]["k"])) == (0, 3)
            assert (r.data["step"]["x"] == 3.0).all()
        assert reader.stats()["bad_messages"] == 0  # W's commit of its slot was taken, not refused
    finally:
        w.close()
        a.close()


def test_held_rollouts_in_every_run_mean_a_gather_at_once(make_reader: Any) -> None:
    reader = make_reader(EX, slots=4, max_writers=1)  # runs of 2: slots 0-1 and 2-3
    with shmbuf.Writer(reader, timeout=2.0) as w:
        reader.poll()
        for k in range(2):
            send(w, 0, k)  # slots 0, 1
        a = reader.get(timeout=5)  # slot 0
        reader.poll()
        for k in range(2, 4):
            send(w, 0, k)  # slots 2, 3
        reader.get(timeout=5).release()  # slot 1
        c = reader.get(timeout=5)  # slot 2: now each run holds a rollout taken with get()
        reader.poll()
        send(w, 0, 4)  # slot 1
        g = reader.get_batch(2, timeout=5)
        assert not g.zero_copy and [k for _, k in check_rows(g)] == [3, 4]  # gathered, oldest first
        a.release()
        c.release()
    with pytest.raises(shmbuf.UsageError, match="zero_copy"):
        reader.get_batch(2, zero_copy=None)  # type: ignore[arg-type]  # the wrong type is the test


def test_an_idle_writer_does_not_stall_the_others(make_reader: Any, procs: Any) -> None:
    """A writer that holds a lane and never writes gets at most one run; the others keep delivering zero-copy
    batches (before: it held a stretch of every run, and after the first gather every get_batch timed out)."""
    reader = make_reader(EX, slots=48, max_writers=2)
    idle = shmbuf.Writer(reader, timeout=20.0)
    stop = SPAWN.Event()
    try:
        procs(_flood, reader.name, 1, stop)
        views = 0
        for _ in range(40):
            b = reader.get_batch(16, timeout=5)
            views += b.zero_copy
            assert all(wr == 1 for wr, _ in check_rows(b))
        assert views >= 30, f"only {views} of 40 batches were zero-copy beside an idle writer"
        b.release()
    finally:
        stop.set()
        idle.close()
    drain_until_writers_leave(reader)


def test_a_writer_that_arrives_later_gets_slots_beside_one_that_keeps_pace(make_reader: Any) -> None:
    """An actor's replacement on a busy pipeline: the older writer takes every slot it is lent before the next batch,
    six of the eight slots are ready, and each batch of two gives the pool one run. The later writer must get slots
    (and deliver) within a few batches. Before, the run went to the lane adopted first at every tie, and the later
    writer never got one: a multi-agent collector's restarted actor waited for ever so (seen under a loaded CI)."""
    reader = make_reader(EX, slots=8, max_writers=2)
    old = shmbuf.Writer(reader, timeout=0)  # both in this thread: a slot() that would wait raises SlotTimeout at once
    late = None

    def use_all(w: shmbuf.Writer, writer: int) -> int:
        n = 0
        while True:
            try:
                send(w, writer, n)
            except shmbuf.SlotTimeout:
                return n
            n += 1

    try:
        for _ in range(8):  # the old writer fills the pipeline: every slot ready
            use_all(old, 0)
            if reader.poll() == 8:
                break
        assert reader.poll() == 8, "the set-up did not make the situation"
        late = shmbuf.Writer(reader, timeout=0)
        sent, tags = 0, []
        for _ in range(10):
            tags += check_rows(reader.get_batch(2, timeout=5, copy=True))  # a run back to the pool at once
            use_all(old, 0)
            sent += use_all(late, 1)
        assert sent >= 4, f"the later writer got {sent} slots in 10 batches beside one that keeps pace"
        assert any(wr == 1 for wr, _ in tags), f"nothing of the later writer was delivered: {tags}"
    finally:
        old.close()
        if late is not None:
            late.close()


@pytest.mark.alone  # how many batches are zero-copy depends on the writers' pace: tests beside it slow them unevenly
def test_more_writers_than_the_batch_size_still_get_zero_copy_batches(make_reader: Any, procs: Any) -> None:
    """Before: with 3 writers and batches of 2 every batch waited out the run patience, then gathered."""
    reader = make_reader(EX, slots=8, max_writers=3)
    for i in range(3):
        procs(_writer_proc, reader.name, i, 300)
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + 60
    while len(seen) < 900:
        assert time.monotonic() < deadline, f"only {len(seen)} of 900 rollouts in 60 s"
        seen += check_rows(reader.get_batch(2, timeout=10))
    assert sorted(seen) == [(i, k) for i in range(3) for k in range(300)]
    st = reader.stats()["batches"]
    assert st["views"] > st["gathered"], st


def test_a_deadline_with_enough_ready_gathers_rather_than_times_out(make_reader: Any) -> None:
    """A hung writer keeps every run from completing in order; with 4 ready, get_batch(4, timeout=0) gathers."""
    reader = make_reader(EX, slots=8, max_writers=2)
    hung = shmbuf.Writer(reader, timeout=2.0)
    busy = shmbuf.Writer(reader, timeout=2.0)
    try:
        reader.poll()
        hung.add("step", {"x": np.zeros(3, np.float32)})
        for k in range(4):
            if k % 2 == 0:
                reader.poll()
            send(busy, 1, k)
        for timeout in (0, 0.01):
            b = reader.get_batch(4, timeout=timeout)
            assert not b.zero_copy and [k for _, k in check_rows(b)] == [0, 1, 2, 3]
            reader.poll()
            for k in range(4):
                if k % 2 == 0:
                    reader.poll()
                send(busy, 1, k)
    finally:
        hung.close()
        busy.close()


def _touch_in_child(batch: shmbuf.Batch, conn: Any) -> None:
    out = []
    for what in (lambda: batch.data, batch.release):
        try:
            what()
            out.append("ok")
        except shmbuf.WrongProcess:
            out.append("WrongProcess")
    conn.send_bytes(",".join(out).encode())


def test_a_batch_copied_into_a_forked_child_refuses_to_be_read_or_released(one_writer: Any) -> None:
    import multiprocessing as mp

    reader, w = one_writer
    fill(reader, w, 0)
    b = reader.get_batch(4, timeout=5)
    rx, tx = mp.get_context("fork").Pipe(duplex=False)
    p = mp.get_context("fork").Process(target=_touch_in_child, args=(b, tx), daemon=True)
    p.start()
    try:
        assert rx.poll(20), "the child did not answer"
        assert rx.recv_bytes().decode() == "WrongProcess,WrongProcess"
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    assert not b.released and check_rows(b) == [(0, 0), (0, 1), (0, 2), (0, 3)]  # the parent's batch is untouched
    assert reader.stats()["slots"]["held"] == 4


def test_stats_say_why_each_gathered_batch_was_gathered(one_writer: Any) -> None:
    """A batch that is not zero-copy is counted under its reason; views are not counted there."""
    reader, w = one_writer
    fill(reader, w, 0)
    assert reader.get_batch(4, timeout=5).zero_copy
    fill(reader, w, 4)
    assert not reader.get_batch(4, timeout=5, zero_copy=False).zero_copy  # asked for
    fill(reader, w, 8)  # one run
    kept = [reader.get(timeout=5)]  # rollout 8 held in that run
    for _ in range(3):
        reader.get(timeout=5).release()
    fill(reader, w, 12)  # the other run, whole
    kept.append(reader.get(timeout=5))  # rollout 12 held in it: now each run holds a rollout taken with get()
    fill(reader, w, 16, 3)
    b = reader.get_batch(4, timeout=5)
    assert not b.zero_copy and [k for _, k in check_rows(b)] == [13, 14, 15, 16]
    for r in kept:
        r.release()
    assert reader.stats()["gathered_why"] == {"zero_copy=False": 1, "every run held a rollout taken with get()": 1}
    assert reader.stats()["batches"] == {"views": 1, "gathered": 2}


_STEPS = st.lists(st.sampled_from(["poll", "A", "B", "batch", "get"]), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_STEPS)
def test_a_quiet_writers_committed_rollouts_are_delivered_while_another_keeps_the_learner_busy(steps: list[str]) -> None:
    """Writer A sends, B sends, the learner polls, gets and gets batches of 2, in any order; then A goes quiet and
    B keeps the learner busy. Every rollout A committed still comes out, once, in A's order.

    Before, A's rollouts could wait for ever: its own run waiting on A's next commit, or two runs of A's each
    holding a rollout older than one in the other (out of order for views, for good) while B's runs kept going
    out, so the patience never came. A SIGKILLed actor's replacement starved so: A's rollouts filled the slots.
    """
    reader = shmbuf.create(EX, slots=8, max_writers=2)
    sent, got = {0: 0, 1: 0}, []
    writers: list[shmbuf.Writer] = []
    try:
        writers += [shmbuf.Writer(reader, timeout=0.001), shmbuf.Writer(reader, timeout=0.001)]

        def try_send(i: int) -> bool:
            try:
                send(writers[i], i, sent[i])
            except shmbuf.SlotTimeout:  # no slot lent to it now
                return False
            sent[i] += 1
            return True

        def take(timeout: float) -> None:
            try:
                got.extend(check_rows(reader.get_batch(2, timeout=timeout, copy=True)))
            except shmbuf.SlotTimeout:
                pass

        for step in steps:
            if step == "poll":
                reader.poll()
            elif step in ("A", "B"):
                try_send("AB".index(step))
            elif step == "get":
                try:
                    with reader.get(timeout=0) as r:
                        got.append((int(r.data["tag"]["writer"]), int(r.data["tag"]["k"])))
                except shmbuf.SlotTimeout:
                    pass
            else:
                take(0)
        deadline = time.monotonic() + 10
        while sorted(k for wr, k in got if wr == 0) != list(range(sent[0])):
            assert time.monotonic() < deadline, (
                f"A committed {sent[0]}, {sum(wr == 0 for wr, _ in got)} came out in 10 s: {reader.stats()['slots']}")
            reader.poll()
            while try_send(1):
                pass
            take(0.05)
        for i in (0, 1):
            ks = [k for wr, k in got if wr == i]
            assert ks == sorted(set(ks)), f"writer {i}'s rollouts came out of order or twice: {ks}"
    finally:
        for w in writers:
            w.close()
        reader.close()
        reader.unlink()

