"""RayCollector on a local two-node Ray cluster: exactly once from both nodes, weights to both, node faults, shutdown.

One cluster (``ray.cluster_utils.Cluster``: a head and one more node, each with its own raylet and
object store: the `cluster` fixture of tests/conftest.py, which this module's tests share with
tests/test_ray_multiagent.py) serves them all, so every test here runs in ``make test``: the
first collects from both nodes, sends weights and checks that shutdown leaves nothing; the others
kill an owner, restart one, fail every node's collector, and kill the learner.

The env and policy live here, at module level: Ray puts the driver's working directory (the
repository root, where pytest runs) on its workers' path, so the node owners import them as
``tests.test_ray``, and their forkserver actors too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra (make test installs it)")

import shmbuf  # noqa: E402  (after the importorskip above)
from tests.conftest import shm_objects, wait_until  # noqa: E402  (after the importorskip above)
from tests.helpers import OnceLedger, described, gone, on_shm, pids_of, remote, watcher_of  # noqa: E402  (after the importorskip above)
from workers import (  # noqa: E402  # after the importorskip: they import ray
    ActorError,
    CollectedBatch,
    RayCollector,
    _ray,
    _ray_node,
    _ray_single,
    _ray_weights,
    _ray_wire,
)

T, E = 8, 2
FRAMES = 4 * T * E  # four rollouts a batch
def W(version: int) -> float:
    """The action every step takes under weights ``version``."""
    return 7.0 * version - 0.5 * version**2


class CountEnv(gym.Env):
    """obs = [uid, g, t]: g counts this env's steps over its whole life, so a step delivered twice shows.

    Episodes last ``length`` steps. ``fail_flag``: once that file exists, ``step`` raises.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, length: int = 5, step_sleep: float = 0.0005, fail_flag: str | None = None,
                 slow_start: float = 0.0):
        self.length, self.step_sleep, self.fail_flag = length, step_sleep, fail_flag
        if slow_start and mp.parent_process() is not None:  # in an actor process, not in the owner's probe
            time.sleep(slow_start)
        self.uid = float(np.random.default_rng().integers(1, 2**40))
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
        self.action_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
        self.g = self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.uid, self.g, self.t], np.float64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.fail_flag is not None and os.path.exists(self.fail_flag):
            raise ValueError("CountEnv: the fail flag is set")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        self.g += 1
        self.t += 1
        return np.array([self.uid, self.g, self.t], np.float64), 1.0, self.t >= self.length, False, {}


def make_count_env(**kw: Any) -> gym.Env:
    return gym.vector.SyncVectorEnv([lambda: CountEnv(**kw) for _ in range(E)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


class WeightPolicy:
    """Every action is the broadcast weight ``w``: a rollout shows which weights it was collected with."""

    def __init__(self) -> None:
        self.w = np.zeros(1)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.w, (len(obs), 1)).copy()

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.w = np.asarray(params["w"], np.float64).copy()


def weights(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1, W(version))}


def collector(**kw: Any) -> RayCollector:
    args = dict(frames_per_batch=FRAMES, rollout_len=T, actors_per_node=1, weights=weights(0), timeout=60,
                create_env_kwargs={}, stop_timeout=5.0)
    args.update(kw)
    return RayCollector(make_count_env, WeightPolicy(), **args)


class Ledger(OnceLedger):
    """Every delivered rollout, checked as it comes: each (node, incarnation, lane, epoch, seq) and each env step at most
    once."""

    def __init__(self, rc: RayCollector) -> None:
        self.rc = rc
        self.local = {n.index for n in rc.nodes if n.local is not None}  # read in this process: Collector's views
        self.seqs: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)  # (node, incarnation, lane, epoch)
        self.steps: dict[float, list[np.ndarray]] = defaultdict(list)
        self.versions: dict[int, set[int]] = defaultdict(set)
        self.batches: list[int] = []
        self.lag_max: int | None = None  # the largest policy_lag of any rollout taken

    def take(self, b: Any) -> None:
        assert isinstance(b, CollectedBatch) and isinstance(b, _ray.RayBatch)
        self.batches.append(b.node)
        obs, act = b.data["step"]["obs"], b.data["step"]["action"]
        assert obs.shape == (len(b.lane), T, E, 3)
        # the learner's node: views of its shared memory, as Collector's; another: read-only views of a Ray object
        assert obs.flags.writeable == (b.node in self.local)
        for i, (lane, epoch, seq, v) in enumerate(zip(b.lane.tolist(), b.epoch.tolist(), b.seq.tolist(),
                                                      b.policy_version.tolist())):
            self.seqs[(b.node, b.incarnation, lane, epoch)].append(seq)
            self.versions[b.node].add(v)
            n = int(b.fill["step"][i])
            assert np.all(act[i, :n] == W(v)), f"a rollout of version {v} took actions {np.unique(act[i, :n])}"
            for e in range(E):
                self.steps[float(obs[i, 0, e, 0])].append(obs[i, :n, e, 1].copy())
        # Each rollout's lag: the learner's version when this batch was handed out (the test takes a batch before it
        # publishes anything more) minus the version the rollout was collected with.
        lag = [self.rc.policy_version - v for v in b.policy_version.tolist()]
        assert b.policy_lag.tolist() == lag, f"lag {b.policy_lag.tolist()} for versions {b.policy_version.tolist()} " \
                                             f"at learner version {self.rc.policy_version}"
        self.lag_max = max(lag) if self.lag_max is None else max(self.lag_max, *lag)

    def check_contiguous(self) -> None:
        for key, seqs in self.seqs.items():
            assert sorted(seqs) == list(range(min(seqs), min(seqs) + len(seqs))), f"{key}: a rollout missing"


