"""msgpack as shmbuf uses it: never pickle, strings as str, and bounded unpacking of bytes from others.

Whatever crosses between processes as bytes (a control message, a schema in a header) is packed
here, and unpacked here with limits: no bin or ext values, str map keys only, and caps on lengths,
so that garbage or hostile bytes raise :class:`NotMsgpack` and never build a large object.
"""

from __future__ import annotations

from typing import Any

import msgpack


class NotMsgpack(ValueError):
    """Bytes that msgpack could not unpack within the limits given."""


def pack(obj: Any) -> bytes:
    """Pack plain data (dicts, lists, str, numbers, bytes); str stays str, bytes stay bytes."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_str_len: int = -1, max_array_len: int = -1, max_map_len: int = -1) -> Any:
    """Unpack untrusted bytes: no bin or ext values, str map keys only, lengths capped (-1: msgpack's default,
    the size of ``data``). Raises :class:`NotMsgpack` naming the error's type on anything else."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                               max_str_len=max_str_len, max_array_len=max_array_len, max_map_len=max_map_len)
    except Exception as exc:  # noqa: BLE001  # msgpack raises several unrelated types on garbage
        raise NotMsgpack(f"not msgpack: {type(exc).__name__}") from None
