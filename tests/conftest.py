"""Fixtures that release what they create even when a test fails, and a leak check that fails the suite."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pathlib
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
# its parent's; pytest-xdist's workers get the controller's), watchers included: so the end check finds this run's
# watchers, not another run's on the machine.
RUN_MARK = "SHMBUF_TEST_RUN"
os.environ.setdefault(RUN_MARK, secrets.token_hex(8))
# One thread per torch (and OpenMP) in every process of the run, set before anything imports torch: the suite runs 4
# workers on a 2-core machine, each starting actors, and a learner with torch's default threads would be told, rightly,
# that it oversubscribes the cores its actors leave (workers/_learner_cpu.py; test_learner_cpu and test_policy_lag
# set torch's threads themselves to check that warning). Scripts and docs blocks the tests run inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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

    def scan() -> list[Any]:
        new = shm_objects() - before
        out = []
        for f in _admin.scan():
            entries = ({f.name[1:]} if f.segment else set()) | set(f.semaphores)
            if entries & new and (f.owner_pid == os.getpid() or f.removable):
                out.append(f)
        return out

    found = scan()
    if found:
        # A pipeline that another process is creating at this moment has its semaphores before its segment, and a
        # scan between the two sees semaphores of no segment (removable): a test beside this one (make bench-smoke
        # runs in parallel) does that. What is still there, as it was, a second later is left behind.
        time.sleep(1.0)
        again = {(f.name, f.segment, tuple(f.semaphores)) for f in scan()}
        found = [f for f in found if (f.name, f.segment, tuple(f.semaphores)) in again]
    return found


def own_objects(before: set[str]) -> list[Any]:
    """New shmbuf objects that this process owns (and holds open)."""
    return [f for f in leaked_since(before) if f.owner_pid == os.getpid()]


def _names(found: list[Any]) -> list[str]:
    return sorted(e for f in found for e in ([f.name[1:]] if f.segment else []) + f.semaphores)


def _remove(found: list[Any]) -> None:
    """Remove what a check found, for the next run; our own, still open, the hard way."""
    from shmbuf import _admin

    for f in found:
        if f.owner_pid == os.getpid() and not f.removable:
            f.owner_alive = False
            f.error = ""
        _admin.remove(f)


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_end(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the suite if any shmbuf object of its own or child process outlives it, or a watcher its owner (and removes
    or kills them, for the next run).

    Under pytest-xdist this runs in each worker, for what that worker owns: its child processes and the objects it
    holds open. An object whose owner died cannot be told apart from another worker's (which may be in use by a test
    running there right now), so those are judged once every worker has finished, by the controller
    (``pytest_runtestloop`` below), which fails the run as this fixture would.
    """
    from shmbuf._janitor import KEEP_ENV

    os.environ.pop(KEEP_ENV, None)  # a developer's SHMBUF_KEEP_ON_CRASH=1 would keep what the tests check is removed
    worker = _worker_id(request.config)
    parallel = worker is not None
    before = shm_objects()
    yield
    judge = own_objects if parallel else leaked_since
    deadline = time.monotonic() + 5.0
    while (child_pids() or judge(before) or orphaned_watchers()) and time.monotonic() < deadline:
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
    found = judge(before)
    leaked = _names(found)
    _remove(found)
    problems = []
    if leaked:
        problems.append(f"left in {SHM_DIR}: {leaked}")
    if kids:
        problems.append(f"child processes survived the suite: {kids}")
    if stray:
        problems.append(f"watchers outlived their owners by 5 s (watcher pid, owner pid): {stray}")
    where = f" (pytest-xdist worker {worker})" if parallel else ""
    assert not problems, "; ".join(problems) + where


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


