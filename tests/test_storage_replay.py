"""shmbuf.storage.replay: the ring against a reference, concurrent inserters, killed and lapped writers, attach, errors.

Every row a test writes carries one code, ``(inserter tag << 22) + row number + 1``, in every
element of every field (float32, uint8 bytes, int64, float64, int32), so a half-written row or a
mix of two inserts decodes to different codes within one row and is caught wherever it shows up.
Every buffer is unlinked at teardown, and its name is checked gone from /dev/shm; every child is
killed and joined; every wait has a deadline.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import multiprocessing as mp
import os
import pathlib
import pickle
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import _errors, _ofd
from shmbuf._shm import unlink_object
from shmbuf.storage import _replay_layout as layout_mod
from shmbuf.storage import _replay_writers as writers_mod
from shmbuf.storage.replay import ReplayBuffer, ReplayHandle, describe, is_replay
from tests.conftest import leaked_since

from .conftest import wait_until

ROOT = pathlib.Path(__file__).parent.parent
FORK = mp.get_context("fork")


def example_row() -> dict[str, Any]:
    return {"obs": np.zeros(6, np.float32), "frame": np.zeros((2, 8), np.uint8), "act": np.zeros((), np.int64),
            "extra": (np.zeros(3, np.float64), np.zeros((), np.int32))}


def code(tag: int, rownum: Any) -> Any:
    assert 0 <= tag <= 3  # so that every code is exact in float32 (below 2**24)
    return (tag << 22) + np.asarray(rownum, np.int64) + 1


def rows_of(codes: Any) -> dict[str, Any]:
    """A batch whose row i carries codes[i] in every element of every field."""
    c = np.asarray(codes, np.int64)
    n = len(c)
    return {"obs": np.repeat(c[:, None], 6, 1).astype(np.float32),
            "frame": np.repeat(c[:, None], 2, 1).astype("<i8").view(np.uint8).reshape(n, 2, 8),
            "act": c.copy(),
            "extra": (np.repeat(c[:, None], 3, 1).astype(np.float64), c.astype(np.int32))}


def decode(tree: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(code of each row, whether every element of the row carries that same code)."""
    n = len(tree["act"])
    cols = np.concatenate([
        tree["obs"].astype(np.int64).reshape(n, -1),
        np.ascontiguousarray(tree["frame"]).reshape(n, -1).view("<i8"),
        tree["act"].reshape(n, 1),
        tree["extra"][0].astype(np.int64).reshape(n, -1),
        tree["extra"][1].astype(np.int64).reshape(n, 1),
    ], axis=1)
    return cols[:, 0], (cols == cols[:, :1]).all(axis=1)


def gone(name: str) -> bool:
    return not os.path.exists(f"/dev/shm/{name[1:]}")


@pytest.fixture
def make_rb() -> Iterator[Callable[..., ReplayBuffer]]:
    """``make_rb(buffer_size, **kw)``: a buffer of example_row() that is unlinked and closed at teardown, and must be gone."""
    made: list[ReplayBuffer] = []

    def make(buffer_size: int, row: Any = None, **kw: Any) -> ReplayBuffer:
        rb = ReplayBuffer.create(example_row() if row is None else row, buffer_size, **kw)
        made.append(rb)
        return rb

    yield make
    for rb in made:
        rb.__exit__(None, None, None)
    assert all(gone(rb.name) for rb in made), "a replay buffer was left in /dev/shm"


@pytest.fixture
def kids(procs: Callable[..., Any]) -> Callable[..., Any]:
    """``kids(target, *args)``: a fork-ed child, killed and joined at teardown (conftest's ``procs``)."""
    return lambda target, *args: procs(target, *args, method="fork")


# ------------------------------------------------------------------ single process: the ring


class RefRing:
    """The rsl_rl fork's ring, written row by row: what every insert must leave."""

    def __init__(self, n: int):
        self.codes = np.zeros(n, np.int64)
        self.total = 0

    def insert(self, codes: np.ndarray) -> int:
        g = self.total
        for c in codes:
            self.codes[self.total % len(self.codes)] = c
            self.total += 1
        return g


def check_against(rb: ReplayBuffer, ref: RefRing) -> None:
    n = len(ref.codes)
    assert rb.inserted == ref.total
    assert rb.num_samples == min(ref.total, n) and len(rb) == rb.num_samples
    assert rb.step == ref.total % n
    rows, complete = rb.snapshot()
    got, ok = decode(rows)
    assert complete.all() and ok.all()
    np.testing.assert_array_equal(got, ref.codes[: rb.num_samples])


def test_every_size_from_1_to_2n_at_every_step(make_rb: Callable[..., ReplayBuffer]) -> None:
    n = 7
    rb, ref = make_rb(n), RefRing(n)
    row = 0
    for size in range(1, 2 * n + 1):
        for start in range(n):
            pad = (start - rb.step) % n
            for k in ([pad] if pad else []) + [size]:
                codes = code(0, np.arange(row, row + k))
                row += k
                assert rb.insert(rows_of(codes)) == ref.insert(codes)
                check_against(rb, ref)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), data=st.data())
