"""RayCollector with multi-agent envs on a local two-node Ray cluster: every agent's steps once from both nodes,
weights, versions and lag per policy, a restarted owner that waits for every policy's current weights, complete
episodes, aligned batches, and the checks on what a node sends.

The env and policies live here, at module level, so that the node owners (and their forkserver actors) import
them as ``tests.test_ray_multiagent`` (see tests/test_ray.py, whose cluster, tests/conftest.py's, this module shares).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra (make test installs it)")
pettingzoo = pytest.importorskip("pettingzoo", reason="the `multiagent` extra (make test installs it)")

import shmbuf  # noqa: E402  (after the importorskips above)
from tests.conftest import wait_until  # noqa: E402  (same)
from tests.helpers import OnceLedger, described, gone, on_shm, pids_of, remote  # noqa: E402  (after the importorskip above)
from workers import MultiAgentBatch, RayCollector, _ray, _ray_multiagent, _ray_wire  # noqa: E402  # they import ray

pytestmark = pytest.mark.usefixtures("cluster")  # the suite's two-node cluster (tests/conftest.py), shared with test_ray

AGENTS = ["red_0", "red_1", "blue_0"]
T = 4  # env steps per round
JOINS, LEAVES, LENGTH = 2, 5, 9  # red_1 acts from step 2 to step 5 of each 9-step episode
BASE = {"red": 100, "blue": 200}  # a policy's action under weights version v: BASE + v


class CountingEnv(pettingzoo.ParallelEnv):
    """Red agents see ``[uid, g, k]`` (float64), blue ``[uid, g, k, 1]`` (float64, another shape): ``uid`` names the env
    instance, ``g`` counts its env steps over its whole life, so an agent step delivered twice shows. red_1 joins and
    leaves within every episode."""

    metadata = {"name": "counting_v0"}

    def __init__(self, step_sleep: float = 0.0005):
        self.possible_agents = list(AGENTS)
        self.uid = float(np.random.default_rng().integers(1, 2**40))
        self.step_sleep = step_sleep
        self.g = self.t = 0
        self.agents: list[str] = []

    def observation_space(self, agent: str) -> gym.spaces.Box:
        return gym.spaces.Box(-np.inf, np.inf, (3,) if agent.startswith("red") else (4,), np.float64)

    def action_space(self, agent: str) -> gym.spaces.Discrete:
        return gym.spaces.Discrete(1000)

    def _obs(self, agent: str) -> np.ndarray:
        o = [self.uid, self.g, AGENTS.index(agent)]
        return np.array(o if agent.startswith("red") else o + [1.0], np.float64)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t = 0
        self.agents = ["red_0", "blue_0"]
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        time.sleep(self.step_sleep)
        self.t += 1
        self.g += 1
        end = self.t >= LENGTH
        term = {a: a == "red_1" and self.t == LEAVES for a in actions}
        trunc = {a: end and not term[a] for a in actions}
        obs = {a: self._obs(a) for a in actions}
        self.agents = [a for a in self.agents if not (term[a] or trunc[a])]
        if self.t == JOINS:
            self.agents.append("red_1")
            obs["red_1"] = self._obs("red_1")
        return obs, {a: 1.0 for a in actions}, term, trunc, {a: {} for a in actions}


class Versioned:
    """Every action is ``base + v``, ``v`` the weights' version number: a rollout shows the weights it was taken with."""

    def __init__(self, base: int):
        self.base, self.v = base, 0

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return np.full(len(obs), self.base + self.v, np.int64)

    def load_weights(self, params: dict[str, np.ndarray]) -> None:
        self.v = int(params["v"])


def team(agent_id: str, episode: Any = None, **kwargs: Any) -> str:
    return agent_id.split("_")[0]


def weights(v: int) -> dict[str, np.ndarray]:
    return {"v": np.array(v)}


def collector(**kw: Any) -> RayCollector:
    args: dict[str, Any] = dict(policy_mapping_fn=team, frames_per_batch=2 * T, rollout_len=T, actors_per_node=1,
                                weights={"red": weights(0), "blue": weights(0)}, timeout=60, stop_timeout=5.0)
    args.update(kw)
    return RayCollector(CountingEnv, {pid: Versioned(b) for pid, b in BASE.items()}, **args)


