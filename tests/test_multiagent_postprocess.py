"""RLlib's postprocess_trajectory with other_agent_batches in multi-agent actors (workers/_multiagent_postprocess.py).

JoinLeaveEnv (tests/helpers_multiagent.py) makes every transition known: red observations are ``[env, agent, t]``,
blue ones ``[env, agent, t, episode, 1]``, and red_1 joins at step 2 and terminates at step 5. The hook is checked
against the plain PettingZoo loop, and other_agent_batches against the stored rollouts of the same round."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
import optree
import pytest

pettingzoo = pytest.importorskip("pettingzoo")

import shmbuf  # noqa: E402  # after the importorskip: the module needs pettingzoo
from tests.helpers_multiagent import (  # noqa: E402  (after the importorskip above)
    POLICIES,
    JoinLeaveEnv,
    assert_same_streams,
    blue_policy,
    mapping,
    plain_streams,
    red_policy,
    run_loop,
    stored_streams,
)
from workers._multiagent import multiagent_examples  # noqa: E402  # same
from workers.compat._rllib_multiagent import discover_policies  # noqa: E402  # same

AGENT_INDEX = {"red_0": 0, "red_1": 1, "blue_0": 2}


def who(batch: dict[str, Any]) -> tuple[int, str]:
    """The (env, agent) of a piece, from its first observation (``[env, agent index, ...]``)."""
    env, k = batch["obs"][0][:2]
    return int(env), ["red_0", "red_1", "blue_0"][int(k)]


def central(sample_batch, other_agent_batches=None, episode=None):
    """A centralised-critic-style hook: at each of the agent's steps, how many other agents acted at that env step
    and the sum of their agent indices (obs[1]), found by lining their ``t`` up with the agent's."""
    out = np.zeros((len(sample_batch["rewards"]), 2), np.float64)
    for _, _, other in (other_agent_batches or {}).values():
        at = {int(t): i for i, t in enumerate(other["t"])}
        for j, t in enumerate(sample_batch["t"]):
            if int(t) in at:
                out[j] += (1.0, float(other["obs"][at[int(t)]][1]))
    sample_batch["central"] = out
    return sample_batch


class RedWithHook:
    """red_policy with RLlib's postprocess_trajectory method (reward-to-go within the piece)."""

    def __call__(self, obs):
        return red_policy(obs)

    def postprocess_trajectory(self, sample_batch, other_agent_batches=None, episode=None):
        r = sample_batch["rewards"]
        sample_batch["to_go"] = np.cumsum(r[::-1])[::-1].astype(np.float32)
        return sample_batch


def run_post_loop(n_envs, rounds, postprocess, *, rollout_len=4, batch_mode="truncate_episodes", policies=POLICIES,
                  record=None, count_steps_by="env_steps"):
    """A MultiAgentLoop in a thread, postprocessing set up as MultiAgentCollector does (see
    tests/helpers_multiagent.py's ``run_loop``). Returns ``({policy: [rollout, ...]}, rows, loop)``."""
    return run_loop(n_envs, rounds, postprocess=postprocess, rollout_len=rollout_len, batch_mode=batch_mode,
                    policies=policies, record=record, count_steps_by=count_steps_by)


def copied(x):
    return optree.tree_map(np.array, x)


