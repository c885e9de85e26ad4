"""shmbuf ls / clean: see everything, remove only what dead owners left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import msgpack
import posix_ipc
import pytest

import shmbuf
from shmbuf import _admin
from shmbuf._cli import main
from tests.conftest import shm_objects, small_example
from tests.helpers import CTX


def _owner(conn: Any) -> None:
    """A pipeline's owner, to be SIGKILLed: keep_on_crash, so that its watcher leaves what `shmbuf clean` is tested on."""
    reader = shmbuf.create(small_example(), slots=2, max_writers=2, keep_on_crash=True)
    conn.send_bytes(msgpack.packb(reader.name))
    import time

    time.sleep(60)  # killed long before


@pytest.fixture
def orphan() -> Any:
    """A pipeline whose owner was SIGKILLed: exactly what a crash leaves."""
    rx, tx = CTX.Pipe(duplex=False)
    p = CTX.Process(target=_owner, args=(tx,), daemon=True)
    p.start()
    assert rx.poll(20)
    name = msgpack.unpackb(rx.recv_bytes())
    os.kill(p.pid, signal.SIGKILL)
    p.join(5)
    yield name
    shmbuf._segment.unlink_all(name, 2)


def test_ls_shows_live_and_dead_owners(make_reader: Any, orphan: str, capsys: Any) -> None:
    live = make_reader(small_example(), slots=3, max_writers=1)
    w = shmbuf.Writer(live.handle, label="ls-test")
    live.poll()
    assert main(["ls", "-v"]) == 0
    out = capsys.readouterr().out
    assert f"{live.name}  open, owner pid {os.getpid()} alive" in out and "3 slots, 1 lanes" in out
    assert f"writer lane 0 (ls-test): pid {os.getpid()} alive" in out
    assert "schema: episode[single-item x1]" in out
    assert f"{orphan}  open, owner pid" in out and "DEAD (removable by `shmbuf clean`)" in out
    w.close()


