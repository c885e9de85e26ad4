"""Reader.max_policy_lag: a ready rollout older than the learner's version allows is given back unread."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmbuf
from tests.test_reader import write


def commit_versions(writer: shmbuf.Writer, versions: list[int]) -> None:
    for k, v in enumerate(versions):
        writer.policy_version = v
        write(writer, float(k))


def test_without_a_setting_every_rollout_goes_out(pair: Any) -> None:
    reader, writer = pair
    commit_versions(writer, [0, 1, 2])
    reader.policy_version = 5
    batch = reader.get_batch(3, timeout=5, zero_copy=False)
    assert batch.policy_version.tolist() == [0, 1, 2]
    assert reader.stats()["stale_dropped"] == 0


def test_rollouts_older_than_the_lag_are_given_back_and_counted(pair: Any) -> None:
    reader, writer = pair
    commit_versions(writer, [0, 1, 2, 3])
    reader.policy_version = 3
    reader.max_policy_lag = 1  # versions 2 and 3 may go out
    batch = reader.get_batch(2, timeout=5, zero_copy=False)
    assert batch.policy_version.tolist() == [2, 3]
    assert reader.stats()["stale_dropped"] == reader.stale_dropped == 2
    batch.release()
    # the two dropped slots went back to the pool: the writer fills them again, and they go out
    reader.poll()
    commit_versions(writer, [3, 3])
    with reader.get_batch(2, timeout=5, zero_copy=False) as again:
        assert again.policy_version.tolist() == [3, 3]
    assert reader.stats()["slots"]["held"] == 0


def test_lag_zero_takes_only_the_learners_version_and_get_too(pair: Any) -> None:
    reader, writer = pair
    commit_versions(writer, [4, 5, 4])
    reader.policy_version = 5
    reader.max_policy_lag = 0
    r = reader.get(timeout=5)
    assert r.policy_version == 5
    r.release()
    with pytest.raises(shmbuf.SlotTimeout):  # the other two are stale: nothing is left to hand out
        reader.get(timeout=0.2)
    assert reader.stats()["stale_dropped"] == 2


def test_a_rollout_that_turns_stale_while_it_waits_is_dropped_at_the_next_call(pair: Any) -> None:
    reader, writer = pair
    reader.max_policy_lag = 0
    reader.policy_version = 1
    commit_versions(writer, [1, 1])
    with reader.get(timeout=5) as r:
        assert r.policy_version == 1
    reader.policy_version = 2  # the learner published: the other ready rollout is now one version behind
    commit_versions(writer, [2])
    with reader.get(timeout=5) as r:
        assert r.policy_version == 2
    assert reader.stats()["stale_dropped"] == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_setting_is_refused_naming_it(pair: Any, bad: Any) -> None:
    reader, _ = pair
    with pytest.raises(shmbuf.UsageError, match=r"max_policy_lag: expected None or an int >= 0 .*got"):
        reader.max_policy_lag = bad
    assert reader.max_policy_lag is None


def test_the_versions_dropped_never_reach_a_zero_copy_batch(pair: Any) -> None:
    reader, writer = pair
    reader.max_policy_lag = 1
    reader.policy_version = 3
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(6):
        reader.poll()
        commit_versions(writer, rng.integers(0, 4, size=2).tolist())
        try:
            with reader.get_batch(1, timeout=0.2) as b:
                seen += b.policy_version.tolist()
        except shmbuf.SlotTimeout:
            pass
    assert seen and min(seen) >= 2, seen
