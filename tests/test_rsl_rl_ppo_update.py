"""rsl_rl 1.0.2's PPO update loop (legged_gym's default trainer) and the legged-robot fork's, over shmbuf's storage.

rsl_rl 1.0.2 is not on PyPI; tests/_rsl_rl_v1.py is a test double of its PPO/ActorCritic contract that makes the
calls its ``PPO.update`` makes with each minibatch. Feed-forward (its default ``ActorCritic``) and recurrent (GRU).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests import _rsl_rl, _rsl_rl_v1

torch = pytest.importorskip("torch")

N, T, OBS, ACT = 8, 12, 5, 3


def storage_for(ac: Any) -> Any:
    from shmbuf.storage import RolloutStorage  # was: from rsl_rl.storage import RolloutStorage

    storage = RolloutStorage(N, T, [OBS], [None], [ACT], "cpu")  # PPO.init_storage's call
    last = _rsl_rl_v1.collect(storage, ac, T, N, OBS)
    with torch.no_grad():
        storage.compute_returns(ac.evaluate(last), 0.99, 0.95)  # PPO.compute_returns
    return storage


@pytest.mark.parametrize("update", [_rsl_rl_v1.ppo_update, _rsl_rl_v1.fork_update], ids=["rsl_rl-1.0.2", "fork"])
def test_a_feed_forward_actor_critic_trains_over_the_storage(update: Any) -> None:
    """legged_gym's default: a feed-forward ActorCritic. rsl_rl 1.0.2 unpacks ``hid_states_batch[0]`` and the fork
    reads ``minibatch.hidden_states.actor``: both get None, as rsl_rl's own storage gives ``(None, None)`` and
    ``masks=None``; every minibatch of every epoch trains, with finite losses."""
    torch.manual_seed(0)
    ac = _rsl_rl_v1.ActorCritic(OBS, ACT)
    losses = update(storage_for(ac), ac, 4, 2)
    assert len(losses) == 8 and np.isfinite(losses).all()
    calls = ac.calls
    assert [c[0] for c in calls] == ["act", "evaluate"] * 8
    assert all(masks is None and hidden is None for _, masks, hidden in calls)


def test_feed_forward_minibatches_carry_rsl_rls_none_hidden_states() -> None:
    """What rsl_rl yields for a feed-forward storage: hidden states ``(None, None)`` (indexable, and named for the
    fork: ``.actor`` / ``.critic``), masks None; with a device and without."""
    from shmbuf.storage import RolloutStorage

    for mb in storage_for(_rsl_rl_v1.ActorCritic(OBS, ACT)).mini_batch_generator(2, 1):  # with a device
        assert mb.hidden_states == (None, None) and mb.masks is None
        assert mb.hidden_states[0] is None and mb.hidden_states[1] is None
        assert mb.hidden_states.actor is None and mb.hidden_states.critic is None
    numpy_storage = RolloutStorage(2, 3, (4,), None, (1,))
    for _ in range(3):
        numpy_storage.add_transitions(RolloutStorage.Transition(
            observations=np.zeros((2, 4)), actions=np.zeros((2, 1)), rewards=np.zeros(2), dones=np.zeros(2),
            values=np.zeros(2), actions_log_prob=np.zeros(2)))
    numpy_storage.compute_returns(np.zeros(2), 0.99, 0.95)
    for gen in (numpy_storage.mini_batch_generator(2, 1), numpy_storage.recurrent_mini_batch_generator(2, 1)):
        for mb in gen:
            assert mb.hidden_states == (None, None) and mb.hidden_states.actor is None


def test_rsl_rl_libs_own_batch_default_is_the_same_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """rsl-rl-lib 5.5.1's own ``RolloutStorage.Batch`` (installed by ``make test`` with --no-deps) defaults its
    hidden states to ``(None, None)`` for feed-forward batches: the same value shmbuf's minibatches carry. (Its PPO
    itself reads another minibatch contract, ``batch.observations`` as a TensorDict and
    ``old_distribution_params``, so it does not run over rsl_rl 1.x's storage, nor over shmbuf's port of it.)"""
    _, RolloutStorage = _rsl_rl.import_rsl_rl(monkeypatch)
    mb = next(storage_for(_rsl_rl_v1.ActorCritic(OBS, ACT)).mini_batch_generator(2, 1))
    assert RolloutStorage.Batch().hidden_states == mb.hidden_states == (None, None)


@pytest.mark.parametrize("update", [_rsl_rl_v1.ppo_update, _rsl_rl_v1.fork_update], ids=["rsl_rl-1.0.2", "fork"])
def test_a_recurrent_actor_critic_trains_over_the_storage(update: Any) -> None:
    """The recurrent path: ``reccurent_mini_batch_generator``, each memory given its trajectories' first hidden
    states ``(num_layers, traj, H)`` and masks ``[T, traj]``, the output unpadded onto ``[T, envs]``."""
    torch.manual_seed(0)
    ac = _rsl_rl_v1.ActorCriticRecurrent(OBS, ACT)
    losses = update(storage_for(ac), ac, 2, 2)
    assert len(losses) == 4 and np.isfinite(losses).all()
    for _, masks, hidden in ac.calls:
        assert masks.shape[0] == T and hidden.shape == (1, masks.shape[1], 8)
