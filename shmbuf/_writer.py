"""The actor side: accumulate a rollout straight into a shared slot, then commit it.

A :class:`Writer` behaves like InstaDeep echo's ``TrajectoryAccumulator``
(same timescale rules, same ``add``/``reset``, the same kinds of error)
except that ``add()`` writes into the shared-memory slot the reader will
read, and ``commit()`` hands the slot over instead of returning a tree to
send. The lane protocol underneath (claim, wait, publish, mail, retire) is
:mod:`shmbuf._lane`'s; this module is its user.
"""

from __future__ import annotations

import math
import os
import select
import time
import traceback
from typing import Any

import numpy as np
import optree
import posix_ipc

from shmbuf import _control, _fork, _segment
from shmbuf._errors import (
    BrokenPipeline, PipelineClosed, SchemaError, SegmentError, TimescaleFull, UnknownTimescale, UsageError, WrongProcess,
)
from shmbuf._handle import Handle, name_of
from shmbuf._lane import WriterLane, check_timeout
from shmbuf._proc import Owner
from shmbuf._schema import Leaf, Schema, Timescale, flatten_like
from shmbuf._segment import S_COMMIT_NS, S_EPOCH, S_FILL, S_POLICY, S_SEQ, W_CLOSED, Segment, sem_name

# How often a writer that is not waiting looks whether the reader still lives: every call looks at
# the closed flag (one load), and at most this often at the reader's process (a few microseconds).
LIVENESS_INTERVAL = 0.25
_MISSING = object()
_F32_MAX = float(np.finfo(np.float32).max)
# add()'s fast path is a function compiled for the timescale when the Writer starts, at about 0.3 ms
# per leaf; a timescale with more leaves than this takes the general path instead.
MAX_FAST_LEAVES = 256
_now = time.monotonic


class _ReaderWatch:
    """Is the reader's process still there? A pidfd where Linux has one (it cannot be fooled by a
    reused pid, and asking costs one poll() with no allocation); else pid and start time. A reader
    in another pid namespace cannot be judged by its pid at all: it counts as alive (``Owner``)."""

    __slots__ = ("owner", "fd", "_poll")

    def __init__(self, owner: Owner):
        self.owner, self.fd = owner, -1
        self._poll: Any = None
        if owner.elsewhere or not hasattr(os, "pidfd_open") or not owner.alive():
            return
        try:
            self.fd = os.pidfd_open(owner.pid)
        except OSError:
            return
        if not owner.alive():  # the pid was reused between the two looks: it is not our reader
            self.close()
            return
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def alive(self) -> bool:
        if self._poll is not None:
            return not self._poll.poll(0)  # readable once the process has exited
        return self.owner.alive()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._poll = None


class _Ts:
    """A timescale as the writer's hot path wants it: everything precomputed, nothing to look up."""

    __slots__ = ("index", "spec", "leaves", "keys", "store", "scratch", "capacity", "buffered")

    def __init__(self, index: int, spec: Timescale):
        self.index = index
        self.spec = spec
        self.leaves = spec.leaves
        self.capacity = spec.capacity
        self.buffered = spec.buffered
        st = spec.structure
        flat = st[0] == "dict" and all(c[0] == "leaf" for c in st[2])
        self.keys: tuple[str, ...] | None = tuple(st[1]) if flat else None
        # A buffered flat dict (the common case) gets add()'s fast path, a function made for it (_ItemStore).
        fast = flat and spec.buffered and len(spec.leaves) <= MAX_FAST_LEAVES
        self.store = _ItemStore(self) if fast else None
        self.scratch: list[Any] = [None] * len(spec.leaves)


def _item_format_ok(dtype: np.dtype) -> bool:
    """Can a memoryview store this dtype's items (bool, integers, float32, float64; native order)?"""
    return dtype.kind in "biu" or (dtype.kind == "f" and dtype.itemsize in (4, 8))


def _flat_memoryview(a: np.ndarray) -> memoryview | None:
    """A 1-d memoryview of a slot's (C-contiguous) leaf in numpy's own format, for item and row stores."""
    if not _item_format_ok(a.dtype) or a.nbytes == 0:
        return None
    m = memoryview(a)
    return m.cast("B").cast(m.format)


