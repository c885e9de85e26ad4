"""max_policy_lag on the collectors: every rollout of every batch within the setting, under a slow learner, a slow
actor, several updates per batch, complete episodes and aligned multi-agent rounds; slots sized from the lag."""

from __future__ import annotations

import time
import warnings
from functools import partial
from typing import Any

import numpy as np
import pytest

import shmbuf
import workers
from tests.helpers_workers import CountingEnv, EchoPolicy, make_counting


class SlowActorEnv(CountingEnv):
    """A CountingEnv whose env 1 sleeps now and then: one actor falls behind the other, for a while."""

    def step(self, action: Any) -> Any:
        if self.env_id == 1 and self.t == 3 and self.k % 3 == 0:
            time.sleep(0.15)
        return super().step(action)


def slow_actor_env(env_id: int) -> SlowActorEnv:
    return SlowActorEnv(env_id)


def run(collector: Any, batches: int, *, learner_s: float = 0.0, updates: int = 1) -> list[list[int]]:
    """Each batch's policy_lag; after each batch, ``updates`` weight updates (a learner taking ``learner_s``)."""
    lags = []
    w = 0.0
    for k, batch in enumerate(collector):
        parts = batch.values() if isinstance(batch, dict) else [batch]
        lags.append([int(x) for p in parts for x in np.asarray(p.policy_lag).ravel()])
        if learner_s:
            time.sleep(learner_s)
        for _ in range(updates):
            w += 1.0
            collector.update_policy_weights({"w": np.array([w], np.float32)})
        if k + 1 == batches:
            break
    return lags


def collector(lag: int | None, env: Any = make_counting, actors: int = 2, **kw: Any) -> workers.Collector:
    kw.setdefault("frames_per_batch", 16 * actors)
    kw.setdefault("rollout_len", 16)
    return workers.Collector([partial(env, i) for i in range(actors)], EchoPolicy(), weights={"w": np.zeros(1, np.float32)},
                             max_policy_lag=lag, timeout=60, **kw)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_slow_learner_never_gets_a_rollout_older_than_the_setting(lag: int) -> None:
    with collector(lag) as c:
        assert c.reader.slots == 2 * (lag + 1)  # B x (lag + 1): B = 2 rollouts a batch
        lags = run(c, 12, learner_s=0.05)
        stats = c.stats()
    assert max(max(b) for b in lags) <= lag, lags
    if lag == 1:  # the actors collect during the update: the batches after the first are one version behind
        assert sum(1 for b in lags if max(b) == 1) >= 6, lags
    assert stats["max_policy_lag"] == lag
    if lag == 0:  # every slot comes back after the learner published, and an actor claims it before it reads the
        assert stats["stale_dropped"] == 0  # weights: nothing is ever collected with a version already old


def test_free_running_with_many_slots_runs_further_behind_the_setting_is_what_bounds_it() -> None:
    with collector(None, slots=12) as c:
        free = run(c, 12, learner_s=0.05)
    assert max(max(b) for b in free) > 1, free  # the same loop, no setting: the lag is whatever the speeds make it


def test_a_slow_actor_and_several_updates_a_batch_still_hold_the_setting() -> None:
    with collector(1, env=slow_actor_env) as c:
        lags = run(c, 12, updates=3)
        dropped = c.stats()["stale_dropped"]
    assert max(max(b) for b in lags) <= 1, lags
    assert dropped > 0  # three versions a batch: what the actors had when they claimed is too old by the next batch


def test_complete_episodes_hold_the_setting() -> None:
    with collector(0, batch_mode="complete_episodes", frames_per_batch=40, rollout_len=128) as c:
        lags = run(c, 6, learner_s=0.02)
    assert max(max(b) for b in lags) == 0, lags


class Weighted:
    """A multi-agent policy (actions from the observation) that takes broadcast weights."""

    def __call__(self, obs: Any) -> Any:
        obs = np.asarray(obs)
        return (obs[:, 1] * 100 + obs[:, 2]).astype(np.int64)

    def load_weights(self, params: Any) -> None:
        self.w = params["w"]


@pytest.mark.parametrize("align", [True, False])
def test_multiagent_streams_hold_the_setting_a_round_at_a_time(align: bool) -> None:
    """Several policies under a lag are taken as whole rounds, aligned or not. As runs of views (each policy's batch
    a run of its own B slots) an actor's round, which holds a slot of every policy, could wait for ever: the readers'
    slots lent ahead gave the last red slot to one actor and the last blue slot to the other (a stall within 1,000
    batches in most runs, without load)."""
    pytest.importorskip("pettingzoo")
    from tests.helpers_multiagent import JoinLeaveEnv, mapping

    zero = {"w": np.zeros(1, np.float32)}
    c = workers.MultiAgentCollector([partial(JoinLeaveEnv, i) for i in range(2)], {"red": Weighted(), "blue": Weighted()},
                                    policy_mapping_fn=mapping, frames_per_batch=16, rollout_len=4, max_policy_lag=0,
                                    timeout=30, align=align, weights={"red": zero, "blue": zero})
    try:
        lags: list[int] = []
        for k, batch in enumerate(c):
            lags += [int(x) for p in batch.values() for x in np.asarray(p.policy_lag).ravel()]
            assert batch.aligned == align  # what was asked: whole rounds are not called aligned unless they were asked
            w = {"w": np.array([k + 1.0], np.float32)}
            c.update_policy_weights({"red": w, "blue": w})
            if k == 999:
                break
    finally:
        c.close()
    assert k == 999 and lags and max(lags) == 0, lags


