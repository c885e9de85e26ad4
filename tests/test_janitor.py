"""A dead owner leaves nothing in /dev/shm: its watcher (shmbuf/_janitor.py) removes what it created within a second of
its death by any signal, SIGKILL included; SIGTERM closes as Ctrl-C does; keep_on_crash keeps; a live owner's objects
and a name made again by anyone are never touched (docs/reliability.md, "A dead owner leaves nothing").

Each owner is a child process that creates its objects, reports their names, and is then signalled. The promise is
1 s after the owner's death; every wait here has a 5 s deadline (a loaded machine), and the latency seen is printed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import pytest

import shmbuf
from tests.conftest import SHM_DIR, orphaned_watchers, small_example, wait_until, watchers
from tests.helpers import descendants, gone

DEADLINE = 5.0  # the promise is 1 s after the owner's death; the margin is for a loaded machine
KINDS = ("pipeline", "collector", "async_batched", "replay", "weights", "rollout_buffer")
# The start method of each kind's owner, so that every method starts some (all three start a pipeline's owner below).
METHOD = {"pipeline": "fork", "collector": "spawn", "async_batched": "forkserver", "replay": "spawn",
          "weights": "forkserver", "rollout_buffer": "fork"}
# How each owner ends: SIGTERM through shmbuf's handler (SystemExit(143)), SIGINT as KeyboardInterrupt (which
# multiprocessing reports as exit code 1), SIGKILL by the signal.
EXIT = {"SIGTERM": 143, "SIGINT": 1, "SIGKILL": -signal.SIGKILL}


def entries_of(names: list[str]) -> set[str]:
    """Every entry of /dev/shm that belongs to these objects: each object and the semaphores named after it."""
    tails = [n[1:] for n in names]
    return {e for e in os.listdir(SHM_DIR) for t in tails if e == t or e.startswith(f"sem.{t}-")}


def watcher_of(pid: int, *, required: bool = True) -> int:
    """The pid of ``pid``'s watcher, as the suite's leak check finds watchers; 0 if it has none, which fails unless
    not ``required`` (a test signals that pid: never 0, the whole process group)."""
    w = next((w for w, owner in watchers() if owner == pid), 0)
    assert w > 0 or not required, f"no watcher watches process {pid}"
    return w


def _make(kind: str, keep: bool) -> tuple[list[Any], list[str]]:
    """An owner's objects of ``kind`` (what must stay referenced) and their names."""
    kw = {"keep_on_crash": True} if keep else {}
    if kind == "pipeline":
        r = shmbuf.create(small_example(), 4, **kw)  # 16 lanes: the object and 17 semaphores
        return [r], [r.name]
    if kind in ("collector", "async_batched"):
        from tests.helpers_workers import EchoPolicy, make_counting
        from workers import AsyncBatchedCollector, Collector

        if kind == "collector":
            c = Collector([make_counting], EchoPolicy(), frames_per_batch=8, rollout_len=4, start_method="fork",
                          weights={"w": np.zeros(3, np.float32)}, **kw)
            return [c], [c.reader.name, c.publisher.name]
        a = AsyncBatchedCollector([make_counting], policy=EchoPolicy(), frames_per_batch=8, rollout_len=4,
                                  start_method="fork", **kw)
        return [a], [a.reader.name, a.table.name]
    if kind == "replay":
        from shmbuf.storage import ReplayBuffer

        rb = ReplayBuffer.create({"x": np.zeros(3, np.float32)}, 16, **kw)
        return [rb], [rb.name]
    if kind == "weights":
        w = shmbuf.WeightPublisher({"w": np.zeros(3, np.float32)}, **kw)
        return [w], [w.name]
    assert kind == "rollout_buffer"
    from shmbuf.storage import RolloutBuffer

    b = RolloutBuffer(2, 4, 3, 1, **kw)
    return [b], [b.reader.name]