def test_the_hook_sees_each_agents_valid_steps_and_the_other_agents_of_its_env_over_the_same_steps():
    """Every call: one agent's valid steps of one piece (equal, concatenated per agent, to the plain PettingZoo loop's
    stream, flags only at a piece's end), and other_agent_batches = exactly the other agents of the same env with a
    valid step in the piece's window, (policy_id, policy, batch) with the stored data at their valid steps."""
    calls = []
    box: list[Any] = []

    def hook(sample_batch, other_agent_batches=None, episode=None):
        if box:  # not the set-up call on the dummy batch
            calls.append((box[0].rounds, copied(sample_batch), {a: (p, pol, copied(b)) for a, (p, pol, b)
                                                                 in other_agent_batches.items()}))
        return sample_batch

    n_envs, rounds, T = 2, 12, 4
    out, rows, loop = run_post_loop(n_envs, rounds, hook, rollout_len=T, record=box)
    want = plain_streams(n_envs, rounds * T)
    # the hook changed nothing stored
    assert_same_streams(stored_streams(out, rows), want)
    got: dict[Any, list[dict[str, Any]]] = {}
    saw_red_1_joined = saw_red_1_away = False
    for r, batch, others in calls:
        env, me = who(batch)
        pid, row = rows.where[(env, me)]
        ts = batch["t"]
        t0, t1 = int(ts[0]), int(ts[-1]) + 1
        assert np.array_equal(ts, np.arange(t0, t1))  # contiguous env steps of the round
        done = batch["terminateds"] | batch["truncateds"]
        assert not done[:-1].any()  # a piece never holds an episode end but at its last step
        st = out[pid][r]["data"]["step"]
        assert st["valid"][t0:t1, row].all()
        for col, leaf in (("obs", "obs"), ("actions", "action"), ("rewards", "reward")):
            assert np.array_equal(batch[col], st[leaf][t0:t1, row]), (col, r, env, me)
        for j in range(len(ts)):
            got.setdefault((env, me), []).append(
                {"obs": batch["obs"][j], "action": int(batch["actions"][j]), "reward": batch["rewards"][j],
                 "terminated": bool(batch["terminateds"][j]), "truncated": bool(batch["truncateds"][j]),
                 "succ": batch["new_obs"][j], **({"value": batch["value"][j]} if "value" in batch else {})})
        expected = set()
        for (e, agent), (opid, orow) in rows.where.items():
            if e == env and agent != me and out[opid][r]["data"]["step"]["valid"][t0:t1, orow].any():
                expected.add(agent)
        assert set(others) == expected, (r, env, me, t0, t1)
        for agent, (opid, policy, ob) in others.items():
            ostep = out[opid][r]["data"]["step"]
            orow = rows.where[(env, agent)][1]
            valid_ts = t0 + np.flatnonzero(ostep["valid"][t0:t1, orow])
            assert opid == mapping(agent, None) and policy is POLICIES[opid]
            assert np.array_equal(ob["t"], valid_ts)
            assert np.array_equal(ob["obs"], ostep["obs"][valid_ts, orow])
            assert np.array_equal(ob["actions"], ostep["action"][valid_ts, orow])
            assert {int(o[0]) for o in ob["obs"]} == {env}  # the same env's agent
        if me != "red_1":
            saw_red_1_joined |= "red_1" in others
            saw_red_1_away |= "red_1" not in others
    assert saw_red_1_joined and saw_red_1_away  # red_1 joins and leaves
    assert set(got) == set(want)
    for key in want:
        assert len(got[key]) == len(want[key]), key  # every valid step in exactly one piece
    assert_same_streams(got, want)
    assert loop.postprocess.calls == len(calls)


@pytest.mark.parametrize("count_steps_by", ["env_steps", "agent_steps"])
def test_a_centralised_critic_column_from_the_other_agents_lands_in_the_stored_rollouts(count_steps_by):
    """The hook adds a column from the other agents' obs (lined up by t); recomputed from the stored rollouts of the
    same round, agent by agent, it is the same: other_agent_batches held the same env's agents at the same steps.
    Counting agent steps, rounds end before T env steps: the pieces end at the fill."""
    n_envs, rounds, T = 2, 10, 5
    out, rows, _ = run_post_loop(n_envs, rounds, {"red": central, "blue": central}, rollout_len=T,
                                 count_steps_by=count_steps_by)
    if count_steps_by == "agent_steps":
        assert any(r["fill"]["step"] < T for r in out["red"])
    checked = 0
    for r in range(rounds):
        steps = {pid: out[pid][r]["data"]["step"] for pid in out}
        for pid, st in steps.items():
            assert st["central"].shape[1:] == (len(rows.policies[pid]), 2)
            for row, (env, me) in enumerate(rows.policies[pid]):
                for t in np.flatnonzero(st["valid"][:, row]):
                    want = np.zeros(2)
                    for (e, agent), (opid, orow) in rows.where.items():
                        if e == env and agent != me and steps[opid]["valid"][t, orow]:
                            want += (1.0, AGENT_INDEX[agent])
                    assert np.array_equal(st["central"][t, row], want), (r, pid, env, me, t)
                    checked += 1
                assert not st["central"][~st["valid"][:, row], row].any()  # zeros where the agent is away
    assert checked > 50


