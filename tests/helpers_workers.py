"""The worker tests' deterministic envs, policies and collection helpers (they need gymnasium).

Shared by tests/test_workers_*.py and the tests that compare workers with other systems, and importable by actor
processes under any start method (spawn and forkserver children import this module to unpickle a target or env
factory). tests/helpers.py holds what needs no extra: the core's job (`make test-core`) imports it without gymnasium.

CountingEnv(env_id): episode k (k = 0, 1, ... counted by resets) lasts
``LENGTHS[(k + env_id) % len(LENGTHS)]`` steps. Step t of episode k:

- observation before it: ``[env_id, k, t]``; after it: ``[env_id, k, t + 1]``
- the action must be ``1000 k + t`` (the env raises otherwise, so a
  misaligned observation/action pair cannot go unnoticed)
- reward ``100 k + t + 1``
- the last step ends the episode: terminated if k % 3 == 0, truncated if
  k % 3 == 1, both if k % 3 == 2.
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import optree

import shmbuf
from shmbuf import WeightSubscriber
from shmbuf.layout import rollout_example, successors
from workers import ActorLoop, probe

LENGTHS = (3, 5, 2, 7, 1, 4, 6)


class CountingEnv(gym.Env):
    metadata: dict = {"render_modes": []}

    def __init__(self, env_id: int = 0, lengths: tuple[int, ...] = LENGTHS, step_sleep: float = 0.0):
        self.env_id = env_id
        self.lengths = lengths
        self.step_sleep = step_sleep
        self.observation_space = gym.spaces.Box(0, 1e9, (3,), np.float64)
        self.action_space = gym.spaces.Discrete(2**31 - 1)
        self.k = -1
        self.t = 0
        self.length = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.env_id, self.k, self.t], np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.k += 1
        self.t = 0
        self.length = self.lengths[(self.k + self.env_id) % len(self.lengths)]
        return self._obs(), {}

    def step(self, action):
        want = 1000 * self.k + self.t
        if int(action) != want:
            raise AssertionError(f"env {self.env_id}: got action {int(action)} at episode {self.k} step {self.t}, "
                                 f"expected {want}")
        if self.t >= self.length:
            raise AssertionError(f"env {self.env_id}: step() after the end of episode {self.k} (a fake transition)")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        r = float(100 * self.k + self.t + 1)
        self.t += 1
        end = self.t == self.length
        kind = self.k % 3
        return self._obs(), r, end and kind in (0, 2), end and kind in (1, 2), {}


def expected_stream(env_id: int, n_steps: int, cap: int | None = None):
    """The first ``n_steps`` transitions of CountingEnv(env_id) as dicts; ``cap``: episodes cut at that many steps."""
    out = []
    k = 0
    while len(out) < n_steps:
        length = LENGTHS[(k + env_id) % len(LENGTHS)]
        cut = cap is not None and length > cap
        n = cap if cut else length
        ret = 0.0
        for t in range(n):
            r = float(100 * k + t + 1)
            ret += r
            last = t == n - 1
            kind = k % 3
            term = last and not cut and kind in (0, 2)
            trunc = last and (cut or kind in (1, 2))
            out.append({"obs": [env_id, k, t], "action": 1000 * k + t, "reward": r, "terminated": term,
                        "truncated": trunc, "succ": [env_id, k, t + 1], "ep": k, "ret": ret if last else None,
                        "len": n if last else None})
        k += 1
    return out[:n_steps]


class EchoPolicy:
    """Acts 1000 k + t from the observation; returns an extra leaf (2 t, float32). Records weight loads."""

    def __init__(self):
        self.loaded: list[float] = []

    def __call__(self, obs):
        obs = np.asarray(obs)
        action = (obs[:, 1] * 1000 + obs[:, 2]).astype(np.int64)
        return action, {"twice_t": (2 * obs[:, 2]).astype(np.float32)}

    def load_weights(self, params):
        self.loaded.append(float(params["w"][0]))


def make_counting(env_id: int = 0, step_sleep: float = 0.0) -> CountingEnv:
    return CountingEnv(env_id, step_sleep=step_sleep)


def make_counting_unless(hang: str, env_id: int = 0) -> CountingEnv:
    """make_counting, but once the file ``hang`` exists the factory never returns: an actor started then hangs before
    ``ctx.ready()`` (as a child stuck at its start would), saying so on stderr first."""
    if os.path.exists(hang):
        import sys

        print(f"make_counting_unless: {hang} exists, hanging", file=sys.stderr, flush=True)
        while True:  # until killed: a stop request is never looked at
            time.sleep(0.05)
    return CountingEnv(env_id)


class ReusingCountingEnv(CountingEnv):
    """CountingEnv that hands back one and the same observation array every time, overwritten in place."""

    def _obs(self) -> np.ndarray:
        buf = self.__dict__.setdefault("_buf", np.zeros(3, np.float64))
        buf[:] = (self.env_id, self.k, self.t)
        return buf


def make_vector(n: int = 3, mode: str = "NextStep", step_sleep: float = 0.0, copy: bool = True):
    """SyncVectorEnv of CountingEnvs; ``copy=False``: it returns its own observation buffer, overwritten every step."""
    return gym.vector.SyncVectorEnv([partial(CountingEnv, i, step_sleep=step_sleep) for i in range(n)], copy=copy,
                                    autoreset_mode=gym.vector.AutoresetMode(mode))


def make_async_vector(n: int = 2, mode: str = "NextStep", copy: bool = True):
    return gym.vector.AsyncVectorEnv([partial(CountingEnv, i) for i in range(n)], context="spawn", copy=copy,
                                     autoreset_mode=gym.vector.AutoresetMode(mode))


# -- pool targets (module level, so that spawn and forkserver can import them) --


def target_ok(ctx, n_steps: int = 0):
    while not ctx.stop_requested:
        time.sleep(0.01)


def target_crash(ctx, message: str = "boom"):
    if ctx.index == 1:
        raise ValueError(f"{message} in actor {ctx.index}")
    while not ctx.stop_requested:
        time.sleep(0.01)


def target_crash_first_time(ctx):
    if ctx.incarnation == 0 and ctx.index == 0:
        raise KeyError("first life fails")
    while not ctx.stop_requested:
        time.sleep(0.01)


def target_hang(ctx, ignore_term: bool = False):
    import signal

    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx.ready()
    while True:  # deaf to stop requests: a hung env
        time.sleep(0.05)


def target_segfault(ctx):
    os.kill(os.getpid(), 9)


# -- running an ActorLoop in a thread (the reader in this one), and the truth to check against --


def collect(make_env, *, T, n_rollouts, batch_mode="truncate_episodes", max_episodes=None, weights=None, policy=None,
            probe_policy=None, general=False, **loop_kw):
    """Run an ActorLoop in a thread until it committed ``n_rollouts``; return them (copied) in commit order.

    ``probe_policy`` answers the probe call (default: ``policy``), so a policy that records its inputs sees only
    the loop's; ``loop_kw`` goes to ActorLoop (view_requirements, horizon, ...).
    """
    policy = policy or EchoPolicy()
    probe_env = make_env()
    try:
        p = probe(probe_env, probe_policy or policy, view_requirements=loop_kw.get("view_requirements"))
    finally:
        probe_env.close()
    env = make_env()
    vector = p["vector"] and batch_mode == "truncate_episodes"
    example = rollout_example(p["obs"], p["action"], rollout_len=T, num_envs=p["num_envs"] if vector else None,
                              extras=p["extras"], batch_mode=batch_mode, max_episodes=max_episodes)
    n_writers = p["num_envs"] if batch_mode == "complete_episodes" else 1
    reader = shmbuf.create(example, slots=4 * n_writers + 2, max_writers=n_writers)
    errors: list[BaseException] = []
    out = []
    loop_box = []

    def actor():
        writers = []
        try:
            writers = [shmbuf.Writer(reader.handle, timeout=20) for _ in range(n_writers)]
            registered.set()
            sub = WeightSubscriber(weights) if weights is not None else None
            loop = ActorLoop(env, policy, writers, rollout_len=T, batch_mode=batch_mode, max_episodes=max_episodes,
                             weights=sub, **loop_kw)
            loop_box.append(loop)
            if general:
                loop._direct = False  # the general path (Writer.add per step), as pytree observations take it
            loop.run(n_rollouts)
            if sub is not None:
                sub.close()
        except BaseException as exc:  # noqa: BLE001  # anything the loop raises is surfaced by the main thread
            errors.append(exc)
        finally:
            for w in writers:
                w.close()

    registered = threading.Event()
    th = threading.Thread(target=actor, daemon=True)
    th.start()
    try:
        # The reader's first scan must meet every lane: it lends all its free slots to the lanes it knows.
        assert registered.wait(20) or errors, "the actor's writers did not attach"
        deadline = time.monotonic() + 60
        while len(out) < n_rollouts:
            if errors:
                raise errors[0]
            assert time.monotonic() < deadline, f"{len(out)} of {n_rollouts} rollouts in 60 s"
            try:
                r = reader.get(timeout=0.5)
            except shmbuf.SlotTimeout:
                assert th.is_alive() or errors, "the actor stopped early"
                continue
            with r:
                out.append({"lane": r.lane, "seq": r.seq, "fill": dict(r.fill), "data": r.copy(),
                            "version": r.policy_version})
        th.join(20)
        assert not th.is_alive()
        if errors:
            raise errors[0]
    finally:
        reader.close()
        env.close()
    return out, loop_box[0]


def check_truncated(rollouts, env_ids, T, cap_episodes=False):
    """Concatenate rollouts per sub-env column and compare with the ground truth, field by field."""
    vector = len(env_ids) > 1 or rollouts[0]["data"]["step"]["obs"].ndim == 3
    total = sum(r["fill"]["step"] for r in rollouts)
    for col, env_id in enumerate(env_ids):
        truth = expected_stream(env_id, total)
        pos = 0
        for r in rollouts:
            d, n = r["data"], r["fill"]["step"]
            if not cap_episodes:
                assert n == T
            step = d["step"]
            pick = (lambda a, c=col: a[:, c]) if vector else (lambda a: a)
            succ = pick(successors(d, r["fill"]))
            ep = d["episode"]
            m = r["fill"]["episode"]
            ended = [(int(ep["end"][i]), i) for i in range(m) if int(ep["env"][i]) == col]
            for t in range(n):
                tr = truth[pos + t]
                assert pick(step["obs"])[t].tolist() == tr["obs"], (col, pos + t)
                assert pick(step["action"])[t] == tr["action"]
                assert pick(step["reward"])[t] == tr["reward"]
                assert bool(pick(step["terminated"])[t]) == tr["terminated"]
                assert bool(pick(step["truncated"])[t]) == tr["truncated"]
                assert pick(step["twice_t"])[t] == 2 * tr["obs"][2]
                assert succ[t].tolist() == tr["succ"], ("successor", col, pos + t)
            # The episode table holds exactly the episodes of this column that ended here, in order.
            want = [(t, truth[pos + t]) for t in range(n) if truth[pos + t]["ret"] is not None]
            assert [e for e, _ in ended] == [t for t, _ in want]
            for (_t, tr), (_, i) in zip(want, ended, strict=True):
                assert ep["return"][i] == tr["ret"] and ep["length"][i] == tr["len"]
                assert bool(ep["terminated"][i]) == tr["terminated"] and bool(ep["truncated"][i]) == tr["truncated"]
                assert ep["final_obs"][i].tolist() == tr["succ"]
            boot = d["bootstrap"]["obs"][col] if vector else d["bootstrap"]["obs"]
            assert boot.tolist() == truth[pos + n - 1]["succ"]  # the successor of the last stored step
            pos += n


def check_complete(rollouts, n_envs, T):
    by_env: dict[int, list] = {e: [] for e in range(n_envs)}
    for r in sorted(rollouts, key=lambda r: (r["lane"], r["seq"])):
        by_env[int(r["data"]["episode"]["env"])].append(r)
    for env_id, rs in by_env.items():
        truth = expected_stream(env_id, sum(r["fill"]["step"] for r in rs), cap=T)
        pos = 0
        for r in rs:
            d, n = r["data"], r["fill"]["step"]
            step = d["step"]
            assert step["obs"][0].tolist()[2] == 0, "a complete-episodes rollout starts at an episode's start"
            succ = successors(d, r["fill"], batch_mode="complete_episodes")
            for t in range(n):
                tr = truth[pos + t]
                assert step["obs"][t].tolist() == tr["obs"]
                assert step["action"][t] == tr["action"] and step["reward"][t] == tr["reward"]
                assert bool(step["terminated"][t]) == tr["terminated"] and bool(step["truncated"][t]) == tr["truncated"]
                assert succ[t].tolist() == tr["succ"]
            last = truth[pos + n - 1]
            assert last["ret"] is not None, "a rollout ends where its episode ends"
            ep = d["episode"]
            assert float(ep["return"]) == last["ret"] and int(ep["length"]) == n == last["len"]
            assert bool(ep["terminated"]) == last["terminated"] and bool(ep["truncated"]) == last["truncated"]
            assert d["bootstrap"]["obs"].tolist() == last["succ"]
            pos += n
    return by_env


class DictObsEnv(CountingEnv):
    """CountingEnv with its observation under a dict key: a pytree observation."""

    def __init__(self, env_id: int = 0):
        super().__init__(env_id)
        self.observation_space = gym.spaces.Dict({"pos": gym.spaces.Box(0, 1e9, (3,), np.float64)})

    def _obs(self):
        return {"pos": super()._obs()}


class RecordingPolicy:
    """Acts as CountingEnv demands (1000 k + t, from the current observation); keeps a copy of every input."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, x: dict[str, Any]) -> Any:
        self.seen.append(optree.tree_map(np.array, x))
        obs = x["obs"]
        action = (obs[:, 1] * 1000 + obs[:, 2]).astype(np.int64)
        return action, {"twice_t": (2 * obs[:, 2]).astype(np.float32)}


