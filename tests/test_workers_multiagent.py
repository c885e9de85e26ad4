"""workers' multi-agent loop against a plain PettingZoo loop: agents that join and leave, two policies of different
shapes, per-agent streams, env and agent step counting."""

from __future__ import annotations

import os
import time
from functools import partial

import numpy as np
import optree
import pytest

pettingzoo = pytest.importorskip("pettingzoo")

import shmbuf  # noqa: E402  # after the importorskip: the module needs pettingzoo
from tests.helpers_multiagent import (  # noqa: E402  # after the importorskip: the module needs pettingzoo
    AGENTS,
    LEAGUE,
    POLICIES,
    JoinLeaveEnv,
    Scaled,
    assert_same_streams,
    blue_policy,
    league,
    mapping,
    plain_streams,
    red_policy,
    run_loop,
    stored_streams,
)
from workers._agent_rows import AgentRows, Episode  # noqa: E402  # same
from workers._multiagent import multiagent_examples  # noqa: E402  # same


def test_rows_are_fixed_per_env_and_agent_and_grouped_by_policy():
    rows = AgentRows(AGENTS, 2, mapping)
    assert rows.policies == {"red": [(0, "red_0"), (0, "red_1"), (1, "red_0"), (1, "red_1")],
                             "blue": [(0, "blue_0"), (1, "blue_0")]}
    assert rows.where[(1, "red_1")] == ("red", 3)


@pytest.mark.parametrize("n_envs", [1, 2])
def test_stored_agent_streams_equal_a_plain_pettingzoo_loop(n_envs):
    """Every agent's stored transitions (obs, action, reward, flags, successor, the policy's extra) equal the plain
    loop's, through agents joining (red_1 at step 2), leaving (terminated at 5), episode ends and rollout ends."""
    rounds, T = 12, 4
    out, rows, loop = run_loop(n_envs, rounds, rollout_len=T)
    got = stored_streams(out, rows)
    want = plain_streams(n_envs, rounds * T)
    assert set(got) == set(want)  # every agent of every env acted, red_1 too
    for key in want:
        assert len(got[key]) == len(want[key]), key  # the same env steps: every transition stored, none invented
    assert_same_streams(got, want)
    assert loop.env_steps == rounds * T * n_envs
    assert loop.agent_steps == sum(len(s) for s in want.values())
    # The shapes are each policy's own: red (3,) float64, blue (5,) float32 with its extra.
    assert out["red"][0]["data"]["step"]["obs"].shape == (T, 2 * n_envs, 3)
    assert out["blue"][0]["data"]["step"]["obs"].dtype == np.float32
    assert out["blue"][0]["data"]["step"]["value"].shape == (T, n_envs)


def test_episode_records_carry_each_agents_own_return_length_and_end():
    out, rows, _ = run_loop(1, 10, rollout_len=4)
    want = plain_streams(1, 40)
    records = []
    for pid, rollouts in out.items():
        for r in rollouts:
            ep, m = r["data"]["episode"], r["fill"]["episode"]
            records += [(rows.policies[pid][int(ep["env"][k])][1], float(ep["return"][k]), int(ep["length"][k]),
                         bool(ep["terminated"][k]), bool(ep["truncated"][k])) for k in range(m)]
    expected = []
    for (_, agent), stream in want.items():
        ret, n = 0.0, 0
        for tr in stream:
            ret += float(np.float64(tr["reward"]))  # the loop sums the env's float64 rewards
            n += 1
            if tr["terminated"] or tr["truncated"]:
                expected.append((agent, n, tr["terminated"], tr["truncated"]))
                ret, n = 0.0, 0
    assert sorted((a, n, te, tr) for a, _, n, te, tr in records) == sorted(expected)
    assert any(a == "red_1" and te for a, _, _, te, _ in records)  # the agent that left, terminated
    assert all(r > 0 for _, r, _, _, _ in records)


def test_counting_agent_steps_ends_a_round_once_the_agents_steps_reach_rollout_len():
    T = 6
    out, _, loop = run_loop(1, 8, rollout_len=T, count_steps_by="agent_steps")
    fills = [r["fill"]["step"] for r in out["red"]]
    assert fills == [r["fill"]["step"] for r in out["blue"]]  # one round: the same env steps for every policy
    for red, blue in zip(out["red"], out["blue"], strict=True):
        n = red["fill"]["step"]
        per_step = red["data"]["step"]["valid"][:n].sum(1) + blue["data"]["step"]["valid"][:n].sum(1)
        assert per_step.sum() >= T and per_step[:-1].sum() < T  # RLlib's check after each env step
    assert max(fills) < T  # two or three agents a step: never the T env steps of env-step counting
    got = stored_streams(out, loop.rows)
    assert_same_streams(got, plain_streams(1, sum(fills)))


def test_a_policy_the_mapping_names_but_policies_lacks_is_refused_by_name():
    with pytest.raises(shmbuf.UsageError, match=r"maps agents to \['blue'\], which policies= does not have"):
        multiagent_examples([JoinLeaveEnv()], {"red": red_policy}, mapping, rollout_len=4)


class BadObsEnv(JoinLeaveEnv):
    def step(self, actions):
        obs, *rest = super().step(actions)
        if "blue_0" in obs:
            obs["blue_0"] = obs["blue_0"][:3]
        return (obs, *rest)


def test_an_observation_of_another_shape_is_refused_naming_the_agent():
    with pytest.raises(shmbuf.SchemaError, match=r"agent 'blue_0'.s observation: expected shape \(5,\)"):
        run_loop(1, 2, envs=[BadObsEnv(0)])


# -- the collector: actor processes, one pipeline per policy ---------------------------------------------------------


