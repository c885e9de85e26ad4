"""Coming from rsl_rl and its legged-robot forks: their call sites with only the import changed (docs/from-rsl_rl.md).

The forks are not installed: their storage is checked against its documented semantics (transcribed here in torch,
line by line from what the forks do), and rsl_rl 5.5.1's GAE against rsl_rl's own code where it is installed.
"""

from __future__ import annotations

import pathlib
from collections import namedtuple
from typing import Any

import numpy as np
import pytest

import shmbuf
from tests import _rsl_rl
from tests.helpers import doc_blocks, run_doc_block

torch = pytest.importorskip("torch")

# The rsl_rl fork's recurrent modules hand the storage namedarraytuples (namedtuples that also index their fields):
ActorCriticHiddenState = namedtuple("ActorCriticHiddenState", ["actor", "critic"])
LstmHiddenState = namedtuple("LstmHiddenState", ["hidden", "cell"])


def ppo_rollout(storage: Any, T: int, N: int, *, seed: int = 0, gamma: float = 0.99, hidden: str | None = None,
                p_done: float = 0.25) -> dict[str, np.ndarray]:
    """Fill ``storage`` the way the rsl_rl fork's PPO does (``act`` then ``process_env_step``): one Transition, filled with
    tensors, passed to ``add_transitions`` and cleared each step; what was given is returned as numpy."""
    g = torch.Generator().manual_seed(seed)
    transition = type(storage).Transition()
    seen: dict[str, list[Any]] = {k: [] for k in ("obs", "rewards", "values", "dones", "time_outs", "h")}
    for _ in range(T):
        obs = torch.randn(N, 3, generator=g)
        # PPO.act
        if hidden is not None:
            h = torch.randn(2, N, 4, generator=g)  # torch's (num_layers, N, H)
            hs = ActorCriticHiddenState(h, -h) if hidden == "gru" else \
                ActorCriticHiddenState(LstmHiddenState(h, h + 1), LstmHiddenState(-h, -h - 1))
            transition.hidden_states = hs
            seen["h"].append(h)
        transition.actions = torch.randn(N, 2, generator=g, requires_grad=True).detach()
        transition.values = torch.randn(N, 1, generator=g)
        transition.actions_log_prob = torch.randn(N, generator=g)
        transition.action_mean = torch.randn(N, 2, generator=g)
        transition.action_sigma = torch.ones(N, 2)
        transition.observations = obs
        transition.critic_observations = obs
        # PPO.process_env_step
        rewards = torch.randn(N, generator=g)
        dones = (torch.rand(N, generator=g) < p_done).long()
        time_outs = dones.bool() & (torch.rand(N, generator=g) < 0.5)
        seen["rewards"].append(rewards.clone())
        transition.rewards = rewards.clone()
        transition.dones = dones
        transition.rewards += gamma * torch.squeeze(transition.values * time_outs.unsqueeze(1), 1)
        storage.add_transitions(transition)
        seen["obs"].append(obs)
        seen["values"].append(transition.values[:, 0])
        seen["dones"].append(dones.bool())
        seen["time_outs"].append(time_outs)
        transition.clear()
    return {k: torch.stack(v).numpy() for k, v in seen.items() if v}


# -- 1. RolloutStorage with a device ----------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "torch.device"])
def test_the_sixth_positional_argument_is_a_device_and_minibatches_are_tensors_there(device: str) -> None:
    from shmbuf.storage import QueueRolloutStorage, RolloutStorage, SarsaRolloutStorage

    dev = torch.device("cpu") if device == "torch.device" else "cpu"
    N, T = 4, 5
    for cls in (RolloutStorage, QueueRolloutStorage, SarsaRolloutStorage):
        storage = cls(N, T, [3], [None], [2], dev)
        assert storage.device == torch.device("cpu") and storage.hidden_states_actor is None
        ppo_rollout(storage, T, N)
        storage.compute_returns(torch.zeros(N, 1), 0.99, 0.95)
        batches = list(storage.mini_batch_generator(2, 3))
        assert len(batches) == 6
        b = batches[0]
        assert all(isinstance(x, torch.Tensor) and x.device == torch.device("cpu") for x in b[:9])
        assert b.obs.shape == (10, 3) and b.actions.shape == (10, 2)
        for f in ("values", "advantages", "returns", "old_actions_log_prob"):  # The rsl_rl fork's [batch, 1]
            assert getattr(b, f).shape == (10, 1), f
        assert b.hidden_states == (None, None) and b.masks is None
        length, reward = storage.get_statistics()
        assert isinstance(length, torch.Tensor) and length.ndim == 0 and reward.ndim == 0
        storage.clear()


