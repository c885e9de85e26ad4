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

# The collectors: their batches are views of slots that later batches reuse, so the value read is
# whatever the last batch left there; the test checks that it is read, and is a number.
COLLECTORS = """
import gymnasium as gym
from workers import AsyncBatchedCollector, Collector

def make_env():
    return gym.make("CartPole-v1")

def policy(obs):
    return (np.asarray(obs)[:, 2] > 0).astype(np.int64)
"""

COLLECTOR_PATTERNS = {
    "collector_after_with_block": """
if __name__ == "__main__":
    with Collector([make_env] * 2, policy, frames_per_batch=256, total_frames=512) as c:
        kept = [b.data["step"]["obs"] for b in c]
    print(sum(float(k.sum()) for k in kept))
""",
    "collector_after_shutdown_and_gc": """
if __name__ == "__main__":
    c = Collector([make_env] * 2, policy, frames_per_batch=256, total_frames=512)
    kept = [b.data["step"]["obs"] for b in c]
    c.shutdown()
    del c
    gc.collect()
    print(sum(float(k.sum()) for k in kept))
""",
    "async_batched_after_with_block": """
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
    print(sum(float(k.sum()) for k in kept) + sum(float(o.sum()) for o in keeping.seen))
""",
}


def run_program(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "late_read.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def assert_survived(proc: subprocess.CompletedProcess[str]) -> float:
    if proc.returncode < 0:
        raise AssertionError(f"the late read killed the process with {signal.Signals(-proc.returncode).name}\n{proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_kept_array_is_read_after_its_pipeline_is_gone(pattern: str, tmp_path: pathlib.Path) -> None:
    code, expected = PATTERNS[pattern]
    assert assert_survived(run_program(PRELUDE + code, tmp_path)) == expected


@pytest.mark.parametrize("pattern", sorted(COLLECTOR_PATTERNS))
def test_a_kept_collector_batch_is_read_after_the_collector_is_gone(pattern: str, tmp_path: pathlib.Path) -> None:
    got = assert_survived(run_program(PRELUDE + COLLECTORS + COLLECTOR_PATTERNS[pattern], tmp_path))
    assert got == got and got != 0.0  # a real sum of CartPole observations: finite (not NaN) and not all zeros


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
from cartpole_collect import LinearPolicy, make_env
from workers import RayCollector

def main():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    kept = {}
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False, runtime_env={"py_modules": [cartpole_collect]})
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
    print(sum(float(k.sum()) for ks in kept.values() for k in ks), flush=True)

if __name__ == "__main__":
    main()
"""


def test_kept_ray_batches_from_every_node_are_read_after_ray_is_shut_down(tmp_path: pathlib.Path) -> None:
    """The learner's own node hands out Collector views of its shared memory; the other node's come through Ray."""
    pytest.importorskip("ray")  # the `test` extra installs it: this skips only where someone runs the core's tests alone
    script = tmp_path / "late_ray.py"
    script.write_text(RAY_PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    got = assert_survived(proc)
    assert got == got and got != 0.0
    assert proc.stdout.strip().splitlines()[-2] == "[0, 1]", proc.stdout  # batches of both nodes were kept
