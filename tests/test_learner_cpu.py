"""The learner's torch threads beside the actor processes: the warning and the ``learner_threads`` setting."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

import shmbuf
from workers._learner_cpu import learner_threads, threads_left

torch = pytest.importorskip("torch", reason="the setting is torch's thread count")


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_left_is_one_core_per_actor_and_at_least_one() -> None:
    assert threads_left(2, machine_cores=8) == 6
    assert threads_left(2, machine_cores=2) == 1
    assert threads_left(4, machine_cores=2) == 1


def test_more_torch_threads_than_the_actors_leave_warns_naming_the_setting() -> None:
    torch.set_num_threads(4)
    with pytest.warns(RuntimeWarning, match=r"runs 4 threads, but the 2 actor processes leave it 1 of this machine's 2 "
                                            r"cores.*learner_threads='auto' \(sets torch.set_num_threads\(1\)\)"):
        assert learner_threads(None, 2, machine_cores=2) is None
    assert torch.get_num_threads() == 4  # the default setting changes nothing


def test_no_warning_when_torch_fits_or_the_actors_are_threads() -> None:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learner_threads(None, 2, machine_cores=2)
        torch.set_num_threads(4)
        learner_threads(None, 2, machine_cores=2, processes=False)


def test_auto_and_an_int_set_torchs_threads() -> None:
    torch.set_num_threads(4)
    assert learner_threads("auto", 2, machine_cores=3) == 1
    assert torch.get_num_threads() == 1
    assert learner_threads(3, 2) == 3
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "all"])
def test_a_bad_setting_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(shmbuf.UsageError, match=r"learner_threads: expected None .*'auto' .* or an int >= 1, got"):
        learner_threads(bad, 2)