def test_without_a_device_everything_is_numpy_as_before_and_a_device_keyword_works() -> None:
    from shmbuf.storage import RolloutStorage

    s = RolloutStorage(2, 3, (3,), None, (2,), (2, 4))
    assert s.device is None and s.hidden_states_actor is not None and s.hidden_states_actor.shape == (3, 2, 2, 4)
    s = RolloutStorage(2, 3, (3,), None, (2,), device="cpu")
    assert s.device == torch.device("cpu")
    s = RolloutStorage(2, 3, (3,), None, (2,), (2, 4), device=torch.device("cpu"))
    assert s.hidden_states_actor is not None
    with pytest.raises(shmbuf.UsageError, match=r"a device was given twice"):
        RolloutStorage(2, 3, (3,), None, (2,), "cpu", device="cpu")
    with pytest.raises(shmbuf.UsageError, match=r"device=\.\.\.\): 'gpu7' is not a torch device"):
        RolloutStorage(2, 3, (3,), None, (2,), "gpu7")
    with pytest.raises(shmbuf.UsageError, match=r"rnn_hidden_shape: expected a shape"):
        RolloutStorage(2, 3, (3,), None, (2,), 1.5)


@pytest.mark.parametrize("seed", range(4))
def test_002s_ppo_loop_gives_rsl_rls_returns_and_normalised_advantages(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rsl_rl fork's PPO folds the time-out bootstrap into the rewards and calls ``compute_returns(last_values, gamma, lam)``,
    which normalises the advantages: the returns are rsl_rl 5.5.1's bit for bit (its own code when installed, else
    the transcription), the advantages its normalised ones."""
    from shmbuf.storage import RolloutStorage

    N, T = 5, 12
    storage = RolloutStorage(N, T, [3], [3], [2], "cpu")
    seen = ppo_rollout(storage, T, N, seed=seed)
    last_values = torch.randn(N, 1, generator=torch.Generator().manual_seed(seed + 100))
    storage.compute_returns(last_values, 0.99, 0.95)
    args = (seen["rewards"], seen["values"], seen["dones"], seen["time_outs"], last_values[:, 0].numpy(), 0.99, 0.95)
    want_adv, want_ret = _rsl_rl.transcribed(*args)
    try:
        want_adv, want_ret = _rsl_rl.real(monkeypatch, *args)
    except pytest.skip.Exception:
        pass
    np.testing.assert_array_equal(storage.returns, want_ret)
    a = torch.from_numpy(want_adv)
    np.testing.assert_allclose(storage.advantages, ((a - a.mean()) / (a.std() + 1e-8)).numpy(), rtol=1e-5, atol=1e-6)
    storage.compute_returns(last_values, 0.99, 0.95, normalize_advantages=False)
    np.testing.assert_allclose(storage.advantages, want_adv, rtol=1e-6, atol=1e-6)


def transcribed_002_recurrent(obs: Any, dones: Any, saved_hidden: Any, num_mini_batches: int) -> list[tuple[Any, Any, Any]]:
    """The rsl_rl fork's ``reccurent_mini_batch_generator`` for one epoch, transcribed in torch: ``(padded obs, masks, hidden)``
    per minibatch; ``saved_hidden`` ``[T, num_layers, N, H]`` as the rsl_rl fork saves it, ``dones`` ``[T, N]``."""
    T, N = dones.shape
    # split_and_pad_trajectories: trajectories env-major, each padded to T
    flat = dones.transpose(1, 0).clone()
    flat[:, -1] = True
    ends = torch.cat((torch.tensor([-1]), flat.reshape(-1).nonzero()[:, 0]))
    lengths = (ends[1:] - ends[:-1]).tolist()
    trajs = torch.split(obs.transpose(1, 0).flatten(0, 1), lengths)
    padded = torch.nn.utils.rnn.pad_sequence([torch.cat([t, t.new_zeros(T - len(t), *t.shape[1:])]) for t in trajs])
    masks = torch.arange(T)[:, None] < torch.tensor(lengths)[None, :]
    out = []
    size = N // num_mini_batches
    last_was_done = torch.zeros_like(dones)
    last_was_done[1:] = dones[:-1]
    last_was_done[0] = True
    first = 0
    for i in range(num_mini_batches):
        count = int(last_was_done[:, i * size:(i + 1) * size].sum())
        hid = saved_hidden.permute(2, 0, 1, 3)[last_was_done.permute(1, 0)][first:first + count].transpose(1, 0)
        out.append((padded[:, first:first + count], masks[:, first:first + count], hid))
        first += count
    return out


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_recurrent_minibatches_match_002s_padding_masks_and_hidden_state_layout(cell: str) -> None:
    from shmbuf.storage import RolloutStorage

    N, T = 4, 6
    storage = RolloutStorage(N, T, [3], [None], [2], "cpu")
    seen = ppo_rollout(storage, T, N, hidden=cell, p_done=0.3, seed=3)
    storage.compute_returns(torch.zeros(N, 1), 0.99, 0.95)
    dones = torch.from_numpy(seen["dones"])
    want = transcribed_002_recurrent(torch.from_numpy(seen["obs"]), dones, torch.from_numpy(seen["h"]), 2)
    got = list(storage.reccurent_mini_batch_generator(2, 1))
    assert len(got) == 2
    for b, (obs, masks, hid) in zip(got, want):
        torch.testing.assert_close(b.obs, obs)
        assert torch.equal(b.masks, masks)
        assert type(b.hidden_states) is ActorCriticHiddenState  # The legged-robot fork: minibatch.hidden_states.actor / .critic
        actor, critic = b.hidden_states.actor, b.hidden_states.critic
        if cell == "gru":
            torch.testing.assert_close(actor, hid)
            torch.testing.assert_close(critic, -hid)
        else:
            assert type(actor) is LstmHiddenState
            torch.testing.assert_close(actor.hidden, hid)
            torch.testing.assert_close(actor[1], hid + 1)
            torch.testing.assert_close(critic[1], -hid - 1)
        assert b.values.shape == (T, N // 2, 1) and b.actions.shape == (T, N // 2, 2)
    with pytest.raises(shmbuf.SchemaError, match=r"torch's layout \(num_layers, num_envs=4, hidden\)"):
        storage.clear()
        storage.add_transitions(RolloutStorage.Transition(
            observations=torch.zeros(N, 3), actions=torch.zeros(N, 2), rewards=torch.zeros(N), dones=torch.zeros(N),
            values=torch.zeros(N, 1), actions_log_prob=torch.zeros(N), hidden_states=(torch.zeros(N, 4), None)))


def test_sarsa_storage_takes_002s_next_privileged_observations() -> None:
    from shmbuf.storage import SarsaRolloutStorage

    N, T = 2, 2
    s = SarsaRolloutStorage(N, T, [3], [5], [2], "cpu")
    tr = SarsaRolloutStorage.Transition()
    for t in range(T):
        tr.observations, tr.critic_observations = torch.full((N, 3), float(t)), torch.full((N, 5), float(t))
        tr.actions, tr.rewards, tr.dones = torch.zeros(N, 2), torch.zeros(N), torch.zeros(N, dtype=torch.uint8)
        tr.values, tr.actions_log_prob = torch.zeros(N, 1), torch.zeros(N)
        tr.next_observations, tr.next_privileged_observations = torch.full((N, 3), t + 1.0), torch.full((N, 5), t + 1.0)
        s.add_transitions(tr)
        tr.clear()
    assert s.all_privileged_observations is not None
    np.testing.assert_array_equal(s.all_privileged_observations[:, 0, 0], [0, 1, 2])
    s.compute_returns(torch.zeros(N, 1), 0.99, 0.95)
    b = next(s.mini_batch_generator(1, 1))
    assert isinstance(b.next_critic_obs, torch.Tensor) and b.next_critic_obs.shape == (4, 5)


# -- 2. ActionLabelRollout ----------------------------------------------------------------------------------

def test_action_label_rollout_keeps_labels_through_growth_loop_and_minibatches() -> None:
    """The rsl_rl fork's TPPO: ``ActionLabelRollout(...)``, ``ActionLabelRollout.Transition()`` with ``action_labels``; labels
    grow, loop and untie with the actions, and every minibatch carries them laid out like the actions."""
    from shmbuf.storage.compat.rsl_rl import ActionLabelRollout

    N, T = 3, 4
    storage = ActionLabelRollout(N, T, [3], [None], [2], "cpu", buffer_dilation_ratio=2.0)
    transition = ActionLabelRollout.Transition()
    assert transition.action_labels is None
    g = 0
    for _ in range(3):  # three rollouts: grow to 2T at the first clear, then loop
        for _ in range(T):
            transition.observations = torch.full((N, 3), float(g))
            transition.actions = torch.full((N, 2), float(g))
            transition.action_labels = torch.full((N, 2), -float(g))
            transition.rewards, transition.dones = torch.zeros(N), torch.zeros(N, dtype=torch.bool)
            transition.values, transition.actions_log_prob = torch.zeros(N, 1), torch.zeros(N)
            storage.add_transitions(transition)
            transition.clear()
            g += 1
        storage.compute_returns(torch.zeros(N, 1), 0.99, 0.95)
        storage.clear()
    assert storage.num_transitions_per_env == 2 * T and storage.buffer_full
    np.testing.assert_array_equal(storage.action_labels, -storage.actions)
    batches = list(storage.mini_batch_generator(2, 2))
    assert len(batches) == 4  # 2 minibatches x 2 epochs
    for b in batches:
        assert type(b).__name__ == "ActionLabelMiniBatch" and b._fields[-1] == "action_labels"
        torch.testing.assert_close(b.action_labels, -b.actions)
    batches = list(storage.reccurent_mini_batch_generator(1, 1))
    assert len(batches) == 1
    for b in batches:
        assert b.action_labels.shape == (2 * T, N, 2)
        torch.testing.assert_close(b.action_labels, -b.actions)
    np.testing.assert_array_equal(storage.actions[:, 0, 0], np.arange(4, 12))  # untied: oldest first
    transition.observations, transition.actions = torch.zeros(N, 3), torch.zeros(N, 2)
    transition.rewards, transition.dones = torch.zeros(N), torch.zeros(N)
    transition.values, transition.actions_log_prob = torch.zeros(N, 1), torch.zeros(N)
    with pytest.raises(shmbuf.SchemaError, match=r"Transition.action_labels is None"):
        storage.add_transitions(transition)
    transition.action_labels = torch.zeros(N, 3)
    with pytest.raises(shmbuf.SchemaError, match=r"Transition.action_labels: expected shape \(3, 2\)"):
        storage.add_transitions(transition)


# -- 3. ReplayBuffer(obs_dim, buffer_size, device) ------------------------------------------------------------

def test_002s_replay_buffer_is_a_ring_of_state_pairs_on_the_device() -> None:
    from shmbuf.storage import ReplayBuffer

    rb = ReplayBuffer(3, 5, "cpu")
    assert type(rb).__name__ == "LocalReplayBuffer" and rb.states.shape == (5, 3) and isinstance(rb.states, torch.Tensor)
    rb.insert(torch.arange(12.0).view(4, 3), -torch.arange(12.0).view(4, 3))
    assert (rb.step, rb.num_samples) == (4, 4)
    rb.insert(torch.full((3, 3), 100.0), torch.full((3, 3), -100.0))  # wraps: rows 4, 0, 1 overwritten
    assert (rb.step, rb.num_samples) == (2, 5)
    torch.testing.assert_close(rb.states[:, 0], torch.tensor([100.0, 100.0, 6.0, 9.0, 100.0]))
    torch.testing.assert_close(rb.next_states, -rb.states)
    batches = list(rb.feed_forward_generator(3, 7))
    assert len(batches) == 3
    for states, next_states in batches:
        assert states.shape == (7, 3) and states.device == torch.device("cpu")
        torch.testing.assert_close(next_states, -states)
        assert set(states[:, 0].tolist()) <= {100.0, 6.0, 9.0}
    rb.insert(np.ones((12, 3), np.float32), np.zeros((12, 3), np.float32))  # larger than the ring: the last 5 rows
    assert (rb.step, rb.num_samples) == (4, 5) and bool((rb.states == 1).all())


def test_002s_replay_buffer_draws_only_filled_rows_and_refuses_bad_input() -> None:
    from shmbuf.storage import ReplayBuffer

    rb = ReplayBuffer(obs_dim=2, buffer_size=100, device=torch.device("cpu"))
    with pytest.raises(shmbuf.UsageError, match=r"the buffer is empty"):
        next(rb.feed_forward_generator(1, 4))
    rb.insert(torch.ones(3, 2), torch.ones(3, 2))
    drawn = list(rb.feed_forward_generator(20, 10))
    assert len(drawn) == 20
    for states, _ in drawn:
        assert states.shape == (10, 2) and bool((states == 1).all())
    with pytest.raises(shmbuf.SchemaError, match=r"states has shape \(3, 4\), expected \(n, obs_dim=2\)"):
        rb.insert(torch.ones(3, 4), torch.ones(3, 4))
    with pytest.raises(shmbuf.SchemaError, match=r"states has 3 rows and next_states 2"):
        rb.insert(torch.ones(3, 2), torch.ones(2, 2))
    with pytest.raises(shmbuf.UsageError, match=r"num_mini_batch=\.\.\.\): expected an int >= 1"):
        rb.feed_forward_generator(0, 4)
    numpy_rb = ReplayBuffer(2, 4)  # no device: numpy
    numpy_rb.insert(np.zeros((1, 2)), np.ones((1, 2)))
    s, ns = next(numpy_rb.feed_forward_generator(1, 2))
    assert isinstance(s, np.ndarray) and s.dtype == np.float32 and ns.tolist() == [[1, 1], [1, 1]]


def test_the_shared_memory_replay_buffer_keeps_its_own_constructors() -> None:
    from shmbuf.storage import ReplayBuffer

    with ReplayBuffer.create({"x": np.zeros(2, np.float32)}, 8) as shared:
        assert type(shared) is ReplayBuffer
        shared.insert({"x": np.ones((3, 2), np.float32)})
        with ReplayBuffer.attach(shared.name) as other:
            assert type(other) is ReplayBuffer and other.num_samples == 3
    with pytest.raises(shmbuf.UsageError, match=r"ReplayBuffer\.create\(example_row, buffer_size\)"):
        ReplayBuffer()
    with pytest.raises(shmbuf.UsageError, match=r"got 3\.5 first"):
        ReplayBuffer(3.5, 5, "cpu")


# -- 4. RolloutFileBase ---------------------------------------------------------------------------------------

class MemoryRollouts:
    """What an rsl_rl fork's user writes: a RolloutFileBase subclass over trajectories held in memory (each a dict of tensors
    ``observations [L, 3]``, ``actions [L, 2]``, ``rewards [L]``), the fork's four abstract methods, a namedtuple buffer."""

    @staticmethod
    def make(trajs: list[dict[str, Any]], num_envs: int) -> Any:
        from collections import namedtuple

        from shmbuf.storage.files import RolloutFileBase

        class Rollouts(RolloutFileBase):
            Transition = namedtuple("Transition", ["observation", "action", "reward", "done", "timeout",
                                                   "next_observation"])

            def __init__(self, data: list[dict[str, Any]], num_envs: int, device: Any = "cpu"):
                super().__init__("memory", num_envs, device=device)
                self.data = data

            def reset_all(self) -> None:
                self.unused = list(range(len(self.data)))
                self.traj_identifiers: list[Any] = [None] * self.num_envs
                self.cursors = [0] * self.num_envs
                self.refresh_handlers()

            def refresh_handlers(self, env_ids: Any = None) -> None:
                if env_ids is None:
                    env_ids = self.all_env_ids
                for e in env_ids:
                    self.traj_identifiers[int(e)] = self.unused.pop(0)
                    self.cursors[int(e)] = 0

            def get_buffer(self, num_transitions_per_env: Any = None) -> Any:
                lead = ([] if num_transitions_per_env is None else [num_transitions_per_env]) + [self.num_envs]
                return self.Transition(torch.empty(lead + [3]), torch.empty(lead + [2]), torch.empty(lead),
                                       torch.empty(lead, dtype=torch.bool), torch.empty(lead, dtype=torch.bool),
                                       torch.empty(lead + [3]))

            def fill_transition(self, buffer: Any, env_ids: Any = None) -> None:
                for e in (self.all_env_ids if env_ids is None else env_ids):
                    e = int(e)
                    traj, c = self.data[self.traj_identifiers[e]], self.cursors[e]
                    buffer.observation[e] = traj["observations"][c]
                    buffer.action[e] = traj["actions"][c]
                    buffer.reward[e] = traj["rewards"][c]
                    buffer.done[e] = c == len(traj["rewards"]) - 1
                    buffer.timeout[e] = False
                    buffer.next_observation[e] = traj["observations"][min(c + 1, len(traj["rewards"]) - 1)]
                    self.cursors[e] += 1
                    if self.cursors[e] == len(traj["rewards"]):
                        if not self.unused:
                            raise StopIteration
                        self.refresh_handlers([e])

        return Rollouts(trajs, num_envs)