def _owner(kinds: list[str], keep: bool, env_keep: bool, conn: Any) -> None:
    """Create each kind's objects, report their names, then wait to be signalled, as a training loop would; ``finally``
    tells the test it ran (it runs when SIGTERM or SIGINT unwinds, never after SIGKILL)."""
    # SIGTERM as a fresh process has it. A fork inherits its parent's: after ray.init() and ray.shutdown() in this
    # test process (the Ray tests), Python's table still names Ray's handler while the kernel's disposition is back
    # to the default, so shmbuf leaves the user's "handler" alone and the signal kills (seen in the parallel suite).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if env_keep:
        os.environ["SHMBUF_KEEP_ON_CRASH"] = "1"
    held, names = [], []
    for kind in kinds:
        h, n = _make(kind, keep and kind != "weights")  # a weight broadcast is never kept: it shows the watcher ran
        held += h
        names += n
    conn.send_bytes(msgpack.packb({"names": names}))
    try:
        while True:
            msg = conn.recv_bytes() if conn.poll(300) else b""
            if msg != b"more":
                break
            h, n = _make("pipeline", False)  # asked for another object (see the watcher-killed test)
            held += h
            conn.send_bytes(msgpack.packb({"names": n}))
    finally:
        try:
            conn.send_bytes(b"finally")
        except OSError:
            pass


class Owner:
    """A child owner process: its pid, the names it reported, and the pipe to it."""

    def __init__(self, proc: Any, conn: Any, names: list[str]):
        self.proc, self.conn, self.names, self.pid = proc, conn, names, proc.pid

    def more(self) -> list[str]:
        """Ask the owner for one more pipeline; its name."""
        self.conn.send_bytes(b"more")
        assert self.conn.poll(60), "the owner did not make another pipeline"
        names = msgpack.unpackb(self.conn.recv_bytes())["names"]
        self.names += names
        return names


@contextmanager
def owner(kinds: list[str], method: str, *, keep: bool = False, env_keep: bool = False) -> Iterator[Owner]:
    """An owner started by ``method``; at the end it is killed, its processes too, and whatever it left is removed."""
    ctx = mp.get_context(method)
    here, there = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_owner, args=(kinds, keep, env_keep, there))  # not a daemon: collectors start actors
    proc.start()
    there.close()
    o = Owner(proc, here, [])
    family: set[int] = set()
    try:
        assert here.poll(120), "the owner did not report its objects"
        o.names = msgpack.unpackb(here.recv_bytes())["names"]
        family = descendants(proc.pid)
        yield o
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        for pid in family | descendants(proc.pid):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        for e in entries_of(o.names):
            try:
                os.unlink(f"{SHM_DIR}/{e}")
            except FileNotFoundError:
                pass
        here.close()


