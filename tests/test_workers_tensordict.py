"""to_tensordict: a CollectedBatch in TorchRL's layout, views where the layout allows, and TorchRL's PPO loss on it.

Hand-built batches (deterministic values, every key checked against hand-written arrays) cover single and
vector envs, short rollouts and complete episodes; a real Collector on CartPole then feeds TorchRL's GAE
and ClipPPOLoss, checked against a reference computed from the raw batch. The env factories and the policy
live at module level so that spawn and forkserver actors can import them.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="to_tensordict needs torch (pip install torch==2.13.0)")
pytest.importorskip("tensordict", reason="to_tensordict needs tensordict (pip install tensordict)")

from torch import nn  # noqa: E402  (after the importorskip above)

import shmbuf  # noqa: E402  (after the importorskip above)
from shmbuf.layout import successors  # noqa: E402  (after the importorskip above)
from workers import CollectedBatch, Collector  # noqa: E402  (after the importorskip above)
from workers.compat._tensordict import to_tensordict  # noqa: E402  (after the importorskip above)

F32 = np.float32


def collected(mode: str = "truncate_episodes", **fields) -> CollectedBatch:
    """A CollectedBatch as the collectors build it (only what to_tensordict reads needs to be right)."""
    fields.setdefault("episode_returns", np.zeros(0))
    fields.setdefault("episode_lengths", np.zeros(0, np.int64))
    return CollectedBatch(batch_mode=mode, **fields)


def shares(t, a: np.ndarray) -> bool:
    """``t`` reads ``a``'s memory: np.shares_memory, and a write into ``a`` shows through ``t``."""
    if not np.shares_memory(t.numpy(), a):
        return False
    t_np = t.numpy()
    before = t_np.copy()
    flat = a.reshape(-1) if a.flags.c_contiguous else None
    assert flat is not None
    old = flat[0].copy()
    flat[0] = flat[0] + 1 if a.dtype != bool else not flat[0]
    changed = not np.array_equal(t_np, before)
    flat[0] = old
    return changed


def episode_table(m: int, item: tuple[int, ...], rows: list[list[tuple[int, int, bool, bool, np.ndarray]]]) -> dict:
    """Episode tables ``(B, m, ...)`` from per-rollout rows (end, env, terminated, truncated, final_obs).

    Rows past each rollout's count hold garbage (end 0, final_obs -5555) that must never be read."""
    B = len(rows)
    ep = {"return": np.zeros((B, m)), "length": np.zeros((B, m), np.int64), "terminated": np.zeros((B, m), bool),
          "truncated": np.zeros((B, m), bool), "env": np.zeros((B, m), np.int32), "end": np.zeros((B, m), np.int32),
          "final_obs": np.full((B, m, *item), -5555, F32)}
    for b, rs in enumerate(rows):
        for i, (end, env, term, trunc, final) in enumerate(rs):
            ep["end"][b, i], ep["env"][b, i] = end, env
            ep["terminated"][b, i], ep["truncated"][b, i] = term, trunc
            ep["final_obs"][b, i] = final
    return ep


# -- hand-built batches --------------------------------------------------------------------------------


def single_env_batch() -> CollectedBatch:
    """B=2 rollouts of T=5 steps of one env, obs[b, t] = [100 b + t, -(100 b + t)].

    Rollout 0: terminated at t=1 (final obs 901), truncated at t=3 (final obs 903), bootstrap 150.
    Rollout 1: terminated at its last step t=4 (final obs 914, which is also its bootstrap row).
    """
    B, T = 2, 5
    v = (100 * np.arange(B)[:, None] + np.arange(T)[None, :]).astype(F32)
    step = {
        "obs": np.stack([v, -v], -1),
        "action": (10 * np.arange(B)[:, None] + np.arange(T)).astype(np.int64),
        "reward": (0.5 + v).astype(F32),
        "terminated": np.zeros((B, T), bool),
        "truncated": np.zeros((B, T), bool),
        "logp": (-v / 1000).astype(F32),
        "value": (v / 10).astype(F32)[..., None],
    }
    step["terminated"][0, 1] = step["truncated"][0, 3] = step["terminated"][1, 4] = True
    ep = episode_table(10, (2,), [[(1, 0, True, False, [901, -901]), (3, 0, False, True, [903, -903])],
                                  [(4, 0, True, False, [914, -914])]])
    boot = {"obs": np.array([[150, -150], [914, -914]], F32), "env_steps": np.array([5, 5])}
    fill = {"step": np.array([5, 5]), "episode": np.array([2, 1]), "bootstrap": np.array([1, 1])}
    return collected(data={"step": step, "episode": ep, "bootstrap": boot}, fill=fill, policy_version=np.array([7, 9]),
                     lengths=fill["step"], frames=10)