def memory_trajectories(n: int, length: int) -> list[dict[str, Any]]:
    out = []
    for k in range(n):
        t = torch.arange(length, dtype=torch.float32) + 100 * k
        out.append({"observations": t[:, None].repeat(1, 3), "actions": t[:, None].repeat(1, 2), "rewards": -t})
    return out


def test_a_002_subclass_of_rollout_file_base_reads_batches_transitions_and_iterates() -> None:
    from shmbuf.storage.files import RolloutDataset, RolloutFileBase

    ds = MemoryRollouts.make(memory_trajectories(6, 5), num_envs=2)
    assert isinstance(ds, RolloutFileBase) and isinstance(ds, torch.utils.data.IterableDataset)
    assert issubclass(RolloutDataset, RolloutFileBase) and ds.all_env_ids.tolist() == [0, 1]
    b = ds.get_batch(4)  # time-major, filled row by row through the namedtuple buffer
    assert b.observation.shape == (4, 2, 3)
    assert b.observation[:, 0, 0].tolist() == [0, 1, 2, 3] and b.observation[:, 1, 0].tolist() == [100, 101, 102, 103]
    buffer, infos = ds.get_transition_batch()  # The rsl_rl fork's (buffer, infos)
    assert buffer.observation.shape == (2, 3) and buffer.done.tolist() == [True, True]
    assert set(infos) == {"time_outs"} and infos["time_outs"].tolist() == [False, False]
    ds.reset([1])  # only env 1 takes a new trajectory
    assert ds.get_batch().observation[:, 0].tolist() == [200, 400]
    seen = [batch.observation[:, 0].tolist() for batch in torch.utils.data.DataLoader(ds, batch_size=None)]
    assert seen[0] == [0, 100] and len(seen) == 14  # reset by iteration; until an env finds no unused trajectory


