"""TorchRL's AsyncBatchedCollector call sites on shmbuf, with only the import changed (docs/from-torchrl.md).

Every test imports the real torchrl and tensordict. The documented example runs as written (lambdas, threads);
its batches are compared with the real TorchRL collector's (keys, shapes, dtypes, the actions the env receives);
then every documented setting and method: backends, transport and weight sync at their defaults and refused
beyond, update_policy_weights_ in each of its forms, background collection into replay buffers, pause,
set_seed, receive_weights, the env and policy properties, shutdown. Env factories used by process workers live
at module level so that spawn and forkserver workers can import them.
"""

from __future__ import annotations

import logging
import pathlib
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="TorchRL's inputs need torch")
pytest.importorskip("tensordict", reason="TorchRL's inputs need tensordict")
pytest.importorskip("torchrl", reason="TorchRL's envs need torchrl")

import gymnasium as gym  # noqa: E402  (after the importorskip above)
from tensordict import TensorDict, TensorDictBase  # noqa: E402  (after the importorskip above)
from tensordict.nn import TensorDictModule  # noqa: E402  (after the importorskip above)
from torch import nn  # noqa: E402  (after the importorskip above)
from torchrl.envs import GymEnv, GymWrapper  # noqa: E402  (after the importorskip above)

import shmbuf  # noqa: E402  (after the importorskip above)
from tests.helpers import doc_blocks, run_doc_block  # noqa: E402  (after the importorskip above)
from workers import AsyncBatchedCollector  # noqa: E402  (after the importorskip above)

TORCHRL_KEYS = sorted(["action", "done", "env_index", "observation", "policy_version", "terminated", "truncated",
                       "next/done", "next/observation", "next/reward", "next/terminated", "next/truncated"])


def keys_of(td: TensorDictBase) -> list[str]:
    return sorted("/".join(k) if isinstance(k, tuple) else k for k in td.keys(True, True))


def linear_policy(seed: int = 0) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])


def make_cartpole() -> GymEnv:
    """A module-level factory: process workers (spawn, forkserver) import it."""
    return GymEnv("CartPole-v1")


class Recording(gym.Wrapper):
    """Records every action the gymnasium env receives (threads: the list is this process's)."""

    def __init__(self, env: gym.Env, seen: list):
        super().__init__(env)
        self.seen = seen

    def step(self, action):
        self.seen.append(action)
        assert self.env.action_space.contains(action), action
        return super().step(action)


def recording_cartpole(seen: list, **kw) -> GymWrapper:
    return GymWrapper(Recording(gym.make("CartPole-v1"), seen), **kw)


def wait_done(c: AsyncBatchedCollector, deadline: float = 60.0) -> None:
    """Poll until the background collection of start() has ended (total_frames reached), for at most ``deadline`` s."""
    tick = threading.Event()
    for _ in range(int(deadline / 0.05)):
        if not c.collecting:
            return
        tick.wait(0.05)
    raise AssertionError(f"the background collection still runs after {deadline} s")


def collector(**kw) -> AsyncBatchedCollector:
    kw.setdefault("create_env_fn", [lambda: GymEnv("CartPole-v1")] * 2)
    kw.setdefault("policy", linear_policy())
    kw.setdefault("frames_per_batch", 64)
    kw.setdefault("timeout", 60)
    return AsyncBatchedCollector(**kw)


# -- the documented example ---------------------------------------------------------------------------------------


def test_the_documented_example_runs_with_only_the_import_changed() -> None:
    policy = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
    c = AsyncBatchedCollector(create_env_fn=[lambda: GymEnv("CartPole-v1")] * 4, policy=policy, frames_per_batch=200,
                              total_frames=1000)
    try:
        shapes = [batch.shape for batch in c]
    finally:
        c.shutdown()
    assert shapes == [torch.Size([200])] * 5