ROOT_KEYS = {"observation", "action", "logp", "value", "policy_version", ("next", "observation"), ("next", "reward"),
             ("next", "done"), ("next", "terminated"), ("next", "truncated"), ("collector", "traj_ids")}


def test_single_env_every_key_and_the_views():
    batch = single_env_batch()
    step = batch.data["step"]
    td = to_tensordict(batch)
    assert td.batch_size == (2, 5)
    assert set(td.keys(True, True)) == ROOT_KEYS | {("collector", "mask")}
    def o(*v):
        return [v[0], -v[0]] if len(v) == 1 else v

    want_next = np.array([[o(1), o(901), o(3), o(903), o(150)],
                          [o(101), o(102), o(103), o(104), o(914)]], F32)
    assert np.array_equal(td["next", "observation"].numpy(), want_next)
    assert np.array_equal(td["observation"].numpy(), step["obs"])
    assert np.array_equal(td["action"].numpy(), step["action"])
    assert np.array_equal(td["logp"].numpy(), step["logp"])
    assert np.array_equal(td["value"].numpy(), step["value"]) and td["value"].shape == (2, 5, 1)
    assert np.array_equal(td["next", "reward"].numpy(), step["reward"][..., None])
    assert td["next", "terminated"].squeeze(-1).tolist() == [[False, True, False, False, False], [False] * 4 + [True]]
    assert td["next", "truncated"].squeeze(-1).tolist() == [[False, False, False, True, False], [False] * 5]
    assert td["next", "done"].squeeze(-1).tolist() == [[False, True, False, True, False], [False] * 4 + [True]]
    assert all(td["next", k].shape == (2, 5, 1) for k in ("reward", "done", "terminated", "truncated"))
    assert td["collector", "traj_ids"].tolist() == [[0, 0, 1, 1, 2], [3, 3, 3, 3, 3]]
    assert td["collector", "mask"].all()
    assert td["policy_version"].tolist() == [[7] * 5, [9] * 5] and td["policy_version"].dtype == torch.int64
    # Zero-copy: these entries are the batch's arrays (a write into the batch shows in the TensorDict).
    for key, leaf in (("observation", "obs"), ("action", "action"), ("logp", "logp"), ("value", "value"),
                      (("next", "reward"), "reward"), (("next", "terminated"), "terminated"),
                      (("next", "truncated"), "truncated")):
        assert shares(td[key], step[leaf]), key
        assert td[key].data_ptr() == step[leaf].ctypes.data, key
    assert not np.shares_memory(td["next", "observation"].numpy(), step["obs"])


