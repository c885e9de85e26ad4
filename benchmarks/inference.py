"""Batched inference benchmark: CartPole frames/s, step round trip and forward batch sizes of four collectors.

One command, from the repository root (torchrl installs a top-level ``benchmarks`` package of its
own, which shadows this one anywhere else)::

    python -m benchmarks.inference [--quick] [--out DIR]      # or: make bench-inference

writes ``<out>/inference[-quick].json`` (every window of every run, the machine, the settings, the
configurations tried), ``.md`` (the tables) and ``.png`` (the plot). In one
run, on ``CartPole-v1`` (gymnasium), with 4, 8 and 16 envs and two torch MLP policies
(4->64->64->2 and 4->512->512->2, an action sampled from the logits by Gumbel-max; the same
module, with the same weights, in every collector):

1. ``workers.AsyncBatchedCollector``: the policy in a server thread of the learner; ``n`` env workers
   in processes or in threads (``env_backend``), tried; and 2 env processes each with a gymnasium
   ``SyncVectorEnv`` of ``n/2`` envs (one request per worker holds its ``n/2`` observations). Two rows.
2. ``workers.Collector``, a policy copy per actor: ``n`` actors x 1 env, and 2 actors each with a
   gymnasium ``SyncVectorEnv`` of ``n/2`` envs (its best configuration on 2 cores). Both rows.
3. TorchRL's ``AsyncBatchedCollector``, the policy as a ``TensorDictModule``: env workers in threads;
   in processes through the driver's threads; in processes with ``transport="auto"`` (TorchRL's
   documented fast path: a policy process the env workers reach directly), tried.
4. TorchRL's ``MultiSyncCollector``: ``n`` workers x 1 env, or 2 workers x ``SerialEnv(n/2)``, tried.

"Tried": for each env count, every configuration is measured with the first policy and the fastest
is the one shown and measured with the other policy; every configuration's figures are in the
results. Both async
collectors keep TorchRL's batching defaults (``max_batch_size=64, min_batch_size=1,
server_timeout=0.01``); ``frames_per_batch`` is the same for all four.

How each figure is taken, the same way for every collector:

- **frames/s**: every env is wrapped (:class:`TimedEnv`) in a gymnasium wrapper that appends, at
  each ``step()``/``reset()``, its entry and exit time (``time.monotonic_ns``, one clock for all
  processes) to a per-env numpy memmap file (:class:`EventLog`): no pickle, no queue. After a
  warm-up (dropped) the benchmark counts the ``step()`` calls of all envs inside each of
  ``--windows`` windows of ``--window-s``; the figure is the median window. The frames the
  collector *delivered* in the same windows are recorded too, as a cross-check.
- **step round trip** (p50/p99): the interval between consecutive ``step()`` entries of one env
  (its step plus the wait for its next action), pooled over the envs, inside the windows;
  intervals across a reset are left out. It splits into the env's own step time and the wait.
- **forward batch sizes**: the policy runs inside :class:`CountingPolicy`, which logs each
  forward's input batch size and duration to a per-process memmap file, wherever the forward runs
  (the learner's server thread for shmbuf's async collector, TorchRL's server thread or process,
  the actors or workers for the two others).
- **CPU**: at the window edges the learner's threads and every child process's CPU time are read
  from ``/proc``, and the whole machine's busy time from ``/proc/stat``: who is busy, and how much
  load came from outside the run.

Torch runs on one thread in every thread that runs it: ``torch.set_num_threads(1)`` here, in each
env factory, and once in each thread that calls the policy (:class:`CountingPolicy`), because the
setting reaches OpenMP only in the calling thread: without the last, a server thread started later
runs MKL's sgemm on a team of one thread per core whose second thread spin-waits between forwards,
a whole core on this machine (``Collector(torch_threads=1)`` and TorchRL's ``num_threads=1,
num_sub_threads=1`` as well). Process pools start from the standard library's forkserver with
torch, torchrl and gymnasium preloaded (set in :func:`cli`), except TorchRL's ``transport="auto"``
workers, which TorchRL spawns itself: start-up is not measured, and this only keeps the sweep
within its ten minutes (a spawned TorchRL worker spends about 5 s of CPU importing torchrl).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import gymnasium
import numpy as np
import torch
from torch import nn

from benchmarks import machine

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_ID = "CartPole-v1"
POLICIES = {"mlp64": (64, 64), "mlp512": (512, 512)}
NUM_ENVS = (4, 8, 16)
FRAMES_PER_BATCH = 1024
QUICK_FRAMES_PER_BATCH = 256
SEED = 0

# ------------------------------------------------------------------ event logs (memmap files, one writer each)

LOG_MAGIC = 0x31474F4C464E49  # b"INFLOG1" little-endian
LOG_VERSION = 1
_HEADER = 4  # int64 words: magic, version, records written, capacity
_FIELDS = 3  # int64 per record: t_in_ns, t_out_ns, value
LOG_CAPACITY = 1 << 20  # records per file (24 MiB, sparse: only touched pages exist); a ring past that
STEP, RESET = 0, 1


class EventLog:
    """Append-only ``(t_in_ns, t_out_ns, value)`` int64 records in a numpy memmap file, one writing process.

    The file starts with a header (magic, version, records written, capacity); records go round a
    ring of ``capacity``. The writer only appends; :func:`read_log` reads the file once the writer
    has stopped (or while it runs: a record is complete before the count covers it). Nothing is
    pickled or sent: each process opens its own file.
    """

    def __init__(self, path: str, capacity: int = LOG_CAPACITY):
        mm = np.memmap(path, np.int64, "w+", shape=(_HEADER + capacity * _FIELDS,))
        mm[0], mm[1], mm[2], mm[3] = LOG_MAGIC, LOG_VERSION, 0, capacity
        self._mm = mm
        self._w = memoryview(mm).cast("B").cast("q")  # item stores through a memoryview: ~30 ns, not numpy's ~100
        self._cap = capacity
        self._n = 0

    def add(self, t_in: int, t_out: int, value: int) -> None:
        w, base = self._w, _HEADER + (self._n % self._cap) * _FIELDS
        w[base], w[base + 1], w[base + 2] = t_in, t_out, value
        self._n += 1
        w[2] = self._n

    def close(self) -> None:
        self._w.release()
        del self._mm


def read_log(path: str) -> np.ndarray:
    """The records of one :class:`EventLog` file, oldest first, as an ``(N, 3)`` int64 array."""
    raw = np.fromfile(path, np.int64)
    if len(raw) < _HEADER or raw[0] != LOG_MAGIC or raw[1] != LOG_VERSION:
        got = raw[:2].tolist() if len(raw) >= 2 else f"{len(raw) * 8} bytes"
        raise ValueError(f"{path}: expected an event log (magic {LOG_MAGIC:#x}, version {LOG_VERSION}), got {got}")
    n, cap = int(raw[2]), int(raw[3])
    recs = raw[_HEADER:].reshape(cap, _FIELDS)
    if n <= cap:
        return recs[:n].copy()
    return np.roll(recs, -(n % cap), axis=0)


class _Logged:
    """Opens this object's :class:`EventLog` on first use in each process (a forked or unpickled copy opens its own)."""

    _log_dir: str
    _log_tag: str

    def _event_log(self) -> EventLog:
        log = self.__dict__.get("_log")
        if log is None or self.__dict__.get("_log_pid") != os.getpid():
            path = os.path.join(self._log_dir, f"{self._log_tag}-{os.getpid()}-{id(self):x}.log")
            log = EventLog(path)
            self.__dict__["_log"], self.__dict__["_log_pid"] = log, os.getpid()
        return log