def test_random_insert_sequences_match_the_reference(n: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(0, 2 * n), min_size=1, max_size=12))
    with ReplayBuffer.create(example_row(), n) as rb:
        ref = RefRing(n)
        row = 0
        for k in sizes:
            codes = code(1, np.arange(row, row + k))
            row += k
            rb.insert(rows_of(codes))
            ref.insert(codes)
            if ref.total:
                check_against(rb, ref)
        name = rb.name
    assert gone(name)


def test_sample_and_feed_forward_generator(make_rb: Callable[..., ReplayBuffer]) -> None:
    rb = make_rb(10, seed=3)
    rb.insert(rows_of(code(0, np.arange(4))))
    batches = list(rb.feed_forward_generator(5, 200))
    assert len(batches) == 5
    for b in batches:
        codes, ok = decode(b)
        assert ok.all() and b["obs"].shape == (200, 6) and b["extra"][1].shape == (200,)
        assert set(codes) == set(code(0, np.arange(4)).tolist())  # only the 4 rows written, each of them drawn
    first = rb.sample(8)
    first["obs"][:] = -1  # the caller's copy: the buffer does not change
    assert (decode(rb.snapshot()[0])[0] == code(0, np.arange(4))).all()
    torch = pytest.importorskip("torch")
    t = ReplayBuffer.to_torch(first)
    assert isinstance(t["obs"], torch.Tensor) and np.shares_memory(t["obs"].numpy(), first["obs"])


# ------------------------------------------------------------------ processes


def _inserter(rb: ReplayBuffer, tag: int, stop: Any, seed: int, log_path: str, max_batch: int) -> None:
    """Insert batches of random size until told to stop; log (global index, n, first row number) of each insert."""
    rng = np.random.default_rng(seed)
    k, log = 0, []
    while not stop.is_set():
        n = int(rng.integers(1, max_batch + 1))
        g = rb.insert(rows_of(code(tag, np.arange(k, k + n))))
        log.append((g, n, k))
        k += n
    np.save(log_path, np.array(log, np.int64).reshape(-1, 3))
    rb.close()


def expected_ring(logs: dict[int, np.ndarray], n: int, total: int) -> np.ndarray:
    """The code every row must hold after inserts logged as (g, n, first row number): the newest ``n`` global indices."""
    ring = np.zeros(n, np.int64)
    for tag, log in logs.items():
        for g, m, k in log:
            lo = max(g, total - n)
            for i in range(lo, g + m):
                ring[i % n] = code(tag, k + (i - g))
    return ring


def test_four_inserters_while_the_learner_samples(make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any],
                                                  tmp_path: pathlib.Path) -> None:
    n = 61  # small, so the inserters lap each other all the time and the lapping wait is exercised
    rb = make_rb(n, timeout=20.0)
    stop = FORK.Event()
    procs = [kids(_inserter, rb, tag, stop, tag, str(tmp_path / f"log{tag}.npy"), 2 * n) for tag in range(4)]
    wait_until(lambda: rb.num_samples == n, 20, "the first ring of inserts")
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    laps = 0
    # Sample while the inserters lap the ring, until each one's rows have been sampled and they have lapped it
    # 20 times since (not for a fixed 3 s, which a loaded machine could spend before an inserter had run).
    while len(seen) < 4 or rb.inserted < laps:
        assert time.monotonic() < deadline, f"in 60 s: rows of inserters {sorted(seen)} sampled, {rb.inserted} inserted"
        codes, ok = decode(rb.sample(64))
        assert ok.all(), f"a torn or mixed row was sampled: {codes[~ok]}"
        seen.update((codes - 1) >> 22)
        if len(seen) == 4 and not laps:
            laps = rb.inserted + 20 * n
    stop.set()
    for p in procs:
        p.join(20)
        assert p.exitcode == 0, f"inserter exit code {p.exitcode}"
    logs = {tag: np.load(tmp_path / f"log{tag}.npy") for tag in range(4)}
    total = rb.inserted
    assert total == sum(int(log[:, 1].sum()) for log in logs.values()), "an insert was lost or counted twice"
    for log in logs.values():  # each process's inserts got consecutive, disjoint global ranges, in its own order
        assert (np.diff(log[:, 0]) >= log[:-1, 1]).all() and (log[1:, 2] == np.cumsum(log[:, 1])[:-1]).all()
    starts = np.concatenate([log[:, 0] for log in logs.values()])
    lengths = np.concatenate([log[:, 1] for log in logs.values()])
    order = np.argsort(starts)
    assert starts[order][0] == 0 and (starts[order][1:] == np.cumsum(lengths[order])[:-1]).all(), "ranges overlap or leave gaps"
    rows, complete = rb.snapshot()
    got, ok = decode(rows)
    assert complete.all() and ok.all()
    np.testing.assert_array_equal(got, expected_ring(logs, n, total))
    # Per inserter, read oldest to newest: its newest rows, consecutive, in its order.
    oldest_first = np.roll(got, -rb.step)
    for tag, log in logs.items():
        mine = (oldest_first[(oldest_first - 1) >> 22 == tag] - 1) & ((1 << 22) - 1)
        count = int(log[:, 1].sum())
        np.testing.assert_array_equal(mine, np.arange(count - len(mine), count))
    assert seen == {0, 1, 2, 3}


