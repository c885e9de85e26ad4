"""The actor side: accumulate a rollout straight into a shared slot, then commit it.

A :class:`Writer` behaves like InstaDeep echo's ``TrajectoryAccumulator``
(same timescale rules, same ``add``/``reset``, same errors) except that
``add()`` writes into the shared-memory slot the reader will read, and
``commit()`` hands the slot over instead of returning a tree to send.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import traceback
from typing import Any

import numpy as np
import optree
import posix_ipc

from shmbuf import _control
from shmbuf._errors import BrokenPipeline, PipelineClosed, SchemaError, SlotTimeout
from shmbuf._handle import Handle, name_of
from shmbuf._proc import alive, start_time
from shmbuf._ring import Consumer, Producer, fence, store_load_fence
from shmbuf._schema import Leaf, Schema, Timescale, flatten_like
from shmbuf._segment import (
    L_EPOCH, L_FREE_HEAD, L_FREE_TAIL, L_FREE_WAIT, L_PID, L_READY_HEAD, L_READY_TAIL, L_START, L_STATE, L_WAKE_AT,
    L_LABEL, L_LABEL_LEN, LABEL_BYTES, LANE_ACTIVE, LANE_FREE, LANE_RETIRED, S_COMMIT_NS, S_FILL, S_POLICY, S_SEQ, W_CLOSED,
    W_NEWCOMER, Segment,
    header_fields, sem_name,
)

# Blocking waits sleep in slices this long, so that a dead reader or a closed
# pipeline is noticed within one slice (the reliability promise is 2 s).
WAIT_SLICE = 0.1
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock: type, whence, start, len, pid
_LOCK_BASE = 1 << 40  # lane locks sit on bytes past the end of any real segment
_MISSING = object()


class _Ts:
    """A timescale as the writer's hot path wants it: everything precomputed, nothing to look up."""

    __slots__ = ("index", "spec", "leaves", "keys", "checks", "whole_checks", "scratch", "capacity", "buffered")

    def __init__(self, index: int, spec: Timescale):
        self.index = index
        self.spec = spec
        self.leaves = spec.leaves
        self.capacity = spec.capacity
        self.buffered = spec.buffered
        st = spec.structure
        flat = st[0] == "dict" and all(c[0] == "leaf" for c in st[2])
        self.keys: tuple[str, ...] | None = tuple(st[1]) if flat else None
        # (key, dtype, item shape) per leaf: what an exact incoming array looks like
        self.checks = tuple(zip(self.keys or ("",) * len(spec.leaves), (lf.dtype for lf in spec.leaves),
                                (lf.item_shape for lf in spec.leaves)))
        self.whole_checks = tuple((k, dt, lf.shape) for (k, dt, _), lf in zip(self.checks, spec.leaves))  # for send()
        self.scratch: list[Any] = [None] * len(spec.leaves)


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

    Rules: echo's ``TrajectoryAccumulator``'s. ``add(ts, tree)`` writes one
    item into the next index of a buffered timescale, or replaces the whole
    leaf of a single-item one; past capacity it raises ``IndexError`` naming
    timescale, capacity and index. Dtypes cast under numpy's ``same_kind``
    rule (float64 into float32 yes, float into int no); shapes must be the
    item shape (or, echo-style, with a leading 1); no other broadcasting.
    A failed ``add`` writes nothing.

    A Writer belongs to the process and thread that made it; it is not
    picklable (pass the handle and make a Writer in the child).
    """

    def __init__(self, pipeline: Handle | str | Any, example: Any = None, *, timeout: float | None = 30.0,
                 label: str = ""):
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ValueError(f"timeout: expected None or a number of seconds >= 0, got {timeout!r}")
        self.name = name_of(pipeline)
        self.timeout = timeout
        self._pid = os.getpid()
        self._closed = False
        self._seg: Segment | None = None
        self._fd = -1
        self._sems: list[posix_ipc.Semaphore] = []
        self.lane = -1
        seg = self._seg = Segment.attach(self.name)
        try:
            self._setup(seg, example, label)
        except BaseException:
            if self.lane >= 0:  # claimed, then failed: hand the lane back for the reader to reclaim
                seg.words[seg.plan.lane_word(self.lane) + L_STATE] = LANE_RETIRED
            self._teardown()
            raise

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
        self._fence = fence()
        self._sl_fence = store_load_fence()
        hdr = header_fields(seg.mm)
        self._owner = (int(hdr["owner_pid"]), int(hdr["owner_start"]))
        self._doorbell = self._open_sem("r")
        if self._w[W_CLOSED]:
            raise PipelineClosed(f"pipeline {self.name} is closed")
        self._claim_lane(label)
        lw = p.lane_word(self.lane)
        self._lane_w = lw
        self._wake_w = lw + L_WAKE_AT
        self._free_sem = self._open_sem(f"f{self.lane}")
        self._ready = Producer(self._w, p.ready_ring_word(self.lane), p.n_slots, lw + L_READY_HEAD, lw + L_READY_TAIL)
        self._free = Consumer(self._w, p.free_ring_word(self.lane), p.n_slots, lw + L_FREE_HEAD, lw + L_FREE_TAIL)
        self._leaf_all = [seg.leaf_view(i) for i in range(len(schema.leaves))]
        first = 0
        self._leaf_base: dict[str, int] = {}
        for ts in schema.timescales:
            self._leaf_base[ts.name] = first
            first += len(ts.leaves)
        self._slot_views: dict[int, list[list[np.ndarray]]] = {}  # built on a slot's first use, then reused
        self._slot = -1
        self._cur: list[list[np.ndarray]] = []
        self._fill = [0] * len(schema.timescales)
        self._seq = 0
        self.policy_version = 0
        self.stats = {"commits": 0, "wait_s": 0.0, "waits": 0}

    # -- set-up and tear-down -----------------------------------------------

    def _open_sem(self, role: str) -> posix_ipc.Semaphore:
        try:
            sem = posix_ipc.Semaphore(sem_name(self.name, role), 0)
        except posix_ipc.ExistentialError:
            raise PipelineClosed(f"pipeline {self.name} is closed (its semaphores are gone)") from None
        self._sems.append(sem)
        return sem

    def _claim_lane(self, label: str) -> None:
        """Take a free lane: an open-file-description lock on the lane's byte, which dies with us."""
        shm = posix_ipc.SharedMemory(self.name, 0)
        self._fd = shm.fd  # kept open: closing it drops the lock
        w, p = self._w, self._plan
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            for lane in range(p.n_lanes):
                lw = p.lane_word(lane)
                if w[lw + L_STATE] != LANE_FREE:
                    continue
                try:
                    fcntl.fcntl(self._fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _LOCK_BASE + lane, 1, 0))
                except OSError:
                    continue  # another writer holds it
                if w[lw + L_STATE] != LANE_FREE:  # a writer retired it between our look and our lock
                    fcntl.fcntl(self._fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, _LOCK_BASE + lane, 1, 0))
                    continue
                # The reader reset the counters when it freed the lane; we own line 0 now.
                w[lw + L_PID] = self._pid
                w[lw + L_START] = start_time(self._pid)
                raw = str(label).encode()[:LABEL_BYTES]
                off = (lw + L_LABEL) * 8
                self._seg.mm[off : off + len(raw)] = raw  # type: ignore[union-attr]
                w[lw + L_LABEL_LEN] = len(raw)
                w[lw + L_EPOCH] = w[lw + L_EPOCH] + 1
                w[lw + L_STATE] = LANE_ACTIVE
                self.lane = lane
                # Tell the reader now rather than at its next periodic scan: it lends slots only to
                # lanes it knows. Setting a flag (not a count) loses nothing to a race that matters:
                # at worst a second newcomer waits for that scan, 50 ms later.
                w[W_NEWCOMER] = 1
                self._doorbell.release()
                return
            if self._w[W_CLOSED]:
                raise PipelineClosed(f"pipeline {self.name} is closed")
            if deadline is not None and time.monotonic() >= deadline:
                raise SlotTimeout(
                    f"pipeline {self.name}: all {p.n_lanes} writer lanes are taken (max_writers={p.n_lanes} at "
                    f"shmbuf.create) and none came free within timeout={self.timeout} s"
                )
            self._check_reader()
            time.sleep(0.01)

    def _teardown(self) -> None:
        for sem in self._sems:
            try:
                sem.close()
            except posix_ipc.Error:
                pass
        self._sems = []
        if self._fd >= 0:
            os.close(self._fd)  # drops the lane lock
            self._fd = -1
        if self._seg is not None:
            self._cur = []
            self._slot_views = {}
            self._leaf_all = []
            self._seg.close()
            self._seg = None

    def close(self, reason: str = "closed") -> None:
        """Give the lane back. A rollout that was started and not committed is dropped."""
        if self._closed or self._seg is None:
            return
        self._closed = True
        if os.getpid() == self._pid:
            try:
                if not self._w[W_CLOSED]:
                    self._post(_control.encode("bye", reason=str(reason)[:200]), wait=0.2)
                    self._w[self._lane_w + L_STATE] = LANE_RETIRED
                    self._doorbell.release()
            except Exception:
                pass  # closing must not raise because the reader went first
            self._teardown()
        else:  # a forked copy: the lane, its fd and its semaphores are the parent's
            self._seg = None
            self._sems = []
            self._fd = -1

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not isinstance(exc, (PipelineClosed, BrokenPipeline, KeyboardInterrupt)):
            self.report_error(exc)
        self.close()

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
            KeyError: unknown timescale (names the known ones).
            IndexError: the timescale is full (names timescale, capacity, index).
            SchemaError: wrong keys, dtype or shape (names the leaf path).
            SlotTimeout, PipelineClosed, BrokenPipeline: see :meth:`commit`.
        """
        ts = self._ts.get(timescale)
        if ts is None:
            self._unknown(timescale)
        i = self._fill[ts.index]
        if i >= ts.capacity:
            raise IndexError(f"Timescale '{timescale}' has {ts.capacity} slots, but you tried to add at index {i}")
        if self._slot < 0:
            self._claim_slot()
        elif self._w[W_CLOSED]:
            self._raise_closed()
        vals = ts.scratch
        if ts.keys is not None and type(data) is dict and len(data) == len(vals):
            # Fast path, a flat dict of exact arrays: check everything before writing anything.
            j = 0
            for k, dt, shape in ts.checks:
                x = data.get(k, _MISSING)
                tx = type(x)  # an array, or a numpy scalar (reward[t]) of the leaf's own type
                if (tx is not np.ndarray and tx is not dt.type) or x.dtype is not dt or x.shape != shape:
                    x = self._slow_item(ts, j, x, data)
                vals[j] = x
                j += 1
        else:
            self._general(ts, data)
        if ts.buffered:
            for dst, x in zip(self._cur[ts.index], vals):
                dst[i] = x
        else:
            for dst, x in zip(self._cur[ts.index], vals):
                dst[...] = x
        self._fill[ts.index] = i + 1

    def commit(self, policy_version: int | None = None) -> int:
        """Publish the current slot to the reader; return the rollout's sequence number on this lane.

        Records how far each timescale was filled, so a rollout cut short is
        delivered with its real length. The next ``add`` claims a new slot.

        Raises:
            ValueError: nothing was added since the last commit.
            PipelineClosed: the reader closed the pipeline.
        """
        if self._slot < 0 or not any(self._fill):
            raise ValueError(f"commit of an empty rollout on pipeline {self.name}: nothing was added since the last commit")
        w = self._w
        if w[W_CLOSED]:
            self._raise_closed()
        slot = self._slot
        sw = self._plan.slot_word(slot)
        seq = self._seq
        w[sw + S_SEQ] = seq
        w[sw + S_POLICY] = self.policy_version if policy_version is None else policy_version
        for t, n in enumerate(self._fill):
            w[sw + S_FILL + t] = n
            self._fill[t] = 0
        w[sw + S_COMMIT_NS] = time.monotonic_ns()
        if self._fence:  # payload before the ring entry (not needed on x86-64: see _ring)
            self._fence()
        self._ready.push(slot)
        # Ring the doorbell only if the reader sleeps and asked to be woken by now. The fence orders
        # our head store before the load of its wake word, as its fence orders its store before
        # its load of our head: one of the two always sees the other (docs/design/rings.md).
        self._sl_fence()
        if w[self._wake_w] <= self._ready.head:
            self._doorbell.release()
        self._slot = -1
        self._seq = seq + 1
        self.stats["commits"] += 1
        return seq

    def reset(self) -> None:
        """Forget what was added since the last commit (e.g. an aborted episode); keep the slot."""
        for t in range(len(self._fill)):
            self._fill[t] = 0

    def send(self, tree: Any, policy_version: int | None = None) -> int:
        """Write a whole, already built rollout and commit it (echo's ``client.send(buf.build())``, one call).

        Every timescale must be present with the example's structure; buffered
        timescales count as full.
        """
        if self._w[W_CLOSED]:
            self._raise_closed()
        if self._slot >= 0 and any(self._fill):
            raise RuntimeError(f"send() while a rollout is being built with add() on pipeline {self.name}; commit() or reset() it first")
        if type(tree) is not dict or len(tree) != len(self._ts) or tree.keys() != self._ts.keys():
            got = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
            raise SchemaError(f"send: expected a dict with timescales {sorted(self._ts)}, got {got}")
        for ts in self._ts_list:  # check everything before writing anything
            sub = tree[ts.spec.name]
            vals = ts.scratch
            if ts.keys is not None and type(sub) is dict and len(sub) == len(vals):
                j = 0
                for k, dt, shape in ts.whole_checks:
                    x = sub.get(k, _MISSING)
                    if type(x) is not np.ndarray or x.dtype is not dt or x.shape != shape:
                        if x is _MISSING:
                            self._keys_mismatch(ts, sub)
                        x = _check_whole(ts.leaves[j], x)
                    vals[j] = x
                    j += 1
            else:
                vals[:] = self._leaves_of(ts, sub, whole=True)
        if self._slot < 0:
            self._claim_slot()
        elif self._w[W_CLOSED]:
            self._raise_closed()
        for ts in self._ts_list:
            vals = ts.scratch
            for j, dst in enumerate(self._cur[ts.index]):
                dst[...] = vals[j]  # dtype already checked against 'same_kind'
                vals[j] = None  # hold no reference to the caller's arrays
            self._fill[ts.index] = ts.capacity
        return self.commit(policy_version)

    # -- slots --------------------------------------------------------------

    def _claim_slot(self) -> None:
        if self._closed or self._seg is None:
            raise PipelineClosed(f"this Writer of pipeline {self.name} was closed")
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this Writer was made in process {self._pid} and copied into {os.getpid()} by fork; "
                "make a new Writer in this process from the pipeline's handle"
            )
        if self._w[W_CLOSED]:
            self._raise_closed()
        if self._free.available() <= 0:
            self._wait_for_slot()
        if self._fence:
            self._fence()
        slot = self._free.pop()
        if not 0 <= slot < self._plan.n_slots:
            raise RuntimeError(f"pipeline {self.name}: free ring holds slot {slot}, outside 0..{self._plan.n_slots - 1}")
        self._slot = slot
        views = self._slot_views.get(slot)
        if views is None:
            views = self._slot_views[slot] = [
                [self._leaf_all[self._leaf_base[ts.name] + j][slot, ...] for j in range(len(ts.leaves))]
                for ts in self.schema.timescales
            ]
        self._cur = views

    def _wait_for_slot(self) -> None:
        w, flag = self._w, self._lane_w + L_FREE_WAIT
        t0 = time.monotonic()
        deadline = None if self.timeout is None else t0 + self.timeout
        self.stats["waits"] += 1
        try:
            while True:
                wait = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
                if wait <= 0:
                    raise SlotTimeout(
                        f"pipeline {self.name}: no free slot within timeout={self.timeout} s (Writer(timeout=...)); "
                        "the reader is not releasing rollouts as fast as writers commit them, or there are too few slots"
                    )
                # Say we sleep, then look once more: the reader stores its head, fences and reads our
                # flag; we store the flag, fence and read its head; one of us sees the other.
                w[flag] = 1
                self._sl_fence()
                if self._free.available() > 0:
                    return
                try:
                    self._free_sem.acquire(wait)  # a spare post from an earlier round only means one more look
                except posix_ipc.BusyError:
                    pass
                w[flag] = 0
                if w[W_CLOSED]:
                    self._raise_closed()
                if self._free.available() > 0:
                    return
                self._check_reader()
        finally:
            w[flag] = 0
            self.stats["wait_s"] += time.monotonic() - t0

    def _check_reader(self) -> None:
        if not alive(*self._owner):
            raise BrokenPipeline(f"pipeline {self.name}: the reader's process (pid {self._owner[0]}) died")

    def _raise_closed(self) -> None:
        raise PipelineClosed(f"pipeline {self.name} was closed by its reader; this writer can do nothing more")

    # -- control messages ---------------------------------------------------

    def _post(self, payload: bytes, wait: float = 1.0) -> bool:
        """Put one message in this lane's mailbox; False if the reader did not take the last one in time,
        closed the pipeline, or died."""
        from shmbuf._segment import MAILBOX_PAYLOAD_OFF

        w = self._w
        base = self._plan.mbox_off_of(self.lane)
        mw = base // 8
        deadline = time.monotonic() + wait
        checked = time.monotonic()
        while w[mw + _control.M_ACK] != w[mw + _control.M_POST]:
            now = time.monotonic()
            if now >= deadline or w[W_CLOSED]:
                return False
            if now - checked > WAIT_SLICE:
                if not alive(*self._owner):
                    return False
                checked = now
            time.sleep(0.001)
        off = base + MAILBOX_PAYLOAD_OFF
        self._seg.mm[off : off + len(payload)] = payload  # type: ignore[union-attr]
        w[mw + _control.M_LEN] = len(payload)
        w[mw + _control.M_MAGIC] = _control.MSG_MAGIC
        if self._fence:
            self._fence()
        w[mw + _control.M_POST] = w[mw + _control.M_POST] + 1
        self._doorbell.release()
        return True

    def report_error(self, exc: BaseException, timeout: float = 10.0) -> bool:
        """Send an exception (with its traceback, as text) to the reader, which raises it as WriterError.

        Waits up to ``timeout`` seconds for the reader to take a message still in the mailbox (it
        does at its next get, get_batch or poll). False if it did not, closed the pipeline, or died.
        """
        if self._closed or self._seg is None:
            return False
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        msg = _control.encode("error", exc_type=type(exc).__name__, message=str(exc)[:2000], traceback=tb)
        return self._post(msg, wait=timeout)

    def send_stats(self) -> bool:
        """Send this writer's counters to the reader (shown in ``reader.stats()``)."""
        counters = {k: v for k, v in self.stats.items()}
        return self._post(_control.encode("stats", counters=counters), wait=0.0)

    # -- errors, the slow way -----------------------------------------------

    def _unknown(self, timescale: Any) -> None:
        raise KeyError(f"Unknown timescale {timescale!r}. Known: {list(self._ts)}")

    def _slow_item(self, ts: _Ts, j: int, x: Any, data: dict[str, Any]) -> np.ndarray:
        if x is _MISSING:
            self._keys_mismatch(ts, data)
        return _coerce(ts.leaves[j], ts.buffered, x)

    def _keys_mismatch(self, ts: _Ts, data: dict[str, Any]) -> None:
        expected = set(ts.keys or ())
        got = set(data)
        missing = sorted(expected - got, key=str)
        extra = sorted(got - expected, key=str)
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"{ts.spec.name}/{k}" for k in missing))
        if extra:
            parts.append("unexpected " + ", ".join(f"{ts.spec.name}/{k}" for k in extra))
        raise SchemaError(f"timescale '{ts.spec.name}': expected keys {sorted(expected)}, got {sorted(got, key=str)} ({'; '.join(parts)})")

    def _general(self, ts: _Ts, data: Any) -> None:
        leaves = self._leaves_of(ts, data, whole=False)
        vals = ts.scratch
        for j, x in enumerate(leaves):
            vals[j] = _coerce(ts.leaves[j], ts.buffered, x)

    def _leaves_of(self, ts: _Ts, data: Any, whole: bool) -> list[Any]:
        """The leaves of ``data`` in schema order, or a SchemaError naming the first mismatch."""
        if ts.keys is not None and isinstance(data, dict):
            if set(data) != set(ts.keys):
                self._keys_mismatch(ts, data)
            leaves = [data[k] for k in ts.keys]
        else:
            leaves, spec = optree.tree_flatten(data)
            if spec != self._treespecs[ts.spec.name]:  # not the example's exact containers: walk and compare
                leaves = []
                flatten_like(ts.spec.structure, data, (ts.spec.name,), leaves)
        if whole:
            return [_check_whole(lf, x) for lf, x in zip(ts.leaves, leaves)]
        return leaves