def collect_batches(n, *, every_lane=False, **kw):
    """``n`` batches from two actors (env 0 and env 1); ``every_lane``: and more, until both actors' rollouts of both
    policies came (a batch takes whichever rollouts are ready: one actor slow to start can fill the first ones)."""
    from workers._multiagent_collector import MultiAgentCollector

    batches = []
    deadline = time.monotonic() + 60
    with MultiAgentCollector([partial(JoinLeaveEnv, 0), partial(JoinLeaveEnv, 1)], POLICIES, policy_mapping_fn=mapping,
                             frames_per_batch=16, copy=True, timeout=60, **kw) as c:
        for b in c:
            batches.append(b)
            lanes = {(pid, int(lane)) for x in batches for pid, y in x.items() for lane in y.lane}
            if len(batches) >= n and (not every_lane or len(lanes) == 4):
                break
            assert time.monotonic() < deadline, f"not every actor's rollouts of every policy in 60 s: {sorted(lanes)}"
        stats = c.stats()
    return batches, c, stats


def test_the_collector_delivers_every_policys_rollouts_once_as_a_plain_loop_makes_them():
    """Two actors (env 0 and env 1), two policies: each batch has both policies' rollouts, each rollout once, and
    each actor's agent streams, read back in sequence order, equal the plain PettingZoo loop's."""
    batches, c, stats = collect_batches(6, every_lane=True)
    n = len(batches)
    assert c.rollout_len == 8 and c.rounds_per_batch == 2  # 16 env steps a batch: one round of 8 steps per actor
    assert [b.env_steps for b in batches] == [16] * n and stats["env_steps"] == 16 * n
    per_lane = {}
    for b in batches:
        assert set(b) == {"red", "blue"}
        assert b["red"].data["step"]["obs"].shape == (2, 8, 2, 3) and b["blue"].data["step"]["value"].shape == (2, 8, 1)
        assert b.agent_steps == sum(int(x.data["step"]["valid"].sum()) for x in b.values())
        for pid, x in b.items():
            for i in range(len(x.seq)):
                data = optree.tree_map(lambda a, i=i: a[i], x.data)
                fill = {"step": int(x.fill["step"][i]), "episode": int(x.fill["episode"][i])}
                # Which actor made it: the env it steps, which row 0's first observation names ([env, agent, t]: red_0
                # and blue_0 act at every step). Not the lane: lanes are numbered per pipeline, in the order the
                # actors attach to it, and the two actors may attach to red's and blue's pipelines in other orders.
                env_id = int(np.asarray(data["step"]["obs"])[0, 0, 0])
                per_lane.setdefault((pid, env_id), []).append((int(x.lane[i]), int(x.epoch[i]), int(x.seq[i]), data, fill))
    keys = [(pid, lane, e, s) for (pid, _), rs in per_lane.items() for lane, e, s, _, _ in rs]
    assert len(keys) == len(set(keys)) == 2 * n * 2  # exactly once: 2 policies x n batches x 2 rollouts
    for (pid, env_id), rs in per_lane.items():
        assert len({lane for lane, *_ in rs}) == 1, (pid, env_id)  # one actor's rollouts come through one lane
    env_ids = sorted({env_id for _, env_id in per_lane})
    assert env_ids == [0, 1]
    for env_id in env_ids:
        out = {pid: [{"seq": s, "fill": f, "data": d}
                     for _, _, s, d, f in sorted(per_lane[(pid, env_id)], key=lambda r: r[2])]
               for pid in ("red", "blue")}
        n_rounds = min(len(v) for v in out.values())
        assert [r["seq"] for r in out["red"][:n_rounds]] == list(range(n_rounds))  # from the start, none missing
        assert [r["seq"] for r in out["blue"][:n_rounds]] == list(range(n_rounds))
        got = stored_streams({pid: v[:n_rounds] for pid, v in out.items()}, c.rows)
        want = plain_streams(1, n_rounds * 8, env_ids=[env_id])
        assert set(got) == set(want)
        assert all(len(got[k]) == len(want[k]) for k in want)  # every transition of those rounds, none invented
        assert_same_streams(got, want)


def test_each_policy_takes_its_own_weights_and_carries_its_own_version():
    """Weights per policy: red's broadcast moves red's version and actions (scale 2 doubles them); blue has none, and
    an update for it is refused by name."""
    from workers import MultiAgentCollector

    policies = {"red": Scaled(1), "blue": blue_policy}
    with MultiAgentCollector([partial(JoinLeaveEnv, 0)] * 2, policies, policy_mapping_fn=mapping, frames_per_batch=16,
                             weights={"red": {"scale": np.array(1)}}, copy=True, timeout=60, start_method="fork") as c:
        it = iter(c)
        first = next(it)
        assert first["red"].policy_version.tolist() == [0, 0]
        assert c.update_policy_weights({"red": {"scale": np.array(2)}}) == {"red": 1}
        with pytest.raises(shmbuf.StateError, match="policy 'blue' has no weight broadcast"):
            c.update_policy_weights({"blue": {}})
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "no rollout of red with version 1 in 60 s"
            b = next(it)
            red = b["red"]
            if (red.policy_version == 1).any():
                break
        i = int(np.flatnonzero(red.policy_version == 1)[0])
        st = red.data["step"]
        v = st["valid"][i]
        assert np.array_equal(st["action"][i][v], 2 * red_policy(st["obs"][i][v]))  # the new weights acted
        assert red.policy_lag[i] == 0 and (b["blue"].policy_version == 0).all()