def vector_env_batch() -> CollectedBatch:
    """B=2 rollouts of T=3 steps of E=2 sub-envs, obs[b, t, e] = [100 b + 10 t + e].

    Rollout 0: env 1 terminated at t=0 (final 500), env 0 truncated at t=1 (final 600); bootstrap [130, 131].
    Rollout 1: env 0 terminated at its last step t=2 (final 777 = its bootstrap row); env 1 runs on (bootstrap 231).
    """
    B, T, E = 2, 3, 2
    v = (100 * np.arange(B)[:, None, None] + 10 * np.arange(T)[None, :, None] + np.arange(E)[None, None, :]).astype(F32)
    step = {"obs": v[..., None], "action": v.astype(np.int64) + 1, "reward": v / 2,
            "terminated": np.zeros((B, T, E), bool), "truncated": np.zeros((B, T, E), bool), "logp": -v}
    step["terminated"][0, 0, 1] = step["truncated"][0, 1, 0] = step["terminated"][1, 2, 0] = True
    ep = episode_table(6, (1,), [[(0, 1, True, False, [500]), (1, 0, False, True, [600])], [(2, 0, True, False, [777])]])
    boot = {"obs": np.array([[[130], [131]], [[777], [231]]], F32), "env_steps": np.array([6, 12])}
    fill = {"step": np.array([3, 3]), "episode": np.array([2, 1]), "bootstrap": np.array([1, 1])}
    return collected(data={"step": step, "episode": ep, "bootstrap": boot}, fill=fill, policy_version=np.array([1, 2]),
                     lengths=fill["step"], frames=12)


def test_vector_env_time_is_the_last_batch_dim_through_a_permuted_view():
    batch = vector_env_batch()
    step = batch.data["step"]
    td = to_tensordict(batch)
    assert td.batch_size == (2, 2, 3)  # (B, E, T)
    want_next = np.array([[[10, 600, 130], [500, 21, 131]],
                          [[110, 120, 777], [111, 121, 231]]], F32)[..., None]
    assert np.array_equal(td["next", "observation"].numpy(), want_next)
    assert td["next", "observation"].is_contiguous()
    assert np.array_equal(td["observation"].numpy(), step["obs"].transpose(0, 2, 1, 3))
    assert np.array_equal(td["action"].numpy(), step["action"].transpose(0, 2, 1))
    assert np.array_equal(td["logp"].numpy(), step["logp"].transpose(0, 2, 1))
    assert np.array_equal(td["next", "reward"].numpy(), step["reward"].transpose(0, 2, 1)[..., None])
    assert td["next", "terminated"].squeeze(-1).tolist() == [[[False] * 3, [True, False, False]],
                                                             [[False, False, True], [False] * 3]]
    assert td["next", "truncated"].squeeze(-1).tolist() == [[[False, True, False], [False] * 3], [[False] * 3] * 2]
    assert td["next", "done"].squeeze(-1).tolist() == [[[False, True, False], [True, False, False]],
                                                       [[False, False, True], [False] * 3]]
    assert td["collector", "traj_ids"].tolist() == [[[0, 0, 1], [2, 3, 3]], [[4, 4, 4], [5, 5, 5]]]
    assert td["collector", "mask"].shape == (2, 2, 3) and td["collector", "mask"].all()
    assert td["policy_version"].tolist() == [[[1] * 3] * 2, [[2] * 3] * 2]
    for key, leaf in (("observation", "obs"), ("action", "action"), ("logp", "logp"), (("next", "reward"), "reward"),
                      (("next", "terminated"), "terminated"), (("next", "truncated"), "truncated")):
        assert shares(td[key], step[leaf]), key
        assert not td[key].is_contiguous()  # a permuted view, not a copy


def short_batch() -> CollectedBatch:
    """B=3, T=4, fills [4, 2, 3]: rows past a fill hold stale values (obs 999, flags set) that are padding.

    Rollout 1's last stored step (t=1) does not end its episode: its successor is the bootstrap row (250).
    Rollout 2's last stored step (t=2) is terminated (final obs 333, also its bootstrap row).
    """
    B, T = 3, 4
    v = (100 * np.arange(B)[:, None] + np.arange(T)[None, :]).astype(F32)
    filled = np.arange(T)[None, :] < np.array([4, 2, 3])[:, None]
    obs = np.where(filled, v, 999).astype(F32)[..., None]
    step = {"obs": obs, "action": np.where(filled, 1, 7).astype(np.int64), "reward": np.where(filled, 1.0, 99.0).astype(F32),
            "terminated": ~filled, "truncated": ~filled, "logp": np.full((B, T), -0.5, F32)}
    step["terminated"][2, 2] = True
    ep = episode_table(4, (1,), [[], [], [(2, 0, True, False, [333])]])
    boot = {"obs": np.array([[50], [250], [333]], F32), "env_steps": np.array([4, 2, 3])}
    fill = {"step": np.array([4, 2, 3]), "episode": np.array([0, 0, 1]), "bootstrap": np.array([1, 1, 1])}
    return collected(data={"step": step, "episode": ep, "bootstrap": boot}, fill=fill, policy_version=np.zeros(3, np.int64),
                     lengths=fill["step"], frames=9)


