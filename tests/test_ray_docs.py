"""docs/ray.md's Python block and examples/ray_cartpole.py run as written, on a local two-node Ray cluster.

Each runs in a fresh interpreter in a session of its own (``start_new_session``). Ray's processes
(gcs, raylets, workers, the node owners) and the owners' actor processes stay in that session, so
"no Ray process left" is checked exactly: no live process in it once the run has returned. The shmbuf
watchers of the node owners and of the learner (shmbuf/_janitor.py) start sessions of their own: none may
outlive its owner. Other runs on this machine may hold their own Ray clusters and pipelines at the same time;
only what these runs made is judged. docs/ray.md's ```text blocks need a real cluster (``ray start``
on several machines) and are not run; the example's ``--address`` mode is what they describe.

Unlike the other docs blocks that start processes (tests/helpers.py's under_each_start_method), the block runs under
its default start method only, forkserver, which imports the script again in a new process as spawn does: that run
is what checks its ``__main__`` guard. fork is no method for it: by the time RayCollector starts the learner node's
actors, ``ray.init`` has started threads in the learner (gRPC, the core worker), and a child forked from it would
inherit their locks. spawn would add a third local cluster (~30 s on 2 cores) to check the same re-import. And the
other nodes' actors are started by owners inside Ray worker processes, where no start method set in the script
applies (RayCollector(start_method=...) is passed on to them instead).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.conftest import leaked_since, orphaned_watchers, shm_objects
from tests.helpers import doc_blocks, in_session, kill_all

pytest.importorskip("ray", reason="the `ray` extra (make test installs it)")
pytest.importorskip("gymnasium")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEADLINE = 180.0  # for one run: starting a local cluster takes ~5-10 s on a busy 2-core machine
CLEANUP = 30.0  # for Ray's processes, the owners' actors and the watchers to be gone after a run returns

# Which test runs each ```python block of docs/ray.md: a block is known by a line only it has.
PYTHON_BLOCKS = {"import cartpole_collect": "test_first_run_block_collects_from_both_nodes_and_leaves_nothing",
                 "import mpe_tag": "test_multiagent_block_collects_both_teams_from_both_nodes_and_leaves_nothing"}


def block(marker: str) -> str:
    (found,) = [b for b in doc_blocks("ray.md") if marker in b]
    return found


def run(args: list[str], cwd: pathlib.Path, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """Run a script in a session of its own; afterwards, nothing of the session, no orphaned watcher, no shmbuf leak.

    Warnings are errors. Output goes to files, not pipes, so that a process left behind cannot hold the test
    up. Whatever of the session outlives the deadlines is killed by pid (those processes are this run's) and
    reported.
    """
    before = shm_objects()
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen([sys.executable, "-W", "error", *args], cwd=cwd, stdout=out_f, stderr=err_f,
                                start_new_session=True)
    sid = proc.pid
    try:
        proc.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        deadline = time.monotonic() + CLEANUP
        while (in_session(sid) or orphaned_watchers() or leaked_since(before)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left, watchers, leaked = in_session(sid), orphaned_watchers(), leaked_since(before)
        kill_all(left)
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 0, f"{args} exited {proc.returncode} (-9: killed after {DEADLINE} s):\n{out[-3000:]}\n{err[-5000:]}"
    assert not left, f"{CLEANUP} s after the run, its processes were still there (killed now): {left}"
    assert not watchers, f"watchers outlived their owners (watcher pid, owner pid): {watchers}"
    assert not leaked, f"left in /dev/shm: {[f.name for f in leaked]}"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_every_python_block_of_the_ray_doc_is_run_by_a_test() -> None:
    for b in doc_blocks("ray.md"):
        assert sum(m in b for m in PYTHON_BLOCKS) == 1, f"a docs/ray.md python block no test runs:\n{b}"
    assert len(doc_blocks("ray.md")) == len(PYTHON_BLOCKS)


def test_first_run_block_collects_from_both_nodes_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    """The block as a script, run from the repository's root as the doc says. No PYTHONPATH: the nodes import
    cartpole_collect only through the block's runtime_env py_modules (examples/ is on no path of theirs)."""
    script = tmp_path / "ray_doc_block.py"
    script.write_text(block("import cartpole_collect"))
    done = run([str(script)], cwd=ROOT, tmp_path=tmp_path)
    lines = re.findall(r"^node (\d) \((\w{12})\): (\d+) batches, (\d+) frames, (\d+) lost$", done.stdout, re.M)
    assert len(lines) == 2, done.stdout
    assert {n for n, *_ in lines} == {"0", "1"} and len({i for _, i, *_ in lines}) == 2
    assert all(int(b) > 0 and int(f) == 1024 * int(b) and lost == "0" for _, _, b, f, lost in lines), lines
    assert sum(int(b) for _, _, b, _, _ in lines) >= 20


def test_multiagent_block_collects_both_teams_from_both_nodes_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    """The multi-agent block as a script: both nodes deliver MultiAgentBatches, the chasers' weights move alone."""
    pytest.importorskip("mpe2", reason="the `multiagent` extra (make test installs it)")
    script = tmp_path / "ray_multiagent_block.py"
    script.write_text(block("import mpe_tag"))
    done = run([str(script)], cwd=ROOT, tmp_path=tmp_path)
    assert "rows: 6 chasers, 2 runners" in done.stdout, done.stdout
    versions = re.search(r"^versions: \{'chaser': (\d+), 'runner': 0\}$", done.stdout, re.M)
    lines = re.findall(r"^node (\d): (\d+) batches, (\d+) env steps, (\d+) lost$", done.stdout, re.M)
    assert versions and len(lines) == 2 and {n for n, *_ in lines} == {"0", "1"}, done.stdout
    batches = sum(int(b) for _, b, _, _ in lines)
    assert int(versions[1]) == batches >= 6  # one chaser update per batch taken
    assert all(int(b) > 0 and int(f) == 100 * int(b) and lost == "0" for _, b, f, lost in lines), lines


def test_ray_cartpole_example_runs_on_two_local_nodes_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    done = run([str(ROOT / "examples" / "ray_cartpole.py"), "--seconds", "3", "--json"], cwd=ROOT, tmp_path=tmp_path)
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    nodes = out["nodes"]
    assert len(nodes) == 2 and len({n["node_id"] for n in nodes}) == 2
    assert all(n["frames"] > 0 and n["batches"] > 0 and n["lost_batches"] == 0 for n in nodes), nodes
    assert out["frames"] == sum(n["frames"] for n in nodes) and out["failures"] == []
    assert out["frames"] == out["batches"] * out["frames_per_batch"] == out["batches"] * 8 * 128
    assert out["policy_version"] == out["batches"] // 4  # new weights every 4 batches
    assert "collecting on 2 nodes" in done.stderr  # the progress bar
