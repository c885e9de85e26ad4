"""Fixtures that release what they create even when a test fails, and a leak check that fails the suite."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import shmbuf

SHM_DIR = "/dev/shm"
T = 16
# Every process this run starts inherits this mark in its environment (a spawned child that imports this module keeps
# its parent's), watchers included: so the end check finds this run's watchers, not another run's on the machine.
RUN_MARK = "SHMBUF_TEST_RUN"
os.environ.setdefault(RUN_MARK, secrets.token_hex(8))


def shm_objects() -> set[str]:
    try:
        return {e for e in os.listdir(SHM_DIR) if "shmbuf-" in e}
    except OSError:
        return set()


def live_processes() -> list[tuple[int, int, int, bytes]]:
    """``(pid, ppid, process group, cmdline)`` of every live process (zombies and dead ones left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2 :].split()
        if rest[0] not in (b"Z", b"X"):
            out.append((int(entry), int(rest[1]), int(rest[2]), cmd))
    return out


def child_pids() -> list[int]:
    """Live children of this process, less multiprocessing's own helpers (forkserver, resource tracker)."""
    me = os.getpid()
    return [pid for pid, ppid, _, cmd in live_processes()
            if ppid == me and b"resource_tracker" not in cmd and b"forkserver" not in cmd]


def watchers() -> list[tuple[int, int]]:
    """``(watcher pid, owner pid)`` of every live shmbuf watcher (shmbuf/_janitor.py) that this run started.

    A watcher is nobody's child (its middle process exits at once), so :func:`child_pids` never counts one.
    """
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode()
    out = []
    for pid, _, _, cmd in live_processes():
        argv = cmd.split()
        script = [i for i, a in enumerate(argv) if a.endswith(b"shmbuf/_janitor.py")]
        if not script or len(argv) <= script[0] + 1:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        out.append((pid, int(argv[script[0] + 1])))
    return out


def orphaned_watchers() -> list[tuple[int, int]]:
    """This run's watchers whose owner is gone: each should exit within a second of its owner (docs/reliability.md)."""
    from shmbuf._proc import alive

    return [(pid, owner) for pid, owner in watchers() if not alive(owner, 0)]


def leaked_since(before: set[str]) -> list[Any]:
    """New shmbuf objects that are this process's, or whose owner is dead (so: left by this suite's children).

    A live object of another process is not ours to judge, or to remove: other test runs and
    programs may share this machine's /dev/shm.
    """
    from shmbuf import _admin

    new = shm_objects() - before
    out = []
    for f in _admin.scan():
        entries = ({f.name[1:]} if f.segment else set()) | set(f.semaphores)
        if entries & new and (f.owner_pid == os.getpid() or f.removable):
            out.append(f)
    return out


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_end() -> Iterator[None]:
    """Fails the suite if any shmbuf object of its own or child process outlives it, or a watcher its owner (and removes
    or kills them, for the next run)."""
    from shmbuf import _admin
    from shmbuf._janitor import KEEP_ENV

    os.environ.pop(KEEP_ENV, None)  # a developer's SHMBUF_KEEP_ON_CRASH=1 would keep what the tests check is removed
    before = shm_objects()
    yield
    deadline = time.monotonic() + 5.0
    while (child_pids() or leaked_since(before) or orphaned_watchers()) and time.monotonic() < deadline:
        for p in mp.active_children():  # reaps the finished ones
            p.join(0)
        time.sleep(0.05)
    kids = child_pids()
    stray = orphaned_watchers()
    for pid in kids + [w for w, _ in stray]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    found = leaked_since(before)
    leaked = sorted(e for f in found for e in ([f.name[1:]] if f.segment else []) + f.semaphores)
    for f in found:
        if f.owner_pid == os.getpid() and not f.removable:  # our own, still open: close it the hard way
            f.owner_alive = False
            f.error = ""
        _admin.remove(f)
    problems = []
    if leaked:
        problems.append(f"left in {SHM_DIR}: {leaked}")
    if kids:
        problems.append(f"child processes survived the suite: {kids}")
    if stray:
        problems.append(f"watchers outlived their owners by 5 s (watcher pid, owner pid): {stray}")
    assert not problems, "; ".join(problems)


@pytest.fixture
def make_reader() -> Iterator[Callable[..., shmbuf.Reader]]:
    """``make_reader(example, slots, **kw)``: a pipeline that is closed (and unlinked) at teardown."""
    made: list[shmbuf.Reader] = []

    def make(example: Any, slots: int = 8, **kw: Any) -> shmbuf.Reader:
        r = shmbuf.create(example, slots, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def pair(make_reader: Callable[..., shmbuf.Reader]) -> Iterator[tuple[shmbuf.Reader, shmbuf.Writer]]:
    """A pipeline of ``small_example()`` (8 slots, 2 lanes) and one Writer in this thread, already lent slots."""
    reader = make_reader(small_example(), slots=8, max_writers=2)  # one writer may queue 8 // 2 before a poll
    writer = shmbuf.Writer(reader.handle, timeout=2.0)
    reader.poll()
    yield reader, writer
    writer.close()


@pytest.fixture
def procs() -> Iterator[Callable[..., Any]]:
    """``procs(target, *args, method="spawn")``: a started process, killed and joined at teardown."""
    started: list[Any] = []

    def start(target: Callable[..., Any], *args: Any, method: str = "spawn") -> Any:
        p = mp.get_context(method).Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)


@pytest.fixture
def started() -> Iterator[list[Any]]:
    """A list for the test to put the processes it started in: each is continued (a test may have stopped it),
    killed and joined at teardown, even when the test fails."""
    started: list[Any] = []
    yield started
    for p in started:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(5)


def small_example(t: int = T) -> dict[str, Any]:
    return {
        "step": {
            "obs": np.zeros((t, 4), np.float32),
            "action": np.zeros((t,), np.int64),
            "reward": np.zeros((t,), np.float32),
            "done": np.zeros((t,), bool),
        },
        "episode": {"return": np.zeros((1,), np.float32), "length": np.zeros((1,), np.int32)},
        "final": {"obs": np.zeros((4,), np.float32), "value": np.zeros((), np.float32)},  # 0-d: single-item
    }


def wait_until(pred: Callable[[], bool], timeout: float, what: str, poll: float = 0.01) -> None:
    """Poll ``pred`` until true or fail after ``timeout`` seconds, saying what was awaited."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)
