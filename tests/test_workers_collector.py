"""Collector: batches from actor processes are exactly the envs' transitions; weights, errors, shutdown."""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import pytest

import shmbuf
from tests.helpers_workers import (
    EchoPolicy,
    WrongPolicy,
    check_complete,
    check_truncated,
    make_counting,
    make_counting_unless,
    make_vector,
    per_lane,
)
from workers import ActorError, Collector


def test_truncate_batches_are_the_exact_transitions():
    with Collector([make_counting] * 2, EchoPolicy(), frames_per_batch=16, total_frames=100, rollout_len=4,
                   copy=True, start_method="fork", timeout=30, seed=None) as c:
        batches = list(c)
        assert c.frames == 112 and c.batches == 7  # total_frames is rounded up to whole batches
        stats = c.stats()
    assert all(b.frames == 16 and b.data["step"]["obs"].shape == (4, 4, 3) for b in batches)
    lanes = per_lane(batches)
    assert len(lanes) == 2
    for rs in lanes.values():
        check_truncated(rs, [0], 4)
    assert stats["frames"] == 112 and stats["policy_lag_max"] == 0


def test_vector_env_next_step_autoreset_through_processes():
    with Collector(partial(make_vector, 3, "NextStep"), EchoPolicy(), num_actors=2, frames_per_batch=60,
                   total_frames=240, rollout_len=5, copy=True, start_method="forkserver", timeout=30, seed=None) as c:
        batches = list(c)
    assert batches[0].data["step"]["obs"].shape == (4, 5, 3, 3)
    for rs in per_lane(batches).values():
        check_truncated(rs, [0, 1, 2], 5)


def test_more_env_factories_than_actors_split_evenly_into_vector_envs():
    """Four factories, num_actors=2: two actors of two envs each (env ids 0,1 and 2,3), every transition exact; and
    a split that is not even is refused, naming num_actors."""
    fns = [partial(make_counting, i) for i in range(4)]
    with Collector(fns, EchoPolicy(), num_actors=2, frames_per_batch=40, total_frames=200, rollout_len=5, copy=True,
                   start_method="fork", timeout=30, seed=None) as c:
        batches = list(c)
        assert c.stats()["shmbuf"]["writers"] == 2
    assert batches[0].data["step"]["obs"].shape[2:] == (2, 3)
    lanes = per_lane(batches)
    envs = sorted(tuple(int(x) for x in rs[0]["data"]["step"]["obs"][0, :, 0]) for rs in lanes.values())
    assert envs == [(0, 1), (2, 3)], "each actor steps its own share of the factories, in order"
    for rs in lanes.values():
        check_truncated(rs, [int(x) for x in rs[0]["data"]["step"]["obs"][0, :, 0]], 5)
    with pytest.raises(shmbuf.UsageError, match="num_actors=3: the 4 env factories must split evenly"):
        Collector(fns, EchoPolicy(), num_actors=3, frames_per_batch=40)


def test_complete_episodes_batches():
    with Collector([make_counting], EchoPolicy(), num_actors=2, frames_per_batch=20, total_frames=60,
                   rollout_len=8, batch_mode="complete_episodes", start_method="fork", timeout=30, seed=None) as c:
        batches = list(c)
    rollouts = []
    for b in batches:
        assert b.frames >= 20 and b.lengths.sum() == b.frames == len(b.data["step"]["obs"])
        start = np.concatenate([[0], np.cumsum(b.lengths)])
        for i, n in enumerate(b.lengths):
            data = {"step": {k: v[start[i]:start[i + 1]] for k, v in b.data["step"].items()},
                    "episode": {k: v[i] for k, v in b.data["episode"].items()},
                    "bootstrap": {k: v[i] for k, v in b.data["bootstrap"].items()}}
            rollouts.append({"lane": int(b.lane[i]), "seq": int(b.seq[i]), "data": data,
                             "fill": {"step": int(n), "episode": 1, "bootstrap": 1}})
        assert np.array_equal(b.episode_lengths, b.lengths)
    for lane in {r["lane"] for r in rollouts}:
        mine = [r for r in rollouts if r["lane"] == lane]
        check_complete(mine, 1, 8)


