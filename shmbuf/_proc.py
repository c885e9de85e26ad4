"""Is a process still the one we met? (pid plus start time, so a reused pid is not mistaken for it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# pid_t is a signed 32-bit int: a larger "pid" (read from a corrupt header) is no process, and
# os.kill would raise OverflowError on it. Linux's own ceiling (PID_MAX_LIMIT) is 2**22.
PID_MAX = 2**31 - 1


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


def valid_pid(pid: object) -> bool:
    """An int that a process id can be (1 to 2**31-1); bool is not one."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= PID_MAX


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or 0 where /proc cannot tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Owner:
    """The process that created a shared object, as the object's header records it.

    ``start`` (clock ticks since boot) and ``pidns`` (its pid namespace) are 0 where the creator
    could not tell. A pid means nothing outside its own pid namespace (a container with its own
    ``--pid`` but a shared /dev/shm): there the owner's liveness is unknown, never "dead".
    """

    pid: int
    start: int
    pidns: int

    @property
    def elsewhere(self) -> bool:
        """True when the owner lives in another pid namespace (both namespaces known, and different)."""
        mine = pid_namespace()
        return bool(self.pidns and mine and self.pidns != mine)

    def alive(self) -> bool:
        """True while the owner runs, and True when that cannot be known (another pid namespace)."""
        return self.elsewhere or alive(self.pid, self.start)


def alive(pid: int, started: int) -> bool:
    """True while ``pid`` runs and (where known) is the same process that started at ``started``."""
    if not valid_pid(pid):
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