def test_every_policys_rollouts_arrive_once_across_an_actor_kill_and_restart():
    """Actor 0 SIGKILLed and restarted: per policy, (lane, epoch, seq) never names two rollouts, and each claim's
    seqs run from 0 without a gap (the dead actor's committed rollouts are delivered, none twice)."""
    import os
    import signal
    from collections import Counter

    from workers import MultiAgentCollector

    keys = {"red": [], "blue": []}
    with MultiAgentCollector([partial(JoinLeaveEnv, 0), partial(JoinLeaveEnv, 1)], POLICIES, policy_mapping_fn=mapping,
                             frames_per_batch=8, rollout_len=4, restart=True, start_method="fork", timeout=30,
                             copy=True) as c:
        it = iter(c)
        deadline = time.monotonic() + 60

        def take():
            # What a stall needs to be told apart: a replacement that never started (failures), or one starved of
            # slots (each pipeline's slots, and what each lane was lent: its writers' pids and commits).
            assert time.monotonic() < deadline, (f"stalled: {c.stats()}, failures {c.failures}, pids {c.pool.pids}, "
                                                 f"slots {({k: r.stats()['slots'] for k, r in c.readers.items()})}, "
                                                 f"delivered per (lane, epoch) "
                                                 f"{({k: Counter((ln, e) for ln, e, _ in v) for k, v in keys.items()})}")
            b = next(it)
            for pid, x in b.items():
                keys[pid] += zip(x.lane.tolist(), x.epoch.tolist(), x.seq.tolist())

        while len({ln for ln, _, _ in keys["red"]}) < 2:
            take()
        victim = c.pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        while any(len({(ln, e) for ln, e, _ in ks}) < 3 or len(ks) < 24 for ks in keys.values()):
            take()  # until every policy has rollouts of the replacement's claim, and a few more
        assert c.stats()["actor_restarts"] == 1
    for pid, ks in keys.items():
        assert len(ks) == len(set(ks)), f"{pid}: a rollout delivered twice"
        claims = {}
        for lane, epoch, seq in ks:
            claims.setdefault((lane, epoch), []).append(seq)
        assert len(claims) >= 3, (pid, claims.keys())  # two lanes, and the replacement's new claim
        for claim, seqs in claims.items():
            assert sorted(seqs) == list(range(len(seqs))), (pid, claim, sorted(seqs))


def test_the_docs_block_prints_each_policys_rows_and_both_counts(tmp_path):
    """docs/multiagent.md's block, as written: 6 chasers (26 numbers each) and 2 runners (24) in two pipelines."""
    from tests.helpers import doc_blocks, run_doc_block

    assert len(doc_blocks("multiagent.md")) >= 1  # block 0; the postprocessing block is run by test_multiagent_postprocess.py
    lines = run_doc_block("multiagent.md", 0, tmp_path).splitlines()
    batch = ["chaser (2, 50, 6, 26) 600 agent steps", "runner (2, 50, 2, 24) 200 agent steps",
             "100 env steps, 800 agent steps"]
    assert lines == batch * 2 + ["[(0, 'agent_0'), (0, 'agent_1')]"]


@pytest.mark.parametrize(("kw", "says"), [({}, "give exactly one of policies"),
                                          ({"policies": POLICIES, "serve": True, "view_requirements": {"red": {}}},
                                           "view_requirements= with serve=True"),
                                          ({"policies": POLICIES, "policy_factories": {"red": Scaled}},
                                           "give exactly one of policies"),
                                          ({"policy_factories": {"red": Scaled, "blue": 3}},
                                           r"policy_factories: expected zero-argument callables, got none for \['blue'\]")])
def test_the_collector_takes_policies_or_their_factories_and_says_which_is_wrong(kw, says):
    from workers import MultiAgentCollector

    with pytest.raises(shmbuf.UsageError, match=says):
        MultiAgentCollector(partial(JoinLeaveEnv, 0), policy_mapping_fn=mapping, frames_per_batch=16, **kw)


class NoRewardEnv(JoinLeaveEnv):
    def step(self, actions):
        obs, rew, *rest = super().step(actions)
        rew.pop("blue_0", None)
        return (obs, rew, *rest)


class SilentEnv(JoinLeaveEnv):
    def step(self, actions):
        obs, *rest = super().step(actions)
        if self.t == 1:
            obs.pop("red_0")
        return (obs, *rest)


class StrangerEnv(JoinLeaveEnv):
    def step(self, actions):
        obs, *rest = super().step(actions)
        obs["green_0"] = obs["red_0"]
        return (obs, *rest)


@pytest.mark.parametrize(("env", "says"), [
    (NoRewardEnv, "expected a reward, a termination and a truncation for every agent that acted, got none for 'blue_0'"),
    (SilentEnv, "agent 'red_0' goes on without an observation"),
    (StrangerEnv, "agent 'green_0' is not in the env's possible_agents"),
])
def test_an_env_that_breaks_the_parallel_api_is_named_with_the_agent(env, says):
    with pytest.raises(shmbuf.UsageError, match=says):
        run_loop(1, 2, envs=[env(0)])


def test_complete_episodes_hold_each_agents_whole_episode_as_a_plain_loop_makes_it():
    """batch_mode='complete_episodes': each rollout is one agent's episode, from its first step (red_1: from its join)
    to its end, with its own record and bootstrap; read back per agent in commit order they equal the plain loop's."""
    out, rows, loop = run_loop(2, 30, rollout_len=12, batch_mode="complete_episodes")
    want = plain_streams(2, 60)
    got = {}
    for pid, rollouts in out.items():
        assert "valid" not in rollouts[0]["data"]["step"]  # every stored step is the agent's
        for r in sorted(rollouts, key=lambda r: (r["lane"], r["seq"])):
            d, n = r["data"], r["fill"]["step"]
            key = rows.policies[pid][int(d["episode"]["env"])]
            st = d["step"]
            assert bool(st["terminated"][n - 1] or st["truncated"][n - 1])  # it ends where its episode ends
            assert not (st["terminated"][: n - 1] | st["truncated"][: n - 1]).any()
            assert int(d["episode"]["length"]) == n
            assert np.isclose(float(d["episode"]["return"]), float(st["reward"][:n].astype(np.float64).sum()), atol=1e-4)
            for t in range(n):
                tr = {"obs": st["obs"][t], "action": int(st["action"][t]), "reward": st["reward"][t],
                      "terminated": bool(st["terminated"][t]), "truncated": bool(st["truncated"][t]),
                      "succ": st["obs"][t + 1] if t + 1 < n else d["bootstrap"]["obs"]}
                if "value" in st:
                    tr["value"] = st["value"][t]
                got.setdefault(key, []).append(tr)
    assert {a for _, a in got} == {"red_0", "red_1", "blue_0"}
    assert_same_streams(got, want)
    assert loop.rounds == loop.episodes >= 30