@pytest.mark.parametrize("slots, why", [(1, "fewer can never fill a batch"), (5, "more would collect rollouts more "
                                                                              "than 1 version")])
def test_slots_that_cannot_hold_the_lag_are_refused_naming_the_range(slots: int, why: str) -> None:
    with pytest.raises(shmbuf.UsageError, match=rf"slots={slots} with max_policy_lag=1: a batch is 2 rollouts, so the "
                                                rf"lag holds with slots from 2 to 4 .*{why}"):
        collector(1, slots=slots)


@pytest.mark.parametrize("bad", [-1, 0.5, True])
def test_a_bad_lag_is_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(shmbuf.UsageError, match=r"max_policy_lag: expected an int >= 0"):
        collector(bad)


def test_the_learners_torch_threads_are_checked_as_the_collector_starts() -> None:
    torch = pytest.importorskip("torch")
    from workers._learner_cpu import cores

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores() + 1)
        with pytest.warns(RuntimeWarning, match=r"learner_threads='auto'"):
            collector(None).close()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            collector(None, learner_threads="auto").close()
        assert torch.get_num_threads() == max(1, cores() - 2)
    finally:
        torch.set_num_threads(before)


def test_the_on_policy_page_runs_and_prints_what_it_says(tmp_path: Any) -> None:
    from tests.helpers import doc_blocks, run_doc_block

    assert len(doc_blocks("on-policy.md")) == 1
    out = run_doc_block("on-policy.md", 0, tmp_path, timeout=180)
    # 0 or 1 each, as promised; which ones arrive depends on the speeds (a learner that is never behind sees only 0)
    assert out.strip() == "slots: 4 every lag <= 1: True", out


@pytest.mark.parametrize("bad", [-1, 0.5])
def test_ray_collector_refuses_a_bad_lag_naming_the_setting(bad: Any) -> None:
    pytest.importorskip("ray")
    with pytest.raises(shmbuf.UsageError, match=r"RayCollector\(max_policy_lag=...\): expected an int >= 0"):
        workers.RayCollector(make_counting, EchoPolicy(), frames_per_batch=32, max_policy_lag=bad)


class _Rollout:
    """What Taker.rounds reads of a rollout: its round's name (pid, seq), its data and its version."""

    def __init__(self, seq: int, version: int):
        self.pid, self.seq, self.lane, self.epoch, self.policy_version = 7, seq, 0, 0, version
        self.data, self.fill = {"x": np.zeros(2)}, {"step": 2}

    def __enter__(self) -> _Rollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Stream:
    """A reader that hands out the rollouts it is given, then has none (SlotTimeout)."""

    def __init__(self, *rollouts: _Rollout):
        self.queue = list(rollouts)

    def get(self, timeout: float) -> _Rollout:
        if not self.queue:
            raise shmbuf.SlotTimeout("none ready")
        return self.queue.pop(0)


def test_a_round_too_old_is_dropped_whole_and_forgotten_once_all_its_rollouts_came() -> None:
    """Round 0 (version 0) is too old for the learner's version 2 at lag 0: the rollout of stream "a" is dropped as the
    round is, the one of "b" as it arrives later; then nothing of round 0 is kept, and round 1 (version 2) is the
    batch."""
    from workers._take import Taker

    a, b = _Stream(_Rollout(0, 0)), _Stream()
    taker = Taker({"a": a, "b": b}, check=lambda: None, leaving=lambda: False, timeout=5.0, copy=True, rollouts=1,
                  frames_per_batch=2, collector="test", stream_name=str, max_policy_lag=0, versions={"a": 2, "b": 2})
    with pytest.raises(shmbuf.SlotTimeout):  # round 0 dropped, nothing whole: the wait runs out
        taker.timeout = 0.2
        taker.rounds()
    assert taker.stale_dropped == 1 and taker._dropped == {(7, 0): 1}
    b.queue.append(_Rollout(0, 0))  # round 0's other rollout, late
    a.queue.append(_Rollout(1, 2))
    b.queue.append(_Rollout(1, 2))
    taker.timeout = 5.0
    out = taker.rounds()
    assert [r[4] for r in out["a"]] == [1] and [r[4] for r in out["b"]] == [1]  # round 1's seq
    assert taker.stale_dropped == 2 and taker._dropped == {}  # nothing left to remember of round 0