def late_batch_waiting(rc: RayCollector, timeout: float = 60.0) -> bool:
    """Wait until a node owner's ``next_batch`` call that the learner keeps in flight has returned (its batch is in
    Ray's object store, not yet handed out); False if none did within ``timeout``. Every node with an owner has calls
    in flight between two batches of the learner (RayCollector._fill)."""
    ready, _ = ray.wait(list(rc._pending), num_returns=1, timeout=timeout)
    return bool(ready)


@pytest.mark.parametrize("local_node", [True, False], ids=["learners-node-in-process", "every-node-through-ray"])
def test_every_rollout_once_from_both_nodes_weights_reach_both_and_shutdown_leaves_nothing(cluster: Any,
                                                                                           local_node: bool) -> None:
    """Two nodes deliver, nothing twice, nothing missing; version 1 reaches both; clean exit. With the learner's
    node read in this process (the default) and with both nodes behind an owner and Ray objects."""
    with collector(local_node=local_node) as rc:
        ledger = Ledger(rc)
        assert sum(n.local is not None for n in rc.nodes) == int(local_node)
        info = described(rc)
        assert len({i["node_id"] for i in info}) == 2 and all(i["actor_pids"] for i in info)
        assert all(on_shm(i) for i in info), "the owners' pipelines are not in this machine's /dev/shm"
        deadline = time.monotonic() + 60
        for k, b in enumerate(rc):
            ledger.take(b)
            if k == 3:
                # A version-0 batch still to come, surely: a node owner's batch already returned (its rollouts all
                # committed before the update) that the learner has not taken yet. Without this wait, every actor
                # just between two rollouts when the update lands leaves none late (the parallel suite's load).
                assert late_batch_waiting(rc), "no node owner's batch came back within 60 s"
                assert rc.update_policy_weights(weights(1)) == 1
            if k > 3 and all(1 in ledger.versions[n] for n in (0, 1)) and len(ledger.batches) >= 12:
                break
            assert time.monotonic() < deadline, f"version 1 did not reach both nodes: {dict(ledger.versions)}"
        stats = rc.stats()
    ledger.check_once()
    ledger.check_contiguous()
    assert {0, 1} <= set(ledger.batches)
    assert all(n["frames"] > 0 and n["lost_batches"] == 0 for n in stats["nodes"]) and stats["failures"] == []
    # version 1 was published after batch 3 with a version-0 batch waiting: its rollouts arrived late, lag 1
    assert stats["policy_version"] == 1 and stats["policy_lag_max"] == ledger.lag_max == 1
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "the owners, their actors and watchers to exit")
    wait_until(lambda: not any(on_shm(i) for i in info), 10, "the nodes' shared memory to go")


def test_usage_errors_name_the_setting(cluster: Any, monkeypatch: Any) -> None:
    with pytest.raises(shmbuf.UsageError, match=r"nodes: 'nope' is not an alive node"):
        collector(nodes=["nope"])
    with pytest.raises(shmbuf.UsageError, match=r"max_in_flight: expected an int >= 1, got 0"):
        collector(max_in_flight=0)
    with pytest.raises(shmbuf.UsageError, match=r"num_actors=.*use actors_per_node"):
        collector(num_actors=2)
    with pytest.raises(shmbuf.UsageError, match=r"policy: .*cannot be pickled"):
        RayCollector(make_count_env, lambda obs: obs[:, :1], frames_per_batch=FRAMES, rollout_len=T)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(shmbuf.UsageError, match=r"needs a Ray cluster: call ray.init"):
        collector()


