"""An array the public API hands out keeps its shared memory mapped while it lives: a late read never kills the process.

Each pattern runs in a child Python process of its own, and the test asserts on its exit status:
before the fix, numpy built the slot views without a buffer export, ``close()`` unmapped the
memory under them and the late read was a SIGSEGV (exit status -11). Each child prints what it
read, and where nothing could have changed the memory since, the test checks the value too.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What every program starts with: a pipeline whose writer fills each step of rollout k with k + 1.
PRELUDE = """
import gc, sys
import numpy as np
import shmbuf

EXAMPLE = {"step": {"obs": np.zeros((8, 64), np.float32)}, "episode": {"n": np.zeros((), np.int64)}}

def fill(reader, n):
    with shmbuf.Writer(reader.handle, timeout=10) as w:
        reader.poll()
        for k in range(n):
            for _ in range(8):
                w.add("step", {"obs": np.full(64, k + 1, np.float32)})
            w.add("episode", {"n": np.int64(k)})
            w.commit()
"""

# One value per step row: sum(k + 1 for the k-th rollout) * 8 steps * 64.
ROLLOUT_SUM = {k: float((k + 1) * 8 * 64) for k in range(8)}

PATTERNS = {
    "rollout_after_close": ("""
reader = shmbuf.create(EXAMPLE, slots=4, max_writers=1)
fill(reader, 1)
r = reader.get(timeout=10)
kept = r.data["step"]["obs"]
reader.close()
print(float(kept.sum()))
""", ROLLOUT_SUM[0]),
    "rollout_after_del_and_gc": ("""
reader = shmbuf.create(EXAMPLE, slots=4, max_writers=1)
fill(reader, 1)
kept = reader.get(timeout=10).data["step"]["obs"][2:6]
del reader
gc.collect()
print(float(kept.sum()))
""", ROLLOUT_SUM[0] / 2),
    "view_batch_after_close": ("""
reader = shmbuf.create(EXAMPLE, slots=4, max_writers=1)
fill(reader, 2)
b = reader.get_batch(2, timeout=10)
assert b.zero_copy, "the pattern needs a zero-copy batch"
kept = b.data["step"]["obs"]
reader.close()
print(float(kept.sum()))
""", ROLLOUT_SUM[0] + ROLLOUT_SUM[1]),
    "view_batch_after_with_block": ("""
with shmbuf.create(EXAMPLE, slots=4, max_writers=1) as reader:
    fill(reader, 2)
    with reader.get_batch(2, timeout=10) as b:
        assert b.zero_copy, "the pattern needs a zero-copy batch"
        kept = b.data["step"]["obs"].reshape(-1)
print(float(kept.sum()))
""", ROLLOUT_SUM[0] + ROLLOUT_SUM[1]),
    "torch_from_numpy_after_close": ("""
import torch
reader = shmbuf.create(EXAMPLE, slots=4, max_writers=1)
fill(reader, 2)
b = reader.get_batch(2, timeout=10)
assert b.zero_copy, "the pattern needs a zero-copy batch"
kept = torch.from_numpy(b.data["step"]["obs"])
del b
reader.close()
del reader
gc.collect()
print(float(kept.sum()))
""", ROLLOUT_SUM[0] + ROLLOUT_SUM[1]),
    "filled_views_after_close": ("""
reader = shmbuf.create(EXAMPLE, slots=4, max_writers=1)
fill(reader, 1)
with reader.get(timeout=10) as r:
    kept = r.filled()["step"]["obs"]
reader.close()
print(float(kept.sum()))
""", ROLLOUT_SUM[0]),
}

# The collectors: their batches are views of slots that later batches reuse, so what a kept array reads is whatever
# the last batch left there. Every observation of ConstEnv is 3.0, so every element of a kept observation array, and
# of every observation batch the policy was handed, reads 3.0 whichever batch wrote it last: each program prints, per
# kind of kept array, the sum read and the number of elements, and the test checks sum == 3.0 * elements.
CONST_ENV = """
import gymnasium as gym
import numpy as np

OBS = 3.0


