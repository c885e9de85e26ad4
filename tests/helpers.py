"""Shared by tests and their child processes (must be importable under spawn).

This module and tests/conftest.py need nothing but the core (`make test-core` imports them); what needs an extra lives
beside them: tests/helpers_workers.py (gymnasium), tests/helpers_multiagent.py (pettingzoo), tests/helpers_schema.py
(hypothesis strategies, kept out of here so that spawned children need not import hypothesis), and
tests/helpers_storage.py (a synthetic actor's rollouts and the rsl_rl fork's recordings). No test module imports another.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing as mp
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

import shmbuf
from tests.conftest import live_processes, shm_objects, small_example

ROOT = pathlib.Path(__file__).resolve().parent.parent


def doc_blocks(page: str) -> list[str]:
    """The ```python blocks of ``docs/<page>`` (or a path from the repo root), in order."""
    path = ROOT / page if "/" in page else ROOT / "docs" / page
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


START_METHODS = ("spawn", "forkserver", "fork")  # forkserver: workers' default, and Python 3.14's on Linux

# The script run in place of a block under a given start method. It makes that method multiprocessing's default and
# runs the block as __main__: spawn and forkserver children then import the block itself (as __mp_main__), not this
# wrapper, as they would import a user's script. workers picks forkserver whatever multiprocessing's default is
# (workers/_pool.py default_start_method), so for a block that imports workers that default is pointed at
# multiprocessing's here: the block's Collector then starts its actors as with start_method=<method>. Every process
# the block starts is recorded, for run_script to check that it started some and all of them by <method>.
START_METHOD_WRAPPER = """\
import json
import multiprocessing
import runpy
from multiprocessing.process import BaseProcess

multiprocessing.set_start_method({method!r}, force=True)
if {uses_workers!r}:
    import workers._collector
    import workers._pool

    workers._pool.default_start_method = workers._collector.default_start_method = multiprocessing.get_start_method
started = []
start = BaseProcess.start


def recorded_start(self):
    started.append(self._start_method or multiprocessing.get_start_method())
    start(self)


BaseProcess.start = recorded_start
try:
    runpy.run_path({script!r}, run_name="__main__")
finally:
    with open({report!r}, "w") as f:
        json.dump(started, f)
"""


def session_of(pid: int) -> int | None:
    """The session id of a live process, or None (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2 :].split()
    return None if rest[0] in (b"Z", b"X") else int(rest[3])


def kill_all(procs: list[tuple[int, str]]) -> None:
    """SIGKILL each ``(pid, command line)`` of ``procs`` (as :func:`in_session` lists them); gone already is fine."""
    for pid, _ in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def in_session(sid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process in session ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and session_of(int(entry)) == sid:
            try:
                cmd = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append((int(entry), cmd[:200]))
    return out


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :].split()[0] in (b"Z", b"X")


def descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            kids[int(stat[stat.rfind(b")") + 2 :].split()[1])].append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def run_in_session(args: list[str], tmp_path: pathlib.Path, stem: str, *, timeout: float = 180,
                   cleanup: float = 15) -> tuple[subprocess.Popen, str, str, list[tuple[int, str]]]:
    """Run ``python *args`` in a fresh interpreter in a session of its own (cwd ``tmp_path``, this checkout on its
    path); return the process, what it printed on stdout and stderr, and what of its session was still there
    ``cleanup`` s after it exited (killed by then). Killed (its whole session) after ``timeout`` s."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # Output to files, not pipes: a process left behind holding a pipe would hold the test up until the deadline.
    out_path, err_path = tmp_path / f"{stem}.stdout", tmp_path / f"{stem}.stderr"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen([sys.executable, *args], stdout=out_f, stderr=err_f, env=env, cwd=tmp_path,
                                start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every process it started: one session
        proc.wait()
    deadline = time.monotonic() + cleanup
    while in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = in_session(proc.pid)
    kill_all(left)
    return proc, out_path.read_text(), err_path.read_text(), left


def run_script(script: pathlib.Path, tmp_path: pathlib.Path, *, start_method: str | None = None,
               timeout: float = 180, cleanup: float = 15) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter in a session of its own (warnings are errors, cwd ``tmp_path``) and
    return what it printed; fail unless it exits 0, printed no traceback (a child process's included), and every
    process it started is gone within ``cleanup`` s.

    With ``start_method``, the script runs under START_METHOD_WRAPPER: that method is multiprocessing's default
    (and workers'), and the run fails unless the script started processes, all of them by that method.
    Whatever of the session outlives a deadline is killed (those processes are this run's) and reported.
    """
    args = [str(script)]
    report = tmp_path / f"{script.stem}.started.json"
    if start_method is not None:
        assert start_method in START_METHODS, start_method
        wrapper = tmp_path / f"{script.stem}.{start_method}.py"
        uses_workers = bool(re.search(r"^\s*(from|import) workers\b", script.read_text(), re.M))
        wrapper.write_text(START_METHOD_WRAPPER.format(method=start_method, uses_workers=uses_workers,
                                                       script=str(script), report=str(report)))
        args = [str(wrapper)]
    proc, out, err, left = run_in_session(["-W", "error", *args], tmp_path, script.stem, timeout=timeout, cleanup=cleanup)
    what = f"{script.name}" + (f" under {start_method}" if start_method else "")
    assert proc.returncode == 0, f"{what} exited {proc.returncode} (-9: killed after {timeout} s):\n{out[-2000:]}\n{err[-3000:]}"
    assert "Traceback" not in err, f"{what} exited 0 but printed a traceback:\n{err[-3000:]}"
    assert not left, f"{what}: {cleanup} s after it exited, processes it started were still there (killed now): {left}"
    if start_method is not None:
        started = json.loads(report.read_text())
        assert started and set(started) == {start_method}, f"{what} started processes by {started}, not all by {start_method}"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_doc_block(page: str, k: int, tmp_path: pathlib.Path, timeout: float = 180, start_method: str | None = None) -> str:
    """Run block ``k`` of a docs page as written, as a script in a fresh interpreter (warnings are errors), under
    ``start_method`` if given (see run_script); return what it printed, for the test to check against what the
    page says it prints."""
    script = tmp_path / f"{pathlib.Path(page).stem}_block_{k}.py"
    script.write_text(doc_blocks(page)[k])
    return run_script(script, tmp_path, start_method=start_method, timeout=timeout).stdout


# A script's own use of multiprocessing (a Process, a Pool, a context, the module itself): the processes it starts then
# follow multiprocessing's default start method. A script whose processes are all started by workers (a Collector, an
# AsyncBatchedCollector, ...) does the same under every default: workers picks forkserver whatever multiprocessing's
# default is (workers/_pool.py default_start_method).
OWN_PROCESSES = re.compile(r"\bmultiprocessing\b|\bmp\.|\bProcess\(|\bPool\(|ProcessPoolExecutor\(")
WORKERS_START_METHOD = "forkserver"


def start_methods(code: str) -> tuple[str, ...]:
    """The start methods that change what ``code`` (a script, a docs block) does: every one of START_METHODS where it
    starts processes of its own through multiprocessing; workers' own, forkserver, where workers starts them all.

    A run under workers' method is the block as written, and it still checks that the block started processes, all by
    that method (run_script). How workers behaves under spawn and fork is its own tests' matter (test_workers_pool,
    test_workers_torch, test_workers_inference, ... pass start_method=), not each docs block's.
    """
    return START_METHODS if OWN_PROCESSES.search(code) else (WORKERS_START_METHOD,)


def under_each_start_method(run: Callable[[str, pathlib.Path], Any], tmp_path: pathlib.Path,
                            methods: tuple[str, ...] = START_METHODS) -> dict[str, Any]:
    """``run(method, directory)`` for every method of ``methods`` at once, each in a directory of its own under
    ``tmp_path``; return ``{method: what run returned}``, or fail with every run's failure once all have ended.

    For scripts that take long: a run is mostly waits (process start-up, actors attaching, a learner waiting for
    batches), so three at once take far less than three in turn (on a busy 2-core machine, about as long as one).
    """
    with concurrent.futures.ThreadPoolExecutor(len(methods)) as pool:
        futures = {}
        for method in methods:
            (tmp_path / method).mkdir()
            futures[method] = pool.submit(run, method, tmp_path / method)
    failed = {m: f.exception() for m, f in futures.items() if f.exception() is not None}
    if failed:
        raise AssertionError("\n\n".join(f"under {m}: {type(e).__name__}: {e}" for m, e in failed.items()))
    return {m: f.result() for m, f in futures.items()}


def run_doc_block_under_each_start_method(page: str, k: int, tmp_path: pathlib.Path, timeout: float = 240) -> dict[str, str]:
    """run_doc_block under each start method that changes what the block does (start_methods: spawn, forkserver and
    fork at once for a block that starts processes through multiprocessing; forkserver, workers' own, for one whose
    processes workers starts): ``{method: printed}``."""
    methods = start_methods(doc_blocks(page)[k])
    return under_each_start_method(lambda m, d: run_doc_block(page, k, d, timeout=timeout, start_method=m), tmp_path,
                                   methods)


class EpisodicEnv:
    """The README's ``env`` in tests/test_readme.py (here, for actor processes to import under spawn): episodes of
    10 (terminated), 30 (truncated) and 100 steps (terminated; longer than T).

    The observation is the step count within the episode. Stepping a finished episode fails:
    gymnasium warns there, and warnings are errors in this suite.
    """

    LENGTHS = ((10, "terminated"), (30, "truncated"), (100, "terminated"))

    def __init__(self) -> None:
        self.t: int | None = None
        self.episodes = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        self.t = 0
        self.length, self.end = self.LENGTHS[self.episodes % len(self.LENGTHS)]
        self.episodes += 1
        return np.zeros(4, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.t is None:
            raise AssertionError("step() after the episode ended: reset() first")
        self.t += 1
        done = self.t == self.length
        terminated, truncated = done and self.end == "terminated", done and self.end == "truncated"
        obs = np.full(4, self.t, np.float32)
        if done:
            self.t = None
        return obs, 1.0, terminated, truncated, {}


def fill_step(step: dict[str, np.ndarray], lane_tag: int, seq: int, t: int) -> None:
    step["obs"][:] = (lane_tag, seq, t, lane_tag * 1000 + seq)
    step["action"][...] = seq * 100 + t
    step["reward"][...] = t * 0.5
    step["done"][...] = t % 2 == 0


def checksum(data: dict[str, Any], fill: int) -> int:
    c = 0
    for name in ("obs", "action", "reward", "done"):
        c = zlib.crc32(np.ascontiguousarray(data["step"][name][:fill]).tobytes(), c)
    return c


def exactly_once_writer(name: str, tag: int, n: int, t: int, out: Any) -> None:
    """Write ``n`` rollouts of varying length; send (seq, length, crc) of each back to the test over ``out``."""
    step = {k: np.zeros(v.shape[1:], v.dtype) for k, v in small_example(t)["step"].items()}
    crcs = []
    with shmbuf.Writer(name, timeout=60, label=f"w{tag}") as w:
        for seq in range(n):
            length = 1 + (seq * 7 + tag) % t
            for i in range(length):
                fill_step(step, tag, seq, i)
                w.add("step", step)
            w.add("episode", {"return": np.array([seq], np.float32), "length": np.array([length], np.int32)})
            w.add("final", {"obs": np.full(4, tag, np.float32), "value": np.float32(seq)})
            got = w.commit()
            assert got == seq
            # what the reader must see, computed from what we wrote
            exp = {k: np.zeros((t, *v.shape), v.dtype) for k, v in step.items()}
            for i in range(length):
                fill_step(step, tag, seq, i)
                for k in exp:
                    exp[k][i] = step[k]
            crcs.append((seq, length, checksum({"step": exp}, length)))
    out.send_bytes(msgpack.packb(crcs))  # results as msgpack, like everything else here
    out.close()


# ------------------------------------------------------------- fault tests

FT = 8  # steps per rollout in fault tests
CTX = mp.get_context("fork")  # fast to start; spawn is covered by test_transfer


def fault_example() -> dict[str, Any]:
    """small_example plus a check timescale: the writer's tag and a CRC of the steps it wrote."""
    ex = small_example(FT)
    ex["check"] = {"tag": np.zeros((), np.int64), "crc": np.zeros((), np.int64), "seq": np.zeros((), np.int64)}
    return ex


def commit_checked(w: shmbuf.Writer, step: dict[str, np.ndarray], buf: dict[str, np.ndarray], tag: int, seq: int,
                   length: int, holding: Any = None, pause: float = 0.0) -> None:
    """Commit rollout ``seq`` of writer ``tag``: ``length`` steps (``fill_step``), its episode record and a check
    record whose CRC covers the steps (``buf`` collects them), as ``verify`` reads them back. ``holding`` (a shared
    value, if given) is set to 1 once the first ``add`` returned: from then on the writer has a slot in its hands.
    ``pause``: seconds to sleep after each step (a writer that spends its time mid-rollout, as an env step would)."""
    for i in range(length):
        fill_step(step, tag, seq, i)
        w.add("step", step)
        if i == 0 and holding is not None:
            holding.value = 1
        if pause:
            time.sleep(pause)
        for k in buf:
            buf[k][i] = step[k]
    w.add("episode", {"return": np.array([seq], np.float32), "length": np.array([length], np.int32)})
    w.add("check", {"tag": tag, "crc": checksum({"step": buf}, length), "seq": seq})
    w.commit()


def loop_writer(name: str, tag: int, committed: Any, rollouts: int = -1, timeout: float | None = None,
                holding: Any = None, pause: float = 0.0) -> None:
    """Commit rollouts until killed (or ``rollouts`` done); publish the last committed seq in ``committed``.

    ``holding`` (optional): 1 from the return of a rollout's first ``add`` to the return of its ``commit``, else 0,
    stored before ``committed``; read after a kill, 1 says the writer died with a slot in its hands (or its commit
    published: then ``committed`` is one behind what the reader got). ``pause``: as in ``commit_checked``."""
    step = {k: np.zeros(v.shape[1:], v.dtype) for k, v in small_example(FT)["step"].items()}
    buf = {k: np.zeros((FT, *v.shape), v.dtype) for k, v in step.items()}
    seq = 0
    try:
        with shmbuf.Writer(name, timeout=timeout, label=f"tag{tag}") as w:
            while seq != rollouts:
                commit_checked(w, step, buf, tag, seq, 1 + (seq * 5 + tag) % FT, holding, pause)
                if holding is not None:
                    holding.value = 0
                committed.value = seq
                seq += 1
    except (shmbuf.PipelineClosed, shmbuf.BrokenPipeline):
        # The reader closed while this writer was still attaching (the with block swallows it once inside), or
        # died: the expected ways out, told apart from a crash.
        os._exit(3)
    if seq != rollouts:  # left the loop early: the reader closed, and the with block ended quietly on PipelineClosed
        os._exit(3)


def verify(r: shmbuf.Rollout) -> tuple[int, int]:
    """Check a fault-test rollout is intact; return (tag, seq)."""
    d = r.data
    tag, seq, crc = int(d["check"]["tag"]), int(d["check"]["seq"]), int(d["check"]["crc"])
    assert r.seq == seq, f"lane seq {r.seq} != written seq {seq}"
    assert checksum(d, r.fill["step"]) == crc, f"tag {tag} seq {seq}: data does not match its checksum"
    assert d["episode"]["return"][0] == seq and d["episode"]["length"][0] == r.fill["step"]
    return tag, seq


class Ledger:
    """What the reader received, per writer tag: sequence numbers in arrival order, each verified."""

    def __init__(self, reader: shmbuf.Reader):
        self.reader = reader
        self.seqs: dict[int, list[int]] = defaultdict(list)

    def take(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(n):
            with self.reader.get(timeout=max(0.01, deadline - time.monotonic())) as r:
                tag, seq = verify(r)
                self.seqs[tag].append(seq)

    def take_ready(self) -> None:
        """Take what the reader already holds as ready: after a reclaim, that includes all the dead lane committed."""
        self.take(self.reader.stats()["ready_depth"])

    def drain(self, quiet: float = 0.2) -> None:
        while True:
            try:
                self.take(1, timeout=quiet)
            except shmbuf.SlotTimeout:
                return

    def check_exactly_once(self, tag: int, committed_at_least: int) -> int:
        got = self.seqs[tag]
        assert got == list(range(len(got))), f"tag {tag}: duplicates, gaps or reordering in {got[:20]}..."
        # `committed` is stored just after commit returns, so a kill in between leaves it one behind
        assert committed_at_least + 1 <= len(got) <= committed_at_least + 2, (tag, committed_at_least, len(got))
        return len(got)


def start_writer(name: str, tag: int, rollouts: int = -1, timeout: float | None = None,
                 holding: Any = None, pause: float = 0.0) -> tuple[Any, Any]:
    committed = CTX.RawValue("q", -1)
    p = CTX.Process(target=loop_writer, args=(name, tag, committed, rollouts, timeout, holding, pause), daemon=True)
    p.start()
    return p, committed


def slot_accounting(reader: shmbuf.Reader) -> dict[str, int]:
    s = reader.stats()["slots"]
    assert sum(s.values()) == reader.slots, f"slots unaccounted for: {s}"
    return s


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory in KiB (0 once it is gone): ``field`` of /proc/PID/status, VmRSS (all of it) or
    RssAnon (its private anonymous pages, where what it allocates lives: not the library pages a forked child faults
    in from its parent's files, nor the shared memory it maps)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------- one small pipeline's steps


def step(tag: float, t: int = 0) -> dict[str, Any]:
    return {"obs": np.full(4, tag, np.float32), "action": np.int64(t), "reward": np.float32(tag), "done": False}


def write(w: shmbuf.Writer, tag: float, length: int = 2) -> None:
    for t in range(length):
        w.add("step", step(tag, t))
    w.commit()


# ------------------------------------------------------------- a RayCollector's nodes (tests/test_ray*.py)


def watcher_of(owner: int) -> int:
    """The pid of the live shmbuf watcher (shmbuf/_janitor.py) of process ``owner``, or 0 if it has none.

    A watcher runs ``python -I -S .../shmbuf/_janitor.py OWNER_PID ...``; its middle process, which has the same
    command line, exits at once: the one left is the watcher."""
    found = []
    for pid, _, _, cmd in live_processes():
        argv = cmd.split()
        at = [i for i, a in enumerate(argv) if a.endswith(b"shmbuf/_janitor.py")]
        if at and len(argv) > at[0] + 1 and argv[at[0] + 1] == str(owner).encode():
            found.append(pid)
    return max(found, default=0)  # the watcher is forked by its middle process: the later pid, should both be seen


def described(rc: Any) -> list[dict[str, Any]]:
    """What each node's owner said about itself at start (pids, names), with ``watcher_pid``: the shmbuf watcher of the
    node's owner process, found in /proc while it lives (each owner has one by now: it made its pipeline). The
    learner's own node's is this process's watcher, which outlives the node: 0 there."""
    out = []
    for n in rc.nodes:  # info is set once a node has described itself, as each has by now
        info = dict(n.info)
        if info["pid"] != os.getpid():
            info["watcher_pid"] = watcher_of(info["pid"])
            assert info["watcher_pid"], f"node {n.index}'s owner (pid {info['pid']}) has no shmbuf watcher"
        else:
            info["watcher_pid"] = 0
        out.append(info)
    return out


def pids_of(info: list[dict[str, Any]]) -> list[int]:
    """A node's processes: its owner (not the learner, which is the owner of its own node), the owner's shmbuf watcher
    (which removes what the owner made if it dies) and its actors."""
    return [p for i in info for p in (i["pid"], i["watcher_pid"], *i["actor_pids"]) if p and p != os.getpid()]


def remote(rc: Any) -> int:
    """The index of a node with an owner actor (not the learner's own node)."""
    return next(n.index for n in rc.nodes if n.local is None)


def on_shm(info: dict[str, Any]) -> bool:
    """Is any of a node's shared-memory objects (its pipeline, its weight broadcast) still in /dev/shm?"""
    return any(e == n[1:] or e.startswith(f"sem.{n[1:]}-") for e in shm_objects() for n in info["names"])


class OnceLedger:
    """The exactly-once check of the Ray tests' ledgers (tests/test_ray.py, tests/test_ray_multiagent.py): a subclass
    fills ``seqs`` (a delivered rollout's key, node/incarnation/[policy/]lane/epoch -> its sequence numbers) and
    ``steps`` (an env's uid [and agent] -> arrays of its whole-life step counts) as batches come."""

    seqs: dict[Any, list[int]]
    steps: dict[Any, list[np.ndarray]]

    def check_once(self) -> None:
        for key, seqs in self.seqs.items():
            assert len(seqs) == len(set(seqs)), f"node/incarnation/lane/epoch {key}: a rollout delivered twice"
        for uid, parts in self.steps.items():
            g = np.concatenate(parts)
            assert len(g) == len(np.unique(g)), f"env {uid}: a step delivered twice"


# ------------------------------------------------------------- benchmarks


def run_bench(cmd: list[str], cwd: pathlib.Path, *, timeout: float = 240, grace: float = 5.0,
              others: Callable[[int], list[Any]] | None = None) -> tuple[int, str, list[int], list[Any]]:
    """Run a benchmark command in a session of its own; return ``(returncode, output, left, others_left)``.

    ``left``: processes of its process group still alive ``grace`` seconds after it returned (a forkserver leaves
    when it sees the run's end of its pipe); ``others(pid)``: more processes to wait for and report (Ray's). Every
    process of the group is SIGKILLed before returning, whatever happened, so that a failing test leaves none.
    """

    def group(pgid: int) -> list[int]:
        return [pid for pid, _, g, _ in live_processes() if g == pgid]

    extra = others or (lambda _pid: [])
    proc = subprocess.Popen(cmd, cwd=cwd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out, left, others_left = "", [], []
    try:
        out, _ = proc.communicate(timeout=timeout)
        deadline = time.monotonic() + grace
        while (group(proc.pid) or extra(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left, others_left = group(proc.pid), extra(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            out = out or proc.communicate()[0] or ""
        for pid in group(proc.pid):  # every process the run started, by pid (its session's process group)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, out, left, others_left


def ray_session_processes(driver: int) -> list[tuple[int, bytes]]:
    """Live processes of the Ray sessions the run started (Ray names a session directory after its driver's pid)."""
    token = re.compile(rb"session_[0-9_-]+_" + str(driver).encode() + rb"\b")
    return [(pid, cmd[:160]) for pid, _, _, cmd in live_processes() if token.search(cmd)]