class Ledger(OnceLedger):
    """Every delivered policy rollout, checked as it comes: each (node, incarnation, policy, lane, epoch, seq) and each
    agent's env step at most once (test_ray's check, keyed by policy and agent too); actions match the version each
    rollout says it was taken with; lag per policy."""

    def __init__(self, rc: RayCollector) -> None:  # the base's fields, keyed by policy and agent too (not its __init__)
        self.rc = rc
        self.seqs: dict[tuple, list[int]] = defaultdict(list)
        self.steps: dict[tuple[float, str], list[np.ndarray]] = defaultdict(list)
        self.versions: dict[tuple[int, str], set[int]] = defaultdict(set)  # (node, policy) -> versions seen
        self.nodes: list[int] = []

    def take(self, b: Any) -> None:
        assert isinstance(b, MultiAgentBatch) and isinstance(b, _ray_multiagent.RayMultiAgentBatch)
        self.nodes.append(b.node)
        for pid, x in b.items():
            assert isinstance(x, _ray.RayBatch) and x.node == b.node
            step = x.data["step"]
            obs, act, valid = step["obs"], step["action"], step["valid"]
            assert obs.shape[1:] == (T, 2 if pid == "red" else 1, 3 if pid == "red" else 4)
            lag = [self.rc.policy_versions[pid] - v for v in x.policy_version.tolist()]
            assert x.policy_lag.tolist() == lag, (pid, x.policy_lag, x.policy_version, self.rc.policy_versions)
            for i, (lane, epoch, seq, v) in enumerate(zip(x.lane.tolist(), x.epoch.tolist(), x.seq.tolist(),
                                                          x.policy_version.tolist())):
                self.seqs[(b.node, b.incarnation, pid, lane, epoch)].append(seq)
                self.versions[(b.node, pid)].add(v)
                n = int(x.fill["step"][i])
                ok = valid[i, :n]
                assert np.all(act[i, :n][ok] == BASE[pid] + v), f"{pid} rollout of version {v}: {act[i, :n][ok]}"
                for row in range(obs.shape[2]):
                    live = ok[:, row]
                    if live.any():
                        o = obs[i, :n, row][live]
                        self.steps[(float(o[0, 0]), AGENTS[int(o[0, 2])])].append(o[:, 1].copy())

    def check_once(self) -> None:
        super().check_once()
        assert {a for _, a in self.steps} == set(AGENTS)


@pytest.mark.parametrize("local_node", [True, False], ids=["learners-node-in-process", "every-node-through-ray"])
def test_every_agents_steps_once_from_both_nodes_with_weights_and_lag_per_policy(local_node: bool) -> None:
    """Both nodes deliver every policy's rollouts, no agent step twice; red's update reaches both nodes while blue
    stays at version 0; each rollout's lag is the learner's version of its own policy minus its own; clean exit."""
    with collector(local_node=local_node) as rc:
        ledger = Ledger(rc)
        info = described(rc)
        assert all(on_shm(i) for i in info) and all(len(i["names"]) == 4 for i in info)  # 2 pipelines, 2 broadcasts
        assert rc.rows.policies["red"] == [(0, "red_0"), (0, "red_1")]
        deadline = time.monotonic() + 60
        for k, b in enumerate(rc):
            ledger.take(b)
            assert b.env_steps == 2 * T and b.agent_steps == int(sum(x.data["step"]["valid"].sum() for x in b.values()))
            if k == 2:
                assert rc.update_policy_weights({"red": weights(1)}) == {"red": 1}
                assert rc.policy_versions == {"red": 1, "blue": 0}
            if k > 2 and all(1 in ledger.versions[(n, "red")] for n in (0, 1)) and len(ledger.nodes) >= 10:
                break
            assert time.monotonic() < deadline, f"red's version 1 did not reach both nodes: {dict(ledger.versions)}"
        stats = rc.stats()
    ledger.check_once()
    assert {0, 1} <= set(ledger.nodes)
    assert all(ledger.versions[(n, "blue")] == {0} for n in (0, 1))
    assert stats["policy_versions"] == {"red": 1, "blue": 0} and stats["failures"] == []
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "the owners, their actors and watchers to exit")
    wait_until(lambda: not any(on_shm(i) for i in info), 10, "the nodes' shared memory to go")


