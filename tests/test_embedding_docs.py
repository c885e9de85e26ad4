"""Every python block of docs/embedding.md runs as written, and prints what the page says it prints.

Each block is a script run in a fresh interpreter in a session of its own (warnings are errors;
tests/helpers.py run_doc_block). The two that start processes (the trainer before and after shmbuf)
run under spawn, forkserver and fork at once (under_each_start_method): a wrapper makes the method
multiprocessing's default and runs the block unchanged as ``__main__``, and the run fails unless every
process the block started was started by that method and is gone after it. A run also fails if it
left a shmbuf object behind. This replaces tests/test_workers_docs.py, which ran the page's old
blocks with stand-ins for names the page left undefined.
"""

from __future__ import annotations

import ast
import pathlib
import re
import time

import gymnasium as gym
import pytest

from tests.conftest import leaked_since, shm_objects
from tests.helpers import ROOT, doc_blocks, run_doc_block, under_each_start_method

PAGE = "embedding.md"
BLOCKS = doc_blocks(PAGE)
TEXT = (ROOT / "docs" / PAGE).read_text()

# One marker per block: what makes it that block and no other.
MARKERS = {
    "before": "queue.put(",
    "after": "shmbuf.WeightPublisher(",
    "fill": 'rollout.fill["episode"]',
    "scalars": '{"reward": 0.0}',
    "lanes": "def one_per_writer(",
    "semaphores": "def shmbuf_cli(",
    "torch": "torch.from_numpy(r.data",
}
STARTS_PROCESSES = ("before", "after")

TRAINER_LINE = re.compile(r"^(\d+) updates; mean return: first 5 (\d+\.\d), last 5 (\d+\.\d)$")
BATCHES_LINE = re.compile(r"^batches: (\d+) zero-copy, (\d+) gathered$")


def index(name: str) -> int:
    found = [k for k, b in enumerate(BLOCKS) if MARKERS[name] in b]
    assert len(found) == 1, f"docs/{PAGE}: expected one python block with {MARKERS[name]!r}, found {len(found)}"
    return found[0]


def shown(name: str) -> str:
    """The ```text block the page shows as what block ``name`` prints: the first one after it."""
    code = BLOCKS[index(name)]
    rest = TEXT[TEXT.index(code) + len(code):]
    m = re.search(r"```text\n(.*?)```", rest, re.S)
    assert m and "```python" not in rest[: m.start()], f"docs/{PAGE}: no output shown after the {name} block"
    assert "prints" in rest[: m.start()], f"docs/{PAGE}: the text after the {name} block does not say it prints"
    return m.group(1)


