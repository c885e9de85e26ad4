"""The learner's share of the machine: torch's threads in the process that trains, beside the actor processes.

An actor process keeps a core busy while it steps its envs; the learner gets what they leave. torch starts as many
threads as the machine has cores, so a learner on a machine its actors share oversubscribes it: its threads spin
against the actors' (on a 2-core machine with 2 actors, CleanRL's PPO on CartPole was measured at 889 env steps/s
with torch's default threads in the learner against 3,558 with one). The collectors' ``learner_threads`` setting:

- ``None`` (the default): torch is left as it is, and a collector warns (``RuntimeWarning``) when torch, imported in
  the learner, has more threads than the actors leave, naming the setting;
- ``"auto"``: ``torch.set_num_threads`` with what the actors leave (the cores this process may run on minus one per
  actor, at least one);
- an int: that many.

The check runs once, as the collector starts its actors. See docs/on-policy.md ("The learner's CPU").
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import shmbuf

__all__ = ["cores", "learner_threads", "threads_left"]


def cores() -> int:
    """The cores this process may run on (its affinity mask: what a container or ``taskset`` leaves it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_left(num_actors: int, machine_cores: int | None = None) -> int:
    """The learner's threads when each of ``num_actors`` actor processes keeps a core busy: at least one."""
    return max(1, (cores() if machine_cores is None else machine_cores) - num_actors)


def learner_threads(setting: Any, num_actors: int, *, processes: bool = True, machine_cores: int | None = None,
                    stacklevel: int = 3) -> int | None:
    """Apply the ``learner_threads`` setting for a collector of ``num_actors`` actors; return the threads set (None:
    torch left as it is). ``processes``: the actors are processes (thread actors share this process's cores anyway,
    and nothing is checked)."""
    if setting is None:
        loaded = sys.modules.get("torch")  # the learner's torch, if it uses one: a collector never imports it for this
        if loaded is None or not processes:
            return None
        machine = cores() if machine_cores is None else machine_cores
        left = threads_left(num_actors, machine)
        have = loaded.get_num_threads()
        if have > left:
            warnings.warn(
                f"torch in this process (the learner) runs {have} threads, but the {num_actors} actor processes leave "
                f"it {left} of this machine's {machine} cores: its threads "
                f"will contend with the actors (a training loop can run several times slower). Pass "
                f"learner_threads='auto' (sets torch.set_num_threads({left})) or an int, or call "
                "torch.set_num_threads yourself before the collector starts", RuntimeWarning, stacklevel=stacklevel)
        return None
    if setting == "auto":
        n = threads_left(num_actors, machine_cores) if processes else None
        if n is None:
            return None
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        n = setting
    else:
        raise shmbuf.UsageError(f"learner_threads: expected None (leave torch as it is, warn when it oversubscribes), "
                                f"'auto' (the cores the actors leave) or an int >= 1, got {setting!r}")
    try:
        import torch
    except ImportError as e:
        raise shmbuf.UsageError(f"learner_threads={setting!r} sets torch's threads in this process, but torch is not "
                                "installed: leave learner_threads=None") from e
    torch.set_num_threads(n)
    return n
