"""Frame stacks and previous actions at an episode's start, against RLlib's own ``AgentCollector`` (ray 2.60.0).

RLlib fills a position before an episode's first step with the episode's first observation for ``obs`` (its
buffers start with ``shift_before`` copies of the reset observation), and with zeros for actions and rewards (a
Policy's default view requirements hold ``prev_actions`` and ``prev_rewards``, whose buffers start from zeros of
the space). The same stream goes through RLlib's collector (one per episode, as its sampler keeps them), through
shmbuf's learner side (``build_views`` over the stored rollout) and its actor side (``ActorViews``, step by step).

Importing ``ray.rllib.evaluation.collectors.agent_collector`` needs, besides ray and gymnasium: pandas, requests,
pyarrow, fsspec, pydantic, dm-tree and pyyaml (RLlib's own requirements, in the ``test`` extra).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shmbuf import UsageError
from shmbuf.storage.views import ViewRequirement as VR
from shmbuf.storage.views import build_views
from workers.lowlevel import ActorViews

agent_collector = pytest.importorskip("ray.rllib.evaluation.collectors.agent_collector",
                                      reason="RLlib's AgentCollector (ray[rllib]'s requirements) is the reference")
from gymnasium.spaces import Box, Discrete  # noqa: E402  (after the importorskip above)
from ray.rllib.policy.sample_batch import SampleBatch as SB  # noqa: E402  (after the importorskip above)
from ray.rllib.policy.view_requirement import ViewRequirement as RLlibVR  # noqa: E402  (after the importorskip above)

OBS_SPACE = Box(-1e6, 1e6, (2,), np.float32)
ACT_SPACE = Discrete(100)
LENGTHS = (4, 3, 2)  # episode 0 and 1 end (terminated, truncated); episode 2 runs on past the rollout
SHMBUF_REQS = {
    "stack": VR("obs", shift="-3:0"),               # a frame stack
    "prev_actions": VR("action", shift=-1),         # SampleBatch.PREV_ACTIONS
    "prev_rewards": VR("reward", shift=-1),         # SampleBatch.PREV_REWARDS
    "prev_two": VR("action", shift="-2:-1"),
}


def rllib_reqs() -> dict[str, Any]:
    """A Policy's default requirements (obs, actions, rewards, flags, prev_actions, prev_rewards) and ours."""
    train_only = {"used_for_compute_actions": False}
    return {
        SB.OBS: RLlibVR(space=OBS_SPACE),
        SB.NEXT_OBS: RLlibVR(SB.OBS, shift=1, space=OBS_SPACE, **train_only),
        SB.ACTIONS: RLlibVR(space=ACT_SPACE, **train_only),
        SB.REWARDS: RLlibVR(**train_only),
        SB.TERMINATEDS: RLlibVR(**train_only),
        SB.TRUNCATEDS: RLlibVR(**train_only),
        SB.PREV_ACTIONS: RLlibVR(SB.ACTIONS, shift=-1, space=ACT_SPACE),
        SB.PREV_REWARDS: RLlibVR(SB.REWARDS, shift=-1),
        "stack": RLlibVR(SB.OBS, shift="-3:0", space=OBS_SPACE),
        "prev_two": RLlibVR(SB.ACTIONS, shift="-2:-1", space=ACT_SPACE),
    }


def stream() -> list[dict[str, Any]]:
    """Every step: the observation acted on (never zero), the action, reward, flags and the next observation."""
    steps = []
    for k, n in enumerate(LENGTHS):
        for s in range(n):
            last = s == n - 1 and k < 2
            steps.append({"obs": np.array([10 * k + s + 1, -(10 * k + s + 1)], np.float32), "action": 10 * k + s + 1,
                          "reward": np.float32(100 * k + s + 1), "terminated": last and k == 0,
                          "truncated": last and k == 1,
                          "next_obs": np.array([10 * k + s + 2, -(10 * k + s + 2)], np.float32)})
    return steps


def rllib_columns() -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """RLlib's inference inputs at every step and its train batches, concatenated over the episodes."""
    infer: dict[str, list[Any]] = {k: [] for k in SHMBUF_REQS}
    train: dict[str, list[Any]] = {k: [] for k in SHMBUF_REQS}
    reqs = rllib_reqs()
    collector = None
    for i, st in enumerate(stream()):
        if collector is None:  # an episode's first step: a new collector, reset obs
            collector = agent_collector.AgentCollector(reqs, is_training=True)
            collector.add_init_obs(episode_id=i, agent_index=0, env_id=0, init_obs=st["obs"], t=-1)
        x = collector.build_for_inference()
        for k in SHMBUF_REQS:
            infer[k].append(np.asarray(x[k])[0])
        collector.add_action_reward_next_obs({SB.ACTIONS: st["action"], SB.REWARDS: float(st["reward"]),
                                              SB.TERMINATEDS: st["terminated"], SB.TRUNCATEDS: st["truncated"],
                                              SB.NEXT_OBS: st["next_obs"]})
        if st["terminated"] or st["truncated"] or i == sum(LENGTHS) - 1:
            batch = collector.build_for_training(reqs)
            for k in SHMBUF_REQS:
                train[k].extend(np.asarray(batch[k]))
            collector = None
    return infer, train