# torchrl 0.14 warns at the import of its collectors
@pytest.mark.filterwarnings("ignore:Creating .* which inherits from WeightUpdaterBase:DeprecationWarning")
def test_batches_have_torchrls_keys_shapes_and_dtypes() -> None:
    """The same example under real TorchRL and under shmbuf: the same keys, per-frame shapes and dtypes."""
    from torchrl.collectors import AsyncBatchedCollector as TorchRLCollector

    ref_c = TorchRLCollector(create_env_fn=[lambda: GymEnv("CartPole-v1")] * 2, policy=linear_policy(),
                             frames_per_batch=64, total_frames=64, env_backend="threading")
    try:
        ref = next(iter(ref_c))
    finally:
        ref_c.shutdown()
    c = collector(total_frames=64)
    try:
        got = next(iter(c))
    finally:
        c.shutdown()
    assert keys_of(ref) == TORCHRL_KEYS == keys_of(got)
    assert got.batch_size == ref.batch_size == torch.Size([64])
    for k in ref.keys(True, True):
        assert got.get(k).shape == ref.get(k).shape, k
        assert got.get(k).dtype == ref.get(k).dtype, k
    assert not got["done"].any() and not ref["done"].any()  # every observation acted on is a live one
    assert set(got["env_index"].tolist()) <= {0, 1}  # a batch is whole rollouts: a fast worker may give both
    # next/observation is the successor: the next step's observation within an episode (one rollout: 32 frames)
    frames = got[:32]
    assert len(set(frames["env_index"].tolist())) == 1
    live = ~frames["next", "done"].squeeze(-1)[:-1]
    assert torch.equal(frames["next", "observation"][:-1][live], frames["observation"][1:][live])


def actions_through_the_spec(batch: TensorDictBase) -> list[int]:
    env = recording_cartpole([])
    try:
        return [int(env.action_spec.to_numpy(a)) for a in batch["action"]]
    finally:
        env.close()


@pytest.mark.filterwarnings("ignore:Creating .* which inherits from WeightUpdaterBase:DeprecationWarning")
def test_the_env_receives_actions_through_its_spec_as_under_torchrl() -> None:
    """A Linear's 2 logits reach TorchRL's one-hot spec, which makes the env's action (``long().argmax(-1)``):
    under shmbuf as under the real TorchRL collector, the env sees exactly the actions the spec makes of the
    logits stored in the batch, all valid (the recording env asserts each is in its action space)."""
    from torchrl.collectors import AsyncBatchedCollector as TorchRLCollector

    seen_ref: list = []
    ref_c = TorchRLCollector(create_env_fn=[lambda: recording_cartpole(seen_ref)], policy=linear_policy(),
                             frames_per_batch=32, total_frames=32, env_backend="threading")
    try:
        ref = next(iter(ref_c))
    finally:
        ref_c.shutdown()
    seen: list = []
    c = collector(create_env_fn=[lambda: recording_cartpole(seen)], total_frames=32, frames_per_batch=32)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    assert batch["action"].dtype == ref["action"].dtype == torch.float32  # logits, as TorchRL stores them
    assert batch["action"].shape == ref["action"].shape == (32, 2)
    assert [int(a) for a in seen_ref[:32]] == actions_through_the_spec(ref)
    assert [int(a) for a in seen[:32]] == actions_through_the_spec(batch)


def test_a_categorical_spec_takes_index_actions() -> None:
    """``categorical_action_encoding=True``: a policy writing an index gets it to the env as is (int64, shape ())."""

    class Argmax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, obs):
            return self.lin(obs).argmax(-1)

    seen: list = []
    policy = TensorDictModule(Argmax(), in_keys=["observation"], out_keys=["action"])
    c = collector(create_env_fn=[lambda: recording_cartpole(seen, categorical_action_encoding=True)], policy=policy,
                  total_frames=32, frames_per_batch=32)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    assert batch["action"].dtype == torch.int64 and batch["action"].shape == (32,)
    assert [int(a) for a in seen[:32]] == batch["action"].tolist()


def test_a_gymnasium_env_with_a_tensordict_policy_goes_through_torchrls_gym_wrapper() -> None:
    """A TensorDict module on ``gym.make`` envs: the env is wrapped in TorchRL's GymWrapper, so the logits reach it
    through the one-hot spec as under TorchRL (never as an invalid action), and the batch is TorchRL's."""
    seen: list = []
    c = collector(create_env_fn=[lambda: Recording(gym.make("CartPole-v1"), seen)], total_frames=32, frames_per_batch=32)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    assert keys_of(batch) == TORCHRL_KEYS and batch["action"].shape == (32, 2)
    assert [int(a) for a in seen[:32]] == batch["action"].long().argmax(-1).tolist()