def run(name: str, tmp_path: pathlib.Path, method: str | None = None, timeout: float = 240) -> str:
    """Run block ``name`` as written (under ``method`` if given: see run_script); return what it printed."""
    before = shm_objects()
    out = run_doc_block(PAGE, index(name), tmp_path, timeout=timeout, start_method=method)
    deadline = time.monotonic() + 30  # an object whose owner died may be another test's, for a moment (run in parallel)
    while leaked_since(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = leaked_since(before)  # the suite's end check removes them
    assert not leaked, f"the {name} block ({method}) left in /dev/shm: {[f.name for f in leaked]}"
    return out


def test_every_block_is_tested_here():
    names = [next((n for n, m in MARKERS.items() if m in b), None) for b in BLOCKS]
    assert sorted(map(str, names)) == sorted(MARKERS), f"blocks of docs/{PAGE} and the tests here differ: {names}"


def test_blocks_that_start_processes_leave_the_start_method_to_the_caller():
    for name, code in ((n, BLOCKS[index(n)]) for n in STARTS_PROCESSES):
        assert 'if __name__ == "__main__":' in code, f"the {name} block starts processes without the __main__ guard"
        assert "get_context" not in code and "set_start_method" not in code, (
            f"the {name} block picks its own start method: the tests could not run it under each")
    # the same trainer: the same sizes, the same learning step and policy
    before, after = BLOCKS[index("before")], BLOCKS[index("after")]
    for pattern in (r"^T, ACTORS, B, UPDATES = [^\n]*$", r"^def reinforce_step\(.*?\n\n\n", r"^def make_policy\(.*?\n\n\n"):
        mb, ma = re.search(pattern, before, re.M | re.S), re.search(pattern, after, re.M | re.S)
        assert mb and ma and mb.group(0) == ma.group(0), f"before and after differ at {pattern!r}"


def updates_in(code: str) -> int:
    return int(re.search(r"^T, ACTORS, B, UPDATES = \d+, \d+, \d+, (\d+)\b", code, re.M).group(1))


@pytest.mark.parametrize("name", STARTS_PROCESSES)
def test_trainer_runs_and_learns_under_each_start_method(name, tmp_path):
    printed = under_each_start_method(lambda method, d: run(name, d, method), tmp_path)
    for method, out in printed.items():
        check_trainer(name, method, out)


def check_trainer(name: str, method: str, out: str) -> None:
    lines = out.splitlines()
    updates = updates_in(BLOCKS[index(name)])
    m = TRAINER_LINE.match(lines[0])
    assert m, f"the {name} block ({method}) printed {lines!r}"
    first, last = float(m.group(2)), float(m.group(3))
    assert int(m.group(1)) == updates
    # A random policy's CartPole return averages about 22; after 20 REINFORCE updates the runs measured 55-72.
    assert 12 <= first <= 45, f"first 5 updates' mean return {first}: not a policy that has just started"
    assert last >= 1.5 * first, f"{name} ({method}) did not learn: mean return {first} -> {last}"
    if name == "after":
        b = BATCHES_LINE.match(lines[1])
        assert b and int(b.group(1)) + int(b.group(2)) == updates, (method, lines)
        assert len(lines) == 2
    else:
        assert len(lines) == 1
    # what the page shows has the form the blocks print
    page = shown("after").splitlines()
    assert TRAINER_LINE.match(page[0]) and int(TRAINER_LINE.match(page[0]).group(1)) == updates
    assert BATCHES_LINE.match(page[1]) and sum(map(int, BATCHES_LINE.match(page[1]).groups())) == updates


def test_fill_block_counts_the_episodes_cartpole_ends(tmp_path):
    out = run("fill", tmp_path)
    assert out == shown("fill")
    # the same 64 steps in a plain gymnasium loop: the episodes that end, and the one still running
    env = gym.make("CartPole-v1")
    env.action_space.seed(0)
    env.reset(seed=0)
    lengths, n = [], 0
    for _ in range(64):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        n += 1
        if terminated or truncated:
            lengths.append(n)
            env.reset()
            n = 0
    want = (f"64 steps, {len(lengths)} episodes ended: {[float(x) for x in lengths]}\n"
            f"lengths: {lengths} and {n} steps of one still running\n")
    assert out == want


def test_scalars_block(tmp_path):
    out = run("scalars", tmp_path)
    assert out == shown("scalars")
    lines = out.splitlines()
    assert lines[0].startswith("SchemaError: at step/reward:") and lines[1].startswith("SchemaError: leaf step/action:")
    assert lines[2] == "{'action': [1, 0], 'reward': [1.0, 0.5]}"  # the refused add wrote nothing


def test_lanes_block(tmp_path):
    out = run("lanes", tmp_path)
    assert out == shown("lanes")


def test_semaphores_block_counts_max_writers_plus_one(tmp_path):
    out = run("semaphores", tmp_path)
    assert out == shown("semaphores")
    listed = re.search(r"^in /dev/shm: (\[.*\])$", out, re.M).group(1)
    n = int(re.search(r"max_writers=(\d+)", BLOCKS[index("semaphores")]).group(1))
    assert ast.literal_eval(listed) == ["NAME", *[f"sem.NAME-f{i}" for i in range(n)], "sem.NAME-r"]


def test_torch_block_trains_on_what_is_in_the_slot(tmp_path):
    torch = pytest.importorskip("torch", reason="the block is about torch (pip install torch==2.13.0)")
    out = run("torch", tmp_path)
    assert out == shown("torch")
    torch.manual_seed(0)  # the block's model, on the one step it wrote (ones), not the slot's 4 rows
    want = torch.nn.Linear(3, 1)(torch.ones(1, 3)).pow(2).mean().item()
    assert f"loss {want:.4f}," in out