def test_weights_reach_the_actors_and_lag_is_reported():
    with Collector([make_counting] * 2, EchoPolicy(), frames_per_batch=8, rollout_len=4, weights={"w": np.zeros(1)},
                   start_method="fork", timeout=30, slots=6) as c:
        it = iter(c)
        first = next(it)
        assert first.policy_version.tolist() == [0, 0]
        assert c.update_policy_weights({"w": np.ones(1)}) == 1
        assert first.policy_lag.tolist() == [0, 0]  # computed when handed out
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            b = next(it)
            # the lag is the learner's version when the batch is handed out (1) minus the version each rollout carries
            assert set(b.policy_version.tolist()) <= {0, 1}
            assert (b.policy_lag == 1 - b.policy_version).all(), (b.policy_lag, b.policy_version)
            if (b.policy_version == 1).all():
                break
        else:
            raise AssertionError("the new weights never showed up in rollouts")
        assert c.stats()["policy_version"] == 1
        with pytest.raises(ValueError, match="larger than the last"):
            c.update_policy_weights({"w": np.ones(1)}, version=1)


def test_update_without_weights_is_a_clear_error():
    with Collector([make_counting], EchoPolicy(), num_actors=1, frames_per_batch=4, rollout_len=4,
                   start_method="fork", timeout=30) as c:
        with pytest.raises(RuntimeError, match="no weight broadcast"):
            c.update_policy_weights({"w": np.zeros(1)})


def test_actor_exception_is_raised_by_the_iterator_with_its_traceback():
    with Collector([make_counting], WrongPolicy(), num_actors=2, frames_per_batch=4, rollout_len=4, total_frames=4000,
                   start_method="fork", timeout=30) as c:
        with pytest.raises(ActorError) as info:
            for _ in c:
                pass
    err = info.value
    assert err.kind == "AssertionError" and "got action" in str(err)
    assert "helpers_workers.py" in err.remote_traceback and "in step" in err.remote_traceback  # CountingEnv.step


def test_restart_keeps_collecting_and_records_the_failure():
    with Collector([make_counting], WrongPolicy(), num_actors=1, frames_per_batch=4, rollout_len=4, total_frames=40,
                   restart=True, max_restarts=50, start_method="fork", timeout=30) as c:
        n = sum(1 for _ in c)
        assert n == 10
        assert c.stats()["actor_restarts"] >= 1 and c.failures[0].kind == "AssertionError"


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_replacement_that_never_gets_ready_is_killed_and_raised(tmp_path, method):
    """Actor 0 SIGKILLed, and its replacement hangs before ctx.ready() (its env factory never returns): within
    ready_timeout it is killed and, the restart budget spent, raised as a start timeout with what it printed; before,
    the collector went on with actor 1 alone for ever and nothing was raised."""
    import os
    import signal

    hang = tmp_path / "hang"
    with Collector([partial(make_counting_unless, str(hang), k) for k in range(2)], EchoPolicy(), num_actors=2,
                   frames_per_batch=8, rollout_len=4, total_frames=-1, restart=True, max_restarts=1, ready_timeout=3,
                   start_method=method, timeout=30, copy=True) as c:
        it = iter(c)
        next(it)
        hang.touch()
        victim = c.pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 40
        with pytest.raises(ActorError) as info:
            while time.monotonic() < deadline:
                next(it)
        replacement = c.pool.pids[0]
        assert c.pool.states == ["failed", "running"] and c.stats()["actor_restarts"] == 1
    err = info.value
    message = str(err)
    assert err.kind == "start_timeout" and err.index == 0 and err.pid == replacement != victim, message
    assert "did not start within ready_timeout=3 s: its replacement never called ctx.ready(), and was killed" in message
    assert f"make_counting_unless: {hang} exists, hanging" in message  # the last lines of its stderr
    assert err.exitcode == -signal.SIGKILL
    assert [f.kind for f in c.failures] == ["died", "start_timeout"]  # actor 0's SIGKILL (restarted), then this


