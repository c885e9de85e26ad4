"""AsyncBatchedCollector: every action answers its own observation, batching rules, isolation, faults, weights.

The env here (TagEnv) writes who made each observation into it: the worker's
index, the process id, a random id of the env instance (threads share a pid),
a step counter that never resets, the step within the episode, the episode
number and the time. The policy's answer is an exact function of that
observation (integer-valued floats, elementwise), so a stored action that is
not the answer to its own stored observation, or a rollout that mixes two
workers or skips a step, is visible in the data. TagEnv also checks every
action it receives and raises on a wrong one, so a cross-wired answer fails
the worker too.

Env factories and policies are module-level (forkserver and spawn pickle the
factories; the policy is never pickled). Every collector is a ``with`` block,
and a fixture checks after each test that no child process and no shared
memory object of this process outlives it. Most tests start their workers
with ``fork`` (fast on this 2-core machine); test 1 also runs the default
start method.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import pytest

import shmbuf
from shmbuf import _admin
from tests.conftest import child_pids, shm_objects, wait_until
from tests.helpers import descendants, gone
from workers import ActorError, AsyncBatchedCollector

pytestmark = pytest.mark.timeout(120)

# observation fields
WORKER, PID, UID, G, T_EP, K, STAMP = range(7)
OBS_DIM = 7


def answer(obs: np.ndarray) -> np.ndarray:
    """The policy's action for observations ``(n, OBS_DIM)``: exact (integers below 2**53), row by row."""
    return np.stack([obs[:, UID] * 2.0**20 + obs[:, G], obs[:, WORKER] * 1e6 + obs[:, K] * 1e3 + obs[:, T_EP]], axis=1)


def echo(obs: np.ndarray) -> np.ndarray:
    """The policy's extra "echo": who asked, and at which step."""
    return obs[:, WORKER] * 1e9 + obs[:, G]


class TagEnv(gym.Env):
    """A deterministic env whose observations say which worker, process, env instance and step made them.

    Args:
        worker: the worker's index (given through ``create_env_kwargs``).
        max_sleep: each step sleeps a time drawn from ``uniform(0, max_sleep)`` (a rng seeded by ``worker``),
            so workers run at random speeds.
        step_sleep: a fixed sleep added to every step.
        slow_flag, slow_sleep: while the file ``slow_flag`` exists, each step sleeps ``slow_sleep`` more.
        hang_flag: once the file exists, ``step`` sleeps for ever (first creating ``hang_flag.<worker>``);
            with ``ignore_term`` the process ignores SIGTERM too, so only SIGKILL ends it.
        raise_at: ``step`` raises ValueError at this step count.
        check: raise if an action is not ``answer(obs)`` for the observation it was sent for.

    Episode k lasts 3 to 40 steps (from the same rng); it ends terminated when k is even, truncated when odd.
    """

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(self, worker: int = 0, *, max_sleep: float = 0.0, step_sleep: float = 0.0, slow_flag: str | None = None,
                 slow_sleep: float = 0.0, hang_flag: str | None = None, ignore_term: bool = False,
                 raise_at: int | None = None, check: bool = True):
        self.worker = worker
        self.max_sleep = max_sleep
        self.step_sleep = step_sleep
        self.slow_flag = slow_flag
        self.slow_sleep = slow_sleep
        self.hang_flag = hang_flag
        self.raise_at = raise_at
        self.check = check
        self.uid = float(secrets.randbelow(2**30) + 1)
        self.rng = np.random.default_rng([12345, worker])
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float64)
        self.action_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
        self.g = 0
        self.t = 0
        self.k = -1
        self.length = 0
        self.last = np.zeros(OBS_DIM)
        # Not here: the collector probes env 0 in the learner (this test process), whose later fork
        # children would inherit the ignored SIGTERM. Only a worker that hangs ignores it.
        self.ignore_term = ignore_term

    def _obs(self) -> np.ndarray:
        self.last = np.array([self.worker, os.getpid(), self.uid, self.g, self.t, self.k, time.monotonic()], np.float64)
        return self.last.copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.k += 1
        self.t = 0
        self.length = int(self.rng.integers(3, 41))
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.check:
            want = answer(self.last[None])[0]
            if not np.array_equal(np.asarray(action), want):
                raise AssertionError(f"worker {self.worker}: got action {action} for observation {self.last}, "
                                     f"expected {want}: another observation's answer")
        if self.raise_at is not None and self.g == self.raise_at:
            raise ValueError(f"TagEnv worker {self.worker} breaks at step {self.g}")
        if self.hang_flag is not None and os.path.exists(self.hang_flag):
            if self.ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(f"{self.hang_flag}.{self.worker}", "w"):
                pass
            while True:
                time.sleep(1.0)
        pause = self.step_sleep + (self.rng.uniform(0.0, self.max_sleep) if self.max_sleep else 0.0)
        if self.slow_flag is not None and os.path.exists(self.slow_flag):
            pause += self.slow_sleep
        if pause:
            time.sleep(pause)
        self.g += 1
        self.t += 1
        end = self.t >= self.length
        return self._obs(), float(self.g), end and self.k % 2 == 0, end and self.k % 2 == 1, {}


def make_tag_env(worker: int = 0, **kw: Any) -> TagEnv:
    return TagEnv(worker, **kw)