def test_rollout_file_base_stays_abstract_and_checks_its_settings() -> None:
    from shmbuf.storage.files import RolloutFileBase

    with pytest.raises(TypeError, match=r"abstract"):
        RolloutFileBase("d", 2)
    with pytest.raises(shmbuf.UsageError, match=r"num_envs=\.\.\.\): expected an int >= 1"):
        MemoryRollouts.make([], num_envs=0)


def test_rsl_rl_2s_training_type_signature_is_refused_naming_the_one_to_use() -> None:
    from shmbuf.storage import RolloutStorage

    with pytest.raises(shmbuf.UsageError,
                       match=r"RolloutStorage\('rl', \.\.\.\): that is rsl_rl 2\+'s signature.*use rsl_rl 1\.x's"):
        RolloutStorage("rl", 4, 24, {"policy": torch.zeros(4, 3)}, (2,), "cpu")


# -- 6. docs/from-rsl_rl.md runs as written --------------------------------------------------------------------

PAGE = "from-rsl_rl.md"
PRINTS = {
    # 24 steps, every env's episode ends on a time-out at steps 9 and 19: pieces of 10, 10 and 4 (rsl_rl cuts at the
    # last row too), 8.0 on average; rewards 1 plus the small folded-in time-out bootstraps
    0: "Tensor (48, 12) (48, 1) cpu\n8.0 1.0\n(48, 4)\n(64, 12) (64, 12) 256\n(64, 12) (64, 12) 256\n",
    1: "(4, 2, 3)\n[True, True] [True, True]\n14\n",
}


