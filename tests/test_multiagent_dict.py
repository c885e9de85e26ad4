"""Multi-agent collection of Dict and Tuple observations (PettingZoo classic's ``observation`` + ``action_mask``): every
stored row equal to what the env returned, through the loop, the collector's processes, served policies, views,
postprocess hooks, aligned batches and the Ray wire; an agent that joins later laid out from its space; anything else
refused naming the agent, its policy and what came."""

from __future__ import annotations

from functools import partial

import gymnasium as gym
import numpy as np
import optree
import pytest

pettingzoo = pytest.importorskip("pettingzoo")

import shmbuf  # noqa: E402  # after the importorskip: the modules need pettingzoo
from tests.helpers_masked import (  # noqa: E402  # same
    POLICIES,
    MaskedEnv,
    plain_streams,
    player_policy,
    scout_policy,
    team,
)
from tests.helpers_multiagent import assert_same_streams, at, run_loop, same, stored_streams  # noqa: E402  # same
from workers._multiagent import multiagent_examples  # noqa: E402  # same


def assert_zeros_where_away(out):
    """Every obs leaf of every row not valid holds zeros (an agent away, or past a round's fill)."""
    for rollouts in out.values():
        for r in rollouts:
            st = r["data"]["step"]
            for leaf in optree.tree_leaves(st["obs"]):
                assert not leaf[~st["valid"]].any()


def test_the_layout_of_a_dict_and_a_tuple_observation_has_a_leaf_per_component():
    """Players (present at the reset) are laid out from their first observation, the scout (absent) from its space."""
    examples, rows = multiagent_examples([MaskedEnv(0), MaskedEnv(1)], POLICIES, team, rollout_len=4, seed=0)
    player, scout = examples["player"]["step"]["obs"], examples["scout"]["step"]["obs"]
    assert {k: (a.shape, a.dtype) for k, a in player.items()} == {"observation": ((4, 4, 3), np.float32),
                                                                   "action_mask": ((4, 4, 4), np.int8)}
    assert isinstance(scout, tuple) and scout[0].shape == (4, 2, 2) and scout[0].dtype == np.float64
    assert scout[1]["action_mask"].shape == (4, 2, 4) and scout[1]["action_mask"].dtype == np.int8
    assert examples["player"]["episode"]["final_obs"]["action_mask"].shape == (16, 4)  # T x rows
    assert rows.policies["scout"] == [(0, "scout_0"), (1, "scout_0")]


@pytest.mark.parametrize("n_envs", [1, 2])
def test_every_stored_row_of_dict_and_tuple_observations_is_what_the_env_returned(n_envs):
    """Truncate-episodes rounds: each agent's stream (observation leaves, action, reward, flags, successor, extras)
    equals the plain loop's, through the scout's joins and ends, episode ends and round ends; the masks the policies
    acted on were their own (the env raises otherwise); rows of agents away hold zeros in every leaf."""
    rounds, T = 8, 4
    out, rows, loop = run_loop(n_envs, rounds, rollout_len=T, policies=POLICIES, policy_mapping_fn=team,
                               make_env=MaskedEnv)
    got = stored_streams(out, rows)
    want = plain_streams(n_envs, rounds * T)
    assert set(got) == set(want)
    assert all(len(got[k]) == len(want[k]) for k in want)  # every transition, none invented
    assert_same_streams(got, want)
    assert isinstance(got[(0, "player_0")][0]["obs"], dict) and isinstance(got[(0, "scout_0")][0]["obs"], tuple)
    assert_zeros_where_away(out)
    assert loop.episodes > 0


def test_complete_episodes_of_dict_observations_hold_each_agents_whole_episode():
    """batch_mode='complete_episodes': each rollout one agent's episode of dict (or tuple) observations, its
    bootstrap the final observation; read back per agent in commit order they equal the plain loop's."""
    out, rows, _ = run_loop(2, 24, rollout_len=12, batch_mode="complete_episodes", policies=POLICIES,
                            policy_mapping_fn=team, make_env=MaskedEnv)
    want = plain_streams(2, 60)
    got = {}
    for pid, rollouts in out.items():
        for r in sorted(rollouts, key=lambda r: (r["lane"], r["seq"])):
            d, n = r["data"], r["fill"]["step"]
            st = d["step"]
            key = rows.policies[pid][int(d["episode"]["env"])]
            for t in range(n):
                tr = {"obs": at(st["obs"], t), "action": int(st["action"][t]), "reward": st["reward"][t],
                      "terminated": bool(st["terminated"][t]), "truncated": bool(st["truncated"][t]),
                      "succ": at(st["obs"], t + 1) if t + 1 < n else d["bootstrap"]["obs"]}
                if "value" in st:
                    tr["value"] = st["value"][t]
                got.setdefault(key, []).append(tr)
    assert set(got) == set(want)
    assert_same_streams(got, want)


