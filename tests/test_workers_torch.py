"""Policies as users write them: a plain torch.nn.Module, and callables that cannot be pickled.

A module's forward gets tensors (CountingEnv's float64 observations) and
returns tensors; workers converts both ways. The module class lives at
module level here so that spawn and forkserver actors can import it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch policies need torch (pip install torch==2.13.0)")

import numpy as np  # noqa: E402  (after the importorskip above)
from torch import nn  # noqa: E402  (after the importorskip above)

import shmbuf  # noqa: E402  (after the importorskip above)
from tests.helpers_workers import EchoPolicy, check_truncated, collect, make_counting, make_vector, per_lane  # noqa: E402  (after the importorskip above)
from workers import Collector  # noqa: E402  (after the importorskip above)


class TorchEcho(nn.Module):
    """CountingEnv's right action, 1000 k + t, from a Linear layer; with ``extras``, also ``twice_t`` (2 t)."""

    def __init__(self, extras: bool = True):
        super().__init__()
        self.extras = extras
        self.linear = nn.Linear(3, 1, dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[0.0, 1000.0, 1.0]], dtype=torch.float64))
            self.linear.bias.zero_()

    def forward(self, obs):
        action = self.linear(obs).squeeze(-1).round().long()
        if not self.extras:
            return action
        return action, {"twice_t": (2 * obs[:, 2]).float()}


def make_echo_policy():
    return EchoPolicy()


def test_a_torch_module_is_a_policy_in_the_actor_loop():
    rollouts, loop = collect(lambda: make_vector(2, "NextStep"), T=5, n_rollouts=4, policy=TorchEcho())
    check_truncated(rollouts, [0, 1], 5)
    assert rollouts[0]["data"]["step"]["action"].dtype == np.int64


def test_a_torch_module_returning_only_actions():
    rollouts, _ = collect(make_counting, T=4, n_rollouts=3, policy=TorchEcho(extras=False))
    step = rollouts[0]["data"]["step"]
    assert set(step) == {"obs", "action", "reward", "terminated", "truncated"}
    assert (step["action"] == step["obs"][:, 1] * 1000 + step["obs"][:, 2]).all()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_collector_takes_a_plain_torch_module_and_broadcasts_its_weights(method):
    model = TorchEcho()
    with Collector([make_counting] * 2, model, frames_per_batch=8, total_frames=24, rollout_len=4, copy=True,
                   start_method=method, timeout=60, seed=None) as c:
        it = iter(c)
        batches = [next(it)]
        c.update_policy_weights(model)  # its state_dict, as numpy, loaded by each actor's copy of the module
        batches += list(it)
    for rs in per_lane(batches).values():
        check_truncated(rs, [0], 4)


def test_a_lambda_policy_under_spawn_is_refused_at_construction_with_what_to_do():
    with pytest.raises(shmbuf.UsageError, match=r"policy: .*<lambda> cannot be pickled.*policy_factory="):
        Collector(make_counting, lambda obs: EchoPolicy()(obs), frames_per_batch=8, rollout_len=4,
                  start_method="spawn")
    with pytest.raises(shmbuf.UsageError, match=r"create_env_fn: .*<lambda> cannot be pickled"):
        Collector(lambda: make_counting(), EchoPolicy(), frames_per_batch=8, rollout_len=4, start_method="forkserver")
    with pytest.raises(shmbuf.UsageError, match=r"policy_factory: .*<lambda> cannot be pickled"):
        Collector(make_counting, policy_factory=lambda: EchoPolicy(), frames_per_batch=8, rollout_len=4,
                  start_method="spawn")


def test_a_lambda_policy_under_fork_needs_no_pickling():
    with Collector([make_counting], lambda obs: EchoPolicy()(obs), num_actors=1, frames_per_batch=4, rollout_len=4,
                   total_frames=8, start_method="fork", timeout=30, seed=None) as c:
        assert sum(b.frames for b in c) == 8


def test_policy_factory_is_the_way_for_what_cannot_be_pickled():
    with Collector([make_counting], policy_factory=make_echo_policy, num_actors=1, frames_per_batch=4, rollout_len=4,
                   total_frames=8, start_method="spawn", timeout=60, seed=None) as c:
        assert sum(b.frames for b in c) == 8
