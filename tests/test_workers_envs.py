"""The deterministic env the worker tests use (tests/helpers_workers.py): it matches its ground truth, refuses
misaligned actions, and EnvDriver drives it (and other envs) as the actor loop does.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from shmbuf import UsageError
from tests.helpers_workers import LENGTHS, CountingEnv, ReusingCountingEnv, expected_stream, make_vector
from workers.lowlevel import EnvDriver

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
