"""ActorPool: failures reach the learner with their traceback, restarts, one stop deadline, no orphans."""

from __future__ import annotations

import ast
import json
import multiprocessing as mp
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import pytest

from shmbuf._proc import alive, start_time
from shmbuf._segment import unlink_all
from tests.conftest import wait_until
from tests.helpers_workers import (
    EchoPolicy,
    make_counting,
    target_crash,
    target_crash_first_time,
    target_hang,
    target_ok,
    target_segfault,
)
from workers import ActorError, ActorPool, ActorSpec, run_actor
from workers._pool import LearnerWatch
from workers.lowlevel import default_start_method


@pytest.fixture
def pools():
    made: list[ActorPool] = []

    def make(*args, **kw) -> ActorPool:
        p = ActorPool(*args, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close(timeout=3)


def raise_within(pool: ActorPool, seconds: float) -> ActorError:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pool.check(timeout=0.1)
        except ActorError as exc:
            return exc
    raise AssertionError(f"no ActorError within {seconds} s")


def test_default_start_method_is_not_fork():
    assert default_start_method() in ("forkserver", "spawn")


@pytest.mark.parametrize("method", [None, "spawn", "fork"])
def test_crashing_actor_raises_in_learner_with_traceback(pools, method):
    pool = pools(target_crash, 2, kwargs={"message": "kaboom"}, start_method=method).start()
    err = raise_within(pool, 30)
    assert err.index == 1 and err.kind == "ValueError"
    assert "kaboom in actor 1" in str(err)
    assert "Traceback (most recent call last)" in err.remote_traceback
    assert "target_crash" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert err.exitcode == 1
    assert pool.states == ["running", "failed"]
    pool.check()  # raised once; the healthy actor goes on
    assert pool.alive() == 1


def test_actor_killed_without_a_word_is_reported_as_died(pools):
    pool = pools(target_segfault, 1, start_method="fork").start()
    err = raise_within(pool, 10)
    assert err.kind == "died" and err.exitcode == -signal.SIGKILL and "SIGKILL" in str(err)


def test_restart_replaces_a_failed_actor(pools):
    pool = pools(target_crash_first_time, 2, restart=True, max_restarts=1, start_method="fork").start()
    first = pool.pids[0]
    wait_until(lambda: (pool.check(), pool.restarts == 1)[1], 20, "a restart")
    assert len(pool.failures) == 1 and pool.failures[0].kind == "KeyError"
    assert "first life fails" in pool.failures[0].remote_traceback
    assert pool.pids[0] != first
    wait_until(lambda: pool.alive() == 2, 20, "both actors running")
    pool.check(timeout=0.3)  # the second life is healthy: nothing to raise
    assert pool.states == ["running", "running"]


def test_restart_budget_runs_out(pools):
    pool = pools(target_crash, 2, restart=True, max_restarts=2, start_method="fork").start()
    deadline = time.monotonic() + 30
    with pytest.raises(ActorError, match="boom in actor 1"):
        while time.monotonic() < deadline:
            pool.check(timeout=0.1)
    assert pool.restarts == 2 and len(pool.failures) == 3


@pytest.mark.parametrize("ignore_term", [False, True])
def test_stop_meets_its_deadline_with_a_hung_actor(pools, ignore_term):
    pool = pools(target_hang, 2, kwargs={"ignore_term": ignore_term}, start_method="fork").start()
    pool.wait_ready(20)  # each actor has set up its SIGTERM handling
    t0 = time.monotonic()
    codes = pool.close(timeout=3.0)
    took = time.monotonic() - t0
    # the deadline and a margin for a loaded machine: a wait for the hung actors (for ever) or a second full wait
    # (SIGTERM's 3 s, then as long again after SIGKILL: 6 s) misses it
    assert took < 3.0 + 2.0, f"stop took {took:.2f} s for a 3 s deadline"
    want = -signal.SIGKILL if ignore_term else -signal.SIGTERM
    assert codes == {0: want, 1: want}
    assert pool.alive() == 0


def test_stop_is_quick_when_actors_listen(pools):
    pool = pools(target_ok, 3, start_method="fork").start()
    wait_until(lambda: pool.alive() == 3, 10, "actors up")
    t0 = time.monotonic()
    assert pool.close(timeout=30) == {0: 0, 1: 0, 2: 0}  # each left on its own: no SIGTERM, no SIGKILL
    assert time.monotonic() - t0 < 15, "stop waited out its deadline for actors that had left"


# -- the learner dies: its actors must not outlive it ------------------------


def _learner(conn, method: str) -> None:
    """A learner with a real shmbuf pipeline, two collecting actors and one hung actor; it reports and waits."""
    import numpy as np

    import shmbuf
    from shmbuf.layout import rollout_example
    from workers import probe

    p = probe(make_counting(), EchoPolicy())
    example = rollout_example(p["obs"], p["action"], rollout_len=4, extras=p["extras"])
    reader = shmbuf.create(example, slots=4, max_writers=2)  # few slots: actors soon block waiting for one
    spec = ActorSpec(pipeline=reader.name, env_fns=(make_counting,), rollout_len=4, policy=EchoPolicy())
    collecting = ActorPool(run_actor, 2, args=(spec,), start_method=method).start()
    hung = ActorPool(target_hang, 1, kwargs={"ignore_term": True}, start_method=method).start()
    r = reader.get(timeout=30)  # actors are really writing
    r.release()
    conn.send_bytes(json.dumps({"pids": collecting.pids + hung.pids, "pipeline": reader.name}).encode())
    while True:
        time.sleep(1)
        np.zeros(1)


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_no_orphans_after_the_learner_is_killed(method):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    learner = ctx.Process(target=_learner, args=(there, method))  # not daemonic: a learner starts processes
    learner.start()
    there.close()
    info = None
    try:
        assert here.poll(60), "the learner did not report within 60 s"
        info = json.loads(here.recv_bytes())
        actors = [(pid, start_time(pid)) for pid in info["pids"]]
        assert all(alive(*a) for a in actors)
        os.kill(learner.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: not any(alive(*a) for a in actors), 2.0, "every actor to exit after the learner died")
        print(f"{method}: actors gone {time.monotonic() - t0:.2f} s after the learner was killed")
    finally:
        if learner.is_alive():
            learner.kill()
        learner.join(5)
        if info is not None:
            for pid in info["pids"]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            unlink_all(info["pipeline"], 2)  # its watcher removes what a killed learner left; whatever is left goes here


def test_run_actor_error_also_reaches_a_bare_reader_as_writer_error(pools):
    """A learner that only reads (no pool.check) still hears of an actor's exception, with its traceback."""
    import shmbuf
    from shmbuf.layout import rollout_example
    from tests.helpers_workers import WrongPolicy
    from workers import probe

    p = probe(make_counting(), EchoPolicy())
    example = rollout_example(p["obs"], p["action"], rollout_len=4, extras=p["extras"])
    reader = shmbuf.create(example, slots=4, max_writers=1)
    try:
        spec = ActorSpec(pipeline=reader.name, env_fns=(make_counting,), rollout_len=4, policy=WrongPolicy())
        pools(run_actor, 1, args=(spec,), start_method="fork").start()
        deadline = time.monotonic() + 20
        with pytest.raises(shmbuf.WriterError) as info:
            while time.monotonic() < deadline:
                try:
                    reader.get(timeout=0.2).release()
                except shmbuf.SlotTimeout:
                    pass
        assert "got action" in str(info.value) and "in step" in info.value.remote_traceback
    finally:
        reader.close()


def test_learner_watch_sees_its_process_exit():
    """The pidfd is readable once the process it was taken on has exited (here a child, killed)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = LearnerWatch.open(child.pid)
    try:
        assert watch.fd >= 0, "os.pidfd_open is expected on this Linux"
        assert watch.alive()
        child.kill()
        wait_until(lambda: not watch.alive(), 5.0, "the watch to see the exit")
    finally:
        watch.close()
        child.kill()
        child.wait(5)


def test_learner_watch_without_pidfd_falls_back_to_the_pid():
    """Where os.pidfd_open is missing the watch checks the pid; it pickles as the pid alone."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = pickle.loads(pickle.dumps(LearnerWatch(child.pid, -1)))
        assert watch.fd == -1 and watch.waitable() == [] and watch.alive()
        child.kill()
        child.wait(5)  # reaped: the pid is gone
        assert not watch.alive()
    finally:
        child.kill()
        child.wait(5)


def test_workers_uses_only_shmbuf_public_api():
    """workers is a user of shmbuf: no import of, or attribute from, a private module, and only names in __all__
    (of shmbuf, its learner-side package shmbuf.storage, the rollout layout shmbuf.layout, or a lowlevel tier)."""
    import shmbuf
    import shmbuf.layout
    import shmbuf.lowlevel
    import shmbuf.storage
    import shmbuf.storage.lowlevel

    public = {m.__name__: set(m.__all__) for m in (shmbuf, shmbuf.storage, shmbuf.layout, shmbuf.lowlevel,
                                                    shmbuf.storage.lowlevel)}
    used = []
    for path in sorted((pathlib.Path(__file__).parent.parent / "workers").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shmbuf"):
                assert node.module in public, f"{path.name}:{node.lineno} imports {node.module}"
                # a public module of the package is public too: `from shmbuf import layout as L` is `import shmbuf.layout`
                bad = [a.name for a in node.names
                       if a.name not in public[node.module] and f"{node.module}.{a.name}" not in public]
                assert not bad, f"{path.name}:{node.lineno} imports {bad} from {node.module}, outside its __all__"
                used += [(path.name, node.lineno, a.name) for a in node.names if node.module == "shmbuf"]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("shmbuf."):
                        assert a.name in public, f"{path.name}:{node.lineno} imports {a.name}"
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "shmbuf":
                used.append((path.name, node.lineno, node.attr))
    assert used, "workers is expected to use shmbuf"
    private = [u for u in used if u[2] not in shmbuf.__all__ and f"shmbuf.{u[2]}" not in public]
    assert not private, f"names outside shmbuf.__all__: {private}"


def test_actor_error_survives_a_pickle_with_its_fields() -> None:
    """Ray carries a node owner's exception to the learner by pickle: an ActorError must come back whole."""
    err = ActorError("actor 1 (pid 7) raised ValueError: x", index=1, pid=7, kind="ValueError", exitcode=None,
                     remote_traceback="Traceback...\nValueError: x\n")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ActorError and str(back) == str(err)
    assert (back.index, back.pid, back.kind, back.exitcode, back.remote_traceback) == (1, 7, "ValueError", None,
                                                                                        err.remote_traceback)