def test_a_malformed_batch_is_refused_naming_the_leaf() -> None:
    with pytest.raises(shmbuf.SchemaError, match="expected msgpack bytes"):
        _ray_wire.unpack_header(["not", "bytes"], "a batch from node 0")
    with pytest.raises(shmbuf.SchemaError, match="not valid msgpack"):
        _ray_wire.unpack_header(b"\xc1", "a batch from node 0")
    with pytest.raises(shmbuf.SchemaError, match=f"wire version 99, expected {_ray_wire.WIRE_VERSION}"):
        _ray_wire.unpack_header(msgpack.packb({"magic": _ray_wire.WIRE_MAGIC, "version": 99}), "a batch from node 0")
    # _unpack against a real schema, without a cluster: a collector shell with the schema of CountEnv's rollouts (its
    # learner's side of one stream, workers._ray_single, holds the schema every batch is checked against)
    from shmbuf.layout import rollout_example
    from workers import probe

    env = make_count_env()
    try:
        p = probe(env, WeightPolicy(), 0)
    finally:
        env.close()
    example = rollout_example(p["obs"], p["action"], rollout_len=T, num_envs=E, extras=p["extras"])
    rc = RayCollector.__new__(RayCollector)
    rc.schema, rc.batch_mode, rc.copy, rc._closed = shmbuf.Schema.from_example(example), "truncate_episodes", False, True
    rc._streams = _ray_single.SingleAgentNodes(None)
    rc._streams.schema = rc.schema
    node = _ray_node.Node(0, "n0")
    leaves = [lf for ts in rc.schema.timescales for lf in ts.leaves]
    good = [np.zeros((2, *lf.shape), lf.dtype) for lf in leaves]
    good += [np.zeros(2, np.int64) for _ in rc.schema.timescales]
    good += [np.zeros(2, np.int64) for _ in _ray_wire.META] + [np.zeros(0), np.zeros(0, np.int64)]
    head = msgpack.packb({"magic": _ray_wire.WIRE_MAGIC, "version": _ray_wire.WIRE_VERSION, "frames": 2 * T * E, "fill": True})
    assert rc._unpack(node, (head, good)).data["step"]["obs"].shape == (2, T, E, 3)
    bad = list(good)
    i = next(k for k, lf in enumerate(leaves) if lf.name == "step/obs")
    bad[i] = np.zeros((2, T, E, 4))
    with pytest.raises(shmbuf.SchemaError, match=r"leaf step/obs: expected float64 \(2, 8, 2, 3\), got float64 \(2, 8, 2, 4\)"):
        rc._unpack(node, (head, bad))
    with pytest.raises(shmbuf.SchemaError, match=r"expected \d+ arrays, got \d+"):
        rc._unpack(node, (head, good[:-1]))
    with pytest.raises(shmbuf.SchemaError, match=r"expected \(header, list of arrays\), got tuple"):
        rc._unpack(node, (head,))
    uneven = list(good)
    uneven[i] = np.zeros((3, T, E, 3))  # another leading size than the other leaves'
    with pytest.raises(shmbuf.SchemaError, match=r"leaf step/obs: expected float64 \(2, 8, 2, 3\), got float64 \(3, 8, 2, 3\)"):
        rc._unpack(node, (head, uneven))
    long_meta = good[:-4] + [np.zeros(7, np.int64)] + good[-3:]
    with pytest.raises(shmbuf.SchemaError, match=r"expected integers of shape \(2,\), got int64 \(7,\)"):
        rc._unpack(node, (head, long_meta))
    text_meta = good[:-4] + [np.array(["a", "b"])] + good[-3:]
    with pytest.raises(shmbuf.SchemaError, match=r"expected integers of shape \(2,\), got <U1 \(2,\)"):
        rc._unpack(node, (head, text_meta))
    for bad_head in ({"frames": "many", "fill": True}, {"fill": True}, {"frames": -1, "fill": True}, {"frames": 1}):
        h = msgpack.packb({"magic": _ray_wire.WIRE_MAGIC, "version": _ray_wire.WIRE_VERSION, **bad_head})
        with pytest.raises(shmbuf.SchemaError, match=r"header field frames .* or fill .* missing or wrong"):
            rc._unpack(node, (h, good))


