"""A user's exception in a training loop ends in that exception and a clean shutdown, never a signal death.

Each run is a user's script, run in a fresh interpreter (tests.helpers.START_METHOD_WRAPPER makes spawn, forkserver
or fork multiprocessing's and workers' default): it builds a collector, iterates it, and raises a user's exception
in the loop's body, with no ``with`` and no shutdown, as TorchRL's examples read. The exception then meets the
interpreter's exit with the collector open: its threads (the inference server, env-worker threads, the
background collection of ``start()``) still running while the finalizers of its pipeline and table release
them. Every run must exit with status 1 and the user's traceback on stderr, and leave nothing behind: no
process of its session, no shmbuf object it made in /dev/shm.

Kinds: ``Collector`` (actor processes), ``AsyncBatchedCollector`` with process env workers and a numpy policy,
the TorchRL-style iteration of ``AsyncBatchedCollector`` (a TensorDict module, TorchRL envs, its default thread
env workers: the run that died by SIGSEGV or SIGABRT in 11 of 12 runs before the fix), its ``start()`` background
mode into a TorchRL replay buffer, and ``MultiAgentCollector`` (served policies: a server thread per policy).
RayCollector is left out: starting a Ray cluster takes longer than all of these runs together.

``make test`` runs each kind once, under the start methods in turn, and the TorchRL-style run under each start
method (7 runs); ``make test-slow`` runs 50 (each kind under each start method, 3 times, and 5 more TorchRL-style).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from shmbuf import _admin
from tests.helpers import START_METHOD_WRAPPER, START_METHODS, run_in_session

pytest.importorskip("torchrl", reason="the TorchRL-style runs need torchrl")
pytest.importorskip("pettingzoo", reason="the multi-agent run needs pettingzoo")

HEAD = '''\
import json
import time

import gymnasium as gym
import numpy as np


class UserBug(Exception):
    """What any bug in a user's training loop raises."""


def made_here(collector):
    """Print the names of the shared-memory objects the collector made, for the test to look for them after the run.

    Attributes only: nothing is opened or scanned here (a scan of /dev/shm in this process, shmbuf._admin's, hid
    the crash this test is about, by its timing).
    """
    made = [getattr(collector, "reader", None), getattr(collector, "publisher", None), getattr(collector, "table", None)]
    made += [*getattr(collector, "readers", {}).values(), *getattr(collector, "publishers", {}).values()]
    made += [sp.table for sp in getattr(collector, "served", {}).values()]
    print(json.dumps(sorted(x.name for x in made if x is not None)), flush=True)


def make_env():
    return gym.make("CartPole-v1")


def policy(obs):
    return (obs[:, 0] > 0).astype(np.int64)
'''

SCRIPTS = {
    "collector": HEAD + '''
from workers import Collector

if __name__ == "__main__":
    collector = Collector([make_env] * 2, policy, frames_per_batch=64, total_frames=100_000)
    for i, batch in enumerate(collector):
        if i == 1:
            made_here(collector)
            raise UserBug("a user's bug in the training loop")
''',
    "async": HEAD + '''
from workers import AsyncBatchedCollector

if __name__ == "__main__":
    collector = AsyncBatchedCollector([make_env] * 2, policy=policy, frames_per_batch=64, total_frames=100_000,
                                      env_backend="multiprocessing")
    for i, batch in enumerate(collector):
        if i == 1:
            made_here(collector)
            raise UserBug("a user's bug in the training loop")
''',
    "torchrl": HEAD + '''
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import GymEnv

from workers import AsyncBatchedCollector


def make_torchrl_env():
    return GymEnv("CartPole-v1")


if __name__ == "__main__":
    module = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
    collector = AsyncBatchedCollector([make_torchrl_env] * 2, policy=module, frames_per_batch=64, total_frames=100_000)
    for i, data in enumerate(collector):
        if i == 2:
            made_here(collector)
            raise UserBug("a user's bug in the training loop")
''',
    "background": HEAD + '''
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv

from workers import AsyncBatchedCollector


def make_torchrl_env():
    return GymEnv("CartPole-v1")


if __name__ == "__main__":
    module = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
    collector = AsyncBatchedCollector([make_torchrl_env] * 2, policy=module, frames_per_batch=64, total_frames=-1,
                                      replay_buffer=rb)
    collector.start()
    for _ in range(1200):  # at most 60 s
        if len(rb) >= 128:
            break
        time.sleep(0.05)
    made_here(collector)
    raise UserBug("a user's bug in the training loop, with the collection running in the background")
''',
    "multiagent": HEAD + '''
import multiprocessing

import pettingzoo

from workers import MultiAgentCollector