# ------------------------------------------------------------------ envs and policies (module level: picklable)


def _one_torch_thread() -> None:
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class TimedEnv(gymnasium.Wrapper, _Logged):
    """Logs the entry and exit time of every ``step()`` (value STEP) and ``reset()`` (RESET) of the env inside."""

    def __init__(self, env: Any, log_dir: str, index: int):
        super().__init__(env)
        self._log_dir, self._log_tag = log_dir, f"env{index:03d}"

    def step(self, action: Any) -> Any:
        t0 = time.monotonic_ns()
        out = self.env.step(action)
        self._event_log().add(t0, time.monotonic_ns(), STEP)
        return out

    def reset(self, **kw: Any) -> Any:
        t0 = time.monotonic_ns()
        out = self.env.reset(**kw)
        self._event_log().add(t0, time.monotonic_ns(), RESET)
        return out


def make_env(log_dir: str, index: int) -> Any:
    """``CartPole-v1`` in a :class:`TimedEnv` (env ``index`` of the run)."""
    _one_torch_thread()
    return TimedEnv(gymnasium.make(ENV_ID), log_dir, index)


def make_vector_env(log_dir: str, indices: tuple[int, ...]) -> Any:
    """A gymnasium ``SyncVectorEnv`` of timed envs (one actor's envs)."""
    return gymnasium.vector.SyncVectorEnv([functools.partial(make_env, log_dir, i) for i in indices])


def make_torchrl_env(log_dir: str, index: int) -> Any:
    """The same timed gymnasium env, in TorchRL's ``GymWrapper`` (integer actions, as the policy gives)."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_env(log_dir, index), categorical_action_encoding=True)


def make_torchrl_serial(log_dir: str, indices: tuple[int, ...]) -> Any:
    """One TorchRL worker's envs: a ``SerialEnv`` of timed envs."""
    from torchrl.envs import SerialEnv

    _one_torch_thread()
    return SerialEnv(len(indices), [functools.partial(make_torchrl_env, log_dir, i) for i in indices])


class MLPPolicy(nn.Module):
    """4 -> h -> h -> 2 (ReLU); the action is sampled from the logits by Gumbel-max (int64, one per row)."""

    def __init__(self, hidden: tuple[int, int]):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden[0]), nn.ReLU(), nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
                                 nn.Linear(hidden[1], 2))

    def forward(self, obs: Any) -> Any:
        logits = self.net(obs)
        gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-10, 1.0)))
        return (logits + gumbel).argmax(-1)


_PER_THREAD = threading.local()


class CountingPolicy(nn.Module, _Logged):
    """Runs ``inner`` and logs each forward's input batch size and its start and end time, in whatever process it runs."""

    def __init__(self, inner: nn.Module, log_dir: str):
        super().__init__()
        self.inner = inner
        self._log_dir, self._log_tag = log_dir, "fwd"

    def forward(self, obs: Any) -> Any:
        if not getattr(_PER_THREAD, "one_torch_thread", False):
            # torch.set_num_threads reaches OpenMP only in the calling thread: a server thread started after the
            # main thread's call still runs MKL's sgemm on a team of one thread per core, and the team's
            # other thread spin-waits between forwards (a whole core on this machine). So: once per thread.
            torch.set_num_threads(1)
            _PER_THREAD.one_torch_thread = True
        t0 = time.monotonic_ns()
        out = self.inner(obs)
        self._event_log().add(t0, time.monotonic_ns(), obs.shape[0] if obs.dim() > 1 else 1)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_log", None)  # each process opens its own file
        state.pop("_log_pid", None)
        return state


def make_policy(name: str, log_dir: str) -> CountingPolicy:
    """The policy ``name`` (weights from seed ``SEED``: the same in every collector) inside a CountingPolicy."""
    _one_torch_thread()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        inner = MLPPolicy(POLICIES[name])
    return CountingPolicy(inner, log_dir).eval()


def make_td_policy(name: str, log_dir: str) -> Any:
    """The same policy as a ``TensorDictModule`` (``observation`` -> ``action``) for TorchRL."""
    from tensordict.nn import TensorDictModule

    return TensorDictModule(make_policy(name, log_dir), in_keys=["observation"], out_keys=["action"])


# ------------------------------------------------------------------ the collectors, behind one small interface