def test_complete_episodes_give_each_agent_the_other_agents_whole_episodes_of_its_env_episode():
    """Complete episodes are held until their env's episode is over: each red agent's hook then gets every other agent
    of that env episode (blue_0, red_0, and red_1 when it joined) over its whole episode, each with ``t`` the env step
    (the env's own step count, obs[2]); the hook's column is stored; every agent episode is committed once."""
    calls = []
    box: list[Any] = []

    def hook(sample_batch, other_agent_batches=None, episode=None):
        if box:
            others = {a: (pid, np.array(b["t"]), np.array(b["obs"])) for a, (pid, _, b) in other_agent_batches.items()}
            calls.append((copied(sample_batch), others))
        sample_batch["twice"] = (sample_batch["rewards"] * 2).astype(np.float64)
        return sample_batch

    out, rows, loop = run_post_loop(2, 20, {"red": hook}, rollout_len=12, batch_mode="complete_episodes", record=box)
    assert len(calls) == len(out["red"]) and "twice" not in out["blue"][0]["data"]["step"]
    for r in out["red"]:
        n = r["fill"]["step"]
        st = r["data"]["step"]
        np.testing.assert_array_equal(st["twice"][:n], st["reward"][:n] * 2)
    joined = 0
    for batch, others in calls:
        done = batch["terminateds"] | batch["truncateds"]
        assert done[-1] and not done[:-1].any()
        assert np.array_equal(batch["t"], batch["obs"][:, 2])  # t: the env step, from the env episode's start
        assert np.array_equal(batch["new_obs"][:-1], batch["obs"][1:])  # successors: the next step's obs, then the
        assert batch["new_obs"][-1][2] == batch["obs"][-1][2] + 1  # final observation (one env step later: obs[2] is t)
        env, me = int(batch["obs"][0][0]), ("red_0", "red_1")[int(batch["obs"][0][1])]
        assert "blue_0" in others and ("red_0" in others) == (me == "red_1") and me not in others
        joined += "red_1" in others
        for agent, (pid, t, obs) in others.items():
            assert pid == mapping(agent, None) and np.array_equal(t, obs[:, 2]) and (obs[:, 0] == env).all()
            if agent != "red_1":  # red_0 and blue_0 act over the whole env episode: the same steps as red_0's
                assert t[0] == 0
    assert joined > 0  # some env episodes lasted long enough for red_1 to join


def test_settings_none_true_false_and_per_policy_dicts():
    examples, rows = multiagent_examples([JoinLeaveEnv(0)], {"red": RedWithHook(), "blue": blue_policy}, mapping,
                                         rollout_len=4, seed=0)
    pols = {"red": RedWithHook(), "blue": blue_policy}

    def specs(setting, policies=pols):
        return discover_policies(setting, policies, examples, rows, batch_mode="truncate_episodes")

    assert set(specs(None)) == {"red"} and specs(None)["red"].hook is None  # the policy's own method, in the actor
    assert specs(None)["red"].columns == {"to_go": ((), "<f4")}
    assert specs(False) == {}
    assert specs({"red": False}) == {}
    both = specs(central)
    assert set(both) == {"red", "blue"} and both["blue"].columns == {"central": ((2,), "<f8")}
    assert set(specs({"blue": central})) == {"red", "blue"}  # red absent from the dict: None, its own method
    with pytest.raises(shmbuf.UsageError, match=r"postprocess=True: the policy \(function\) has no postprocess_traj"):
        specs(True)
    with pytest.raises(shmbuf.UsageError, match=r"postprocess: keyed by policy id; \['green'\] are not in policies"):
        specs({"green": central})
    with pytest.raises(shmbuf.UsageError, match=r"postprocess\['red'\]: postprocess: expected None"):
        specs({"red": 3})
    with pytest.raises(shmbuf.UsageError, match="with serve=True the policies stay in this process"):
        discover_policies(None, pols, examples, rows, batch_mode="truncate_episodes", served=True)
    with pytest.raises(shmbuf.SchemaError, match=r"policy 'blue': postprocess_trajectory returned NoneType"):
        specs({"blue": lambda b, o=None, e=None: None})
    with pytest.raises(shmbuf.UsageError, match=r"policy 'blue': postprocess_trajectory added column 'action'.*step leaf"):
        specs({"blue": lambda b, o=None, e=None: {**b, "action": b["actions"]}})