def test_short_rollouts_padding_is_masked_and_each_cut_is_marked_truncated_on_a_copy():
    batch = short_batch()
    step = batch.data["step"]
    trunc_before = step["truncated"].copy()
    td = to_tensordict(batch)
    assert td["collector", "mask"].tolist() == [[True] * 4, [True, True, False, False], [True, True, True, False]]
    assert td["collector", "traj_ids"].tolist() == [[0, 0, 0, 0], [1, 1, -1, -1], [2, 2, 2, -1]]
    assert td["next", "observation"].squeeze(-1).tolist() == [[1, 2, 3, 50], [101, 250, 0, 0], [201, 202, 333, 0]]
    # The cut of rollout 1 (t=1, not done) is marked truncated; rollout 2 ended terminated there, so it is not.
    # Padding keeps the batch's stale flags: it is masked out, never read as data.
    assert td["next", "truncated"].squeeze(-1).tolist() == [[False] * 4, [False, True, True, True],
                                                            [False, False, False, True]]
    assert td["next", "terminated"].squeeze(-1).tolist() == [[False] * 4, [False, False, True, True],
                                                             [False, False, True, True]]
    assert td["next", "done"].squeeze(-1).tolist() == [[False] * 4, [False, True, True, True], [False, False, True, True]]
    assert np.array_equal(step["truncated"], trunc_before), "the batch itself must not change"
    assert not np.shares_memory(td["next", "truncated"].numpy(), step["truncated"])
    assert shares(td["next", "terminated"], step["terminated"]) and shares(td["observation"], step["obs"])
    valid = td[td["collector", "mask"]]
    assert valid.batch_size == (9,) and valid["observation"].squeeze(-1).tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 202]


def test_short_rollouts_torchrl_gae_never_reads_padding():
    """GAE over the time axis of a short batch equals GAE over each rollout's stored steps alone."""
    from tensordict.nn import TensorDictModule
    from torchrl.objectives.value import GAE

    batch = short_batch()
    critic = TensorDictModule(lambda x: x / 100.0, in_keys=["observation"], out_keys=["state_value"])
    td = to_tensordict(batch)
    GAE(gamma=0.9, lmbda=0.8, value_network=critic)(td)
    step, n = batch.data["step"], batch.fill["step"]
    for b in range(3):
        rollout = {k: {kk: vv[b] for kk, vv in v.items()} for k, v in batch.data.items()}
        succ = successors(rollout, {k: int(v[b]) for k, v in batch.fill.items()})[:, 0] / 100.0
        val = step["obs"][b, : n[b], 0] / 100.0
        want = reference_gae(step["reward"][b, : n[b]], val, succ, step["terminated"][b, : n[b]],
                             step["terminated"][b, : n[b]] | step["truncated"][b, : n[b]], 0.9, 0.8)
        assert np.allclose(td["advantage"][b, : n[b], 0].numpy(), want, atol=1e-5), b


def reference_gae(reward, value, next_value, terminated, done, gamma, lam):
    """GAE over one rollout's stored steps, one step at a time (the rollout's last step ends the recursion)."""
    adv = np.zeros(len(reward))
    a = 0.0
    for t in reversed(range(len(reward))):
        delta = reward[t] + gamma * (1.0 - terminated[t]) * next_value[t] - value[t]
        a = delta + (gamma * lam * (1.0 - done[t]) * a if t < len(reward) - 1 else 0.0)
        adv[t] = a
    return adv