def _torchrl_collectors() -> Any:
    """``torchrl.collectors``, imported with its import-time DeprecationWarning (about its own weight updaters) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torchrl.collectors

    return torchrl.collectors


class Run:
    """One collector under test: ``batches()`` yields the env frames in each batch it hands out; ``close()`` ends it."""

    VARIANTS: ClassVar[dict[str, str]] = {}  # configuration name -> how it is built, in words
    where = "learner"  # where the forward passes run: "learner", "policy process" or "workers"

    def __init__(self, n: int, policy: str, log_dir: str, variant: str, frames_per_batch: int):
        self.n, self.policy, self.log_dir, self.variant, self.fpb = n, policy, log_dir, variant, frames_per_batch
        self.c: Any = None

    def batches(self) -> Iterator[int]:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.c is not None:
            self.c.shutdown()

    def envs(self) -> list[Callable[[], Any]]:
        return [functools.partial(make_env, self.log_dir, i) for i in range(self.n)]

    def halves(self, factory: Callable[..., Any]) -> list[Callable[[], Any]]:
        h = self.n // 2
        return [functools.partial(factory, self.log_dir, tuple(range(k * h, (k + 1) * h))) for k in range(2)]


class ShmbufAsync(Run):
    """``workers.AsyncBatchedCollector``: the policy in a server thread of this process; env workers in processes or threads."""

    VARIANTS: ClassVar[dict[str, str]] = {
        "processes": "n env processes", "threads": "n env threads", "2xvec": "2 env processes x SyncVectorEnv(n/2)"}

    def __init__(self, *args: Any):
        super().__init__(*args)
        from workers import AsyncBatchedCollector

        envs = self.halves(make_vector_env) if self.variant == "2xvec" else self.envs()
        self.c = AsyncBatchedCollector(envs, policy=make_policy(self.policy, self.log_dir), frames_per_batch=self.fpb,
                                       env_backend="threading" if self.variant == "threads" else "multiprocessing")

    def batches(self) -> Iterator[int]:
        for b in self.c:
            yield int(b.frames)

    def stats(self) -> dict[str, Any]:
        s = self.c.stats().get("server", {})
        return {k: v for k, v in s.items() if isinstance(v, (int, float, str, list, dict))}


class ShmbufCollector(Run):
    """``workers.Collector``: a policy copy in each actor process."""

    VARIANTS: ClassVar[dict[str, str]] = {"nx1": "n actors x 1 env", "2xvec": "2 actors x SyncVectorEnv(n/2)"}
    where = "workers"

    def __init__(self, *args: Any):
        super().__init__(*args)
        from workers import Collector

        envs = self.envs() if self.variant == "nx1" else self.halves(make_vector_env)
        self.c = Collector(envs, make_policy(self.policy, self.log_dir), frames_per_batch=self.fpb, torch_threads=1)

    def batches(self) -> Iterator[int]:
        for b in self.c:
            yield int(b.frames)


class TorchRLAsync(Run):
    """TorchRL's ``AsyncBatchedCollector``, the same policy as a ``TensorDictModule``, its default batching settings."""

    VARIANTS: ClassVar[dict[str, str]] = {
        "threads": "env_backend='threading'",
        "processes": "env_backend='multiprocessing', transport='driver'",
        "processes-auto": "env_backend='multiprocessing', transport='auto' (policy process)"}

    def __init__(self, *args: Any):
        super().__init__(*args)
        tc = _torchrl_collectors()
        envs = [functools.partial(make_torchrl_env, self.log_dir, i) for i in range(self.n)]
        kw: dict[str, Any] = {"frames_per_batch": self.fpb, "total_frames": -1}
        if self.variant == "threads":
            kw.update(policy=make_td_policy(self.policy, self.log_dir), env_backend="threading", policy_backend="threading",
                      transport="driver")
        elif self.variant == "processes":
            kw.update(policy=make_td_policy(self.policy, self.log_dir), env_backend="multiprocessing",
                      policy_backend="threading", transport="driver")
        else:
            self.where = "policy process"
            kw.update(policy_factory=functools.partial(make_td_policy, self.policy, self.log_dir),
                      env_backend="multiprocessing", transport="auto")
        self.c = tc.AsyncBatchedCollector(envs, **kw)

    def batches(self) -> Iterator[int]:
        for td in self.c:
            yield int(td.numel())


class TorchRLMultiSync(Run):
    """TorchRL's ``MultiSyncCollector``: a policy copy in each worker process, batches from all workers together."""

    VARIANTS: ClassVar[dict[str, str]] = {"nx1": "n workers x 1 env", "2xserial": "2 workers x SerialEnv(n/2)"}
    where = "workers"

    def __init__(self, *args: Any):
        super().__init__(*args)
        tc = _torchrl_collectors()
        envs = [functools.partial(make_torchrl_env, self.log_dir, i) for i in range(self.n)] if self.variant == "nx1" \
            else self.halves(make_torchrl_serial)
        self.c = tc.MultiSyncCollector(envs, policy=make_td_policy(self.policy, self.log_dir), frames_per_batch=self.fpb,
                                       total_frames=-1, num_threads=1, num_sub_threads=1, cat_results="stack")

    def batches(self) -> Iterator[int]:
        for td in self.c:
            yield int(td.numel())


# name -> (class, label, rows): each row is a group of configurations; a group of several is tried (with the first
# policy, at each env count) and its fastest is the row; the first of a group is what --quick runs.
SYSTEMS: dict[str, tuple[type[Run], str, tuple[tuple[str, ...], ...]]] = {
    "shmbuf_async": (ShmbufAsync, "shmbuf AsyncBatchedCollector", (("processes", "threads"), ("2xvec",))),
    "shmbuf_collector": (ShmbufCollector, "shmbuf Collector", (("nx1",), ("2xvec",))),
    "torchrl_async": (TorchRLAsync, "TorchRL AsyncBatchedCollector", (("threads", "processes", "processes-auto"),)),
    "torchrl_multisync": (TorchRLMultiSync, "TorchRL MultiSyncCollector", (("2xserial", "nx1"),)),
}


def available(system: str) -> str | None:
    """None if ``system`` can run here, else why not."""
    try:
        if system == "shmbuf_async":
            import workers

            if not hasattr(workers, "AsyncBatchedCollector"):
                return "this shmbuf's workers package has no AsyncBatchedCollector yet"
        elif system.startswith("torchrl"):
            _torchrl_collectors()
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------ processes and CPU, from /proc

# shmbuf._proc is imported where it is used, never at the top: TorchRL's workers import this module to unpickle their
# env makers, and importing shmbuf would add a few hundred ms to their start-up. The learner imports it in its first
# descendants(), before the run starts.
_PPID, _UTIME, _STIME = 1, 11, 12  # in shmbuf._proc.stat_fields(): proc(5)'s fields 4, 14 and 15


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, CPU seconds, cmdline) of every process visible."""
    from shmbuf._proc import CLOCK_TICKS, stat_fields

    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (fields := stat_fields(entry)) is None:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry)] = (int(fields[_PPID]), (int(fields[_UTIME]) + int(fields[_STIME])) / CLOCK_TICKS, cmd)
    return out


def descendants(table: dict[int, tuple[int, float, str]] | None = None) -> dict[int, tuple[float, str]]:
    """Every process below this one (children, and the children of the forkserver it started): pid -> (CPU s, cmdline)."""
    table = table if table is not None else _proc_table()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = {}, list(kids.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        out[pid] = table[pid][1:]
        todo.extend(kids.get(pid, []))
    return out


def _helper(cmd: str) -> bool:
    """multiprocessing's own long-lived helpers: shared by every run, never one run's to kill."""
    return "forkserver import main" in cmd or "resource_tracker import main" in cmd


def _threads() -> dict[int, tuple[str, float]]:
    """This process's threads: tid -> (name, CPU s); Python threads by their ``threading`` name."""
    from shmbuf._proc import CLOCK_TICKS, cpu_ticks

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        ticks = cpu_ticks(f"self/task/{tid}")
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:  # gone, as its stat was, once the thread has ended
                name = f.read().strip()
        except OSError:
            continue
        out[int(tid)] = (names.get(int(tid), name), ticks / CLOCK_TICKS)
    return out


