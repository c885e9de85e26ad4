"""One benchmark run: a learner process, N actor processes, a watchdog in the parent.

The parent (the sweep) starts the learner, learns the address the actors need
from it, starts the actors, then only watches: a shared heartbeat (the
learner's batch count) that stands still for ``stall_s`` seconds marks the run
*stalled*, and every process of the run is killed by pid. Whatever happens,
every process is killed and joined and every /dev/shm object of the run is
removed before :func:`run_one` returns.

Timing lives in the learner: warm-up (dropped), then ``windows`` windows of
``window_s`` seconds, each cut at a batch arrival so that it holds whole
batches. At each cut the learner bumps a shared phase word; each actor, at its
next rollout, notes its rollout count and CPU time (``getrusage``) in its own
row of the shared control block. Nothing of the data path crosses processes
through this block; results go back as JSON bytes over a pipe.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

# Control block (int64 words) layout.
C_PHASE = 0  # 0: warm-up, 1..W: window k, W+1: stop
C_BATCHES = 1  # the learner's batch count: the watchdog's heartbeat
C_ACTORS = 8  # actor rows start here
# Actor row: [phase seen, 0, then per phase p: rollouts sent, CPU ns, voluntary and involuntary
# context switches] for p in 0..W+1.
A_SEEN = 0
A_PHASES = 2
A_WORDS = 4


def _log_to(path: str | None) -> None:
    """Send this process's stderr (Python's and native code's) to ``path``: tracebacks end up in the record."""
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _usage() -> tuple[int, int, int]:
    """This process's CPU time (ns, user + system, all threads) and its voluntary / involuntary context switches."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return int((ru.ru_utime + ru.ru_stime) * 1e9), ru.ru_nvcsw, ru.ru_nivcsw


def _row_words(windows: int) -> int:
    return A_PHASES + A_WORDS * (windows + 2)


def ctl_words(actors: int, windows: int) -> int:
    return C_ACTORS + actors * _row_words(windows)


# -- the actor process --------------------------------------------------------


def actor_main(system: str, payload: str, mode: str, index: int, shared: Any, address: Any, ctl: Any,
               windows: int, pace_s: float, log: str | None = None) -> None:
    _log_to(log)
    from benchmarks import payloads, transports

    c = np.frombuffer(ctl, np.int64)
    row = c[C_ACTORS + index * _row_words(windows):][: _row_words(windows)]
    stop = windows + 1
    tree = payloads.rollout(payload, seed=index + 1)
    step_tree = tree["step"]
    steps = payloads.steps_of(tree)
    side = transports.ACTORS[system](shared, address, payloads.example(payload))
    busy = transports.Busy
    closed = side.closed_errors
    seen = -1
    count = 0
    next_t = time.monotonic()
    try:
        while True:
            p = int(c[C_PHASE])
            if p != seen:
                at = A_PHASES + A_WORDS * p
                row[at] = count
                row[at + 1 : at + 4] = _usage()
                row[A_SEEN] = p
                seen = p
                if p >= stop:
                    break
            if pace_s:
                now = time.monotonic()
                if now < next_t:
                    time.sleep(next_t - now)
                next_t = max(next_t + pace_s, time.monotonic() - pace_s)  # late: no burst to catch up
            try:
                if mode == "step":
                    side.step(steps)
                else:
                    side.send({"step": step_tree, "meta": {"send_ns": np.array(time.monotonic_ns(), np.int64)}})
            except busy:
                continue
            count += 1
    except closed:
        pass  # the learner closed first: nothing more to send
    finally:
        side.close()


# -- the learner process ------------------------------------------------------


def learner_main(system: str, payload: str, mode: str, n_actors: int, batch: int, depth: int, shared: Any, ctl: Any,
                 conn: Any, windows: int, window_s: float, warmup_s: float, log: str | None = None) -> None:
    _log_to(log)
    from benchmarks import payloads, transports

    c = np.frombuffer(ctl, np.int64)
    side = transports.LEARNERS[system](shared, payloads.example(payload), batch, n_actors, depth)
    try:
        conn.send_bytes(json.dumps({"address": side.address, "pid": os.getpid()}).encode())
        touch_key = payloads.touch_leaf(payload)
        touched = 0.0
        n = 0  # batches received
        cuts: list[tuple[float, int, tuple[int, int, int]]] = []  # (time, batches, usage) at each phase change
        lat: list[list[np.ndarray]] = [[] for _ in range(windows)]
        phase = 0
        start = None
        while phase <= windows:
            b = side.next_batch(0.5)
            if b is None:
                continue
            now_ns = time.monotonic_ns()
            # Touch: sum one leaf, and read one element of every leaf, so that nothing is skipped lazily.
            touched += float(b["step"][touch_key].sum())
            for leaf in b["step"].values():
                touched += float(leaf.flat[-1])
            if phase:
                lat[phase - 1].append(now_ns - b["meta"]["send_ns"])
            n += 1
            c[C_BATCHES] = n
            t = time.monotonic()
            if start is None:
                start = t
            if t - start >= (warmup_s if phase == 0 else window_s):
                cuts.append((t, n, _usage()))
                phase += 1
                c[C_PHASE] = phase
                start = t
        lat_us = []
        for w in lat:
            a = np.concatenate(w).astype(np.float64) / 1e3 if w else np.zeros(0)
            lat_us.append({"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": int(a.size)}
                          if a.size else None)
        result = {
            "cuts": [{"t": t, "batches": k, "cpu_ns": u[0], "vcsw": u[1], "ivcsw": u[2]} for t, k, u in cuts],
            "latency_us": lat_us,
            "touched": touched,
            "extra": side.extra(),
        }
        conn.send_bytes(json.dumps(result).encode())
        # Keep serving until every actor has noted the stop (its last CPU reading), then close.
        rows = [c[C_ACTORS + i * _row_words(windows):][: _row_words(windows)] for i in range(n_actors)]
        if system in transports.ECHO_SYSTEMS:  # sample() cannot time out: close the server from a timer if the actors went quiet
            timer = threading.Timer(2.0, side.close)
            timer.daemon = True
            timer.start()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(r[A_SEEN] < windows + 1 for r in rows):
            side.next_batch(0.05)
    finally:
        side.close()


# -- the parent: one run, with its watchdog -------------------------------------


def _kill_all(procs: list[Any], grace: float) -> list[int]:
    """Join each process for up to ``grace`` s in total, then kill the rest by pid; return the pids killed."""
    deadline = time.monotonic() + grace
    killed = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            killed.append(p.pid)
            p.kill()
    for p in procs:
        p.join(5.0)
        if p.is_alive():  # cannot happen after SIGKILL short of a kernel hang; say so rather than hide it
            raise RuntimeError(f"process {p.pid} survived SIGKILL")
    return killed


def _remove_shmbuf_objects(name: str) -> list[str]:
    """Remove what a killed learner left of pipeline ``name`` in /dev/shm (the segment and its semaphores)."""
    token = name.rsplit("-", 1)[-1]
    removed = []
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return removed
    for e in entries:
        if token in e:
            try:
                os.unlink(os.path.join("/dev/shm", e))
                removed.append(e)
            except OSError:
                pass
    return removed


def _remove_owned_by(procs: list[Any]) -> list[str]:
    """A learner killed before it told us its pipeline's name: remove the pipelines whose owner was that pid."""
    from shmbuf import _admin  # the listing behind `shmbuf ls`; only pipelines of our own dead learner are touched

    pids = {p.pid for p in procs}
    removed = []
    for f in _admin.scan():
        if f.segment and f.owner_pid in pids and not f.owner_alive:
            removed += _remove_shmbuf_objects(f.name)
    return removed