def complete_batch(version_leaf: bool) -> CollectedBatch:
    """Three episodes of lengths [3, 1, 2] concatenated (N=6), obs[i] = [i, 10 i]; bootstrap rows 70, 80, 90."""
    lengths = np.array([3, 1, 2])
    i = np.arange(6, dtype=F32)
    step = {"obs": np.stack([i, 10 * i], -1), "action": np.arange(6, dtype=np.int64) * 3, "reward": i + 0.25,
            "terminated": np.array([0, 0, 1, 0, 0, 1], bool), "truncated": np.array([0, 0, 0, 1, 0, 1], bool),
            "value": -i}
    if version_leaf:  # the batched-inference collector stamps every step with the version that chose it
        step["policy_version"] = np.array([3, 3, 4, 4, 5, 6], np.int64)
    ep = {"return": np.zeros(3), "length": lengths, "terminated": np.array([1, 0, 1], bool),
          "truncated": np.array([0, 1, 1], bool), "env": np.zeros(3, np.int32)}
    boot = {"obs": np.array([[70, 700], [80, 800], [90, 900]], F32), "env_steps": np.array([3, 4, 6])}
    return collected("complete_episodes", data={"step": step, "episode": ep, "bootstrap": boot}, fill=None,
                     policy_version=np.array([3, 4, 5]), lengths=lengths, frames=6)


@pytest.mark.parametrize("version_leaf", [True, False], ids=["step-version", "rollout-version"])
def test_complete_episodes_flat_with_one_traj_id_per_episode(version_leaf):
    batch = complete_batch(version_leaf)
    step = batch.data["step"]
    td = to_tensordict(batch)
    assert td.batch_size == (6,)
    assert set(td.keys(True, True)) == (ROOT_KEYS - {"logp"})  # no padding, so no mask (TorchRL's "cat" format)
    assert td["next", "observation"].tolist() == [[1, 10], [2, 20], [70, 700], [80, 800], [5, 50], [90, 900]]
    assert td["next", "done"].squeeze(-1).tolist() == [False, False, True, True, False, True]
    assert td["collector", "traj_ids"].tolist() == [0, 0, 0, 1, 2, 2]
    for key, leaf in (("observation", "obs"), ("action", "action"), ("value", "value"), (("next", "reward"), "reward"),
                      (("next", "terminated"), "terminated"), (("next", "truncated"), "truncated")):
        assert shares(td[key], step[leaf]), key
    if version_leaf:
        assert td["policy_version"].tolist() == [3, 3, 4, 4, 5, 6]
        assert shares(td["policy_version"], step["policy_version"])
    else:
        assert td["policy_version"].tolist() == [3, 3, 3, 4, 5, 5]


def test_a_step_version_leaf_is_a_view_in_truncate_mode_too():
    batch = vector_env_batch()
    pv = np.arange(12, dtype=np.int64).reshape(2, 3, 2)
    batch.data["step"]["policy_version"] = pv
    td = to_tensordict(batch)
    assert np.array_equal(td["policy_version"].numpy(), pv.transpose(0, 2, 1)) and shares(td["policy_version"], pv)
    assert set(td.keys(True, True)) == (ROOT_KEYS - {"value"}) | {("collector", "mask")}  # not an extra as well


def test_dict_observations_and_rename():
    batch = single_env_batch()
    d = batch.data
    pos = d["step"]["obs"]
    def px(a):
        return (np.abs(a) % 256).astype(np.uint8)

    d["step"]["obs"] = {"pos": pos, "cam": {"px": px(pos)}}
    d["bootstrap"]["obs"] = {"pos": d["bootstrap"]["obs"], "cam": {"px": px(d["bootstrap"]["obs"])}}
    d["episode"]["final_obs"] = {"pos": d["episode"]["final_obs"], "cam": {"px": px(d["episode"]["final_obs"])}}
    td = to_tensordict(batch, rename={"pos": "position", "logp": "sample_log_prob", "value": "state_value"})
    assert {"position", ("cam", "px"), "sample_log_prob", "state_value", ("next", "position"),
            ("next", "cam", "px")} <= set(td.keys(True, True))
    assert not {"observation", "logp", "value", "pos"} & set(td.keys())
    assert np.array_equal(td["next", "position"].numpy(), to_tensordict(single_env_batch())["next", "observation"].numpy())
    assert np.array_equal(td["next", "cam", "px"].numpy(), px(td["next", "position"].numpy()))
    assert shares(td["position"], pos) and shares(td["sample_log_prob"], d["step"]["logp"])