def workers(n: int, **kw: Any) -> list[dict[str, Any]]:
    """``create_env_kwargs``: one dict per worker, worker i tagged i."""
    return [{"worker": i, **kw} for i in range(n)]


class TagPolicy:
    """``answer`` and ``echo`` on a batch; records each forward pass's observations' workers (it runs in the server)."""

    def __init__(self) -> None:
        self.calls: list[np.ndarray] = []  # the worker column of each forward pass's batch

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self.calls.append(obs[:, WORKER].copy())
        return answer(obs), {"echo": echo(obs)}


def tag_batch(batch: Any) -> tuple[str, Any]:
    """A postproc: the yielded item shows it ran."""
    return ("postprocessed", batch)


# -- what a stored rollout must look like --------------------------------------------------------------


def rollouts_of(batches: list[Any]) -> list[dict[str, Any]]:
    """Truncate-episodes batches (``copy=True``) split into rollouts: each its filled steps and its batch fields."""
    out = []
    for b in batches:
        for i in range(len(b.lane)):
            n = int(b.fill["step"][i])
            step = {k: v[i, :n] for k, v in b.data["step"].items()}
            out.append({"step": step, "boot": b.data["bootstrap"]["obs"][i], "lane": int(b.lane[i]),
                        "seq": int(b.seq[i]), "version": int(b.policy_version[i])})
    return out


def check_rollout(step: dict[str, np.ndarray], boot: np.ndarray | None = None) -> tuple[float, int, int]:
    """Every action is the answer to its own observation; one worker, process and env; consecutive steps.

    Returns ``(uid, first step, last step)``.
    """
    obs, act = step["obs"], step["action"]
    assert len(obs) >= 1
    assert np.array_equal(act, answer(obs)), f"an action is not the answer to its observation: {obs[:, :6]} -> {act}"
    assert np.array_equal(step["echo"], echo(obs)), "the echo extra does not match its observation"
    for col, what in ((WORKER, "workers"), (PID, "processes"), (UID, "env instances")):
        assert len(np.unique(obs[:, col])) == 1, f"one rollout mixes {what}: {np.unique(obs[:, col])}"
    g = obs[:, G]
    assert (np.diff(g) == 1).all(), f"steps are not consecutive: {g}"
    done = step["terminated"] | step["truncated"]
    t, k = obs[:, T_EP], obs[:, K]
    nxt_t = np.where(done[:-1], 0, t[:-1] + 1)
    nxt_k = np.where(done[:-1], k[:-1] + 1, k[:-1])
    assert np.array_equal(t[1:], nxt_t) and np.array_equal(k[1:], nxt_k), "episode steps do not follow each other"
    if boot is not None:
        assert boot[UID] == obs[0, UID] and boot[G] == g[-1] + 1, "the bootstrap observation is not the last one's successor"
    return float(obs[0, UID]), int(g[0]), int(g[-1])


def check_streams(spans: list[tuple[float, int, int]]) -> dict[float, int]:
    """Per env instance, its rollouts tile its steps from 0 without gap or overlap; returns steps per instance."""
    by: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for uid, a, b in spans:
        by[uid].append((a, b))
    out = {}
    for uid, s in by.items():
        s.sort()
        starts = [a for a, _ in s]
        ends = [b for _, b in s]
        assert starts[0] == 0 and starts[1:] == [e + 1 for e in ends[:-1]], \
            f"env {uid:.0f}: its rollouts do not tile its steps (lost or duplicated transitions): {s[:10]}"
        out[uid] = ends[-1] + 1
    return out


# -- fixtures ------------------------------------------------------------------------------------------


def my_objects(before: set[str]) -> list[str]:
    """New shmbuf objects in /dev/shm owned by this process (others' concurrent runs are not ours to judge)."""
    new = shm_objects() - before
    out = []
    for f in _admin.scan():
        entries = ({f.name[1:]} if f.segment else set()) | set(f.semaphores)
        if entries & new and f.owner_pid == os.getpid():
            out += sorted(entries & new)
    return out


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    """After each test: no child process (but multiprocessing's helpers) and no shared memory object of ours."""
    before = shm_objects()
    yield
    deadline = time.monotonic() + 5.0
    while (child_pids() or my_objects(before)) and time.monotonic() < deadline:
        for p in mp.active_children():
            p.join(0)
        time.sleep(0.05)
    assert not child_pids(), f"child processes outlived the test: {child_pids()}"
    assert not my_objects(before), f"shared memory objects outlived the test: {my_objects(before)}"


def names_of(c: AsyncBatchedCollector) -> list[str]:
    return [c.table.name, c.reader.name]  # type: ignore[union-attr]  # set while the collector runs