class ConstEnv(gym.Env):
    observation_space = gym.spaces.Box(-10.0, 10.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full(4, OBS, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(4, OBS, np.float32), 1.0, self.t >= 20, False, {}


def make_env(num_envs=1):
    if num_envs == 1:
        return ConstEnv()
    return gym.vector.SyncVectorEnv([ConstEnv] * num_envs)
"""

COLLECTORS = CONST_ENV + """
from workers import AsyncBatchedCollector, Collector

def policy(obs):
    return np.zeros(len(obs), np.int64)

def report(what, arrays):
    print(what, sum(float(a.sum()) for a in arrays), sum(a.size for a in arrays))
"""

# Each: the program, and how many elements its kept batches hold (frames x 4).
COLLECTOR_PATTERNS = {
    "collector_after_with_block": ("""
if __name__ == "__main__":
    with Collector([make_env] * 2, policy, frames_per_batch=256, total_frames=512) as c:
        kept = [b.data["step"]["obs"] for b in c]
    report("kept", kept)
""", 512 * 4),
    "collector_after_shutdown_and_gc": ("""
if __name__ == "__main__":
    c = Collector([make_env] * 2, policy, frames_per_batch=256, total_frames=512)
    kept = [b.data["step"]["obs"] for b in c]
    c.shutdown()
    del c
    gc.collect()
    report("kept", kept)
""", 512 * 4),
    "async_batched_after_with_block": ("""
class Keeping:
    def __init__(self):
        self.seen = []  # the observation batches the server handed the policy, kept past shutdown

    def __call__(self, obs):
        self.seen.append(obs)
        return policy(obs)

if __name__ == "__main__":
    keeping = Keeping()
    with AsyncBatchedCollector([make_env] * 2, policy=keeping, frames_per_batch=128, total_frames=256) as c:
        kept = [b.data["step"]["obs"] for b in c]
    gc.collect()
    report("kept", kept)
    report("seen", keeping.seen)
""", 256 * 4),
}


def run_program(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "late_read.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def survived(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """Fail unless the program exited 0 (a late read that crashed is named by its signal); return its lines."""
    if proc.returncode < 0:
        raise AssertionError(f"the late read killed the process with {signal.Signals(-proc.returncode).name}\n{proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def assert_survived(proc: subprocess.CompletedProcess[str]) -> float:
    return float(survived(proc)[-1])


def const_reads(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    """The lines ``<what> <sum> <elements>`` a program printed (``report``): check that every element read 3.0 (the
    only observation ConstEnv makes) and return ``{what: elements}``."""
    out = {}
    for line in survived(proc):
        if line.startswith(("kept ", "seen ")):
            what, total, n = line.split()
            assert int(n) > 0 and float(total) == 3.0 * int(n), f"{what}: {n} elements read {total}, not 3.0 each"
            out[what] = int(n)
    return out


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_kept_array_is_read_after_its_pipeline_is_gone(pattern: str, tmp_path: pathlib.Path) -> None:
    code, expected = PATTERNS[pattern]
    assert assert_survived(run_program(PRELUDE + code, tmp_path)) == expected


@pytest.mark.parametrize("pattern", sorted(COLLECTOR_PATTERNS))
def test_a_kept_collector_batch_is_read_after_the_collector_is_gone(pattern: str, tmp_path: pathlib.Path) -> None:
    code, kept = COLLECTOR_PATTERNS[pattern]
    got = const_reads(run_program(PRELUDE + COLLECTORS + code, tmp_path))
    assert got["kept"] == kept  # every batch's observations were kept, and read
    assert ("seen" in got) == pattern.startswith("async")


def test_after_close_the_rollout_itself_raises_stale_rollout() -> None:
    """The handle knows the pipeline is gone: ``data`` and ``release()`` raise (arrays taken before: the patterns above)."""
    import numpy as np

    import shmbuf

    reader = shmbuf.create({"step": {"x": np.zeros((4,), np.int64)}}, slots=2, max_writers=1)
    try:
        with shmbuf.Writer(reader.handle, timeout=10) as w:
            reader.poll()
            for t in range(4):
                w.add("step", {"x": np.int64(t + 1)})
            w.commit()
        r = reader.get(timeout=10)
        assert r.data["step"]["x"].tolist() == [1, 2, 3, 4]
    finally:
        reader.close()
    with pytest.raises(shmbuf.StaleRollout, match="closed"):
        _ = r.data
    with pytest.raises(shmbuf.StaleRollout, match="closed"):
        r.release()
    assert r.released


RAY_PROGRAM = """
import gc, os, sys
import numpy as np
import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
import cartpole_collect
import const_env  # CONST_ENV, written beside this program
from cartpole_collect import LinearPolicy
from const_env import make_env
from workers import RayCollector

def main():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    kept = {}
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False,
                 runtime_env={"py_modules": [cartpole_collect, const_env]})
        with RayCollector(make_env, LinearPolicy(), frames_per_batch=1024, actors_per_node=1,
                          create_env_kwargs={"num_envs": 8}, weights={"w": np.zeros((4, 2), np.float32)}, timeout=60) as c:
            for b in c:
                kept.setdefault(b.node, []).append(b.data["step"]["obs"])  # node 0: this process's shared memory
                if len(kept) == 2 and sum(map(len, kept.values())) >= 6:
                    break
    finally:
        ray.shutdown()
        cluster.shutdown()
    gc.collect()
    print(sorted(kept), flush=True)
    arrays = [k for ks in kept.values() for k in ks]
    print("batches", len(arrays), flush=True)
    print("kept", sum(float(k.sum()) for k in arrays), sum(k.size for k in arrays), flush=True)

if __name__ == "__main__":
    main()
"""


def test_kept_ray_batches_from_every_node_are_read_after_ray_is_shut_down(tmp_path: pathlib.Path) -> None:
    """The learner's own node hands out Collector views of its shared memory; the other node's come through Ray."""
    pytest.importorskip("ray")  # the `test` extra installs it: this skips only where someone runs the core's tests alone
    script = tmp_path / "late_ray.py"
    script.write_text(RAY_PROGRAM)
    (tmp_path / "const_env.py").write_text(CONST_ENV)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    got = const_reads(proc)  # every element of every kept batch read 3.0, from either node
    lines = proc.stdout.strip().splitlines()
    assert lines[-3] == "[0, 1]", proc.stdout  # batches of both nodes were kept
    batches = int(lines[-2].split()[1])
    assert batches >= 6 and got["kept"] == batches * 1024 * 4, proc.stdout  # 1024 frames of 4 numbers a batch
