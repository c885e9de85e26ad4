"""Segment: owner-only, unguessable short names, space reserved or refused, headers never trusted."""

from __future__ import annotations

import mmap
import os
import stat
import struct
from typing import Any

import numpy as np
import posix_ipc
import pytest

import shmbuf
from shmbuf import NoSpace, SegmentError
from shmbuf._segment import HEADER_BYTES, LAYOUT_VERSION, MAGIC, PREFIX, Segment, new_name, sem_name
from tests.conftest import small_example


def test_segment_and_semaphores_are_owner_only(make_reader: Any) -> None:
    reader = make_reader(small_example(), slots=2, max_writers=2)
    tail = reader.name[1:]
    entries = [tail, "sem." + tail + "-r", "sem." + tail + "-f0", "sem." + tail + "-f1"]
    for entry in entries:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{entry}").st_mode)
        assert mode == 0o600, f"{entry} has mode {mode:o}"


def test_names_are_random_prefixed_and_fit_macos_limit(make_reader: Any) -> None:
    names = {new_name() for _ in range(1000)}
    assert len(names) == 1000
    for n in list(names)[:50]:
        assert n.startswith(PREFIX) and len(n) == 24
        assert len(sem_name(n, "f255")) <= 31  # macOS: 31 characters, leading slash included
    a = make_reader(small_example(), slots=1)
    b = make_reader(small_example(), slots=1)
    assert a.name != b.name


@pytest.mark.alone  # compares all of /dev/shm before and after: no other test may change it meanwhile
def test_too_large_for_dev_shm_is_refused_with_sizes_and_nothing_left() -> None:
    before = set(os.listdir("/dev/shm"))
    huge = {"step": {"obs": np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (64, 1 << 30), (0, 0))}}
    with pytest.raises(NoSpace) as info:
        shmbuf.create(huge, slots=64)
    msg = str(info.value)
    assert "needs 4.0 TiB of shared memory" in msg and "/dev/shm has" in msg and "--shm-size" in msg
    assert isinstance(info.value, OSError)
    assert set(os.listdir("/dev/shm")) == before


def test_space_is_reserved_at_creation(make_reader: Any) -> None:
    reader = make_reader({"step": {"obs": np.zeros((8, 1 << 20), np.uint8)}}, slots=4)
    st = os.stat("/dev/shm/" + reader.name[1:])
    assert st.st_blocks * 512 >= 4 * 8 * (1 << 20)  # allocated, not a sparse promise


def test_attach_to_a_missing_name() -> None:
    with pytest.raises(SegmentError, match="no pipeline named '/shmbuf-0000000000000000'"):
        shmbuf.Writer("/shmbuf-0000000000000000")
    with pytest.raises(ValueError, match="starts with '/shmbuf-'"):
        shmbuf.Writer("/not-ours")


def _foreign(size: int, content: bytes) -> str:
    name = new_name()
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    with mmap.mmap(shm.fd, size) as mm:
        mm[: len(content)] = content
    shm.close_fd()
    return name


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"\x00" * 64, "not a shmbuf segment"),
        (b"hello world", "not a shmbuf segment"),
        (MAGIC + struct.pack("<I", LAYOUT_VERSION + 1),
         f"layout version {LAYOUT_VERSION + 1}, this shmbuf reads version {LAYOUT_VERSION}"),
    ],
)
def test_foreign_or_other_version_segments_are_refused(content: bytes, pattern: str) -> None:
    name = _foreign(8192, content)
    try:
        with pytest.raises(SegmentError, match=pattern):
            shmbuf.Writer(name)
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_tiny_object_is_refused() -> None:
    name = _foreign(16, b"")
    try:
        with pytest.raises(SegmentError, match="too small to be a shmbuf segment"):
            Segment.attach(name)
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_header_fuzz_never_gives_a_wild_view(make_reader: Any) -> None:
    """Random bytes over every header field and the schema: attach either refuses or yields a sane plan."""
    reader = make_reader(small_example(), slots=3, max_writers=2)
    path = "/dev/shm/" + reader.name[1:]
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pristine = f.read(HEADER_BYTES + 2048)
    schema_end = HEADER_BYTES + 256 + len(reader.schema.to_msgpack())
    rng = np.random.default_rng(1)
    outcomes = {"refused": 0, "accepted": 0}
    pristine_plan = reader._plan
    shm = posix_ipc.SharedMemory(reader.name, 0)
    mm = mmap.mmap(shm.fd, size)
    shm.close_fd()
    try:
        for case in range(3000):
            mm[: len(pristine)] = pristine
            span = HEADER_BYTES if case % 2 else schema_end
            for _ in range(int(rng.integers(1, 5))):
                at = int(rng.integers(0, span))
                if at >= 256 and at < 512:  # live words are not part of the header
                    continue
                n = int(rng.integers(1, 9))
                mm[at : at + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            try:
                seg = Segment.attach(reader.name)
            except SegmentError:
                outcomes["refused"] += 1
                continue
            try:
                p = seg.plan
                # a corruption that got through touched nothing structural: same layout, same schema
                assert p == pristine_plan and seg.schema == reader.schema
                assert p.total == size
                for i in range(len(seg.schema.leaves)):
                    v = seg.leaf_view(i)
                    end = p.leaf_offs[i] + (p.n_slots - 1) * seg.schema.leaves[i].stride + seg.schema.leaves[i].nbytes
                    assert end <= size
                    del v
                outcomes["accepted"] += 1
            finally:
                seg.close()
        mm[: len(pristine)] = pristine
    finally:
        mm.close()
    assert outcomes["refused"] > 1000  # corruptions of layout fields are caught...
    assert sum(outcomes.values()) == 3000  # ...and none crashed, escaped the mapping or changed the layout


def test_create_and_attach_keep_the_file_open_until_close(make_reader: Any) -> None:
    """seg.fd is the object's own file (a writer locks its lane on it); close() closes it."""
    reader = make_reader(small_example(), slots=2, max_writers=1)
    seg = Segment.attach(reader.name)
    try:
        assert os.fstat(seg.fd).st_ino == os.stat("/dev/shm/" + reader.name[1:]).st_ino
        assert seg.creator.pid == os.getpid() and seg.creator.alive()
    finally:
        seg.close()
    assert seg.fd == -1
    seg.close()  # twice is fine


def test_segments_are_0600_whatever_the_umask(make_reader: Any) -> None:
    old = os.umask(0o277)  # would leave the owner without write
    try:
        reader = make_reader(small_example(), slots=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat("/dev/shm/" + reader.name[1:]).st_mode) == 0o600