def test_killing_one_owner_leaves_the_other_delivering(cluster: Any) -> None:
    with collector() as rc:
        ledger = Ledger(rc)
        r = remote(rc)
        info = described(rc)
        it = iter(rc)
        for _ in range(6):
            ledger.take(next(it))
        ray.kill(rc.nodes[r].owner, no_restart=True)
        deadline = time.monotonic() + 60
        while not rc.failures:
            ledger.take(next(it))
            assert time.monotonic() < deadline, "the dead owner was never reported"
        failure = rc.failures[0]
        assert failure.node == r and isinstance(failure.error, ray.exceptions.RayActorError) and not failure.restarting
        assert rc.nodes[r].state == "dead"
        after = len(ledger.batches)
        for _ in range(8):
            ledger.take(next(it))
        assert ledger.batches[after:] == [1 - r] * 8, "batches after the failure must come from the living node"
        stats = rc.stats()
        assert stats["nodes"][r]["state"] == "dead" and stats["nodes"][r]["lost_batches"] == failure.lost_batches >= 1
        assert "ActorDiedError" in stats["failures"][0] or "RayActorError" in stats["failures"][0]
        # The dead owner's actors and shmbuf watcher exit; the watcher removes its node's shared memory.
        wait_until(lambda: all(gone(p) for p in pids_of([info[r]])), 20, "the dead node's processes to exit")
        wait_until(lambda: not on_shm(info[r]), 10, "the dead node's shared memory to be removed")
        assert on_shm(info[1 - r]), "the living node's shared memory went too"
    ledger.check_once()
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")


def _the_kill(exc: BaseException) -> bool:
    """``exc`` is the ActorError of actor 0's SIGKILL."""
    return isinstance(exc, ActorError) and "actor 0 (pid" in str(exc) and "killed by SIGKILL" in str(exc)


def test_a_node_owner_raises_its_actors_death_at_every_call_after_it() -> None:
    """Without Ray: a node's collecting side (what a node owner runs), its collector's slot timeout short. Its actor
    is stopped, so that the owner's wait runs out and it takes the collector up again (the SlotTimeout path, twice)
    before the death; then SIGKILLed: the call raises the actor's ActorError, and so does the next one, as every
    later call of the learner's in flight must (the learner may read any of them first). A generator that raised
    is over: the next call used to raise a bare StopIteration, which became the node's failure."""
    from workers._ray_nodes import _NodeCollector

    kw = dict(policy=WeightPolicy(), frames_per_batch=FRAMES, rollout_len=T, num_actors=1, weights=weights(0),
              timeout=0.1, stop_timeout=5.0, copy=False)
    owner = _NodeCollector((make_count_env,), kw, 60.0, "node 1")
    pid = owner.collector.pool.pids[0]
    try:
        taken_up = []
        iterator = owner.collector.iterator

        def counted() -> Any:
            taken_up.append(time.monotonic())
            return iterator()

        owner.collector.iterator = counted  # an instance attribute: the owner's next iterator is counted
        assert owner._next() is not None
        os.kill(pid, signal.SIGSTOP)
        raised: list[BaseException] = []

        def take() -> None:
            try:
                while True:  # the batches committed before the stop, then the wait
                    owner._next()
            except BaseException as exc:  # noqa: BLE001  # what the owner raised is the point
                raised.append(exc)

        th = threading.Thread(target=take, daemon=True)
        th.start()
        wait_until(lambda: len(taken_up) >= 3, 30, "the owner to take its collector up again after two slot timeouts")
        os.kill(pid, signal.SIGKILL)
        th.join(30)
        assert not th.is_alive() and len(raised) == 1 and _the_kill(raised[0]), raised
        for _ in range(2):  # the learner's other calls in flight: each the same failure
            with pytest.raises(ActorError) as again:
                owner._next()
            assert again.value is raised[0]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        owner.collector.shutdown(5.0)


def test_an_actor_killed_on_a_remote_node_is_the_nodes_failure_whichever_call_is_read(cluster: Any) -> None:
    """One actor per node, the other node's SIGKILLed without restart: every next_batch call of its owner after the
    death raises Ray's RayTaskError of that ActorError (calls made here, before the learner makes any, so that their
    order is known), and the learner's NodeFailure for the node carries it."""
    with collector(actors_per_node=1) as rc:
        r = remote(rc)
        info = described(rc)
        owner = rc.nodes[r].owner
        assert ray.get(owner.next_batch.remote(), timeout=60) is not None  # the learner has not iterated: no call of its
        os.kill(info[r]["actor_pids"][0], signal.SIGKILL)
        raised: list[Any] = []
        deadline = time.monotonic() + 60
        while len(raised) < 3:
            assert time.monotonic() < deadline, f"the owner's calls did not fail: {raised}"
            try:
                ray.get(owner.next_batch.remote(), timeout=60)  # a batch committed before the death, or its failure
            except ray.exceptions.RayTaskError as exc:
                raised.append(exc)
        assert all(_the_kill(exc.cause) for exc in raised), [type(exc.cause).__name__ for exc in raised]
        it = iter(rc)
        while not rc.failures:
            assert time.monotonic() < deadline + 60, f"node {r}'s failure was never reported: {rc.stats()}"
            next(it)
        failure = rc.failures[0]
        assert failure.node == r and not failure.restarting
        assert isinstance(failure.error, ray.exceptions.RayTaskError) and _the_kill(failure.error.cause), failure
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")
    wait_until(lambda: not any(on_shm(i) for i in info), 10, "the nodes' shared memory to be removed")


