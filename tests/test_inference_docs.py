"""Every python block of docs/inference.md runs as written, and prints what the page says it prints.

Each block's env workers are started by workers, with its default method, forkserver, whatever multiprocessing's
default is: a block runs the same under every default start method, so it runs once, under forkserver (and the run
fails unless it started processes, all by forkserver: tests.helpers.start_methods, run_script).
AsyncBatchedCollector under spawn and fork is tests/test_workers_inference.py's matter.
"""

from __future__ import annotations

import ast
import pathlib
import re

from tests.helpers import doc_blocks, run_doc_block_under_each_start_method

BLOCKS = doc_blocks("inference.md")


def test_the_page_has_its_blocks() -> None:
    assert len(BLOCKS) == 3


def test_the_collector_block_prints_its_batches_and_the_servers_batching(tmp_path: pathlib.Path) -> None:
    """1024 frames in batches of 256 from 4 CartPoles; the policy version an action carries moves on with the
    updates and is never one the learner has not published yet."""
    assert "total_frames=1024" in BLOCKS[0] and "frames_per_batch=256" in BLOCKS[0]
    for method, out in run_doc_block_under_each_start_method("inference.md", 0, tmp_path).items():
        check_collector_block_output(method, out.splitlines())


def check_collector_block_output(method: str, lines: list[str]) -> None:
    assert len(lines) == 4 + 1, (method, lines)
    versions = []
    for line in lines[:4]:
        m = re.fullmatch(r"\((\d+), 64, 4\) \((\d+), 64\) (\d+)", line)
        assert m and m[1] == m[2] and int(m[1]) * 64 == 256, (method, line)  # (B, T, 4) and (B, T): 256 frames a batch
        versions.append(int(m[3]))
    assert versions[0] == 0 and all(v <= k for k, v in enumerate(versions)), (method, versions)  # k after k updates
    assert versions == sorted(versions), (method, versions)
    m = re.fullmatch(r"(\d+) forward passes, ([\d.]+) requests each", lines[4])
    assert m, (method, lines[4])
    forwards, mean_batch = int(m[1]), float(m[2])
    assert 1.0 <= mean_batch <= 4.0, (method, lines[4])  # 4 envs: at most one request of each in a forward pass
    assert forwards * (mean_batch + 0.05) >= 1024, (method, lines[4])  # a request for every step (mean_batch is rounded)


def test_the_tensordict_block_prints_torchrls_layout(tmp_path: pathlib.Path) -> None:
    for method, out in run_doc_block_under_each_start_method("inference.md", 2, tmp_path).items():
        size, keys = out.strip().split(" [", 1)
        keys = "[" + keys
        assert size == "torch.Size([2, 64])", method  # 2 envs x T = 64: the 128 frames asked for
        assert ast.literal_eval(keys) == [
            "('collector', 'mask')", "('collector', 'traj_ids')", "('next', 'done')", "('next', 'observation')",
            "('next', 'reward')", "('next', 'terminated')", "('next', 'truncated')", "action", "observation",
            "policy_version"], method


def test_the_num_workers_block_prints_vector_rollouts_and_requests_of_four_envs(tmp_path: pathlib.Path) -> None:
    """8 envs in 2 workers: every rollout holds a worker's 4 envs, and a forward pass holds at most both workers'
    requests (each request 4 observations)."""
    for method, out in run_doc_block_under_each_start_method("inference.md", 1, tmp_path).items():
        lines = out.splitlines()
        assert lines[:-1] and all(line == "(2, 64, 4, 4)" for line in lines[:-1]), (method, lines)
        assert len(lines[:-1]) == 4, (method, lines)  # 2048 frames in batches of 512
        m = re.fullmatch(r"(\d+) forward passes, ([\d.]+) requests each", lines[-1])
        assert m and 1.0 <= float(m[2]) <= 2.0, (method, lines[-1])  # 2 workers: at most 2 requests a forward
        assert int(m[1]) * 2 >= 2048 // 4, (method, lines[-1])  # a request per worker step, 4 frames each
