"""The suite's own end check under pytest-xdist, as `make test` runs it (tests/conftest.py): a leak in any worker fails
the run, whichever kind it is.

A pytest run of three planted tests on two workers, each leaving one thing behind: a child process, a pipeline it
holds open itself, a pipeline whose owner (a child) was SIGKILLed (xdist deals the three out in turn: the first and
last to one worker, the second to the other). The first two are judged by their worker's
no_leaks_at_end, the last by the controller once every worker has ended (it cannot tell whose a dead owner was while
the others run). The run must fail, name each leak, and leave none of them behind. It runs `alone`: the controller's
check judges every new entry of /dev/shm whose owner is dead, and a test beside it could make one.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import shm_objects
from tests.helpers import ROOT, session_of

PLANTED = r'''
import multiprocessing as mp
import os
import signal
import time

import shmbuf
from tests.conftest import small_example

KEPT = []


def tell(what, value):  # the outer test reads what each planted test left (a worker's output is not shown)
    with open(os.environ["PLANTED_OUT"], "a") as f:
        f.write(f"{what} {value}\n")


def _create(q):
    reader = shmbuf.create(small_example(), 2, keep_on_crash=True)  # kept: a reader dropped unlinks; its watcher would too
    q.put(reader.name)
    time.sleep(60)


def test_leaves_a_child_process():
    p = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    p.start()
    tell("child", p.pid)


def test_leaves_its_own_pipeline_open():
    KEPT.append(shmbuf.create(small_example(), 2))
    tell("own", KEPT[0].name)


def test_leaves_a_pipeline_whose_owner_died():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_create, args=(q,))
    p.start()
    tell("dead", q.get(timeout=30))
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
'''


@pytest.mark.alone
def test_a_leak_in_any_worker_fails_the_run_and_is_removed(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("xdist", reason="pytest-xdist (the test extra) runs `make test` in parallel")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]  # the suite\'s fixtures and hooks\n')
    (tmp_path / "test_planted.py").write_text(PLANTED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    told = tmp_path / "told"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # this run's own, when it runs in a worker
    env.update(PYTHONPATH=str(ROOT), PLANTED_OUT=str(told))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "load",
                          "test_planted.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-5000:]
    assert re.search(r"3 passed, 3 errors? in", out), out[-3000:]
    left = told.read_text()
    child = re.search(r"^child (\d+)$", left, re.M)
    own = re.search(r"^own /(shmbuf-[0-9a-f]{16})$", left, re.M)
    dead = re.search(r"^dead /(shmbuf-[0-9a-f]{16})$", left, re.M)
    assert child and own and dead, left
    assert re.search(rf"child processes survived the suite: \[{child[1]}\] \(pytest-xdist worker gw\d\)", out), out[-3000:]
    assert re.search(rf"left in /dev/shm: \[[^\]]*'{own[1]}'[^\]]*\] \(pytest-xdist worker gw\d\)", out), out[-3000:]
    assert "ERROR at teardown of no_leaks_at_end" in out and "(their owners dead), after every worker ended" in out
    assert re.search(rf"after every worker ended: \[[^\]]*'{dead[1]}'", out), out[-3000:]
    # removed, and killed, for the next run
    assert not [e for e in shm_objects() if own[1] in e or dead[1] in e]
    assert session_of(int(child[1])) is None