# -- running in parallel (pytest-xdist: `make test` runs ``-n 4 --dist loadgroup``) ---------------------------------
#
# What the parallel run keeps from the serial one:
# - the end check (no_leaks_at_end): each worker judges its own children and open objects, the controller what was
#   left with its owner dead once every worker has finished (pytest_runtestloop);
# - one Ray cluster: the tests that take the `cluster` fixture form one xdist group (one worker: the scheduler below
#   keeps a group together), run one after the other, first in the queue (the longest chain), and share one cluster,
#   stopped after the last of them;
# - tests marked `alone` run with no other test beside them: the other workers wait (Turns below). They judge what
#   the whole machine holds (every new entry of /dev/shm, every process), which tests beside them would change, or
#   their outcome depends on the pace of their processes, which tests beside them would slow unevenly.
# They are queued last, in one group, where the others have finished their work anyway.
# Run serially (plain `pytest`), none of this changes anything but the order: the cluster's tests first, `alone` last.

RAY_GROUP, ALONE_GROUP = "ray_cluster", "alone"
BENCH = pathlib.Path(__file__).resolve().parent / "bench"


def _worker_id(config: pytest.Config) -> str | None:
    """This pytest-xdist worker's id ("gw0", ...), or None outside xdist's workers (not from the environment, which a
    worker's children inherit: a pytest run that a test starts is no worker)."""
    return getattr(config, "workerinput", {}).get("workerid")


def _xdist_controller(config: pytest.Config) -> bool:
    """Is this process the controller of a pytest-xdist run (which runs no test itself)?"""
    return _worker_id(config) is None and getattr(config.option, "dist", "no") != "no"


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """tests/bench (the benchmarks' smoke tests, `make bench-smoke`) is collected only when named on the command line:
    plain `pytest` and `make test` run the library's tests, which need only the `test` extra."""
    if collection_path != BENCH:
        return None
    here = config.invocation_params.dir
    named = [(here / arg.split("::")[0]).resolve() for arg in config.args]
    return not any(p == BENCH or BENCH in p.parents for p in named)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order: the cluster's tests first (the longest chain), the `alone` ones last; and their xdist groups."""
    cluster = [i for i in items if "cluster" in getattr(i, "fixturenames", ())]
    alone = [i for i in items if i.get_closest_marker("alone") and i not in cluster]
    first, last = {id(i) for i in cluster}, {id(i) for i in alone}
    items[:] = cluster + [i for i in items if id(i) not in first and id(i) not in last] + alone
    if config.pluginmanager.hasplugin("xdist"):
        for i in cluster:
            i.add_marker(pytest.mark.xdist_group(RAY_GROUP))
        for i in alone:
            i.add_marker(pytest.mark.xdist_group(ALONE_GROUP))


# xdist's loadgroup puts a test's group into its node id (``item._nodeid``), which pytest 9.2 no longer reads (its
# node ids are ``item._id``): every test would be its own group. So the workers hand the groups to the controller's
# scheduler here, in a file beside the Turns, as they finish collecting (before they report it).


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    directory = getattr(config, "workerinput", {}).get("shmbuf_turns")
    if directory is None or not config.getvalue("loadgroup"):
        return
    groups = {}
    for item in session.items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if names:
            groups[item.nodeid] = "_".join(names)
    tmp = os.path.join(directory, f"groups.{_worker_id(config)}.tmp")
    with open(tmp, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, os.path.join(directory, "groups.json"))  # every worker collects the same tests: one file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`, with the groups the workers wrote (see above)."""
    if config.getvalue("dist") != "loadgroup" or _TURNS_DIR not in config.stash:
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = os.path.join(config.stash[_TURNS_DIR], "groups.json")

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (schedule() runs then)
                with open(path) as f:
                    self.groups = json.load(f)
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


