"""shmbuf.lowlevel.InferenceTable / InferenceClient: the request path between env workers and one inference server."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmbuf
import shmbuf.lowlevel
from shmbuf import _admin
from shmbuf._inference import CLOSED_WORD

REQ = {"obs": np.zeros((2, 3), np.float64), "mask": np.zeros((2,), np.int32)}
RESP = {"action": np.zeros((2,), np.int64), "extras": {"echo": np.zeros((2, 3), np.float64)}}


@pytest.fixture
def table() -> Any:
    t = shmbuf.lowlevel.InferenceTable(REQ, RESP, 4)
    yield t
    t.close()


def answer(t: shmbuf.lowlevel.InferenceTable, idx: np.ndarray, version: int = 0) -> int:
    """The test server's rule: action = 10 * obs[..., 0] + mask; echo = obs."""
    req = t.requests(idx)
    action = (10 * req["obs"][..., 0]).astype(np.int64) + req["mask"]
    return t.respond(idx, [action, req["obs"].copy()], version)


def serve(t: shmbuf.lowlevel.InferenceTable, stop: threading.Event, sizes: list[int], **take: Any) -> None:
    rotate = 0
    while not stop.is_set():
        try:
            idx, _ = t.take(take.get("max_count", 64), min_count=take.get("min_count", 1), linger=take.get("linger", 0.0),
                            idle=0.05, rotate=rotate)
        except shmbuf.PipelineClosed:
            return
        if len(idx):
            sizes.append(len(idx))
            rotate = int(idx[-1]) + 1
            answer(t, idx)


def client_main(name: str, index: int, n: int) -> None:
    c = shmbuf.lowlevel.InferenceClient(name, index, timeout=20)
    try:
        for k in range(n):
            c.request["obs"][:] = [[index, k, 0.5], [index + 100, k, 0.25]]
            c.request["mask"][:] = [k % 3, 1]
            c.call()
            want = np.array([10 * index + k % 3, 10 * (index + 100) + 1])
            if not np.array_equal(c.response["action"], want) or not np.array_equal(c.response["extras"]["echo"],
                                                                                       c.request["obs"]):
                raise SystemExit(f"client {index} step {k}: got {c.response['action']}, expected {want}")
    finally:
        c.close()