@pytest.mark.alone  # `shmbuf clean` removes every dead owner's objects on the machine: another test's may be in use
def test_clean_removes_only_dead_owners_objects(make_reader: Any, orphan: str, capsys: Any) -> None:
    live = make_reader(small_example(), slots=1)
    assert main(["clean", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove: {orphan}" in out and f"kept {live.name}: owner pid {os.getpid()} is alive" in out
    assert any(orphan[1:] in e for e in shm_objects())  # dry run removed nothing
    assert main(["clean"]) == 0
    out = capsys.readouterr().out
    assert f"removed: {orphan}" in out
    assert not any(orphan[1:] in e for e in shm_objects())  # segment and its semaphores
    assert any(live.name[1:] in e for e in shm_objects())  # the live one untouched
    shmbuf.Writer(live.handle).close()  # and still usable


@pytest.mark.parametrize("named", [True, False])
def test_clean_after_a_pid_waits_for_it_then_removes_only_what_it_created(orphan: str, named: bool) -> None:
    """`shmbuf clean --after PID [NAME]`: a janitor for a process that may be SIGKILLed (RayCollector's node owners).

    The orphan (another dead owner's pipeline) stays either way: --after removes only PID's objects.
    """
    rx, tx = CTX.Pipe(duplex=False)
    owner = CTX.Process(target=_owner, args=(tx,), daemon=True)
    owner.start()
    janitor, name = None, None
    try:
        assert rx.poll(20)
        name = msgpack.unpackb(rx.recv_bytes())
        janitor = subprocess.Popen([sys.executable, "-m", "shmbuf", "clean", "--after", str(owner.pid)] + [name] * named,
                                   stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            janitor.wait(1.0)  # the owner lives: the janitor waits and removes nothing
        assert any(name[1:] in e for e in shm_objects())
        os.kill(owner.pid, signal.SIGKILL)
        out, _ = janitor.communicate(timeout=20)
        assert janitor.returncode == 0 and f"removed: {name}" in out, out
        assert not any(name[1:] in e for e in shm_objects())
        assert any(orphan[1:] in e for e in shm_objects()), "clean --after removed another owner's pipeline"
    finally:
        if janitor is not None and janitor.poll() is None:
            janitor.kill()
            janitor.wait(5)
        if owner.is_alive():
            os.kill(owner.pid, signal.SIGKILL)
        owner.join(5)
        if name is not None:
            shmbuf._segment.unlink_all(name, 2)


@pytest.mark.alone  # `shmbuf clean` removes every dead owner's objects on the machine: another test's may be in use
def test_clean_removes_semaphores_whose_segment_is_gone(capsys: Any) -> None:
    name = shmbuf._segment.new_name()
    sem = posix_ipc.Semaphore(name + "-r", posix_ipc.O_CREX, mode=0o600)
    sem.close()
    found = [f for f in _admin.scan() if f.name == name]
    assert len(found) == 1 and not found[0].segment and found[0].removable
    main(["clean"])
    assert not any(name[1:] in e for e in shm_objects())


@pytest.mark.alone  # `shmbuf clean` removes every dead owner's objects on the machine: another test's may be in use
def test_unreadable_segment_is_kept_and_reported(capsys: Any) -> None:
    name = shmbuf._segment.new_name()
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    shm.close_fd()
    try:
        main(["clean"])
        out = capsys.readouterr().out
        assert f"kept {name}: unreadable" in out
        assert any(name[1:] in e for e in shm_objects())
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_command_line_entry_point_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "shmbuf", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout and "clean" in out.stdout


def _help(argv: list[str], capsys: Any) -> str:
    """What ``shmbuf <argv> --help`` prints, whitespace-normalised (argparse wraps to the terminal's width)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_demo_help_shows_every_default(capsys: Any) -> None:
    out = _help(["demo", "--help"], capsys)
    for option, default in (("--seconds", "10.0"), ("--actors", "2"), ("--envs", "8"), ("--steps", "64")):
        assert f"{option} {option.upper()[2:]} " in out, out
        text = out.split(f"{option} {option.upper()[2:]} ", 1)[1]
        assert text.split("--", 1)[0].rstrip().endswith(f"(default: {default})"), (option, out)


def test_bench_help_calls_itself_shmbuf_bench(capsys: Any) -> None:
    pytest.importorskip("tqdm")  # the bench's own imports; `make test` installs them
    out = _help(["bench", "--help"], capsys)
    assert out.startswith("usage: shmbuf bench [-h] [--quick]"), out
    assert "run.py" not in out.split("Runs shmbuf")[0]  # the usage line names the command the user typed


def test_demo_runs_and_its_actors_leave_cleanly(capsys: Any) -> None:
    """`make demo`, the README's first command, in miniature: every actor exits 0 and nothing is left in /dev/shm."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("tqdm")
    assert main(["demo", "--seconds", "1", "--actors", "1", "--envs", "2", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "actors exited        1/1 cleanly" in out and "left in /dev/shm     nothing" in out


def _planted(monkeypatch: Any, *found: _admin.Found) -> list[str]:
    """Make ``scan`` find exactly ``found``; return the list that records every ``remove`` call."""
    removed: list[str] = []
    monkeypatch.setattr(_admin, "scan", lambda: list(found))
    monkeypatch.setattr(_admin, "remove", lambda f: removed.append(f.name) or [f.name])
    return removed


def test_owner_in_another_pid_namespace_is_neither_dead_nor_removed(monkeypatch: Any, capsys: Any) -> None:
    """Its pid means nothing here: ls must not call it DEAD and removable, clean must keep it and say why."""
    name = shmbuf._segment.new_name()
    f = _admin.Found(name, segment=True, owner_pid=4242, owner_elsewhere=True, slots=2, lanes=1)
    removed = _planted(monkeypatch, f)
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "owner pid 4242 in another pid namespace" in out and "DEAD" not in out
    for argv in (["clean", "--dry-run"], ["clean"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"kept {name}: owner (pid 4242 there) is in another pid namespace" in out and "remove" not in out.split("kept")[0]
    assert removed == []


def test_files_clean_keeps_are_listed_with_the_reason(monkeypatch: Any, capsys: Any) -> None:
    """A foreign file under a shmbuf name (a link, a directory, another user's): shown with why, never 'removed'."""
    name = shmbuf._segment.new_name()
    entry = f"sem.{name[1:]}-r"
    f = _admin.Found(name, segment=False, kept=[(entry, "a symbolic link, not a file shmbuf made")])
    removed = _planted(monkeypatch, f)
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert f"{entry}: a symbolic link, not a file shmbuf made (`shmbuf clean` never removes it)" in out
    assert "orphan semaphore" not in out
    for argv in (["clean", "--dry-run"], ["clean"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out == f"kept {entry}: a symbolic link, not a file shmbuf made\n"
    assert removed == []


@pytest.mark.parametrize("argv, told", [
    (["--envs", "0"], "argument --envs: expected an int >= 1, got '0'"),
    (["--actors", "-1"], "argument --actors: expected an int >= 1, got '-1'"),
    (["--seconds", "nan"], "argument --seconds: expected a number >= 0.1, got 'nan'"),
])
def test_demo_refuses_what_it_cannot_run(argv: list[str], told: str, capsys: Any) -> None:
    """--envs 0 used to start actors that died at once, and the demo then waited 60 s for a first rollout."""
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    assert exit_.value.code == 2 and told in capsys.readouterr().err


def test_demo_says_at_once_when_every_actor_died(make_reader: Any) -> None:
    """It waits for the first rollout in short slices and looks at the actors between them."""
    from types import SimpleNamespace

    from shmbuf._demo import _first_rollout

    reader = make_reader(small_example(), slots=2)
    dead = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=-9)]
    with pytest.raises(shmbuf.BrokenPipeline, match=r"every actor exited before its first rollout \(exit codes 1, -9\)"):
        _first_rollout(reader, dead, timeout=60.0)  # returns after one slice
    starting = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=1)]
    with pytest.raises(shmbuf.SlotTimeout):
        _first_rollout(reader, starting, timeout=0.2)


def test_ls_shows_a_replay_buffer_and_clean_removes_a_dead_owners(capsys) -> None:
    """shmbuf ls and clean know the learner-side replay buffer: listed as one, and removed once its owner is dead."""
    import numpy as np

    from shmbuf.storage import ReplayBuffer

    with ReplayBuffer.create({"x": np.zeros(3, np.float32)}, 16) as rb:
        rb.insert({"x": np.ones((5, 3), np.float32)})
        main(["ls"])
        out = capsys.readouterr().out
        assert f"{rb.name}  replay buffer, owner pid {os.getpid()} alive" in out and "16 rows, 5 rows inserted" in out

    rx, tx = CTX.Pipe(duplex=False)

    def owner() -> None:
        b = ReplayBuffer.create({"x": np.zeros(3, np.float32)}, 8, keep_on_crash=True)  # kept for clean, not its watcher
        tx.send_bytes(b.name.encode())
        signal.pause()

    p = CTX.Process(target=owner, daemon=True)
    p.start()
    try:
        assert rx.poll(10)
        name = rx.recv_bytes().decode()
    finally:
        p.kill()
        p.join(5)
    found = [f for f in _admin.scan() if f.name == name]
    assert found and found[0].replay and found[0].removable
    assert name in _admin.remove(found[0])
    assert not os.path.exists("/dev/shm" + name)


def test_convert_needs_allow_pickle_then_turns_a_002_recording_into_shmbufs_format(tmp_path: Any, capsys: Any) -> None:
    from shmbuf.storage.files import RolloutDataset
    from tests.helpers_storage import write_fork_recording

    write_fork_recording(tmp_path / "fork")
    assert main(["convert", str(tmp_path / "fork"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unpickling runs whatever code" in err and "--allow-pickle" in err and not (tmp_path / "out").exists()
    assert main(["convert", "--allow-pickle", str(tmp_path / "fork"), str(tmp_path / "out")]) == 0
    assert "converted 3 trajectories" in capsys.readouterr().out
    assert RolloutDataset(tmp_path / "out", num_envs=3).get_batch(3).observation.shape == (3, 3, 7)
    assert main(["convert", "--allow-pickle", str(tmp_path / "fork"), str(tmp_path / "out")]) == 1
    assert "is not empty" in capsys.readouterr().err


def test_convert_help_says_it_is_unsafe_for_untrusted_files(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = capsys.readouterr().out
    assert "UNSAFE" in out and "--allow-pickle" in out