class PrevViews:
    """A player policy on views: acts on the current observation's mask, and checks that its previous observation
    is its own stream's (``t - 1``), or at the episode's start the first observation itself (RLlib's fill for an
    observation column, docs/views.md)."""

    def __call__(self, x):
        now, prev = x["obs"], x["prev_obs"]
        assert isinstance(now, dict) and isinstance(prev, dict), (type(now), type(prev))
        for o, p in zip(now["observation"], prev["observation"], strict=True):
            if o[2] == 0:
                assert np.array_equal(p, o), (o, p)
            else:
                assert np.array_equal(p, o - np.array([0, 0, 1], np.float32)), (o, p)
        return player_policy(now)


def test_views_of_dict_observations_keep_their_structure_per_agent_stream():
    """view_requirements on a policy of dict observations: its input's views are dicts of batched arrays, each row
    its own agent's stream; what it stores is the plain loop's."""
    from shmbuf.storage import ViewRequirement

    reqs = {"obs": ViewRequirement("obs"), "prev_obs": ViewRequirement("obs", shift=-1)}
    policies = {"player": PrevViews(), "scout": scout_policy}
    out, rows, _ = run_loop(2, 6, rollout_len=4, policies=policies, policy_mapping_fn=team, make_env=MaskedEnv,
                            view_requirements={"player": reqs})
    got = stored_streams(out, rows)
    want = plain_streams(2, 24)
    assert all(len(got[k]) == len(want[k]) for k in want)
    assert_same_streams(got, want)


def mask_hook(sample_batch, other_agent_batches, episode=None):
    """RLlib's postprocess_trajectory on dict observations: each step's next legal-action count, and how many of the
    other agents' steps at the same env steps it saw (their observations dicts or tuples, as the env made them)."""
    assert isinstance(sample_batch["obs"], dict) and isinstance(sample_batch["new_obs"], dict)
    sample_batch["next_legal"] = sample_batch["new_obs"]["action_mask"].sum(1).astype(np.int64)
    seen = np.zeros(len(sample_batch["t"]), np.int64)
    for agent_id, (_, _, other) in (other_agent_batches or {}).items():
        kind = tuple if agent_id.startswith("scout") else dict
        assert isinstance(other["obs"], kind) and isinstance(other["new_obs"], kind), (agent_id, type(other["obs"]))
        seen += np.isin(sample_batch["t"], other["t"])
    sample_batch["others_seen"] = seen
    return sample_batch


@pytest.mark.parametrize("serve", [False, True], ids=["in-actors", "served"])
def test_the_collector_delivers_dict_observations_as_the_env_returned_them(serve):
    """Two actor processes (env 0 and env 1), aligned: each actor's stored streams equal the plain loop's; a hook's
    columns are read from dict observations; agents() gives each agent's dict column; the batch crosses RayCollector's
    multi-agent wire unchanged."""
    from shmbuf.layout import successors
    from workers import MultiAgentCollector
    from workers._ray_wire import pack_multiagent_batch, unpack_multiagent_batch

    T = 8
    batches = []
    with MultiAgentCollector([partial(MaskedEnv, 0), partial(MaskedEnv, 1)], POLICIES, policy_mapping_fn=team,
                             frames_per_batch=2 * T, copy=True, timeout=60, align=True, serve=serve,
                             postprocess={"player": mask_hook}) as c:
        for b in c:
            batches.append(b)
            if len(batches) == 3:
                break
        rows, schemas = c.rows, c.schemas
    per_actor: dict = {}
    for b in batches:
        x = b["player"]
        obs = x.data["step"]["obs"]
        assert set(obs) == {"observation", "action_mask"} and obs["action_mask"].shape == (2, T, 2, 4)
        succ = successors(x.data, x.fill)
        v = x.data["step"]["valid"]
        assert np.array_equal(x.data["step"]["next_legal"][v], succ["action_mask"][v].sum(-1))  # the hook's column
        assert (x.data["step"]["others_seen"][v] >= 1).all()  # the other player acts at every step of a player
        cols = b.agents("obs")
        obs, valid = cols[(0, "player_1")]
        assert isinstance(obs, dict) and np.array_equal(obs["action_mask"][valid],
                                                        x.data["step"]["obs"]["action_mask"][:, :, 1][valid])
        scout, scout_valid = cols[(0, "scout_0")]
        assert isinstance(scout, tuple) and scout_valid.any()
        wire = pack_multiagent_batch(schemas, b)
        back = unpack_multiagent_batch((wire[0], [(h, list(a)) for h, a in wire[1]]), schemas, "truncate_episodes",
                                       True, "a batch")
        for pid, part in back.policies.items():
            assert same(part.data, b[pid].data), pid
        actor_of = b["player"].lane  # aligned: row i of every policy is one actor's round; lanes differ by pipeline
        for pid, part in b.items():
            for i in range(len(part.seq)):
                per_actor.setdefault(int(actor_of[i]), {}).setdefault(pid, []).append(
                    {"seq": int(part.seq[i]), "fill": {"step": int(part.fill["step"][i]),
                                                       "episode": int(part.fill["episode"][i])},
                     "data": optree.tree_map(lambda a, i=i: a[i], part.data)})
    assert len(per_actor) == 2 or len(batches) * 2 == sum(len(v["player"]) for v in per_actor.values())
    for out in per_actor.values():
        assert sorted(r["seq"] for r in out["player"]) == list(range(len(out["player"])))  # from the start, none missing
        env_id = int(out["player"][0]["data"]["step"]["obs"]["observation"][0, 0, 0])
        got = stored_streams(out, rows)
        want = plain_streams(1, len(out["player"]) * T, env_ids=[env_id])
        assert all(len(got[k]) == len(want[k]) for k in got)
        assert_same_streams(got, want)