class _ItemStore:
    """add()'s fast path for one buffered flat-dict timescale: check every leaf of a step, then store them.

    Python's per-bytecode cost, not numpy's copy, dominates an add of small items, so the check
    is one straight-line function made for the timescale when the Writer starts (like the
    ``__init__`` that ``dataclasses`` writes): per leaf a chain of identity tests on the item's type,
    each with the store that type gets, then the stores. No user text goes into its source: keys,
    dtypes and bounds are passed in by name. ``source`` keeps the text, for reading.

    The routes, per leaf (all give the same bits as numpy's assignment of the same item):

    - a numpy integer or bool scalar of the leaf's own type, or a Python bool: an item store
      through the slot's memoryview (``mv[i] = x``), no numpy call;
    - a Python int within the leaf's range (integer leaves), or within +-2**53 (float leaves), and a
      Python float within float32's finite range (float32 leaves; any, for float64): the same item
      store. Outside these ranges the general path decides (its range error, numpy's overflow);
    - a numpy float scalar of the leaf's own type: numpy's own store (through a C double, a
      memoryview store would quiet a signalling NaN);
    - an ndarray of the leaf's exact dtype and item shape: for a 1-d item of a memoryview-able
      dtype, a row store through the memoryview (``mv[a:b] = x``, a plain copy, half numpy's
      cost); otherwise numpy's ``arr[i] = x``;
    - anything else (other dtypes, a leading 1, Python numbers out of range, ``__array__``
      objects, a missing key): the general path, ``_coerce``, then numpy's store; it raises
      before anything is stored if the item is refused.
    """

    __slots__ = ("source", "fn")

    def __init__(self, ts: _Ts):
        spec = ts.spec
        ns: dict[str, Any] = {"ndarray": np.ndarray, "MISSING": _MISSING, "slow": _SlowItem(spec, ts.keys or ())}
        checks, stores = [], []
        for j, (key, leaf) in enumerate(zip(ts.keys or (), spec.leaves)):
            dt, mv = leaf.dtype, _item_format_ok(leaf.dtype) and leaf.nbytes > 0
            ns[f"K{j}"], ns[f"DT{j}"], ns[f"SH{j}"] = key, dt, leaf.item_shape
            x, item, general = f"x{j}", f"d{j} = mvs[{j}]; k{j} = i", f"d{j} = arrs[{j}]; k{j} = i"
            lines = [f"{x} = data.get(K{j}, MISSING)"]
            if leaf.item_shape == ():
                ns[f"NT{j}"] = dt.type
                lines.append(f"t = type({x})")
                lines.append(f"if t is NT{j}: {item if mv and dt.kind in 'biu' else general}")
                if mv:
                    lines.append(f"elif t is bool: {item}")
                    if dt.kind in "iu":
                        ns[f"IL{j}"], ns[f"IH{j}"] = int(np.iinfo(dt).min), int(np.iinfo(dt).max)
                    elif dt.kind == "f":  # ints a double holds exactly: then one rounding, as numpy's
                        ns[f"IL{j}"], ns[f"IH{j}"] = -(2**53), 2**53
                        lim = _F32_MAX if dt.itemsize == 4 else math.inf
                        ns[f"FL{j}"], ns[f"FH{j}"] = -lim, lim
                        lines.append(f"elif t is float and FL{j} <= {x} <= FH{j}: {item}")
                    if dt.kind in "iuf":
                        lines.append(f"elif t is int and IL{j} <= {x} <= IH{j}: {item}")
                lines.append(f"elif t is ndarray and {x}.dtype is DT{j} and {x}.shape == (): {general}")
            else:
                exact = f"type({x}) is ndarray and {x}.dtype is DT{j} and {x}.shape == SH{j}"
                if mv and len(leaf.item_shape) == 1:
                    n = leaf.item_shape[0]
                    ns[f"ROWS{j}"] = tuple(slice(r * n, r * n + n) for r in range(spec.capacity))
                    lines.append(f"if {exact}: d{j} = mvs[{j}]; k{j} = ROWS{j}[i]")
                else:
                    lines.append(f"if {exact}: {general}")
            lines.append(f"else: {x} = slow({j}, {x}, data); {general}")
            checks += lines
            stores.append(f"d{j}[k{j}] = {x}")
        body = "\n".join("    " + ln for ln in checks + stores)
        self.source = f"def store(data, i, arrs, mvs):\n{body}\n"
        # exec of our own text: no user input in it (the timescale's name goes only into the file name)
        exec(compile(self.source, f"<shmbuf add() of timescale {spec.name!r}>", "exec"), ns)  # noqa: S102
        self.fn = ns["store"]