def test_a_restarted_owner_collects_with_every_policys_current_weights() -> None:
    """Kill the other node's owner after red reached version 2: Ray restarts it with its first arguments, and its first
    rollouts are already red's version 2 and blue's version 0 (never updated: the weights it started from)."""
    with collector(restart=True, max_restarts=1) as rc:
        ledger = Ledger(rc)
        r = remote(rc)
        it = iter(rc)
        rc.update_policy_weights({"red": weights(1)})
        rc.update_policy_weights({"red": weights(2)})
        deadline = time.monotonic() + 60
        while 2 not in ledger.versions[(r, "red")]:
            assert time.monotonic() < deadline, f"node {r} never delivered red's version 2: {dict(ledger.versions)}"
            ledger.take(next(it))
        before = described(rc)[r]
        ray.kill(rc.nodes[r].owner, no_restart=False)
        reborn: dict[str, set[int]] = defaultdict(set)
        batches = 0
        while batches < 3:
            assert time.monotonic() < deadline + 60, f"node {r} did not come back: {rc.stats()}"
            b = next(it)
            ledger.take(b)
            if b.node == r and b.incarnation == 1:
                batches += 1
                for pid, x in b.items():
                    reborn[pid] |= set(x.policy_version.tolist())
        assert rc.failures and rc.failures[0].restarting
        assert dict(reborn) == {"red": {2}, "blue": {0}}, dict(reborn)
        info = described(rc)
    ledger.check_once()
    wait_until(lambda: all(gone(p) for p in pids_of(info) + pids_of([before])), 20, "every owner's processes to exit")


def test_complete_episodes_and_aligned_batches_come_through_ray() -> None:
    """Complete episodes: each agent's whole episodes, once per (node, policy, lane, seq), lengths as the env makes
    them. Aligned batches from the other node: agents() lines every agent up on the learner's rows."""
    with collector(batch_mode="complete_episodes", count_steps_by="agent_steps", rollout_len=LENGTH,
                   frames_per_batch=3 * LENGTH) as rc:
        seen: dict[tuple, list[int]] = defaultdict(list)
        nodes = set()
        deadline = time.monotonic() + 60
        for b in rc:
            nodes.add(b.node)
            for pid, x in b.items():
                for ln in x.episode_lengths.tolist():
                    assert ln == (LEAVES - JOINS if pid == "red" and ln != LENGTH else LENGTH), (pid, ln)
                for lane, seq in zip(x.lane.tolist(), x.seq.tolist()):
                    seen[(b.node, pid, lane)].append(seq)
            if nodes == {0, 1} and sum(map(len, seen.values())) >= 24:
                break
            assert time.monotonic() < deadline, f"not both nodes in 60 s: {nodes}"
    for key, s in seen.items():
        assert s == list(range(len(s))), f"{key}: agent episodes lost or out of order: {s}"
    with collector(align=True, local_node=False) as rc:
        b = next(iter(rc))
        lined = b.agents("obs")
        assert set(lined) == {(0, a) for a in AGENTS}
        g = {who: obs[..., 1] for who, (obs, _) in lined.items()}
        valid = {who: v for who, (_, v) in lined.items()}
        both = valid[(0, "red_0")] & valid[(0, "blue_0")]
        assert both.any() and np.array_equal(g[(0, "red_0")][both], g[(0, "blue_0")][both])  # the same env steps