class Paused(ReplayBuffer):
    """Copies the first half of the leaves, says so, waits to be let go (or to be killed), then copies the rest."""

    mid: Any = None
    go: Any = None

    def _copy_rows(self, leaves: list[np.ndarray], start: int, part: int, skip: int) -> None:
        rows, half = self._rows, len(leaves) // 2
        try:
            self._rows = rows[:half]
            super()._copy_rows(leaves[:half], start, part, skip)
            self.mid.set()
            assert self.go.wait(30), "never let go"
            self._rows = rows[half:]
            super()._copy_rows(leaves[half:], start, part, skip)
        finally:
            self._rows = rows


def _paused_inserter(name: str, tag: int, n: int, mid: Any, go: Any) -> None:
    rb = Paused.attach(name)
    rb.mid, rb.go = mid, go
    rb.insert(rows_of(code(tag, np.arange(n))))
    rb.close()


def test_a_slow_writer_is_never_lapped(make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any]) -> None:
    n = 8
    rb = make_rb(n)
    rb.insert(rows_of(code(0, np.arange(n))))  # full: rows 0..7 hold tag 0
    mid, go = FORK.Event(), FORK.Event()
    slow = kids(_paused_inserter, rb.name, 1, 4, mid, go)  # global 8..11 -> rows 0..3, stopped half-way
    assert mid.wait(10), "the slow writer never started copying"
    for _ in range(50):  # its rows are odd: never sampled
        codes, ok = decode(rb.sample(32))
        assert ok.all() and set(codes) <= set(code(0, np.arange(4, 8)).tolist())
    # Another instance would lap it (its rows 0..3): it waits, and gives up with nothing written (its places skipped).
    impatient = ReplayBuffer.attach(rb.name, timeout=0.3)
    with pytest.raises(_errors.SlotTimeout, match=r"still writing rows .* nothing of this batch was written"):
        impatient.insert(rows_of(code(2, np.arange(n))))
    impatient.close()
    assert rb.inserted == 20
    rows, complete = rb.snapshot()
    assert complete.tolist() == [False] * 4 + [True] * 4 and (decode(rows)[0][4:] == code(0, np.arange(4, 8))).all()
    # A patient one (global 20..27 -> rows 4..7, 0..3) waits for the slow writer before its first store, then goes.
    patient = ReplayBuffer.attach(rb.name, timeout=30)
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(patient.insert(rows_of(code(3, np.arange(n))))))
    t.start()
    try:
        wait_until(lambda: rb.inserted == 28, 10, "the patient insert's reservation")
        for _ in range(20):  # reserved, but it touches none of its rows while the slow writer is at rows 0..3
            rows, complete = rb.snapshot()
            assert complete.tolist() == [False] * 4 + [True] * 4 and (decode(rows)[0][4:] == code(0, np.arange(4, 8))).all()
            codes, ok = decode(rb.sample(32))
            assert ok.all()
    finally:
        go.set()
        t.join(30)
        slow.join(30)
        patient.close()
    assert slow.exitcode == 0 and done == [20]
    rows, complete = rb.snapshot()
    got, ok = decode(rows)
    assert complete.all() and ok.all()
    np.testing.assert_array_equal(got, code(3, (np.arange(n) - 20) % n))  # global 20..27 -> rows 4..7, 0..3


def test_a_writer_killed_mid_insert_leaves_no_torn_row(make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any]) -> None:
    n = 8
    rb = make_rb(n, timeout=5.0)
    rb.insert(rows_of(code(0, np.arange(n))))
    mid, go = FORK.Event(), FORK.Event()
    victim = kids(_paused_inserter, rb.name, 1, 4, mid, go)
    assert mid.wait(10), "the victim never started copying"
    victim.kill()
    victim.join(10)
    assert victim.exitcode == -signal.SIGKILL
    rows, complete = rb.snapshot()
    assert complete.tolist() == [False] * 4 + [True] * 4
    assert not decode(rows)[1][:4].all()  # those rows really are torn (half the fields written)
    for _ in range(100):
        codes, ok = decode(rb.sample(64))
        assert ok.all() and set(codes) <= set(code(0, np.arange(4, 8)).tolist())
    # The others go on: overwriting the dead writer's rows needs no wait (timeout=5 s would fail otherwise).
    assert rb.insert(rows_of(code(2, np.arange(3)))) == 12
    assert rb.insert(rows_of(code(2, np.arange(3, 8)))) == 15
    rows, complete = rb.snapshot()
    assert complete.all() and decode(rows)[1].all()


