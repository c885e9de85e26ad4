"""Hostile and corrupt objects under shmbuf names: always a ShmbufError (or an `ls` entry saying why), never a crash.

/dev/shm is writable by every local user, so whatever sits under a shmbuf name is input. These
tests put there what another user, a crash or a stray bit could: malformed names, impossible
header values, symbolic links, directories, FIFOs, other users' files, files open to everyone,
and thousands of corrupted copies of a real segment. ``Segment.attach``/``Writer`` must answer
with a ShmbufError, ``shmbuf ls`` (``_admin.scan``) must list the object with the reason, and
``shmbuf clean`` (``_admin.remove``) must keep it, never following a link to delete its target.

Every object a test makes is named with a random token and removed at teardown, whatever it is.
"""

from __future__ import annotations

import copy
import hashlib
import json
import mmap
import os
import random
import secrets
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import posix_ipc
import pytest

import shmbuf
from shmbuf import SegmentError, ShmbufError, UsageError, _admin, _proc
from shmbuf._handle import Handle, name_of
from shmbuf._segment import (
    HEADER_BYTES,
    LIVE_BYTES,
    MAX_LANES,
    MAX_SLOTS,
    PIDNS_OFF,
    SHM_DIR,
    WEIGHTS_PREFIX,
    Segment,
    check_name,
    check_semaphore,
    new_name,
    open_object,
    plan,
    why_untrusted,
)
from shmbuf._weights import WeightPublisher, WeightsHandle, WeightSubscriber
from tests.conftest import small_example
from tests.helpers import ROOT

NOBODY = 65534
OFF_PID, OFF_START = 24, 32  # in the head every shmbuf header starts with
KINDS = ["symlink", "directory", "fifo", "other_uid", "open_mode"]
WHY = {
    "symlink": "a symbolic link",
    "directory": "a directory",
    "fifo": "a FIFO",
    "other_uid": f"owned by uid {NOBODY}",
    "open_mode": "mode 0644",
}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another uid's file takes root (os.chown); without root, "
                             "test_a_file_of_another_uid_is_refused_seen_from_a_user_namespace holds the same refusal")


def _kind_params() -> list[Any]:
    return [pytest.param(k, marks=as_root) if k == "other_uid" else k for k in KINDS]


# ------------------------------------------------------------------ helpers


def _path(name: str) -> str:
    return f"{SHM_DIR}/{name[1:]}"