def test_complete_episodes_refuse_an_agent_episode_longer_than_rollout_len_by_name():
    with pytest.raises(shmbuf.UsageError, match=r"the episode of agent '(red_0|blue_0)' outlasted rollout_len=8"):
        run_loop(1, 10, rollout_len=8, batch_mode="complete_episodes")  # the first episode lasts 9 steps


def test_the_collector_delivers_each_agents_whole_episodes_once_in_complete_episodes_mode():
    """MultiAgentCollector(batch_mode='complete_episodes'): batches of agent episodes from two actors, each once, each
    whole (it ends where the agent's episode ends), equal per agent to the plain loop's episodes in order."""
    from workers import MultiAgentCollector

    batches = []
    with MultiAgentCollector([partial(JoinLeaveEnv, 0), partial(JoinLeaveEnv, 1)], POLICIES, policy_mapping_fn=mapping,
                             frames_per_batch=40, rollout_len=12, batch_mode="complete_episodes",
                             count_steps_by="agent_steps", timeout=60, start_method="fork") as c:
        for b in c:
            batches.append(b)
            if len(batches) == 6:
                break
        rows = c.rows
    per_lane = {}
    for b in batches:
        assert b.agent_steps == b.frames >= 40 and b.env_steps == 0
        assert b.agent_steps == sum(int(x.lengths.sum()) for x in b.values())
        for pid, x in b.items():
            starts = np.concatenate([[0], np.cumsum(x.lengths)[:-1]])
            for i, (s0, n) in enumerate(zip(starts.tolist(), x.lengths.tolist(), strict=True)):
                st = {k: v[s0 : s0 + n] for k, v in x.data["step"].items()}
                per_lane.setdefault((pid, int(x.lane[i])), []).append(
                    (int(x.epoch[i]), int(x.seq[i]), st, x.data["bootstrap"]["obs"][i], int(x.data["episode"]["env"][i])))
    keys = [(pid, lane, e, s) for (pid, lane), eps in per_lane.items() for e, s, *_ in eps]
    assert len(keys) == len(set(keys))  # exactly once
    for (pid, _lane), eps in per_lane.items():
        eps.sort(key=lambda r: r[1])
        assert [s for _, s, *_ in eps] == list(range(len(eps)))  # every episode of this agent, in order, none lost
        env_id = int(eps[0][2]["obs"][0][0])
        row = eps[0][4]
        _, agent = rows.policies[pid][row]
        got = []
        for _, _, st, boot, r in eps:
            assert r == row
            n = len(st["reward"])
            for t in range(n):
                tr = {"obs": st["obs"][t], "action": int(st["action"][t]), "reward": st["reward"][t],
                      "terminated": bool(st["terminated"][t]), "truncated": bool(st["truncated"][t]),
                      "succ": st["obs"][t + 1] if t + 1 < n else boot}
                if "value" in st:
                    tr["value"] = st["value"][t]
                got.append(tr)
        want = plain_streams(1, 200, env_ids=[env_id])[(0, agent)]
        assert_same_streams({(0, agent): got}, {(0, agent): want})


@pytest.mark.parametrize(("kw", "says"), [
    ({"rollout_len": 12}, "pass count_steps_by='agent_steps'"),
    ({"count_steps_by": "agent_steps"}, "give rollout_len, the most steps an agent's episode may take"),
])
def test_complete_episodes_collection_says_which_setting_it_needs(kw, says):
    from workers import MultiAgentCollector

    with pytest.raises(shmbuf.UsageError, match=says):
        MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=40,
                            batch_mode="complete_episodes", **kw)


class GatedEnv(JoinLeaveEnv):
    """JoinLeaveEnv whose ``hold_at``-th step (counted over its episodes) waits until the file ``gate`` exists: the
    test decides when the actor goes on (every wait in a test has a deadline: 60 s, then the actor fails)."""

    def __init__(self, env_id: int, gate: str, hold_at: int):
        super().__init__(env_id)
        self.gate, self.hold_at, self.steps = gate, hold_at, 0

    def step(self, actions):
        self.steps += 1
        if self.steps == self.hold_at:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test did not open {self.gate} within 60 s")
                time.sleep(0.005)
        return super().step(actions)


