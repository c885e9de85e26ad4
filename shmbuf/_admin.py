"""What ``shmbuf ls`` and ``shmbuf clean`` see: every shmbuf object in /dev/shm, and whether its owner lives."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import posix_ipc

from shmbuf._errors import SegmentError
from shmbuf._proc import alive
from shmbuf._reader import read_label
from shmbuf._segment import (
    L_PID, L_READY_HEAD, L_STATE, LANE_ACTIVE, LANE_RETIRED, PREFIX, W_CLOSED, W_DELIVERED, W_POOL, W_READY_DEPTH,
    Segment, header_fields, unlink_all,
)

SHM_DIR = "/dev/shm"
_SEG = re.compile(r"^shmbuf-([0-9a-f]{16})$")
_WEIGHTS = re.compile(r"^shmbuf-w([0-9a-f]{16})$")
_SEM = re.compile(r"^sem\.shmbuf-([0-9a-f]{16})-(r|f\d+)$")


@dataclass
class Found:
    """One pipeline's objects as found in /dev/shm."""

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

    @property
    def removable(self) -> bool:
        """Left by a dead owner, or semaphores whose segment is gone: safe to remove."""
        if not self.segment:
            return True
        return not self.error and not self.owner_alive


def scan(directory: str = SHM_DIR) -> list[Found]:
    """Every shmbuf pipeline with an object in ``directory``, read without changing anything."""
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    found: dict[str, Found] = {}
    for entry in entries:
        m = _WEIGHTS.match(entry)
        if m:
            f = found.setdefault("/" + entry, Found("/" + entry, segment=True, weights=True))
            continue
        m = _SEG.match(entry)
        if m:
            found.setdefault(PREFIX + m.group(1), Found(PREFIX + m.group(1), segment=True)).segment = True
            continue
        m = _SEM.match(entry)
        if m:
            name = PREFIX + m.group(1)
            found.setdefault(name, Found(name, segment=False)).semaphores.append(entry)
    for f in found.values():
        if f.weights:
            _inspect_weights(f, directory)
        elif f.segment:
            _inspect(f)
    return list(found.values())


def _inspect(f: Found) -> None:
    try:
        seg = Segment.attach(f.name, readonly=True)
    except SegmentError as exc:
        f.error = str(exc)
        return
    try:
        hdr = header_fields(seg.mm)
        f.owner_pid = int(hdr["owner_pid"])
        f.owner_alive = alive(f.owner_pid, int(hdr["owner_start"]))
        f.size = len(seg.mm)
        f.slots = seg.plan.n_slots
        f.lanes = seg.plan.n_lanes
        f.schema = seg.schema.summary()
        w = seg.words
        f.closed = bool(w[W_CLOSED])
        f.pool, f.ready, f.delivered = w[W_POOL], w[W_READY_DEPTH], w[W_DELIVERED]
        for lane in range(seg.plan.n_lanes):
            lw = seg.plan.lane_word(lane)
            if w[lw + L_STATE] in (LANE_ACTIVE, LANE_RETIRED):
                pid = w[lw + L_PID]
                label = read_label(seg.mm, w, lw)
                f.writers.append((lane, pid, alive(pid, 0), w[lw + L_READY_HEAD], label))  # ready head = commits
    finally:
        seg.close()


def _inspect_weights(f: Found, directory: str) -> None:
    """A weight-broadcast object: check its magic and size, read its owner."""
    from shmbuf._weights import _HEADER, W_MAGIC

    try:
        with open(os.path.join(directory, f.name[1:]), "rb") as fh:
            raw = fh.read(_HEADER.size)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        f.error = str(exc)
        return
    if len(raw) < _HEADER.size:
        f.error = "too small to be a shmbuf weights object"
        return
    magic, _lv, _hb, total, buffers, pid, started, *_ = _HEADER.unpack(raw)
    if magic != W_MAGIC or total != size:
        f.error = "not a shmbuf weights object (magic or size)"
        return
    f.owner_pid, f.size, f.slots = int(pid), size, int(buffers)
    f.owner_alive = alive(int(pid), int(started))


def remove(f: Found) -> list[str]:
    """Unlink a removable pipeline's objects; return what was removed. Never a live owner's."""
    if not f.removable:
        return []
    removed = []
    if f.weights:
        try:
            posix_ipc.unlink_shared_memory(f.name)
            removed.append(f.name)
        except posix_ipc.ExistentialError:
            pass
        return removed
    if f.segment:
        unlink_all(f.name, f.lanes)
        removed.append(f.name)
    for sem in f.semaphores:
        try:
            posix_ipc.unlink_semaphore("/" + sem[len("sem."):])
            removed.append(sem)
        except posix_ipc.ExistentialError:
            pass
    return removed