def test_restart_brings_a_killed_owner_back_with_the_latest_weights(cluster: Any) -> None:
    with collector(restart=True, max_restarts=1) as rc:
        ledger = Ledger(rc)
        r = remote(rc)
        before = described(rc)[r]
        it = iter(rc)
        for _ in range(4):
            ledger.take(next(it))
        rc.update_policy_weights(weights(1))
        rc.update_policy_weights(weights(2))
        ray.kill(rc.nodes[r].owner, no_restart=False)
        deadline = time.monotonic() + 90
        while not (rc.failures and rc.nodes[r].state == "running" and 2 in ledger.versions[r]
                   and ledger.batches[-1] == r):
            ledger.take(next(it))
            assert time.monotonic() < deadline, f"node {r} did not come back with version 2: {rc.stats()}"
        assert rc.failures[0].restarting and rc.failures[0].node == r
        assert rc.nodes[r].info["pid"] != before["pid"], "Ray did not restart the owner in a new process"
        assert rc.nodes[r].incarnation == 1 and rc.stats()["nodes"][r]["restarts"] == 1
        info = described(rc)
    ledger.check_once()
    wait_until(lambda: all(gone(p) for p in pids_of(info) + pids_of([before])), 20, "every owner's processes to exit")


def test_rollout_keys_stay_unique_when_each_node_restarts_a_killed_actor(cluster: Any) -> None:
    """Issue 18 item 3: each node's actor process, SIGKILLed, is restarted by its node's pool on its lane and counts
    seq from 0 again, so (node, incarnation, lane, seq) repeats; (node, incarnation, lane, epoch, seq) must not, on the
    learner's own node (Collector's batches) and on the other (through Ray)."""
    with collector(restart=True, max_restarts=2) as rc:
        ledger = Ledger(rc)
        info = described(rc)
        it = iter(rc)
        for _ in range(4):
            ledger.take(next(it))
        # Kill only once each node's actor has delivered: a replacement of an actor that had committed nothing
        # repeats no seq, and the loop below would wait out its deadline (a loaded machine's slow node did so).
        deadline = time.monotonic() + 60
        while {node for node, *_ in ledger.seqs} != {0, 1}:
            assert time.monotonic() < deadline, f"a node delivered nothing in 60 s: {rc.stats()}"
            ledger.take(next(it))
        for i in info:
            os.kill(i["actor_pids"][0], signal.SIGKILL)

        def pairs() -> list[tuple[int, int, int, int]]:
            return [(node, inc, lane, s) for (node, inc, lane, _), seqs in ledger.seqs.items() for s in seqs]

        def repeated_on(node: int) -> bool:
            p = [k for k in pairs() if k[0] == node]
            return len(set(p)) < len(p)

        deadline = time.monotonic() + 90
        while not (repeated_on(0) and repeated_on(1)):
            assert time.monotonic() < deadline, f"a killed actor's replacement delivered nothing: {rc.stats()}"
            ledger.take(next(it))
        for _ in range(4):
            ledger.take(next(it))
        assert rc.failures == [] and all(n.incarnation == 0 for n in rc.nodes)  # the owners lived; the actors died
    ledger.check_once()  # keyed by (node, incarnation, lane, epoch): no seq twice under one key
    keys = [k + (s,) for k, seqs in ledger.seqs.items() for s in seqs]
    assert len(set(keys)) == len(keys)
    claims: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    for node, inc, lane, epoch in ledger.seqs:
        claims[(node, inc, lane)].add(epoch)
    assert all(any(len(e) > 1 for k, e in claims.items() if k[0] == node) for node in (0, 1)), dict(claims)
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")