def test_served_policies_answer_every_actor_and_stamp_each_action_with_their_version(tmp_path):
    """serve=True: each policy behind an inference server in this process (never pickled); every actor's stored
    streams still equal the plain loop's, each action carries the version that chose it, and an update moves only
    that policy's.

    Both actors step JoinLeaveEnv(0), so their rows name the same (env, agent): streams are compared actor by actor
    (lane by lane). Each actor is held at its 9th env step, after its first round (8 steps) is committed, until the
    first batch is in: that batch is then both actors' round 0, of every policy, whatever the load (a batch of one
    actor's rounds 0 and 1 is what an unheld run mostly gets; the old check read two actors' rounds 0 as one stream,
    and failed whenever a batch held both)."""
    from workers import MultiAgentCollector

    gate = str(tmp_path / "gate")
    policies = {"red": Scaled(1), "blue": blue_policy}
    try:
        with MultiAgentCollector([partial(GatedEnv, 0, gate, 9)] * 2, policies, policy_mapping_fn=mapping,
                                 frames_per_batch=16, serve=True, copy=True, timeout=60, start_method="fork") as c:
            it = iter(c)
            first = next(it)
            open(gate, "w").close()  # the actors go on
            for x in first.values():
                st = x.data["step"]
                assert st["policy_version"].shape == st["valid"].shape and not st["policy_version"].any()
                assert np.array_equal(st["action"][~st["valid"]], np.zeros(int((~st["valid"]).sum()), np.int64))
                assert sorted(x.lane.tolist()) == [0, 1] and x.seq.tolist() == [0, 0]  # each actor's round 0
            per_lane = {lane: {pid: [{"seq": 0, "fill": {"step": int(x.fill["step"][i]),
                                                          "episode": int(x.fill["episode"][i])},
                                      "data": optree.tree_map(lambda a, i=i: a[i], x.data)}
                                     for i in range(2) if x.lane[i] == lane] for pid, x in first.items()}
                        for lane in (0, 1)}
            assert c.update_policy_weights({"red": {"scale": 2}}) == {"red": 1}
            assert policies["red"].scale == 2  # copied into the served policy between two forward passes
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, "no action of red's version 1 in 60 s"
                b = next(it)
                st = b["red"].data["step"]
                newer = st["valid"] & (st["policy_version"] == 1)
                if newer.any():
                    break
            assert np.array_equal(st["action"][newer], 2 * red_policy(st["obs"][newer]))
            assert not b["blue"].data["step"]["policy_version"].any()
            assert set(c.stats()["servers"]) == {"red", "blue"}
    finally:
        open(gate, "w").close()  # never leave an actor held (close() stops it at its next step)
    want = plain_streams(1, 8, env_ids=[0])
    for lane, out in per_lane.items():
        got = stored_streams(out, c.rows)
        assert set(got) == set(want), lane
        assert all(len(got[k]) == len(want[k]) for k in want), lane  # every transition of the round, none invented
        assert_same_streams(got, want)


def test_rllib_mapping_functions_of_every_signature_map_each_agent_once():
    from workers._agent_rows import mapping_of

    def old(agent_id, episode, worker, **kwargs):  # RLlib's older signature
        return "p" + agent_id[-1]

    assert mapping_of(old)("red_1") == "p1"
    assert mapping_of(mapping)("blue_0") == "blue"  # (agent_id, episode, **kwargs)
    assert mapping_of(lambda agent_id: agent_id[:3])("red_0") == "red"
    assert mapping_of(None)("anyone") == "default_policy"
    with pytest.raises(shmbuf.UsageError, match="policy_mapping_fn: expected a function of the agent id"):
        mapping_of("red")


class Recording:
    """Red's policy on a dict of views: acts from the current observation, and records every input it was given."""

    def __init__(self):
        self.seen = []

    def __call__(self, x):
        self.seen.append({k: np.array(v) for k, v in x.items()})
        return red_policy(x["obs"])


def test_each_agents_views_are_its_own_stream_and_equal_what_the_learner_builds():
    """view_requirements per policy: red's policy gets its previous observations and actions, per agent stream (red_1
    joins with zeros behind it, and leaves); the learner's build_views over the stored rows gives the same."""
    from shmbuf.storage import ViewRequirement, build_views

    reqs = {"obs": ViewRequirement("obs"), "prev_obs": ViewRequirement("obs", shift=[-2, -1]),
            "prev_action": ViewRequirement("action", shift=-1)}
    red = Recording()
    out, rows, _ = run_loop(1, 10, rollout_len=4, policies={"red": red, "blue": blue_policy},
                            view_requirements={"red": reqs})
    rollouts = sorted(out["red"], key=lambda r: r["seq"])
    seen = iter(red.seen[1:])  # the first call is multiagent_examples' probe
    compared = 0
    prev = None
    for r in rollouts:
        d = r["data"]
        built = build_views(d, reqs, fill=r["fill"], prev=None if prev is None else prev["data"])
        valid = d["step"]["valid"]
        for t in range(r["fill"]["step"]):
            x = next(seen)
            for k in reqs:
                assert np.array_equal(x[k], built[k][t][valid[t]]), (r["seq"], t, k)
                compared += 1
        prev = r
    assert compared == 3 * 40
    # red_1 (row 1) joins at step 2: its first input has zeros behind it, not red_0's or an old stream's data
    first = rollouts[0]["data"]
    assert first["step"]["valid"][2, 1] and not first["step"]["valid"][1, 1]
    joined = build_views(first, reqs, fill=rollouts[0]["fill"])
    assert not joined["prev_obs"][2, 1].any() and joined["prev_action"][2, 1] == 0


class EchoViews:
    """Red's policy on views, picklable: acts from the current observation and returns what it saw as extras."""

    def __call__(self, x):
        return red_policy(x["obs"]), {"seen_prev_action": np.asarray(x["prev_action"], np.int64).copy()}


def test_the_collector_takes_view_requirements_per_policy_into_its_actors():
    """Through actor processes (spawn: the requirements are pickled): red's extra records its prev_action view, and
    the learner's build_views over the stored rows agrees at every valid step after the first rollout."""
    from shmbuf.storage import ViewRequirement, build_views
    from workers import MultiAgentCollector

    reqs = {"obs": ViewRequirement("obs"), "prev_action": ViewRequirement("action", shift=-1)}
    with MultiAgentCollector(partial(JoinLeaveEnv, 0), {"red": EchoViews(), "blue": blue_policy},
                             policy_mapping_fn=mapping, num_actors=1, frames_per_batch=8, total_frames=40, copy=True,
                             view_requirements={"red": reqs}, start_method="spawn", timeout=60) as c:
        reds = [b["red"] for b in c]
    compared = 0
    prev = None
    for b in reds:
        data = optree.tree_map(lambda a: a[0], b.data)
        built = build_views(data, reqs, fill={"step": 8, "episode": int(b.fill["episode"][0])}, prev=prev)
        v = data["step"]["valid"]
        assert np.array_equal(data["step"]["seen_prev_action"][v], built["prev_action"][v])
        compared += int(v.sum())
        prev = data
    assert compared > 40


