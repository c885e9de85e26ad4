"""The Atari part of the training benchmark (``benchmarks/train.py``): real ALE games, every way to collect from them.

Envs (:data:`GAMES` x :data:`ENV_COUNTS`, named ``pong-8``, ``breakout-16``, ...): ale-py 0.12.1's ``ALE/Pong-v5`` and
``ALE/Breakout-v5`` (their ROMs ship inside ale-py) with the standard preprocessing, the same work in every system:

- gymnasium's side: ``gymnasium.make("ALE/<Game>-v5", frameskip=1, repeat_action_probability=0.25)`` (v5's sticky
  actions, its default, written out), ``AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84,
  terminal_on_life_loss=False, grayscale_obs=True)`` (max over the last two frames, INTER_AREA resize), then
  ``FrameStackObservation(4)``: ``(4, 84, 84)`` uint8 observations, v5's minimal action set, rewards unclipped.
- EnvPool's: ``envpool.make("<Game>-v5", env_type="gymnasium", stack_num=4, img_height=84, img_width=84,
  noop_max=30, frame_skip=4, repeat_action_probability=0.25, episodic_life=False, reward_clip=False,
  use_fire_reset=False)``: the same emulator steps (EnvPool presses FIRE after a reset by default; gymnasium's
  preprocessing does not, so it is off), the same max-pool, grayscale and INTER_AREA resize, the same episode
  limit (108,000 frames).
- ale-py's own C++ vector env (``ale_py.vector_env.AtariVectorEnv``, what ``gymnasium.make_vec("ALE/Pong-v5")``
  gives) with the same settings (``reward_clipping=False``, ``use_fire_reset=False``, sticky actions 0.25).

Policies: ``random`` (numpy, uniform over the game's actions: the env's own cost) and ``cnn`` (the Nature DQN
network, 3 conv layers and a 512-unit layer, on the stacked frames / 255, argmax; torch on one thread in every
process and thread that calls it).

Systems, each a :class:`benchmarks.collect_systems.Run` (``batches()`` yields the real transitions delivered; each
one-process loop stores every transition into preallocated arrays, as a learner's buffer would):

- ``floor``: one process, gymnasium ``SyncVectorEnv(n, copy=False, SAME_STEP)``, the policy here: the floor.
- ``gym_async``: gymnasium ``AsyncVectorEnv(n, shared_memory=True, copy=False, SAME_STEP)``, forkserver.
- ``puffer``: PufferLib 3 (``pufferlib-core``), over the gymnasium env: ``vector.Serial``, and
  ``vector.Multiprocessing`` with 2 workers (batch of all n, and of n/2: one worker steps while the other's half
  is served).
- ``collector``: ``workers.Collector``, 2 actors x ``SyncVectorEnv(n/2)``, a policy copy in each actor.
- ``async_batched``: ``workers.AsyncBatchedCollector``, 2 env processes x ``SyncVectorEnv(n/2)``, the policy in the
  learner's inference server.
- ``envpool_sync``, ``envpool_async``: EnvPool 1.2.5, 2 threads, ``batch_size=n`` (sync: ``step``) and ``n/2``
  (async: ``send``/``recv``, the policy acting on whichever half is ready).
- ``ale_vec``: ale-py's ``AtariVectorEnv(n, num_threads=2, SAME_STEP)``, ``step``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from benchmarks.collect_envs import one_torch_thread
from benchmarks.collect_systems import Run, Store, vector_loop

GAMES = {"pong": "Pong", "breakout": "Breakout"}
ENV_COUNTS = (8, 16)
ENVS = {f"{g}-{n}": f"ALE/{name}-v5, {n} envs" for g, name in GAMES.items() for n in ENV_COUNTS}
POLICIES = {"random": "numpy, uniform over the game's actions", "cnn": "torch Nature CNN (3 conv + 512), argmax, 1 thread"}
ACTIONS = {"pong": 6, "breakout": 4}  # v5's minimal action sets
STICKY = 0.25  # ALE v5's repeat_action_probability, on every side
SEED = 0
SETTINGS = {"noop_max": 30, "frame_skip": 4, "screen": 84, "stack": 4, "sticky_actions": STICKY,
            "terminal_on_life_loss": False, "reward_clip": False, "fire_reset": False, "max_frames_per_episode": 108_000}


def parse_env(env: str) -> tuple[str, int]:
    """``"pong-8"`` -> ``("pong", 8)``."""
    game, _, n = env.partition("-")
    if game not in GAMES or not n.isdigit():
        raise ValueError(f"env: expected one of {list(ENVS)}, got {env!r}")
    return game, int(n)


def quiet_ale() -> None:
    """ale-py's errors only: no banner from every emulator that starts (a process-wide setting of ale-py's)."""
    import ale_py

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)


def make_atari(game: str, stack: bool = True) -> Any:
    """One gymnasium Atari env with the standard preprocessing and a 4-frame stack (see the module doc); without
    ``stack``, single ``(84, 84)`` frames (the stack is then built by trajectory views: the ``views`` variants)."""
    import ale_py
    import gymnasium
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    quiet_ale()
    gymnasium.register_envs(ale_py)
    env = gymnasium.make(f"ALE/{GAMES[game]}-v5", frameskip=1, repeat_action_probability=STICKY)
    env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False,
                             grayscale_obs=True, scale_obs=False)
    return FrameStackObservation(env, 4) if stack else env


def make_vec(game: str, n: int, stack: bool = True) -> Any:
    """gymnasium ``SyncVectorEnv`` of ``n`` :func:`make_atari` envs, ``copy=False``, ``SAME_STEP`` autoreset."""
    import gymnasium

    return gymnasium.vector.SyncVectorEnv([functools.partial(make_atari, game, stack)] * n, copy=False,
                                          autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP)


def make_envpool(game: str, n: int, batch_size: int) -> Any:
    import envpool

    return envpool.make(f"{GAMES[game]}-v5", env_type="gymnasium", num_envs=n, batch_size=batch_size, num_threads=2,
                        seed=SEED, episodic_life=False, reward_clip=False, use_fire_reset=False, stack_num=4,
                        img_height=84, img_width=84, noop_max=30, frame_skip=4, repeat_action_probability=STICKY,
                        max_episode_steps=108_000 // 4)


def make_puffer_env(game: str, buf: Any = None, seed: int = 0) -> Any:
    """One env in PufferLib's gymnasium emulation (PufferLib calls this with its shared buffers and a seed)."""
    from pufferlib.emulation import GymnasiumPufferEnv

    return GymnasiumPufferEnv(env_creator=make_atari, env_args=[game], buf=buf, seed=seed)


