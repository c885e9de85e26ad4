"""Seeds of TorchRL envs under AsyncBatchedCollector, frame for frame against TorchRL 0.14.1's own collectors.

TorchRL's rule (torchrl/envs/common.py, torchrl/collectors/_multi_base.py, _runner.py): ``EnvBase.set_seed(s)``
seeds the env and returns the next seed (``seed_generator(s)``, or ``s`` with ``static_seed``); a multi-process
collector's ``set_seed(s)`` seeds worker 0's env with ``s``, worker ``i+1``'s with what worker ``i``'s returned, then
resets them all, and returns the last one's. ``AsyncBatchedCollector`` itself never seeds: a factory's own
``env.set_seed(...)`` holds. The policy is a Linear TensorDict module: deterministic, so equal seeds give equal
frames. Env factories live at module level (TorchRL's multi-process collector spawns its workers).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="TorchRL's envs need torch")
pytest.importorskip("torchrl", reason="TorchRL's collectors are the reference")

from tensordict.nn import TensorDictModule  # noqa: E402  (after the importorskip above)
from torch import nn  # noqa: E402  (after the importorskip above)
from torchrl.envs import GymEnv  # noqa: E402  (after the importorskip above)

import shmbuf  # noqa: E402  (after the importorskip above)
from workers import AsyncBatchedCollector  # noqa: E402  (after the importorskip above)

KEYS = ("observation", ("next", "observation"), ("next", "reward"), ("next", "done"), "action")
# torchrl 0.14 warns at the import of its collectors
pytestmark = pytest.mark.filterwarnings("ignore:Creating .* which inherits from WeightUpdaterBase:DeprecationWarning")


def policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])


def make_cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


def seeded_cartpole(seed: int) -> GymEnv:
    """A factory that seeds its own env, as TorchRL users write it."""
    env = GymEnv("CartPole-v1")
    env.set_seed(seed)
    return env


def per_env(batches: list[Any], n: int) -> dict[int, dict[Any, torch.Tensor]]:
    """Each env's first ``n`` frames (by ``env_index``, in the order the batches hold them)."""
    out: dict[int, dict[Any, list[torch.Tensor]]] = {}
    for b in batches:
        for i in b["env_index"].unique().tolist():
            rows = b[b["env_index"] == i]
            for k in KEYS:
                out.setdefault(int(i), {}).setdefault(k, []).append(rows.get(k))
    return {i: {k: torch.cat(v)[:n] for k, v in cols.items()} for i, cols in out.items()}


def shmbuf_frames(n: int, **kw: Any) -> tuple[dict[int, dict[Any, torch.Tensor]], Any]:
    """Each env's first ``n`` frames under shmbuf's AsyncBatchedCollector, and what its ``set_seed`` answers."""
    c = AsyncBatchedCollector(policy=policy(), frames_per_batch=2 * n, timeout=60, **kw)
    try:
        batches = []
        for b in c:
            batches.append(b)
            got = per_env(batches, n)
            if all(len(v["observation"]) >= n for v in got.values()) and len(got) == c.num_actors:
                break
        seed = kw.get("seed")
        answer = c.set_seed(seed, kw.get("static_seed", False))
    finally:
        c.shutdown()
    return got, answer


def assert_same(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor], what: str) -> None:
    for k in KEYS:
        assert torch.equal(a[k], b[k].to(a[k].dtype)), (what, k)


def test_a_factorys_own_set_seed_holds_frame_for_frame_as_under_torchrl() -> None:
    """No ``seed=``: each env keeps the seed its factory set, as under TorchRL's AsyncBatchedCollector. Three seeds
    give three different runs, each equal to TorchRL's frame for frame."""
    from torchrl.collectors import AsyncBatchedCollector as TorchRLCollector

    n = 40
    firsts = []
    for s in (3, 4, 5):
        ref_c = TorchRLCollector(create_env_fn=[partial(seeded_cartpole, s)], policy=policy(), frames_per_batch=n,
                                 total_frames=n, env_backend="threading")
        try:
            ref = per_env([next(iter(ref_c))], n)[0]
        finally:
            ref_c.shutdown()
        got, _ = shmbuf_frames(n, create_env_fn=[partial(seeded_cartpole, s)])
        assert_same(got[0], ref, f"factory seed {s}")
        if s == 3:  # seed=None said outright: the same (the envs are left as their factories made them)
            unseeded, answer = shmbuf_frames(n, create_env_fn=[partial(seeded_cartpole, s)], seed=None)
            assert_same(unseeded[0], ref, "seed=None")
            assert answer is None
        firsts.append(got[0]["observation"][0].tolist())
    assert len({tuple(f) for f in firsts}) == 3, firsts  # three seeds, three runs