def test_aligned_batches_hold_the_same_rounds_for_every_policy_so_agents_line_up():
    """align=True: row i of red's and blue's batches is the same round of the same actor, so agents() gives every
    agent's column on one time axis: at each step, all agents of an env see the same episode step (obs[2]). Without
    align, agents() refuses."""
    from workers import MultiAgentCollector

    seen = set()
    with MultiAgentCollector([partial(JoinLeaveEnv, 0), partial(JoinLeaveEnv, 1)], POLICIES, policy_mapping_fn=mapping,
                             frames_per_batch=16, align=True, timeout=60, start_method="fork") as c:
        it = iter(c)
        for _ in range(5):
            b = next(it)
            red, blue = b["red"], b["blue"]
            assert np.array_equal(red.seq, blue.seq) and b.env_steps == 16
            for i in range(len(red.seq)):
                assert red.data["step"]["obs"][i, 0, 0, 0] == blue.data["step"]["obs"][i, 0, 0, 0]  # the same env
                assert (red.lane[i], red.epoch[i], red.seq[i]) not in seen
                seen.add((red.lane[i], red.epoch[i], red.seq[i]))
            cols = b.agents("obs")
            assert set(cols) == {(0, "red_0"), (0, "red_1"), (0, "blue_0")}
            (r0, v0), (b0, vb) = cols[(0, "red_0")], cols[(0, "blue_0")]
            both = v0 & vb
            assert both.any() and np.array_equal(r0[both][:, 2], b0[both][:, 2].astype(np.float64))
    with MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
                             timeout=60, start_method="fork") as c:
        with pytest.raises(shmbuf.UsageError, match="collect with MultiAgentCollector\\(align=True\\)"):
            next(iter(c)).agents()


def test_rounds_ended_early_by_agent_steps_leave_no_valid_row_past_their_fill():
    """Counting agent steps, a round ends when they reach rollout_len, before the slot's T env steps: the rows past
    its fill are never valid (a reused slot held an older rollout's there), and a batch's frames count only filled
    valid rows. (Found by the multi-agent benchmark: frames said 15 where 10 agent steps were stored.)"""
    from workers import MultiAgentCollector

    with MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, num_actors=1,
                             frames_per_batch=12, rollout_len=6, count_steps_by="agent_steps", timeout=60,
                             start_method="fork") as c:
        it = iter(c)
        for _ in range(12):
            b = next(it)
            for x in b.values():
                valid, n = x.data["step"]["valid"], x.fill["step"]
                for i in range(len(n)):
                    assert not valid[i, n[i] :].any(), (x.seq[i], n[i])
                assert x.frames == sum(int(valid[i, : n[i]].sum()) for i in range(len(n)))
            assert b.agent_steps == sum(x.frames for x in b.values())


def valid_in_fill(x):
    """The valid rows of a policy's rounds batch within each rollout's fill: the agent steps it delivers."""
    valid, n = x.data["step"]["valid"], x.fill["step"]
    return sum(int(valid[i, : n[i]].sum()) for i in range(len(n)))


@pytest.mark.parametrize(("count_steps_by", "mode"), [("env_steps", "rounds"), ("env_steps", "aligned"),
                                                      ("agent_steps", "rounds"), ("agent_steps", "aligned"),
                                                      ("agent_steps", "complete_episodes")])
def test_frames_are_the_steps_count_steps_by_counts_and_total_frames_stops_on_them(count_steps_by, mode):
    """Each batch's frames, env_steps and agent_steps, the collector's and its stats', and where total_frames stops,
    against a ledger of the steps the batches deliver: agent steps are the valid rows within each rollout's fill
    (complete episodes: the episodes' lengths), env steps blue_0's valid rows (it acts at every step of its env,
    and is its policy's only row per env). frames is the one count_steps_by names, frames_per_batch or more."""
    from workers import MultiAgentCollector

    total = 40
    if mode == "complete_episodes":
        kw = {"batch_mode": "complete_episodes", "rollout_len": 12}
    else:
        kw = {"rollout_len": 4, "align": mode == "aligned"}  # 4 rounds a batch: 16 env steps, or 16 agent steps or more
    with MultiAgentCollector([partial(JoinLeaveEnv, 0), partial(JoinLeaveEnv, 1)], POLICIES, policy_mapping_fn=mapping,
                             frames_per_batch=16, count_steps_by=count_steps_by, total_frames=total, copy=True,
                             timeout=60, start_method="fork", **kw) as c:
        batches = list(c)
        stats = c.stats()
    ledger = []  # (frames, agent steps, env steps) of each batch, counted from what it holds
    for b in batches:
        if mode == "complete_episodes":
            agent, env = sum(int(x.lengths.sum()) for x in b.values()), 0  # env steps: not known in this mode
        else:
            agent, env = sum(valid_in_fill(x) for x in b.values()), valid_in_fill(b["blue"])
        frames = agent if count_steps_by == "agent_steps" else env
        assert (b.frames, b.agent_steps, b.env_steps) == (frames, agent, env), (count_steps_by, mode)
        assert frames == 16 if count_steps_by == "env_steps" else frames >= 16, frames
        ledger.append((frames, agent, env))
    sums = [sum(col) for col in zip(*ledger)]
    assert len(ledger) >= 2 and sums[0] - ledger[-1][0] < total <= sums[0], f"total_frames={total} ended after {ledger}"
    assert c.frames == stats["frames"] == sums[0] and stats["batches"] == len(ledger)
    assert (c.agent_steps, c.env_steps) == (stats["agent_steps"], stats["env_steps"]) == (sums[1], sums[2])