# ------------------------------------------------------------------ policies


class RandomPolicy:
    """Uniform random actions (int64), from its own seeded generator. Picklable."""

    def __init__(self, n_actions: int):
        self.n = n_actions
        self.rng = np.random.default_rng(SEED)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.rng.integers(0, self.n, len(obs))


class NatureCNN(nn.Module):
    """The Nature DQN network on ``(N, 4, 84, 84)`` uint8 frames (scaled by 1/255 inside), argmax: int64 actions."""

    def __init__(self, n_actions: int):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(SEED)
            self.net = nn.Sequential(nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                                     nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
                                     nn.Linear(512, n_actions))

    def forward(self, obs: Any) -> Any:
        one_torch_thread()
        return self.net(obs.float() / 255.0).argmax(-1)


def on_views(inner: Any) -> Any:
    """A policy of :func:`make_policy` called with trajectory views' input, ``{"obs": (N, 4, 84, 84)}``: it acts on
    the stack, as it acts on a wrapper's stacked observation. Picklable (it travels to the actors); a torch module
    when the policy is one."""
    return _TorchOnViews(inner) if isinstance(inner, nn.Module) else _OnViews(inner)


class _OnViews:
    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, x: dict[str, Any]) -> Any:
        return self.inner(x["obs"])


class _TorchOnViews(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: dict[str, Any]) -> Any:
        return self.inner(x["obs"])


def make_policy(game: str, policy: str) -> Any:
    """``random`` or ``cnn`` for ``game``."""
    if policy == "random":
        return RandomPolicy(ACTIONS[game])
    if policy == "cnn":
        one_torch_thread()
        return NatureCNN(ACTIONS[game]).eval()
    raise ValueError(f"policy: expected one of {list(POLICIES)}, got {policy!r}")