def _machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores: everything but idle and iowait)."""
    from shmbuf._proc import CLOCK_TICKS, machine_ticks

    return machine_ticks()[0] / CLOCK_TICKS


def _usage(pid: int) -> tuple[float, float, int]:
    """(user s, kernel s, context switches) of process ``pid``, all its threads."""
    from shmbuf._proc import CLOCK_TICKS, stat_fields

    user = kernel = 0.0
    switches = 0
    fields = stat_fields(pid)
    if fields is None:  # gone
        return user, kernel, switches
    try:
        user, kernel = int(fields[_UTIME]) / CLOCK_TICKS, int(fields[_STIME]) / CLOCK_TICKS
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)  # voluntary and not
    except (OSError, ValueError, IndexError):
        pass
    return user, kernel, switches


def cpu_sample() -> dict[str, Any]:
    """The learner's and every child process's CPU (user, kernel) and context switches, its threads' CPU, the machine's."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"t": time.monotonic(), "learner": (ru.ru_utime, ru.ru_stime, ru.ru_nvcsw + ru.ru_nivcsw),
            "children": {p: _usage(p) for p in descendants()}, "threads": _threads(), "machine": _machine_busy()}


def cpu_between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Between two samples: cores busy in the learner (its busiest threads), its child processes, the machine, outside;
    the kernel's share of each; context switches per second."""
    dt = b["t"] - a["t"]
    lu, lk, ls = (y - x for x, y in zip(a["learner"], b["learner"]))
    both = [(a["children"][p], u) for p, u in b["children"].items() if p in a["children"]]
    cu, ck, cs = (sum(y[i] - x[i] for x, y in both) for i in range(3))
    threads = sorted(((name, (c - a["threads"][tid][1]) / dt) for tid, (name, c) in b["threads"].items()
                      if tid in a["threads"]), key=lambda x: -x[1])
    machine_busy = (b["machine"] - a["machine"]) / dt
    learner, children = (lu + lk) / dt, (cu + ck) / dt
    return {"learner": learner, "children": children, "machine": machine_busy,
            "outside": max(0.0, machine_busy - learner - children),
            "learner_kernel": lk / dt, "children_kernel": ck / dt,
            "learner_switches_per_s": ls / dt, "children_switches_per_s": cs / dt,
            "learner_threads": [[n, round(c, 3)] for n, c in threads[:4] if c > 0.005]}


# ------------------------------------------------------------------ one run


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else math.nan


def _per_window(t: np.ndarray, edges: list[int], weights: np.ndarray | None = None) -> np.ndarray:
    """How many of the times ``t`` (or their ``weights``) fall in each half-open window ``[edges[k], edges[k+1])``."""
    k = np.searchsorted(np.asarray(edges, np.int64), t, side="right") - 1
    ok = (k >= 0) & (k < len(edges) - 1)
    return np.bincount(k[ok], weights=None if weights is None else weights[ok], minlength=len(edges) - 1).astype(np.float64)


def analyse(log_dir: str, edges: list[int]) -> dict[str, Any]:
    """Frames/s per window, step round trip, and forward batch sizes, from the run's event logs."""
    t0, t1 = edges[0], edges[-1]
    per_window = np.zeros(len(edges) - 1)
    rt, wait, step, envs = [], [], [], 0
    fwd = []
    for name in sorted(os.listdir(log_dir)):
        recs = read_log(os.path.join(log_dir, name))
        if name.startswith("fwd"):
            fwd.append(recs[(recs[:, 0] >= t0) & (recs[:, 0] < t1)])
            continue
        steps = recs[recs[:, 2] == STEP]
        if not len(steps):
            continue
        envs += 1
        per_window += _per_window(steps[:, 0], edges)
        prev, cur = recs[:-1], recs[1:]
        ok = (prev[:, 2] == STEP) & (cur[:, 2] == STEP) & (cur[:, 0] >= t0) & (cur[:, 0] < t1)
        rt.append(cur[ok, 0] - prev[ok, 0])
        wait.append(cur[ok, 0] - prev[ok, 1])
        step.append(cur[ok, 1] - cur[ok, 0])
    secs = np.diff(np.asarray(edges, np.float64)) / 1e9
    rates = (per_window / secs).tolist()
    us = {k: np.concatenate(v) / 1e3 if v else np.zeros(0) for k, v in (("rt", rt), ("wait", wait), ("step", step))}
    f = np.concatenate(fwd) if fwd else np.zeros((0, 3), np.int64)
    sizes, durs = f[:, 2], (f[:, 1] - f[:, 0]) / 1e3
    hist = {int(s): int(c) for s, c in zip(*np.unique(sizes, return_counts=True))}
    span = (t1 - t0) / 1e9
    return {
        "envs_logged": envs,
        "frames_per_s": {"median": float(np.median(rates)), "min": min(rates), "max": max(rates), "windows": rates},
        "round_trip_us": {"p50": _pct(us["rt"], 50), "p99": _pct(us["rt"], 99),
                          "mean": float(us["rt"].mean()) if len(us["rt"]) else math.nan, "n": len(us["rt"])},
        "wait_us": {"p50": _pct(us["wait"], 50), "p99": _pct(us["wait"], 99)},
        "env_step_us": {"p50": _pct(us["step"], 50), "p99": _pct(us["step"], 99)},
        "forward": {
            "count": len(sizes), "per_s": len(sizes) / span, "hist": hist,
            "mean": float(sizes.mean()) if len(sizes) else math.nan,
            "frame_weighted_mean": float((sizes ** 2).sum() / sizes.sum()) if len(sizes) else math.nan,
            "p10": _pct(sizes, 10), "p50": _pct(sizes, 50), "p90": _pct(sizes, 90), "max": int(sizes.max()) if len(sizes) else 0,
            "duration_us_p50": _pct(durs, 50), "busy_cores": float(durs.sum() / 1e6 / span),
            "us_per_row": float(durs.sum() / sizes.sum()) if len(sizes) else math.nan,
        },
    }


def reap_new(before: Any, grace: float = 5.0) -> list[int]:
    """Give the run's processes (descendants not in ``before``, helpers aside) ``grace`` seconds to leave, joining
    finished children meanwhile; then kill what is left and return those pids (see :func:`_kill_new`)."""
    deadline = time.monotonic() + grace
    while any(p not in before and not _helper(c) for p, (_, c) in descendants().items()) and time.monotonic() < deadline:
        for p in mp.active_children():
            p.join(0)
        time.sleep(0.05)
    return _kill_new(before)