def _looping_inserter(rb: ReplayBuffer, tag: int, progress: Any, max_batch: int) -> None:
    k = 0
    rng = np.random.default_rng(tag)
    while True:
        m = int(rng.integers(1, max_batch + 1))
        rb.insert(rows_of(code(tag, np.arange(k, k + m))))
        k += m
        progress.value = k


def test_inserters_killed_at_random_times(make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any]) -> None:
    n = 256
    rb = make_rb(n, timeout=5.0)
    steady_progress = FORK.Value("q", 0, lock=False)
    kids(_looping_inserter, rb, 3, steady_progress, 2 * n)
    rng = np.random.default_rng(0)
    for i in range(6):
        p = kids(_looping_inserter, rb, i % 3, FORK.Value("q", 0, lock=False), 2 * n)
        time.sleep(float(rng.uniform(0.0, 0.05)))  # a random moment to kill at, not a wait for anything
        p.kill()
        p.join(10)
        before = steady_progress.value
        wait_until(lambda before=before: steady_progress.value > before, 10, "the steady inserter to go on after a kill")
        assert decode(rb.sample(256))[1].all()
    rows, complete = rb.snapshot()
    assert decode(rows)[1][complete].all(), "a row counted complete is torn"
    for _ in range(50):
        assert decode(rb.sample(256))[1].all()


def _paused_over(rb: ReplayBuffer, kids: Callable[..., Any], tag: int, n: int) -> tuple[Any, Any]:
    """A fork-ed child inserting ``n`` rows at ``rb.step``, stopped half-way through its copy, alive: (process, its go event)."""
    mid, go = FORK.Event(), FORK.Event()
    p = kids(_paused_inserter, rb.name, tag, n, mid, go)
    assert mid.wait(10), "the writer never started copying"
    return p, go


class AfterFirstDraw(ReplayBuffer):
    """A sampler that calls ``then()`` once a sample's first draw is gathered (which got some rows and missed others),
    and counts the redraws after it."""

    then: Any = None
    redraws = 0

    def _gather_into(self, out: list[np.ndarray], todo: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
        bad = super()._gather_into(out, todo, idx)
        if todo is None:
            assert 0 < bad.size < len(idx), f"the first draw missed {bad.size} of {len(idx)} rows: some of each wanted"
            self.then()
        else:
            self.redraws += 1
        return bad


def test_sample_says_its_writers_died_when_they_leave_no_complete_row(make_rb: Callable[..., ReplayBuffer],
                                                                      kids: Callable[..., Any]) -> None:
    """A first draw got complete rows, then writers died part-way over all the others: sample looked for "no complete
    row, for good" only while every row drawn was bad, so it redrew in a busy loop until its timeout and raised
    SlotTimeout ("every row drawn was being written"). Now a redraw that gets no further makes it look."""
    n = 8
    rb = make_rb(n)
    rb.insert(rows_of(code(0, np.arange(n))))
    a, _ = _paused_over(rb, kids, 1, 4)  # rows 0..3 odd, rows 4..7 complete

    def the_writers_die_over_the_rest() -> None:
        b, _ = _paused_over(rb, kids, 2, 4)  # rows 4..7 odd too
        for p in (a, b):
            p.kill()
            p.join(10)
            assert p.exitcode == -signal.SIGKILL

    sampler = AfterFirstDraw.attach(rb.name, timeout=3.0, seed=1)
    sampler.then = the_writers_die_over_the_rest
    try:
        with pytest.raises(_errors.UsageError, match=r"has no complete row \(its writers died"):
            sampler.sample(64)
    finally:
        sampler.close()
    assert not rb.snapshot()[1].any()


def test_sample_pauses_while_live_writers_are_mid_row(make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any]) -> None:
    """The same with the writers alive, stopped mid-row: sample redrew at full CPU (about 24,000 redraws/s) until its
    timeout. Now it pauses (a yield, growing to 1 ms) between redraws that get no further while a live writer is
    mid-row; with timeout=None it waits for them and samples their rows."""
    n = 8
    rb = make_rb(n)
    rb.insert(rows_of(code(0, np.arange(n))))
    writers = [_paused_over(rb, kids, 1, 4)]  # rows 0..3 odd, rows 4..7 complete
    sampler = AfterFirstDraw.attach(rb.name, timeout=0.5, seed=1)
    sampler.then = lambda: writers.append(_paused_over(rb, kids, 2, 4))  # rows 4..7 odd too
    out: list[Any] = []
    patient: ReplayBuffer | None = None
    t: threading.Thread | None = None
    try:
        with pytest.raises(_errors.SlotTimeout, match=r"timeout=0.5 s"):
            sampler.sample(64)
        assert sampler.redraws < 600, f"{sampler.redraws} redraws in the 0.5 s timeout: a busy loop"
        patient = ReplayBuffer.attach(rb.name, timeout=None, seed=2)
        t = threading.Thread(target=lambda p=patient: out.append(p.sample(64)), daemon=True)  # a hang must not block exit
        t.start()
        assert not out  # every row is mid-write: it waits
        for _, go in writers:
            go.set()
        t.join(30)
        assert not t.is_alive(), "sample(timeout=None) did not return once the writers finished"
    finally:
        for _, go in writers:
            go.set()
        if t is not None:
            t.join(30)
        sampler.close()
        if patient is not None:
            patient.close()
    for p, _ in writers:
        p.join(10)
        assert p.exitcode == 0
    codes, ok = decode(out[0])
    assert ok.all() and set(((codes - 1) >> 22).tolist()) <= {1, 2}