class _SlowItem:
    """The general path of one leaf of a fast-path timescale: a missing key, or an item to coerce."""

    __slots__ = ("keys", "spec")

    def __init__(self, spec: Timescale, keys: tuple[str, ...]):
        self.spec, self.keys = spec, keys  # not the _Ts: no reference cycle through the function's globals

    def __call__(self, j: int, x: Any, data: dict[Any, Any]) -> np.ndarray:
        if x is _MISSING:
            _keys_mismatch(self.spec.name, self.keys, data)
        return _coerce(self.spec.leaves[j], x, True, whole=False)


class Writer:
    """Fills shared slots of a pipeline, one rollout at a time.

    Args:
        pipeline: the pipeline's :class:`Handle`, its name, or the :class:`Reader`
            (in the reader's own process, e.g. for threads).
        example: optional. When given, it must describe exactly the pipeline's
            schema (checked by fingerprint; the error names the first differing
            leaf), and its container types are used for :meth:`send`.
        timeout: how long ``add``/``commit``/``send`` may wait for a free slot
            before raising :class:`SlotTimeout`; ``None`` waits for ever (still
            noticing a closed pipeline or a dead reader within 0.1 s).
        label: a short text shown by ``shmbuf ls`` and in the reader's stats.

    ``lane`` and ``epoch`` say which lane this Writer claimed and which claim of it this is
    (the lane's claims so far, never reused in the pipeline's life); :meth:`commit` returns
    ``seq``, counted from 0 per Writer. The reader gives each rollout all three: ``(lane, epoch,
    seq)`` names one rollout for the pipeline's whole life, across writers that replace
    others on a lane.

    Rules: echo's ``TrajectoryAccumulator``'s. ``add(ts, tree)`` writes one
    item into the next index of a buffered timescale; a single-item
    timescale holds one item, so its one ``add`` writes the whole leaf and a
    second one before ``commit``/``reset`` raises :class:`TimescaleFull`
    (an IndexError naming timescale, capacity and index). Dtypes cast under
    numpy's ``same_kind`` rule (float64 into float32 yes, float into int no);
    a Python number must fit the leaf's dtype (300 into int8 is refused, as
    numpy's own assignment refuses it). Shapes must be the item shape (or,
    echo-style, with a leading 1); no other broadcasting. Anything with
    ``__array__`` (a CPU torch tensor, a JAX array) is read through it. A
    failed ``add`` writes nothing.

    Stopping: when the reader closes the pipeline, every call raises
    :class:`PipelineClosed`, and leaving a ``with Writer(...)`` block because
    of it is quiet (the exception is swallowed), so ``while True`` actor
    loops end cleanly. Any other exception leaving the block is reported to
    the reader (raised there as :class:`WriterError`) and propagates.

    A Writer belongs to the process and thread that made it; it is not
    picklable (pass the handle and make a Writer in the child), and a copy
    inherited through ``fork`` raises :class:`WrongProcess`.
    """

    def __init__(self, pipeline: Handle | str | Any, example: Any = None, *, timeout: float | None = 30.0,
                 label: str = ""):
        self.timeout = check_timeout(timeout, "Writer(timeout=...)")
        self.name = name_of(pipeline)
        self._pid = os.getpid()
        self._closed = False
        self._foreign = False
        self._reader_closed = False
        self._seg: Segment | None = None
        self._lane: WriterLane | None = None
        self._sems: list[posix_ipc.Semaphore] = []
        self._slot = -1
        self.lane = -1
        self.epoch = 0
        seg = self._seg = Segment.attach(self.name)
        try:
            self._setup(seg, example, label)
        except BaseException:
            if self._lane is not None:  # claimed, then failed: hand the lane back for the reader to reclaim
                self._lane.retire()
            self._teardown()
            raise
        _fork.track(self)

    def _setup(self, seg: Segment, example: Any, label: str) -> None:
        schema = seg.schema
        treespecs = {ts.name: ts.treespec for ts in schema.timescales}
        if example is not None:
            mine = Schema.from_example(example)
            if mine != schema:
                diff = schema.first_difference(mine) or "same leaves, different encoding"
                raise SchemaError(f"the example does not match pipeline {self.name}: {diff}")
            treespecs = {ts.name: ts.treespec for ts in mine.timescales}
        self.schema = schema
        self._ts = {ts.name: _Ts(i, ts) for i, ts in enumerate(schema.timescales)}
        self._treespecs = treespecs
        self._ts_list = list(self._ts.values())
        self._w = seg.words
        self._plan = p = seg.plan
        self._reader_watch = _ReaderWatch(seg.creator)
        self._next_check = 0.0
        doorbell = self._open_sem("r")
        if self._w[W_CLOSED]:
            raise PipelineClosed(f"pipeline {self.name} is closed")
        self._lock_fd = self._open_lock_fd(seg)
        self._lane = WriterLane.claim(self.name, p, self._w, seg.mm, self._lock_fd, doorbell,
                                      lambda i: self._open_sem(f"f{i}"), label, self.timeout, self._check_reader)
        self.lane = self._lane.rec.index
        self.epoch = self._lane.epoch
        self._leaf_all = [seg.leaf_view(i) for i in range(len(schema.leaves))]
        first = 0
        self._leaf_base: dict[str, int] = {}
        for ts in schema.timescales:
            self._leaf_base[ts.name] = first
            first += len(ts.leaves)
        # Per slot, built on its first use and then reused: per timescale, each leaf's array view and
        # (for add's fast path) its flat memoryview, or None.
        self._slot_views: dict[int, tuple[list[list[np.ndarray]], list[list[memoryview | None]]]] = {}
        self._cur: list[list[np.ndarray]] = []
        self._cur_mv: list[list[memoryview | None]] = []
        self._fill = [0] * len(schema.timescales)
        self._direct = False  # slot() handed out the views: commit counts every timescale full
        self._seq = 0
        self.policy_version = 0
        self.stats = {"commits": 0, "wait_s": 0.0, "waits": 0}

    # -- set-up and tear-down -----------------------------------------------

    def _open_lock_fd(self, seg: Segment) -> int:
        """A descriptor of the segment that only this Writer holds, for its lane lock.

        An open-file-description lock lives as long as any descriptor of that description, and
        ``mmap`` keeps a ``dup`` of the descriptor it mapped; locking through the mapping's own
        description would let a forked child's copy of the mapping keep the lane locked. So the
        lock gets a description of its own, checked to be the file we mapped.
        """
        fd, _ = _segment.open_object(self.name, readonly=False)
        try:
            a, b = os.fstat(fd), os.fstat(seg.fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise SegmentError(f"pipeline {self.name} was replaced while this Writer attached to it")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_sem(self, role: str) -> posix_ipc.Semaphore:
        name = sem_name(self.name, role)
        _segment.check_semaphore(name)  # a symlink, a FIFO or another user's file under the name: refused before sem_open
        try:
            sem = posix_ipc.Semaphore(name, 0)
        except posix_ipc.ExistentialError:
            raise PipelineClosed(f"pipeline {self.name} is closed (its semaphores are gone)") from None
        except (posix_ipc.Error, OSError, ValueError) as exc:
            raise SegmentError(f"pipeline {self.name}: semaphore {name} cannot be opened: {exc}") from None
        self._sems.append(sem)
        return sem

    def _teardown(self) -> None:
        watch = getattr(self, "_reader_watch", None)
        if watch is not None:
            watch.close()
        for sem in self._sems:
            try:
                sem.close()
            except posix_ipc.Error:
                pass
        self._sems = []
        self._lane = None
        if getattr(self, "_lock_fd", -1) >= 0:
            os.close(self._lock_fd)  # drops the lane lock
            self._lock_fd = -1
        if self._seg is not None:
            self._forget_views()
            self._slot_views = {}
            self._leaf_all = []
            self._seg.close()
            self._seg = None

    def close(self, reason: str = "closed") -> None:
        """Give the lane back. A rollout that was started and not committed is dropped."""
        if self._closed:
            return
        self._closed = True
        self._slot = -1
        if self._foreign:
            return  # the lane, its lock and its semaphores are the parent's (see _after_fork_in_child)
        lane = self._lane
        if lane is not None:
            try:
                if not self._w[W_CLOSED]:
                    lane.post(_control.encode("bye", reason=str(reason)[:200]), 0.2, self._reader_gone)
                    lane.retire()
            except Exception:
                pass  # closing must not raise because the reader went first
        self._teardown()

    def _after_fork_in_child(self) -> None:
        """In a child that inherited this Writer by fork: let go of what is the parent's."""
        self._foreign = True
        self._slot = -1
        self._forget_views()
        watch = getattr(self, "_reader_watch", None)
        if watch is not None:
            watch.close()
        if getattr(self, "_lock_fd", -1) >= 0:
            try:
                os.close(self._lock_fd)  # our copy: while it is open, the lane's lock outlives the parent's writer
            except OSError:
                pass
            self._lock_fd = -1

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        """Close; report an exception to the reader; swallow PipelineClosed raised because the reader closed."""
        try:
            if exc is not None and not isinstance(exc, (PipelineClosed, BrokenPipeline, WrongProcess, KeyboardInterrupt)):
                try:
                    if self.report_error(exc) and hasattr(exc, "add_note"):
                        # It goes on up, and the process that dies of it prints it too (multiprocessing does): say
                        # where else it went, so that two tracebacks do not read as two failures.
                        exc.add_note(f"(shmbuf: also sent to the learner, which raises it as WriterError from "
                                     f"pipeline {self.name}, lane {self.lane})")
                except Exception:
                    pass  # the user's exception is the one that matters
        finally:
            self.close()
        return isinstance(exc, PipelineClosed) and self._reader_closed

    def __del__(self) -> None:
        try:
            self.close(reason="garbage collected")
        except Exception:
            pass

    def __reduce__(self) -> Any:
        raise TypeError(
            "a shmbuf Writer belongs to the process that made it; pass the pipeline's handle "
            "(reader.handle) to the other process and make a Writer there"
        )

    # -- the hot path -------------------------------------------------------

    def add(self, timescale: str, data: Any) -> None:
        """Write one item of ``timescale`` into the current slot (claiming a slot first if needed).

        Raises:
            UnknownTimescale: a KeyError naming the known timescales.
            TimescaleFull: an IndexError naming timescale, capacity and index.
            SchemaError: wrong keys, dtype, shape or value (names the leaf path).
            SlotTimeout, PipelineClosed, BrokenPipeline, WrongProcess: see :meth:`commit`.
        """
        ts = self._ts.get(timescale)
        if ts is None:
            self._unknown(timescale)
        i = self._fill[ts.index]
        if i >= ts.capacity:
            self._full(ts, i)
        if self._slot < 0:
            self._claim_slot()
        elif self._w[W_CLOSED] or _now() >= self._next_check:
            self._guard()
        store = ts.store
        if store is not None and type(data) is dict and len(data) == len(ts.scratch):
            t = ts.index
            store.fn(data, i, self._cur[t], self._cur_mv[t])  # checks every leaf, then stores them all
            self._fill[t] = i + 1
            return
        vals = ts.scratch
        if ts.keys is not None and type(data) is dict and len(data) == len(vals):
            for j, k in enumerate(ts.keys):
                x = data.get(k, _MISSING)
                if x is _MISSING:
                    _keys_mismatch(ts.spec.name, ts.keys, data)
                vals[j] = _coerce(ts.leaves[j], x, ts.buffered, whole=False)
        else:
            leaves = self._leaves_of(ts, data)
            for j, x in enumerate(leaves):
                vals[j] = _coerce(ts.leaves[j], x, ts.buffered, whole=False)
        if ts.buffered:
            for dst, x in zip(self._cur[ts.index], vals):
                dst[i] = x
        else:
            for dst, x in zip(self._cur[ts.index], vals):
                dst[...] = x
        self._fill[ts.index] = i + 1

    def commit(self, policy_version: int | None = None, *, fill: dict[str, int] | None = None) -> int:
        """Publish the current slot to the reader; return the rollout's sequence number (from 0 per Writer).

        Records how far each timescale was filled, so a rollout cut short is
        delivered with its real length. The next ``add`` claims a new slot.
        After :meth:`slot`, every timescale counts as full unless ``fill``
        (timescale to count, at most its capacity) says otherwise.

        Raises:
            UsageError: nothing was added since the last commit (a ValueError).
            PipelineClosed: the reader closed the pipeline, or this Writer was closed.
            BrokenPipeline: the reader's process died.
            WrongProcess: this Writer was inherited through fork.
        """
        if fill is not None or self._direct:
            self._set_fill(fill)
        if self._slot < 0 or not any(self._fill):
            self._guard()
            raise UsageError(f"commit of an empty rollout on pipeline {self.name}: nothing was added since the last commit")
        w = self._w
        if w[W_CLOSED] or _now() >= self._next_check:
            self._guard()
        slot = self._slot
        sw = self._plan.slot_word(slot)
        seq = self._seq
        w[sw + S_SEQ] = seq
        w[sw + S_EPOCH] = self.epoch
        w[sw + S_POLICY] = self.policy_version if policy_version is None else policy_version
        for t, n in enumerate(self._fill):
            w[sw + S_FILL + t] = n
            self._fill[t] = 0
        w[sw + S_COMMIT_NS] = time.monotonic_ns()
        self._lane.publish(slot)  # type: ignore[union-attr]  # _guard passed: the lane is ours
        self._slot = -1
        self._direct = False
        self._seq = seq + 1
        self.stats["commits"] += 1
        return seq

    def slot(self) -> dict[str, Any]:
        """The current slot as a tree shaped like the example, of writable views: write into it in place.

        For actors that produce whole arrays (a vector env's observations, a policy's batched
        outputs): write them straight into shared memory, with no ``add`` per step and no copy
        in between, then :meth:`commit`, which publishes every timescale as full (pass ``fill``
        to say otherwise). Claims a slot first if none is held (waiting like ``add``).

        Lifetime: the views are this slot's until :meth:`commit` (or :meth:`close`); after that the
        slot belongs to the reader, and writing through a view you kept would change a rollout
        the learner may be reading. Take the views again after each commit.
        """
        if self._slot < 0:
            self._claim_slot()
        else:
            self._guard()
        self._direct = True
        out, views = {}, self._cur
        for ts in self._ts_list:
            out[ts.spec.name] = optree.tree_unflatten(self._treespecs[ts.spec.name], views[ts.index])
        return out

    def reset(self) -> None:
        """Forget what was added since the last commit (e.g. an aborted episode); keep the slot."""
        if self._foreign or self._closed:
            self._guard()
        for t in range(len(self._fill)):
            self._fill[t] = 0
        self._direct = False

    def _set_fill(self, fill: dict[str, int] | None) -> None:
        """Fill counts for a commit after slot(): every timescale full, or what ``fill`` says (checked first)."""
        counts = [ts.capacity for ts in self._ts_list] if self._direct else list(self._fill)
        for name, n in (fill or {}).items():
            ts = self._ts.get(name)
            if ts is None:
                self._unknown(name)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= ts.capacity:
                raise UsageError(f"commit(fill=...): timescale '{name}' holds 0 to {ts.capacity}, got {n!r}")
            counts[ts.index] = int(n)
        self._fill[:] = counts

    def send(self, tree: Any, policy_version: int | None = None) -> int:
        """Write a whole, already built rollout and commit it (echo's ``client.send(buf.build())``, one call).

        Every timescale must be present with the example's structure; buffered
        timescales count as full.
        """
        self._guard()
        if self._slot >= 0 and any(self._fill):
            raise UsageError(
                f"send() while a rollout is being built with add() on pipeline {self.name}; commit() or reset() it first"
            )
        if type(tree) is not dict or len(tree) != len(self._ts) or tree.keys() != self._ts.keys():
            got = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
            raise SchemaError(f"send: expected a dict with timescales {sorted(self._ts)}, got {got}")
        for ts in self._ts_list:  # check everything before writing anything
            vals = ts.scratch
            for j, x in enumerate(self._leaves_of(ts, tree[ts.spec.name])):
                vals[j] = _coerce(ts.leaves[j], x, ts.buffered, whole=True)
        if self._slot < 0:
            self._claim_slot()
        for ts in self._ts_list:
            vals = ts.scratch
            for j, dst in enumerate(self._cur[ts.index]):
                dst[...] = vals[j]  # dtype already checked against 'same_kind'
                vals[j] = None  # hold no reference to the caller's arrays
            self._fill[ts.index] = ts.capacity
        return self.commit(policy_version)

    # -- slots, and whether anyone is still listening -----------------------

    def _claim_slot(self) -> None:
        self._guard()
        lane = self._lane
        assert lane is not None  # _guard raised otherwise
        if not lane.has_free():
            t0 = _now()
            self.stats["waits"] += 1
            try:
                lane.wait(None if self.timeout is None else t0 + self.timeout, self._guard, self._timeout_message)
            finally:
                self.stats["wait_s"] += _now() - t0
        slot = lane.take()
        if not 0 <= slot < self._plan.n_slots:
            raise SegmentError(f"pipeline {self.name}: the free ring of lane {self.lane} holds slot {slot}, outside "
                               f"0..{self._plan.n_slots - 1}: the segment is corrupt")
        self._slot = slot
        views = self._slot_views.get(slot)
        if views is None:
            arrays = [[self._leaf_all[self._leaf_base[ts.name] + j][slot, ...] for j in range(len(ts.leaves))]
                      for ts in self.schema.timescales]
            mvs = [[_flat_memoryview(a) for a in leaves] if ts.store is not None else [None] * len(leaves)
                   for ts, leaves in zip(self._ts_list, arrays)]
            views = self._slot_views[slot] = (arrays, mvs)
        self._cur, self._cur_mv = views

    def _forget_views(self) -> None:
        """Drop every reference to the current slot's views (the mapping cannot be closed while one lives)."""
        self._cur = []
        self._cur_mv = []

    def _guard(self) -> None:
        """Raise if this Writer can do nothing more: forked copy, closed, pipeline closed, reader dead, lane lost."""
        if self._foreign:
            raise WrongProcess(
                f"this Writer was made in process {self._pid} and copied into {os.getpid()} by fork; "
                "make a new Writer in this process from the pipeline's handle"
            )
        if self._closed or self._lane is None:
            raise PipelineClosed(f"this Writer of pipeline {self.name} was closed (Writer.close()); make a new one")
        if self._w[W_CLOSED]:
            self._reader_closed = True
            raise PipelineClosed(f"pipeline {self.name} was closed by its reader; this writer can do nothing more")
        now = _now()
        if now >= self._next_check:
            self._check_reader()
            if self._lane.taken_back():
                raise BrokenPipeline(f"pipeline {self.name}: the reader took lane {self.lane} back (it found the "
                                     "lane's words corrupt); this writer can do nothing more")
            self._next_check = now + LIVENESS_INTERVAL

    def _check_reader(self) -> None:
        if not self._reader_watch.alive():
            raise BrokenPipeline(f"pipeline {self.name}: the reader's process (pid {self._reader_watch.owner.pid}) died")

    def _reader_gone(self) -> bool:
        return bool(self._w[W_CLOSED]) or not self._reader_watch.alive()

    def _timeout_message(self) -> str:
        where = f"pipeline {self.name}: no free slot within Writer(timeout={self.timeout})"
        if self._lane is not None and not self._lane.served():
            return (f"{where}, and the reader has not served this writer yet: it lends slots only inside get, "
                    "get_batch, batches and poll. Have the learner call reader.poll() (or start reading) sooner, "
                    "or give the Writer a longer timeout")
        return (f"{where}: the reader is not releasing rollouts as fast as writers commit them, or there are "
                "too few slots (shmbuf.create(slots=...))")

    # -- control messages ---------------------------------------------------

    def report_error(self, exc: BaseException, timeout: float = 10.0) -> bool:
        """Send an exception (with its traceback, as text) to the reader, which raises it as WriterError.

        Waits up to ``timeout`` seconds for the reader to take a message still in the mailbox (it
        does at its next get, get_batch or poll). False if it did not, closed the pipeline, or died.
        """
        if self._closed or self._foreign or self._lane is None or self._reader_gone():
            return False  # (a closed pipeline's mailbox would take the message, and nobody would read it)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        msg = _control.encode("error", exc_type=type(exc).__name__, message=str(exc), traceback=tb)
        return self._lane.post(msg, timeout, self._reader_gone)

    def send_stats(self) -> bool:
        """Send this writer's counters to the reader (shown in ``reader.stats()``)."""
        if self._closed or self._foreign or self._lane is None:
            return False
        return self._lane.post(_control.encode("stats", counters=dict(self.stats)), 0.0, self._reader_gone)

    # -- errors, the slow way -----------------------------------------------

    def _unknown(self, timescale: Any) -> None:
        raise UnknownTimescale(f"Unknown timescale {timescale!r}. Known: {list(self._ts)}")

    def _full(self, ts: _Ts, i: int) -> None:
        what = "steps" if ts.buffered else "item (it is single-item)"
        raise TimescaleFull(
            f"Timescale '{ts.spec.name}' is full: it holds {ts.capacity} {what}, and add() was called for index {i}. "
            "commit() (or reset()) starts the next rollout"
        )

    def _leaves_of(self, ts: _Ts, data: Any) -> list[Any]:
        """The leaves of ``data`` in schema order, or a SchemaError naming the first mismatch."""
        if ts.keys is not None and isinstance(data, dict):
            if set(data) != set(ts.keys):
                _keys_mismatch(ts.spec.name, ts.keys, data)
            return [data[k] for k in ts.keys]
        leaves, spec = optree.tree_flatten(data)
        if spec != self._treespecs[ts.spec.name]:  # not the example's exact containers: walk and compare
            leaves = []
            flatten_like(ts.spec.structure, data, (ts.spec.name,), leaves)
        return leaves


def _keys_mismatch(name: str, keys: tuple[str, ...] | None, data: dict[Any, Any]) -> None:
    """Raise the SchemaError naming the missing and the unexpected keys of flat timescale ``name``."""
    expected = set(keys or ())
    got = set(data)
    missing = sorted(expected - got, key=str)
    extra = sorted(got - expected, key=str)
    parts = []
    if missing:
        parts.append("missing " + ", ".join(f"{name}/{k}" for k in missing))
    if extra:
        parts.append("unexpected " + ", ".join(f"{name}/{k}" for k in extra))
    raise SchemaError(
        f"timescale '{name}': expected keys {sorted(expected)}, got {sorted(got, key=str)} ({'; '.join(parts)})"
    )


# Which kinds of Python number may go into which kinds of leaf: numpy's own rules for Python scalars
# (a bool goes anywhere; an int into any integer, float or complex leaf if its value fits; a float
# into float or complex; a complex into complex).
_PY_INTO = {bool: "biufc", int: "iufc", float: "fc", complex: "c"}


def _coerce(leaf: Leaf, x: Any, buffered: bool, *, whole: bool) -> np.ndarray:
    """Check one incoming value against its leaf; return an array numpy can assign without surprises.

    ``whole``: ``x`` is the whole leaf (``send``), else one item (``add``), which may also come,
    echo-style, with a leading 1 (buffered) or without the leading 1 of a single-item leaf.
    """
    if not isinstance(x, np.ndarray):
        x = _as_array(leaf, x)
    if x.dtype != leaf.dtype and not np.can_cast(x.dtype, leaf.dtype, casting="same_kind"):
        raise SchemaError(
            f"leaf {leaf.name}: expected dtype {leaf.dtype} (or one that casts to it under numpy's 'same_kind' rule), "
            f"got {x.dtype}"
        )
    want = leaf.shape if whole else leaf.item_shape
    if x.shape != want:
        if whole:
            ok = False
        elif buffered:
            ok = x.shape == (1, *want)
        else:
            ok = len(want) >= 1 and want[0] == 1 and x.shape == want[1:]
        if not ok:
            raise SchemaError(f"leaf {leaf.name}: expected shape {want}{'' if whole else ' for one add()'}, got {x.shape}")
        x = x.reshape(want)
    return x


def _as_array(leaf: Leaf, x: Any) -> np.ndarray:
    """A Python number (range-checked, as numpy's assignment does), a numpy scalar, or anything with ``__array__``."""
    kinds = _PY_INTO.get(type(x))
    if kinds is not None:
        if leaf.dtype.kind not in kinds:
            raise SchemaError(f"leaf {leaf.name}: expected dtype {leaf.dtype} (a Python {type(x).__name__} does not cast to it "
                              f"under numpy's 'same_kind' rule), got Python {type(x).__name__} {x!r}")
        try:
            return np.asarray(x, leaf.dtype)
        except OverflowError:
            info = np.iinfo(leaf.dtype)
            raise SchemaError(
                f"leaf {leaf.name}: {x!r} does not fit dtype {leaf.dtype} ({info.min}..{info.max}); "
                "numpy's own assignment refuses it too"
            ) from None
    if isinstance(x, np.generic):
        return np.asarray(x)
    if hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except Exception as exc:  # e.g. a torch tensor that requires grad, or lives on a GPU
            raise SchemaError(
                f"leaf {leaf.name}: could not read a {type(x).__name__} as a numpy array ({type(exc).__name__}: {exc}); "
                "pass a CPU array (for torch: tensor.detach().cpu())"
            ) from None
    raise SchemaError(
        f"leaf {leaf.name}: expected a numpy array of {leaf.dtype} with shape {leaf.item_shape}, got {type(x).__name__}"
    )
