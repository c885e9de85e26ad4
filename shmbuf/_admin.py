"""What ``shmbuf ls`` and ``shmbuf clean`` see: every shmbuf object in /dev/shm, and whether its owner lives.

/dev/shm is writable by every local user, so nothing found there is trusted: a pipeline is read
through ``Segment.attach`` (no links followed, a 0600 regular file of ours, every header field
checked), a weight broadcast through ``WeightSubscriber``, a semaphore file is lstat'ed. What
fails is listed with the reason (``error``, or ``kept`` for single files) and never removed; an
owner in another pid namespace is never judged dead. Nothing here raises on what it finds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shmbuf._errors import ShmbufError
from shmbuf._lane import LANE_ACTIVE, LANE_RETIRED, Record, lane_held, read_label
from shmbuf._names import PREFIX, SHM_DIR, entry_pattern
from shmbuf._proc import Owner, alive
from shmbuf._segment import W_CLOSED, W_DELIVERED, W_POOL, W_READY_DEPTH, Segment
from shmbuf._trust import path_problem

_SEG = entry_pattern("pipeline")
_WEIGHTS = entry_pattern("weights")
_SEM = entry_pattern("pipeline", semaphore=True)
_INFER = entry_pattern("inference")
_ISEM = entry_pattern("inference", semaphore=True)


@dataclass
class Found:
    """One pipeline's (or weight broadcast's) objects as found in /dev/shm.

    ``semaphores`` holds only semaphore files shmbuf could have made (regular, ours, 0600);
    anything else under a shmbuf name is in ``kept`` as ``(entry, why)`` and is never removed.
    """

    name: str
    segment: bool
    semaphores: list[str] = field(default_factory=list)
    owner_pid: int = 0
    owner_alive: bool = False
    size: int = 0
    slots: int = 0
    lanes: int = 0
    schema: str = ""
    closed: bool = False
    pool: int = 0
    ready: int = 0
    delivered: int = 0
    writers: list[tuple[int, int, bool, int, str]] = field(default_factory=list)  # lane, pid, alive, commits, label
    error: str = ""
    weights: bool = False  # a weight-broadcast object (shmbuf._weights), not a pipeline
    inference: bool = False  # an inference table (shmbuf._inference): slots are its clients
    replay: bool = False  # a replay buffer (shmbuf.storage.replay): slots are its rows, delivered its rows inserted
    owner_elsewhere: bool = False  # the owner is in another pid namespace: whether it lives cannot be known here
    kept: list[tuple[str, str]] = field(default_factory=list)  # (entry in /dev/shm, why clean leaves it alone)
    directory: str = SHM_DIR

    @property
    def removable(self) -> bool:
        """Left by a dead owner, or semaphores whose segment is gone: safe to remove (``kept`` entries never are)."""
        if not self.segment:
            return True
        return not self.error and not self.owner_alive and not self.owner_elsewhere

    @property
    def why_kept(self) -> str:
        """Why ``clean`` leaves this pipeline's segment alone ("" when it is removable)."""
        if self.removable:
            return ""
        if self.error:
            return f"unreadable ({self.error}); remove it by hand if you know it is dead"
        if self.owner_elsewhere:
            return f"owner (pid {self.owner_pid} there) is in another pid namespace: whether it lives cannot be told from here"
        return f"owner pid {self.owner_pid} is alive"


def scan(directory: str = SHM_DIR, *, name: str | None = None) -> list[Found]:
    """Every shmbuf pipeline with an object in ``directory``, read without changing anything; never raises on content.

    ``name`` (a pipeline's or weight broadcast's) limits the scan to that one's objects. Objects
    that vanish while we look (their owner closed them) are left out.
    """
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    if name is not None:
        entries = [e for e in entries if e == name[1:] or e.startswith(f"sem.{name[1:]}-")]
    found: dict[str, Found] = {}
    for entry in entries:
        m = _WEIGHTS.match(entry)
        if m:
            found.setdefault("/" + entry, Found("/" + entry, segment=True, weights=True, directory=directory))
            continue
        m = _INFER.match(entry)
        if m:
            found.setdefault("/" + entry, Found("/" + entry, segment=True, directory=directory)).segment = True
            found["/" + entry].inference = True
            continue
        m = _SEG.match(entry)
        if m:
            pipeline = PREFIX + m.group(1)
            found.setdefault(pipeline, Found(pipeline, segment=True, directory=directory)).segment = True
            continue
        m = _SEM.match(entry) or _ISEM.match(entry)
        if m:
            pipeline = PREFIX + ("i" if m.re is _ISEM else "") + m.group(1)
            f = found.setdefault(pipeline, Found(pipeline, segment=False, directory=directory, inference=m.re is _ISEM))
            why = path_problem(os.path.join(directory, entry))
            if why:
                f.kept.append((entry, why))
            elif why is not None:  # None: gone since the listing
                f.semaphores.append(entry)
    out = []
    for f in found.values():
        if f.segment:
            (_inspect_weights if f.weights else _inspect_inference if f.inference else _inspect)(f)
            if f.error and path_problem(os.path.join(directory, f.name[1:])) is None:
                # removed while we looked: what remains are its semaphores, if any (its owner unlinks them first, so
                # the ones listed before are most likely gone too)
                f.segment, f.error = False, ""
                f.semaphores = [e for e in f.semaphores if os.path.lexists(os.path.join(directory, e))]
        if f.segment or f.semaphores or f.kept:
            out.append(f)
    return out