def collect_with(make_env, policy, *, T, n_rollouts, batch_mode="truncate_episodes", **loop_kw):
    """collect, with ``policy`` positional and a fresh RecordingPolicy for the probe so a recorder sees only the loop's calls."""
    probe_policy = RecordingPolicy() if isinstance(policy, RecordingPolicy) else policy
    return collect(make_env, T=T, n_rollouts=n_rollouts, batch_mode=batch_mode, policy=policy,
                         probe_policy=probe_policy, **loop_kw)


# -- Collector batches --


class WrongPolicy(EchoPolicy):
    """Acts wrongly from the third episode on: CountingEnv raises inside the actor."""

    def __call__(self, obs):
        action, extras = super().__call__(obs)
        return np.where(obs[:, 1] >= 2, action + 1, action), extras


def per_lane(batches):
    """Rollouts regrouped by lane, in commit order (the copy=True batches are the test's own)."""
    lanes: dict[int, list] = {}
    for b in batches:
        for i in range(len(b.lane)):
            d = {"data": {ts: {k: v[i] for k, v in b.data[ts].items()} for ts in b.data},
                 "fill": {ts: int(n[i]) for ts, n in b.fill.items()}, "seq": int(b.seq[i])}
            lanes.setdefault(int(b.lane[i]), []).append(d)
    for rs in lanes.values():
        rs.sort(key=lambda r: r["seq"])
        assert [r["seq"] for r in rs] == list(range(len(rs))), "a rollout of this lane is missing"
    return lanes