def _kill_new(before: set[int]) -> list[int]:
    """SIGKILL the processes this run started that are still alive (by pid; never multiprocessing's helpers)."""
    killed = []
    for pid, (_, cmd) in descendants().items():
        if pid not in before and not _helper(cmd):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def run_one(system: str, variant: str, n: int, policy: str, a: argparse.Namespace, log_root: str) -> dict[str, Any]:
    """Start one collector, let it warm up, measure ``a.windows`` windows, stop it, and read the event logs."""
    warmup_s, windows, window_s = a.warmup_s, a.windows, a.window_s
    cls, label, _ = SYSTEMS[system]
    rec: dict[str, Any] = {"system": system, "label": label, "variant": variant, "variant_desc": cls.VARIANTS[variant],
                           "n": n, "policy": policy, "status": "ok", "where": cls.where}
    log_dir = tempfile.mkdtemp(prefix=f"{system}-{variant}-{n}-", dir=log_root)
    before = set(descendants())
    arrivals: list[tuple[int, int]] = []
    failure: list[str] = []
    stop, done = threading.Event(), threading.Event()
    run: Run | None = None
    consumer = None
    t_start, t_start_ns = time.monotonic(), time.monotonic_ns()
    try:
        run = cls(n, policy, log_dir, variant, a.frames_per_batch)
        rec["where"] = run.where

        def consume(run: Run) -> None:
            try:
                for frames in run.batches():
                    arrivals.append((time.monotonic_ns(), frames))
                    if stop.is_set():
                        break
            except BaseException as exc:  # noqa: BLE001  (whatever ends the collector is reported in the record; the sweep goes on)
                import traceback

                failure.append("".join(traceback.format_exception(exc))[-3000:])
            finally:
                done.set()

        consumer = threading.Thread(target=consume, args=(run,), name="bench-consumer", daemon=True)
        consumer.start()
        deadline = time.monotonic() + a.start_timeout
        while not arrivals and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not arrivals:
            raise RuntimeError(failure[0] if failure else f"no batch within {a.start_timeout} s of starting")
        rec["startup_s"] = (arrivals[0][0] - t_start_ns) / 1e9
        edges = [arrivals[0][0] + int((warmup_s + k * window_s) * 1e9) for k in range(windows + 1)]
        cpu = []
        for edge in (edges[0], edges[-1]):
            while time.monotonic_ns() < edge:
                if done.is_set():
                    raise RuntimeError(failure[0] if failure else "the collector stopped handing out batches")
                if time.monotonic_ns() - arrivals[-1][0] > a.stall_s * 1e9:
                    rec["status"] = "stalled"
                    raise RuntimeError(f"no batch for {a.stall_s} s")
                time.sleep(min(0.02, max(0.0, (edge - time.monotonic_ns()) / 1e9)))
            cpu.append(cpu_sample())
        stop.set()
        done.wait(a.stall_s)
        rec["cpu_cores"] = cpu_between(*cpu)
        rec["edges_ns"] = edges
        t_arr, frames_arr = np.asarray(arrivals, np.int64).reshape(-1, 2).T
        rec["delivered_per_s"] = (_per_window(t_arr, edges, frames_arr.astype(np.float64)) / window_s).tolist()
        rec["batches"], rec["frames_delivered"] = len(arrivals), int(sum(f for _, f in arrivals))
    except Exception as exc:  # noqa: BLE001  (a failed or stalled run is recorded and the sweep goes on)
        if rec["status"] == "ok":
            rec["status"] = "failed"
        rec["error"] = str(exc)[-3000:]
    finally:
        stop.set()
        if run is not None and (consumer is None or done.wait(a.stall_s)):
            try:
                rec["server"] = run.stats()
            except Exception as exc:  # noqa: BLE001  (stats are a bonus; the run's figures stand without them)
                rec["server"] = {"error": repr(exc)}
            try:
                run.close()
            except Exception as exc:  # noqa: BLE001  (recorded; what is left of the run is killed below)
                rec.setdefault("error", f"shutdown: {exc!r}")
        else:
            rec.setdefault("error", "the collector did not return from its iterator; its processes were killed")
        rec["killed_pids"] = reap_new(before)
        del run
        rec["seconds"] = time.monotonic() - t_start
        if "edges_ns" in rec:
            rec.update(analyse(log_dir, rec["edges_ns"]))
        shutil.rmtree(log_dir, ignore_errors=True)
    return rec


# ------------------------------------------------------------------ the sweep


def plan(a: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(policy, n, system) in the order measured: systems interleaved within each configuration."""
    return [(pol, n, s) for pol in a.policies for n in a.num_envs for s in a.systems]


def sweep(a: argparse.Namespace, log_root: str, res: dict[str, Any]) -> None:
    """Every run of the plan, in order, into ``res["runs"]``; a tried group's slower configurations get ``chosen: False``."""
    from tqdm.auto import tqdm

    steps = plan(a)
    first = a.policies[0]
    bar = tqdm(total=sum(len(_todo(s, g, a, tried=pol == first)) for pol, _, s in steps for g in range(len(SYSTEMS[s][2]))),
               unit="run", desc="inference bench", dynamic_ncols=True)
    chosen: dict[tuple[str, int, int], str] = {}  # (system, n, group) -> its fastest configuration with the first policy
    try:
        for pol, n, system in steps:
            label = SYSTEMS[system][1]
            for g in range(len(SYSTEMS[system][2])):
                tried = pol == first and _tried(system, g, a)
                variants = [chosen[(system, n, g)]] if (system, n, g) in chosen else _todo(system, g, a, tried=tried)
                runs = []
                for v in variants:
                    bar.set_postfix_str(f"{pol} n={n} {label} [{v}]")
                    r = run_one(system, v, n, pol, a, log_root)
                    r["group"], r["tried"], r["chosen"] = g, tried, True
                    runs.append(r)
                    res["runs"].append(r)
                    bar.update(1)
                    bar.write(_line(r))
                if tried:
                    ok = [r for r in runs if r["status"] == "ok"]
                    best = max(ok, key=lambda r: r["frames_per_s"]["median"]) if ok else runs[0]
                    chosen[(system, n, g)] = best["variant"]
                    for r in runs:
                        r["chosen"] = r is best
    finally:
        bar.close()


def _tried(system: str, group: int, a: argparse.Namespace) -> bool:
    """Whether row ``group`` of ``system`` is a choice among configurations, tried for the fastest (not with --quick)."""
    return not a.quick and len(SYSTEMS[system][2][group]) > 1


def _todo(system: str, group: int, a: argparse.Namespace, *, tried: bool) -> list[str]:
    """The configurations to run for a row: all of a tried group, else its first (the trials' winner replaces it later)."""
    variants = SYSTEMS[system][2][group]
    return list(variants) if tried and _tried(system, group, a) else [variants[0]]


def _line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['policy']:6s} n={r['n']:2d} {r['label']} [{r['variant']}]: {r['status']}: {r.get('error', '')[-300:]}"
    f = r["forward"]
    return (f"{r['policy']:6s} n={r['n']:2d} {r['label']} [{r['variant']}]: {r['frames_per_s']['median']:,.0f} frames/s, "
            f"round trip p50 {r['round_trip_us']['p50']:,.0f} / p99 {r['round_trip_us']['p99']:,.0f} us, forward batch "
            f"mean {f['mean']:.1f}, cores: learner {r['cpu_cores']['learner']:.2f}, children {r['cpu_cores']['children']:.2f}, "
            f"outside {r['cpu_cores']['outside']:.2f}")