def _owner(f: Found, owner: Owner) -> None:
    f.owner_pid = owner.pid
    f.owner_elsewhere = owner.elsewhere
    f.owner_alive = not f.owner_elsewhere and alive(owner.pid, owner.start)


def _inspect(f: Found) -> None:
    from shmbuf.storage import replay  # the learner-side package; only shmbuf ls and clean need to know it here

    if replay.is_replay(f.name):
        _inspect_replay(f, replay)
        return
    try:
        seg = Segment.attach(f.name, readonly=True)
    except ShmbufError as exc:
        f.error = str(exc)
        return
    try:
        _owner(f, seg.creator)
        f.size = len(seg.mm)
        f.slots = seg.plan.n_slots
        f.lanes = seg.plan.n_lanes
        f.schema = seg.schema.summary()
        w = seg.words
        f.closed = bool(w[W_CLOSED])
        f.pool, f.ready, f.delivered = w[W_POOL], w[W_READY_DEPTH], w[W_DELIVERED]
        for lane in range(seg.plan.n_lanes):
            rec = Record(seg.plan, lane)
            if w[rec.state] in (LANE_ACTIVE, LANE_RETIRED):
                pid = w[rec.pid]
                held = lane_held(seg.fd, lane)  # the lane lock: right in any pid namespace (see _lane.lane_held)
                ok = alive(pid, 0) if held is None else held
                f.writers.append((lane, pid, ok, w[rec.ready_head], read_label(seg.mm, w, rec)))  # ready head = commits
    finally:
        seg.close()


def _inspect_replay(f: Found, replay: Any) -> None:
    """A replay buffer: its owner, size, rows, inserts, and the processes inserting into it."""
    f.replay = True
    try:
        info = replay.describe(f.name)
    except ShmbufError as exc:
        f.error = str(exc)
        return
    _owner(f, info.owner)
    f.size, f.slots, f.lanes, f.schema, f.delivered = info.size, info.buffer_size, info.max_writers, info.schema, info.inserted
    f.writers = [(slot, pid, live, rows, "inserter") for slot, pid, live, rows in info.writers]


def _inspect_inference(f: Found) -> None:
    """An inference table, read through its clients' own checks: its owner, size and clients."""
    from shmbuf._inference import describe

    try:
        owner, f.size, f.slots = describe(f.name)
    except ShmbufError as exc:
        f.error = str(exc)
        return
    _owner(f, owner)


def _inspect_weights(f: Found) -> None:
    """A weight-broadcast object, read through the subscriber's own checks; its owner, size and buffers."""
    from shmbuf._weights import WeightSubscriber

    try:
        sub = WeightSubscriber(f.name)
    except ShmbufError as exc:
        f.error = str(exc)
        return
    try:
        _owner(f, sub.owner)
        f.size, f.slots = len(sub._mm), sub.buffers
    finally:
        sub.close()


def remove(f: Found) -> list[str]:
    """Unlink a removable pipeline's objects; return what was removed. Never raises on what it finds.

    Never a live owner's, nor one whose owner is in another pid namespace, nor anything in
    ``f.kept``. Each file is lstat'ed again just before its unlink and left alone (added to
    ``f.kept`` with the reason) unless it is still a 0600 regular file of ours; unlink removes
    a name, never what a link points to. An unlink that fails (another user's file: EPERM) is
    recorded in ``f.kept`` too, and the rest go on.
    """
    if not f.removable:
        return []
    # The semaphores first, the segment last, as the owner's own unlink does: a remover stopped half way leaves the
    # segment, which names the rest for the next look (a watcher's or `shmbuf clean`'s); never semaphores alone.
    entries = list(f.semaphores) + ([f.name[1:]] if f.segment else [])
    removed = []
    for entry in entries:
        path = os.path.join(f.directory, entry)
        why = path_problem(path)
        if why is None:
            continue  # already gone
        if not why:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                why = f"could not remove it: {exc.strerror or exc}"
            else:
                removed.append("/" + entry if entry == f.name[1:] else entry)
                continue
        f.kept.append((entry, why))
    return sorted(removed, key=lambda e: not e.startswith("/"))  # said object first, as it is the one a user knows
