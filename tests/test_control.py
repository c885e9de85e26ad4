"""Control messages: msgpack only; garbage, truncated and oversized messages are refused and counted."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

import shmbuf
from shmbuf import _control, _lane
from shmbuf._segment import MAILBOX_PAYLOAD_OFF
from tests.conftest import small_example


def post_raw(writer: shmbuf.Writer, payload: bytes, length: int | None = None, magic: int = _lane.MSG_MAGIC) -> None:
    """Put bytes in the writer's mailbox as a hostile or broken writer would."""
    seg, w = writer._seg, writer._w
    base = writer._plan.mbox_off_of(writer.lane)
    mw = base // 8
    n = min(len(payload), _control.MAX_PAYLOAD)
    seg.mm[base + MAILBOX_PAYLOAD_OFF : base + MAILBOX_PAYLOAD_OFF + n] = payload[:n]
    w[mw + _lane.M_LEN] = len(payload) if length is None else length
    w[mw + _lane.M_MAGIC] = magic
    w[mw + _lane.M_POST] = w[mw + _lane.M_POST] + 1


def wait_acked(reader: shmbuf.Reader, writer: shmbuf.Writer) -> None:
    mw = writer._plan.mbox_off_of(writer.lane) // 8
    for _ in range(100):
        reader.poll()
        if writer._w[mw + _lane.M_ACK] == writer._w[mw + _lane.M_POST]:
            return
    raise AssertionError("the reader never took the message")


BAD = [
    (b"\xc1\xc1\xc1", None, _lane.MSG_MAGIC),  # not msgpack
    (msgpack.packb([1, 2, 3]), None, _lane.MSG_MAGIC),  # not a map
    (msgpack.packb({"type": "launch_missiles"}), None, _lane.MSG_MAGIC),  # unknown type
    (msgpack.packb({"type": "error", "exc_type": 3, "message": "m", "traceback": ""}), None, _lane.MSG_MAGIC),
    (msgpack.packb({"type": "bye", "reason": "x", "extra": 1}), None, _lane.MSG_MAGIC),
    (msgpack.packb({"type": "stats", "counters": {"a": "b"}}), None, _lane.MSG_MAGIC),
    (msgpack.packb({"type": "bye", "reason": "xyz"})[:-2], None, _lane.MSG_MAGIC),  # truncated
    (b"x" * 10, 10**9, _lane.MSG_MAGIC),  # oversized length
    (b"x" * 10, 0, _lane.MSG_MAGIC),
    (msgpack.packb({"type": "bye", "reason": "x"}), None, 12345),  # bad magic
    (msgpack.packb({"type": "stats", "counters": {"n": True}}), None, _lane.MSG_MAGIC),  # bool is not a count
]


def test_bad_messages_are_refused_counted_and_the_pipeline_goes_on(make_reader: Any) -> None:
    reader = make_reader(small_example(), slots=2, max_writers=1)
    writer = shmbuf.Writer(reader.handle, timeout=2, label="ok")
    reader.poll()
    for payload, length, magic in BAD:
        post_raw(writer, payload, length, magic)
        wait_acked(reader, writer)
    assert reader.stats()["bad_messages"] == len(BAD)
    assert reader.errors == []
    writer.add("step", {"obs": np.zeros(4, np.float32), "action": np.int64(1), "reward": np.float32(1), "done": False})
    writer.commit()
    with reader.get(timeout=5) as r:
        assert r.data["step"]["action"][0] == 1
    assert writer.send_stats()
    wait_acked(reader, writer)
    assert reader.stats()["writer_stats"][writer.lane]["commits"] == 1
    writer.close()


def test_encode_refuses_unknown_types_and_trims_long_text() -> None:
    with pytest.raises(ValueError, match="unknown control message type"):
        _control.encode("nope")
    data = _control.encode("error", exc_type="E", message="m", traceback="x" * 100_000)
    assert len(data) <= _control.MAX_PAYLOAD
    assert _control.decode(data)["traceback"].endswith("x" * 100)