def collect_until(it: Iterator[Any], into: list[Any], done: Any, timeout: float, what: str) -> None:
    """Take batches from ``it`` into ``into`` until ``done()``; fail after ``timeout`` s saying what was awaited."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        into.append(next(it))


def no_objects_named(names: list[str]) -> bool:
    here = shm_objects()
    return not [e for e in here for n in names if n.lstrip("/") in e]


# -- 1. no cross-wiring ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("min_batch_size", "start_method"), [(1, None), (3, "fork"), (1, "spawn")],
                         ids=["min1-default", "min3-fork", "min1-spawn"])  # default: forkserver
def test_every_stored_action_answers_its_own_observation(min_batch_size: int, start_method: str | None) -> None:
    """Five workers at random speeds, thousands of steps: never another worker's answer, never a skipped step."""
    policy = TagPolicy()
    kw = {} if start_method is None else {"start_method": start_method}
    with AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=workers(5, max_sleep=0.002),
                               frames_per_batch=80, rollout_len=16, total_frames=4000, min_batch_size=min_batch_size,
                               max_batch_size=5, server_timeout=0.05, copy=True, timeout=30, **kw) as c:
        batches = list(c)
    server = c.stats()["server"]  # the server thread has ended: its counts are final
    rollouts = rollouts_of(batches)
    assert sum(len(r["step"]["obs"]) for r in rollouts) == c.frames >= 4000
    spans = [check_rollout(r["step"], r["boot"]) for r in rollouts]
    steps = check_streams(spans)
    assert sorted({int(r["step"]["obs"][0, WORKER]) for r in rollouts}) == [0, 1, 2, 3, 4]
    assert len(steps) == 5, "one env instance per worker"
    lanes = defaultdict(set)
    for r in rollouts:
        lanes[r["lane"]].add(float(r["step"]["obs"][0, UID]))
    assert all(len(u) == 1 for u in lanes.values()), f"a lane carried two envs' rollouts: {dict(lanes)}"
    # each worker has one request slot: a forward pass of n requests holds n different workers
    sizes = [len(w) for w in policy.calls[1:]]  # the first call is the construction's probe
    assert all(len(np.unique(w)) == len(w) for w in policy.calls), "a forward pass held two requests of one worker"
    assert sum(sizes) == server["requests"] and len(sizes) == server["forwards"]
    if min_batch_size > 1:
        assert max(sizes) >= min_batch_size, "batches never mixed workers"
        lingered = server["lingered_out"]
        assert sum(s < min_batch_size for s in sizes) <= lingered


def test_num_workers_splits_the_envs_into_vector_workers_that_ask_for_all_their_envs_at_once() -> None:
    """Six envs, num_workers=2: two processes, each stepping three envs and asking the server once per step for all
    three; every action still answers its own observation, and each env's rollouts tile its steps."""
    policy = TagPolicy()
    with AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=workers(6), num_workers=2,
                               frames_per_batch=96, rollout_len=8, total_frames=1500, copy=True, timeout=30) as c:
        batches = list(c)
        assert len(c.pool.pids) == 2
    server = c.stats()["server"]
    spans = []
    for r in rollouts_of(batches):
        assert r["step"]["obs"].shape[1] == 3, "a rollout of a vector worker holds its 3 envs"
        for e in range(3):
            spans.append(check_rollout({k: v[:, e] for k, v in r["step"].items()}))
    steps = check_streams(spans)
    assert len(steps) == 6, "one env instance per factory"
    # a request holds a worker's 3 envs: every forward pass's batch is a multiple of 3 observations
    assert all(len(w) % 3 == 0 for w in policy.calls[1:])
    assert server["requests"] == sum(len(w) // 3 for w in policy.calls[1:])
    with pytest.raises(shmbuf.UsageError, match="num_workers=4: the 6 envs must split evenly"):
        AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=workers(6), num_workers=4,
                              frames_per_batch=96)


# -- 2. batching -------------------------------------------------------------------------------------------


def recent_sizes(c: AsyncBatchedCollector) -> list[tuple[int, bool]]:
    return list(c.server.recent)  # type: ignore[union-attr]  # set while the collector runs


def test_min_batch_size_is_honoured_while_workers_are_alive() -> None:
    """min 3, max 4, six workers, a linger that never expires: every forward pass holds 3 or 4 requests."""
    policy = TagPolicy()
    with AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=workers(6, max_sleep=0.002),
                               frames_per_batch=96, rollout_len=16, total_frames=1500, min_batch_size=3,
                               max_batch_size=4, server_timeout=1.0, copy=True, timeout=30, start_method="fork") as c:
        batches = list(c)
    server, recent = c.stats()["server"], recent_sizes(c)  # the server thread has ended: its counts are final
    for r in rollouts_of(batches):
        check_rollout(r["step"], r["boot"])
    assert recent and len(recent) == server["forwards"]
    assert all(3 <= n <= 4 and not lingered for n, lingered in recent), f"batch sizes {sorted(set(recent))}"
    assert set(server["batch_sizes"]) <= {3, 4} and server["lingered_out"] == 0
    assert sum(server["batch_sizes"].values()) == server["forwards"]
    assert [len(w) for w in policy.calls[1:]] == [n for n, _ in recent], "the policy saw other batches"