# ------------------------------------------------------------------ report


def _n(x: float, fmt: str = ",.0f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _batch_summary(f: dict[str, Any]) -> str:
    """Forward batch sizes in one cell: mean, p10-p90 (per forward), the frame-weighted mean, the largest."""
    if not f["count"]:
        return "n/a"
    spread = f"{f['p10']:.0f}" if f["p10"] == f["p90"] else f"{f['p10']:.0f}-{f['p90']:.0f}"
    return f"{f['mean']:.1f} ({spread}; per frame {f['frame_weighted_mean']:.1f}; max {f['max']})"


def _group_desc(system: str, group: int) -> str:
    """A row's configuration in words; a tried group is named by its choices."""
    cls, _, groups = SYSTEMS[system]
    variants = groups[group] if group < len(groups) else ()
    if len(variants) == 1:
        return cls.VARIANTS[variants[0]]
    return "fastest of " + " / ".join(variants)  # the names; the table says which won, in words


def _label(r: dict[str, Any]) -> str:
    return f"{r['label']} [{r['variant_desc']}]"


OUTSIDE_MARK = 0.25  # cores of outside load above which a run is marked ‡


def shown(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs the table and plot show: all but a tried collector's slower configurations."""
    return [r for r in res["runs"] if r.get("chosen", True)]


def best_rows(res: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """(policy, n, system) -> its best run shown (by frames/s)."""
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in shown(res):
        if r["status"] != "ok":
            continue
        k = (r["policy"], r["n"], r["system"])
        if k not in out or r["frames_per_s"]["median"] > out[k]["frames_per_s"]["median"]:
            out[k] = r
    return out


def aims(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The two aims, per configuration measured: shmbuf's AsyncBatchedCollector at least 20x TorchRL's, and ahead of
    shmbuf's Collector (its best row) with the larger policy."""
    best = best_rows(res)
    out = []
    for pol in res["config"]["policies"]:
        for n in res["config"]["num_envs"]:
            ours = best.get((pol, n, "shmbuf_async"))
            if ours is None:
                continue
            trl = best.get((pol, n, "torchrl_async"))
            if trl is not None:
                ratio = ours["frames_per_s"]["median"] / trl["frames_per_s"]["median"]
                out.append({"aim": "at least 20x TorchRL's AsyncBatchedCollector", "policy": pol, "n": n,
                            "ratio": ratio, "met": ratio >= 20})
            col = best.get((pol, n, "shmbuf_collector"))
            if col is not None and pol == max(POLICIES, key=lambda k: POLICIES[k][0]):
                ratio = ours["frames_per_s"]["median"] / col["frames_per_s"]["median"]
                out.append({"aim": "ahead of shmbuf's Collector (its best row) with the larger policy", "policy": pol, "n": n,
                            "ratio": ratio, "met": ratio > 1})
    return out


def _row(r: dict[str, Any]) -> str:
    """One table row: the figures of a run."""
    if r["status"] != "ok":
        last = r["error"].splitlines()[-1][:120] if r.get("error") else ""
        return f"| {r['n']} | {_label(r)} | {r['status']}: {last} |" + " |" * 8
    fps, rt, cpu, f = r["frames_per_s"], r["round_trip_us"], r["cpu_cores"], r["forward"]
    spread = f" ±{(fps['max'] - fps['min']) / 2:,.0f}" if len(fps["windows"]) > 1 else ""
    mark = " ‡" if cpu["outside"] > OUTSIDE_MARK else ""
    per_frame = [cpu[k] / fps["median"] * 1e6 for k in ("learner", "children")]
    return (f"| {r['n']} | {_label(r)} | {_n(fps['median'])}{spread}{mark} | {_n(rt['p50'])} / {_n(rt['p99'])} | "
            f"{_n(r['env_step_us']['p50'], '.1f')} | {_n(r['wait_us']['p50'])} | {_batch_summary(f)} | "
            f"{_n(f['us_per_row'], '.1f')} ({r['where']}) | {per_frame[0]:.0f} / {per_frame[1]:.0f} | {cpu['outside']:.2f} |")


def tables(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"# Batched inference benchmark, {res['date']}", "", (f"Machine: {res['machine_line']}; torch {c['torch']}, "
             f"torchrl {c['torchrl']}, tensordict {c['tensordict']}, gymnasium {c['gymnasium']}."), "",
             (f"Settings: {ENV_ID}; policies "
             f"{', '.join(f'{k} (4->{POLICIES[k][0]}->{POLICIES[k][1]}->2)' for k in c['policies'])}, "
             "action sampled by Gumbel-max, the same module and weights in every collector; torch on one thread in every "
             f"thread that runs it; frames_per_batch {c['frames_per_batch']} for all; {c['windows']} windows of "
             f"{c['window_s']} s after {c['warmup_s']} s of warm-up (from the first batch), each figure the median window "
             "(± half the spread). Both async collectors with TorchRL's batching defaults (max_batch_size 64, "
             f"min_batch_size 1, server_timeout 0.01 s). The sweep took {res.get('seconds', 0) / 60:.1f} minutes."), "",
             ("**frames/s**: env `step()` calls per second, counted by a wrapper inside every env (‡: more than "
             f"{OUTSIDE_MARK} core of load from outside the run). **round trip**: between consecutive `step()` calls of "
             "one env (its step, then the wait for its next action), pooled over the envs; **env step** and **wait** are "
             "its two parts. **forward batch**: rows per forward pass, mean (p10-p90 over forwards; per frame: the batch "
             "the average frame's forward had; the largest). **forward µs/row**: forward wall time per row (a forward "
             "preempted by other processes counts its wait), and where the forward runs. **CPU µs/frame**: the learner "
             "process's CPU and its child processes' CPU per env frame. "
             "**outside**: cores busy outside the run. **forwards running at once**: summed forward wall time per second "
             "(for one server thread: the share of its time spent in the policy)."), ""]
    for pol in c["policies"]:
        lines += [f"## {pol} (4->{POLICIES[pol][0]}->{POLICIES[pol][1]}->2)", "",
                  ("| envs | collector [configuration] | frames/s | round trip p50 / p99 µs | env step p50 µs | wait p50 µs | "
                   "forward batch | forward µs/row (where) | CPU µs/frame learner / children | outside |"),
                  "|---:|---|---:|---:|---:|---:|---|---|---:|---:|"]
        lines += [_row(r) for n in c["num_envs"] for r in shown(res) if r["policy"] == pol and r["n"] == n]
        lines.append("")
    best = best_rows(res)
    if any(k[2] == "shmbuf_async" for k in best):
        lines += ["## shmbuf's AsyncBatchedCollector against the others (frames/s ratio; each one's best row)", "",
                  "| policy | envs | / TorchRL AsyncBatchedCollector | / TorchRL MultiSyncCollector | / shmbuf Collector |",
                  "|---|---:|---:|---:|---:|"]
        for pol in c["policies"]:
            for n in c["num_envs"]:
                ours = best.get((pol, n, "shmbuf_async"))
                if ours is None:
                    continue
                cells = []
                for s in ("torchrl_async", "torchrl_multisync", "shmbuf_collector"):
                    o = best.get((pol, n, s))
                    cells.append(f"{ours['frames_per_s']['median'] / o['frames_per_s']['median']:.2f}x" if o else "n/a")
                lines.append(f"| {pol} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Where the CPU goes (during the windows)", "",
              ("| policy | envs | collector [configuration] | learner cores (kernel) | its busiest threads | children cores "
               "(kernel) | forwards running at once (mean) | context switches / frame |"),
              "|---|---:|---|---:|---|---:|---:|---:|"]
    for r in shown(res):
        if r["status"] != "ok" or "learner_kernel" not in r["cpu_cores"]:
            continue
        cpu = r["cpu_cores"]
        busiest = ", ".join(f"{name} {cores:.2f}" for name, cores in cpu["learner_threads"][:2])
        switches = (cpu["learner_switches_per_s"] + cpu["children_switches_per_s"]) / r["frames_per_s"]["median"]
        lines.append(f"| {r['policy']} | {r['n']} | {_label(r)} | {cpu['learner']:.2f} ({cpu['learner_kernel']:.2f}) | "
                     f"{busiest} | {cpu['children']:.2f} ({cpu['children_kernel']:.2f}) | {r['forward']['busy_cores']:.2f} | "
                     f"{switches:.2f} |")
    lines.append("")
    if res["aims"]:
        lines += ["## Aims", "", "| aim | policy | envs | ratio | met |", "|---|---|---:|---:|---|"]
        lines += [f"| {m['aim']} | {m['policy']} | {m['n']} | {m['ratio']:.2f}x | {'yes' if m['met'] else '**no**'} |"
                  for m in res["aims"]]
        lines.append("")
    tried = [r for r in res["runs"] if r.get("tried")]
    if tried:
        lines += [(f"## Configurations tried (with {c['policies'][0]}; the fastest, in bold, is the one shown above and "
                   "measured with the other policy)"), "",
                  "| envs | collector | configuration | frames/s | round trip p50 / p99 µs | start-up s |",
                  "|---:|---|---|---:|---:|---:|"]
        for r in tried:
            fps = _n(r["frames_per_s"]["median"]) if r["status"] == "ok" else r["status"]
            rt = f"{_n(r['round_trip_us']['p50'])} / {_n(r['round_trip_us']['p99'])}" if r["status"] == "ok" else ""
            name = r["variant_desc"]
            if r["chosen"]:
                name, fps = f"**{name}**", f"**{fps}**"
            lines.append(f"| {r['n']} | {r['label']} | {name} | {fps} | {rt} | {_n(r.get('startup_s'), '.1f')} |")
        lines.append("")
    skipped = res.get("skipped", {})
    if skipped:
        lines += ["## Not measured", ""] + [f"- {SYSTEMS[s][1]}: {why}" for s, why in skipped.items()] + [""]
    return "\n".join(lines)


COLORS = {"shmbuf_async": "#d62728", "shmbuf_collector": "#ff9896", "torchrl_async": "#1f77b4", "torchrl_multisync": "#9ecae1"}


def plot(res: dict[str, Any], path: str) -> bool:
    """Frames/s and round trip per collector per env count, each policy; forward batch sizes of the async collectors."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    c = res["config"]
    pols, ns = c["policies"], c["num_envs"]
    fig, axes = plt.subplots(3, len(pols), figsize=(7.5 * len(pols), 14.5), squeeze=False)
    def series(r: dict[str, Any]) -> tuple[str, int]:  # one series per row of a collector
        return (r["system"], r.get("group", 0))

    keys: list[tuple[str, str]] = []
    for r in shown(res):
        if series(r) not in keys:
            keys.append(series(r))
    shades = {}
    for s in SYSTEMS:
        mine = [k for k in keys if k[0] == s]
        for i, k in enumerate(mine):
            shades[k] = (COLORS[s], 1.0 if i == 0 else 0.55)
    width = 0.8 / max(1, len(keys))
    by = {(r["policy"], r["n"], *series(r)): r for r in shown(res) if r["status"] == "ok"}
    for col, pol in enumerate(pols):
        ax_f, ax_l, ax_b = axes[0][col], axes[1][col], axes[2][col]
        for i, (s, v) in enumerate(keys):
            xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(ns))]
            rows = [by.get((pol, n, s, v)) for n in ns]
            color, alpha = shades[(s, v)]
            label = f"{SYSTEMS[s][1]} [{_group_desc(s, v)}]"
            fps = [r["frames_per_s"]["median"] if r else 0 for r in rows]
            bars = ax_f.bar(xs, fps, width, color=color, alpha=alpha, label=label)
            for b, f in zip(bars, fps):
                if f:
                    ax_f.annotate(f"{f / 1000:.1f}k" if f >= 1000 else f"{f:.0f}", (b.get_x() + b.get_width() / 2, f),
                                  ha="center", va="bottom", fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
            p50 = [r["round_trip_us"]["p50"] if r else np.nan for r in rows]
            p99 = [r["round_trip_us"]["p99"] if r else np.nan for r in rows]
            ax_l.bar(xs, p50, width, color=color, alpha=alpha, label=label)
            ax_l.scatter(xs, p99, marker="_", s=120, color=color, alpha=alpha, linewidths=2)
        for ax, what in ((ax_f, "env frames/s"), (ax_l, "step round trip, µs (bar p50, dash p99)")):
            ax.set_xticks(range(len(ns)), [f"{n} envs" for n in ns])
            if any(b.get_height() > 0 for b in ax.patches):
                ax.set_yscale("log")
            ax.set_ylabel(what)
            ax.grid(axis="y", alpha=0.3, which="both")
        ax_f.set_title(f"{pol}: 4->{POLICIES[pol][0]}->{POLICIES[pol][1]}->2, {ENV_ID}")
        ax_l.set_title(f"{pol}: step round trip (env step + wait for the next action)")
        for ax in (ax_f, ax_l):
            if ax.get_yscale() == "log":
                lo, hi = ax.get_ylim()
                ax.set_ylim(lo, hi * 2.5)  # room for the labels above the bars
        # forward batch sizes, frame-weighted, of the collectors that batch across envs
        styles = {4: ":", 8: "--", 16: "-"}
        for s in ("shmbuf_async", "torchrl_async"):
            for n in ns:
                r = by.get((pol, n, s, 0))  # shmbuf's first row: one env per worker, the case batching is for
                if r is None or not r["forward"]["hist"]:
                    continue
                h = {int(k): v for k, v in r["forward"]["hist"].items()}
                sizes = np.arange(1, max(h) + 1)
                frames = np.array([h.get(int(k), 0) * k for k in sizes], np.float64)
                ax_b.step(sizes, np.cumsum(frames) / frames.sum(), where="post", color=COLORS[s], linestyle=styles.get(n, "-"),
                          label=f"{SYSTEMS[s][1]}, {n} envs")
        ax_b.set_xlabel("forward batch size (rows)")
        ax_b.set_ylabel("fraction of frames whose forward had at most this many rows")
        ax_b.set_title(f"{pol}: forward batch sizes (async collectors)")
        ax_b.set_ylim(0, 1.02)
        ax_b.grid(alpha=0.3)
        if ax_b.lines:
            ax_b.legend(fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.955))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inference", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="mlp64 and 4 envs, one configuration of each peer, short windows")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"), help="where to write the results")
    p.add_argument("--tmp", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                   help="where the run's event-log directory goes (removed at the end)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"collectors (default {','.join(SYSTEMS)})")
    p.add_argument("--policies", help=f"policies (default {','.join(POLICIES)}; quick mlp64)")
    p.add_argument("--num-envs", help="env counts (default 4,8,16; quick 4)")
    p.add_argument("--windows", type=int, help="timed windows per run (default 3, quick 2)")
    p.add_argument("--window-s", type=float, help="seconds per window (default 1.5, quick 0.5)")
    p.add_argument("--warmup-s", type=float, help="warm-up seconds from the first batch, dropped (default 1.5, quick 0.5)")
    p.add_argument("--frames-per-batch", type=int, help=f"default {FRAMES_PER_BATCH}, quick {QUICK_FRAMES_PER_BATCH}")
    p.add_argument("--start-timeout", type=float, default=120.0, help="longest wait for a run's first batch (s)")
    p.add_argument("--stall-s", type=float, default=20.0, help="a run with no batch for this long is stopped as stalled")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--render", metavar="FILE.json", help="rewrite the table and plot of a results file; measure nothing")
    a = p.parse_args(argv)
    q = a.quick
    a.policies = (a.policies or ("mlp64" if q else ",".join(POLICIES))).split(",")
    a.num_envs = [int(x) for x in (a.num_envs or ("4" if q else ",".join(map(str, NUM_ENVS)))).split(",")]
    a.systems = [s for s in a.systems.split(",") if s]
    a.windows = a.windows or (2 if q else 3)
    a.window_s = a.window_s or (0.5 if q else 1.5)
    a.warmup_s = a.warmup_s if a.warmup_s is not None else (0.5 if q else 1.5)
    a.frames_per_batch = a.frames_per_batch or (QUICK_FRAMES_PER_BATCH if q else FRAMES_PER_BATCH)
    for what, got, known in (("--systems", a.systems, SYSTEMS), ("--policies", a.policies, POLICIES)):
        bad = [x for x in got if x not in known]
        if bad:
            p.error(f"{what}: unknown {bad}; choose from {list(known)}")
    odd = [n for n in a.num_envs if n < 2 or n % 2]
    if odd:
        p.error(f"--num-envs: expected even counts >= 2 (2 workers get n/2 envs each), got {odd}")
    return a


def write(res: dict[str, Any], stem: str, draw: bool) -> None:
    res["paths"] = {"json": stem + ".json", "md": stem + ".md"}
    if draw and plot(res, stem + ".png"):
        res["paths"]["png"] = stem + ".png"
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(tables(res))


def main(argv: list[str] | None = None, *, preload: list[str] | None = None) -> dict[str, Any]:
    """The sweep (or ``--render``); ``preload``: what :func:`cli` had the forkserver import, recorded in the results."""
    a = parse_args(argv)
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        write(res, a.render.removesuffix(".json"), not a.no_plot)
        print(tables(res))
        return res
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine.info(), "runs": [],
                           "skipped": {}}
    res["machine_line"] = machine.line(res["machine"])
    res["config"] = {"quick": a.quick, "env": ENV_ID, "policies": a.policies, "num_envs": a.num_envs, "systems": a.systems,
                     "frames_per_batch": a.frames_per_batch, "windows": a.windows, "window_s": a.window_s,
                     "warmup_s": a.warmup_s,
                     "torch_threads_per_process": 1, "start_method": mp.get_start_method(allow_none=True) or "default",
                     "forkserver_preload": preload, "torch": machine._version("torch"),
                     "torchrl": machine._version("torchrl"), "tensordict": machine._version("tensordict"),
                     "gymnasium": machine._version("gymnasium")}
    for s in list(a.systems):
        why = available(s)
        if why is not None:
            res["skipped"][s] = why
            a.systems.remove(s)
            print(f"{SYSTEMS[s][1]} is not measured: {why}", file=sys.stderr)
    log_root = tempfile.mkdtemp(prefix="bench-inference-", dir=a.tmp)
    t0 = time.perf_counter()
    try:
        sweep(a, log_root, res)
    finally:
        shutil.rmtree(log_root, ignore_errors=True)
        torch.set_num_threads(threads_before)
    res["seconds"] = time.perf_counter() - t0
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["aims"] = aims(res)
    os.makedirs(a.out, exist_ok=True)
    write(res, os.path.join(a.out, "inference-quick" if a.quick else "inference"), not a.no_plot)
    print(tables(res))
    return res


PRELOAD = ["torch", "gymnasium", "torchrl", "torchrl.collectors", "tensordict"]


def cli() -> None:
    """``python -m benchmarks.inference``: every process pool forks from one forkserver that has the heavy imports done.

    Set here, not in :func:`main`: the start method and the forkserver's preload are process-wide.
    """
    mp.set_start_method("forkserver")
    mp.set_forkserver_preload(PRELOAD)
    main(preload=PRELOAD)


if __name__ == "__main__":
    cli()