@pytest.mark.parametrize("entry", ["Collector", "AsyncBatchedCollector"])
def test_collector_and_async_batched_collector_take_multiagent_envs_given_policies(entry):
    """The single-agent entry points, given policies=, collect from PettingZoo envs as a MultiAgentCollector does
    (AsyncBatchedCollector: with each policy served): MultiAgentBatches holding every policy's rows."""
    import workers

    cls = getattr(workers, entry)
    with cls([partial(JoinLeaveEnv, 0)] * 2, policies=POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
             copy=True, timeout=60, start_method="fork") as c:
        assert set(c.policies) == {"red", "blue"} and c.rows is not None
        assert bool(c.served) == (entry == "AsyncBatchedCollector")
        assert set(c.served) == ({"red", "blue"} if entry == "AsyncBatchedCollector" else set())
        b = next(iter(c))
        assert isinstance(b, workers.MultiAgentBatch)
        assert set(b) == {"red", "blue"} and b.env_steps == 16
        assert b["blue"].data["step"]["obs"].shape[2:] == (1, 5)
        if c.served:
            assert "policy_version" in b["red"].data["step"]
    with cls([partial(JoinLeaveEnv, 0)] * 2, POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
             timeout=60, start_method="fork") as c:  # a dict of policies in the policy's place
        b = next(iter(c))
        assert isinstance(b, workers.MultiAgentBatch) and set(b) == {"red", "blue"}


class CastObsEnv(JoinLeaveEnv):
    """JoinLeaveEnv's observations, but none of them an array of its rows' exact dtype: red's float32 (its rows are
    float64), blue's plain lists. The driver's one-store-per-policy path takes only exact arrays, so these go the
    checked path, agent by agent, casting as it stores."""

    def _obs(self, agent):
        o = super()._obs(agent)
        return o.astype(np.float32) if agent.startswith("red") else o.tolist()


def _rollout_bytes(out):
    """Every leaf of every rollout of every policy as (dtype, shape, bytes), rollouts in commit order."""
    got = {}
    for pid, rollouts in out.items():
        for r in sorted(rollouts, key=lambda r: r["seq"]):
            leaves, spec = optree.tree_flatten(r["data"])
            got.setdefault(pid, []).append((r["fill"], str(spec), [(a.dtype, a.shape, a.tobytes()) for a in leaves]))
    return got


@pytest.mark.parametrize("cast", [[0, 1], [1]])
def test_the_one_store_path_and_the_checked_path_store_the_same_bytes(cast):
    """The driver stores a policy's observations of an env in one store when they are arrays of its rows' shape and
    dtype, else agent by agent through the checked path (a same-kind cast). Both give the same rollouts, bit for bit,
    through agents joining (red_1 at step 2), leaving (terminated at 5), episode ends and resets, with every env on
    the checked path, or one env on each path at the same steps."""
    rounds, T = 12, 4
    want, _, plain = run_loop(2, rounds, rollout_len=T)
    envs = [CastObsEnv(i) if i in cast else JoinLeaveEnv(i) for i in range(2)]
    got, _, loop = run_loop(2, rounds, rollout_len=T, envs=envs)
    assert _rollout_bytes(got) == _rollout_bytes(want)
    assert (loop.env_steps, loop.agent_steps, loop.episodes) == (plain.env_steps, plain.agent_steps, plain.episodes)


class MuteJoinEnv(JoinLeaveEnv):
    """red_1 joins (is in env.agents) without an observation to act on."""

    def step(self, actions):
        obs, *rest = super().step(actions)
        if "red_1" not in actions:
            obs.pop("red_1", None)
        return (obs, *rest)


class NoFinalEnv(JoinLeaveEnv):
    """red_1 terminates without a final observation."""

    def step(self, actions):
        obs, rew, term, *rest = super().step(actions)
        if term.get("red_1"):
            obs.pop("red_1")
        return (obs, rew, term, *rest)


@pytest.mark.parametrize(("env", "says"), [
    (MuteJoinEnv, "agent 'red_1' is live, but it was in no observation the env returned, so it has nothing to act on"),
    (NoFinalEnv, "agent 'red_1' ended without a final observation"),
])
def test_an_agent_without_an_observation_to_act_on_or_to_end_with_is_named(env, says):
    with pytest.raises(shmbuf.UsageError, match=says):
        run_loop(1, 4, envs=[env(0)])


# -- a mapping per episode (RLlib's policy_mapping_fn(agent_id, episode)) ------------------------------------------------


def env_episodes(streams, env):
    """``{at: the env's episode count}`` for every step of env ``env``, from red_0's stream (it acts at every step)."""
    out, k = {}, 0
    for tr in streams[(env, "red_0")]:
        out[tr["at"]] = k
        k += bool(tr["terminated"] or tr["truncated"])
    return out


@pytest.mark.parametrize("n_envs", [1, 2])
def test_a_per_episode_mapping_puts_each_agents_episode_in_the_policy_it_was_mapped_to(n_envs):
    """Every agent's stored steps, across the policies' rows, equal the plain loop's; each red agent's steps of an
    episode are in the rows of the policy the mapping named for that episode, and both red policies got both agents."""
    rounds, T = 12, 4
    out, rows, loop = run_loop(n_envs, rounds, rollout_len=T, policies=LEAGUE, policy_mapping_fn=league,
                               remap_each_episode=True)
    assert rows.remap and all(len(r) == 3 * n_envs for r in rows.policies.values())  # every (env, agent) in each
    got = stored_streams(out, rows)
    want = plain_streams(n_envs, rounds * T)
    assert set(got) == set(want)
    for key in want:
        assert len(got[key]) == len(want[key]), key
    assert_same_streams(got, want)
    for env in range(n_envs):
        episode_of = env_episodes(got, env)
        assert max(episode_of.values()) >= 3, "too few episodes to see the mapping change"
        for agent in ("red_0", "red_1", "blue_0"):
            for tr in got[(env, agent)]:
                want_pid = league(agent, Episode(env, episode_of[tr["at"]], 0))
                assert tr["policy"] == want_pid, (env, agent, tr["at"], tr["policy"], want_pid)
    for agent in ("red_0", "red_1"):
        assert {tr["policy"] for tr in got[(0, agent)]} == {"red_a", "red_b"}
    assert loop.agent_steps == sum(len(s) for s in want.values())