def test_a_probabilistic_actor_stores_its_other_out_keys() -> None:
    from tensordict.nn import InteractionType
    from torchrl.modules import OneHotCategorical, ProbabilisticActor

    torch.manual_seed(0)
    actor = ProbabilisticActor(TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"]),
                               in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical,
                               return_log_prob=True, default_interaction_type=InteractionType.RANDOM)
    c = collector(policy=actor, total_frames=64)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    assert {"logits", "action_log_prob"} <= set(batch.keys())
    assert batch["action"].shape == (64, 2) and torch.all(batch["action"].sum(-1) == 1)  # one-hot samples
    dist = torch.distributions.OneHotCategorical(logits=batch["logits"])
    assert torch.allclose(dist.log_prob(batch["action"]), batch["action_log_prob"], atol=1e-5)


def test_exploration_type_and_post_collect_hook() -> None:
    """TorchRL 0.14's exploration_type reaches the actor's forward passes (deterministic: the mode, so the one-hot
    action is the logits' argmax); post_collect_hook sees every batch."""
    from tensordict.nn import InteractionType
    from torchrl.envs.utils import ExplorationType
    from torchrl.modules import OneHotCategorical, ProbabilisticActor

    torch.manual_seed(0)
    actor = ProbabilisticActor(TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"]),
                               in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical,
                               default_interaction_type=InteractionType.RANDOM)
    seen: list = []
    c = collector(policy=actor, exploration_type=ExplorationType.DETERMINISTIC, post_collect_hook=seen.append,
                  total_frames=128)
    try:
        batches = list(c)
    finally:
        c.shutdown()
    assert len(seen) == 2 and all(a is b for a, b in zip(seen, batches, strict=True))
    for b in batches:
        assert torch.equal(b["action"].argmax(-1), b["logits"].argmax(-1))
    with pytest.raises(shmbuf.UsageError, match="exploration_type"):
        collector(policy=actor, exploration_type="sometimes")


def test_a_frames_per_batch_that_is_not_a_multiple_of_the_envs() -> None:
    c = collector(create_env_fn=[lambda: GymEnv("CartPole-v1")] * 3, frames_per_batch=200, total_frames=300)
    try:
        shapes = [b.shape for b in c]
    finally:
        c.shutdown()
    assert shapes == [torch.Size([200]), torch.Size([100])]  # TorchRL stops at total_frames exactly


def test_yield_completed_trajectories_gives_whole_episodes() -> None:
    c = collector(yield_completed_trajectories=True, frames_per_batch=50, total_frames=50)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    n = batch.batch_size[0]
    assert n >= 50 and keys_of(batch) == TORCHRL_KEYS
    done = batch["next", "done"].squeeze(-1)
    assert bool(done[-1])  # the batch ends with an episode's end
    ends = torch.nonzero(done).squeeze(-1).tolist()
    starts = [0] + [e + 1 for e in ends[:-1]]
    for a, b in zip(starts, ends, strict=True):  # each episode from one env, in time order
        assert len(set(batch["env_index"][a : b + 1].tolist())) == 1
        assert torch.equal(batch["next", "observation"][a:b], batch["observation"][a + 1 : b + 1])


def test_postproc_gets_the_tensordict() -> None:
    got = []
    c = collector(total_frames=64, postproc=lambda td: got.append(type(td)) or td.exclude("env_index"))
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    assert issubclass(got[0], TensorDictBase) and "env_index" not in batch.keys()


# -- backends and the settings shmbuf has no use for -----------------------------------------------------------


def test_backends() -> None:
    c = collector(total_frames=64)
    try:
        assert type(c.env).__name__ == "ThreadActorPool"  # TorchRL's default: threads (the lambdas are not pickled)
    finally:
        c.shutdown()
    c = collector(create_env_fn=[make_cartpole] * 2, env_backend="multiprocessing", policy_backend="threading",
                  total_frames=64)
    try:
        assert next(iter(c)).shape == (64,)
        assert type(c.env).__name__ == "ActorPool"
    finally:
        c.shutdown()
    c = collector(backend="threading", policy_backend="multiprocessing", total_frames=64)
    c.shutdown()
    with pytest.raises(shmbuf.UsageError, match="RayCollector"):
        collector(backend="ray")
    with pytest.raises(shmbuf.UsageError, match="RayCollector"):
        collector(policy_backend="ray")
    with pytest.raises(shmbuf.UsageError, match="monarch"):
        collector(backend="monarch")
    with pytest.raises(shmbuf.UsageError, match="env_backend"):
        collector(env_backend="ray-ish")