@pytest.mark.parametrize("static_seed", [False, True])
def test_seed_is_torchrls_set_seed_chain_over_the_workers(static_seed: bool) -> None:
    """``seed=7``: worker i's env gets the seed TorchRL's multi-process collector's ``set_seed(7)`` gives its worker
    i (each the previous env's ``set_seed`` return), so every worker's frames equal TorchRL's; ``set_seed(7)`` on the
    collector answers what TorchRL's returns."""
    from torchrl.collectors import MultiSyncCollector

    n = 32
    ref_c = MultiSyncCollector([make_cartpole] * 2, policy(), frames_per_batch=2 * n, total_frames=2 * n,
                               cat_results="stack")
    try:
        ref_seed = ref_c.set_seed(7, static_seed=static_seed)
        ref = next(iter(ref_c))  # (workers, frames)
    finally:
        ref_c.shutdown()
    kw = {"static_seed": True} if static_seed else {}
    got, answer = shmbuf_frames(n, create_env_fn=[make_cartpole] * 2, seed=7, **kw)
    for i in range(2):
        assert_same(got[i], {k: ref[i].get(k) for k in KEYS}, f"worker {i}")
    assert answer == ref_seed
    same = torch.equal(got[0]["observation"], got[1]["observation"])
    assert same == static_seed  # the chain gives each worker its own seed; static_seed gives them one


def test_set_seed_after_start_is_refused_naming_the_constructor_argument() -> None:
    c = AsyncBatchedCollector(create_env_fn=[make_cartpole], policy=policy(), frames_per_batch=16, timeout=60)
    try:
        with pytest.raises(shmbuf.UsageError, match=r"set_seed\(5\): the actors started at construction.*seed=None.*"
                                                    r"AsyncBatchedCollector\(\.\.\., seed=5\)"):
            c.set_seed(5)
    finally:
        c.shutdown()
    with pytest.raises(shmbuf.UsageError, match=r"static_seed=True: TorchRL's seed rule"):
        AsyncBatchedCollector([lambda: __import__("gymnasium").make("CartPole-v1")],
                              policy=lambda obs: (obs[:, 2] > 0).astype("int64"), frames_per_batch=16,
                              env_backend="threading", static_seed=True, timeout=60)


class OddSeeds(GymEnv):
    """A TorchRL env whose set_seed returns another next seed than EnvBase's."""

    def set_seed(self, seed: int | None = None, static_seed: bool = False) -> int | None:
        super().set_seed(seed, static_seed)
        return 12345


def test_an_env_whose_set_seed_breaks_the_chain_is_named() -> None:
    with pytest.raises(shmbuf.UsageError, match=r"OddSeeds.set_seed\(7\) returned 12345.*Seed each env in its factory"):
        AsyncBatchedCollector(create_env_fn=[lambda: OddSeeds("CartPole-v1")], policy=policy(), frames_per_batch=16,
                              seed=7, timeout=60)


class Attached:
    """A reader as lane_indices reads it: its writers' labels by lane, in the order they attached."""

    def __init__(self, labels: dict[int, str]):
        self.labels = labels

    def stats(self) -> dict[str, Any]:
        return {"writer_stats": {lane: {"label": label, "pid": 1} for lane, label in self.labels.items()}}


def test_env_index_is_the_env_workers_not_the_order_their_writers_attached() -> None:
    """Worker 1's writer may attach first (it took lane 0 under load, and the chain test above saw worker 1's
    frames as worker 0's): env_index follows the worker named in each writer's label, as TorchRL numbers its envs."""
    from workers.compat._torchrl import lane_indices, writer_index

    assert writer_index("shmbuf-env-3") == (3, 0) and writer_index("actor-1/2") == (1, 2)
    assert writer_index("someone else") is None
    assert lane_indices(Attached({0: "shmbuf-env-1", 1: "shmbuf-env-0"}), {}) == {0: 1, 1: 0}
    per_env = Attached({0: "a-1/0", 1: "a-0/1", 2: "a-1/1", 3: "a-0/0", 4: "not ours"})
    assert lane_indices(per_env, {}) == {0: 2, 1: 1, 2: 3, 3: 0}  # one writer a sub-env: worker x 2 + sub-env