def test_max_batch_size_smaller_than_the_workers_serves_everyone() -> None:
    """max 2 with five workers: no forward pass is larger, batches of 2 happen, and every worker is served."""
    policy = TagPolicy()
    with AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=workers(5, max_sleep=0.001),
                               frames_per_batch=80, rollout_len=16, total_frames=1600, max_batch_size=2,
                               copy=True, timeout=30, start_method="fork") as c:
        batches = list(c)
    server, recent = c.stats()["server"], recent_sizes(c)
    rollouts = rollouts_of(batches)
    for r in rollouts:
        check_rollout(r["step"], r["boot"])
    assert recent and all(1 <= n <= 2 for n, _ in recent) and set(server["batch_sizes"]) <= {1, 2}
    assert server["batch_sizes"].get(2, 0) > 0, "the limit was never reached: the test did not test it"
    per_worker = defaultdict(int)
    for r in rollouts:
        per_worker[int(r["step"]["obs"][0, WORKER])] += 1
    assert sorted(per_worker) == [0, 1, 2, 3, 4], f"a worker was starved: {dict(per_worker)}"


def test_a_forward_pass_below_min_batch_size_is_one_that_lingered_out() -> None:
    """min 2 of two workers, one of them slow, a short linger: small batches happen, and each one lingered out."""
    policy = TagPolicy()
    kwargs = [{"worker": 0, "max_sleep": 0.001}, {"worker": 1, "step_sleep": 0.03}]
    with AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=kwargs, frames_per_batch=16,
                               rollout_len=8, total_frames=320, min_batch_size=2, max_batch_size=2,
                               server_timeout=0.003, copy=True, timeout=30, start_method="fork") as c:
        batches = list(c)
    server, recent = c.stats()["server"], recent_sizes(c)  # the server thread has ended: its counts are final
    for r in rollouts_of(batches):
        check_rollout(r["step"], r["boot"])
    assert all((n >= 2) or lingered for n, lingered in recent)
    assert all(n < 2 for n, lingered in recent if lingered), "a full batch was counted as lingered out"
    assert server["lingered_out"] == sum(lingered for _, lingered in recent) > 0
    assert [len(w) for w in policy.calls[1:]] == [n for n, _ in recent]


# -- 3. a hung env does not hold up the others -------------------------------------------------------------


def test_a_hung_env_does_not_hold_up_the_others(tmp_path: Any) -> None:
    """Worker 3's env hangs in ``step`` for good; the other three keep stepping, each well past where it was.

    The server answers whoever has asked and never waits for a worker that does not ask. This used to be a
    rate test (the three's steps per second within 20 % with worker 3 slow and without): a speed claim that a
    shared machine's load decides. What it guarded is checked here without a clock: if the server waited for
    worker 3 (lockstep, or a forward pass of every worker), the three would stop with it and never reach
    their 40 more steps (deadline 60 s).
    """
    flag = str(tmp_path / "hang")
    kwargs = workers(3, max_sleep=0.002) + [{"worker": 3, "max_sleep": 0.002, "hang_flag": flag}]
    batches: list[Any] = []
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=kwargs, frames_per_batch=16,
                               rollout_len=8, copy=True, timeout=30, start_method="fork") as c:
        it = iter(c)
        batches.append(next(it))  # every worker is up
        open(flag, "w").close()
        collect_until(it, batches, lambda: os.path.exists(f"{flag}.3"), 60, "worker 3 to hang")
        hung_at = time.monotonic()  # worker 3 entered its endless step before this (one clock for all processes)

        def after(worker: int) -> int:
            """Steps of ``worker`` delivered so far that it took after worker 3 hung."""
            obs = [r["step"]["obs"] for r in rollouts_of(batches) if int(r["step"]["obs"][0, WORKER]) == worker]
            return int(sum((o[:, STAMP] > hung_at).sum() for o in obs))

        collect_until(it, batches, lambda: min(after(w) for w in range(3)) >= 40, 60,
                      "workers 0-2 to take 40 steps each beside the hung worker 3")
    for r in rollouts_of(batches):
        check_rollout(r["step"])
    assert after(3) == 0, "worker 3 kept stepping: it never hung, and nothing was tested"


# -- 4. faults ---------------------------------------------------------------------------------------------


class KillingPolicy(TagPolicy):
    """Answers as TagPolicy; when armed, SIGKILLs the armed worker while the server holds its request.

    It then waits (in the forward pass, so the answer is not yet written) until the collector has
    restarted that worker: the old request's answer must be dropped, never given to the replacement.
    """

    def __init__(self) -> None:
        super().__init__()
        self.collector: AsyncBatchedCollector | None = None
        self.armed: int | None = None
        self.killed: list[int] = []

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if self.armed is not None and self.collector is not None:
            rows = np.flatnonzero(obs[:, WORKER] == self.armed)
            if len(rows):
                self.armed = None
                pid = int(obs[rows[0], PID])
                pool = self.collector.pool
                restarts = pool.restarts
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
                deadline = time.monotonic() + 20
                while pool.restarts == restarts and time.monotonic() < deadline:
                    time.sleep(0.002)
        return super().__call__(obs)


