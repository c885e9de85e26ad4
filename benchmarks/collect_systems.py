"""The systems of the collection benchmark (``benchmarks/collect.py``), each behind one small interface.

A :class:`Run` is made with ``(env, policy, variant, frames_per_batch)``, 16 envs in all; ``batches()`` yields, at
each delivery, how many real transitions it delivered (each row stored is one env step taken on the observation
stored with it); ``close()`` ends it. The one-process loops (the floors, gymnasium's ``AsyncVectorEnv``, PufferLib)
run in the benchmark's own process and store every transition (obs, action, reward, terminated, truncated) into
preallocated numpy arrays of ``rollout_len`` rows, then yield; the collectors yield at each batch.

``VARIANTS`` names each system's configurations; the sweep tries all of them and shows the fastest.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from benchmarks import collect_envs as ce

NUM_ENVS = 16


class Run:
    """One system under test."""

    VARIANTS: ClassVar[dict[str, str]] = {}
    LABEL = ""
    IMPORTS: tuple[str, ...] = ()  # modules it needs: a system whose modules are missing is not measured, and says so

    def __init__(self, env: str, policy: str, variant: str, frames_per_batch: int):
        self.env, self.policy, self.variant, self.fpb = env, policy, variant, frames_per_batch
        self.c: Any = None

    def batches(self) -> Iterator[int]:
        raise NotImplementedError

    def close(self) -> None:
        if self.c is not None:
            self.c.close()


class Store:
    """Preallocated ``(T, n, ...)`` arrays for one rollout of transitions: obs, action, reward, terminated, truncated."""

    def __init__(self, rows: int, n: int, obs: np.ndarray):
        self.obs = np.zeros((rows, n, *obs.shape[1:]), obs.dtype)
        self.action = np.zeros((rows, n), np.int64)
        self.reward = np.zeros((rows, n), np.float32)
        self.terminated = np.zeros((rows, n), bool)
        self.truncated = np.zeros((rows, n), bool)


def vector_loop(env: Any, policy: Any, rows: int, *, next_step: bool = False) -> Iterator[int]:
    """The plainest one-process loop over a gymnasium vector env, each transition stored.

    SAME_STEP autoreset: every row is a transition. NEXT_STEP (``next_step=True``): the step after an episode's end
    only resets that sub-env (the action is ignored, reward 0); its row is stored, as the env returns it, but not
    counted: only real transitions are.
    """
    obs, _ = env.reset(seed=ce.SEED)
    n = env.num_envs
    store = Store(rows, n, obs)
    s_obs, s_act, s_rew, s_term, s_trunc = store.obs, store.action, store.reward, store.terminated, store.truncated
    was_done = np.zeros(n, bool)  # NEXT_STEP: which sub-envs ended their episode at the previous rollout's last row
    while True:
        for t in range(rows):
            s_obs[t] = obs
            action = policy(obs)
            obs, reward, terminated, truncated, _ = env.step(action)
            s_act[t], s_rew[t], s_term[t], s_trunc[t] = action, reward, terminated, truncated
        if next_step:  # a row whose previous row ended its sub-env's episode was an autoreset: no transition
            done = s_term | s_trunc
            resets = int(np.count_nonzero(done[:-1])) + int(np.count_nonzero(was_done))
            was_done = done[-1].copy()
            yield rows * n - resets
        else:
            yield rows * n


class FloorVec(Run):
    """One process: ``SyncVectorEnv(16)``, the policy, each transition stored."""

    LABEL = "one process, SyncVectorEnv(16)"
    VARIANTS: ClassVar[dict[str, str]] = {
        "vec16": "gymnasium SyncVectorEnv(16, copy=False, SAME_STEP)",
        "vec16-next": "gymnasium SyncVectorEnv(16, copy=False), its default NEXT_STEP autoreset (reset rows not counted)"}

    def batches(self) -> Iterator[int]:
        next_step = self.variant.endswith("-next")
        self.c = ce.make_vec(self.env, NUM_ENVS, "NextStep" if next_step else "SameStep")
        return vector_loop(self.c, ce.numpy_caller(ce.make_policy(self.env, self.policy)), self.fpb // NUM_ENVS,
                           next_step=next_step)


class FloorHand(Run):
    """One process stepping 16 plain envs in a Python loop, each next observation written into the store's next row."""

    LABEL = "one process, 16 envs by hand"
    VARIANTS: ClassVar[dict[str, str]] = {"hand16": "16 gymnasium envs stepped in a Python loop, reset where done"}

    def batches(self) -> Iterator[int]:
        envs = self.c = [ce.make_env(self.env) for _ in range(NUM_ENVS)]
        policy = ce.numpy_caller(ce.make_policy(self.env, self.policy))
        rows = self.fpb // NUM_ENVS
        first = np.stack([e.reset(seed=ce.SEED + i)[0] for i, e in enumerate(envs)])
        store = Store(rows + 1, NUM_ENVS, first)  # row T is the next rollout's first observation
        s_obs, s_act, s_rew, s_term, s_trunc = store.obs, store.action, store.reward, store.terminated, store.truncated
        s_obs[0] = first
        rewards, terms, truncs = [0.0] * NUM_ENVS, [False] * NUM_ENVS, [False] * NUM_ENVS
        while True:
            for t in range(rows):
                action = policy(s_obs[t])
                s_act[t] = action
                nxt = s_obs[t + 1]
                for i, (env, a) in enumerate(zip(envs, action.tolist())):
                    o, rewards[i], te, tr, _ = env.step(a)
                    if te or tr:
                        o, _ = env.reset()
                    nxt[i] = o
                    terms[i], truncs[i] = te, tr
                s_rew[t], s_term[t], s_trunc[t] = rewards, terms, truncs
            s_obs[0] = s_obs[rows]
            yield rows * NUM_ENVS

    def close(self) -> None:
        for env in self.c or ():
            env.close()