def test_clients_in_processes_get_exactly_their_own_answers(table: shmbuf.lowlevel.InferenceTable) -> None:
    stop = threading.Event()
    sizes: list[int] = []
    server = threading.Thread(target=serve, args=(table, stop, sizes), daemon=True)
    server.start()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=client_main, args=(table.name, i, 400)) for i in range(4)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    finally:
        stop.set()
        server.join(5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert sum(sizes) == 1600 and max(sizes) <= 4
    assert table.client_pids() == [p.pid for p in procs]


def test_consecutive_clients_are_one_view_others_are_gathered(table: shmbuf.lowlevel.InferenceTable) -> None:
    clients = [shmbuf.lowlevel.InferenceClient(table.name, i) for i in range(4)]
    try:
        for i, c in enumerate(clients):
            c.request["obs"][:] = i
        rows = table.request_rows[table.schema.timescales[0].leaves.index(
            next(lf for lf in table.schema.timescales[0].leaves if lf.path[-1] == "obs"))]
        view = table.requests(np.array([1, 2, 3]))
        assert np.shares_memory(view["obs"], rows) and view["obs"][:, 0, 0].tolist() == [1, 2, 3]
        gathered = table.requests(np.array([0, 3]))
        assert not np.shares_memory(gathered["obs"], rows) and gathered["obs"][:, 0, 0].tolist() == [0, 3]
    finally:
        for c in clients:
            c.close()


def _call_in_thread(c: shmbuf.lowlevel.InferenceClient, errors: list[BaseException]) -> threading.Thread:
    """Start ``c.call()`` in a thread (it blocks until answered); its exception goes to ``errors``."""

    def call() -> None:
        try:
            c.call()
        except BaseException as exc:  # noqa: BLE001  # reported to the test's thread
            errors.append(exc)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    return th


def _send(c: shmbuf.lowlevel.InferenceClient, value: float, errors: list[BaseException] | None = None) -> threading.Thread:
    """Make a request of ``value`` from a thread (see :func:`_call_in_thread`)."""
    c.request["obs"][:] = value
    c.request["mask"][:] = 0
    return _call_in_thread(c, [] if errors is None else errors)


def _wait_pending(t: shmbuf.lowlevel.InferenceTable, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(t.pending()) < n:
        assert time.monotonic() < deadline, f"{len(t.pending())} requests pending, expected {n}"
        time.sleep(0.001)


def test_take_waits_for_min_count_at_most_linger_and_never_takes_more_than_max(table: shmbuf.lowlevel.InferenceTable) -> None:
    clients = [shmbuf.lowlevel.InferenceClient(table.name, i) for i in range(4)]
    try:
        th = [_send(clients[0], 1.0)]
        t0 = time.monotonic()
        idx, lingered = table.take(4, min_count=3, linger=0.2)
        waited = time.monotonic() - t0
        assert idx.tolist() == [0] and lingered and waited >= 0.19
        answer(table, idx)
        th[0].join(10)
        assert not th[0].is_alive()

        th = [_send(c, 2.0) for c in clients]
        _wait_pending(table, 4)
        idx, lingered = table.take(3, min_count=2, rotate=2)  # from client 2 on, wrapping: 2, 3, 0
        assert idx.tolist() == [0, 2, 3] and not lingered
        answer(table, idx)
        idx, _ = table.take(3)
        assert idx.tolist() == [1]
        answer(table, idx)
        for x in th:
            x.join(10)
            assert not x.is_alive()
        assert [int(c.response["action"][0]) for c in clients] == [20, 20, 20, 20]

        t0 = time.monotonic()
        idx, lingered = table.take(4, idle=0.1)  # nothing pending: sleeps on the doorbell, no polling
        assert len(idx) == 0 and not lingered and 0.09 <= time.monotonic() - t0 < 5
    finally:
        for c in clients:
            c.close()


def test_a_sleeping_server_is_woken_by_a_request(table: shmbuf.lowlevel.InferenceTable) -> None:
    c = shmbuf.lowlevel.InferenceClient(table.name, 1)
    got: list[float] = []

    def server() -> None:
        t0 = time.monotonic()
        idx, _ = table.take(4, idle=30)
        got.append(time.monotonic() - t0)
        answer(table, idx)

    s = threading.Thread(target=server, daemon=True)
    s.start()
    try:
        time.sleep(0.2)  # let it fall asleep (a shorter wait only makes the test weaker)
        th = _send(c, 3.0)
        th.join(10)
        s.join(10)
        assert not th.is_alive() and got and got[0] < 10 and int(c.response["action"][0]) == 30
    finally:
        c.close()


def test_a_retired_clients_pending_request_is_dropped_and_its_successor_is_served(table: shmbuf.lowlevel.InferenceTable) -> None:
    old = shmbuf.lowlevel.InferenceClient(table.name, 2)
    old_errors: list[BaseException] = []
    th = _send(old, 5.0, old_errors)
    _wait_pending(table, 1)
    idx, _ = table.take(4)
    assert idx.tolist() == [2]
    table.retire(2)  # the worker died while the server held its request
    assert table.respond(idx, [np.zeros((1, 2), np.int64), np.zeros((1, 2, 3))], 0) == 0
    assert table.dropped == 1 and len(table.pending()) == 0
    old._sem.release()  # wake the old caller's thread; it must not take the answer it never got
    time.sleep(0.05)
    assert th.is_alive()
    new = shmbuf.lowlevel.InferenceClient(table.name, 2)
    try:
        th2 = _send(new, 7.0)
        _wait_pending(table, 1)
        idx, _ = table.take(4)
        answer(table, idx)
        th2.join(10)
        assert not th2.is_alive() and int(new.response["action"][0]) == 70
        # The old caller, still waiting (its process would be dead), finds its slot given away.
        th.join(10)
        assert not th.is_alive() and len(old_errors) == 1 and isinstance(old_errors[0], shmbuf.PipelineClosed)
        assert "given to another client" in str(old_errors[0])
    finally:
        new.close()
        old.close()


def test_close_wakes_a_waiting_client_with_pipeline_closed() -> None:
    t = shmbuf.lowlevel.InferenceTable(REQ, RESP, 2)
    c = shmbuf.lowlevel.InferenceClient(t.name, 0)
    err: list[BaseException] = []
    try:
        th = _call_in_thread(c, err)
        _wait_pending(t, 1)
        t0 = time.monotonic()
        t.close()
        th.join(5)
        assert not th.is_alive() and time.monotonic() - t0 < 2
        assert len(err) == 1 and isinstance(err[0], shmbuf.PipelineClosed)
    finally:
        t.close()
        c.close()
    assert not [f for f in _admin.scan() if f.name == t.name]


OWNER = """
import sys, time, numpy as np, shmbuf
t = shmbuf.lowlevel.InferenceTable({"x": np.zeros((1,), np.float32)}, {"a": np.zeros((1,), np.int64)}, 1,
                                   keep_on_crash=True)  # what the SIGKILL leaves is this test's `shmbuf clean`'s
print(t.name, flush=True)
time.sleep(60)
"""


def test_a_client_waiting_on_a_dead_owner_raises_broken_pipeline_within_2_s() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None  # stdout=PIPE
    name = None
    try:
        name = owner.stdout.readline().strip()
        c = shmbuf.lowlevel.InferenceClient(name, 0)
        err: list[BaseException] = []
        th = _call_in_thread(c, err)
        time.sleep(0.1)
        t0 = time.monotonic()
        owner.kill()
        owner.wait(10)
        th.join(5)
        assert not th.is_alive() and time.monotonic() - t0 < 2
        assert len(err) == 1 and isinstance(err[0], shmbuf.BrokenPipeline), err
        c.close()
        # The dead owner's table is `shmbuf clean`'s to remove, semaphores included.
        found = [f for f in _admin.scan() if f.name == name]
        assert len(found) == 1 and found[0].inference and found[0].removable and len(found[0].semaphores) == 2
        removed = _admin.remove(found[0])
        assert name[1:] in [r.lstrip("/") for r in removed] and not [f for f in _admin.scan() if f.name == name]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdout.close()
        if name:
            for f in _admin.scan(name=name):
                f.owner_alive = False
                _admin.remove(f)


def test_client_call_times_out_with_a_slot_timeout_naming_the_setting(table: shmbuf.lowlevel.InferenceTable) -> None:
    with shmbuf.lowlevel.InferenceClient(table.name, 0, timeout=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(shmbuf.SlotTimeout, match=r"timeout=0.2"):
            c.call()
        assert time.monotonic() - t0 < 5


def test_bad_input_is_refused_with_a_clear_error(table: shmbuf.lowlevel.InferenceTable) -> None:
    with pytest.raises(shmbuf.UsageError, match="clients"):
        shmbuf.lowlevel.InferenceTable(REQ, RESP, 0)
    with pytest.raises(shmbuf.UsageError, match="request example"):
        shmbuf.lowlevel.InferenceTable({"obs": [1, 2]}, RESP, 2)
    with pytest.raises(shmbuf.UsageError, match=r"index.*0 to 3"):
        shmbuf.lowlevel.InferenceClient(table.name, 4)
    with pytest.raises(shmbuf.UsageError, match="inference table name"):
        shmbuf.lowlevel.InferenceClient("/shmbuf-0123456789abcdef", 0)
    with pytest.raises(shmbuf.SegmentError, match="no .* named"):
        shmbuf.lowlevel.InferenceClient("/shmbuf-i0123456789abcdef", 0)
    c = shmbuf.lowlevel.InferenceClient(table.name, 1)
    try:
        th = _send(c, 1.0)
        _wait_pending(table, 1)
        idx, _ = table.take(4)
        with pytest.raises(shmbuf.SchemaError, match=r"action: expected 1 rows of shape \(2,\)"):
            table.respond(idx, [np.zeros((1, 5), np.int64), np.zeros((1, 2, 3))], 0)
        answer(table, idx)  # nothing was published by the failed answer; the right one goes through
        th.join(10)
        assert not th.is_alive() and int(c.response["action"][0]) == 10
    finally:
        c.close()


def test_the_object_is_owner_only_and_a_corrupt_header_is_refused(table: shmbuf.lowlevel.InferenceTable) -> None:
    path = f"/dev/shm/{table.name[1:]}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for s in (f"/dev/shm/sem.{table.name[1:]}-s", f"/dev/shm/sem.{table.name[1:]}-c0"):
        assert stat.S_IMODE(os.stat(s).st_mode) == 0o600
    with open(path, "r+b") as f:
        good = f.read(64)
        try:
            f.seek(40)
            f.write((10_000).to_bytes(4, "little"))  # the clients field
            f.flush()
            with pytest.raises(shmbuf.SegmentError):
                shmbuf.lowlevel.InferenceClient(table.name, 0)
        finally:
            f.seek(0)
            f.write(good)
    shmbuf.lowlevel.InferenceClient(table.name, 0).close()


def test_a_forked_child_cannot_unlink_its_parents_table(table: shmbuf.lowlevel.InferenceTable) -> None:
    pid = os.fork()
    if pid == 0:  # the child: closing its copy must leave the parent's table alone
        try:
            table.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(f"/dev/shm/{table.name[1:]}") and not table._w[CLOSED_WORD]
    shmbuf.lowlevel.InferenceClient(table.name, 0).close()


def _all_pending(t: shmbuf.lowlevel.InferenceTable) -> None:
    """Make every client's request pending without client processes (the request words alone)."""
    t._req[:] = (t._gen << 32) | ((t._resp & 0xFFFFFFFF) + 1)


def test_more_pending_than_max_count_serves_everyone_in_turn(table: shmbuf.lowlevel.InferenceTable) -> None:
    big = shmbuf.lowlevel.InferenceTable(REQ, RESP, 8)
    try:
        served = np.zeros(8, int)
        for _ in range(8):
            _all_pending(big)
            idx, _ = big.take(3, rotate=big.next_rotate)
            served[idx] += 1
            answer(big, idx)
        assert served.tolist() == [3] * 8  # a wrapped batch [0, 6, 7] once made client 0 the favourite
        with pytest.raises(shmbuf.UsageError, match="clients of the last take"):
            _all_pending(big)
            idx, _ = big.take(3)
            big.respond(idx[::-1].copy() + 1, [np.zeros((3, 2), np.int64), np.zeros((3, 2, 3))], 0)
    finally:
        big.close()


def test_waiting_for_min_count_sleeps_instead_of_spinning(table: shmbuf.lowlevel.InferenceTable) -> None:
    _all_pending(table)
    table._req[1:] = table._resp[1:]  # one request pending of the 3 asked for
    t0 = time.thread_time()
    w0 = time.monotonic()
    idx, lingered = table.take(4, min_count=3, linger=0.3)
    cpu, wall = time.thread_time() - t0, time.monotonic() - w0
    assert idx.tolist() == [0] and lingered and wall >= 0.29
    assert cpu < 0.1, f"take() used {cpu:.3f} s of CPU in a {wall:.3f} s linger: a spin, not a sleep"
    answer(table, idx)