@pytest.mark.parametrize("published", [True, False], ids=["after-updates", "never-updated"])
def test_a_restarted_owner_collects_with_the_current_weights_from_its_first_rollout(cluster: Any,
                                                                                   published: bool) -> None:
    """Issue 18 item 4: Ray restarts an owner with its first arguments, so its actors started at the first weights
    (version 0) and the node delivered rollouts of version 0 before the republished version arrived. Now its actors
    collect nothing until it has the learner's current weights (never updated: the ones it started from)."""
    with collector(restart=True, max_restarts=1) as rc:
        ledger = Ledger(rc)
        r = remote(rc)
        it = iter(rc)
        want = 3 if published else 0
        for v in range(1, want + 1):
            rc.update_policy_weights(weights(v))
        deadline = time.monotonic() + 60
        while want not in ledger.versions[r]:  # the owner has the current weights before it is killed
            assert time.monotonic() < deadline, f"node {r} never delivered version {want}: {dict(ledger.versions)}"
            ledger.take(next(it))
        ray.kill(rc.nodes[r].owner, no_restart=False)
        reborn: list[int] = []
        while len(reborn) < 3 * 4:  # three batches of the restarted owner's rollouts
            assert time.monotonic() < deadline + 60, f"node {r} did not come back: {rc.stats()}"
            b = next(it)
            ledger.take(b)
            if b.node == r and b.incarnation == 1:
                reborn += b.policy_version.tolist()
        assert rc.policy_version == want and rc.failures and rc.failures[0].restarting
        assert set(reborn) == {want}, f"the restarted owner delivered versions {sorted(set(reborn))}, not only {want}"
        info = described(rc)
    ledger.check_once()
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")


def test_a_collector_error_on_every_node_is_raised_with_both_failures(cluster: Any, tmp_path: Any) -> None:
    flag = str(tmp_path / "fail")
    with collector(create_env_kwargs={"fail_flag": flag}) as rc:
        info = described(rc)
        it = iter(rc)
        next(it)
        open(flag, "w").close()
        with pytest.raises(RuntimeError, match="every node has failed") as raised:
            for _ in range(10_000):
                next(it)
        assert "CountEnv: the fail flag is set" in str(raised.value)
        assert {f.node for f in rc.failures} == {0, 1}
        for f in rc.failures:  # through Ray from a node owner; straight from the collector on the learner's node
            want = ActorError if rc.nodes[f.node].local is not None else ray.exceptions.RayTaskError
            assert isinstance(f.error, want), f"node {f.node}: {type(f.error)}"
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")
    assert not any(on_shm(i) for i in info), f"left in /dev/shm: {sorted(shm_objects())}"


def test_complete_episodes_through_ray_lose_no_episode(cluster: Any) -> None:
    """Episodes 0.4 s apart: longer than the owners' 0.25 s waits, which once dropped the episodes taken so far."""
    with collector(batch_mode="complete_episodes", rollout_len=16, frames_per_batch=20,
                   create_env_kwargs={"step_sleep": 0.08}) as rc:
        info = described(rc)
        got = []
        deadline = time.monotonic() + 60
        for b in rc:
            got.append(b)
            assert b.data["step"]["obs"].shape[0] == int(b.lengths.sum()) >= 20
            assert np.all(b.lengths == 5) and np.all(b.episode_lengths == 5)
            if len({g.node for g in got}) == 2 and len(got) >= 4:
                break
            assert time.monotonic() < deadline
    seqs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for b in got:
        for lane, seq in zip(b.lane.tolist(), b.seq.tolist()):
            seqs[(b.node, lane)].append(seq)
    for key, s in seqs.items():
        assert s == list(range(len(s))), f"node/lane {key}: episodes lost or out of order: {s}"
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")


LEARNER = """
import json, sys, time
import ray
sys.path[:0] = {path!r}
from tests.test_ray import collector
ray.init(address={address!r}, include_dashboard=False, log_to_driver=False)
rc = collector()
next(iter(rc))
print(json.dumps([{{k: n.info[k] for k in ("pid", "actor_pids", "names")}} for n in rc.nodes]), flush=True)
time.sleep(600)
"""


def test_the_learner_dying_stops_every_node(cluster: Any) -> None:
    """SIGKILL the learner: Ray's fate-sharing kills the owners, their actors follow, and the shmbuf watchers of the
    owners and of the learner (the owner of its own node's objects) remove every node's shared memory, then exit."""
    code = LEARNER.format(path=sys.path, address=cluster.address)
    learner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = learner.stdout.readline()  # type: ignore[union-attr]  # stdout=PIPE: never None
        assert line, "the learner did not start"
        import json

        info = json.loads(line)
        for i in info:  # each node's owner process (the learner for its own node) and its watcher
            i["watcher_pid"] = watcher_of(i["pid"])
            assert i["watcher_pid"], f"the owner {i['pid']} has no shmbuf watcher"
        assert all(on_shm(i) for i in info)
        learner.send_signal(signal.SIGKILL)
        learner.wait(10)
        wait_until(lambda: all(gone(p) for p in pids_of(info)), 30, "every node's processes to exit after the learner died")
        wait_until(lambda: not any(on_shm(i) for i in info), 10, f"the watchers to remove {[i['names'] for i in info]}")
    finally:
        if learner.poll() is None:
            learner.kill()
        learner.wait(10)
        learner.stdout.close()  # type: ignore[union-attr]  # stdout=PIPE: never None


