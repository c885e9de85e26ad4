"""Is a process still the one we met? (pid plus start time, so a reused pid is not mistaken for it)."""

from __future__ import annotations

import os


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot, or 0 where /proc cannot tell (then pid alone is used)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses; fields after the last ')' are plain.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of stat, counted from 1
    except (IndexError, ValueError):
        return 0


def alive(pid: int, started: int) -> bool:
    """True while ``pid`` runs and (where known) is the same process that started at ``started``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's: it is alive, and it is not ours
    if started:
        now = start_time(pid)
        if now and now != started:
            return False
        if not now:
            return os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc/self") else True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    state = raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3]
    return state in (b"Z", b"X")
