"""What /proc says of a process: is it still the one we met (pid plus start time, so a reused pid is not
mistaken for it), and how much CPU it and the machine used. The one reader of /proc/<pid>/stat in shmbuf."""

from __future__ import annotations

import os
from dataclasses import dataclass

# pid_t is a signed 32-bit int: a larger "pid" (read from a corrupt header) is no process, and
# os.kill would raise OverflowError on it. Linux's own ceiling (PID_MAX_LIMIT) is 2**22.
PID_MAX = 2**31 - 1


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time, per second
# Fields of /proc/<pid>/stat as stat_fields() returns them: field n of proc(5), counted from 1, is index n - 3.
_STATE, _UTIME, _STIME, _START = 0, 11, 12, 19


def stat_fields(pid: int | str) -> list[bytes] | None:
    """/proc/<pid>/stat's fields from the third on (state, ppid, ...), or None where /proc cannot tell.

    ``pid`` may be ``"self"`` or ``"<pid>/task/<tid>"`` (a thread).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields after the last ')' are plain.
    return raw[raw.rfind(b")") + 2 :].split()


def _field(fields: list[bytes] | None, i: int) -> int:
    """Field ``i`` of :func:`stat_fields` as an int; 0 where /proc could not tell."""
    try:
        return int(fields[i]) if fields is not None else 0
    except (IndexError, ValueError):
        return 0


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot, or 0 where /proc cannot tell (then pid alone is used)."""
    return _field(stat_fields(pid), _START)


def cpu_ticks(pid: int | str = "self") -> int:
    """User plus system CPU time of a process (all its threads) or thread, in clock ticks; 0 where /proc cannot tell.

    Divide by :data:`CLOCK_TICKS` for seconds.
    """
    fields = stat_fields(pid)
    return _field(fields, _UTIME) + _field(fields, _STIME)


def machine_ticks() -> tuple[int, int]:
    """``(busy, all)`` clock ticks of the whole machine since boot, all cores (/proc/stat's first line: busy is
    everything but idle and iowait); ``(0, 0)`` where /proc cannot tell."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0), sum(v)


def valid_pid(pid: object) -> bool:
    """An int that a process id can be (1 to 2**31-1); bool is not one."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= PID_MAX


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or 0 where /proc cannot tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def this_process() -> Owner:
    """This process, as an object's header records its creator."""
    pid = os.getpid()
    return Owner(pid, start_time(pid), pid_namespace())


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
    fields = stat_fields(pid)
    return fields is not None and fields[_STATE : _STATE + 1] in ([b"Z"], [b"X"])