def test_transport_weight_sync_and_verbose_at_their_defaults(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="workers.inference"):
        c = collector(transport=None, weight_sync=None, weight_sync_model_id="policy", verbose=True, total_frames=64)
        try:
            list(c)
        finally:
            c.shutdown()
    assert any("64 frames" in r.getMessage() for r in caplog.records)
    with pytest.raises(shmbuf.UsageError, match="transport"):
        collector(transport="driver")
    with pytest.raises(shmbuf.UsageError, match="update_policy_weights_"):
        collector(weight_sync=object())
    for name in ("env_exchange", "envs_per_worker", "transition_chunk_size", "worker_affinity", "driver_affinity",
                 "server_config", "device_config", "policy_version", "policy_version_key"):
        with pytest.raises(shmbuf.UsageError, match=f"{name}=: a setting of TorchRL 0.14"):
            collector(**{name: None})


# -- weights -------------------------------------------------------------------------------------------------------


def weight_of(c: AsyncBatchedCollector) -> torch.Tensor:
    return c.policy.module.weight.detach().clone()


def test_update_policy_weights_in_every_form() -> None:
    c = collector(total_frames=-1)
    try:
        it = iter(c)
        assert next(it)["policy_version"].max() == 0
        trained = linear_policy(seed=1)
        for k, call in enumerate([
            lambda: c.update_policy_weights_(),  # the policy given, changed in place
            lambda: c.update_policy_weights_(trained),
            lambda: c.update_policy_weights_(TensorDict.from_module(trained)),
            lambda: c.update_policy_weights_(trained.state_dict()),
            lambda: c.update_policy_weights_(weights=TensorDict.from_module(trained)),
            lambda: c.update_policy_weights_(policy=trained),
            lambda: c.update_policy_weights_({0: trained.state_dict(), 1: TensorDict.from_module(trained)}),
            lambda: c.update_policy_weights_(trained, model_id="policy"),
            lambda: c.update_policy_weights_(trained.module, model_id="module"),  # a submodule of the policy
            lambda: c.update_policy_weights_(weights_dict={"policy": trained}),
            lambda: c.update_policy_weights_(trained, worker_ids=[0, 1]),
            lambda: c.receive_weights(trained),
            lambda: c.receive_weights(weights=trained.state_dict()),
            lambda: c.receive_weights(),
        ], start=1):
            with torch.no_grad():
                c.policy.module.weight.zero_()
            call()
            assert c.policy_version == k
            if k > 1 and k != 14:
                assert torch.equal(weight_of(c), trained.module.weight), k
        assert c.update_policy_weights(trained) == 15  # shmbuf's own name stays
        while True:  # answers carry the new version: a batch collected wholly after the update shows it
            if next(it)["policy_version"].min() == 15:
                break
    finally:
        c.shutdown()


def test_update_policy_weights_refuses_what_one_served_policy_cannot_honour() -> None:
    c = collector(total_frames=64)
    try:
        a, b = linear_policy(seed=1), linear_policy(seed=2)
        with pytest.raises(shmbuf.UsageError, match="per-worker weights differ"):
            c.update_policy_weights_({0: a, 1: b})
        with pytest.raises(shmbuf.UsageError, match="worker_ids"):
            c.update_policy_weights_(a, worker_ids=[0])
        with pytest.raises(shmbuf.UsageError, match="model_id='critic'"):
            c.update_policy_weights_(a, model_id="critic")
        with pytest.raises(shmbuf.UsageError, match="once"):
            c.update_policy_weights_(a, weights=a.state_dict())
        with pytest.raises(shmbuf.UsageError, match="weights_dict"):
            c.update_policy_weights_(a, weights_dict={"policy": a})
        assert c.policy_version == 0
    finally:
        c.shutdown()


# -- background collection, pause and the rest ----------------------------------------------------------------------


def test_start_collects_into_a_torchrl_replay_buffer_until_total_frames() -> None:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = collector(replay_buffer=rb, total_frames=256)
    try:
        c.start()
        with pytest.raises(shmbuf.StateError):
            c.start()
        wait_done(c)
        assert not c.collecting
    finally:
        c.async_shutdown()
    assert len(rb) == 256
    assert keys_of(rb.sample(8)) == TORCHRL_KEYS


