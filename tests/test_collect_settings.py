"""workers.CollectSettings: what every collector shares, checked once, given as settings= or as keywords (the
frameworks' names for its fields translated), the same object for every collector."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

import shmbuf
from tests.helpers_workers import EchoPolicy, make_counting
from workers import AsyncBatchedCollector, Collector, CollectSettings, MultiAgentCollector


def _tagged(batch):
    return "seen", batch


@pytest.mark.parametrize(("kw", "says"), [
    ({"rollout_len": 1}, r"rollout_len"),
    ({"num_actors": 0}, r"num_actors"),
    ({"batch_mode": "whole"}, r"batch_mode"),
    ({"timeout": -1}, r"timeout"),
    ({"stop_timeout": "soon"}, r"stop_timeout: expected a number of seconds >= 0, got 'soon'"),
    ({"restart": 1}, r"restart: expected a bool, got 1"),
    ({"seed": 1.5}, r"seed: expected an int or None, got 1.5"),
    ({"on_batch": 3}, r"on_batch: expected a callable"),
    ({"soft_limit": True}, r"soft_limit=True needs episode_limit="),
])
def test_each_field_is_checked_when_made_naming_it(kw, says):
    with pytest.raises(shmbuf.UsageError, match=says):
        CollectSettings(**kw)


def test_settings_are_frozen_and_replace_makes_another():
    s = CollectSettings(rollout_len=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rollout_len = 8  # type: ignore[misc]  # the assignment is the test
    assert dataclasses.replace(s, rollout_len=8).rollout_len == 8 and s.rollout_len == 4
    with pytest.raises(shmbuf.UsageError, match="rollout_len"):
        dataclasses.replace(s, rollout_len=0)


def test_a_collector_takes_settings_and_a_keyword_wins_over_the_same_field():
    s = CollectSettings(rollout_len=4, copy=True, start_method="fork", timeout=30, seed=None)
    with Collector([make_counting] * 2, EchoPolicy(), frames_per_batch=16, settings=s, rollout_len=8) as c:
        assert c.settings.rollout_len == c.rollout_len == 8 and c.rollouts_per_batch == 2
        assert c.copy and c.timeout == 30 and c.settings.seed is None
        b = next(iter(c))
        assert b.data["step"]["obs"].shape == (2, 8, 3)
    with pytest.raises(shmbuf.UsageError, match=r"settings: expected a workers.CollectSettings, got dict"):
        Collector([make_counting], EchoPolicy(), frames_per_batch=16, settings={"rollout_len": 4})


def test_frameworks_names_are_the_fields_and_a_setting_is_given_once():
    with Collector([make_counting], EchoPolicy(), frames_per_batch=8, rollout_len=4, horizon=3, postproc=_tagged,
                   reset_at_each_iter=True, start_method="fork", timeout=30) as c:
        assert c.settings.episode_limit == 3 and c.settings.on_batch is _tagged and c.settings.reset_each_rollout
        tag, batch = next(iter(c))  # postproc (the engine's on_batch) ran on the batch
        assert tag == "seen" and batch.frames == 8
    with pytest.raises(shmbuf.UsageError, match=r"horizon= \(RLlib's name\) and episode_limit= are one setting"):
        Collector([make_counting], EchoPolicy(), frames_per_batch=8, horizon=3, episode_limit=3)
    with pytest.raises(shmbuf.UsageError, match=r"Collector\(rollout_length=...\): not a setting of Collector"):
        Collector([make_counting], EchoPolicy(), frames_per_batch=8, rollout_length=4)


def test_every_collector_takes_the_same_settings_object():
    from tests.helpers_multiagent import POLICIES, JoinLeaveEnv, mapping

    s = CollectSettings(rollout_len=4, start_method="fork", timeout=60, copy=True)
    with MultiAgentCollector([partial(JoinLeaveEnv, 0)] * 2, POLICIES, policy_mapping_fn=mapping, frames_per_batch=16,
                             settings=s) as m:
        assert m.settings.rollout_len == m.rollout_len == 4 and set(next(iter(m))) == {"red", "blue"}
    with AsyncBatchedCollector([make_counting] * 2, EchoPolicy(), frames_per_batch=16, settings=s) as a:
        assert a.rollout_len == 4 and a.served and next(iter(a)).data["step"]["obs"].shape == (4, 4, 3)


def test_ray_collector_gives_its_nodes_the_fields_a_settings_object_sets():
    pytest.importorskip("ray")
    from workers import _ray

    assert _ray._given_fields(None) == {}
    assert _ray._given_fields(CollectSettings(rollout_len=8, restart=True)) == {"rollout_len": 8, "restart": True}
    with pytest.raises(shmbuf.UsageError, match="settings: expected a workers.CollectSettings, got dict"):
        _ray._given_fields({"rollout_len": 8})