class Flaky:
    """A hook right on the dummy batch (set-up) and wrong on the first real piece, as ``how`` says."""

    def __init__(self, how):
        self.how, self.n = how, 0

    def __call__(self, sample_batch, other_agent_batches=None, episode=None):
        self.n += 1
        n = len(sample_batch["rewards"])
        sample_batch["adv"] = np.zeros(n, np.float32)
        if self.n == 1:
            return sample_batch
        if self.how == "none":
            return None
        if self.how == "length":
            sample_batch["adv"] = np.zeros(n + 1, np.float32)
        if self.how == "shape":
            sample_batch["adv"] = np.zeros((n, 2), np.float32)
        if self.how == "dtype":
            sample_batch["adv"] = np.zeros(n, np.complex64)
        if self.how == "t":
            sample_batch["t"] = sample_batch["t"] + 1
        return sample_batch


@pytest.mark.parametrize(("how", "error", "says"), [
    ("none", shmbuf.SchemaError, r"policy 'blue': postprocess_trajectory returned NoneType"),
    ("length", shmbuf.SchemaError, r"policy 'blue': postprocess_trajectory: column 'adv': expected float32 \(\d+,\) .*"
                                   r"got float32 \(\d+,\)"),
    ("shape", shmbuf.SchemaError, r"policy 'blue': .*column 'adv': expected float32 \(\d+,\) .*got float32 \(\d+, 2\)"),
    ("dtype", shmbuf.SchemaError, r"policy 'blue': .*column 'adv': expected float32 .*got complex64"),
    ("t", shmbuf.UsageError, r"policy 'blue': postprocess_trajectory replaced 't'"),
])
def test_a_hook_that_breaks_the_contract_is_named_with_its_policy_and_column(how, error, says):
    with pytest.raises(error, match=says):
        run_post_loop(1, 2, {"blue": Flaky(how)}, rollout_len=4)


def make_blue():
    return blue_policy


@pytest.mark.parametrize("given", ["policies", "policy_factories"])
def test_the_collector_runs_the_hooks_in_its_actors_and_the_columns_reach_the_learner(given):
    """Through actor processes: red's own postprocess_trajectory (postprocess=None; the actor's own policy, made there
    by its factory) and blue's centralised column (a dict entry); with align=True the learner recomputes blue's
    column from every agent's stored obs."""
    from workers import MultiAgentCollector

    kw = ({"policies": {"red": RedWithHook(), "blue": blue_policy}} if given == "policies" else
          {"policy_factories": {"red": RedWithHook, "blue": make_blue}})
    with MultiAgentCollector([partial(JoinLeaveEnv, 0), partial(JoinLeaveEnv, 1)], policy_mapping_fn=mapping,
                             frames_per_batch=16, align=True, timeout=60, start_method="fork",
                             postprocess={"blue": central}, **kw) as c:
        it = iter(c)
        for _ in range(3):
            b = next(it)
            red, blue = b["red"].data["step"], b["blue"].data["step"]
            assert "to_go" in red and "central" not in red and "central" in blue and "to_go" not in blue
            for i in range(len(b["red"].seq)):
                n = b["red"].fill["step"][i]
                for row in range(red["valid"].shape[2]):
                    v = red["valid"][i, :n, row]
                    done = (red["terminated"][i, :n, row] | red["truncated"][i, :n, row]) & v
                    ends = [*np.flatnonzero(done).tolist()]
                    idx = np.flatnonzero(v)
                    pieces = np.split(idx, [np.searchsorted(idx, e) + 1 for e in ends])
                    for p in pieces:
                        if len(p):
                            r = red["reward"][i, p, row]
                            np.testing.assert_allclose(red["to_go"][i, p, row], np.cumsum(r[::-1])[::-1], rtol=1e-6)
            cols = b.agents("obs")
            (ob, vb) = cols[(0, "blue_0")]
            want = np.zeros((*vb.shape, 2))
            for agent in ("red_0", "red_1"):
                _, va = cols[(0, agent)]
                want[va & vb] += (1.0, AGENT_INDEX[agent])
            got = blue["central"][:, :, 0]
            assert np.array_equal(got[vb], want[vb])
    with pytest.raises(shmbuf.UsageError, match="postprocess=True: the policy"):
        MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
                            postprocess=True, start_method="fork")


def test_the_docs_block_runs_a_centralised_critic_hook(tmp_path):
    from tests.helpers import doc_blocks, run_doc_block

    blocks = doc_blocks("multiagent.md")
    k = next(i for i, b in enumerate(blocks) if "other_agent_batches" in b)
    lines = run_doc_block("multiagent.md", k, tmp_path).splitlines()
    assert lines == DOCS_PRINTS, lines


