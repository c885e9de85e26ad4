"""A deterministic env whose episode lengths we choose, its ground truth, and the policies the worker tests use.

Lives in a test module (importable by actor processes under any start method)
so that every test of workers/ checks rollouts against the same truth.

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
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest

from shmbuf import UsageError
from workers.lowlevel import EnvDriver

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


# -- the env itself --------------------------------------------------------


def test_counting_env_matches_its_ground_truth():
    env = CountingEnv(1)
    obs, _ = env.reset()
    truth = expected_stream(1, 40)
    for tr in truth:
        assert obs.tolist() == tr["obs"]
        obs, r, term, trunc, _ = env.step(tr["action"])
        assert (obs.tolist(), r, term, trunc) == (tr["succ"], tr["reward"], tr["terminated"], tr["truncated"])
        if term or trunc:
            obs, _ = env.reset()


def test_counting_env_refuses_a_step_past_the_end():
    env = CountingEnv(0)
    env.reset()
    for t in range(LENGTHS[0]):
        env.step(t)
    with pytest.raises(AssertionError, match="fake transition"):
        env.step(LENGTHS[0])


def test_next_step_autoreset_really_makes_a_fake_step():
    """The hazard the actor must avoid: in NEXT_STEP mode the step after an episode's end is a reset."""
    venv = make_vector(1, "NextStep")
    obs, _ = venv.reset()
    for t in range(LENGTHS[0]):
        obs, r, term, trunc, _ = venv.step(np.array([t]))
    assert term[0] or trunc[0]
    obs, r, term, trunc, _ = venv.step(np.array([123456]))  # action ignored, reward 0: no transition
    assert obs[0].tolist() == [0, 1, 0] and r[0] == 0.0
    venv.close()


# -- EnvDriver: buffers that the env overwrites, and envs without partial reset ---


@pytest.mark.parametrize("make", [lambda: ReusingCountingEnv(0), lambda: make_vector(2, "NextStep", copy=False),
                                  lambda: make_vector(2, "SameStep", copy=False)], ids=["single", "next", "same"])
def test_driver_observation_survives_the_next_step(make):
    """The observation an action is taken on is still that observation after step(), even if the env reuses its buffer."""
    env = make()
    driver = EnvDriver(env)
    obs = driver.reset()
    try:
        for _ in range(30):
            before = obs.copy()
            action = (obs[:, 1] * 1000 + obs[:, 2]).astype(np.int64)
            nobs, _, term, trunc, succ = driver.step(action)
            assert np.array_equal(obs, before), "step() changed the observation the action was taken on"
            ended = term | trunc
            assert np.array_equal(succ[~ended], nobs[~ended])
            assert (succ[:, 2] == obs[:, 2] + 1).all() and (succ[:, 1] == obs[:, 1]).all()  # the real successor
            assert (nobs[ended, 2] == 0).all()  # a new episode starts where one ended
            obs = nobs
    finally:
        env.close()


def test_reusing_env_really_reuses():
    """The hazard itself: ReusingCountingEnv's and SyncVectorEnv(copy=False)'s observations change under the caller."""
    env = ReusingCountingEnv(0)
    obs, _ = env.reset()
    env.step(0)
    assert obs.tolist() == [0, 0, 1]
    venv = make_vector(2, copy=False)
    vobs, _ = venv.reset()
    venv.step(np.array([0, 0]))
    assert vobs[:, 2].tolist() == [1, 1]
    venv.close()


def test_gymnasium_without_partial_reset_is_refused(monkeypatch):
    """gymnasium 1.0's vector envs reset every sub-env on reset(options={"reset_mask": ...}): refuse, say what to install."""
    monkeypatch.setattr(gym, "__version__", "1.0.0")
    env = make_vector(2)
    try:
        with pytest.raises(UsageError, match=r"gymnasium 1\.0\.0 is installed.*pip install 'gymnasium>=1\.1'"):
            EnvDriver(env)
    finally:
        env.close()


class FakeVectorEnv(gym.vector.VectorEnv):
    """A vector env of gymnasium 1.0's kind: no declared autoreset mode, and a reset that ignores reset_mask."""

    def __init__(self, n: int = 2):
        self.num_envs = n
        self.metadata = {"render_modes": []}
        self.single_observation_space = gym.spaces.Box(0, 1e9, (3,), np.float64)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, n)

    def reset(self, *, seed=None, options=None):
        return np.zeros((self.num_envs, 3)), {}


def test_vector_env_that_does_not_declare_its_autoreset_mode_is_refused():
    with pytest.raises(UsageError, match=r"FakeVectorEnv: metadata has no 'autoreset_mode'.*reset_mask"):
        EnvDriver(FakeVectorEnv())
    assert issubclass(UsageError, ValueError)