def test_progress_bar(capsys):
    with Collector([make_counting], EchoPolicy(), num_actors=1, frames_per_batch=8, rollout_len=4, total_frames=32,
                   progress=True, start_method="fork", timeout=30) as c:
        for _ in c:
            pass
    err = capsys.readouterr().err
    assert "collecting" in err and "100%" in err and "frame/s" in err


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of policy and policy_factory"):
        Collector(make_counting, frames_per_batch=8)
    with pytest.raises(ValueError, match="not a multiple"):
        Collector(make_counting, EchoPolicy(), frames_per_batch=10, rollout_len=4)
    with pytest.raises(ValueError, match="batch_mode"):
        Collector(make_counting, EchoPolicy(), frames_per_batch=8, batch_mode="episodes")


def test_shutdown_twice_and_iterate_after():
    c = Collector([make_counting], EchoPolicy(), num_actors=1, frames_per_batch=4, rollout_len=4, start_method="fork",
                  timeout=30)
    try:
        next(iter(c))
        c.shutdown()
        c.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            next(iter(c))
    finally:
        c.shutdown()


def test_timeout_when_actors_are_alive_but_too_slow():
    with Collector([partial(make_counting, 0, 0.5)], EchoPolicy(), num_actors=1, frames_per_batch=4, rollout_len=4,
                   start_method="fork", timeout=0.5, stop_timeout=3) as c:
        t0 = time.monotonic()
        with pytest.raises(shmbuf.SlotTimeout, match="no batch within timeout=0.5"):
            next(iter(c))
        assert time.monotonic() - t0 < 15  # a liveness bound: the 0.5 s timeout held, not waited for ever


def test_complete_episodes_lose_nothing_to_a_timeout_between_episodes():
    """A SlotTimeout between two episodes of a batch keeps the episodes taken so far for the next batch.

    They used to be dropped with the frame that held them: RayCollector's node owners wait in short
    slices, so complete-episodes batches through Ray lost every episode that came more than 0.25 s
    before the batch was full.
    """
    with Collector([partial(make_counting, 0, 0.02)], EchoPolicy(), num_actors=1, frames_per_batch=12, rollout_len=8,
                   batch_mode="complete_episodes", start_method="fork", timeout=0.1, stop_timeout=3, seed=None) as c:
        batches, timeouts = [], 0
        deadline = time.monotonic() + 30
        while len(batches) < 4:
            assert time.monotonic() < deadline, f"4 batches did not come within 30 s ({timeouts} timeouts)"
            try:
                batches.append(next(iter(c)))
            except shmbuf.SlotTimeout:
                timeouts += 1
    assert timeouts > 0, "no timeout came between two episodes: the test tested nothing"
    seqs = np.concatenate([b.seq for b in batches]).tolist()
    assert seqs == list(range(len(seqs))), f"episodes lost to a timeout: {seqs}"
    assert all(b.frames >= 12 and b.lengths.sum() == b.frames for b in batches)


def test_complete_episodes_with_vector_envs_shares_slots_among_sub_env_lanes():
    """One actor, 3 sub-envs, 3 lanes: all must get slots (none may wait for ever behind the first lane)."""
    with Collector(partial(make_vector, 3, "NextStep"), EchoPolicy(), num_actors=1, frames_per_batch=30,
                   total_frames=120, rollout_len=8, batch_mode="complete_episodes", start_method="fork", timeout=30,
                   seed=None) as c:
        batches = list(c)
        assert c.stats()["shmbuf"]["writers"] == 3
    envs = np.concatenate([b.data["episode"]["env"] for b in batches])
    assert set(envs.tolist()) == {0, 1, 2}