# -- refused: anything but an array, or a dict or tuple of them --------------------------------------------------


class TextScoutEnv(MaskedEnv):
    def observation_space(self, agent):
        return gym.spaces.Text(8) if agent == "scout_0" else super().observation_space(agent)


class StrObsEnv(MaskedEnv):
    def _obs(self, agent):
        return f"{agent} at {self.t}"

    def observation_space(self, agent):
        return gym.spaces.Text(16)


class NoneLeafEnv(MaskedEnv):
    def _obs(self, agent):
        o = super()._obs(agent)
        return {**o, "action_mask": None} if isinstance(o, dict) else o


class IntKeyEnv(MaskedEnv):
    def _obs(self, agent):
        o = super()._obs(agent)
        return {0: o["observation"]} if isinstance(o, dict) else o


@pytest.mark.parametrize(("env", "says"), [
    (TextScoutEnv, r"envs\[0\]: agent 'scout_0' \(policy 'scout', absent at the first reset\): its observation_space is "
                   r"Text\(1, 8"),
    (StrObsEnv, r"envs\[0\]: agent 'player_0' \(policy 'player'\): expected an observation that is a numpy array .*, got "
                r"str \(its observation_space is Text\(1, 16"),
    (NoneLeafEnv, r"agent 'player_0' \(policy 'player'\): expected an observation .*, got NoneType at obs\['action_mask'\]"),
    (IntKeyEnv, r"agent 'player_0' \(policy 'player'\): .*got a dict with the key 0 \(int; keys must be str\)"),
], ids=["text-space-of-an-agent-joining-later", "str-observation", "none-leaf", "int-key"])
def test_an_observation_of_another_kind_is_refused_naming_the_agent_the_policy_and_what_came(env, says):
    with pytest.raises(shmbuf.UsageError, match=says):
        multiagent_examples([env(0)], POLICIES, team, rollout_len=4, seed=0)


class LosesMaskEnv(MaskedEnv):
    """player_1's observation at step 3 lacks its action mask."""

    def _obs(self, agent):
        o = super()._obs(agent)
        return {"observation": o["observation"]} if agent == "player_1" and self.t == 3 else o


class ScoutDictEnv(MaskedEnv):
    """The scout joins with a dict, where its space (and so its rows) say a tuple."""

    def _obs(self, agent):
        o = super()._obs(agent)
        return {"pos": o[0]} if agent == "scout_0" else o


@pytest.mark.parametrize(("env", "says"), [
    (LosesMaskEnv, r"envs\[0\]: agent 'player_1' \(policy 'player'\)'s observation: expected a dict with keys "
                   r"\['action_mask', 'observation'\], got a dict with keys \['observation'\]"),
    (ScoutDictEnv, r"envs\[0\]: agent 'scout_0' \(policy 'scout'\)'s observation: expected a tuple of 2, got dict"),
], ids=["a-key-missing", "a-dict-for-a-tuple"])
def test_an_observation_whose_structure_changes_is_refused_naming_the_agent_and_the_path(env, says):
    with pytest.raises(shmbuf.SchemaError, match=says):
        run_loop(1, 4, rollout_len=4, policies=POLICIES, policy_mapping_fn=team, envs=[env(0)], make_env=MaskedEnv)


def test_the_docs_block_collects_dict_observations_and_every_action_obeys_its_mask(tmp_path):
    """docs/multiagent.md's Dict observations block, as written: one leaf per component, every stored action legal."""
    from tests.helpers import doc_blocks, run_doc_block

    k = next(i for i, b in enumerate(doc_blocks("multiagent.md")) if "action_mask" in b)
    lines = run_doc_block("multiagent.md", k, tmp_path).splitlines()
    assert lines == ["{'action_mask': (2, 10, 2, 5), 'observation': (2, 10, 2, 5)}", "every action legal: True"] * 2, lines
