"""Weight broadcast: versions are never torn, the publisher never waits, nothing is left behind."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import time
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf._weights import MAX_BUFFERS, W_LAYOUT_VERSION, W_MAGIC, WeightPublisher, WeightsHandle, WeightSubscriber

N_A = 16384  # float64: 128 KiB, so a copy takes long enough to be overtaken
N_B = 4096


def _params(version: int) -> dict:
    return {
        "a": np.full(N_A, float(version), np.float64),
        "layers": [np.full(N_B, version * 7 + 1, np.int64), np.full((8, 8), version % 251, np.uint8)],
    }


def _torn(version: int, tree: dict) -> bool:
    """The checksum of a version: every element of every leaf says which version it belongs to."""
    a, (b, c) = tree["a"], tree["layers"]
    return not (
        np.all(a == float(version)) and np.all(b == version * 7 + 1) and np.all(c == version % 251)
    )


def _reader_proc(name: str, last: Any, counts: Any, conn) -> None:
    """Read as fast as possible until the version in ``last`` (set at the end) is seen; keep ``counts`` (reads,
    distinct versions, retries) current for the publisher; report the totals as JSON bytes."""
    sub = WeightSubscriber(WeightsHandle(name))
    conn.send_bytes(b"ready")
    reads = torn = went_back = 0
    prev = -1
    seen = set()
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if 0 <= last.value == prev:
                break
            got = sub.read(timeout=10)
            if got is None:
                continue
            v, tree = got
            reads += 1
            torn += _torn(v, tree)
            went_back += v < prev
            prev = v
            seen.add(v)
            counts[:] = [reads, len(seen), sub.retries]
        conn.send_bytes(json.dumps({"reads": reads, "torn": torn, "back": went_back, "distinct": len(seen),
                                    "retries": sub.retries, "last": prev}).encode())
    finally:
        sub.close()


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmbuf-w")}


@pytest.fixture
def publisher():
    pubs = []

    def make(example, **kw):
        p = WeightPublisher(example, **kw)
        pubs.append(p)
        return p

    yield make
    for p in pubs:
        p.close()
    # only our own names: other programs on this machine may make weight broadcasts meanwhile
    left = _shm_names() & {p.name[1:] for p in pubs}
    assert not left, f"a weight broadcast object was left in /dev/shm: {left}"


def test_roundtrip_versions_and_poll(publisher):
    pub = publisher(_params(0))
    assert pub.name.startswith("/shmbuf-w") and len(pub.name) <= 31
    assert oct(os.stat("/dev/shm/" + pub.name[1:]).st_mode & 0o777) == "0o600"
    with WeightSubscriber(pub.handle) as sub:
        assert sub.read() is None and sub.newest() == 0
        assert pub.publish(_params(0)) == 0
        v, tree = sub.read()
        assert v == 0 and not _torn(0, tree)
        assert sub.poll() is None  # nothing newer
        pub.publish(_params(1))
        pub.publish(_params(41), version=41)
        v, tree = sub.poll()
        assert v == 41 and not _torn(41, tree)  # the newest, skipping 1
        tree["a"][:] = -1  # the caller's own copy: shared memory is untouched
        assert not _torn(41, sub.read()[1])


def test_bad_publish_is_refused_and_names_the_leaf(publisher):
    pub = publisher(_params(0))
    bad = _params(1)
    bad["layers"][0] = np.zeros(N_B + 1, np.int64)
    with pytest.raises(shmbuf.SchemaError, match=r"layers/0: expected shape \(4096,\), got \(4097,\)"):
        pub.publish(bad)
    with pytest.raises(shmbuf.SchemaError, match="layers"):
        pub.publish({"a": np.zeros(N_A)})
    pub.publish(_params(3), version=3)
    with pytest.raises(ValueError, match="larger than the last"):
        pub.publish(_params(2), version=2)


def test_handle_pickles_as_a_name_and_publisher_does_too(publisher):
    pub = publisher({"w": np.zeros(3, np.float32)})
    h = pickle.loads(pickle.dumps(pub))
    assert h == pub.handle == WeightsHandle(pub.name)
    with pytest.raises(ValueError):
        WeightsHandle("/shmbuf-0123")  # a pipeline name, not a weights one


def test_attach_to_missing_or_closed_fails_clearly(publisher):
    pub = publisher({"w": np.zeros(3, np.float32)})
    name = pub.name
    pub.close()
    with pytest.raises(shmbuf.SegmentError, match="no weight broadcast"):
        WeightSubscriber(name)


def test_subscriber_outlives_publisher_close(publisher):
    pub = publisher({"w": np.zeros(3, np.float32)})
    pub.publish({"w": np.arange(3, dtype=np.float32)})
    sub = WeightSubscriber(pub.handle)
    try:
        pub.close()  # unlinked: subscribers keep their mapping and the last version
        v, tree = sub.read()
        assert v == 0 and tree["w"].tolist() == [0, 1, 2]
    finally:
        sub.close()


@pytest.mark.parametrize("buffers", [1, 3])
def test_no_torn_reads_under_a_publisher_going_flat_out(publisher, buffers):
    """Several reader processes check every element of every version they read while the learner publishes
    as fast as it can: zero torn reads over many thousand versions. buffers=1 is a bare seqlock (many
    retries); buffers=3 is the default.

    The publisher goes on past its 6000 versions until the readers have raced it enough for the checks below
    to mean something (300 reads, 20 distinct versions, and with one buffer a retry), however the machine
    schedules them (deadline 60 s): a count, not a hope that 6000 versions take long enough.
    """
    pub = publisher(_params(0), buffers=buffers)
    versions = 6000
    ctx = mp.get_context("spawn")
    last = ctx.Value("q", -1, lock=False)
    counts = [ctx.Array("q", 3, lock=False) for _ in range(3)]
    procs, conns = [], []

    def raced() -> bool:
        reads, distinct, retries = (sum(c[k] for c in counts) for k in range(3))
        return reads >= 300 and distinct >= 20 and (buffers > 1 or retries > 0)

    try:
        for i in range(3):
            here, there = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_reader_proc, args=(pub.name, last, counts[i], there), daemon=True)
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        for c in conns:  # every reader attached before the first publish
            assert c.poll(60), "a reader did not start within 60 s"
            assert c.recv_bytes() == b"ready"
        t0 = time.perf_counter()
        deadline = time.monotonic() + 60
        v = 0
        while v < versions or not raced():
            assert time.monotonic() < deadline, f"the readers barely raced {v} versions in 60 s: {[c[:] for c in counts]}"
            pub.publish(_params(v))
            v += 1
        versions = v + 1
        last.value = v  # the readers stop when they have read it
        pub.publish(_params(v))
        publish_s = time.perf_counter() - t0
        results = []
        for c in conns:
            assert c.poll(60), "a reader did not finish within 60 s"
            results.append(json.loads(c.recv_bytes()))
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    print(f"buffers={buffers}: {versions} versions in {publish_s:.2f} s; readers: {results}")
    for r in results:
        assert r["torn"] == 0
        assert r["back"] == 0  # never an older version after a newer one
        assert r["last"] == versions - 1
    assert sum(r["reads"] for r in results) >= 300
    assert sum(r["distinct"] for r in results) >= 20
    if buffers == 1:  # a retry means the publisher was writing the buffer being read: the readers raced it
        assert sum(r["retries"] for r in results) > 0


def test_bad_settings_and_names_are_usage_errors(publisher):
    for buffers in (True, 0, 2.0, MAX_BUFFERS + 1):
        with pytest.raises(shmbuf.UsageError, match=r"WeightPublisher\(buffers=...\)"):
            WeightPublisher({"w": np.zeros(3, np.float32)}, buffers=buffers)
    for name in ("/shmbuf-w" + "0" * 15 + "/", "/shmbuf-w" + "a" * 300, "/shmbuf-w0123456789abcdeg", 7):
        with pytest.raises(shmbuf.UsageError):
            WeightsHandle(name)
        with pytest.raises(shmbuf.UsageError):
            WeightSubscriber(name)


def test_header_shares_the_segments_head_and_owner(publisher):
    """Same head as a pipeline's (magic, version, sizes, owner pid and start), same pid namespace word."""
    from shmbuf._proc import pid_namespace
    from shmbuf._segment import HEAD, PIDNS_OFF

    pub = publisher({"w": np.zeros(3, np.float32)})
    with open("/dev/shm/" + pub.name[1:], "rb") as f:
        raw = f.read(256)
    magic, version, hbytes, total, pid, _start = HEAD.unpack_from(raw)
    assert (magic, version, hbytes, total, pid) == (W_MAGIC, W_LAYOUT_VERSION, 256, os.path.getsize(
        "/dev/shm/" + pub.name[1:]), os.getpid())
    assert int.from_bytes(raw[PIDNS_OFF:PIDNS_OFF + 8], "little") == pid_namespace()
    with WeightSubscriber(pub.handle) as sub:
        assert sub.owner.pid == os.getpid() and sub.publisher_alive() and sub.buffers == 3