class Pairs(pettingzoo.ParallelEnv):
    """Two agents, each of its own policy, for 20 steps an episode."""

    metadata = {"name": "pairs_v0"}
    possible_agents = ["red_0", "blue_0"]

    def observation_space(self, agent):
        return gym.spaces.Box(-1.0, 1.0, (3,), np.float32)

    def action_space(self, agent):
        return gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        self.t = 0
        self.agents = list(self.possible_agents)
        return {a: np.zeros(3, np.float32) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        self.t += 1
        end = self.t >= 20
        obs = {a: np.full(3, self.t / 20, np.float32) for a in actions}
        self.agents = [] if end else self.agents
        return (obs, {a: 1.0 for a in actions}, {a: False for a in actions}, {a: end for a in actions},
                {a: {} for a in actions})


def team(agent_id, episode, **kwargs):
    return agent_id.split("_")[0]


def act(obs):
    return (np.asarray(obs)[:, 0] > 0.5).astype(np.int64)


if __name__ == "__main__":
    collector = MultiAgentCollector([Pairs] * 2, {"red": act, "blue": act}, policy_mapping_fn=team,
                                    frames_per_batch=40, serve=True,
                                    start_method=multiprocessing.get_start_method())  # the wrapper's
    for i, batch in enumerate(collector):
        if i == 1:
            made_here(collector)
            raise UserBug("a user's bug in the training loop")
''',
}
KINDS = tuple(SCRIPTS)
THREADS = {"torchrl", "background"}  # TorchRL's default for a TensorDict module: env workers are threads, none started


def run_raising(kind: str, method: str, tmp_path: pathlib.Path, timeout: float = 180, cleanup: float = 20) -> None:
    """Run ``kind``'s script under ``method``; fail unless it exits 1 with the user's traceback, and nothing of it
    (a process of its session, a shmbuf object it made) is left. Whatever is left is killed and removed first."""
    script = tmp_path / f"{kind}_{method}.py"
    script.write_text(SCRIPTS[kind])
    wrapper = tmp_path / f"{kind}_{method}_wrapper.py"
    wrapper.write_text(START_METHOD_WRAPPER.format(method=method, uses_workers=True, script=str(script),
                                                   report=str(tmp_path / f"{kind}_{method}.started.json")))
    proc, out, err, left = run_in_session([str(wrapper)], tmp_path, f"{kind}_{method}", timeout=timeout, cleanup=cleanup)
    lines = [line for line in out.splitlines() if line.startswith("[")]
    made = set(json.loads(lines[-1])) if lines else set()
    leftovers = [f for f in _admin.scan() if f.name in made or f.owner_pid == proc.pid]
    for f in leftovers:
        _admin.remove(f)
    what = f"{kind} under {method}"
    assert proc.returncode == 1, f"{what} exited {proc.returncode} (negative: killed by that signal), not 1:\n{err[-4000:]}"
    assert "Traceback (most recent call last)" in err and "UserBug: a user's bug" in err, \
        f"{what}: no user traceback:\n{err[-4000:]}"
    assert made, f"{what} did not report what it made (it failed before its loop?):\n{out[-2000:]}\n{err[-4000:]}"
    assert not left, f"{what}: {cleanup} s after it exited, processes it started were still there (killed now): {left}"
    assert not leftovers, f"{what} left in /dev/shm (removed now): {[f.name for f in leftovers]}"
    if kind not in THREADS:
        started = json.loads((tmp_path / f"{kind}_{method}.started.json").read_text())
        assert started and set(started) == {method}, f"{what} started processes by {started}, not all by {method}"


# make test: each kind once, under the start methods in turn, and the TorchRL-style run under each.
FAST = sorted({(kind, START_METHODS[i % 3]) for i, kind in enumerate(KINDS)} | {("torchrl", m) for m in START_METHODS})


@pytest.mark.parametrize(("kind", "method"), FAST)
def test_a_users_exception_in_the_loop_ends_in_it_and_a_clean_shutdown(kind: str, method: str,
                                                                       tmp_path: pathlib.Path) -> None:
    run_raising(kind, method, tmp_path)


# make test-slow: 50 runs, every kind under every start method 3 times (45), and 5 more TorchRL-style.
SLOW = [(kind, method, k) for kind in KINDS for method in START_METHODS for k in range(3)] + [
    ("torchrl", START_METHODS[k % 3], 3 + k) for k in range(5)]
assert len(SLOW) == 50


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "method", "run"), SLOW)
def test_fifty_runs_of_a_users_exception_end_in_it_and_a_clean_shutdown(kind: str, method: str, run: int,
                                                                        tmp_path: pathlib.Path) -> None:
    run_raising(kind, method, tmp_path)