def numpy_caller(policy: Any) -> Any:
    """``obs (numpy) -> actions (numpy)`` for a policy of :func:`make_policy`: what the one-process loops call."""
    if isinstance(policy, RandomPolicy):
        return policy

    def call(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return policy(torch.from_numpy(np.asarray(obs))).numpy()

    return call


# ------------------------------------------------------------------ systems


class AtariRun(Run):
    """A system on ``env`` = ``"<game>-<n>"``."""

    def __init__(self, env: str, policy: str, variant: str, frames_per_batch: int):
        super().__init__(env, policy, variant, frames_per_batch)
        self.game, self.n = parse_env(env)
        if frames_per_batch % (2 * self.n):
            raise ValueError(f"frames_per_batch: expected a multiple of 2 x {self.n} envs, got {frames_per_batch}")

    def act(self) -> Any:
        return numpy_caller(make_policy(self.game, self.policy))


class Floor(AtariRun):
    LABEL = "one process, SyncVectorEnv"
    IMPORTS = ("ale_py", "cv2")
    VARIANTS: ClassVar[dict[str, str]] = {"vec": "gymnasium SyncVectorEnv(n, copy=False, SAME_STEP), policy and store here"}

    def batches(self) -> Iterator[int]:
        self.c = make_vec(self.game, self.n)
        return vector_loop(self.c, self.act(), self.fpb // self.n)


class GymAsync(AtariRun):
    LABEL = "gymnasium AsyncVectorEnv"
    IMPORTS = ("ale_py", "cv2")
    VARIANTS: ClassVar[dict[str, str]] = {
        "forkserver": "AsyncVectorEnv(n, shared_memory=True, copy=False, SAME_STEP), context='forkserver'"}

    def batches(self) -> Iterator[int]:
        import gymnasium

        self.c = gymnasium.vector.AsyncVectorEnv([functools.partial(make_atari, self.game)] * self.n, shared_memory=True,
                                                 copy=False, context=self.variant,
                                                 autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP)
        return vector_loop(self.c, self.act(), self.fpb // self.n)


def recv_loop(recv: Any, send: Any, policy: Any, n: int, rows: int, first: np.ndarray, acted: Any) -> Iterator[int]:
    """The loop of an asynchronous vector env (PufferLib's, EnvPool's): take a ready batch, store it, act on it.

    These envs reset an env that ended at its next step instead of stepping it (the action is ignored, reward 0):
    that row is stored, as their own trainers do, but not counted. ``recv()`` returns ``(obs, reward, terminated,
    truncated, env ids)``; ``first`` is the first batch's observation and ``acted`` the envs already acted on from
    their reset observation (an env whose reset observation the loop receives gives a row that is no transition).
    """
    store = Store(rows, len(first), first)
    s_obs, s_act, s_rew, s_term, s_trunc = store.obs, store.action, store.reward, store.terminated, store.truncated
    was_done = np.ones(n, bool)
    was_done[acted] = False
    while True:
        frames = 0
        for t in range(rows):
            o, r, d, tr, ids = recv()
            s_obs[t] = o
            action = policy(o)
            send(action, ids)
            s_act[t], s_rew[t], s_term[t], s_trunc[t] = action, r, d, tr
            frames += len(ids) - int(np.count_nonzero(was_done[ids]))
            was_done[ids] = d | tr
        yield frames


class Puffer(AtariRun):
    LABEL = "PufferLib"
    IMPORTS = ("pufferlib", "psutil", "ale_py", "cv2")
    VARIANTS: ClassVar[dict[str, str]] = {
        "serial": "vector.Serial(n)",
        "mp2": "vector.Multiprocessing, 2 workers x n/2 envs, batch_size n",
        "mp2-half": "vector.Multiprocessing, 2 workers x n/2 envs, batch_size n/2 (one worker steps while the other's "
                    "half is served)"}

    def batches(self) -> Iterator[int]:
        import psutil
        import pufferlib.vector as pv

        kw: dict[str, Any] = {}
        if self.variant != "serial":
            kw = {"num_workers": 2, "batch_size": self.n if self.variant == "mp2" else self.n // 2}
            if 2 > (psutil.cpu_count(logical=False) or 1):
                kw["overwork"] = True  # PufferLib refuses more workers than physical cores unless told
        backend = pv.Serial if self.variant == "serial" else pv.Multiprocessing
        vec = self.c = pv.make(functools.partial(make_puffer_env, self.game), backend=backend, num_envs=self.n, seed=SEED, **kw)
        batch = kw.get("batch_size", self.n)
        vec.async_reset(SEED)

        def recv() -> tuple[Any, ...]:
            o, r, d, tr, _ta, _infos, ids, _mask = vec.recv()
            return o, r, d, tr, ids

        first = recv()
        policy = self.act()
        vec.send(policy(first[0]))
        return recv_loop(recv, lambda a, _ids: vec.send(a), policy, self.n, self.fpb // batch, np.asarray(first[0]), first[4])


class EnvpoolSync(AtariRun):
    LABEL = "EnvPool, sync"
    IMPORTS = ("envpool",)
    VARIANTS: ClassVar[dict[str, str]] = {"t2": "envpool.make(num_envs=n, batch_size=n, num_threads=2), step()"}

    def batches(self) -> Iterator[int]:
        env = self.c = make_envpool(self.game, self.n, self.n)
        policy = self.act()
        obs, _ = env.reset()
        ids = np.arange(self.n)
        state = {"obs": obs}

        def recv() -> tuple[Any, ...]:
            return state["obs"], *state["out"], ids

        def send(action: np.ndarray, _ids: Any) -> None:
            o, r, te, tr, _info = env.step(action)
            state["obs"], state["out"] = o, (r, te, tr)

        send(policy(obs), ids)
        return recv_loop(recv, send, policy, self.n, self.fpb // self.n, obs, ids)


class EnvpoolAsync(AtariRun):
    LABEL = "EnvPool, async"
    IMPORTS = ("envpool",)
    VARIANTS: ClassVar[dict[str, str]] = {
        "t2-half": "envpool.make(num_envs=n, batch_size=n/2, num_threads=2), send()/recv(): the policy acts on whichever "
                   "half is ready"}

    def batches(self) -> Iterator[int]:
        env = self.c = make_envpool(self.game, self.n, self.n // 2)
        env.async_reset()

        def recv() -> tuple[Any, ...]:
            o, r, te, tr, info = env.recv()
            return o, r, te, tr, info["env_id"]

        first = recv()
        policy = self.act()
        env.send(policy(first[0]), first[4])
        return recv_loop(recv, env.send, policy, self.n, self.fpb // (self.n // 2), first[0], first[4])


class AleVec(AtariRun):
    LABEL = "ale-py AtariVectorEnv"
    IMPORTS = ("ale_py",)
    VARIANTS: ClassVar[dict[str, str]] = {"t2": "AtariVectorEnv(n, num_threads=2, SAME_STEP), step()"}

    def batches(self) -> Iterator[int]:
        from ale_py.vector_env import AtariVectorEnv

        quiet_ale()
        self.c = AtariVectorEnv(self.game, self.n, num_threads=2, batch_size=self.n, repeat_action_probability=STICKY,
                                reward_clipping=False, use_fire_reset=False, episodic_life=False, noop_max=30, frameskip=4,
                                stack_num=4, img_height=84, img_width=84, autoreset_mode="SameStep")
        return vector_loop(self.c, self.act(), self.fpb // self.n)


def _halves(game: str, n: int) -> list[Any]:
    return [functools.partial(make_vec, game, n // 2)] * 2


class ShmbufCollector(AtariRun):
    LABEL = "shmbuf Collector"
    IMPORTS = ("workers", "ale_py", "cv2")
    VARIANTS: ClassVar[dict[str, str]] = {
        "2xvec": "2 actors x SyncVectorEnv(n/2, copy=False, SAME_STEP), a policy copy in each",
        "2xvec-views": "the same without FrameStackObservation: each frame written once, the policy's 4-frame stack a "
                       "view (ViewRequirement('obs', shift='-3:0'), equal to the wrapper's stack)"}

    def batches(self) -> Iterator[int]:
        from shmbuf.storage.views import ViewRequirement
        from workers import Collector

        views = self.variant.endswith("-views")
        envs = [functools.partial(make_vec, self.game, self.n // 2, not views)] * 2
        policy = make_policy(self.game, self.policy)
        kw = {"view_requirements": {"obs": ViewRequirement("obs", shift="-3:0")}} if views else {}
        self.c = Collector(envs, on_views(policy) if views else policy, frames_per_batch=self.fpb, torch_threads=1,
                           num_actors=2, **kw)
        for b in self.c:
            yield int(b.frames)


class ShmbufAsync(AtariRun):
    LABEL = "shmbuf AsyncBatchedCollector"
    IMPORTS = ("workers", "ale_py", "cv2")
    VARIANTS: ClassVar[dict[str, str]] = {
        "2xvec": "2 env processes x SyncVectorEnv(n/2, copy=False, SAME_STEP), the policy in the learner's server thread"}

    def batches(self) -> Iterator[int]:
        from workers import AsyncBatchedCollector

        self.c = AsyncBatchedCollector(_halves(self.game, self.n), policy=make_policy(self.game, self.policy),
                                       frames_per_batch=self.fpb)
        for b in self.c:
            yield int(b.frames)


# name -> class; the order is the order of the tables, the plot and each pass of the sweep
SYSTEMS: dict[str, type[Run]] = {
    "floor": Floor, "gym_async": GymAsync, "puffer": Puffer, "collector": ShmbufCollector, "async_batched": ShmbufAsync,
    "envpool_sync": EnvpoolSync, "envpool_async": EnvpoolAsync, "ale_vec": AleVec,
}
FLOOR = "floor"
# Seconds a run takes besides its windows (start-up, first delivery, shutdown), for the estimate printed at the start.
OVERHEAD_S = {"floor": 1.5, "gym_async": 4.0, "puffer": 3.0, "collector": 4.0, "async_batched": 4.0, "envpool_sync": 1.5,
              "envpool_async": 1.5, "ale_vec": 1.0}