def _kill_actor_and_collect(c, how_many_after: int = 3):
    """Batches until actor 0, SIGKILLed after two batches, has a restarted process whose rollouts arrived; then a few
    more. Returns every rollout's (lane, epoch, seq), in delivery order."""
    import os
    import signal

    keys: list[tuple[int, int, int]] = []
    it = iter(c)
    deadline = time.monotonic() + 60
    # Both actors' lanes delivered: the victim's has seqs that its replacement (on that lane: there are two) repeats.
    # Two batches were not enough: on a loaded machine actor 0 could have delivered nothing yet, and then nothing
    # repeated and the loop below waited out its deadline (a fresh-clone CI run failed so).
    while len(keys) < 2 or len({ln for ln, _, _ in keys}) < 2:
        assert time.monotonic() < deadline, f"both actors did not deliver within 60 s: {c.stats()}"
        b = next(it)
        keys += zip(b.lane.tolist(), b.epoch.tolist(), b.seq.tolist())
    victim = c.pool.pids[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    after = None
    while after is None or len(keys) < after:
        assert time.monotonic() < deadline, f"no rollout from actor 0's replacement within 60 s: {c.stats()}"
        b = next(it)
        keys += zip(b.lane.tolist(), b.epoch.tolist(), b.seq.tolist())
        if after is None and c.pool.pids[0] not in (None, victim) and len({(ln, s) for ln, _, s in keys}) < len(keys):
            after = len(keys) + how_many_after  # the replacement delivered its seq 0 on a lane seen before
    return keys


@pytest.mark.parametrize("mode", ["truncate_episodes", "complete_episodes", "async_batched"])
def test_rollout_keys_name_one_rollout_across_an_actor_kill_and_restart(mode):
    """Issue 18 item 3: actor 0 SIGKILLed, restarted on its lane, counts seq from 0 again. (lane, seq) then repeats;
    (lane, epoch, seq) must not, in Collector's truncate- and complete-episodes batches and AsyncBatchedCollector's."""
    from workers import AsyncBatchedCollector

    kw = dict(frames_per_batch=8, rollout_len=4, total_frames=-1, restart=True, max_restarts=3, start_method="fork",
              timeout=30, copy=True)
    if mode == "async_batched":
        c = AsyncBatchedCollector([make_counting] * 2, policy=EchoPolicy(), **kw)
    elif mode == "complete_episodes":
        c = Collector([make_counting] * 2, EchoPolicy(), **dict(kw, rollout_len=8, batch_mode="complete_episodes"))
    else:
        c = Collector([make_counting] * 2, EchoPolicy(), **kw)
    with c:
        keys = _kill_actor_and_collect(c)
        assert c.stats()["actor_restarts"] == 1
    pairs = [(lane, seq) for lane, _, seq in keys]
    assert len(set(pairs)) < len(pairs), "(lane, seq) never repeated: the kill tested nothing"
    dup = [k for k in set(keys) if keys.count(k) > 1]
    assert not dup, f"(lane, epoch, seq) named two rollouts: {dup[:5]}"
    assert all(e >= 1 for _, e, _ in keys)


def test_await_weights_collects_nothing_before_the_first_update():
    """Collector(await_weights=True): version 0 is not published; the actors wait, so even the first rollouts are
    collected with the weights of the first update (RayCollector's restarted owners rely on it, issue 18 item 4)."""
    w0 = {"w": np.zeros(1)}
    with Collector([make_counting] * 2, EchoPolicy(), frames_per_batch=8, rollout_len=4, weights=w0, start_method="fork",
                   timeout=30, await_weights=True, copy=True) as c:
        assert c.awaited_weights is w0 and c.publisher.version is None
        c.pool.wait_ready(30)
        assert c.update_policy_weights({"w": np.ones(1)}, version=5) == 5
        assert c.awaited_weights is None
        it = iter(c)
        versions = np.concatenate([next(it).policy_version for _ in range(3)]).tolist()
    assert versions == [5] * 6, versions
    with Collector([make_counting], EchoPolicy(), num_actors=1, frames_per_batch=4, rollout_len=4, start_method="fork",
                   timeout=30, await_weights=True) as c:  # no broadcast: nothing to await, it collects as ever
        assert c.publisher is None and next(iter(c)).policy_version.tolist() == [0]