def test_a_worker_killed_while_waiting_for_its_action_is_replaced_and_its_request_dropped() -> None:
    policy = KillingPolicy()
    batches: list[Any] = []
    with AsyncBatchedCollector(make_tag_env, policy=policy, create_env_kwargs=workers(4, max_sleep=0.002),
                               frames_per_batch=32, rollout_len=8, copy=True, timeout=30, restart=True,
                               max_restarts=10, start_method="fork") as c:
        policy.collector = c
        it = iter(c)
        batches += [next(it) for _ in range(10)]
        rng = np.random.default_rng(3)
        for victim in (1, 2):  # killed inside the server's forward pass, its request taken but not answered
            policy.armed = victim
            collect_until(it, batches, lambda: policy.armed is None, 20, f"worker {victim}'s request to reach the server")
            batches += [next(it) for _ in range(5)]
        for victim in (0, 3):  # killed from here, at a random moment
            time.sleep(rng.uniform(0.0, 0.05))
            pid = c.pool.pids[victim]
            os.kill(pid, signal.SIGKILL)
            policy.killed.append(pid)
            batches += [next(it) for _ in range(5)]

        def replaced() -> bool:
            pids = {int(pid) for b in batches for pid in b.data["step"]["obs"][:, 0, PID]}
            return len(pids - set(policy.killed)) == 4

        collect_until(it, batches, replaced, 30, "every replacement to deliver a rollout")
        server = c.stats()["server"]
        failures = list(c.failures)
        restarts = c.stats()["actor_restarts"]
    assert len(policy.killed) == 4 and restarts == 4
    assert [f.kind for f in failures] == ["died"] * 4, [str(f) for f in failures]  # no AssertionError: no stale answer
    assert all(f.exitcode == -signal.SIGKILL for f in failures)
    assert sorted(f.pid for f in failures) == sorted(policy.killed)
    assert server["dropped"] >= 2, f"the killed workers' taken requests were answered: {server}"
    rollouts = rollouts_of(batches)
    steps = check_streams([check_rollout(r["step"], r["boot"]) for r in rollouts])
    assert len(steps) == 8  # four first incarnations, four replacements
    assert sum(len(r["step"]["obs"]) for r in rollouts) == sum(steps.values())


def test_a_dead_worker_without_restart_is_raised_from_iteration() -> None:
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=workers(3, max_sleep=0.001),
                               frames_per_batch=24, rollout_len=8, timeout=30, start_method="fork") as c:
        it = iter(c)
        next(it)
        pid = c.pool.pids[1]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(ActorError) as info:
            for _ in it:
                assert time.monotonic() < deadline, "the dead worker was never reported"
    err = info.value
    assert err.kind == "died" and err.index == 1 and err.pid == pid and err.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("backend", ["multiprocessing", "threading"])
def test_an_env_error_carries_its_traceback(backend: str) -> None:
    kwargs = workers(3, max_sleep=0.001)
    kwargs[1]["raise_at"] = 30
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=kwargs, frames_per_batch=24,
                               rollout_len=8, timeout=30, env_backend=backend, start_method="fork") as c:
        deadline = time.monotonic() + 20
        with pytest.raises(ActorError) as info:
            for _ in c:
                assert time.monotonic() < deadline, "the env's error was never reported"
    err = info.value
    assert err.kind == "ValueError" and err.index == 1
    assert "TagEnv worker 1 breaks at step 30" in str(err)
    assert "test_workers_inference.py" in err.remote_traceback and "in step" in err.remote_traceback
    assert "raise ValueError" in err.remote_traceback


def _learner_main(conn: Any) -> None:
    """A learner in its own process (the default start method for its workers): reports its workers, then collects."""
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=workers(3, max_sleep=0.002),
                               frames_per_batch=24, rollout_len=8, timeout=60) as c:
        it = iter(c)
        next(it)
        conn.send_bytes(json.dumps({"pids": c.pool.pids, "names": names_of(c)}).encode())
        deadline = time.monotonic() + 60  # killed long before
        while time.monotonic() < deadline:
            next(it)


def test_when_the_learner_is_killed_every_env_worker_exits_within_2s() -> None:
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    learner = ctx.Process(target=_learner_main, args=(tx,))  # not a daemon: daemons may not start processes
    learner.start()
    tx.close()
    family: set[int] = set()
    names: list[str] = []
    try:
        assert rx.poll(90), "the learner never reported its workers"
        info = json.loads(rx.recv_bytes())
        pids, names = info["pids"], info["names"]
        family = descendants(learner.pid)
        assert set(pids) <= family
        time.sleep(0.2)  # the workers are mid-run: stepping, or waiting for an action
        os.kill(learner.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not all(gone(p) for p in pids) and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert all(gone(p) for p in pids), f"env workers {[p for p in pids if not gone(p)]} outlived the learner"
        assert took < 2.0, f"the env workers took {took:.2f} s to leave"
        wait_until(lambda: all(gone(p) for p in family), 5, "the learner's other processes (its fork server) to exit")
    finally:
        if learner.is_alive():
            learner.kill()
        learner.join(10)
        for p in family:
            if not gone(p):
                os.kill(p, signal.SIGKILL)
        for f in _admin.scan():  # the dead learner's table and pipeline (its watcher removes them): anything left goes
            if f.name in names and f.removable:
                _admin.remove(f)
    assert no_objects_named(names)


def drop_what_is_ready(c: AsyncBatchedCollector) -> bool:
    """Serve the writers and release every ready rollout, so that no worker waits for a slot (always True).

    Tests that stop reading and wait for each worker to reach a flag in its env need this: the reader lends
    slots only when called, and a worker that has filled what it was lent never steps again.
    """
    for _ in range(c.reader.poll()):  # type: ignore[union-attr]  # set while the collector runs
        c.reader.get(timeout=0).release()  # type: ignore[union-attr]  # set while the collector runs
    return True


def test_shutdown_returns_within_its_deadline_with_a_hung_env(tmp_path: Any) -> None:
    """Every env hangs in step (one of them ignoring SIGTERM too); shutdown(timeout=3) still cleans everything,
    within its deadline and a margin for a loaded machine: a wait for the hung envs (for ever) or a second full
    wait (6 s) misses it."""
    flag = str(tmp_path / "hang")
    kwargs = workers(3, max_sleep=0.001, hang_flag=flag)
    kwargs[0]["ignore_term"] = True
    c = AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=kwargs, frames_per_batch=24,
                              rollout_len=8, timeout=30, start_method="fork")
    with c:
        it = iter(c)
        next(it)
        pids, names = list(c.pool.pids), names_of(c)
        open(flag, "w").close()
        wait_until(lambda: drop_what_is_ready(c) and all(os.path.exists(f"{flag}.{w}") for w in range(3)), 20,
                   "every env to hang")
        t0 = time.monotonic()
        c.shutdown(timeout=3.0)
        took = time.monotonic() - t0
    assert took < 3.0 + 2.0, f"shutdown(timeout=3) took {took:.2f} s"
    assert all(gone(p) for p in pids), "a hung env worker survived shutdown"
    assert no_objects_named(names), "shutdown left the table or the pipeline in /dev/shm"
    assert c.failures == [] or all(f.kind != "AssertionError" for f in c.failures)