def _spawned_inserter(buffer: ReplayBuffer, tag: int, n: int) -> None:
    buffer.insert(rows_of(code(tag, np.arange(n))))
    buffer.close()


def test_attach_from_a_spawned_process(make_rb: Callable[..., ReplayBuffer], procs: Callable[..., Any]) -> None:
    rb = make_rb(16)
    assert stat.S_IMODE(os.stat(f"/dev/shm/{rb.name[1:]}").st_mode) == 0o600
    p = procs(_spawned_inserter, rb, 2, 10, method="spawn")  # pickling the buffer carries its name; the child attaches
    p.join(60)
    assert p.exitcode == 0
    assert rb.inserted == 10 and (decode(rb.snapshot()[0])[0] == code(2, np.arange(10))).all()
    other = ReplayBuffer.attach(ReplayHandle(rb.name))
    assert other.num_samples == 10 and other.schema == rb.schema
    other.insert(rows_of(code(3, np.arange(3))))
    with pytest.raises(_errors.UsageError, match="only the process that created it"):
        other.unlink()
    other.close()
    other.close()
    with pytest.raises(_errors.UsageError, match="closed"):
        other.insert(rows_of(code(3, np.arange(3))))
    info = describe(rb.name)
    assert info.inserted == 13 and info.buffer_size == 16 and is_replay(rb.name)
    # The child's slot came free when it closed, and `other` took it over: one slot, its last holder's 3 rows, none alive.
    assert [(rows, live) for _, _, live, rows in info.writers] == [(3, False)]


def test_a_forked_child_uses_its_inherited_copy(make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any]) -> None:
    rb = make_rb(16)
    rb.insert(rows_of(code(0, np.arange(2))))  # the parent holds a writer slot; the child must take its own
    p = kids(_spawned_inserter, rb, 1, 4)
    p.join(20)
    assert p.exitcode == 0 and rb.inserted == 6
    assert sorted(rows for _, _, _, rows in describe(rb.name).writers) == [2, 4]


# ------------------------------------------------------------------ release, close, interrupts, a stuck reservation