def run_one(system: str, payload: str, mode: str, actors: int, *, batch: int, depth: int, windows: int,
            window_s: float, warmup_s: float, stall_s: float, pace_s: float = 0.0) -> dict[str, Any]:
    """Run one configuration and return its raw record (see :mod:`benchmarks.report` for the summary)."""
    # Here, in the parent, before any window: importing shmbuf takes a few hundred ms of CPU, and the peers' processes
    # import this module (actor_main) and must not pay for it.
    from benchmarks import payloads, transports
    from shmbuf._proc import CLOCK_TICKS, machine_ticks

    ctx = mp.get_context("spawn")
    ctl = ctx.RawArray("q", ctl_words(actors, windows))
    c = np.frombuffer(ctl, np.int64)
    c[:] = 0
    for i in range(actors):
        c[C_ACTORS + i * _row_words(windows):][: _row_words(windows)] = -1
    msg_bytes = payloads.nbytes(payload)
    shared = transports.shared(system, ctx, depth, msg_bytes)
    rx, tx = ctx.Pipe(duplex=False)
    record: dict[str, Any] = {
        "system": system, "payload": payload, "mode": mode, "actors": actors, "batch": batch, "depth": depth,
        "rollout_bytes": msg_bytes, "pace_s": pace_s, "status": "ok",
    }
    procs: list[Any] = []
    address = None
    t_begin = time.monotonic()
    logdir = tempfile.mkdtemp(prefix="shmbuf-bench-")
    logs = [os.path.join(logdir, "learner.log")] + [os.path.join(logdir, f"actor{i}.log") for i in range(actors)]
    try:
        learner = ctx.Process(
            target=learner_main, name=f"bench-learner-{system}",
            args=(system, payload, mode, actors, batch, depth, shared, ctl, tx, windows, window_s, warmup_s, logs[0]),
            daemon=True,
        )
        learner.start()
        procs.append(learner)
        tx.close()
        if not rx.poll(30.0):
            raise RuntimeError(f"{system} learner did not start within 30 s (exit code {learner.exitcode})")
        try:
            hello = json.loads(rx.recv_bytes())
        except EOFError:
            raise RuntimeError(f"{system} learner died while starting (exit code {learner.exitcode})") from None
        address = record["address"] = hello["address"]
        for i in range(actors):
            p = ctx.Process(target=actor_main, name=f"bench-actor-{system}-{i}",
                            args=(system, payload, mode, i, shared, address, ctl, windows, pace_s, logs[1 + i]),
                            daemon=True)
            p.start()
            procs.append(p)
        last_n, last_t = -1, time.monotonic()
        result = None
        busy0 = None
        while result is None:
            if busy0 is None and c[C_PHASE] >= 1:  # the first window began: start counting the machine's busy time
                busy0 = (time.monotonic(), machine_ticks()[0])
            if rx.poll(0.05):
                try:
                    result = json.loads(rx.recv_bytes())
                except EOFError:
                    learner.join(1.0)
                    raise RuntimeError(f"{system} learner died (exit code {learner.exitcode})") from None
                break
            now = time.monotonic()
            n = int(c[C_BATCHES])
            if n != last_n:
                last_n, last_t = n, now
            elif now - last_t > stall_s:
                record["status"] = "stalled"
                record["stall"] = {"batches_before": n, "phase": int(c[C_PHASE]), "after_s": round(now - t_begin, 2)}
                break
            if not learner.is_alive():
                raise RuntimeError(f"{system} learner died (exit code {learner.exitcode})")
            dead = [p for p in procs[1:] if not p.is_alive() and p.exitcode != 0]
            if dead:
                raise RuntimeError(f"{system} actor {dead[0].name} died (exit code {dead[0].exitcode})")
        if result is not None and busy0 is not None:
            record["machine_busy_cores"] = (machine_ticks()[0] - busy0[1]) / CLOCK_TICKS / (time.monotonic() - busy0[0])
        if result is not None:
            # Give the actors a moment to note the stop (their last CPU reading).
            deadline = time.monotonic() + 3.0
            rows = [c[C_ACTORS + i * _row_words(windows):][: _row_words(windows)] for i in range(actors)]
            while time.monotonic() < deadline and any(r[A_SEEN] < windows + 1 for r in rows):
                time.sleep(0.01)
            record["learner"] = result
            record["actor_rows"] = [
                [[int(x) for x in r[A_PHASES + A_WORDS * p:][:A_WORDS]] for p in range(windows + 2)] for r in rows
            ]
    except Exception as exc:  # noqa: BLE001  # one broken run must not end the sweep: record it
        record["status"] = "error"
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        c[C_PHASE] = windows + 1  # tell every actor to stop
        record["killed_pids"] = _kill_all(procs, grace=2.0 if record["status"] == "ok" else 0.0)
        rx.close()
        if system == "mp_queue" and shared is not None:
            shared.cancel_join_thread()
            shared.close()
        if system in transports.SHMBUF_SYSTEMS:
            left = _remove_shmbuf_objects(address) if isinstance(address, str) else _remove_owned_by(procs[:1])
            if left:
                record["shm_removed_after_kill"] = left
        tails = {os.path.basename(x): _tail(x) for x in logs}
        record["logs"] = {k: v for k, v in tails.items() if v and (record["status"] != "ok" or "Traceback" in v)}
        shutil.rmtree(logdir, ignore_errors=True)
    record["wall_s"] = round(time.monotonic() - t_begin, 2)
    return record