def test_shutdown_keeps_its_deadline_while_the_server_lingers_for_a_hung_worker(tmp_path: Any) -> None:
    """min_batch_size=3 of three workers, one hung in its env: the server lingers (server_timeout=10 s) over the other
    two's requests. shutdown(timeout=1.5) must still return within its deadline (and a margin for a loaded
    machine, far below the 10 s linger) and leave nothing behind."""
    flag = str(tmp_path / "hang")
    kwargs = workers(3, max_sleep=0.001)
    kwargs[0]["hang_flag"] = flag
    # Room for many rollouts (slots=60): nobody reads after the first batch, and the two others must be waiting
    # on the server, not for a slot, when worker 0 hangs.
    c = AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=kwargs, frames_per_batch=24,
                              rollout_len=8, timeout=30, min_batch_size=3, max_batch_size=3, server_timeout=10.0,
                              start_method="fork", slots=60)
    with c:
        it = iter(c)
        next(it)
        pids, names = list(c.pool.pids), names_of(c)
        open(flag, "w").close()
        wait_until(lambda: drop_what_is_ready(c) and os.path.exists(f"{flag}.0"), 20, "worker 0 to hang")
        # The reader lends slots only when called: poll, so that the two others wait on the server, not for a slot.
        wait_until(lambda: c.reader.poll() >= 0 and len(c.table.pending()) == 2, 20,  # type: ignore[union-attr]  # set while the collector runs
                   "the other two workers' requests")
        t0 = time.monotonic()
        c.shutdown(timeout=1.5)
        took = time.monotonic() - t0
        server_alive = c.server.is_alive()  # type: ignore[union-attr]  # set while the collector runs
    assert took < 1.5 + 3.5, f"shutdown(timeout=1.5) took {took:.2f} s"
    assert not server_alive, "shutdown returned with the server thread still running"
    assert all(gone(p) for p in pids)
    assert no_objects_named(names)


class FailingPolicy(TagPolicy):
    """Breaks on its 40th forward pass."""

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if len(self.calls) == 40:
            raise ZeroDivisionError("the policy breaks on its 40th forward pass")
        return super().__call__(obs)


class SlowOnce:
    """Answers like TagPolicy; once ``slow`` is set, one forward pass takes ``seconds`` (``inside`` is set meanwhile)."""

    def __init__(self, seconds: float):
        self.inner = TagPolicy()
        self.seconds = seconds
        self.slow = threading.Event()
        self.inside = threading.Event()

    def __call__(self, obs: np.ndarray) -> Any:
        if self.slow.is_set() and not self.inside.is_set():
            self.inside.set()
            time.sleep(self.seconds)
        return self.inner(obs)


def test_shutdown_wakes_waiting_workers_even_while_a_forward_pass_runs_long() -> None:
    """The server is inside a 6 s forward pass when shutdown(timeout=2) comes: workers waiting for an answer
    are woken at once (they exit 0, not by SIGTERM), and shutdown keeps its deadline (with a margin for a
    loaded machine; waiting for the forward pass to end would take 6 s)."""
    policy = SlowOnce(6.0)
    c = AsyncBatchedCollector([make_tag_env] * 2, policy=policy, create_env_kwargs=workers(2, max_sleep=0.001),
                              frames_per_batch=16, rollout_len=8, max_batch_size=1, timeout=30, start_method="fork")
    try:
        next(iter(c))
        policy.slow.set()
        assert policy.inside.wait(10), "the slow forward pass never started"
        t0 = time.monotonic()
        c.shutdown(timeout=2.0)
        took = time.monotonic() - t0
        codes = [a.exitcode for a in c.pool._actors]
    finally:
        c.shutdown()
    assert codes == [0, 0], f"workers did not leave on their own: exit codes {codes}"
    assert took < 2.0 + 2.5, f"shutdown took {took:.2f} s for a 2 s deadline"