class GymAsync(Run):
    """gymnasium ``AsyncVectorEnv(16, shared_memory=True)``: 16 env processes, the policy and the store here."""

    LABEL = "gymnasium AsyncVectorEnv(16)"
    VARIANTS: ClassVar[dict[str, str]] = {
        "forkserver": "AsyncVectorEnv(16, shared_memory=True, copy=False, SAME_STEP), context='forkserver'",
        "fork": "the same, context='fork'"}

    def batches(self) -> Iterator[int]:
        import gymnasium

        self.c = gymnasium.vector.AsyncVectorEnv([functools.partial(ce.make_env, self.env)] * NUM_ENVS, shared_memory=True,
                                                 copy=False, context=self.variant,
                                                 autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP)
        return vector_loop(self.c, ce.numpy_caller(ce.make_policy(self.env, self.policy)), self.fpb // NUM_ENVS)


class Puffer(Run):
    """PufferLib 3's ``vector.Serial`` and ``vector.Multiprocessing`` over its gymnasium emulation; policy and store here.

    PufferLib resets an env that ended at the next ``send`` instead of stepping it: that row (the reset observation,
    reward 0) is no transition, so it is stored, as PufferLib's own trainer does, but not counted.
    """

    LABEL = "PufferLib"
    IMPORTS = ("pufferlib", "psutil")
    VARIANTS: ClassVar[dict[str, str]] = {
        "serial": "vector.Serial(16)",
        "mp1": "vector.Multiprocessing, 1 worker x 16 envs, batch_size 16",
        "mp2": "vector.Multiprocessing, 2 workers x 8 envs, batch_size 16",
        "mp2-b8": "vector.Multiprocessing, 2 workers x 8 envs, batch_size 8 (one worker steps while the other's batch is served)",
        "mp2-b8-copy": "the same with zero_copy=False",
    }
    SETTINGS: ClassVar[dict[str, dict[str, Any]]] = {
        "serial": {}, "mp1": {"num_workers": 1, "batch_size": 16}, "mp2": {"num_workers": 2, "batch_size": 16},
        "mp2-b8": {"num_workers": 2, "batch_size": 8}, "mp2-b8-copy": {"num_workers": 2, "batch_size": 8, "zero_copy": False},
    }

    def batches(self) -> Iterator[int]:
        import psutil
        import pufferlib.vector as pv

        kw = dict(self.SETTINGS[self.variant])
        backend = pv.Serial if self.variant == "serial" else pv.Multiprocessing
        if kw.get("num_workers", 0) > (psutil.cpu_count(logical=False) or 1):
            kw["overwork"] = True  # PufferLib refuses more workers than physical cores unless told
        vec = self.c = pv.make(functools.partial(ce.make_puffer_env, self.env), backend=backend, num_envs=NUM_ENVS,
                               seed=ce.SEED, **kw)
        policy = ce.numpy_caller(ce.make_policy(self.env, self.policy))
        batch = kw.get("batch_size", NUM_ENVS)
        rows = self.fpb // batch
        vec.async_reset(ce.SEED)
        o, *_ = vec.recv()
        store = Store(rows, batch, np.asarray(o))
        s_obs, s_act, s_rew, s_term, s_trunc = store.obs, store.action, store.reward, store.terminated, store.truncated
        was_done = np.ones(NUM_ENVS, bool)  # the first rows are resets
        vec.send(policy(o))
        while True:
            frames = 0
            for t in range(rows):
                o, r, d, tr, _ta, _infos, ids, _mask = vec.recv()
                s_obs[t] = o
                action = policy(o)
                vec.send(action)
                s_act[t], s_rew[t], s_term[t], s_trunc[t] = action, r, d, tr
                frames += len(ids) - int(np.count_nonzero(was_done[ids]))
                was_done[ids] = d | tr
            yield frames


class TorchRLMultiSync(Run):
    """TorchRL's ``MultiSyncCollector``: a policy copy in each worker process, one thread each."""

    LABEL = "TorchRL MultiSyncCollector"
    IMPORTS = ("torchrl", "tensordict")
    VARIANTS: ClassVar[dict[str, str]] = {"2xserial": "2 workers x SerialEnv(8)", "16x1": "16 workers x 1 env"}

    def batches(self) -> Iterator[int]:
        from benchmarks.inference import _torchrl_collectors

        if self.variant == "2xserial":
            envs = [functools.partial(ce.make_torchrl_serial, self.env, NUM_ENVS // 2)] * 2
        else:
            envs = [functools.partial(ce.make_torchrl_env, self.env)] * NUM_ENVS
        self.c = _torchrl_collectors().MultiSyncCollector(
            envs, policy=ce.make_td_policy(self.env, self.policy), frames_per_batch=self.fpb, total_frames=-1,
            num_threads=1, num_sub_threads=1, cat_results="stack")
        for td in self.c:
            yield int(td.numel())

    def close(self) -> None:
        if self.c is not None:
            self.c.shutdown()


def _vec_factories(env: str, workers: int, autoreset: str = "SameStep") -> list[Any]:
    if workers == NUM_ENVS:
        return [functools.partial(ce.make_env, env)] * NUM_ENVS
    return [functools.partial(ce.make_vec, env, NUM_ENVS // workers, autoreset)] * workers


def check_envs(collector: Any) -> None:
    """Raise unless a shmbuf collector steps :data:`NUM_ENVS` envs in all (its plan: actors x sub-envs)."""
    plan = collector.plan
    if plan.num_actors * plan.num_envs != NUM_ENVS:
        raise RuntimeError(f"expected {NUM_ENVS} envs in all, got {plan.num_actors} actors x {plan.num_envs} envs")


class ShmbufCollector(Run):
    """``workers.Collector``: a policy copy in each actor process (one torch thread each)."""

    LABEL = "shmbuf Collector"
    IMPORTS = ("workers",)
    VARIANTS: ClassVar[dict[str, str]] = {
        "2x8": "2 actors x SyncVectorEnv(8, copy=False, SAME_STEP)", "1x16": "1 actor x SyncVectorEnv(16, copy=False, SAME_STEP)",
        "2x8-next": "2 actors x SyncVectorEnv(8, copy=False), gymnasium's default NEXT_STEP autoreset"}

    def batches(self) -> Iterator[int]:
        from workers import Collector

        workers = 1 if self.variant == "1x16" else 2
        envs = _vec_factories(self.env, workers, "NextStep" if self.variant.endswith("-next") else "SameStep")
        # num_actors given: a single factory would otherwise get the default of 2 actors (32 envs)
        self.c = Collector(envs, ce.make_policy(self.env, self.policy), frames_per_batch=self.fpb, torch_threads=1,
                           num_actors=workers)
        check_envs(self.c)
        for b in self.c:
            yield int(b.frames)


class ShmbufAsync(Run):
    """``workers.AsyncBatchedCollector``: the policy in a server thread of this process, env workers in processes."""

    LABEL = "shmbuf AsyncBatchedCollector"
    IMPORTS = ("workers",)
    VARIANTS: ClassVar[dict[str, str]] = {
        "2xvec8": "2 env processes x SyncVectorEnv(8, copy=False, SAME_STEP)",
        "2xvec8-t2": "2 env processes x SyncVectorEnv(8, copy=False, SAME_STEP), server_threads=2 (the forward pass on "
                     "both cores while the env workers wait for it)",
        "4xvec4": "4 env processes x SyncVectorEnv(4, copy=False, SAME_STEP)",
        "16x1": "16 env processes x 1 env"}

    def batches(self) -> Iterator[int]:
        from workers import AsyncBatchedCollector

        workers = {"2xvec8": 2, "2xvec8-t2": 2, "4xvec4": 4, "16x1": 16}[self.variant]
        self.c = AsyncBatchedCollector(_vec_factories(self.env, workers), policy=ce.make_policy(self.env, self.policy),
                                       frames_per_batch=self.fpb, server_threads=2 if self.variant.endswith("-t2") else 1)
        check_envs(self.c)
        for b in self.c:
            yield int(b.frames)


# name -> class; the order is the order of the tables, the plot and each pass of the sweep
SYSTEMS: dict[str, type[Run]] = {
    "floor_vec": FloorVec, "floor_hand": FloorHand, "gym_async": GymAsync, "puffer": Puffer,
    "torchrl_multisync": TorchRLMultiSync, "collector": ShmbufCollector, "async_batched": ShmbufAsync,
}
FLOORS = ("floor_vec", "floor_hand")