def _remove_any(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(path)
    else:
        os.unlink(path)  # a link itself, never its target


@pytest.fixture
def fresh() -> Iterator[Callable[..., str]]:
    """``fresh()`` / ``fresh("weights")``: a new shmbuf name; every /dev/shm entry under one is removed at teardown."""
    made: set[str] = set()

    def make(kind: str = "pipeline") -> str:
        name = new_name() if kind == "pipeline" else WEIGHTS_PREFIX + secrets.token_hex(8)
        made.add(name[1:])
        return name

    yield make
    for entry in os.listdir(SHM_DIR):
        base = entry[4:].rsplit("-", 1)[0] if entry.startswith("sem.") else entry
        if base in made:
            _remove_any(f"{SHM_DIR}/{entry}")


def plant(path: str, data: bytes, mode: int = 0o600) -> None:
    """A new regular file at ``path`` holding ``data``: os.open (O_EXCL), ftruncate, mmap."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.ftruncate(fd, len(data))
        if data:
            with mmap.mmap(fd, len(data)) as mm:
                mm[:] = data
    finally:
        os.close(fd)


def plant_hostile(kind: str, path: str, *, target: str, data: bytes) -> None:
    """What another user (or a mistake) could leave at ``path``: ``target`` is what a link points to."""
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "other_uid":
        plant(path, data)
        os.chown(path, NOBODY, NOBODY)
    elif kind == "open_mode":
        plant(path, data, mode=0o644)
    else:  # pragma: no cover
        raise AssertionError(kind)


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def entry_of(name: str) -> _admin.Found:
    found = [f for f in _admin.scan(name=name) if f.name == name]
    assert len(found) == 1, f"scan() listed {len(found)} entries for {name}"
    return found[0]


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


@pytest.fixture
def pristine(make_reader: Any) -> tuple[Any, bytes]:
    """A real pipeline (its reader) and its segment's bytes as shmbuf.create wrote them."""
    reader = make_reader(small_example(), slots=2, max_writers=2)
    return reader, read_file(_path(reader.name))


def with_word(data: bytes, off: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<Q", out, off, value)
    return bytes(out)


# ------------------------------------------------------------------ names


BAD_NAMES = [
    "/shmbuf-" + "a" * 300,  # over NAME_MAX: a bare ValueError inside posix_ipc
    "/shmbuf-0123/456789abcdef",  # '/': a bare ValueError inside posix_ipc
    "/shmbuf-../../etc/passwd",
    "/shmbuf-0123456789ABCDEF",  # upper case: not what shmbuf makes
    "/shmbuf-0123456789abcdef\n",
    "/shmbuf-",
    "shmbuf-0123456789abcdef",
    "",
    b"/shmbuf-0123456789abcdef",
    42,
    None,
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[:24])
def test_malformed_names_are_usage_errors_everywhere(name: Any) -> None:
    for call in (Segment.attach, shmbuf.Writer, Handle, name_of, check_name):
        with pytest.raises(UsageError, match="16 lowercase hex digits|expected a shmbuf Handle"):
            call(name)
    with pytest.raises(UsageError):
        Segment.attach(name, readonly=True)
    with pytest.raises(UsageError):
        WeightsHandle(name)


def test_a_nul_byte_in_a_name_never_reaches_posix_ipc() -> None:
    """posix_ipc dies of SIGSEGV on a NUL byte: in a child, so that a crash fails this test instead of pytest."""
    code = r"""
import shmbuf
from shmbuf._segment import Segment
from shmbuf._weights import WeightSubscriber
from shmbuf._handle import Handle
for call in (Segment.attach, shmbuf.Writer, Handle, WeightSubscriber):
    for name in ("/shmbuf-0123456789abcde\0", "/shmbuf-\0", "/shmbuf-w0123456789abcde\0"):
        try:
            call(name)
        except shmbuf.UsageError:
            print("UsageError")
        else:
            print("accepted", name.encode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.split() == ["UsageError"] * 12, out.stdout


def test_weight_names_are_checked_by_the_same_rule(fresh: Callable[..., str]) -> None:
    name = fresh("weights")
    assert check_name(name, "weights") == name and WeightsHandle(name).name == name
    with pytest.raises(UsageError):
        check_name(name)  # a weight broadcast is not a pipeline
    with pytest.raises(UsageError):
        Handle(name)
    with pytest.raises(UsageError, match="'/shmbuf-w' followed by 16 lowercase hex digits"):
        WeightSubscriber("/shmbuf-w0123/")


# ------------------------------------------------------------------ settings


@pytest.mark.alone  # judges every new entry of /dev/shm: no other test may make one meanwhile
@pytest.mark.parametrize(
    ("kw", "setting"),
    [
        ({"slots": True}, "slots"),
        ({"slots": 0}, "slots"),
        ({"slots": 2.5}, "slots"),
        ({"slots": "4"}, "slots"),
        ({"slots": MAX_SLOTS + 1}, "slots"),
        ({"slots": 2, "max_writers": 0}, "max_writers"),
        ({"slots": 2, "max_writers": True}, "max_writers"),
        ({"slots": 2, "max_writers": MAX_LANES + 1}, "max_writers"),
        ({"slots": 2, "max_writers": 1.0}, "max_writers"),
    ],
)
def test_bad_create_settings_are_usage_errors(kw: dict[str, Any], setting: str) -> None:
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(UsageError, match=rf"shmbuf.create\({setting}=...\): expected an int from 1 to"):
        shmbuf.create(small_example(), **kw)
    assert not {e for e in set(os.listdir(SHM_DIR)) - before if "shmbuf-" in e}


def test_numpy_int_settings_are_accepted(make_reader: Any) -> None:
    reader = make_reader(small_example(), slots=np.int64(2), max_writers=np.int32(1))
    seg = Segment.attach(reader.name, readonly=True)
    try:
        assert (seg.plan.n_slots, seg.plan.n_lanes) == (2, 1) and type(seg.plan.n_slots) is int
    finally:
        seg.close()


def test_create_refuses_a_bad_name() -> None:
    schema = shmbuf.Schema.from_example(small_example())
    with pytest.raises(UsageError):
        Segment.create(schema, 2, 1, name="/shmbuf-../x")


# ------------------------------------------------------------------ header values


def test_alive_refuses_impossible_pids() -> None:
    for pid in (0, -5, 2**31, 2**40, 2**63 - 1, True):
        assert _proc.alive(pid, 0) is False  # was OverflowError from os.kill for the large ones
    assert _proc.alive(os.getpid(), _proc.start_time(os.getpid()))


def test_owner_pid_beyond_pid_t_is_refused_listed_and_kept(pristine: Any, fresh: Callable[..., str]) -> None:
    _, data = pristine
    name = fresh()
    plant(_path(name), with_word(data, OFF_PID, 2**40))
    with pytest.raises(SegmentError, match="owner pid 1099511627776 is no process id"):
        Segment.attach(name)
    with pytest.raises(SegmentError, match="no process id"):
        shmbuf.Writer(name)
    f = entry_of(name)
    assert "no process id" in f.error and not f.removable
    assert _admin.remove(f) == [] and os.path.exists(_path(name))


def test_a_dead_owner_in_our_pid_namespace_is_removable(pristine: Any, fresh: Callable[..., str]) -> None:
    """The control for the next test: same bytes, our namespace, a dead owner: clean removes it."""
    _, data = pristine
    name = fresh()
    plant(_path(name), with_word(with_word(data, OFF_PID, dead_pid()), OFF_START, 0))
    f = entry_of(name)
    assert not f.error and not f.owner_alive and not f.owner_elsewhere and f.removable
    assert _admin.remove(f) == [name] and not os.path.exists(_path(name))


def test_an_owner_in_another_pid_namespace_is_never_judged_dead(pristine: Any, fresh: Callable[..., str]) -> None:
    """Its pid means nothing here: what looks dead may be a live pipeline in another container."""
    reader, data = pristine
    assert Segment.attach(reader.name, readonly=True).creator.pidns == _proc.pid_namespace() != 0
    name = fresh()
    data = with_word(with_word(data, OFF_PID, dead_pid()), OFF_START, 0)
    plant(_path(name), with_word(data, PIDNS_OFF, _proc.pid_namespace() + 1))
    f = entry_of(name)
    assert not f.error and f.owner_elsewhere and not f.removable
    assert "another pid namespace" in f.why_kept
    assert _admin.remove(f) == [] and os.path.exists(_path(name))
    seg = Segment.attach(name)  # a writer may still attach: it is a sound segment
    try:
        assert seg.creator.elsewhere and seg.creator.alive()  # unknown, so never "dead"
    finally:
        seg.close()


def test_weights_owner_in_another_pid_namespace_is_kept(fresh: Callable[..., str]) -> None:
    pub = WeightPublisher({"w": np.zeros(3, np.float32)})
    try:
        data = read_file(_path(pub.name))
    finally:
        pub.close()
    assert struct.unpack_from("<Q", data, PIDNS_OFF)[0] == _proc.pid_namespace()
    data = with_word(with_word(data, OFF_PID, dead_pid()), OFF_START, 0)
    dead, elsewhere = fresh("weights"), fresh("weights")
    plant(_path(dead), data)
    plant(_path(elsewhere), with_word(data, PIDNS_OFF, _proc.pid_namespace() + 1))
    f = entry_of(elsewhere)
    assert f.weights and not f.error and f.owner_elsewhere and not f.removable
    assert _admin.remove(f) == [] and os.path.exists(_path(elsewhere))
    g = entry_of(dead)
    assert g.weights and not g.error and g.removable and _admin.remove(g) == [dead]


# ------------------------------------------------------------------ links, directories, FIFOs, other users


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", _kind_params())
def test_hostile_file_under_a_segment_name(kind: str, pristine: Any, fresh: Callable[..., str]) -> None:
    reader, data = pristine
    name = fresh()
    target = _path(reader.name)  # a link points at a real, sound pipeline: still refused
    plant_hostile(kind, _path(name), target=target, data=data)
    for attach in (lambda: Segment.attach(name), lambda: Segment.attach(name, readonly=True), lambda: shmbuf.Writer(name)):
        with pytest.raises(SegmentError, match=WHY[kind]):
            attach()
    with pytest.raises(SegmentError, match=WHY[kind]):
        open_object(name, readonly=True)
    f = entry_of(name)
    assert WHY[kind] in f.error and not f.removable and f.why_kept.startswith("unreadable")
    assert _admin.remove(f) == []
    assert os.path.lexists(_path(name)) and os.path.exists(target)  # kept, and the link's target untouched
    shmbuf.Writer(reader.handle).close()  # the real pipeline still works


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", _kind_params())
def test_hostile_file_under_a_weights_name(kind: str, fresh: Callable[..., str]) -> None:
    pub = WeightPublisher({"w": np.zeros(3, np.float32)})
    try:
        name = fresh("weights")
        plant_hostile(kind, _path(name), target=_path(pub.name), data=read_file(_path(pub.name)))
        with pytest.raises(SegmentError, match=WHY[kind]):
            WeightSubscriber(name)
        f = entry_of(name)
        assert f.weights and WHY[kind] in f.error and not f.removable
        assert _admin.remove(f) == [] and os.path.lexists(_path(name)) and os.path.exists(_path(pub.name))
    finally:
        pub.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", _kind_params())
def test_hostile_semaphore_file_is_refused_and_kept(kind: str, fresh: Callable[..., str]) -> None:
    """Orphan semaphores (the segment is gone): clean removes the real one, keeps the hostile one, says why."""
    name = fresh()
    real = posix_ipc.Semaphore(name + "-r", posix_ipc.O_CREX, mode=0o600)
    real.close()
    real_path = f"{SHM_DIR}/sem.{name[1:]}-r"
    other = fresh()  # a link's target: another real semaphore file of ours, which must survive
    posix_ipc.Semaphore(other + "-r", posix_ipc.O_CREX, mode=0o600).close()
    other_path = f"{SHM_DIR}/sem.{other[1:]}-r"
    hostile = f"{SHM_DIR}/sem.{name[1:]}-f0"
    plant_hostile(kind, hostile, target=other_path, data=read_file(real_path))
    check_semaphore(name + "-r")  # a real one passes
    check_semaphore(name + "-f7")  # a missing one is for sem_open to report
    with pytest.raises(SegmentError, match=WHY[kind]):
        check_semaphore(name + "-f0")
    f = entry_of(name)
    assert not f.segment and f.semaphores == [f"sem.{name[1:]}-r"]
    assert [(e, w) for e, w in f.kept if WHY[kind] in w] == [(f"sem.{name[1:]}-f0", f.kept[0][1])]
    assert _admin.remove(f) == [f"sem.{name[1:]}-r"]
    assert not os.path.exists(real_path) and os.path.lexists(hostile) and os.path.exists(other_path)


def _stat(mode: int, uid: int) -> os.stat_result:
    """An ``os.stat_result`` of the given mode and owner (the rest zero): what fstat would say of such a file."""
    return os.stat_result((mode, 0, 0, 1, uid, 0, 4096, 0, 0, 0))


def test_why_untrusted_refuses_every_kind_and_every_other_uid() -> None:
    """The check behind every open: a regular 0600 file of this euid passes; another uid (whatever its mode),
    group or other bits, links, directories, FIFOs and devices are named. Runs as any user: the stat is made here."""
    me = os.geteuid()
    assert why_untrusted(_stat(stat.S_IFREG | 0o600, me)) == ""
    assert why_untrusted(_stat(stat.S_IFREG | 0o400, me)) == ""
    for other in {0, 1, NOBODY, me + 1, 2**32 - 2} - {me}:
        for mode in (0o600, 0o644, 0o000):
            assert why_untrusted(_stat(stat.S_IFREG | mode, other)) == f"owned by uid {other}, not by this user (uid {me})"
    for bits in (0o640, 0o604, 0o660, 0o601, 0o610, 0o777):
        want = f"mode {bits:04o}, open to other users (shmbuf makes its objects 0600)"
        assert why_untrusted(_stat(stat.S_IFREG | bits, me)) == want
    for kind, why in ((stat.S_IFLNK, WHY["symlink"]), (stat.S_IFDIR, WHY["directory"]), (stat.S_IFIFO, WHY["fifo"])):
        for uid in (me, me + 1):
            assert why_untrusted(_stat(kind | 0o600, uid)) == why
    for kind in (stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
        assert why_untrusted(_stat(kind | 0o600, me)).startswith("not a regular file (")


# Run in a child: become an ordinary user if root (the interpreter and every module are loaded first, so that a
# home directory closed to that user does not matter), enter a new user and mount namespace in which this user is
# uid 0, and bind a file of another uid (root's, unmapped in there, so it reads as the overflow uid 65534) over a
# segment name and a semaphore name of ours. The kernel then reports, from the descriptor shmbuf opens, a file
# that is not this user's: no chown, no root. Exit 77: no user namespace on this machine.
_USERNS_CHILD = r"""
import ctypes, json, os, sys
import shmbuf
from shmbuf import _admin
from shmbuf._segment import Segment, check_semaphore, open_object
import shmbuf.storage  # what _admin imports when it scans, loaded while the interpreter's files are readable

name, foreign = sys.argv[1], sys.argv[2]
seg_path, sem_path = "/dev/shm/" + name[1:], "/dev/shm/sem." + name[1:] + "-r"
libc = ctypes.CDLL(None, use_errno=True)
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a uid change made /proc/self root's, and its maps ours to write
uid, gid = os.geteuid(), os.getegid()
CLONE_NEWUSER, CLONE_NEWNS, MS_BIND = 0x10000000, 0x00020000, 4096
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
    print("unshare:", os.strerror(ctypes.get_errno()))
    sys.exit(77)
for f, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
    with open("/proc/self/" + f, "w") as fh:
        fh.write(text)
for path in (seg_path, sem_path):
    if libc.mount(foreign.encode(), path.encode(), None, MS_BIND, None) != 0:
        print("mount:", os.strerror(ctypes.get_errno()))
        sys.exit(77)
out = {"euid": os.geteuid(), "st_uid": os.stat(seg_path).st_uid, "refused": []}
for what, call in (("attach", lambda: Segment.attach(name)), ("attach readonly", lambda: Segment.attach(name, readonly=True)),
                   ("Writer", lambda: shmbuf.Writer(name, timeout=1)), ("open_object", lambda: open_object(name, readonly=True)),
                   ("check_semaphore", lambda: check_semaphore(name + "-r"))):
    try:
        call()
        out["refused"].append([what, None])
    except shmbuf.SegmentError as exc:
        out["refused"].append([what, str(exc)])
found = [f for f in _admin.scan(name=name) if f.name == name]
out["scan"] = [[f.error, f.removable, f.kept] for f in found]
out["removed"] = [_admin.remove(f) for f in found]
print(json.dumps(out))
"""


def _foreign_file() -> str:
    """A regular file of another uid that any user can reach: root's own, or (when we are root) NOBODY's view of it."""
    for path in ("/bin/sh", "/usr/bin/env", sys.executable, "/etc/passwd"):
        real = os.path.realpath(path)
        st = os.stat(real)
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o004:
            return real
    raise AssertionError("no world-readable regular file of root's found to stand for another user's file")


@pytest.mark.timeout(60)
def test_a_file_of_another_uid_is_refused_seen_from_a_user_namespace(fresh: Callable[..., str]) -> None:
    """Another uid's file under a shmbuf name, for any user: the same refusals as the root-only ``other_uid`` cases.

    As root (CI), the child drops to nobody first, so this is the path an unprivileged user runs; no user
    namespace there is a failure as root, a skip otherwise (the ``other_uid`` cases then hold it, as root).
    """
    name = fresh()
    plant(_path(name), b"\0" * 4096)
    plant(f"{SHM_DIR}/sem.{name[1:]}-r", b"\0" * 32)
    foreign = _foreign_file()
    out = subprocess.run([sys.executable, "-W", "error", "-c", _USERNS_CHILD, name, foreign], capture_output=True,
                         text=True, timeout=50, cwd=ROOT,
                         # unshare(CLONE_NEWUSER) refuses a process with threads: no BLAS thread pool
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                                  MKL_NUM_THREADS="1"))
    if out.returncode == 77 and os.geteuid() != 0:
        pytest.skip(f"no unprivileged user namespace here ({out.stdout.strip()}); as root the other_uid cases run")
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["euid"] == 0 and got["st_uid"] == NOBODY, got  # the kernel's view: this user is 0, the file another's
    want = f"is owned by uid {NOBODY}, not by this user (uid 0)"
    for what, message in got["refused"]:
        assert message is not None and want in message, f"{what}: {message}"
    assert [w for w, _ in got["refused"]] == ["attach", "attach readonly", "Writer", "open_object", "check_semaphore"]
    [(error, removable, kept)] = got["scan"]
    assert want[3:] in error and not removable, got["scan"]
    assert any(entry == f"sem.{name[1:]}-r" and want[3:] in why for entry, why in kept), kept
    assert got["removed"] == [[]]  # clean removes nothing
    assert os.path.exists(_path(name)) and os.path.exists(f"{SHM_DIR}/sem.{name[1:]}-r")  # ours, untouched out here


def test_check_semaphore_refuses_malformed_names() -> None:
    for bad in ("/shmbuf-0123456789abcdef-x", "/shmbuf-0123456789abcdef-r\0", "/etc/passwd", 3):
        with pytest.raises(UsageError):
            check_semaphore(bad)  # type: ignore[arg-type]  # the int among them is part of the test


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", _kind_params())
def test_writer_refuses_a_hostile_doorbell(kind: str, make_reader: Any) -> None:
    """A live pipeline whose doorbell semaphore file was replaced: Writer() refuses it with a ShmbufError."""
    reader = make_reader(small_example(), slots=2, max_writers=2)
    tail = reader.name[1:]
    bell = f"{SHM_DIR}/sem.{tail}-r"
    saved = read_file(bell)
    os.unlink(bell)
    try:
        plant_hostile(kind, bell, target=f"{SHM_DIR}/sem.{tail}-f1", data=saved)
        with pytest.raises(ShmbufError, match=WHY[kind]):
            shmbuf.Writer(reader.handle, timeout=5)
        f = entry_of(reader.name)
        assert any(e == f"sem.{tail}-r" and WHY[kind] in w for e, w in f.kept)
        assert os.path.exists(f"{SHM_DIR}/sem.{tail}-f1")
    finally:
        _remove_any(bell)


def test_segment_fd_stays_open_while_attached(make_reader: Any) -> None:
    reader = make_reader(small_example(), slots=2, max_writers=1)
    seg = Segment.attach(reader.name)
    fd = seg.fd
    assert fd >= 0 and os.fstat(fd).st_ino == os.stat(_path(reader.name)).st_ino
    seg.close()
    assert seg.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)


# ------------------------------------------------------------------ fuzz

FUZZ_TRIALS = 6000
WORDS = [0, 1, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1, 2**64 - 1, 256, 512, 4096]


def _corrupt(rng: random.Random, data: bytes, schema_end: int) -> bytes:
    """Flip bits, write bytes or whole words into the header and schema (not the live words); maybe resize."""
    buf = bytearray(data)
    regions = [(0, HEADER_BYTES), (HEADER_BYTES + LIVE_BYTES, schema_end)]
    for _ in range(rng.randint(1, 4)):
        lo, hi = rng.choice(regions)
        at = rng.randrange(lo, hi)
        how = rng.random()
        if how < 0.4:
            buf[at] ^= 1 << rng.randrange(8)
        elif how < 0.7:
            buf[at] = rng.randrange(256)
        else:
            at = min(at - at % 8, hi - 8)
            word = rng.choice(WORDS + [len(data), len(data) + 64, rng.getrandbits(64)])
            struct.pack_into("<Q", buf, at, word)
    r = rng.random()
    if r < 0.08:
        del buf[rng.randrange(len(buf)) :]  # truncated, down to nothing
    elif r < 0.14:
        buf.extend(bytes(rng.choice([1, 64, 4096, 65536])))
    return bytes(buf)


@pytest.mark.timeout(120)
def test_fuzz_corrupt_copies_of_a_real_segment(pristine: Any, fresh: Callable[..., str]) -> None:
    """Thousands of corrupted copies of a real segment, each under a fresh name: attach, ls and clean answer
    with success or a ShmbufError (an `ls` entry with an error), never another exception, crash or hang."""
    reader, data = pristine
    schema_end = HEADER_BYTES + LIVE_BYTES + len(reader.schema.to_msgpack())
    rng = random.Random(20261121)
    seen = {"attached": 0, "refused": 0, "listed unreadable": 0, "removed": 0, "kept": 0}
    t0 = time.monotonic()
    for trial in range(FUZZ_TRIALS):
        blob = _corrupt(rng, data, schema_end)
        name = fresh()
        path = _path(name)
        plant(path, blob)
        try:
            try:
                seg = Segment.attach(name, readonly=trial % 2 == 1)
            except ShmbufError:
                seen["refused"] += 1
            else:
                try:  # what got through is a sound segment: the layout fits the object
                    p = seg.plan
                    assert p.total == len(blob) == len(seg.mm) and seg.schema == reader.schema
                    seen["attached"] += 1
                finally:
                    seg.close()
            f = entry_of(name)
            seen["listed unreadable"] += bool(f.error)
            removed = _admin.remove(f)
            if f.removable:
                assert removed == [name] and not os.path.exists(path)
                seen["removed"] += 1
            else:
                assert removed == [] and os.path.exists(path)
                seen["kept"] += 1
        finally:
            _remove_any(path)
    print(f"{FUZZ_TRIALS} trials in {time.monotonic() - t0:.1f} s: {seen}")
    assert seen["refused"] > FUZZ_TRIALS // 3 and seen["attached"] > 0
    assert seen["listed unreadable"] >= seen["refused"]


def _deep(n: int) -> list[Any]:
    node: list[Any] = ["leaf", 0]
    for _ in range(n):
        node = ["list", [node]]
    return node


VALUES: list[Callable[[], Any]] = [
    lambda: 0, lambda: -1, lambda: 2**40, lambda: 2**64 - 1, lambda: True, lambda: None, lambda: "", lambda: 1.5,
    lambda: ",f4", lambda: "<f4", lambda: "O", lambda: "V8", lambda: "<U4", lambda: "f8,i4", lambda: "(2,)f8",
    lambda: "|b1", lambda: "<M8[s]", lambda: [], lambda: [0] * 40, lambda: [2**40] * 3, lambda: {"a": 1},
    lambda: ["leaf", 0], lambda: ["leaf", -1], lambda: ["leaf", 99], lambda: ["none"], lambda: ["bogus", 1],
    lambda: ["namedtuple", "1bad", ["x"], [["leaf", 0]]], lambda: ["namedtuple", "T", ["x", "x"], [["leaf", 0]] * 2],
    lambda: ["dict", ["b", "a"], [["leaf", 0], ["leaf", 1]]], lambda: ["dict", [1], [["leaf", 0]]],
    lambda: _deep(70), lambda: _deep(200), lambda: [["step", "obs"], "<f4", [16, 4]],
]


def _nodes(x: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in list(items):
        out.append((x, k))
        _nodes(v, out)
    return out


@pytest.mark.timeout(120)
def test_fuzz_well_formed_msgpack_schemas(pristine: Any, fresh: Callable[..., str]) -> None:
    """Schemas that are valid msgpack with a matching fingerprint but wrong inside (dtypes numpy parses as
    Python, nesting hundreds deep, wild shapes and leaf indices): the checks past the msgpack decoder."""
    reader, data = pristine
    schema_off = HEADER_BYTES + LIVE_BYTES
    base = msgpack.unpackb(reader.schema.to_msgpack())
    n_slots, n_lanes = struct.unpack_from("<II", data, 48)
    rng = random.Random(8)
    seen = {"attached": 0, "refused": 0}
    for _ in range(1500):
        obj = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            box, key = rng.choice(_nodes(obj, []))
            box[key] = rng.choice(VALUES)()
        try:
            packed = msgpack.packb(obj, use_bin_type=True)
        except ValueError:  # nested past msgpack's own packing limit (two deep nodes, one inside the other)
            continue
        size = len(data)
        try:  # steer half the cases past the size check: the object as large as the new schema calls for
            if rng.random() < 0.5:
                size = min(plan(shmbuf.Schema.from_msgpack(packed), n_slots, n_lanes).total, 1 << 22)
        except ShmbufError:
            pass
        size = max(size, schema_off + len(packed))
        blob = bytearray(size)
        blob[:schema_off] = data[:schema_off]
        blob[schema_off : schema_off + len(packed)] = packed
        struct.pack_into("<Q", blob, 16, size)
        struct.pack_into("<Q", blob, 64, len(packed))
        blob[88:104] = hashlib.sha256(packed).hexdigest()[:16].encode()
        name = fresh()
        plant(_path(name), bytes(blob))
        try:
            try:
                seg = Segment.attach(name, readonly=True)
            except ShmbufError:
                seen["refused"] += 1
            else:
                try:
                    assert seg.plan.total == size and seg.schema.to_msgpack() == packed
                    seen["attached"] += 1
                finally:
                    seg.close()
            f = entry_of(name)
            assert _admin.remove(f) == [] and os.path.exists(_path(name))  # the owner (this process) lives
        finally:
            _remove_any(_path(name))
    print(seen)
    assert seen["refused"] > 500