def _coerce(leaf: Leaf, buffered: bool, x: Any) -> np.ndarray:
    """Check one incoming item against its leaf; return it as an array numpy can assign without surprises."""
    if not isinstance(x, np.ndarray):
        if isinstance(x, (bool, int, float, complex, np.generic)):
            x = np.asarray(x)
        else:
            raise SchemaError(
                f"leaf {leaf.name}: expected a numpy array of {leaf.dtype} with shape {leaf.item_shape}, got {type(x).__name__}"
            )
    if x.dtype != leaf.dtype and not np.can_cast(x.dtype, leaf.dtype, casting="same_kind"):
        raise SchemaError(
            f"leaf {leaf.name}: expected dtype {leaf.dtype} (or one that casts to it under numpy's 'same_kind' rule), got {x.dtype}"
        )
    item = leaf.item_shape
    if x.shape != item:
        ok = x.shape == (1, *item) if buffered else (len(item) >= 1 and item[0] == 1 and x.shape == item[1:])
        if not ok:
            raise SchemaError(f"leaf {leaf.name}: expected shape {item} for one add(), got {x.shape}")
        x = x.reshape(item)
    return x


def _check_whole(leaf: Leaf, x: Any) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if isinstance(x, (bool, int, float, complex, np.generic)) and leaf.shape == ():
            x = np.asarray(x)
        else:
            raise SchemaError(f"leaf {leaf.name}: expected a numpy array of {leaf.dtype} {leaf.shape}, got {type(x).__name__}")
    if x.dtype != leaf.dtype and not np.can_cast(x.dtype, leaf.dtype, casting="same_kind"):
        raise SchemaError(f"leaf {leaf.name}: expected dtype {leaf.dtype} (or one that casts to it under 'same_kind'), got {x.dtype}")
    if x.shape != leaf.shape:
        raise SchemaError(f"leaf {leaf.name}: expected shape {leaf.shape}, got {x.shape}")
    return x