@pytest.mark.parametrize("backend", ["multiprocessing", "threading"])
def test_a_policy_error_in_the_server_is_raised_by_the_learner(backend: str) -> None:
    c = AsyncBatchedCollector(make_tag_env, policy=FailingPolicy(), create_env_kwargs=workers(3, max_sleep=0.001),
                              frames_per_batch=24, rollout_len=8, timeout=30, env_backend=backend, start_method="fork")
    with c:
        pids, names = list(c.pool.pids), names_of(c)
        deadline = time.monotonic() + 20
        with pytest.raises(RuntimeError, match="the inference server failed: ZeroDivisionError") as info:
            for _ in c:
                assert time.monotonic() < deadline, "the server's failure was never reported"
    msg = str(info.value)
    assert "the policy breaks on its 40th forward pass" in msg and "Server traceback" in msg
    assert "test_workers_inference.py" in msg and "raise ZeroDivisionError" in msg
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    if backend == "multiprocessing":
        assert all(gone(p) for p in pids)
    assert no_objects_named(names)


# -- 5. weights ----------------------------------------------------------------------------------------------


BIAS = {0: 0.0, 1: 100.0, 2: 200.0}


def test_weight_updates_change_the_answers_and_every_step_carries_its_version() -> None:
    torch = pytest.importorskip("torch")

    class BiasPolicy(torch.nn.Module):
        def __init__(self, bias: float):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.tensor([bias], dtype=torch.float64))

        def forward(self, obs: Any) -> Any:
            a = torch.stack([obs[:, UID] * 2.0**20 + obs[:, G], obs[:, WORKER] * 1e6 + obs[:, K] * 1e3 + obs[:, T_EP]], 1)
            return a + self.bias, {"echo": obs[:, WORKER] * 1e9 + obs[:, G]}

    batches = []
    with AsyncBatchedCollector(make_tag_env, policy=BiasPolicy(0.0), create_env_kwargs=workers(3, max_sleep=0.002, check=False),
                               frames_per_batch=24, rollout_len=8, copy=True, timeout=30, start_method="fork") as c:
        it = iter(c)
        batches += [next(it) for _ in range(4)]
        for version in (1, 2):
            assert c.update_policy_weights(BiasPolicy(BIAS[version])) == version
            assert c.stats()["server"]["policy_version"] == version
            batches += [next(it) for _ in range(4)]
        collect_until(it, batches, lambda: int(batches[-1].policy_version.min()) == 2, 20,
                      "a batch collected wholly with version 2")
        with pytest.raises(shmbuf.UsageError, match="larger than the last"):
            c.update_policy_weights(BiasPolicy(0.0), version=2)
    rollouts = rollouts_of(batches)
    by_uid: dict[float, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    seen = set()
    for r in rollouts:
        s = r["step"]
        v = s["policy_version"]
        assert set(np.unique(v).tolist()) <= set(BIAS), f"unknown versions {np.unique(v)}"
        want = answer(s["obs"]) + np.array([BIAS[int(x)] for x in v])[:, None]
        assert np.array_equal(s["action"], want), "an action does not match the weights of its stamped version"
        assert r["version"] <= v.min(), f"batch.policy_version {r['version']} is newer than a step's {v.min()}"
        by_uid[float(s["obs"][0, UID])].append((s["obs"][:, G], v))
        seen |= set(v.tolist())
    assert seen == {0, 1, 2}
    for uid, parts in by_uid.items():
        g = np.concatenate([p[0] for p in parts])
        v = np.concatenate([p[1] for p in parts])[np.argsort(g)]
        assert (np.diff(v) >= 0).all(), f"env {uid:.0f}: versions go backwards over its steps"


# -- 6. other settings -----------------------------------------------------------------------------------------


def test_threading_backend_delivers_exact_data_and_postproc_runs() -> None:
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=workers(3, max_sleep=0.001),
                               frames_per_batch=48, rollout_len=8, total_frames=960, copy=True, timeout=30,
                               env_backend="threading", min_batch_size=2, server_timeout=0.02, postproc=tag_batch) as c:
        got = list(c)
        assert c.pool.pids == [None, None, None]
    assert all(tag == "postprocessed" for tag, _ in got)
    rollouts = rollouts_of([b for _, b in got])
    assert {int(r["step"]["obs"][0, PID]) for r in rollouts} == {os.getpid()}
    steps = check_streams([check_rollout(r["step"], r["boot"]) for r in rollouts])
    assert len(steps) == 3


def test_yield_completed_trajectories_yields_whole_episodes() -> None:
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=workers(3, max_sleep=0.001),
                               frames_per_batch=100, rollout_len=64, total_frames=600, timeout=30,
                               yield_completed_trajectories=True, start_method="fork") as c:
        batches = list(c)
    spans = []
    for b in batches:
        assert b.lengths.sum() == b.frames == len(b.data["step"]["obs"]) and b.frames >= 100
        assert np.array_equal(b.episode_lengths, b.lengths)
        starts = np.concatenate([[0], np.cumsum(b.lengths)])
        for i in range(len(b.lengths)):
            step = {k: v[starts[i] : starts[i + 1]] for k, v in b.data["step"].items()}
            done = step["terminated"] | step["truncated"]
            assert done[-1] and not done[:-1].any(), "an episode that does not end at its last step"
            assert step["obs"][0, T_EP] == 0 and step["obs"][-1, T_EP] == len(step["obs"]) - 1
            assert bool(step["terminated"][-1]) == (step["obs"][0, K] % 2 == 0)
            spans.append(check_rollout(step, b.data["bootstrap"]["obs"][i]))
    check_streams(spans)


