"""Weight broadcast: the learner publishes policy parameters, actors read the newest whole version.

The learner (one process, one thread: the *publisher*) owns a POSIX
shared-memory object holding ``buffers`` copies of a parameter pytree. Actors
(*subscribers*, any number, read-only mappings) copy the newest complete
version out whenever they like. Nobody ever waits for anybody: the publisher
never blocks, and a subscriber retries only when the publisher overwrote the
buffer it was copying, which takes ``buffers`` publishes during one copy.

Layout (every region 64-byte aligned)::

    0     header   magic, layout version, sizes, owner pid, buffer count; last word: owner's pid namespace
    256   latest   the publish count of the newest complete buffer (0: none yet)
    320   seq[b]   one word per buffer, each on its own cache line
    ...   schema   msgpack (never pickle): the tree's structure, paths, dtypes, shapes
    ...   data     buffers x (the tree's leaves, then its int64 version)

Publish ``n`` (n = 1, 2, ...) goes to buffer ``b = n % buffers``.

The object is made, opened and checked by the segment's own code
(:mod:`shmbuf._segment`: ``create_object``, ``map_object``, ``check_head``): the
same name rules, the same refusal of links, FIFOs, directories and other users'
files, the same header head (magic, version, sizes, owner) and pid namespace.

Memory ordering (a sequence lock per buffer)
--------------------------------------------
Publisher, for publish ``n``::

    seq[b] = 2n - 1        odd: buffer b is being written
    fence
    copy every leaf and the version into buffer b
    fence
    seq[b] = 2n            even: buffer b holds publish n, complete
    latest = n

Subscriber::

    n  = latest;  b = n % buffers
    s1 = seq[b];  if s1 != 2n: start again  (b is already being rewritten)
    fence
    copy buffer b out
    fence
    s2 = seq[b];  if s2 != s1: start again  (b was rewritten during the copy)
    accept

Why a subscriber never accepts a torn mix: the publisher stores the odd
``seq[b]`` before any byte of a new version and the even one after the last;
the subscriber loads ``s1`` before any byte it copies and ``s2`` after the
last. If any byte it copied came from a later publish ``m > n`` into ``b``,
then the odd ``2m - 1`` was stored before that byte, so the later load of
``s2`` sees at least ``2m - 1 != 2n`` and the copy is thrown away. If
``s1 == 2n`` then publish ``n`` had finished, so every byte of it is visible
to loads that come after ``s1``. Counts only grow, so ``2n`` is written to
``seq[b]`` once ever: no ABA.

What that needs from the machine, and how it gets it (the same argument as
:mod:`shmbuf._ring`): each ``seq``/``latest`` access is one aligned 8-byte
load or store done by one C call (memoryview item access), so it is never
torn, and the C compiler cannot move it across the neighbouring opaque calls
(numpy's copy). On x86-64 (TSO) stores become visible in program order and
loads are not reordered with older loads, which is all a seqlock needs; the
one exception, non-temporal stores that glibc's ``memcpy`` uses for very large
copies, ends with an ``sfence`` inside ``memcpy`` itself. On weakly ordered
CPUs (AArch64, POWER) :class:`shmbuf._ring.Fence` is a full barrier at the
places marked ``fence`` above.

With ``buffers >= 2`` a subscriber that is slower than one publish still gets
the version that was newest when it started; it only restarts when lapped
``buffers`` times. Only one publisher may exist per object (it is the
learner's; ``WeightPublisher`` is not picklable).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import posix_ipc

from shmbuf._closable import Closable
from shmbuf._errors import PipelineClosed, SchemaError, SegmentError, SlotTimeout, UsageError
from shmbuf._proc import Owner, start_time
from shmbuf._ring import Fence
from shmbuf._schema import Schema, _align
from shmbuf._segment import (
    HEAD, HEADER_BYTES, WEIGHTS_PREFIX, _fmt_bytes, check_head, check_name, create_object, map_object, pinned,
    stamp_pidns,
)

W_PREFIX = WEIGHTS_PREFIX
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
class WeightsHandle:
    """A picklable reference to a weight broadcast: its name. ``WeightSubscriber(handle)`` attaches."""

    name: str

    def __post_init__(self) -> None:
        check_name(self.name, "weights")  # UsageError unless '/shmbuf-w' and 16 hex digits


class _Layout:
    """Offsets of one weights object, derived from (schema, buffers): recomputed and checked on attach."""

    def __init__(self, schema: Schema, buffers: int):
        self.schema = schema
        self.buffers = buffers
        self.schema_len = len(schema.to_msgpack())
        self.schema_off = _align(SEQ_OFF + buffers * 64)
        self.data_off = _align(self.schema_off + self.schema_len)
        leaves = schema.leaves
        self.leaf_offs: list[int] = []
        off = 0
        for lf in leaves:
            self.leaf_offs.append(off)
            off += lf.stride
        self.buffer_bytes = _align(max(off, 64))
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

    ``publish`` never waits for subscribers. ``close()`` unlinks the object
    (subscribers keep their mapping and simply see no newer version). The
    object is created owner-only (0600) under ``/shmbuf-w<16 hex>``.
    """

    def __init__(self, example: Any, *, buffers: int = 3):
        if isinstance(buffers, bool) or not isinstance(buffers, int) or not 1 <= buffers <= MAX_BUFFERS:
            raise UsageError(f"WeightPublisher(buffers=...): expected an int from 1 to {MAX_BUFFERS}, got {buffers!r:.80}")
        self.schema = _schema_of(example)
        self._lay = lay = _Layout(self.schema, buffers)
        self._treespec = self.schema.timescales[0].treespec
        self.name = W_PREFIX + secrets.token_hex(8)
        self._pid = os.getpid()
        self._closed = False
        fd, self._mm = create_object(self.name, lay.total, f"{buffers} buffers of {_fmt_bytes(lay.buffer_bytes)}")
        os.close(fd)  # the mapping is all the publisher needs
        packed = self.schema.to_msgpack()
        pid = os.getpid()
        self._mm[: _HEADER.size] = _HEADER.pack(W_MAGIC, W_LAYOUT_VERSION, HEADER_BYTES, lay.total, pid, start_time(pid),
                                                buffers, lay.schema_off, lay.schema_len, lay.data_off, lay.buffer_bytes)
        stamp_pidns(self._mm)
        self._mm[lay.schema_off : lay.schema_off + lay.schema_len] = packed
        self._w = memoryview(self._mm).cast("q")
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
            raise RuntimeError(f"this WeightPublisher belongs to process {self._pid}; only the learner publishes")
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
        got, spec = optree.tree_flatten({"params": params, "version": np.zeros((), np.int64)})
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

    def close(self) -> None:
        """Unlink the object and unmap it. Subscribers keep the last version they read."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        try:
            self._w[CLOSED_WORD] = 1
        except (ValueError, TypeError):
            pass
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
        self._bufs = []
        self._w.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # arrays taken from the buffers still exist; the mapping goes with them



def _param_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path[2:]) or "<root>"


def _is_arrays(tree: Any) -> bool:
    try:
        return all(isinstance(x, (np.ndarray, np.generic)) for x in optree.tree_leaves(tree))
    except Exception:
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
        lay = _Layout(schema, buffers)
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

    def close(self) -> None:
        """Unmap (detach). Arrays returned by read() are this process's own and stay valid."""
        if getattr(self, "_bufs", None) is None:
            return
        self._bufs = None  # type: ignore[assignment]
        self._w.release()
        try:
            self._mm.close()
        except BufferError:
            pass