def test_bad_calls_say_what_to_do(monkeypatch):
    with pytest.raises(shmbuf.UsageError, match=r"rename: \['logprob'\] name no entry.*'logp'"):
        to_tensordict(single_env_batch(), rename={"logprob": "sample_log_prob"})
    with pytest.raises(shmbuf.UsageError, match=r"rename: \['action'\] would name two entries"):
        to_tensordict(single_env_batch(), rename={"logp": "action"})
    with pytest.raises(shmbuf.UsageError, match="expected a workers.CollectedBatch"):
        to_tensordict({"step": {}})
    bad = single_env_batch()
    bad.fill = None
    with pytest.raises(shmbuf.UsageError, match="needs batch.fill"):
        to_tensordict(bad)
    bad = single_env_batch()
    bad.data["bootstrap"]["obs"] = bad.data["bootstrap"]["obs"][:1]
    with pytest.raises(shmbuf.SchemaError, match=r"bootstrap obs has shape \(1, 2\); expected \(2, 2\)"):
        to_tensordict(bad)
    monkeypatch.setitem(sys.modules, "tensordict", None)  # as if it were not installed
    with pytest.raises(shmbuf.UsageError, match="pip install tensordict"):
        to_tensordict(single_env_batch())


def test_a_read_only_array_is_copied_without_a_warning():
    batch = single_env_batch()
    obs = batch.data["step"]["obs"]
    obs.flags.writeable = False
    td = to_tensordict(batch)  # warnings are errors in this suite: torch.from_numpy would warn on it
    assert np.array_equal(td["observation"].numpy(), obs) and not np.shares_memory(td["observation"].numpy(), obs)


# -- a real Collector on CartPole, and TorchRL's PPO loss on the result -------------------------------


def make_cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def make_cartpole_vector():
    import gymnasium as gym

    return gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")