@pytest.mark.parametrize("max_episodes", [None, 2], ids=["table-T", "table-2"])
def test_reset_at_each_iter_starts_every_rollout_at_a_reset_and_dict_kwargs_go_to_every_env(max_episodes: Any) -> None:
    """With a small episode table rollouts are committed short; those too end in a reset."""
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), num_envs=2, create_env_kwargs={"worker": 7},
                               frames_per_batch=16, rollout_len=8, total_frames=320, reset_at_each_iter=True,
                               copy=True, timeout=30, start_method="fork", max_episodes=max_episodes) as c:
        batches = list(c)
    rollouts = rollouts_of(batches)
    if max_episodes is not None:
        assert any(len(r["step"]["obs"]) < 8 for r in rollouts), "no rollout was committed short: the case is not tested"
    uids = set()
    for r in rollouts:
        s = r["step"]
        check_rollout(s, r["boot"])
        assert s["obs"][0, T_EP] == 0, "a rollout that does not start at a reset"
        assert s["terminated"][-1] or s["truncated"][-1], "a rollout's last step is not an episode end"
        uids.add(s["obs"][0, UID])
    assert {int(r["step"]["obs"][0, WORKER]) for r in rollouts} == {7}
    assert len(uids) == 2  # two workers, each its own env


def test_bad_settings_are_usage_errors_naming_the_setting() -> None:
    class ClashingPolicy(TagPolicy):
        def __call__(self, obs: np.ndarray) -> Any:
            a, ex = super().__call__(obs)
            return a, {**ex, "policy_version": np.zeros(len(obs), np.int64)}

    base = {"create_env_kwargs": workers(2), "frames_per_batch": 16, "rollout_len": 8, "start_method": "fork"}
    with pytest.raises(shmbuf.UsageError, match="min_batch_size"):
        AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), min_batch_size=5, max_batch_size=4, **base)
    with pytest.raises(shmbuf.UsageError, match="env_backend"):
        AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), env_backend="threads", **base)
    with pytest.raises(shmbuf.UsageError, match="device"):
        AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), device="cpu", **base)
    with pytest.raises(shmbuf.UsageError, match="policy_version"):
        AsyncBatchedCollector(make_tag_env, policy=ClashingPolicy(), **base)
    with pytest.raises(shmbuf.UsageError, match="create_env_kwargs"):
        AsyncBatchedCollector([make_tag_env] * 3, policy=TagPolicy(), **{**base, "create_env_kwargs": workers(2)})
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shmbuf")], "a server thread was left running"


def test_update_policy_weights_after_shutdown_raises() -> None:
    c = AsyncBatchedCollector([make_tag_env], policy=TagPolicy(), create_env_kwargs=workers(1), frames_per_batch=8,
                              rollout_len=8, env_backend="threading", timeout=30)
    c.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        c.update_policy_weights()


def test_torchrls_settings_at_their_defaults_keep_numpy_inputs_as_they_were() -> None:
    """TorchRL's backend / transport / weight-sync settings, given at their defaults with a numpy policy: the env
    workers stay processes (shmbuf's default for non-TorchRL inputs) and the batches stay CollectedBatch."""
    with AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), create_env_kwargs=workers(2, max_sleep=0.001),
                               frames_per_batch=16, total_frames=16, rollout_len=8, timeout=30, start_method="fork",
                               backend=None, env_backend=None, policy_backend="threading", transport=None,
                               weight_sync=None, weight_sync_model_id="policy", verbose=False) as c:
        assert type(c.env).__name__ == "ActorPool"
        batches = list(c)
        assert [type(b).__name__ for b in batches] == ["CollectedBatch"]
        assert c.set_seed(0) == 20_000 and c.policy is not None  # seed=0 (the default): next base past 2 workers
        c.update_policy_weights_()  # no argument: the policy changed in place, the version moves on
        assert c.policy_version == 1


def test_torchrls_settings_shmbuf_has_no_equivalent_for_are_refused_naming_what_to_use() -> None:
    base = {"create_env_kwargs": workers(2), "frames_per_batch": 16, "rollout_len": 8, "start_method": "fork"}
    for kw, match in (({"backend": "ray"}, "RayCollector"), ({"policy_backend": "ray"}, "RayCollector"),
                      ({"env_backend": "ray"}, "RayCollector"), ({"backend": "monarch"}, "Monarch"),
                      ({"policy_backend": "grpc"}, "policy_backend"), ({"transport": "driver"}, "inference table"),
                      ({"weight_sync": object()}, "update_policy_weights_"), ({"verbose": "yes"}, "verbose")):
        with pytest.raises(shmbuf.UsageError, match=match):
            AsyncBatchedCollector(make_tag_env, policy=TagPolicy(), **base, **kw)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shmbuf")], "a server thread was left running"