def _finally_ran(o: Owner) -> bool:
    """Whether the owner's ``finally`` reported (the pipe holds its word even after it exited)."""
    try:
        return o.conn.poll(0) and o.conn.recv_bytes() == b"finally"
    except (EOFError, OSError):
        return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_owner_leaves_nothing_in_dev_shm(kind: str, sig: str) -> None:
    """Every object the owner created (and every semaphore named after one) is gone within the deadline of its death by
    SIGTERM, SIGINT or SIGKILL, its watcher exits, and so do the processes it started (a collector's actors)."""
    with owner([kind], METHOD[kind]) as o:
        made = entries_of(o.names)
        assert {n[1:] for n in o.names} <= made, f"{o.names} not all in /dev/shm: {sorted(made)}"
        family = descendants(o.pid)
        sent = time.monotonic()
        os.kill(o.pid, getattr(signal, sig))
        o.proc.join(60)  # SIGTERM and SIGINT: the owner first closes what it holds (a collector stops its actors)
        died = time.monotonic()
        wait_until(lambda: not entries_of(o.names), DEADLINE, f"{sorted(made)} to leave /dev/shm", poll=0.001)
        gone_at = time.monotonic()
        assert o.proc.exitcode == EXIT[sig]
        wait_until(lambda: not [w for w, owner in watchers() if owner == o.pid], DEADLINE, "the owner's watcher to exit")
        wait_until(lambda: all(gone(p) for p in family), 30, f"the owner's processes {sorted(family)} to exit")
        print(f"{kind} {sig}: {len(made)} entries gone {1e3 * (gone_at - died):.0f} ms after the owner's death was seen "
              f"({1e3 * (gone_at - sent):.0f} ms after the signal)")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_killed_owners_watcher_works_whatever_start_method_started_the_owner(method: str) -> None:
    with owner(["pipeline", "weights"], method) as o:
        w = watcher_of(o.pid)
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        wait_until(lambda: not entries_of(o.names), DEADLINE, f"{o.names} to leave /dev/shm")
        wait_until(lambda: gone(w), DEADLINE, "the watcher to exit")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_sigterm_unwinds_and_the_owner_removes_its_objects_itself(method: str) -> None:
    """SIGTERM in a process that has no handler of its own closes as Ctrl-C does: ``finally`` runs, and the owner's
    own close removes everything before it exits (its watcher is frozen meanwhile, so it cannot be the one)."""
    with owner(["pipeline", "replay"], method) as o:
        w = watcher_of(o.pid)
        os.kill(w, signal.SIGSTOP)
        try:
            os.kill(o.pid, signal.SIGTERM)
            o.proc.join(30)
            assert o.proc.exitcode == 143
            assert _finally_ran(o), "SIGTERM did not unwind the owner's code"
            assert not entries_of(o.names), "the owner did not remove its objects on SIGTERM"
        finally:
            os.kill(w, signal.SIGCONT)
        wait_until(lambda: gone(w), DEADLINE, "the watcher to exit")


def test_a_live_owners_objects_stay_when_another_owner_dies(make_reader: Any) -> None:
    mine = make_reader(small_example(), slots=2, max_writers=2)
    ours = entries_of([mine.name])
    with owner(["pipeline"], "spawn") as o:
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        wait_until(lambda: not entries_of(o.names), DEADLINE, f"{o.names} to leave /dev/shm")
    assert entries_of([mine.name]) == ours
    shmbuf.Writer(mine.handle, timeout=2.0).close()  # still whole and usable


def test_a_name_made_again_after_its_owner_removed_it_is_left_alone() -> None:
    """The watcher removes only the very file its owner created: here another process took the name over (the file
    was removed and made again), so it is not the owner's, and neither are the semaphores named after it."""
    with owner(["pipeline"], "spawn") as o:
        [name] = o.names
        w = watcher_of(o.pid)
        path = f"{SHM_DIR}/{name[1:]}"
        os.unlink(path)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # someone's new file under the name
        sems = entries_of(o.names) - {name[1:]}
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        wait_until(lambda: gone(w), DEADLINE, "the watcher to finish")
        assert os.path.exists(path), "the watcher removed a file its owner never made"
        assert entries_of(o.names) == sems | {name[1:]}


def test_semaphores_left_by_a_remover_stopped_after_the_object_are_removed_too() -> None:
    """A remover stopped half way (a `shmbuf clean` killed, or any unlink of the object alone) leaves the semaphores
    named after the object, whose own name is gone: the watcher removes those too when its owner dies, instead of
    leaving 17 semaphores that nothing names any more (seen once under the parallel suite, after a Ray run)."""
    with owner(["pipeline"], "spawn") as o:
        [name] = o.names
        w = watcher_of(o.pid)
        os.unlink(f"{SHM_DIR}/{name[1:]}")  # the object alone, as a remover stopped right after it would leave it
        sems = entries_of(o.names)
        assert sems and name[1:] not in sems
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        wait_until(lambda: not entries_of(o.names), DEADLINE, f"{sorted(sems)} to leave /dev/shm")
        wait_until(lambda: gone(w), DEADLINE, "the watcher to exit")


