"""The substrate's internal API (docs/design/segment.md): names, the owned-object base, OFD locks, the codec, /proc."""

from __future__ import annotations

import fcntl
import gc
import os

import pytest

import shmbuf
from shmbuf import _codec, _names, _ofd, _proc
from shmbuf._closable import Closable
from shmbuf._shm import create_object, unlink_object, unmap


def test_every_name_kind_has_one_pattern_for_names_and_entries() -> None:
    for kind, prefix in (("pipeline", _names.PREFIX), ("weights", _names.WEIGHTS_PREFIX),
                         ("inference", _names.INFERENCE_PREFIX)):
        name = _names.new_name(prefix)
        assert _names.check_name(name, kind) == name and _names.check_name(name, "any") == name
        m = _names.entry_pattern(kind).match(name[1:])
        assert m and m.group(1) == name[-16:]
        with pytest.raises(shmbuf.UsageError, match="16 lowercase hex digits"):
            _names.check_name(name + "0", kind)
    for kind, role in (("pipeline", "f12"), ("inference", "c345")):
        name = _names.new_name(_names.INFERENCE_PREFIX if kind == "inference" else _names.PREFIX)
        sem = _names.sem_name(name, role)
        assert _names.check_sem_name(sem) == sem
        m = _names.entry_pattern(kind, semaphore=True).match("sem." + sem[1:])
        assert m and m.group(2) == role
    with pytest.raises(shmbuf.UsageError, match="semaphore name"):
        _names.check_sem_name(_names.new_name() + "-x")


class _Owned(Closable):
    _kind = "test object"

    def __init__(self, log: list[str], *, creator: bool) -> None:
        self.name = _names.new_name()
        self._fd, mm = create_object(self.name, 4096, "a test")
        unmap(mm)
        self._lifetime(_release, self._fd, self.name, log,
                       unlink=(lambda name=self.name: unlink_object(name)) if creator else None)


def _release(fd: int, name: str, log: list[str]) -> None:
    os.close(fd)
    log.append(name)


def _exists(name: str) -> bool:
    return os.path.exists(_names.shm_path(name))


def test_closable_releases_once_at_close_or_collection_and_only_the_creator_unlinks() -> None:
    log: list[str] = []
    with _Owned(log, creator=True) as a:
        assert _exists(a.name)
    assert log == [a.name]
    a.close()  # idempotent
    assert log == [a.name]
    assert _exists(a.name)  # close detaches; unlink destroys
    a.unlink()
    assert not _exists(a.name)

    b = _Owned(log, creator=False)
    name = b.name
    try:
        with pytest.raises(shmbuf.UsageError, match="only the process that created it unlinks it"):
            b.unlink()
        del b
        gc.collect()
        assert log[-1] == name  # released at collection, as close() would
    finally:
        unlink_object(name)


def test_ofd_lock_is_seen_from_another_description_and_dropped_with_it() -> None:
    name = _names.new_name()
    fd, mm = create_object(name, 4096, "a test")
    unmap(mm)
    other = os.open(_names.shm_path(name), os.O_RDWR | os.O_CLOEXEC)
    try:
        byte = _ofd.LOCK_BASE + 3
        assert _ofd.held(other, byte) is False
        _ofd.lock(fd, byte, fcntl.F_WRLCK)
        assert _ofd.held(other, byte) is True
        with pytest.raises(OSError) as exc:
            _ofd.lock(other, byte, fcntl.F_WRLCK)
        assert exc.value.errno in _ofd.BUSY
        os.close(fd)
        fd = -1
        assert _ofd.held(other, byte) is False
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(other)
        unlink_object(name)


def test_codec_round_trips_and_refuses_garbage_within_limits() -> None:
    msg = {"type": "stats", "counters": {"a": 1, "b": 2.5}, "text": "é"}
    assert _codec.unpack(_codec.pack(msg)) == msg
    with pytest.raises(_codec.NotMsgpack, match="not msgpack"):
        _codec.unpack(b"\xc1")
    with pytest.raises(_codec.NotMsgpack):
        _codec.unpack(_codec.pack(list(range(10))), max_array_len=4)
    with pytest.raises(_codec.NotMsgpack):
        _codec.unpack(_codec.pack({"bin": b"x"}))  # no bin values from others


def test_proc_reads_this_process() -> None:
    me = _proc.this_process()
    assert me.pid == os.getpid() and me.alive()
    assert _proc.start_time(os.getpid()) == me.start
    assert _proc.cpu_ticks() >= 0 and _proc.cpu_ticks(os.getpid()) >= 0
    busy, total = _proc.machine_ticks()
    assert 0 <= busy <= total
    assert _proc.stat_fields(2**31 - 1) is None  # no such process