def fds(name: str) -> int:
    """This process's descriptors open on the object ``name`` (not all fds: other threads may open theirs meanwhile)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "/dev/shm" + name
        except OSError:
            pass
    return n


def test_an_instance_dropped_without_close_gives_back_its_slot_and_descriptor(make_rb: Callable[..., ReplayBuffer]) -> None:
    """Each attached instance collected unclosed kept its fd, and its writer slot's lock with it: after max_writers
    of them every insert timed out. A finalizer now closes the descriptor."""
    rb = make_rb(16, max_writers=2, timeout=0.3)
    before = fds(rb.name)
    for i in range(5):
        other = ReplayBuffer.attach(rb.name, timeout=0.3)
        other.insert(rows_of(code(1, np.arange(i, i + 1))))
        del other
        gc.collect()
    assert fds(rb.name) == before
    rb.insert(rows_of(code(0, np.arange(2))))
    assert rb.inserted == 7 and describe(rb.name).writers[0][2]  # the creator took slot 0 back; it is live


def test_the_creator_unlinks_at_close_or_when_collected_and_nobody_else_does(make_rb: Callable[..., ReplayBuffer]) -> None:
    rb = ReplayBuffer.create(example_row(), 8)
    name = rb.name
    try:
        other = ReplayBuffer.attach(name)
        other.close()  # an attached instance only detaches
        assert not gone(name)
        rb.insert(rows_of(code(0, np.arange(3))))
        del rb  # a creator that forgets `with` and close(): its name goes when it is collected
        gc.collect()
        assert gone(name)
    finally:
        unlink_object(name)
    rb = ReplayBuffer.create(example_row(), 8)
    try:
        rb.close()
        assert gone(rb.name)
        rb.close()
    finally:
        unlink_object(rb.name)


def test_close_waits_for_an_insert_in_another_thread(make_rb: Callable[..., ReplayBuffer]) -> None:
    """close() did not take the insert lock: it dropped the writer slot (and unmapped) under an insert mid-copy."""
    n = 8
    rb = make_rb(n)
    p = Paused.attach(rb.name, timeout=0.3)
    p.mid, p.go = threading.Event(), threading.Event()
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(p.insert(rows_of(code(1, np.arange(4))))))
    t.start()
    try:
        assert p.mid.wait(10), "the insert never started copying"
        with pytest.raises(_errors.SlotTimeout, match=r"close\(\) waited timeout=0.3 s for an insert"):
            p.close()
        assert describe(rb.name).writers[0][2]  # its writer slot is still held
        closer = threading.Thread(target=p.close)
        closer.start()
        p.go.set()
        closer.join(30)
        t.join(30)
    finally:
        p.go.set()
        t.join(30)
    assert out == [0] and p._closed
    rows, complete = rb.snapshot()
    assert complete.all() and (decode(rows)[0] == code(1, np.arange(4))).all()


class _StoreBoom:
    """The writer words, raising KeyboardInterrupt at the store of INSERTED (a Ctrl-C between two of _reserve's stores)."""

    def __init__(self, w: memoryview):
        self.w = w

    def __getitem__(self, i: int) -> int:
        return self.w[i]

    def __setitem__(self, i: int, v: int) -> None:
        if i == layout_mod.W_INSERTED:
            raise KeyboardInterrupt
        self.w[i] = v


def test_an_interrupt_inside_the_reservation_leaves_no_insert_in_progress(make_rb: Callable[..., ReplayBuffer]) -> None:
    """Interrupted after END was stored and before INSERTED, the record said "in progress" for ever: every lapping
    insert waited out its timeout for a write that would never come."""
    n = 8
    rb = make_rb(n)
    rb.insert(rows_of(code(0, np.arange(n))))
    victim = ReplayBuffer.attach(rb.name, timeout=0.3)
    victim.insert(rows_of(code(1, np.arange(1))))  # its writer slot, claimed: the victim stays alive and holds it
    words = victim._w
    victim._writers._w = _StoreBoom(words)  # type: ignore[assignment]  # a stand-in whose store raises, to interrupt the insert there
    with pytest.raises(KeyboardInterrupt):
        victim.insert(rows_of(code(1, np.arange(1, 5))))
    victim._writers._w = words
    assert rb.inserted == 9
    assert all(a >= b for a, b in zip(rb._writers._firsts, rb._writers._ends))  # no record reads "in progress"
    other = ReplayBuffer.attach(rb.name, timeout=0.3)
    assert other.insert(rows_of(code(2, np.arange(12)))) == 9  # laps the victim's reserved-looking rows: no wait
    assert victim.insert(rows_of(code(1, np.arange(5, 7)))) == 21
    rows, complete = rb.snapshot()
    assert complete.all() and decode(rows)[1].all()
    other.close()
    victim.close()


def test_a_reservation_held_for_ever_times_out(make_rb: Callable[..., ReplayBuffer]) -> None:
    """A stopped holder of the reservation lock (SIGSTOP; here a descriptor that never lets go) stalled inserts
    past timeout (F_OFD_SETLKW has none): now SlotTimeout, nothing reserved."""
    rb = make_rb(8, timeout=0.3)
    rb.insert(rows_of(code(0, np.arange(2))))
    holder = os.open(f"/dev/shm/{rb.name[1:]}", os.O_RDWR)
    out: list[Any] = []

    def insert() -> None:
        try:
            out.append(rb.insert(rows_of(code(0, np.arange(2, 4)))))
        except Exception as exc:  # noqa: BLE001  # whatever the insert raised is checked by the test
            out.append(exc)

    t = threading.Thread(target=insert)
    try:
        lock = _ofd.packed(fcntl.F_WRLCK, writers_mod.LOCK_BASE)
        fcntl.fcntl(holder, _ofd.SETLK, lock)
        t.start()
        wait_until(lambda: bool(out), 10, "the insert to give up on the reservation lock")
    finally:
        os.close(holder)  # drops the lock: an old-style blocked insert goes on
        if t.ident is not None:
            t.join(30)
    assert isinstance(out[0], _errors.SlotTimeout) and "reservation lock" in str(out[0]), out
    assert rb.inserted == 2 and all(a >= b for a, b in zip(rb._writers._firsts, rb._writers._ends))
    assert rb.insert(rows_of(code(0, np.arange(2, 4)))) == 2


def test_a_lock_call_failing_otherwise_than_busy_is_raised(make_rb: Callable[..., ReplayBuffer],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Any failure of a writer slot's lock call (ENOLCK, EINVAL, ...) was read as "held by a live instance": the insert
    waited out its timeout and blamed max_writers. Now the kernel's error is raised at once, naming the buffer, and so
    is the reservation lock's (which was raised bare)."""
    rb = make_rb(8, timeout=0.5)

    def no_locks(*args: Any) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(writers_mod, "lock", no_locks)
    with pytest.raises(OSError, match=f"replay buffer {rb.name}: taking writer slot 0's lock failed") as got:
        rb.insert(rows_of(code(0, np.arange(2))))
    assert got.value.errno == errno.ENOLCK and not isinstance(got.value, _errors.SlotTimeout)
    monkeypatch.undo()
    real_apply = writers_mod.apply

    def no_reservation(fd: int, flock: bytes) -> None:
        if flock == writers_mod._RESERVE:
            no_locks()
        real_apply(fd, flock)

    monkeypatch.setattr(writers_mod, "apply", no_reservation)
    with pytest.raises(OSError, match=f"replay buffer {rb.name}: taking the reservation lock failed") as got:
        rb.insert(rows_of(code(0, np.arange(2))))
    assert got.value.errno == errno.ENOLCK
    monkeypatch.undo()
    assert rb.inserted == 0 and all(a >= b for a, b in zip(rb._writers._firsts, rb._writers._ends))
    assert rb.insert(rows_of(code(0, np.arange(2)))) == 0


def test_a_writer_whose_liveness_the_kernel_cannot_tell_is_not_waited_for(
        make_rb: Callable[..., ReplayBuffer], kids: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed F_OFD_GETLK made writer_held answer True: an insert lapping that writer waited out its timeout (and would
    wait for ever with timeout=None). Now it is an OSError naming the buffer."""
    n = 8
    rb = make_rb(n, timeout=0.5)
    rb.insert(rows_of(code(0, np.arange(n))))
    slow, go = _paused_over(rb, kids, 1, 4)  # alive, mid-row on rows 0..3
    try:
        monkeypatch.setattr(layout_mod, "held", lambda fd, byte: None)
        with pytest.raises(OSError, match=f"replay buffer {rb.name}: the kernel could not say whether writer slot"):
            rb.insert(rows_of(code(2, np.arange(n))))  # global 12..19: laps the slow writer's rows
        monkeypatch.undo()
    finally:
        go.set()
    slow.join(10)
    assert slow.exitcode == 0 and all(a >= b for a, b in zip(rb._writers._firsts, rb._writers._ends))


# ------------------------------------------------------------------ bad input


def test_bad_settings_and_rows_are_named(make_rb: Callable[..., ReplayBuffer]) -> None:
    for kw, what in [({"buffer_size": 0}, "buffer_size"), ({"buffer_size": True}, "buffer_size"),
                     ({"buffer_size": 4, "max_writers": 0}, "max_writers"), ({"buffer_size": 4, "timeout": -1}, "timeout"),
                     ({"buffer_size": 4, "timeout": float("nan")}, "timeout"), ({"buffer_size": 4, "timeout": True}, "timeout"),
                     ({"buffer_size": 4, "timeout": "10"}, "timeout")]:
        with pytest.raises(_errors.UsageError, match=what):
            ReplayBuffer.create(example_row(), **kw)
    for timeout, kept in [(None, None), (float("inf"), None), (0, 0.0), (2, 2.0)]:  # timeout_setting's one rule
        with ReplayBuffer.create(example_row(), 4, timeout=timeout) as rb:
            assert rb.timeout == kept
    with pytest.raises(_errors.SchemaError, match="obs: expected a numpy array"):
        ReplayBuffer.create({"obs": 1.0}, 4)
    with pytest.raises(_errors.SchemaError, match="no array leaves"):
        ReplayBuffer.create({}, 4)
    rb = make_rb(4)
    good = rows_of(code(0, np.arange(2)))
    bad_shape = dict(good, obs=np.zeros((2, 5), np.float32))
    with pytest.raises(_errors.SchemaError, match=r"leaf obs: expected shape \(n, 6\).*got \(2, 5\)"):
        rb.insert(bad_shape)
    with pytest.raises(_errors.SchemaError, match=r"leaf act: expected shape \(n,\)"):
        rb.insert(dict(good, act=np.int64(3)))
    with pytest.raises(_errors.SchemaError, match="leaf extra/1: expected dtype int32.*got float64"):
        rb.insert(dict(good, extra=(good["extra"][0], np.zeros(2))))
    with pytest.raises(_errors.SchemaError, match="missing frame"):
        rb.insert({k: v for k, v in good.items() if k != "frame"})
    with pytest.raises(_errors.SchemaError, match="unexpected bonus"):
        rb.insert(dict(good, bonus=np.zeros(2)))
    with pytest.raises(_errors.SchemaError, match="leaf obs: batch dim 3, but leaf act has 2"):
        rb.insert(dict(good, obs=np.zeros((3, 6), np.float32)))
    assert rb.inserted == 0  # nothing refused was written
    with pytest.raises(_errors.UsageError, match="empty"):
        rb.sample(4)
    with pytest.raises(_errors.UsageError, match="empty"):
        next(rb.feed_forward_generator(1, 4))
    with pytest.raises(_errors.UsageError, match="mini_batch_size"):
        rb.feed_forward_generator(2, 0)
    with pytest.raises(_errors.UsageError, match="batch_size"):
        rb.sample(0)
    assert rb.insert(dict(good, obs=good["obs"].astype(np.float64))) == 0  # same_kind casts are fine


def test_timeout_none_waits_for_ever_and_an_ordinary_insert_and_sample_work(make_rb: Callable[..., ReplayBuffer]) -> None:
    """One timeout rule (shmbuf._validate.timeout_setting): None or infinity waits for ever, seconds >= 0 bound."""
    rb = make_rb(8, timeout=None)
    assert rb.timeout is None
    assert rb.insert(rows_of(code(0, np.arange(5)))) == 0
    codes, ok = decode(rb.sample(32))
    assert ok.all() and set(codes.tolist()) == set(code(0, np.arange(5)).tolist())
    other = pickle.loads(pickle.dumps(rb))  # attaches, keeping timeout=None
    try:
        assert other.timeout is None and other.insert(rows_of(code(1, np.arange(4)))) == 5
        assert decode(other.sample(16))[1].all()
    finally:
        other.close()
    with ReplayBuffer.attach(rb.name, timeout=0) as b:  # 0 only looks: nothing here has to wait
        assert b.insert(rows_of(code(2, np.arange(1)))) == 9 and decode(b.sample(4))[1].all()


def test_attach_refuses_what_is_not_a_replay_buffer(make_rb: Callable[..., ReplayBuffer]) -> None:
    with pytest.raises(_errors.UsageError, match="16 lowercase hex"):
        ReplayBuffer.attach("/not-ours")
    with pytest.raises(_errors.SegmentError, match="no pipeline named"):
        ReplayBuffer.attach("/shmbuf-" + "0" * 16)
    reader = shmbuf.create({"step": {"x": np.zeros((4, 2), np.float32)}}, 2)
    try:
        with pytest.raises(_errors.SegmentError, match="not a shmbuf replay buffer"):
            ReplayBuffer.attach(reader.name)
        assert not is_replay(reader.name)
    finally:
        reader.close()
    rb = make_rb(4)
    import mmap

    fd = os.open(f"/dev/shm/{rb.name[1:]}", os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
        mm[40:48] = (5).to_bytes(8, "little")  # buffer_size 4 -> 5: the sizes no longer add up
        mm.close()
    finally:
        os.close(fd)
    with pytest.raises(_errors.SegmentError, match=rb.name):
        ReplayBuffer.attach(rb.name)


@pytest.mark.alone  # judges every new entry of /dev/shm whose owner is dead: another test's killed process may leave one
def test_too_big_fails_at_create_and_leaves_nothing() -> None:
    before = {e for e in os.listdir("/dev/shm") if "shmbuf-" in e}
    with pytest.raises(_errors.NoSpace, match="replay buffer of"):
        ReplayBuffer.create({"frame": np.zeros((1 << 20,), np.uint8)}, 1 << 24)  # 16 TiB
    assert not leaked_since(before)


# -- the rsl_rl fork's constructor: ReplayBuffer(obs_dim, buffer_size, device) ---------------------------------------------

def test_002s_constructor_makes_the_in_process_ring_and_numpy_without_a_device() -> None:
    """An int first is the rsl_rl fork's ReplayBuffer (an in-process ring of state pairs); a name first stays the shared one."""
    from shmbuf.storage.lowlevel import LocalReplayBuffer

    rb = ReplayBuffer(2, 3, seed=0)
    assert isinstance(rb, LocalReplayBuffer) and rb.device is None and not isinstance(rb, ReplayBuffer)
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    rb.insert(rows, -rows)  # 4 rows into a ring of 3: the newest 3 survive, wrapped from where the 4th would go
    assert (rb.step, rb.num_samples, len(rb)) == (1, 3, 3)
    np.testing.assert_array_equal(rb.states, rows[[3, 1, 2]])
    drawn = list(rb.feed_forward_generator(4, 5))
    assert len(drawn) == 4
    for states, next_states in drawn:
        assert states.shape == (5, 2) and states.dtype == np.float32
        np.testing.assert_array_equal(next_states, -states)
    rb.insert(np.ones((1, 2)), np.ones((1, 2)))  # overwrites the oldest (row 1, at index 1)
    np.testing.assert_array_equal(rb.states[:, 0], [6, 1, 4])
    with pytest.raises(shmbuf.UsageError, match=r"ReplayBuffer\(buffer_size=\.\.\.\): expected an int >= 1"):
        ReplayBuffer(2, 0)