DOCS_PRINTS = ["(2, 25, 3, 2, 18) True"] * 2  # docs/multiagent.md says so


def test_served_policies_take_a_hook_given_as_a_function_and_refuse_their_own_method():
    """serve=True: the policies stay in the learner; a hook given as a function runs in the actors (its added column
    is no extra the server is asked for), a served policy's own method is refused by name."""
    from workers import MultiAgentCollector

    with MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
                             serve=True, timeout=60, start_method="fork", postprocess={"red": central}) as c:
        b = next(iter(c))
        red = b["red"].data["step"]
        assert red["central"].shape[-1] == 2 and "policy_version" in red
        v = red["valid"]
        assert (red["central"][..., 0][v] >= 1).all()  # blue_0 acts at every step red_0 or red_1 does
    with pytest.raises(shmbuf.UsageError, match="policy 'red' has a postprocess_trajectory method, but with serve=True"):
        MultiAgentCollector(partial(JoinLeaveEnv, 0), {"red": RedWithHook(), "blue": blue_policy},
                            policy_mapping_fn=mapping, frames_per_batch=16, serve=True, start_method="fork")


def test_other_agent_batches_under_a_per_episode_mapping_name_the_policy_of_that_episode():
    """With red_0 and red_1 mapped to opposite red policies in every episode, a red policy's hook sees the other red
    agent under the other red policy, and blue under blue: each other agent once, from the rows it was valid in."""
    from tests.helpers_multiagent import LEAGUE, league

    calls = []

    def hook_of(pid):
        def hook(batch, others, episode):
            # which agent: the one others lack (the set-up's dummy call has every other agent), else its obs says
            absent = [a for a in ("red_0", "red_1", "blue_0") if a not in others]
            me = absent[0] if len(absent) == 1 else ("red_0", "red_1", "blue_0")[int(batch["obs"][0][1])]
            calls.append((pid, me, {a: p for a, (p, _, _) in others.items()}))
            return batch
        return hook

    run_loop(1, 10, postprocess={pid: hook_of(pid) for pid in LEAGUE}, policies=LEAGUE, policy_mapping_fn=league,
             remap_each_episode=True)
    seen = {"red_a": set(), "red_b": set()}
    for pid, me, others in calls:
        if pid == "blue":
            assert me == "blue_0" and set(others) <= {"red_0", "red_1"}
            assert len(set(others.values())) == len(others) and set(others.values()) <= {"red_a", "red_b"}
            continue
        seen[pid].add(me)
        assert others.get("blue_0", "blue") == "blue", (pid, me, others)
        other_red = "red_1" if me == "red_0" else "red_0"
        assert others.get(other_red, "red_b" if pid == "red_a" else "red_a") != pid, (pid, me, others)
    assert seen == {"red_a": {"red_0", "red_1"}, "red_b": {"red_0", "red_1"}}


def red0_actions(sample_batch, other_agent_batches=None, episode=None):
    """Blue's hook: red_0's action at each of blue's steps (-1 where red_0 did not act), from the other agents."""
    out = np.full(len(sample_batch["rewards"]), -1, np.int64)
    got = (other_agent_batches or {}).get("red_0")
    if got is not None:
        at = {int(t): int(a) for t, a in zip(got[2]["t"], got[2]["actions"])}
        out[:] = [at.get(int(t), -1) for t in sample_batch["t"]]
    sample_batch["red0_action"] = out
    return sample_batch