def test_shmbuf_clean_removes_the_object_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """`shmbuf clean` (shmbuf._admin.remove) unlinks a dead owner's semaphores before its object, as the owner's own
    close does: stopped half way, it leaves the object, which names what is left for the next look."""
    from shmbuf import _admin

    with owner(["pipeline"], "spawn", keep=True) as o:
        [name] = o.names
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        [found] = [f for f in _admin.scan() if f.name == name]
        order: list[str] = []
        real = os.unlink

        def unlink(path: Any, *args: Any, **kw: Any) -> None:
            order.append(os.path.basename(path))
            real(path, *args, **kw)

        monkeypatch.setattr(os, "unlink", unlink)  # observed in this process only, for the one call below
        _admin.remove(found)
        monkeypatch.undo()
        assert order and order[-1] == name[1:] and all(e.startswith(f"sem.{name[1:]}-") for e in order[:-1]), order
        assert not entries_of(o.names)


@pytest.mark.parametrize("how", ["argument", "environment", "collector"])
def test_keep_on_crash_keeps_a_killed_owners_objects(how: str) -> None:
    """``keep_on_crash=True`` (given to shmbuf.create, ReplayBuffer.create, a Collector) or SHMBUF_KEEP_ON_CRASH=1: what
    the killed owner created stays for ``shmbuf ls`` and ``shmbuf clean``. A weight broadcast made without it is
    removed all the same (so the watcher ran, and finished, before the kept objects are looked at)."""
    from shmbuf import _admin

    kinds = {"argument": ["pipeline", "replay", "weights"], "environment": ["pipeline", "weights"],
             "collector": ["collector"]}[how]
    with owner(kinds, "spawn", keep=how != "environment", env_keep=how == "environment") as o:
        w = watcher_of(o.pid, required=how == "argument")
        made = entries_of(o.names)
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        if how == "argument":
            wait_until(lambda: gone(w), DEADLINE, "the watcher to finish")
            kept = [n for n in o.names if not n.startswith("/shmbuf-w")]
            assert not entries_of([n for n in o.names if n not in kept]), "the broadcast made without keep_on_crash stayed"
        else:  # nothing of the owner's was watched, so it started no watcher
            assert w == 0, "a watcher watched an owner whose every object is kept"
            kept = o.names
        assert entries_of(kept) == {e for e in made if any(n[1:] in e for n in kept)}
        found = [f for f in _admin.scan() for n in kept if f.name == n]
        assert len(found) == len(kept) and all(f.removable for f in found)  # `shmbuf clean` takes them as today
        for f in found:
            _admin.remove(f)
        assert not entries_of(o.names)


def test_a_bad_keep_on_crash_setting_is_refused_naming_it(monkeypatch: Any) -> None:
    from shmbuf import _admin

    monkeypatch.setenv("SHMBUF_KEEP_ON_CRASH", "yes")
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(shmbuf.UsageError, match=r"SHMBUF_KEEP_ON_CRASH='yes': expected 1 .* or 0 / unset"):
        shmbuf.create(small_example(), 2)
    new = set(os.listdir(SHM_DIR)) - before
    assert not [f for f in _admin.scan() if f.name[1:] in new and f.owner_pid == os.getpid()], "created before refusing"


NORMAL_END = """
import os, sys, numpy as np, shmbuf
from shmbuf import _janitor
r = shmbuf.create({"step": {"x": np.zeros((4, 2), np.float32)}}, 4)
w = shmbuf.WeightPublisher({"w": np.zeros(3, np.float32)})
print(r.name, w.name, _janitor.watcher_pid(), flush=True)
if sys.argv[1] == "close":
    r.close()
    w.close()
"""


@pytest.mark.parametrize("end", ["close", "exit"])
def test_the_watcher_exits_when_its_owner_ends_normally(end: str) -> None:
    """The owner closes everything (or exits with its objects open: they close at exit) and exits 0: its watcher has
    nothing to remove and exits too. Its stderr is the owner's: reading it to the end waits for the watcher."""
    p = subprocess.run([sys.executable, "-W", "error", "-c", NORMAL_END, end], capture_output=True, text=True, timeout=120)
    r, w, watcher = p.stdout.split()
    try:
        assert p.returncode == 0, p.stderr
        assert int(watcher) > 0
        wait_until(lambda: gone(int(watcher)), DEADLINE, "the watcher to exit")  # it closed our stderr on its way out
        assert not entries_of([r, w])
        assert "its watcher removed" not in p.stderr, p.stderr
    finally:
        for e in entries_of([r, w]):
            os.unlink(f"{SHM_DIR}/{e}")