def test_dict_observations_come_through_ray_as_each_nodes_env_returned_them() -> None:
    """PettingZoo classic's observation + action_mask (tests.test_multiagent_dict's env: a Dict for the players, a
    Tuple for a scout that joins later) from both nodes through Ray objects: every stored row of every lane, read back
    in sequence order, is the plain loop's."""
    from tests.helpers_masked import POLICIES, MaskedEnv, plain_streams
    from tests.helpers_masked import team as masked_team
    from tests.helpers_multiagent import assert_same_streams, stored_streams

    per_lane: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    with RayCollector(MaskedEnv, POLICIES, policy_mapping_fn=masked_team, frames_per_batch=2 * T, rollout_len=T,
                      actors_per_node=1, timeout=60, stop_timeout=5.0, local_node=False) as rc:
        info = described(rc)
        deadline = time.monotonic() + 60
        for b in rc:
            for pid, x in b.items():
                obs = x.data["step"]["obs"]
                assert isinstance(obs, dict) if pid == "player" else isinstance(obs, tuple), (pid, type(obs))
                for i in range(len(x.seq)):
                    per_lane[(b.node, int(x.lane[i]))][pid].append(
                        {"seq": int(x.seq[i]), "fill": {k: int(v[i]) for k, v in x.fill.items()},
                         "data": rollout_copy(x.data, i)})
            if {n for n, _ in per_lane} == {0, 1} and all(len(v["player"]) >= 3 for v in per_lane.values()):
                break
            assert time.monotonic() < deadline, f"not both nodes' rollouts in 60 s: {sorted(per_lane)}"
        rows = rc.rows
    for key, out in per_lane.items():
        seqs = sorted(r["seq"] for r in out["player"])
        n = next((k for k, q in enumerate(seqs) if q != k), len(seqs))  # the rounds from the first, none missing
        assert n >= 1, (key, seqs)  # (a call the learner had in flight at the break may hold a later round)
        rounds = {pid: [r for r in v if r["seq"] < n] for pid, v in out.items()}
        assert all(len(v) == n for v in rounds.values()), key  # every policy commits one rollout per round
        got = stored_streams(rounds, rows)
        want = plain_streams(1, n * T)
        assert all(len(got[k]) == len(want[k]) for k in got), key
        assert_same_streams(got, want)
    wait_until(lambda: all(gone(p) for p in pids_of(info)), 20, "the owners, their actors and watchers to exit")
    wait_until(lambda: not any(on_shm(i) for i in info), 10, "the nodes' shared memory to go")


def rollout_copy(tree: Any, i: int) -> Any:
    """Rollout ``i`` of a batch's tree, its own copy."""
    import optree

    return optree.tree_map(lambda a: np.array(a[i]), tree)


def swapping(agent_id: str, episode: Any) -> str:
    """Blue plays blue; red agents alternate between red and red2, episode by episode (a per-episode mapping)."""
    return "blue" if agent_id.startswith("blue") else ("red", "red2")[episode.count % 2]


def test_a_per_episode_mapping_comes_through_ray_with_the_rows_the_learner_rebuilds() -> None:
    """remap_each_episode on the other node: the learner rebuilds every policy's rows (all agents in each) and accepts
    the node's; both red policies get red_0's steps."""
    policies = {"red": Versioned(100), "red2": Versioned(300), "blue": Versioned(200)}
    with RayCollector(CountingEnv, policies, policy_mapping_fn=swapping, remap_each_episode=True, frames_per_batch=4 * T,
                      rollout_len=2 * T, actors_per_node=1, local_node=False, timeout=60) as rc:
        assert rc.rows.remap and all(len(r) == 3 for r in rc.rows.policies.values())
        got = {pid: 0 for pid in policies}
        it = iter(rc)
        deadline = time.monotonic() + 60
        while not (got["red"] and got["red2"]):
            assert time.monotonic() < deadline, got
            b = next(it)
            for pid, x in b.items():
                row = rc.rows.policies[pid].index((0, "red_0"))
                got[pid] += int(x.data["step"]["valid"][:, :, row].sum())
        assert got["blue"] == 0  # red_0 never plays blue


def test_policies_not_trained_stay_on_their_node_and_still_take_weights() -> None:
    """policies_to_train=["red"] through an owner: batches hold red only, and blue, which acts on the node, takes an
    update (its broadcast is described even though its rollouts are not)."""
    with collector(policies_to_train=["red"], local_node=False) as rc:
        it = iter(rc)
        assert set(next(it)) == {"red"}
        assert rc.update_policy_weights({"blue": weights(1)}) == {"blue": 1}
        assert set(next(it)) == {"red"} and rc.policy_versions == {"red": 0, "blue": 1}


