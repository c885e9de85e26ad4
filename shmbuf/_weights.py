"""Weight broadcast: the learner publishes policy parameters, actors read the newest whole version.

One publisher (the learner) owns an object of ``buffers`` copies of a parameter pytree, each under a
sequence lock; subscribers (actors, read-only mappings) copy the newest complete one out, and nobody
waits for anybody. Layout, protocol and why a torn version is never accepted: docs/design/weights.md.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

from shmbuf._errors import PipelineClosed, SchemaError, SegmentError, SlotTimeout, UsageError, WrongProcess
from shmbuf._handle import Handle
from shmbuf._schema import Schema
from shmbuf._substrate import (
    HEAD,
    HEADER_BYTES,
    WEIGHTS_PREFIX,
    Closable,
    Fence,
    Owner,
    align,
    check_head,
    create_object,
    fmt_bytes,
    keeping,
    map_object,
    new_name,
    pinned,
    this_process,
    unlink_object,
    unmap,
    write_header,
)
from shmbuf._validate import int_setting, timeout_setting

W_MAGIC = b"\x89SHMBUFW"
W_LAYOUT_VERSION = 2  # 2: the segment's header head (owner before buffer count), pid namespace in the last word
# <the head every shmbuf header starts with: magic, layout version, header bytes, total, owner pid, owner start>
# <n_buffers, schema off, schema len, data off, buffer bytes>
_HEADER = struct.Struct(HEAD.format + "IQQQQ")
LATEST_WORD = 256 // 8
CLOSED_WORD = LATEST_WORD + 1
SEQ_OFF = 320
MAX_BUFFERS = 16
_TS = "weights"  # the single timescale of the internal schema: {"params": tree, "version": int64 0-d}


def _schema_of(params: Any) -> Schema:
    # A 0-d leaf makes the timescale single-item whatever the parameters' shapes are.
    return Schema.from_example({_TS: {"params": params, "version": np.zeros((), np.int64)}})


@dataclass(frozen=True)
class WeightsHandle(Handle):
    """A picklable reference to a weight broadcast: its name. ``WeightSubscriber(handle)`` attaches."""

    kind = "weights"  # UsageError unless '/shmbuf-w' and 16 hex digits


class _WeightsLayout:
    """Offsets of one weights object, derived from (schema, buffers): recomputed and checked on attach."""

    def __init__(self, schema: Schema, buffers: int):
        self.schema = schema
        self.buffers = buffers
        self.schema_len = len(schema.to_msgpack())
        self.schema_off = align(SEQ_OFF + buffers * 64)
        self.data_off = align(self.schema_off + self.schema_len)
        leaves = schema.leaves
        self.leaf_offs: list[int] = []
        off = 0
        for lf in leaves:
            self.leaf_offs.append(off)
            off += lf.stride
        self.buffer_bytes = align(max(off, 64))
        self.total = self.data_off + buffers * self.buffer_bytes

    def views(self, mm: mmap.mmap, b: int) -> list[np.ndarray]:
        base = self.data_off + b * self.buffer_bytes
        pin = pinned(mm)
        return [
            np.ndarray(lf.shape, lf.dtype, buffer=pin, offset=base + o)
            for lf, o in zip(self.schema.leaves, self.leaf_offs, strict=True)
        ]


class WeightPublisher(Closable):
    """The learner's side: owns the shared object and publishes versions into it.

    Args:
        example: a pytree of numpy arrays shaped like the parameters (e.g. a
            dict of ``param.detach().numpy()``); every publish must match it.
        buffers: copies kept; a subscriber restarts a read only when lapped
            this many publishes during one copy (2 or 3 is plenty).
        keep_on_crash: if this process dies without closing, leave the object
            for ``shmbuf ls`` (its watcher removes it within 1 s otherwise).

    ``publish`` never waits for subscribers. ``close()`` unlinks the object
    (subscribers keep their mapping and simply see no newer version). The
    object is created owner-only (0600) under ``/shmbuf-w<16 hex>``.
    """

    _kind = "weight broadcast"

    def __init__(self, example: Any, *, buffers: int = 3, keep_on_crash: bool = False):
        buffers = int_setting("WeightPublisher(buffers=...)", buffers, 1, MAX_BUFFERS)
        self.schema = _schema_of(example)
        self._lay = lay = _WeightsLayout(self.schema, buffers)
        self._treespec = self.schema.timescales[0].treespec
        self.name = new_name(WEIGHTS_PREFIX)
        self._pid = os.getpid()
        self._closed = False
        fd, self._mm = create_object(self.name, lay.total, f"{buffers} buffers of {fmt_bytes(lay.buffer_bytes)}",
                                     keep=keeping(keep_on_crash))
        os.close(fd)  # the mapping is all the publisher needs
        self._w = memoryview(self._mm).cast("q")
        # Closed and unlinked at close(), collection or exit, in this process only (a forked child's copy never).
        self._lifetime(_withdraw, self._w, self.name, self._pid, unlink=functools.partial(unlink_object, self.name))
        me = this_process()
        write_header(self._mm, _HEADER.pack(W_MAGIC, W_LAYOUT_VERSION, HEADER_BYTES, lay.total, me.pid, me.start, buffers,
                                            lay.schema_off, lay.schema_len, lay.data_off, lay.buffer_bytes))
        self._mm[lay.schema_off : lay.schema_off + lay.schema_len] = self.schema.to_msgpack()
        self._bufs = [lay.views(self._mm, b) for b in range(buffers)]
        self._fence = Fence()
        self._count = 0
        self.version: int | None = None

    @property
    def handle(self) -> WeightsHandle:
        return WeightsHandle(self.name)

    def __reduce__(self) -> Any:
        return (WeightsHandle, (self.name,))

    def publish(self, params: Any, version: int | None = None) -> int:
        """Copy ``params`` into the next buffer and make it the newest; return its version.

        ``version`` defaults to the last one plus 1 (0 for the first); given
        explicitly it must be larger than the last. Never waits.
        """
        if self._closed:
            raise PipelineClosed(f"weight broadcast {self.name} is closed")
        if os.getpid() != self._pid:
            raise WrongProcess(f"this WeightPublisher belongs to process {self._pid}; only the learner publishes")
        if version is None:
            version = 0 if self.version is None else self.version + 1
        elif not isinstance(version, (int, np.integer)) or (self.version is not None and version <= self.version):
            raise UsageError(f"version: expected an int larger than the last one ({self.version}), got {version!r}")
        leaves = self._check(params)
        n = self._count + 1
        b = n % self._lay.buffers
        seq_word = SEQ_OFF // 8 + b * 8
        w = self._w
        w[seq_word] = 2 * n - 1
        self._fence()
        dst = self._bufs[b]
        for d, x in zip(dst, leaves, strict=True):
            np.copyto(d, x, casting="same_kind")
        dst[-1][...] = version
        self._fence()
        w[seq_word] = 2 * n
        w[LATEST_WORD] = n
        self._count = n
        self.version = int(version)
        return self.version

    def _check(self, params: Any) -> list[np.ndarray]:
        leaves = self.schema.leaves
        tree: Any = {"params": params, "version": np.zeros((), np.int64)}  # Any: optree's PyTree is a class no dict is
        got, spec = optree.tree_flatten(tree)
        if spec != self._treespec:
            mine = _schema_of(params) if _is_arrays(params) else None
            diff = self.schema.first_difference(mine) if mine is not None else "leaves are not all numpy arrays"
            diff = (diff or "different containers").replace(f"{_TS}/params/", "").replace(f"'{_TS}'", "the parameters")
            raise SchemaError(f"publish: the parameters do not match the example: {diff}")
        out = []
        for lf, x in zip(leaves, got, strict=True):
            x = np.asarray(x)
            if x.shape != lf.shape:
                raise SchemaError(f"publish: leaf {_param_name(lf.path)}: expected shape {lf.shape}, got {x.shape}")
            if x.dtype != lf.dtype and not np.can_cast(x.dtype, lf.dtype, casting="same_kind"):
                raise SchemaError(f"publish: leaf {_param_name(lf.path)}: expected dtype {lf.dtype}, got {x.dtype}")
            out.append(x)
        return out

    def close(self, timeout: float | None = None) -> None:
        """Unlink the object and unmap it. Subscribers keep the last version they read. Waits for nothing (``timeout``:
        accepted, as by every shmbuf close, and checked)."""
        timeout_setting("WeightPublisher.close(timeout=...)", timeout)
        if self._closed:
            return
        self._closed = True
        super().close()
        if os.getpid() != self._pid:
            return
        self._bufs = []
        self._w.release()
        unmap(self._mm)  # arrays taken from the buffers that still exist keep it until they go


def _withdraw(w: memoryview, name: str, pid: int) -> None:
    """The publisher's release: tell subscribers it closed, and remove the name; in the publisher's process only."""
    if os.getpid() != pid:
        return
    try:
        w[CLOSED_WORD] = 1
    except (ValueError, TypeError):
        pass
    unlink_object(name)


def _param_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path[2:]) or "<root>"


def _is_arrays(tree: Any) -> bool:
    try:
        return all(isinstance(x, (np.ndarray, np.generic)) for x in optree.tree_leaves(tree))
    except Exception:  # noqa: BLE001  # a tree optree cannot flatten (a registered node's flatten failing, ...) is not arrays
        return False


class WeightSubscriber(Closable):
    """An actor's side: a read-only mapping; :meth:`read` copies out the newest complete version.

    Args:
        weights: a :class:`WeightsHandle`, a name, or the publisher itself.

    The arrays :meth:`read` returns are new ones, the caller's to keep: they
    never alias shared memory and nothing overwrites them later.
    """

    def __init__(self, weights: WeightsHandle | str | Any):
        name = weights if isinstance(weights, str) else getattr(weights, "name", None)
        self.name = WeightsHandle(name).name if isinstance(name, str) else WeightsHandle(str(weights)).name
        fd, self._mm = map_object(self.name, readonly=True, min_size=HEADER_BYTES + 64, what="weight broadcast")
        os.close(fd)  # the mapping is all a subscriber needs
        try:
            self._setup(len(self._mm))
        except BaseException:
            self._mm.close()
            raise
        self.retries = 0
        self.last_version: int | None = None
        self._last_count = 0

    def _setup(self, size: int) -> None:
        mm = self._mm
        owner = check_head(mm, self.name, magic=W_MAGIC, version=W_LAYOUT_VERSION, what="weight broadcast")
        *_, buffers, schema_off, schema_len, data_off, buffer_bytes = _HEADER.unpack_from(mm, 0)
        if not 1 <= buffers <= MAX_BUFFERS:
            raise SegmentError(f"{self.name}: header declares {buffers} buffers (limit {MAX_BUFFERS})")
        if not 0 < schema_len <= size or not SEQ_OFF <= schema_off <= size - schema_len:
            raise SegmentError(f"{self.name}: schema lies outside the object")
        schema = Schema.from_msgpack(bytes(mm[schema_off : schema_off + schema_len]))
        lay = _WeightsLayout(schema, buffers)
        if (lay.total, lay.schema_off, lay.data_off, lay.buffer_bytes) != (size, schema_off, data_off, buffer_bytes):
            raise SegmentError(f"{self.name}: the schema calls for a different layout than the header states")
        self.schema = schema
        self._lay = lay
        self.owner: Owner = owner  # the publisher's process
        self._w = memoryview(mm).cast("q")
        self._bufs = [lay.views(mm, b) for b in range(buffers)]
        self._treespec = schema.timescales[0].treespec
        self._fence = Fence()

    @property
    def handle(self) -> WeightsHandle:
        return WeightsHandle(self.name)

    def newest(self) -> int:
        """How many versions were ever published (0: none yet); one load, no copy."""
        return self._w[LATEST_WORD]

    def read(self, timeout: float = 1.0) -> tuple[int, Any] | None:
        """The newest complete version as ``(version, params)``, or None if nothing was published yet.

        Raises SlotTimeout if the publisher lapped every attempt for
        ``timeout`` seconds (it publishes ``buffers`` times faster than one copy).
        """
        w = self._w
        lay = self._lay
        deadline = None
        while True:
            n = w[LATEST_WORD]
            if n == 0:
                return None
            b = n % lay.buffers
            seq_word = SEQ_OFF // 8 + b * 8
            s1 = w[seq_word]
            if s1 == 2 * n:
                self._fence()
                out = [np.array(s) for s in self._bufs[b]]
                self._fence()
                if w[seq_word] == s1:
                    self._last_count = n
                    self.last_version = int(out[-1])
                    return self.last_version, optree.tree_unflatten(self._treespec, out)["params"]
            self.retries += 1
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            elif now >= deadline:
                raise SlotTimeout(f"weight broadcast {self.name}: every read was overtaken by the publisher for {timeout} s")

    def poll(self, timeout: float = 1.0) -> tuple[int, Any] | None:
        """Like :meth:`read`, but None unless something newer than the last read was published."""
        if self._w[LATEST_WORD] == self._last_count:
            return None
        return self.read(timeout)

    @property
    def buffers(self) -> int:
        return self._lay.buffers

    def publisher_alive(self) -> bool:
        """True while the publisher's process runs (and when that cannot be known: another pid namespace)."""
        return self.owner.alive()

    def close(self, timeout: float | None = None) -> None:
        """Unmap (detach). Arrays returned by read() are this process's own and stay valid. Waits for nothing
        (``timeout``: accepted, as by every shmbuf close, and checked)."""
        timeout_setting("WeightSubscriber.close(timeout=...)", timeout)
        if getattr(self, "_bufs", None) is None:
            return
        self._bufs = None  # type: ignore[assignment]  # closed: None is the mark close() tests for; read() is not for after close
        self._w.release()
        unmap(self._mm)