def test_a_per_episode_mapping_gets_each_episode_once_with_rllibs_arguments():
    """The mapping is called once per agent per env episode, with an Episode (count, a 63-bit id, its hex id_)."""
    seen = []

    def recording(agent_id, episode):
        seen.append((agent_id, episode))
        return league(agent_id, episode)

    rounds, T = 6, 4
    run_loop(1, rounds, rollout_len=T, policies=LEAGUE, policy_mapping_fn=recording, remap_each_episode=True)
    live = [(a, e) for a, e in seen if e.episode_id != 0]  # the set-up's calls have episode id 0
    counts = [e.count for a, e in live if a == "red_0"]
    assert counts == list(range(len(counts))) and len(counts) >= 3
    assert all(sorted(a for a, e in live if e.count == k) == sorted(AGENTS) for k in counts)
    ids = {e.count: e.episode_id for _, e in live}
    assert len(set(ids.values())) == len(ids) and all(0 < i < 2**63 for i in ids.values())
    assert all(e.id_ == f"{e.episode_id:016x}" for _, e in live)


def test_a_per_episode_mapping_to_a_policy_of_another_shape_or_none_is_refused_by_name():
    def swap(agent_id, episode):  # blue joins red_a in the second episode: (5,) float32 into (3,) float64 rows
        return "red_a" if episode.count == 1 or agent_id.startswith("red") else "blue"

    with pytest.raises(shmbuf.SchemaError, match=r"agent 'blue_0''s observation: expected shape \(3,\) and dtype float64 "
                                                 r"\(policy 'red_a''s rows\), got shape \(5,\) and dtype float32"):
        run_loop(1, 8, policies={"red_a": red_policy, "blue": blue_policy}, policy_mapping_fn=swap,
                 remap_each_episode=True)

    def stray(agent_id, episode):
        return "green" if episode.count == 1 else league(agent_id, episode)

    with pytest.raises(shmbuf.UsageError, match=r"policy_mapping_fn\('red_0', episode 1 of env 0\) returned 'green', "
                                                r"which is not one of the policies \['blue', 'red_a', 'red_b'\]"):
        run_loop(1, 8, policies=LEAGUE, policy_mapping_fn=stray, remap_each_episode=True)


def test_the_collector_remaps_each_episode_in_its_actors_and_agents_lines_the_policies_up():
    """Through actor processes: both red policies get both red agents' steps; aligned batches' agents() give each red
    agent's steps from whichever policy held them, valid at every step it acted; complete-episodes rollouts of each
    red policy hold both red agents' whole episodes."""
    from workers import MultiAgentCollector

    with MultiAgentCollector([partial(JoinLeaveEnv, 0)] * 2, LEAGUE, policy_mapping_fn=league, frames_per_batch=32,
                             rollout_len=8, remap_each_episode=True, align=True, copy=True, timeout=60,
                             start_method="fork") as c:
        held = {pid: set() for pid in LEAGUE}
        it = iter(c)
        for _ in range(4):
            b = next(it)
            for pid, x in b.items():
                v = x.data["step"]["valid"]
                held[pid] |= {c.rows.policies[pid][row][1] for row in np.flatnonzero(v.any(axis=(0, 1)))}
            lined = b.agents("action")
            acts, valid = lined[(0, "red_0")]
            assert valid.all()  # red_0 acts at every env step, for one red policy or the other
            red_a = b["red_a"].data["step"]
            row = c.rows.policies["red_a"].index((0, "red_0"))
            mine = red_a["valid"][:, :, row]
            assert np.array_equal(acts[mine], red_a["action"][:, :, row][mine])
    assert held == {"red_a": {"red_0", "red_1"}, "red_b": {"red_0", "red_1"}, "blue": {"blue_0"}}
    with MultiAgentCollector([partial(JoinLeaveEnv, 0)] * 2, LEAGUE, policy_mapping_fn=league, frames_per_batch=40,
                             rollout_len=12, batch_mode="complete_episodes", count_steps_by="agent_steps",
                             remap_each_episode=True, timeout=60, start_method="fork") as c:
        agents = {pid: set() for pid in LEAGUE}
        it = iter(c)
        for _ in range(4):
            for pid, x in next(it).items():
                agents[pid] |= {c.rows.policies[pid][int(row)][1] for row in x.data["episode"]["env"]}
    assert agents == {"red_a": {"red_0", "red_1"}, "red_b": {"red_0", "red_1"}, "blue": {"blue_0"}}


def test_the_docs_per_episode_block_sends_the_chasers_to_the_old_policy_every_other_episode(tmp_path):
    """docs/multiagent.md's per-episode block, as written: two 25-step episodes per rollout, one per chaser policy."""
    from tests.helpers import doc_blocks, run_doc_block

    k = next(i for i, b in enumerate(doc_blocks("multiagent.md")) if "remap_each_episode=True" in b)
    lines = run_doc_block("multiagent.md", k, tmp_path).splitlines()
    batch = ["chaser (2, 50, 8, 26) 300 agent steps", "chaser_old (2, 50, 8, 26) 300 agent steps",
             "runner (2, 50, 8, 24) 200 agent steps"]
    assert lines == batch * 2, lines
