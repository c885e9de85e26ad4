"""Faults: killed and stopped writers, a killed or closing reader, a slow reader. Every wait has a deadline."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import msgpack
import numpy as np
import pytest

import shmbuf
from shmbuf import _admin
from shmbuf._lane import Record
from tests.conftest import shm_objects, wait_until
from tests.helpers import (
    CTX,
    FT,
    Ledger,
    commit_checked,
    fault_example,
    fill_step,
    rss_kib,
    slot_accounting,
    start_writer,
)

pytestmark = pytest.mark.timeout(120)


# A dead writer's slots are back at the reader's next look for dead writers, due SCAN_INTERVAL (50 ms) after its
# last one. Called with at least 10 ms between calls (time.sleep sleeps at least that long on the monotonic clock the
# reader reads), the reader is due a look by its 6th call after the death, however loaded the machine: 8 calls is a
# bound that cannot fail for a reader that looks every 50 ms, and that a reader looking every 1 s misses in about 9
# kills out of 10 (it would need up to 100 calls), unless the machine stalls for a whole second within 8 calls.
CALLS_TO_RECLAIM = 8


def reclaim_within_calls(reader: shmbuf.Reader, reclaimed_before: int) -> int:
    """Call the reader (``stats()``: it serves the writers and looks for dead ones when due, and takes nothing) at
    least 10 ms apart until it has reclaimed one more lane; return how many calls that took (at most
    CALLS_TO_RECLAIM, or the test fails)."""
    for calls in range(1, CALLS_TO_RECLAIM + 1):
        if reader.stats()["lanes_reclaimed"] > reclaimed_before:
            return calls
        time.sleep(0.01)
    raise AssertionError(f"the dead writer's lane was not reclaimed within {CALLS_TO_RECLAIM} reader calls at "
                         "least 10 ms apart: the reader does not look for dead writers every 50 ms while it is called")


def check_partial_counted(tag: int, delivered: int, committed: int, holding: int, dropped: int) -> bool:
    """What one death added to ``partial_dropped`` (``dropped``) is the rollout the writer had in hand, if any.

    ``holding`` (the writer's flag, frozen by its death): 1 from a rollout's first ``add`` to its ``commit``'s
    return. With 1, either the rollout was not published (the reader got ``committed + 1`` rollouts: its slot was
    in hand, 1 dropped) or its commit was (``committed + 2``: nothing in hand, 0 dropped). With 0 the writer was
    between rollouts, or inside the first ``add``, which may have claimed a slot: 0 or 1. Returns whether the
    count was known exactly (the writer died holding a slot).
    """
    if holding:
        want = 1 if delivered == committed + 1 else 0
        assert dropped == want, f"tag {tag}: died holding a slot (delivered {delivered}, committed {committed}), " \
                                f"partial_dropped grew by {dropped}, not {want}"
        return True
    assert dropped in (0, 1), f"tag {tag}: died between rollouts, partial_dropped grew by {dropped}"
    return False


def test_a_killed_writer_loses_only_its_partial_rollout(make_reader: Any, started: list) -> None:
    """SIGKILL at random points, again and again, beside a steady writer that must never notice. Each death loses
    only the rollout in the writer's hands, counted in partial_dropped, and the reader takes its lane back within
    CALLS_TO_RECLAIM calls (it looks for dead writers every 50 ms while it is called).

    Half the victims pause 2 ms after each step, as an env step would, and are killed once they hold a slot: mostly
    mid-rollout (between ``add``s, mid-``add`` or mid-``commit``). The others write as fast as they can, and are
    killed wherever they are: mostly waiting for a slot, as 6 slots among 3 writers leave them.
    """
    reader = make_reader(fault_example(), slots=6, max_writers=3)
    ledger = Ledger(reader)
    steady_holding = CTX.RawValue("q", 0)
    steady, steady_count = start_writer(reader.name, tag=1000, holding=steady_holding)
    started.append(steady)
    rng = np.random.default_rng(7)
    exact = 0  # deaths with a slot in hand: partial_dropped must grow by exactly what the ledger says

    def take_until(done: Any, what: str) -> None:
        deadline = time.monotonic() + 20
        while not done():  # keep reading: the reader lends the victim slots as they come back
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            try:
                ledger.take(1, timeout=0.05)
            except shmbuf.SlotTimeout:
                pass

    for victim_tag in range(12):
        paced = rng.random() < 0.5
        holding = CTX.RawValue("q", 0)
        p, committed = start_writer(reader.name, tag=victim_tag, holding=holding, pause=0.002 if paced else 0.0)
        started.append(p)
        take_until(lambda c=committed: c.value >= 0, "the victim's first commit")
        # run a while, consuming at a varying pace (a slow phase leaves the victim waiting for a slot)
        t_end = time.monotonic() + rng.uniform(0.0, 0.15)
        slow = rng.random() < 0.3
        while time.monotonic() < t_end:
            ledger.take(1)
            if slow:
                time.sleep(0.01)
        if paced:
            take_until(lambda h=holding: h.value == 1, "the victim to hold a slot")
        before = reader.stats()
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        assert p.exitcode == -signal.SIGKILL, f"victim {victim_tag} exited with {p.exitcode}"
        reclaim_within_calls(reader, before["lanes_reclaimed"])
        ledger.take_ready()
        delivered = ledger.check_exactly_once(victim_tag, committed.value)
        exact += check_partial_counted(victim_tag, delivered, committed.value, holding.value,
                                       reader.stats()["partial_dropped"] - before["partial_dropped"])
        slot_accounting(reader)
    assert reader.stats()["writers"] == 1  # only the steady one is left; every victim's lane came back
    before = reader.stats()
    os.kill(steady.pid, signal.SIGKILL)
    steady.join(5)
    reclaim_within_calls(reader, before["lanes_reclaimed"])
    ledger.drain()
    delivered = ledger.check_exactly_once(1000, steady_count.value)
    exact += check_partial_counted(1000, delivered, steady_count.value, steady_holding.value,
                                   reader.stats()["partial_dropped"] - before["partial_dropped"])
    slot_accounting(reader)
    s = reader.stats()
    assert s["writers"] == 0 and s["slots"]["pool"] == reader.slots  # every slot back
    assert s["lanes_reclaimed"] == 13, f"13 deaths, {s['lanes_reclaimed']} reclaims counted"
    assert exact > 0, "no victim died holding a slot: the partial rollout's count was never checked"


def test_a_lane_freed_by_a_death_is_taken_by_a_new_writer(make_reader: Any, started: list) -> None:
    reader = make_reader(fault_example(), slots=2, max_writers=1)  # one lane only
    ledger = Ledger(reader)
    p, committed = start_writer(reader.name, tag=1)
    started.append(p)
    ledger.take(5)
    os.kill(p.pid, signal.SIGKILL)
    p.join(5)
    q, committed2 = start_writer(reader.name, tag=2, rollouts=50, timeout=5)
    started.append(q)
    ledger.drain(quiet=0.3)  # serves the reclaim and the new writer
    ledger.take(50 - len(ledger.seqs[2]), timeout=10)
    q.join(5)
    assert q.exitcode == 0
    assert ledger.seqs[2] == list(range(50))


def _commit_then_stop(name: str, tag: int, k: int, go: Any, state: Any, end: str) -> None:
    """Wait for ``go``, commit ``k`` rollouts (fault-test layout) and start one more; then hang, or close."""
    step = {key: np.zeros(v.shape[1:], v.dtype) for key, v in fault_example()["step"].items()}
    buf = {key: np.zeros((FT, *v.shape), v.dtype) for key, v in step.items()}
    with shmbuf.Writer(name, timeout=10, label=f"tag{tag}") as w:
        state.value = 1  # attached
        if not go.wait(30):
            os._exit(4)
        for seq in range(k):
            commit_checked(w, step, buf, tag, seq, 1 + seq % FT)
        fill_step(step, tag, k, 0)
        w.add("step", step)  # a partial rollout: the slot in the writer's hands
        state.value = 2  # k committed, one partial in hand
        if end == "killed":
            time.sleep(60)  # killed long before
    os._exit(0)  # "closed": the with block retired the lane, the partial rollout dropped with it


@pytest.mark.parametrize("end", ["killed", "closed"])
def test_rollouts_committed_before_the_writer_went_are_delivered_at_reclaim(make_reader: Any, started: list,
                                                                            end: str) -> None:
    """The reader has taken in none of a writer's commits when the writer dies (or leaves): the reclaim delivers
    every one of them, intact and in order, and drops only the rollout the writer had in hand.

    The reader calls nothing (no get, poll or stats) between lending the slots and the writer's end, so
    every commit is still in the lane's ready ring when the reclaim finds the lane dead or retired.
    """
    k = 3
    reader = make_reader(fault_example(), slots=8, max_writers=2)
    go, state = CTX.Event(), CTX.RawValue("q", 0)
    p = CTX.Process(target=_commit_then_stop, args=(reader.name, 7, k, go, state, end), daemon=True)
    p.start()
    started.append(p)
    wait_until(lambda: state.value == 1, 20, "the writer to attach")
    # Lend the writer its slots: enough for k rollouts and the partial one, without the reader's help.
    wait_until(lambda: reader.poll() == 0 and reader.stats()["slots"]["lent"] >= k + 1, 10, "the slots to be lent")
    go.set()
    wait_until(lambda: state.value == 2 or not p.is_alive(), 20, "the writer's commits")  # no reader call meanwhile
    assert state.value == 2, f"the writer exited with {p.exitcode} before committing"
    if end == "killed":
        os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == (-signal.SIGKILL if end == "killed" else 0)
    # poll() looks at the lane table before it takes in any commit: it finds the lane gone and reclaims it,
    # so what is ready now came through the reclaim, not through a live lane's ring.
    assert reader.poll() == k, "the reclaim did not deliver the rollouts the writer had committed"
    assert reader.stats()["writers"] == 0
    ledger = Ledger(reader)
    ledger.take(k, timeout=5)
    assert ledger.seqs == {7: list(range(k))}
    s = reader.stats()
    assert s["writers"] == 0 and s["slots"] == {"pool": reader.slots, "lent": 0, "ready": 0, "held": 0}, s
    assert s["lanes_reclaimed"] == (1 if end == "killed" else 0), s
    assert s["partial_dropped"] == (1 if end == "killed" else 0), s  # the partial rollout, counted once
    with pytest.raises(shmbuf.SlotTimeout):
        reader.get(timeout=0.2)  # nothing else: no rollout twice


def test_a_stopped_writer_blocks_no_one(make_reader: Any, started: list) -> None:
    reader = make_reader(fault_example(), slots=6, max_writers=2)
    ledger = Ledger(reader)
    a, _ = start_writer(reader.name, tag=1)
    b, _ = start_writer(reader.name, tag=2)
    started.extend([a, b])
    ledger.take(50)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        before = len(ledger.seqs[2])
        ledger.take(300, timeout=10)  # the reader and the other writer go on
        assert len(ledger.seqs[2]) >= before + 290
    finally:
        os.kill(a.pid, signal.SIGCONT)


def _reader_process(conn: Any) -> None:
    # keep_on_crash: what the SIGKILLed reader leaves stays for the test's `shmbuf clean` (else its watcher removes it)
    reader = shmbuf.create(fault_example(), slots=2, max_writers=2, keep_on_crash=True)
    conn.send_bytes(msgpack.packb(reader.name))
    time.sleep(60)  # killed long before


def test_a_killed_reader_fails_writers_within_2s_and_clean_removes_its_leftovers() -> None:
    rx, tx = CTX.Pipe(duplex=False)
    rp = CTX.Process(target=_reader_process, args=(tx,), daemon=True)
    rp.start()
    try:
        assert rx.poll(20)
        name = msgpack.unpackb(rx.recv_bytes())
        writer = shmbuf.Writer(name, timeout=None)  # waits for ever, unless the reader dies
        step = {"obs": np.zeros(4, np.float32), "action": np.int64(0), "reward": np.float32(0), "done": False}
        os.kill(rp.pid, signal.SIGKILL)
        rp.join(5)
        t0 = time.monotonic()
        with pytest.raises(shmbuf.BrokenPipeline, match=rf"{name}: the reader's process \(pid {rp.pid}\) died"):
            writer.add("step", step)  # no slot was ever lent: this blocks until the death is seen
        assert time.monotonic() - t0 < 2.0
        writer.close()
        found = {f.name: f for f in _admin.scan()}
        assert name in found and found[name].removable and not found[name].owner_alive
        for f in _admin.scan():
            if f.name == name:
                _admin.remove(f)
        assert not [e for e in shm_objects() if name[1:] in e]
    finally:
        if rp.is_alive():
            rp.kill()
        rp.join(5)
        shmbuf._segment.unlink_all(name, 2) if "name" in locals() else None


def _writer_asleep_for_a_slot(name: str, state: Any) -> None:
    """Attach with timeout=None and add: no slot is ever lent, so only the reader's death can end the wait."""
    step = {"obs": np.zeros(4, np.float32), "action": np.int64(0), "reward": np.float32(0), "done": False}
    try:
        w = shmbuf.Writer(name, timeout=None)
        state.value = 1
        w.add("step", step)
    except shmbuf.BrokenPipeline as exc:
        os._exit(5 if "the reader's process" in str(exc) and "died" in str(exc) else 6)
    except BaseException:  # noqa: BLE001  # any other ending is this child's answer to the test: exit code 7
        os._exit(7)
    os._exit(8)


def test_a_writer_already_asleep_for_a_slot_when_the_reader_dies_raises_broken_pipeline() -> None:
    """The other half of the row above: there the reader is dead before the writer's call, so the call's first
    look raises; here the writer is asleep in the semaphore wait when the reader is killed, and only the look
    between two wait slices can wake it."""
    rx, tx = CTX.Pipe(duplex=False)
    rp = CTX.Process(target=_reader_process, args=(tx,), daemon=True)
    rp.start()
    wp = None
    seg = None
    name = None
    try:
        assert rx.poll(20)
        name = msgpack.unpackb(rx.recv_bytes())
        state = CTX.RawValue("q", 0)
        wp = CTX.Process(target=_writer_asleep_for_a_slot, args=(name, state), daemon=True)
        wp.start()
        seg = shmbuf._segment.Segment.attach(name, readonly=True)
        records = [Record(seg.plan, i) for i in range(seg.plan.n_lanes)]
        # the writer's FREE_WAIT word: set while it sleeps for want of a slot
        wait_until(lambda: state.value == 1 and any(seg.words[r.free_wait] for r in records), 20, "the writer to sleep")
        os.kill(rp.pid, signal.SIGKILL)
        rp.join(5)
        wp.join(10)  # a liveness deadline: the writer looks every 0.25 s
        assert wp.exitcode == 5, f"the waiting writer did not raise BrokenPipeline naming the dead reader: exit {wp.exitcode}"
    finally:
        for p in (rp, wp):
            if p is not None and p.is_alive():
                p.kill()
            if p is not None:
                p.join(5)
        if seg is not None:
            seg.close()
        if name is not None:
            shmbuf._segment.unlink_all(name, 2)


def test_closing_the_reader_mid_rollout_stops_every_writer(make_reader: Any, started: list) -> None:
    reader = make_reader(fault_example(), slots=4, max_writers=3)
    ledger = Ledger(reader)
    writers = [start_writer(reader.name, tag=k)[0] for k in range(3)]
    started.extend(writers)
    ledger.take(60)
    deadline = time.monotonic() + 20
    while len(ledger.seqs) < 3:  # every writer attached and committing, so the close meets each one mid-run
        assert time.monotonic() < deadline, f"only writers {sorted(ledger.seqs)} delivered within 20 s"
        ledger.take(1)
    name = reader.name
    reader.close()
    for p in writers:
        p.join(5)
        assert p.exitcode == 3, f"writer exited with {p.exitcode}, not by the reader's close"  # see loop_writer
    assert not [e for e in shm_objects() if name[1:] in e]  # unlinked, once, by the owner
    reader.close()  # a second close is a no-op


def test_a_slow_reader_makes_writers_wait_and_loses_nothing(make_reader: Any, started: list) -> None:
    reader = make_reader(fault_example(), slots=3, max_writers=2)
    ledger = Ledger(reader)
    procs = [start_writer(reader.name, tag=k, rollouts=150, timeout=30) for k in range(2)]
    started.extend(p for p, _ in procs)
    # Each writer's private memory (RssAnon: a forked writer's VmRSS also counts pages it never allocated, its parent's
    # library pages faulted in after the fork; under the parallel suite one writer's rose 18 MB between the samples, to
    # the other writer's exact figure), when the reader has its 16th rollout and its 141st: with 3 slots the writer
    # is then at most 3 rollouts ahead of the reader, so still alive (a sample of an exited writer read 0 and passed).
    marks = {16: 0, 141: 1}
    rss = {tag: [-1, -1] for tag in range(2)}
    for i in range(300):
        ledger.take(1)
        if i % 3 == 0:
            time.sleep(0.002)  # slower than the writers
        for tag, (p, _) in enumerate(procs):
            at = marks.get(len(ledger.seqs[tag]))
            if at is not None and rss[tag][at] < 0:
                rss[tag][at] = rss_kib(p.pid, "RssAnon")
    for p, _ in procs:
        p.join(10)
        assert p.exitcode == 0
    assert ledger.seqs[0] == list(range(150)) and ledger.seqs[1] == list(range(150))
    assert all(before > 0 and after > 0 for before, after in rss.values()), f"a writer was not measured alive: {rss}"
    assert all(after - before < 2048 for before, after in rss.values()), f"writer memory grew: {rss}"  # KiB


def test_another_user_cannot_attach(make_reader: Any) -> None:
    """A process of another uid (nobody) is refused, by the kernel (0600) and by name. A second uid takes root, so
    without root this one skips; test_hostile.py's user-namespace and why_untrusted tests hold the refusal for any
    user, and CI runs as root."""
    if os.geteuid() != 0:
        pytest.skip("dropping to another uid needs root; without root, test_hostile.py::"
                    "test_a_file_of_another_uid_is_refused_seen_from_a_user_namespace and the 0600 modes in test_segment hold it")
    reader = make_reader(fault_example(), slots=1)
    rx, tx = CTX.Pipe(duplex=False)

    def intruder() -> None:
        os.setgid(65534)
        os.setuid(65534)  # nobody
        try:
            shmbuf.Writer(reader.name)
            tx.send_bytes(b"attached")
        except shmbuf.SegmentError as exc:
            tx.send_bytes(str(exc).encode())
        os._exit(0)

    p = CTX.Process(target=intruder, daemon=True)
    p.start()
    p.join(10)
    assert rx.poll(1)
    assert "not by this user" in rx.recv_bytes().decode()