class ActorCritic(nn.Module):
    """CartPole policy for the actors: samples an action, returns ``(action, {"logp", "value"})``."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.pi = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.v = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, obs):
        dist = torch.distributions.Categorical(logits=self.pi(obs))
        action = dist.sample()
        return action, {"logp": dist.log_prob(action), "value": self.v(obs)}


@pytest.mark.parametrize("vector", [False, True], ids=["single-env", "vector-env"])
def test_torchrl_gae_and_clip_ppo_loss_run_unchanged_on_a_real_batch(vector):
    pytest.importorskip("torchrl", reason="the TorchRL loss test needs torchrl (pip install torchrl==0.14.1)")
    pytest.importorskip("gymnasium")
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    net = ActorCritic()
    actor = ProbabilisticActor(TensorDictModule(net.pi, in_keys=["observation"], out_keys=["logits"]), in_keys=["logits"],
                               distribution_class=torch.distributions.Categorical, return_log_prob=True)
    critic = ValueOperator(net.v, in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic)
    E = 2 if vector else 1
    # One actor process (its start, importing torch, is most of this test's time): four rollouts of it per batch.
    with Collector(make_cartpole_vector if vector else make_cartpole, net, num_actors=1, frames_per_batch=512,
                   rollout_len=128 // E, start_method="forkserver", timeout=60, stop_timeout=5, total_frames=512) as c:
        batch = next(iter(c))
        step = batch.data["step"]
        td = to_tensordict(batch, rename={"logp": loss.tensor_keys.sample_log_prob})
        assert td.batch_size == ((4, 2, 64) if vector else (4, 128))
        assert shares(td["observation"], step["obs"]) and shares(td["action"], step["action"])
        tl = (lambda a: a.swapaxes(1, 2)) if vector else (lambda a: a)
        assert int(td["next", "done"].sum()) >= 4  # CartPole's episodes end inside the batch: the final obs matter

        # next/observation: the true successors (shmbuf.layout.successors, rollout by rollout).
        succ = np.stack([successors({k: {kk: vv[b] for kk, vv in v.items()} for k, v in batch.data.items()},
                                    {k: int(v[b]) for k, v in batch.fill.items()}) for b in range(4)])
        assert np.array_equal(td["next", "observation"].numpy(), tl(succ))

        # The learner's actor and critic (the actors' weights) read back what the actors stored.
        with torch.no_grad():
            logp = actor.get_dist(td).log_prob(td["action"])
            value = critic(td.select("observation").clone())["state_value"]
        assert torch.allclose(logp, td[loss.tensor_keys.sample_log_prob], atol=1e-5)
        assert torch.allclose(value, td["value"], atol=1e-5)

        GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td)
        with torch.no_grad():
            v_succ = net.v(torch.from_numpy(succ)).squeeze(-1).numpy()
        done = step["terminated"] | step["truncated"]
        for b in range(4):
            for e in range(E):
                ix = (b, slice(None), e) if vector else (b, slice(None))
                want = reference_gae(step["reward"][ix], step["value"][ix][..., 0], v_succ[ix], step["terminated"][ix],
                                     done[ix], 0.99, 0.95)
                got = td["advantage"][(b, e) if vector else b][..., 0].numpy()
                assert np.allclose(got, want, atol=1e-4), (b, e)

        out = loss(td)
        # The learner's weights are the ones that acted: every ratio is 1, so the clipped objective is -mean(A).
        assert torch.allclose(out["loss_objective"], -td["advantage"].mean(), atol=1e-5)
        total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
        assert torch.isfinite(total)
        total.backward()
        grads = [p.grad for p in net.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert all(g.abs().sum() > 0 for g in grads)


# -- TorchRL's AsyncBatchedCollector layout (workers._torchrl.torchrl_batch) ------------------------------------------


def test_torchrls_flat_layout_leaves_padding_out_and_numbers_envs_by_lane():
    """The layout TorchRL's AsyncBatchedCollector yields, from hand-built batches: one dim of frames, rollout by
    rollout in time order, padding left out, env_index from each rollout's writer lane (times E, plus the sub-env),
    root flags False, and the reward cast to the env's dtype."""
    pytest.importorskip("torchrl", reason="workers._torchrl is TorchRL's path")
    from workers.compat._torchrl import torchrl_batch

    batch = short_batch()
    batch.lane = np.array([2, 0, 1])
    td = torchrl_batch(batch, reward_dtype=torch.float64)
    assert td.batch_size == (9,)  # fills 4 + 2 + 3: no padding row
    assert "collector" not in td.keys()
    assert td["observation"].squeeze(-1).tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 202]
    assert td["env_index"].tolist() == [2] * 4 + [0] * 2 + [1] * 3
    assert td["next", "observation"].squeeze(-1).tolist() == [1, 2, 3, 50, 101, 250, 201, 202, 333]
    assert td["next", "done"].squeeze(-1).tolist() == [False, False, False, False, False, True, False, False, True]
    assert td["next", "reward"].dtype == torch.float64 and td["next", "reward"].shape == (9, 1)
    assert all(not td[k].any() and td[k].shape == (9, 1) for k in ("done", "terminated", "truncated"))

    vec = vector_env_batch()
    vec.lane = np.array([1, 0])
    td = torchrl_batch(vec)
    assert td.batch_size == (12,)  # B=2 x E=2 x T=3, each sub-env's steps in time order
    assert td["env_index"].tolist() == [2] * 3 + [3] * 3 + [0] * 3 + [1] * 3