def rollout() -> dict[str, Any]:
    """The stream as one truncate-episodes rollout of a single env, as workers.ActorLoop writes it."""
    st = stream()
    ends = [t for t, x in enumerate(st) if x["terminated"] or x["truncated"]]
    return {
        "step": {"obs": np.stack([x["obs"] for x in st]), "action": np.array([x["action"] for x in st], np.int64),
                 "reward": np.array([x["reward"] for x in st], np.float32),
                 "terminated": np.array([x["terminated"] for x in st]), "truncated": np.array([x["truncated"] for x in st])},
        "episode": {"end": np.array(ends, np.int32), "env": np.zeros(len(ends), np.int32),
                    "final_obs": np.stack([st[t]["next_obs"] for t in ends])},
        "bootstrap": {"obs": st[-1]["next_obs"]},
    }


def actor_inputs(reqs: dict[str, VR]) -> dict[str, list[Any]]:
    """What shmbuf's actor side hands the policy at every step of the stream."""
    st = stream()
    views = ActorViews(reqs, st[0]["obs"][None], 1, ACT_SPACE)
    seen: dict[str, list[Any]] = {k: [] for k in reqs}
    for i, x in enumerate(st):
        for k, v in views.inputs().items():
            seen[k].append(np.array(v[0]))
        ended = x["terminated"] or x["truncated"]
        nxt = st[i + 1]["obs"] if ended else x["next_obs"]  # the driver hands over the reset obs after an end
        views.advance(np.array([x["action"]]), {}, np.array([x["reward"]]), np.array([x["terminated"]]),
                      np.array([x["truncated"]]), nxt[None])
    return seen


def test_learner_columns_are_rllibs_train_batch() -> None:
    """``build_views``: the frame stack repeats each episode's first observation before its start, previous
    actions and rewards are zeros there, column for column what RLlib's ``build_for_training`` gives."""
    _, train = rllib_columns()
    cols = build_views(rollout(), SHMBUF_REQS)
    for k in SHMBUF_REQS:
        np.testing.assert_array_equal(cols[k], np.stack(train[k]).astype(cols[k].dtype), err_msg=k)
    assert cols["stack"][4].tolist() == [[11, -11]] * 4  # episode 1's first step: its first observation, four times


def test_actor_inputs_are_rllibs_inputs() -> None:
    """``ActorViews`` (the policy's input at every step): the frame stack is what RLlib's ``build_for_inference``
    gives, and every column what RLlib's train batch holds for that step, so the actor acts on what the learner
    trains on. (RLlib's ``build_for_inference`` reads actions and rewards one step further back than its train
    batch when ``prev_actions`` / ``prev_rewards`` are requirements, since their buffers are built at the reset;
    its sampler's ``get_inference_input_dict`` reads the previous ones, as its train batch and shmbuf do.)"""
    infer, train = rllib_columns()
    seen = actor_inputs(SHMBUF_REQS)
    np.testing.assert_array_equal(np.stack(seen["stack"]), np.stack(infer["stack"]))
    for k in SHMBUF_REQS:
        np.testing.assert_array_equal(np.stack(seen[k]), np.stack(train[k]).astype(seen[k][0].dtype), err_msg=k)


def test_fill_zeros_keeps_zeros_for_observations_on_both_sides() -> None:
    """``fill="zeros"``: zeros before an episode's start for ``obs`` too, the same on the actor and learner sides."""
    reqs = {"stack": VR("obs", shift="-3:0", fill="zeros"), "first": VR("obs", shift="-3:0")}
    cols = build_views(rollout(), reqs)
    seen = actor_inputs(reqs)
    assert cols["stack"][4].tolist() == [[0, 0], [0, 0], [0, 0], [11, -11]]
    assert cols["first"][4].tolist() == [[11, -11]] * 4
    for k in reqs:
        np.testing.assert_array_equal(np.stack(seen[k]), cols[k], err_msg=k)


def test_fill_first_is_for_observations_only_and_a_bad_fill_is_named() -> None:
    with pytest.raises(UsageError, match=r"fill='first'\) on column 'action'.*only observations"):
        build_views(rollout(), {"pa": VR("action", shift=-1, fill="first")})
    with pytest.raises(UsageError, match=r"fill='first'\) on column 'action'"):
        ActorViews({"pa": VR("action", shift=-1, fill="first")}, np.zeros((1, 2), np.float32), 1, ACT_SPACE)
    with pytest.raises(UsageError, match=r"ViewRequirement\(fill=\.\.\.\): expected None.*'first' or 'zeros', got 'edge'"):
        VR("obs", shift=-1, fill="edge")