def test_start_collects_into_shmbufs_shared_memory_replay_buffer() -> None:
    from shmbuf.storage import ReplayBuffer

    c = collector(replay_buffer=500, total_frames=128)  # rows: shmbuf's ReplayBuffer, laid out from the first batch
    try:
        c.start()
        wait_done(c)
        rb = c.replay_buffer
        assert isinstance(rb, ReplayBuffer) and rb.num_samples == 128
        s = rb.sample(16)
        assert s["observation"].shape == (16, 4) and s["next"]["reward"].shape == (16, 1)
    finally:
        c.async_shutdown()
    with pytest.raises(shmbuf.UsageError, match="closed"):  # the collector made it, and closed it at shutdown
        len(rb)


def test_a_given_shmbuf_replay_buffer_takes_the_batches_rows() -> None:
    """A shmbuf.storage.ReplayBuffer made by the caller, laid out as one frame of a batch (workers._torchrl.numpy_tree)."""
    from shmbuf.storage import ReplayBuffer
    from workers.compat._torchrl import numpy_tree

    c = collector(total_frames=64)
    try:
        first = next(iter(c))
    finally:
        c.shutdown()
    with ReplayBuffer.create(numpy_tree(first[0]), 1000) as rb:
        c = collector(replay_buffer=rb, total_frames=128)
        try:
            assert list(c) == [None, None]
        finally:
            c.shutdown()
        assert rb.num_samples == 128 and rb.sample(4)["next"]["observation"].shape == (4, 4)


def test_iterating_with_a_replay_buffer_yields_none_as_torchrl() -> None:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = collector(replay_buffer=rb, total_frames=128)
    try:
        assert list(c) == [None, None]
    finally:
        c.shutdown()
    assert len(rb) == 128


def test_pause_holds_the_forward_passes_and_the_writes() -> None:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
    c = collector(replay_buffer=rb, total_frames=-1)
    try:
        c.start()
        with c.pause():
            forwards = c.stats()["server"]["forwards"]
            n = len(rb)
            c.update_policy_weights_(linear_policy(seed=3))  # allowed inside: this thread holds the server
            assert c.server is not None and not c.server.lock.acquire(blocking=False)
            done = threading.Event()
            done.wait(0.3)  # a short window in which nothing may move
            assert c.stats()["server"]["forwards"] == forwards and len(rb) == n
            with pytest.raises(shmbuf.StateError):
                with c.pause():
                    pass
        ok = threading.Event()
        for _ in range(600):  # collection resumes: a deadline of 60 s
            if len(rb) > n:
                break
            ok.wait(0.1)
        assert len(rb) > n
    finally:
        c.async_shutdown()


def test_background_errors_reach_async_shutdown() -> None:
    class Broken:
        def extend(self, td):
            raise ValueError("full")

    c = collector(replay_buffer=Broken(), total_frames=128)
    c.start()
    wait_done(c)
    with pytest.raises(RuntimeError, match="background") as info:
        c.async_shutdown()
    assert isinstance(info.value.__cause__, ValueError)


def test_the_other_names() -> None:
    policy = linear_policy()
    c = collector(policy=policy, total_frames=64)
    try:
        assert c.policy is policy
        assert c.set_seed(None) is None  # built without seed=: the envs keep their factories' seeds
        with pytest.raises(shmbuf.UsageError, match=r"set_seed\(7\): the actors started at construction"):
            c.set_seed(7)  # tests/test_torchrl_seeding.py: seed= at construction, against TorchRL's collectors
        with pytest.raises(shmbuf.UsageError, match="start"):
            c.start()  # no replay buffer
        with pytest.raises(shmbuf.UsageError, match="close_env=False"):
            c.shutdown(close_env=False)
        assert c.env is c.pool
    finally:
        c.shutdown(timeout=10, close_env=True, raise_on_error=True)
    c = collector(policy=None, policy_factory=linear_policy, total_frames=64)  # TorchRL's policy_factory: called here, once
    try:
        assert isinstance(c.policy, TensorDictModule)
        assert next(iter(c)).shape == (64,)
    finally:
        c.shutdown()