GROUP_OWNER = """
import time, numpy as np, shmbuf
r = shmbuf.create({"step": {"x": np.zeros((4, 2), np.float32)}}, 4)
print(r.name, flush=True)
time.sleep(300)
"""


def test_a_signal_to_the_owners_whole_process_group_spares_its_watcher() -> None:
    """``timeout -s KILL``, a shell's job control, ``kill -- -PGID``: the whole group goes, the watcher (in a session
    of its own) does not, and removes what the owner left."""
    p = subprocess.Popen([sys.executable, "-c", GROUP_OWNER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None
    name = ""
    try:
        name = p.stdout.readline().strip()
        w = watcher_of(p.pid)
        assert os.getpgid(w) != p.pid
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        wait_until(lambda: not entries_of([name]), DEADLINE, f"{name} to leave /dev/shm")
        wait_until(lambda: gone(w), DEADLINE, "the watcher to exit")
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        p.stdout.close()
        for e in entries_of([name] if name else []):
            os.unlink(f"{SHM_DIR}/{e}")


NO_PIDFD = """
import os, sys, time, numpy as np
del os.pidfd_open  # a Linux older than 5.3, or a Python without it
import shmbuf
r = shmbuf.create({"step": {"x": np.zeros((4, 2), np.float32)}}, 4)
print(r.name, flush=True)
time.sleep(300)
"""


def test_without_a_pidfd_the_watcher_polls_the_owner() -> None:
    p = subprocess.Popen([sys.executable, "-c", NO_PIDFD], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    name = ""
    try:
        name = p.stdout.readline().strip()
        w = watcher_of(p.pid)
        with open(f"/proc/{w}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[-2] == b"--poll"
        p.kill()
        p.wait(10)
        wait_until(lambda: not entries_of([name]), DEADLINE, f"{name} to leave /dev/shm")
        wait_until(lambda: gone(w), DEADLINE, "the watcher to exit")
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        p.stdout.close()
        for e in entries_of([name] if name else []):
            os.unlink(f"{SHM_DIR}/{e}")


def test_a_watcher_killed_by_hand_is_replaced_and_told_every_name() -> None:
    with owner(["pipeline"], "spawn") as o:
        first = watcher_of(o.pid)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: gone(first), DEADLINE, "the first watcher to die")
        o.more()  # the owner's next object finds its watcher gone and starts another, with every name
        second = watcher_of(o.pid)
        assert second != first
        os.kill(o.pid, signal.SIGKILL)
        o.proc.join(10)
        wait_until(lambda: not entries_of(o.names), DEADLINE, f"{o.names} (both pipelines) to leave /dev/shm")


def test_the_suites_leak_check_sees_a_watcher_that_outlives_its_owner() -> None:
    """tests/conftest.py fails the suite on a watcher still running 5 s after its owner died: here one is frozen."""
    with owner(["pipeline"], "spawn") as o:
        w = watcher_of(o.pid)
        os.kill(w, signal.SIGSTOP)
        try:
            os.kill(o.pid, signal.SIGKILL)
            o.proc.join(10)
            assert (w, o.pid) in orphaned_watchers()
        finally:
            os.kill(w, signal.SIGCONT)
        wait_until(lambda: (w, o.pid) not in orphaned_watchers(), DEADLINE, "the thawed watcher to finish")
        assert not entries_of(o.names)


SIGTERM_RULES = """
import os, signal, threading, numpy as np, shmbuf
from shmbuf import _janitor
ex = {"step": {"x": np.zeros((4, 2), np.float32)}}
ours = _janitor._on_sigterm
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
r = shmbuf.create(ex, 2)
assert signal.getsignal(signal.SIGTERM) is ours, "not installed at the first object"
r2 = shmbuf.create(ex, 2)
r.close()
assert signal.getsignal(signal.SIGTERM) is ours, "put back while an object was still open"
r2.close()
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "not put back at the last close"

def mine(signum, frame): pass
signal.signal(signal.SIGTERM, mine)  # the user's handler, first
r = shmbuf.create(ex, 2)
assert signal.getsignal(signal.SIGTERM) is mine
r.close()
assert signal.getsignal(signal.SIGTERM) is mine

signal.signal(signal.SIGTERM, signal.SIG_DFL)
r = shmbuf.create(ex, 2)
signal.signal(signal.SIGTERM, mine)  # the user's handler, installed after ours: it wins, and stays
r.close()
assert signal.getsignal(signal.SIGTERM) is mine

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with shmbuf.create(ex, 2):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN

signal.signal(signal.SIGTERM, signal.SIG_DFL)
made = []
t = threading.Thread(target=lambda: made.append(shmbuf.create(ex, 2)))
t.start(); t.join()
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "installed from a thread"
made[0].close()

with shmbuf.create(ex, 2, keep_on_crash=True):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "installed for an object kept on a crash"
print("ok")
"""


def test_shmbufs_sigterm_handler_only_takes_sigterm_the_user_left_at_its_default() -> None:
    """Installed at the first watched object, from the main thread, over SIG_DFL only; put back at the last close
    if still ours; a user's handler (before or after), SIG_IGN, a thread or keep_on_crash: left alone."""
    p = subprocess.run([sys.executable, "-W", "error", "-c", SIGTERM_RULES], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


FORKED_CHILD = """
import multiprocessing as mp, os, signal, sys, time, numpy as np, shmbuf

def child(conn):
    conn.send(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    time.sleep(300)

if __name__ == "__main__":
    with shmbuf.create({"step": {"x": np.zeros((4, 2), np.float32)}}, 2):
        ctx = mp.get_context("fork")
        here, there = ctx.Pipe()
        p = ctx.Process(target=child, args=(there,))
        p.start()
        default = here.recv()
        p.terminate()
        p.join(30)
        print(default, p.exitcode)
"""


def test_a_forked_child_of_an_owner_dies_by_sigterm_as_before() -> None:
    """A child forked while its parent holds shmbuf's handler owns nothing: SIGTERM kills it by the signal, as if
    shmbuf had never been there (multiprocessing's terminate() and a pool's stop expect that)."""
    p = subprocess.run([sys.executable, "-W", "error", "-c", FORKED_CHILD], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["True", str(-signal.SIGTERM)], (p.stdout, p.stderr)


def test_the_watcher_takes_only_its_owners_words_and_only_shmbuf_names() -> None:
    from shmbuf._janitor import MAGIC, _Watcher, entry_ok

    assert entry_ok("shmbuf-0123456789abcdef") and entry_ok("shmbuf-w0123456789abcdef")
    for bad in ("sem.shmbuf-0123456789abcdef-r", "../etc/passwd", "shmbuf-../../x", "shmbuf-ABC", "other", "shmbuf-" + "a" * 40,
                "shmbuf-a/b", ""):
        assert not entry_ok(bad), bad
    w = _Watcher(1, 0, -1, -1)
    for line in [MAGIC.strip(), b"+ 1 2 shmbuf-0123456789abcdef", b"+ 1 2 ../../etc/passwd", b"+ x 2 shmbuf-aaaa",
                 b"+ 3 4 shmbuf-w0123456789abcdef", b"- shmbuf-w0123456789abcdef", b"garbage"]:
        w.take(line)
    assert w.names == {"shmbuf-0123456789abcdef": (1, 2)} and not w.foreign
    other = _Watcher(1, 0, -1, -1)
    other.take(b"not the magic")
    other.take(b"+ 1 2 shmbuf-0123456789abcdef")
    assert other.foreign and not other.names