def test_the_page_opens_with_002s_call_sites_and_only_the_import_changed() -> None:
    blocks = doc_blocks(PAGE)
    assert len(blocks) == len(PRINTS)
    first = blocks[0]
    imports = [line for line in first.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import torch",
                       "from shmbuf.storage import ReplayBuffer, RolloutStorage  # was: from rsl_rl.storage import ...",
                       "from shmbuf.storage.compat.rsl_rl import ActionLabelRollout  # was: from "
                       "rsl_rl.storage.rollout_storage import ..."]
    for call in ("RolloutStorage.Transition()", "add_transitions(transition)", "transition.clear()",
                 "compute_returns(", "mini_batch_generator(", "get_statistics()", "ReplayBuffer(12, 1000, device)",
                 "insert(", "feed_forward_generator("):
        assert call in first, call


@pytest.mark.parametrize("k", sorted(PRINTS))
def test_block_runs_as_written_and_prints_what_the_page_says(k: int, tmp_path: Any) -> None:
    assert run_doc_block(PAGE, k, tmp_path) == PRINTS[k]
    page = (pathlib.Path(__file__).parent.parent / "docs" / PAGE).read_text()
    if k == 0:
        assert "```text\n" + PRINTS[0] + "```" in page


def test_002s_attributes_and_helpers_are_there() -> None:
    from shmbuf.storage.compat.rsl_rl import QueueRolloutStorage
    from shmbuf.storage.files import FileTransition, RolloutDataset

    q = QueueRolloutStorage(2, 4, [3], [None], [2], "cpu", buffer_dilation_ratio=2.0)
    assert (q.obs_shape, q.privileged_obs_shape, q.actions_shape) == ((3,), None, (2,))
    ppo_rollout(q, 3, 2)
    assert q.step == 3
    rows = torch.arange(4)
    assert q.swap_from_cursor(rows).tolist() == [3, 0, 1, 2] and q.swap_from_cursor(np.arange(4)).tolist() == [3, 0, 1, 2]
    assert RolloutDataset.Transition is FileTransition
