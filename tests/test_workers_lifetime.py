"""workers' one lifetime helper (workers/_lifetime.py): what an owner holds is let go newest first, once, at close,
when the owner is dropped, or at exit; and a let-go owner leaves no exit hook behind."""

from __future__ import annotations

import gc
import multiprocessing.util

import pytest

from workers._lifetime import Lifetime


class Owner:
    pass


def test_close_lets_go_newest_first_once_within_one_budget_and_raises_the_first_error():
    seen: list[tuple[str, float]] = []

    def failing(timeout: float) -> None:
        seen.append(("failing", timeout))
        raise ValueError("release failed")

    owner = Owner()
    life = Lifetime(owner, 5.0)
    life.hold("first", lambda timeout: seen.append(("first", timeout)))
    life.hold("failing", failing)
    life.hold("last", lambda timeout: seen.append(("last", timeout)), last=True)
    life.hold("newest", lambda timeout: seen.append(("newest", timeout)))
    with pytest.raises(ValueError, match="release failed"):
        life.close(2.0)
    assert [name for name, _ in seen] == ["newest", "failing", "first", "last"]  # every release ran
    assert all(0.0 <= t <= 2.0 for _, t in seen)  # what was left of the budget close() was given
    assert not life.alive
    life.close()  # once: nothing runs again, nothing is raised again
    assert len(seen) == 4


def test_a_dropped_owner_is_let_go_and_leaves_no_exit_hook():
    seen: list[str] = []
    registry = multiprocessing.util._finalizer_registry  # multiprocessing's exit hooks (a process it started)
    before = set(registry)
    owner = Owner()
    life = Lifetime(owner, 1.0)
    life.hold("thing", lambda timeout: seen.append("released"))
    life.arm()
    # this hook by its key: other objects of the same process (a collector an earlier test dropped) may add or
    # remove theirs while this test runs, so the registry's size says nothing
    hooks = set(registry) - before
    assert len(hooks) == 1
    del owner
    gc.collect()
    assert seen == ["released"] and not life.alive
    # the hook of a let-go owner is gone (it used to stay registered until exit; its atexit twin is unregistered
    # with it, which atexit gives no way to count)
    assert not hooks & set(registry)