def test_weights_that_do_not_fit_a_node_are_raised_in_the_learner(cluster: Any) -> None:
    with collector(weights=None) as rc:
        with pytest.raises(RuntimeError, match="has no weight broadcast: pass weights="):
            rc.update_policy_weights(weights(1))
    with collector() as rc:  # the learner's own node publishes at once: refused at once, and no version is spent
        with pytest.raises(shmbuf.SchemaError, match=r"leaf w: expected shape \(1,\), got \(3,\)"):
            rc.update_policy_weights({"w": np.zeros(3)})
        assert rc.policy_version == 0 and rc.update_policy_weights(weights(1)) == 1
    # Through Ray: the owners' refusal comes back later. Version 0 is weights(3): actions W(3), not an untouched policy's 0.
    with collector(local_node=False, weights=weights(3)) as rc:
        it = iter(rc)
        next(it)
        rc.update_policy_weights({"w": np.zeros(3)})  # the broadcast holds w as float64 (1,)
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match=r"could not take weights version 1: ") as raised:
            while time.monotonic() < deadline:
                next(it)
        # The error names the nodes that refused, and its cause is a node's own SchemaError naming leaf, expected, got.
        named = re.match(r"nodes? ([\d, ]+) could not take", str(raised.value))
        assert named and {int(k) for k in named[1].split(", ")} <= {n.index for n in rc.nodes}, str(raised.value)
        cause = raised.value.__cause__
        assert isinstance(cause, shmbuf.SchemaError), f"the cause is {cause!r}, not the node's SchemaError"
        assert "leaf w: expected shape (1,), got (3,)" in str(cause), str(cause)
        # The nodes go on with the weights they had; a new iterator takes up where that one stopped.
        b = next(iter(rc))
        assert b.policy_version.tolist() == [0] * len(b.lane)
        for i, n in enumerate(b.fill["step"].tolist()):
            assert np.all(b.data["step"]["action"][i, :n] == W(3)), np.unique(b.data["step"]["action"][i, :n])
        assert rc.failures == []


class FakeAck:
    """A set_weights call's reference, without a cluster: answered or not, refused (``exc``) or taken."""

    def __init__(self, exc: BaseException | None, done: bool, answers_within_wait: bool = True) -> None:
        self.exc, self.done, self.answers_within_wait = exc, done, answers_within_wait


@pytest.mark.parametrize("second_answers", ["within-the-wait", "after-it"])
def test_weights_refused_by_two_nodes_are_raised_once(monkeypatch: Any, second_answers: str) -> None:
    """Issue 18 item 8: every node refuses weights that do not fit, each at its own moment. The first refusal was
    raised and a refusal answered later was raised again at the learner's next call (test_weights_that_do_not_fit...
    failed once so in a full run, at its next(iter(rc))). Now one error names every node that answered within the
    wait, and no later call raises that version again."""
    def get(ref: FakeAck, *a: Any, **k: Any) -> int:
        if ref.exc is not None:
            raise ref.exc
        return 1

    def wait(refs: list[FakeAck], num_returns: int = 1, timeout: float | None = None, **k: Any) -> tuple[list, list]:
        for r in refs:
            r.done = r.done or (r.answers_within_wait and timeout != 0)
        return [r for r in refs if r.done][:num_returns], [r for r in refs if not r.done]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(_ray_weights, "done", lambda ref: ref.done)
    rc = RayCollector.__new__(RayCollector)
    rc._closed = True  # a shell: nothing to shut down
    nodes = [_ray_node.Node(k, f"n{k}", state="running", incarnation=0) for k in range(3)]
    first = FakeAck(ValueError("leaf w: expected shape (1,), got (3,) on node 0"), done=True)
    second = FakeAck(ValueError("leaf w: expected shape (1,), got (3,) on node 1"), done=False,
                     answers_within_wait=second_answers == "within-the-wait")
    taken = FakeAck(None, done=False)  # node 2 took it
    later = FakeAck(None, done=False)  # the next version, not answered yet
    rc._weight_acks = [(first, nodes[0], 0, 1), (second, nodes[1], 0, 1), (taken, nodes[2], 0, 1),
                       (later, nodes[0], 0, 2)]
    with pytest.raises(RuntimeError) as raised:
        rc._check_acks()
    msg = str(raised.value)
    assert isinstance(raised.value.__cause__, ValueError) and "on node 0" in str(raised.value.__cause__)
    if second_answers == "within-the-wait":
        assert msg.startswith("nodes 0, 1 could not take weights version 1: node 0: ") and "on node 1" in msg, msg
    else:
        assert msg.startswith("node 0 could not take weights version 1: ") and "on node 1" not in msg, msg
    second.done = taken.done = True  # whatever had not answered answers now
    rc._check_acks()  # version 1 was raised once: nothing again
    assert [a[3] for a in rc._weight_acks] == [2], "the next version's call is still followed"
    later.exc, later.done = ValueError("version 2 refused"), True
    with pytest.raises(RuntimeError, match=r"^node 0 could not take weights version 2: version 2 refused"):
        rc._check_acks()
    assert rc._weight_acks == []


