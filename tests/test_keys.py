"""Rollout keys: ``(lane, epoch, seq)`` names one rollout for a pipeline's whole life, across writers that replace
others on a lane (a killed actor's replacement counts ``seq`` from 0 again). Every wait has a deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

import shmbuf
from tests.conftest import small_example
from tests.helpers import fault_example, loop_writer, verify

CTX = mp.get_context("fork")
pytestmark = pytest.mark.timeout(120)


def start_writer(procs: list[Any], name: str, tag: int, rollouts: int = -1) -> Any:
    committed = CTX.RawValue("q", -1)
    p = CTX.Process(target=loop_writer, args=(name, tag, committed, rollouts, 5.0), daemon=True)
    p.start()
    procs.append(p)
    return p


def take_all(reader: shmbuf.Reader, got: list[tuple[int, int, int, int]], want: int, timeout: float = 20.0) -> None:
    """Take rollouts until ``want`` of them are in ``got`` as (tag, lane, epoch, seq), checking each."""
    deadline = time.monotonic() + timeout
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {len(got)} of {want} rollouts within {timeout} s: {reader.stats()}"
        try:
            r = reader.get(timeout=0.2)
        except shmbuf.SlotTimeout:
            continue
        with r:
            tag, seq = verify(r)  # the rollout's own data says which writer wrote it, and its seq
            got.append((tag, r.lane, r.epoch, r.seq))


def test_a_writer_that_replaces_a_killed_one_on_its_lane_gets_a_new_epoch(make_reader: Any, started: list) -> None:
    reader = make_reader(fault_example(), slots=2, max_writers=1)  # one lane: the replacement must take it
    got: list[tuple[int, int, int, int]] = []
    first = start_writer(started, reader.name, tag=1)
    take_all(reader, got, 5)
    os.kill(first.pid, signal.SIGKILL)
    first.join(5)
    second = start_writer(started, reader.name, tag=2, rollouts=5)
    deadline = time.monotonic() + 30
    while sum(1 for g in got if g[0] == 2) < 5:  # whatever the first one committed before it died, then all 5
        assert time.monotonic() < deadline, f"the second writer's rollouts did not all arrive: {got}"
        take_all(reader, got, len(got) + 1)
    second.join(5)
    assert second.exitcode == 0
    assert {lane for _, lane, _, _ in got} == {0}
    # The case the key exists for: the second writer counted seq from 0 on the same lane.
    repeated = [k for k, c in Counter((lane, seq) for _, lane, _, seq in got).items() if c > 1]
    assert (0, 0) in repeated, f"(lane, seq) did not repeat: {got}"
    keys = Counter((lane, epoch, seq) for _, lane, epoch, seq in got)
    assert max(keys.values()) == 1, f"a (lane, epoch, seq) key named two rollouts: {keys.most_common(3)}"
    epochs = {tag: {epoch for t, _, epoch, _ in got if t == tag} for tag in (1, 2)}
    assert len(epochs[1]) == 1 and len(epochs[2]) == 1, epochs  # one claim each
    assert min(epochs[2]) > max(epochs[1]) >= 1, epochs
    assert sum(1 for g in got if g[0] == 1) >= 5


def test_each_claim_of_a_lane_has_its_own_epoch_in_rollouts_and_batches(make_reader: Any) -> None:
    """Three writers one after the other on one lane, two rollouts each: every (lane, epoch, seq) differs, and
    Batch.epoch (views and gathered) says what Rollout.epoch says."""
    reader = make_reader(small_example(), slots=8, max_writers=1)
    epochs = []
    for k in range(3):
        with shmbuf.Writer(reader.handle, timeout=5) as w:
            reader.poll()  # lend it slots
            epochs.append(w.epoch)
            for _ in range(2):
                w.add("step", {"obs": np.full(4, k, np.float32), "action": 0, "reward": 0.0, "done": False})
                w.commit()
        reader.poll()  # take the lane back before the next writer claims it
    assert epochs == sorted(set(epochs)) and epochs[0] >= 1, epochs
    b = reader.get_batch(4, timeout=5)
    rows = list(zip(b.lane.tolist(), b.epoch.tolist(), b.seq.tolist()))
    tags = b.data["step"]["obs"][:, 0, 0].tolist()
    b.release()
    b2 = reader.get_batch(2, timeout=5, copy=True)
    rows += list(zip(b2.lane.tolist(), b2.epoch.tolist(), b2.seq.tolist()))
    tags += b2.data["step"]["obs"][:, 0, 0].tolist()
    assert sorted(rows) == [(0, e, s) for e in epochs for s in (0, 1)], rows
    assert [epochs[int(t)] for t in tags] == [e for _, e, _ in rows], "an epoch that is not its writer's"
    with shmbuf.Writer(reader.handle, timeout=5) as w:
        reader.poll()
        w.add("step", {"obs": np.zeros(4, np.float32), "action": 0, "reward": 0.0, "done": False})
        assert w.commit() == 0
        with reader.get(timeout=5) as r:
            assert (r.lane, r.epoch, r.seq) == (0, w.epoch, 0) and w.epoch > epochs[-1]
            assert f"epoch={w.epoch}" in repr(r)