class Turns:
    """A readers-writer lock over the workers of one run, on flock(2): every test holds a shared turn for its whole
    protocol (setup, call, teardown); a test marked `alone` holds the exclusive one, which waits for the tests running
    beside it to end and keeps new ones from starting (they queue at ``gate``, which it holds while it waits: so a
    stream of shared turns cannot starve it). Every wait has a deadline."""

    DEADLINE = 900.0  # s: longer than any test's timeout, so that only a lost turn (a bug here) ends in this error

    def __init__(self, directory: str) -> None:
        self.gate = os.path.join(directory, "gate")
        self.turn = os.path.join(directory, "turn")

    @staticmethod
    def _lock(path: str, op: int, what: str, deadline: float) -> int:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        while True:
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RuntimeError(f"no {what} after {Turns.DEADLINE} s: a test of another worker kept it") from None
                time.sleep(0.02)

    @contextlib.contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        import fcntl

        deadline = time.monotonic() + self.DEADLINE
        gate = self._lock(self.gate, fcntl.LOCK_EX, "turn at the gate", deadline)
        try:
            if not alone:  # through the gate: while an `alone` test waits there, none passes
                os.close(gate)
                gate = -1
            turn = self._lock(self.turn, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, "turn", deadline)
        except BaseException:
            if gate >= 0:
                os.close(gate)
            raise
        try:
            yield
        finally:
            os.close(turn)
            if gate >= 0:
                os.close(gate)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller hands each worker the directory of the run's Turns."""
    node.workerinput["shmbuf_turns"] = node.config.stash[_TURNS_DIR]


_TURNS_DIR = pytest.StashKey[str]()
_BEFORE = pytest.StashKey[set]()


def pytest_configure(config: pytest.Config) -> None:
    if _xdist_controller(config):
        import tempfile

        config.stash[_TURNS_DIR] = tempfile.mkdtemp(prefix="shmbuf-tests-turns-")
        config.stash[_BEFORE] = shm_objects()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _TURNS_DIR in config.stash:
        import shutil

        shutil.rmtree(config.stash[_TURNS_DIR], ignore_errors=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _RAY.next_item = nextitem
    directory = getattr(item.config, "workerinput", {}).get("shmbuf_turns")
    if directory is None:  # not an xdist worker: nothing runs beside this test
        yield
        return
    with Turns(directory).hold(alone=item.get_closest_marker("alone") is not None):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    """The controller's end check, once every worker has finished: what the run left in /dev/shm with its owner dead
    (the workers judged their own children and open objects). Reported as a failed test, which fails the run."""
    yield
    if _BEFORE not in session.config.stash:
        return
    before = session.config.stash[_BEFORE]
    deadline = time.monotonic() + 5.0
    while leaked_since(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = leaked_since(before)
    if found:
        leaked = _names(found)
        _remove(found)
        report = pytest.TestReport(
            nodeid="tests/conftest.py::no_leaks_at_end", location=("tests/conftest.py", None, "no_leaks_at_end"),
            keywords={}, outcome="failed", when="teardown",
            longrepr=f"left in {SHM_DIR} by the run's processes (their owners dead), after every worker ended: {leaked}")
        session.config.hook.pytest_runtest_logreport(report=report)


class SharedRayCluster:
    """The local two-node Ray cluster (``ray.cluster_utils.Cluster``: a head and one more node, each with its own raylet
    and object store) that every test taking the `cluster` fixture shares: started by the first of them, stopped after
    the last (they run one after the other: pytest_collection_modifyitems puts them first, in one xdist group), so
    that no test after them finds its processes among this process's children."""

    def __init__(self) -> None:
        self.cluster: Any = None
        self.next_item: pytest.Item | None = None  # the test after the running one (pytest_runtest_protocol)

    def start(self) -> Any:
        if self.cluster is not None:
            return self.cluster
        import ray
        from ray.cluster_utils import Cluster

        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        self.cluster = c
        try:
            c.add_node(num_cpus=1)
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
            wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, 60, "both Ray nodes to be alive")
        except BaseException:
            self.stop()
            raise
        return c

    def stop(self) -> None:
        if self.cluster is None:
            return
        import ray

        c, self.cluster = self.cluster, None
        try:
            ray.shutdown()
        finally:
            c.shutdown()
            wait_until(lambda: not [p for p in child_pids() if b"ray" in _cmdline(p)], 30, "the Ray cluster's processes to exit")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


_RAY = SharedRayCluster()


@pytest.fixture
def cluster() -> Iterator[Any]:
    """The suite's local two-node Ray cluster (SharedRayCluster), with this process connected to it."""
    pytest.importorskip("ray", reason="the `ray` extra (make test installs it)")
    yield _RAY.start()
    following = _RAY.next_item
    if following is None or "cluster" not in following.fixturenames:
        _RAY.stop()
