"""The collector's batch arithmetic (workers._plan.plan_batches): a pure function, tested without env or process."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from shmbuf import UsageError
from shmbuf.layout import COMPLETE_EPISODES, TRUNCATE_EPISODES
from workers._plan import BatchPlan, default_num_actors, plan_batches


def test_truncate_default_rollout_len_is_one_rollout_per_actor_per_batch() -> None:
    plan = plan_batches(frames_per_batch=16, num_actors=2)
    assert plan == BatchPlan(batch_mode=TRUNCATE_EPISODES, frames_per_batch=16, num_actors=2, num_envs=1,
                             rollout_len=8, rollouts_per_batch=2, writers=2, slots=8)


def test_truncate_with_rollout_len_and_vector_envs() -> None:
    plan = plan_batches(frames_per_batch=60, num_actors=2, num_envs=3, rollout_len=5)
    assert (plan.rollout_len, plan.num_envs, plan.rollouts_per_batch, plan.writers) == (5, 3, 4, 2)
    assert plan.slots == 12  # three batches: two, and room for two rollouts a writer (4 of them) rounded up


def test_truncate_frames_per_batch_must_be_a_multiple_of_a_rollouts_frames() -> None:
    with pytest.raises(UsageError, match=r"frames_per_batch=10 is not a multiple of rollout_len \* num_envs = 4 \* 1; "
                                         r"use 8") as info:
        plan_batches(frames_per_batch=10, num_actors=2, rollout_len=4)
    assert isinstance(info.value, ValueError)
    with pytest.raises(UsageError, match="use 12"):
        plan_batches(frames_per_batch=14, num_actors=1, num_envs=3, rollout_len=2)


@pytest.mark.parametrize("B, writers", list(itertools.product([1, 2, 3, 4, 7, 16], [1, 2, 3, 8, 33])))
def test_default_slots_are_whole_batches_two_and_room_for_two_rollouts_a_writer(B: int, writers: int) -> None:
    plan = plan_batches(frames_per_batch=B * 4, num_actors=writers, rollout_len=4)
    assert plan.rollouts_per_batch == B and plan.writers == writers
    assert plan.slots % B == 0 and plan.slots >= 2 * B + 2 * writers
    assert plan.slots - B < 2 * B + 2 * writers  # the least number of whole batches that holds it


def test_slots_given_are_kept() -> None:
    assert plan_batches(frames_per_batch=8, num_actors=2, rollout_len=4, slots=6).slots == 6


def test_complete_episodes_one_lane_per_sub_env_and_the_env_limit_as_rollout_len() -> None:
    plan = plan_batches(batch_mode=COMPLETE_EPISODES, frames_per_batch=100, num_actors=2, num_envs=3,
                        max_episode_steps=200)
    assert plan == BatchPlan(batch_mode=COMPLETE_EPISODES, frames_per_batch=100, num_actors=2, num_envs=3,
                             rollout_len=200, rollouts_per_batch=0, writers=6, slots=32)
    given = plan_batches(batch_mode=COMPLETE_EPISODES, frames_per_batch=7, num_actors=1, rollout_len=8,
                         max_episode_steps=500)
    assert given.rollout_len == 8 and given.rollouts_per_batch == 0  # frames_per_batch is a minimum: no multiple


def test_complete_episodes_need_a_rollout_len_or_an_env_limit() -> None:
    with pytest.raises(UsageError, match=r"rollout_len: the env has no spec.max_episode_steps"):
        plan_batches(batch_mode=COMPLETE_EPISODES, frames_per_batch=100, num_actors=2)


def test_total_frames_round_up_to_whole_batches_in_truncate_mode_only() -> None:
    truncate = plan_batches(frames_per_batch=16, num_actors=2, rollout_len=4)
    assert [truncate.rounded_total(n) for n in (100, 112, 1, -1, 0)] == [112, 112, 16, None, None]
    complete = plan_batches(batch_mode=COMPLETE_EPISODES, frames_per_batch=20, num_actors=2, rollout_len=8)
    assert [complete.rounded_total(n) for n in (60, 61, -1)] == [60, 61, None]


@pytest.mark.parametrize("kw, match", [
    ({"frames_per_batch": 0}, r"frames_per_batch: expected an int >= 1, got 0"),
    ({"frames_per_batch": True}, r"frames_per_batch: expected an int >= 1, got True"),
    ({"frames_per_batch": 8.0}, r"frames_per_batch: expected an int >= 1, got 8.0"),
    ({"num_actors": 0}, r"num_actors: expected an int >= 1, got 0"),
    ({"num_envs": 0}, r"num_envs: expected an int >= 1, got 0"),
    ({"batch_mode": "episodes"}, r"batch_mode: expected one of \('truncate_episodes', 'complete_episodes'\)"),
    ({"rollout_len": 1}, r"rollout_len: expected an int >= 2, got 1"),
    ({"num_actors": 8}, r"rollout_len: expected an int >= 2, got 1"),  # the default T: 8 frames over 8 actors
])
def test_bad_settings_are_usage_errors_naming_the_setting(kw: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        plan_batches(**{"frames_per_batch": 8, "num_actors": 2, **kw})


def test_a_plan_is_frozen_and_the_default_actor_count() -> None:
    plan = plan_batches(frames_per_batch=8, num_actors=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.slots = 3  # type: ignore[misc]  # the point: it refuses
    assert [default_num_actors(n) for n in (1, 2, 5)] == [2, 2, 5]


def test_async_batched_collector_only_gives_collector_a_served_policy() -> None:
    """Composition, not hooks: AsyncBatchedCollector is Collector with a served placement, plus TorchRL's collector
    API (issue 22). It overrides exactly four of Collector's methods, each around Collector's own: ``iterator`` (to
    give TorchRL's batches, or write them into a replay buffer), ``close`` (to stop background collection too),
    ``shutdown`` (TorchRL's signature, closing through ``close``, with the background collection's error) and
    ``update_policy_weights_`` (TorchRL's forms for one served policy, where Collector broadcasts to its actors)."""
    import inspect

    from workers import AsyncBatchedCollector, Collector

    # its own: the class and its TorchRL façade parts (workers/compat/_torchrl_weights.py, _torchrl_replay.py), the
    # classes before Collector in its MRO
    mro = AsyncBatchedCollector.__mro__
    own = {k for cls in mro[:mro.index(Collector)] for k in vars(cls) if not k.startswith("__")}
    assert own & set(dir(Collector)) == {"close", "iterator", "shutdown", "update_policy_weights_"}
    assert "super().iterator()" in inspect.getsource(AsyncBatchedCollector.iterator)
    assert "super().close(timeout)" in inspect.getsource(AsyncBatchedCollector.close)
    assert "self.close(timeout)" in inspect.getsource(AsyncBatchedCollector.shutdown)
    torchrl_api = {"async_shutdown", "collecting", "env", "pause", "policy", "receive_weights", "start",
                   "update_policy_weights_"}  # set_seed, reset, state_dict, ...: Collector's (workers._torchrl_names)
    assert {k for k in own if not k.startswith("_")} == {"server", "table"} | torchrl_api | {"close", "iterator",
                                                                                          "shutdown"}