@pytest.mark.alone  # counts every shmbuf entry of /dev/shm: no other test may add one meanwhile
def test_policies_not_trained_act_take_weights_and_show_in_other_agent_batches_but_are_not_handed_out():
    """policies_to_train=["blue"]: only blue's pipeline exists and only blue's rollouts come; red still acts (the env
    refuses a step without every live agent's action), takes new weights (scale 2 doubles its actions), and its
    actions reach blue's hook through other_agent_batches."""
    from tests.conftest import shm_objects
    from tests.helpers_multiagent import Scaled
    from workers import MultiAgentCollector

    before = len(shm_objects())
    with MultiAgentCollector(partial(JoinLeaveEnv, 0), {"red": Scaled(1), "blue": blue_policy}, policy_mapping_fn=mapping,
                             frames_per_batch=16, weights={"red": {"scale": np.array(1)}}, policies_to_train=["blue"],
                             postprocess={"blue": red0_actions}, copy=True, timeout=60, start_method="fork") as c:
        assert list(c.readers) == ["blue"] and c.trained == ["blue"]
        it = iter(c)
        b = next(it)
        assert set(b) == {"blue"} and b.agent_steps == int(b["blue"].data["step"]["valid"].sum())
        st = b["blue"].data["step"]
        seen = st["red0_action"][..., 0][st["valid"][..., 0]]
        t_obs = st["obs"][..., 0, 2][st["valid"][..., 0]]  # blue's obs[2] is the env's step t; red_0's action is 0*100 + t
        assert ((seen == t_obs.astype(np.int64)) | (seen == -1)).all() and (seen >= 0).any()
        assert c.update_policy_weights({"red": {"scale": np.array(2)}}) == {"red": 1}
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "red's new weights never showed in blue's hook"
            st = next(it)["blue"].data["step"]
            v = st["valid"][..., 0]
            seen, t_obs = st["red0_action"][..., 0][v], st["obs"][..., 0, 2][v].astype(np.int64)
            if ((seen == 2 * t_obs) & (t_obs > 0)).any():
                break
    assert len(shm_objects()) <= before


@pytest.mark.parametrize(("setting", "says"), [(["green"], r"policies_to_train: \['green'\] are not in policies"),
                                               (lambda pid: False, "policies_to_train: no policy selected"),
                                               ("red", "policies_to_train: expected policy ids or a function")])
def test_policies_to_train_is_checked_by_name(setting, says):
    from workers import MultiAgentCollector

    with pytest.raises(shmbuf.UsageError, match=says):
        MultiAgentCollector(partial(JoinLeaveEnv, 0), POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
                            policies_to_train=setting, start_method="fork")


class RejoinEnv(JoinLeaveEnv):
    """red_1 leaves at step 5 (terminated) and comes back at step 7 of an episode long enough: two of its episodes in
    one env episode."""

    def step(self, actions):
        obs, rew, term, trunc, info = super().step(actions)
        if self.t == 7 and self.t < self.length and "red_1" not in self.agents:
            self.agents.append("red_1")
            obs["red_1"] = self._obs("red_1")
        return obs, rew, term, trunc, info


def test_an_agent_back_in_the_same_env_episode_gets_its_first_episode_committed_whole_first():
    """Complete episodes held for their env episode's end: an agent that comes back before it has its earlier episode
    postprocessed and committed first (with the others ended by then), so neither episode overwrites the other."""
    calls = []

    def hook(sample_batch, other_agent_batches=None, episode=None):
        calls.append((np.array(sample_batch["obs"]), set(other_agent_batches)))
        return sample_batch

    envs = [RejoinEnv(0)]
    out, rows, _ = run_loop(1, 24, envs=envs, postprocess={"red": hook}, rollout_len=12, batch_mode="complete_episodes")
    red1 = [r["data"]["step"]["obs"][: r["fill"]["step"]] for r in out["red"]
            if rows.policies["red"][int(r["data"]["episode"]["env"])][1] == "red_1"]
    starts = sorted(int(o[0, 2]) for o in red1)
    assert 7 in starts and 2 in starts  # both of red_1's episodes of an env episode arrived
    for o in red1:
        assert np.array_equal(o[:, 2], np.arange(o[0, 2], o[0, 2] + len(o)))  # each one whole, its own steps
    assert any(o[0, 1] == 1 and o[0, 2] == 2 for o, _ in calls)  # the first one was postprocessed too


def test_a_hook_that_writes_its_own_new_obs_changes_no_other_agents_batch():
    """``other_agent_batches`` are copies taken before any hook of the round ran: a hook that overwrites its own
    ``new_obs`` in place (a view would do) leaves what later hooks get as that agent's batch untouched."""
    seen = []

    def scribble(sample_batch, other_agent_batches=None, episode=None):
        seen.extend(np.asarray(b["new_obs"]).min() for _, _, b in (other_agent_batches or {}).values())
        sample_batch["new_obs"][...] = -1
        return sample_batch

    run_loop(2, 8, postprocess={"red": scribble, "blue": scribble})
    assert len(seen) > 20 and min(seen) >= 0  # every observation here is >= 0: no -1 reached another hook
