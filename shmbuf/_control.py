"""Control messages between writers and the reader: msgpack in per-lane mailboxes, never pickle.

A lane's mailbox is an 8 KiB region of the segment::

    word 0   post count      (writer)        word 8   ack count  (reader, own cache line)
    word 1   payload length  (writer)
    word 2   magic + version (writer)
    byte 128 payload: a msgpack map

The writer may post when ``ack == post``: it writes the payload, then the
length and magic, then ``post + 1``, then rings the reader's doorbell. The
reader reads the payload once ``post != ack`` and stores ``ack = post``.
Both halves, and the fences that order them, are in :mod:`shmbuf._lane`;
this module only packs and checks what travels.

Message types (writer to reader, the ``type`` field; every field checked on receipt):

- ``error``: an exception in the writer (``exc_type``, ``message``, ``traceback``).
- ``stats``: the writer's counters (``counters``: str to number).
- ``bye``: the writer closed its lane (``reason``).

Reader to writers there is one message, *stop*, and it needs no mailbox: the
reader sets the segment's closed word and posts every lane's semaphore.
A message that fails any check is dropped and counted; the pipeline goes on.
"""

from __future__ import annotations

from typing import Any

from shmbuf._codec import NotMsgpack, pack, unpack
from shmbuf._segment import MAILBOX_BYTES, MAILBOX_PAYLOAD_OFF

MAX_PAYLOAD = MAILBOX_BYTES - MAILBOX_PAYLOAD_OFF

_FIELDS: dict[str, dict[str, type]] = {
    "error": {"exc_type": str, "message": str, "traceback": str},
    "stats": {"counters": dict},
    "bye": {"reason": str},
}


class BadMessage(ValueError):
    """A control message failed a check on receipt."""


def encode(msg_type: str, **fields: Any) -> bytes:
    """Pack a message; long text is cut from its start, by bytes, until the message fits a mailbox.

    The end of a traceback is the part that matters, so that is what is kept.
    """
    if msg_type not in _FIELDS:
        raise ValueError(f"unknown control message type {msg_type!r}; known: {sorted(_FIELDS)}")
    msg = {"type": msg_type, **fields}
    data = pack(msg)
    while len(data) > MAX_PAYLOAD:
        texts = [k for k, v in msg.items() if isinstance(v, str) and v and k != "type"]
        if not texts:
            raise ValueError(f"control message {msg_type!r} is {len(data)} bytes, the mailbox holds {MAX_PAYLOAD}")
        key = max(texts, key=lambda k: len(msg[k].encode()))
        raw = msg[key].encode()
        # Cut what is over (8: the marker and msgpack's length header), but at most half of this field at a
        # time, so that two long fields (a message and the traceback that repeats it) both keep a share.
        keep = max(0, len(raw) - (len(data) - MAX_PAYLOAD) - 8, len(raw) // 2)
        msg[key] = "…" + raw[len(raw) - keep :].decode(errors="ignore") if keep else ""
        data = pack(msg)
    return data


def decode(data: bytes) -> dict[str, Any]:
    """Unpack and check one message; raise :class:`BadMessage` naming what is wrong."""
    if len(data) > MAX_PAYLOAD:
        raise BadMessage(f"message of {len(data)} bytes exceeds the {MAX_PAYLOAD}-byte mailbox")
    try:
        msg = unpack(data, max_array_len=256, max_map_len=256, max_str_len=MAX_PAYLOAD)
    except NotMsgpack as exc:
        raise BadMessage(str(exc)) from None
    if not isinstance(msg, dict):
        raise BadMessage(f"expected a map, got {type(msg).__name__}")
    mtype = msg.get("type")
    spec = _FIELDS.get(mtype) if isinstance(mtype, str) else None
    if spec is None:
        raise BadMessage(f"unknown type {mtype!r:.40}")
    for key, typ in spec.items():
        if not isinstance(msg.get(key), typ) or isinstance(msg.get(key), bool) and typ is int:
            raise BadMessage(f"{mtype}: field {key!r} expected {typ.__name__}, got {type(msg.get(key)).__name__}")
    extra = set(msg) - set(spec) - {"type"}
    if extra:
        raise BadMessage(f"{mtype}: unexpected fields {sorted(extra, key=str)}")
    if mtype == "stats" and not all(isinstance(k, str) and type(v) in (int, float) for k, v in msg["counters"].items()):
        raise BadMessage("stats: counters must map str to numbers")
    return msg