def test_a_restart_while_the_learner_publishes_every_batch(cluster: Any) -> None:
    """Weights sent while the owner is down or restarting: it comes back (not declared dead) and takes the latest."""
    with collector(restart=True, max_restarts=2) as rc:
        ledger = Ledger(rc)
        r = remote(rc)
        it = iter(rc)
        ledger.take(next(it))
        ray.kill(rc.nodes[r].owner, no_restart=False)
        deadline = time.monotonic() + 90
        while not (rc.failures and rc.nodes[r].state == "running" and ledger.batches[-1] == r
                   and max(ledger.versions[r]) >= 2):
            ledger.take(next(it))
            rc.update_policy_weights(weights(rc.policy_version + 1))
            assert time.monotonic() < deadline, f"node {r} did not come back: {rc.stats()}"
        assert rc.nodes[r].incarnation == 1 and all(f.node == r and f.restarting for f in rc.failures)
        info = described(rc)
    ledger.check_once()
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "every owner's processes to exit")


@pytest.mark.parametrize("updates", [1, 3])
def test_max_policy_lag_holds_for_every_rollout_from_both_nodes(cluster: Any, updates: int) -> None:
    """max_policy_lag=1 on two nodes: every rollout handed out is at most one version behind the learner's, each once;
    with one update a batch both nodes deliver, given a learner slower than a node's batch (200 ms an update here: at
    20 ms, a soak with two busy loops beside the suite saw the remote node's every batch arrive two versions behind,
    dropped, while the local node kept the learner busy). With 3 updates a batch a batch of the node the learner did
    not take from is 3 versions behind when it arrives: dropped, and counted (the learner's own node may then be the
    only one to deliver: a CI run saw the other's every batch dropped)."""
    with collector(max_policy_lag=1) as rc:
        ledger = Ledger(rc)
        it = iter(rc)
        deadline = time.monotonic() + 90

        def more() -> bool:
            if len(ledger.batches) < 12:
                return True
            return set(ledger.batches) != {0, 1} if updates == 1 else rc.stats()["stale_dropped"] == 0

        while more():
            ledger.take(next(it))  # checks each rollout's lag against the learner's version
            time.sleep(0.2 if updates == 1 else 0.06)
            for _ in range(updates):
                rc.update_policy_weights(weights(rc.policy_version + 1))
            assert time.monotonic() < deadline, f"batches {ledger.batches}, {rc.stats()}"
        stats = rc.stats()
    ledger.check_once()
    assert ledger.lag_max is not None and ledger.lag_max <= 1 and stats["max_policy_lag"] == 1


def test_a_lag_below_the_nodes_but_one_is_refused_naming_both(cluster: Any) -> None:
    with pytest.raises(shmbuf.UsageError, match=r"max_policy_lag=0\) with 2 nodes: .*max_policy_lag >= 1"):
        collector(max_policy_lag=0)


def test_ready_timeout_covers_the_actor_processes_and_leaves_nothing(cluster: Any) -> None:
    """Actors that take 60 s to start: the constructor gives up after ready_timeout, and every owner is cleaned up."""
    before = shm_objects()
    t0 = time.monotonic()
    with pytest.raises(shmbuf.SlotTimeout, match="did not start within ready_timeout=3"):
        collector(ready_timeout=3, create_env_kwargs={"slow_start": 60.0})
    assert time.monotonic() - t0 < 3 + 15
    # The owners were killed (after their stop timed out): their shmbuf watchers remove what they had made.
    wait_until(lambda: not [e for e in shm_objects() - before if _owner_is_dead_or_ours(e)], 20,
               "the owners' shared memory to be removed")


def _owner_is_dead_or_ours(entry: str) -> bool:
    """An object of ours: its owner is dead (a killed node owner's), or it is gone already."""
    from shmbuf import _admin

    return any(f.removable and (entry == f.name[1:] or entry in f.semaphores) for f in _admin.scan())