def test_numpy_inputs_keep_shmbufs_batches() -> None:
    from workers import CollectedBatch

    c = AsyncBatchedCollector([lambda: gym.make("CartPole-v1")] * 2, policy=lambda obs: (obs[:, 2] > 0).astype(np.int64),
                              frames_per_batch=64, total_frames=64, env_backend="threading", timeout=60)
    try:
        assert isinstance(next(iter(c)), CollectedBatch)
    finally:
        c.shutdown()


# -- docs/from-torchrl.md -------------------------------------------------------------------------------------------

BLOCKS = doc_blocks("from-torchrl.md")


# Every name TorchRL 0.14 documents for AsyncBatchedCollector (constructor, methods, properties):
# TorchRL's documentation of AsyncBatchedCollector and torchrl/collectors/_async_batched.py.
DOCUMENTED = [
    "create_env_fn", "policy", "policy_factory", "frames_per_batch", "total_frames", "max_batch_size", "min_batch_size",
    "server_timeout", "transport", "device", "backend", "env_backend", "policy_backend", "reset_at_each_iter",
    "postproc", "yield_completed_trajectories", "weight_sync", "weight_sync_model_id", "verbose", "create_env_kwargs",
    "replay_buffer", "exploration_type", "post_collect_hook",
    "async_shutdown", "cascade_execute", "enable_profile", "env", "init_updater", "iterator", "pause", "profile_config",
    "receive_weights", "register_scheme_receiver", "set_seed", "shutdown", "start", "update_policy_weights_",
    "worker_idx",
]


def test_the_page_maps_every_documented_name() -> None:
    page = (pathlib.Path(__file__).parent.parent / "docs" / "from-torchrl.md").read_text()
    table = page[page.index("## Every name"):]
    missing = [n for n in DOCUMENTED if f"`{n}" not in table]
    assert not missing, missing
    for name in ("cascade_execute", "enable_profile", "worker_idx", "register_scheme_receiver", "init_updater"):
        assert not hasattr(AsyncBatchedCollector, name), name  # refused: not defined, as the page says
    for name in ("update_policy_weights_", "receive_weights", "start", "async_shutdown", "pause", "set_seed", "env",
                 "policy", "shutdown", "iterator"):
        assert hasattr(AsyncBatchedCollector, name), name


def test_the_page_starts_with_torchrls_example_with_the_import_changed() -> None:
    assert BLOCKS[0].startswith("from workers import AsyncBatchedCollector\n")
    assert "lambda: GymEnv(\"CartPole-v1\")] * 4" in BLOCKS[0] and "collector.shutdown()" in BLOCKS[0]


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_docs_block_runs(k: int, tmp_path: pathlib.Path) -> None:
    out = run_doc_block("from-torchrl.md", k, tmp_path, timeout=300)
    lines = out.splitlines()
    if k == 0:
        assert lines == ["torch.Size([200])"]
    elif "replay_buffer=rb" in BLOCKS[k]:
        last = lines[-1]  # torchrl logs its storage's creation to stdout first
        assert last.startswith("1024 [") and "'next'" in last and "'env_index'" in last, lines
    else:
        assert lines[-1:] == ["20"]  # 4 batches, 5 updates after each


LAZY_FACTORY_SCRIPT = '''
import sys

import numpy as np

from workers import AsyncBatchedCollector


def make():
    from torchrl.envs import GymEnv  # torchrl imported only here, inside the factory

    return GymEnv("CartPole-v1")


def policy(obs):
    return np.eye(2, dtype=np.int64)[np.zeros(len(obs), int)]  # CartPole's one-hot action spec


assert not {"torchrl", "tensordict"} & set(sys.modules)
c = AsyncBatchedCollector([make] * 2, policy=policy, frames_per_batch=16, env_backend="threading", timeout=60)
try:
    b = next(iter(c))
    print(type(b).__name__, tuple(b.batch_size))
finally:
    c.shutdown()
'''


def test_a_factory_that_imports_torchrl_itself_is_stepped_through_torchrl(tmp_path: pathlib.Path) -> None:
    """What a factory returns decides whether its env is stepped through TorchRL's API, not whether torchrl was
    imported before the collector was made (a fresh interpreter, torchrl imported only inside the factory)."""
    from tests.helpers import run_script

    script = tmp_path / "lazy_torchrl_factory.py"
    script.write_text(LAZY_FACTORY_SCRIPT)
    assert run_script(script, tmp_path, timeout=240).stdout.strip().splitlines()[-1] == "TensorDict (16,)"