def test_multiagent_usage_errors_name_the_setting() -> None:
    with pytest.raises(shmbuf.UsageError, match=r"policies: policy id \('red', 1\): .*expected a str or an int, got tuple"):
        RayCollector(CountingEnv, {("red", 1): Versioned(0)}, frames_per_batch=2 * T, rollout_len=T)
    with pytest.raises(shmbuf.UsageError, match=r"take policies= .*not policy/policy_factory/create_env_kwargs"):
        RayCollector(CountingEnv, Versioned(0), policies={"red": Versioned(0)}, frames_per_batch=2 * T)
    with collector(nodes=[ray.get_runtime_context().get_node_id()]) as rc:
        with pytest.raises(shmbuf.UsageError, match=r"\['green'\] are not policies of this collector"):
            rc.update_policy_weights({"green": weights(1)})
        with pytest.raises(shmbuf.UsageError, match=r"version=.*count per policy"):
            rc.update_policy_weights({"red": weights(1)}, version=5)
        assert rc.policy_versions == {"red": 0, "blue": 0}


def test_a_malformed_multiagent_batch_is_refused_naming_the_policy() -> None:
    """What a node sends is checked against every policy's schema: the outer header, the policies it names, and each
    policy's batch leaf by leaf."""
    from workers._multiagent import multiagent_examples

    env = CountingEnv()
    examples, _ = multiagent_examples([env], {pid: Versioned(b) for pid, b in BASE.items()}, team, rollout_len=T)
    schemas = {pid: shmbuf.Schema.from_example(ex) for pid, ex in examples.items()}

    def part(schema: shmbuf.Schema, obs_shape: tuple | None = None) -> tuple[bytes, list[np.ndarray]]:
        arrays = [np.zeros((1, *(obs_shape if obs_shape and lf.name == "step/obs" else lf.shape)), lf.dtype)
                  for ts in schema.timescales for lf in ts.leaves]
        arrays += [np.zeros(1, np.int64) for _ in schema.timescales]
        arrays += [np.zeros(1, np.int64) for _ in _ray_wire.META] + [np.zeros(0), np.zeros(0, np.int64)]
        return msgpack.packb({"magic": _ray_wire.WIRE_MAGIC, "version": _ray_wire.WIRE_VERSION, "frames": T,
                              "fill": True}), arrays

    def head(**kw: Any) -> bytes:
        fields = {"magic": _ray_wire.WIRE_MAGIC, "version": _ray_wire.WIRE_VERSION, "multiagent": True,
                  "policies": ["red", "blue"], "frames": T, "env_steps": T, "agent_steps": 3 * T, **kw}
        return msgpack.packb(fields)

    def unpack(got: Any) -> Any:
        return _ray_wire.unpack_multiagent_batch(got, schemas, "truncate_episodes", False, "a batch from node 1")

    good = [part(schemas["red"]), part(schemas["blue"])]
    w = unpack((head(), good))
    assert w.policies["blue"].data["step"]["obs"].shape == (1, T, 1, 4) and w.agent_steps == 3 * T
    with pytest.raises(shmbuf.SchemaError, match=r"policy 'blue', leaf step/obs: expected float64 \(1, 4, 1, 4\), got "
                                                 r"float64 \(1, 4, 1, 3\)"):
        unpack((head(), [good[0], part(schemas["blue"], (T, 1, 3))]))
    with pytest.raises(shmbuf.SchemaError, match=r"policies \['red', 'green'\] with 2 batches; expected distinct"):
        unpack((head(policies=["red", "green"]), good))
    with pytest.raises(shmbuf.SchemaError, match=r"policies \['red', 'blue'\] with 1 batches"):
        unpack((head(), good[:1]))
    with pytest.raises(shmbuf.SchemaError, match=r"expected a multi-agent header"):
        unpack((head(agent_steps=-1), good))
    with pytest.raises(shmbuf.SchemaError, match=r"expected \(header, list of policy batches\)"):
        unpack((head(),))
