"""Soaks: writers killed and restarted under load; many back-to-back small transfers with no hang.

The full versions are marked slow (`make test-slow`, or the commands in docs/reliability.md);
`make test` runs short ones of the same code.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import shmbuf
from tests.conftest import small_example
from tests.helpers import CTX, Ledger, rss_kib, slot_accounting, start_writer

pytestmark = pytest.mark.timeout(1800)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(make_reader: Any, cycles: int, seed: int = 0) -> dict[str, Any]:
    from tests.helpers import fault_example

    reader = make_reader(fault_example(), slots=8, max_writers=4)
    ledger = Ledger(reader)
    rng = np.random.default_rng(seed)
    live: dict[int, tuple[Any, Any]] = {}
    dead: dict[int, Any] = {}
    next_tag = 0
    try:
        for _ in range(3):
            live[next_tag] = start_writer(reader.name, next_tag)
            next_tag += 1
        ledger.take(300, timeout=30)  # warm up: every slot's views built, arenas settled
        fds0, rss0 = _fds(), rss_kib(os.getpid())
        for _ in range(cycles):
            ledger.take(int(rng.integers(5, 60)), timeout=30)
            tag = int(rng.choice(list(live)))
            p, committed = live.pop(tag)
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            dead[tag] = committed
            live[next_tag] = start_writer(reader.name, next_tag)
            next_tag += 1
        for tag, (p, committed) in list(live.items()):
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            dead[tag] = committed
        deadline = time.monotonic() + 30  # a hang's deadline (a reclaim takes well under 1 s: test_faults times it)
        while reader.stats()["writers"]:
            assert time.monotonic() < deadline, "dead writers' lanes not reclaimed within 30 s"
            try:
                ledger.take(1, timeout=0.05)
            except shmbuf.SlotTimeout:
                pass
        ledger.take_ready()
        committed_total = delivered = 0
        for tag, committed in dead.items():
            delivered += ledger.check_exactly_once(tag, committed.value)
            committed_total += committed.value + 1
        s = reader.stats()
        slot_accounting(reader)
        assert s["slots"]["pool"] == reader.slots, f"slots leaked: {s['slots']}"
        fds1, rss1 = _fds(), rss_kib(os.getpid())
        assert fds1 == fds0, f"file descriptors: {fds0} before, {fds1} after"
        assert rss1 - rss0 < 16 * 1024, f"reader RSS grew from {rss0} to {rss1} KiB"
        # a writer killed before it took a lane leaves nothing to reclaim; one that committed always does
        had_lane = sum(c.value >= 0 for c in dead.values())
        assert had_lane <= s["lanes_reclaimed"] <= len(dead)
        return {"cycles": cycles, "kills": len(dead), "had_committed": had_lane, "delivered": delivered,
                "committed_seen": committed_total, "partial_dropped": s["partial_dropped"],
                "lanes_reclaimed": s["lanes_reclaimed"], "rss_kib": (rss0, rss1)}
    finally:
        for p, _ in live.values():
            if p.is_alive():
                p.kill()
            p.join(5)


def test_soak_short(make_reader: Any) -> None:
    out = soak(make_reader, cycles=25)
    assert out["kills"] == 28 and out["had_committed"] >= 7  # most victims die mid-stream, some before a lane
    assert out["partial_dropped"] <= out["lanes_reclaimed"]


@pytest.mark.slow
def test_soak_200_kills(make_reader: Any) -> None:
    out = soak(make_reader, cycles=int(os.environ.get("SHMBUF_SOAK_CYCLES", "200")), seed=1)
    print("soak:", out)
    assert out["kills"] == out["cycles"] + 3


def _two_writers_once(n: int) -> None:
    from tests.helpers import exactly_once_writer  # the exactly-once writer, small payload

    reader = shmbuf.create(small_example(8), slots=4, max_writers=2)
    procs = []
    try:
        for tag in range(2):
            rx, tx = CTX.Pipe(duplex=False)
            p = CTX.Process(target=exactly_once_writer, args=(reader.name, tag, n, 8, tx), daemon=True)
            p.start()
            procs.append((p, rx))
        seen = {0: 0, 1: 0}
        for _ in range(2 * n):
            with reader.get(timeout=10) as r:  # a hang shows up here, as SlotTimeout, within 10 s
                tag = int(r.data["final"]["obs"][0])
                assert r.seq == seen[tag]
                seen[tag] += 1
        for p, rx in procs:
            assert rx.poll(10)
            rx.recv_bytes()
            p.join(10)
            assert p.exitcode == 0
    finally:
        reader.close()
        for p, _ in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def back_to_back(runs: int, n: int = 200) -> dict[str, Any]:
    hangs: list[str] = []
    t0 = time.monotonic()
    for i in range(runs):
        try:
            _two_writers_once(n)
        except shmbuf.SlotTimeout as exc:
            hangs.append(f"run {i}: {exc}")
    return {"runs": runs, "hangs": hangs, "seconds": time.monotonic() - t0}


def test_back_to_back_two_writer_transfers_short() -> None:
    out = back_to_back(30)
    assert out["hangs"] == []


@pytest.mark.slow
def test_back_to_back_two_writer_transfers_1000() -> None:
    out = back_to_back(int(os.environ.get("SHMBUF_RUNS", "1000")))
    print(f"back-to-back: {out['runs']} runs in {out['seconds']:.0f} s, hangs: {len(out['hangs'])}")
    assert out["hangs"] == []
