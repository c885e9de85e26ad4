"""Every code block of the README runs as written, and what its prose promises holds.

The README leaves a few names to the reader (``start_actors``, ``train``, ``env``, ``policy``) and
says so in its comments; the tests here supply them, as stand-ins or as real gymnasium envs.
Python blocks run in this process (threads) or as scripts in child processes; the command-line
blocks run as subprocesses. Every wait has a deadline.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmbuf
from tests.conftest import small_example
from tests.helpers import START_METHODS, EpisodicEnv, run_script, start_methods, under_each_start_method

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
DEADLINE = 120.0  # seconds, for any one child process (they take a few: importing gymnasium, torch)

# Which test runs each ```python block: a block is known by a line only it has.
PYTHON_BLOCKS = {
    "shmbuf.create(": "test_readme_learner_and_actor_blocks_run, test_readme_learner_block_runs_with_actor_processes",
    "def actor(handle):": "test_readme_learner_and_actor_blocks_run, test_readme_learner_block_runs_with_actor_processes, "
                          "test_readme_actors_exit_cleanly_when_the_learner_closes",
    "from workers import Collector": "test_readme_collector_script_runs",
}
# The README's shell lines that run the command line, and why a test may leave one out.
CLI_RUN = {"demo --help", "ls", "clean --dry-run", "bench --help", "convert --help"}
CLI_NOT_RUN = {
    "clean": "would remove what other test runs on this machine left, under their feet; test_cli covers it",
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def python_block(marker: str) -> str:
    (block,) = [b for b in blocks("python") if marker in b]
    return block


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_every_python_block_is_run_by_a_test() -> None:
    for block in blocks("python"):
        known = [m for m in PYTHON_BLOCKS if m in block]
        assert len(known) == 1, f"a README python block that no test runs (add it to PYTHON_BLOCKS):\n{block}"
    assert len(blocks("python")) == len(PYTHON_BLOCKS)


# -- the first screen: learner and actor ------------------------------------


def test_readme_learner_and_actor_blocks_run() -> None:
    """The learner block with the actor block in a thread, over an env whose episodes end."""
    learner, actor = python_block("shmbuf.create("), python_block("def actor(handle):")
    trained: list[np.ndarray] = []
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []

    def run_actor(handle: Any) -> None:
        try:
            ns["actor"](handle)
        except shmbuf.PipelineClosed:
            pass  # the quiet end is test_readme_actors_exit_cleanly_when_the_learner_closes's to check
        except BaseException as exc:  # noqa: BLE001  # whatever the actor raises: reported below
            errors.append(exc)

    def start_actors(handle: Any) -> None:
        t = threading.Thread(target=run_actor, args=(handle,), daemon=True)
        t.start()
        threads.append(t)

    ns: dict[str, Any] = {"env": EpisodicEnv(), "policy": lambda obs: 0, "train": lambda obs: trained.append(obs.copy()),
                          "start_actors": start_actors, "__name__": "__main__"}  # run as the script, past its guard
    exec(actor, ns)  # noqa: S102  # the README's own block, run as written: defines actor(handle)
    exec(learner, ns)  # noqa: S102  # the README's block: creates the pipeline, trains on 64 batches of 16 rollouts, closes
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert not errors, errors
    assert len(trained) == 64 * 16
    # One episode per rollout, cut at T = 64; each stored obs is the one the action was taken on.
    assert {len(obs) for obs in trained} == {10, 30, 64}
    for obs in trained:
        assert (obs[:, 0] == np.arange(len(obs))).all()
    assert ns["batch"].released  # closing the reader released the last batch
    batches = ns["reader"].stats()["batches"]  # zero-copy, as the README says (a gather only where patience ran out)
    assert batches["views"] + batches["gathered"] == 64 and batches["views"] >= 48, batches


# The learner and actor blocks as one script, the way the README's user writes them: the names the README leaves to
# the reader come first, then the actor block and the learner block. start_actors starts processes with
# multiprocessing's default start method, which run_script sets; under spawn and forkserver each actor process
# imports this script, so only the learner block's guard keeps it from running the learner again.
LEARNER_SCRIPT = '''\
import json
import multiprocessing as mp
import time

import numpy as np

from tests.helpers import EpisodicEnv

env, policy = EpisodicEnv(), lambda obs: 0
actors, lengths, in_order = [], [], []


def train(obs):
    obs = obs.copy()  # a view of the slot: kept past the next get_batch, it would show a later rollout
    if not lengths:  # let both actors attach before the learner can finish (a late one would find no pipeline)
        deadline = time.monotonic() + 60
        while reader.stats()["writers"] < 2:
            assert time.monotonic() < deadline, "the actor processes did not attach within 60 s"
            time.sleep(0.01)
    lengths.append(len(obs))
    in_order.append(bool((obs[:, 0] == np.arange(len(obs))).all()))


def start_actors(handle):
    for _ in range(2):
        actors.append(mp.Process(target=actor, args=(handle,)))
        actors[-1].start()


{actor}
{learner}
if __name__ == "__main__":
    for p in actors:
        p.join(30)
    print(json.dumps({{"rollouts": len(lengths), "lengths": sorted(set(lengths)), "in_order": all(in_order),
                      "released": batch.released, "exitcodes": [p.exitcode for p in actors]}}))
'''


@pytest.mark.parametrize("method", START_METHODS)
def test_readme_learner_block_runs_with_actor_processes(method: str, tmp_path: pathlib.Path) -> None:
    """The learner block starts two actor processes by each start method; under spawn and forkserver they import
    the script, and its guard keeps them to the actor. They end with exit code 0 when the learner closes."""
    script = tmp_path / "learner.py"
    script.write_text(LEARNER_SCRIPT.format(actor=python_block("def actor(handle):"), learner=python_block("shmbuf.create(")))
    printed = run_script(script, tmp_path, start_method=method, timeout=DEADLINE).stdout.splitlines()
    # The block's own line: its batch counts, as the README's comment shows them. Zero-copy batches are the point of
    # the example; a gather is allowed only where a run did not complete within the reader's patience (a loaded machine).
    counts = ast.literal_eval(printed[-2])
    assert counts["views"] + counts["gathered"] == 64 and counts["views"] >= 48, counts
    out = json.loads(printed[-1])
    # 64 batches of 16 rollouts of one episode each, cut at T = 64, each stored obs the one its action was taken on;
    # the last batch released when the reader closed; and both actors ended quietly (PipelineClosed in their
    # `with Writer` block) with exit code 0 (run_script checks that no process of the run is left).
    assert out == {"rollouts": 1024, "lengths": [10, 30, 64], "in_order": True, "released": True,
                   "exitcodes": [0, 0]}, out


ACTOR_SCRIPT = '''\
import sys

import gymnasium as gym
import numpy as np
import shmbuf

T = 64
env = gym.make("CartPole-v1")


def policy(obs):
    return int(obs[2] > 0)  # push toward where the pole leans


{actor}

actor(sys.argv[1])
'''


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    """Child processes, killed and reaped at teardown even when the test fails."""
    made: list[subprocess.Popen] = []
    yield made
    for p in made:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def test_readme_actors_exit_cleanly_when_the_learner_closes(tmp_path: pathlib.Path, children: list[Any]) -> None:
    """The actor block in processes of their own over CartPole: no gymnasium warning, and when the
    learner block closes the pipeline they end with exit code 0 and no traceback."""
    pytest.importorskip("gymnasium")
    script = tmp_path / "actor.py"
    script.write_text(ACTOR_SCRIPT.format(actor=python_block("def actor(handle):")))
    trained: list[np.ndarray] = []

    def start_actors(handle: shmbuf.Handle) -> None:
        for _ in range(2):
            children.append(subprocess.Popen([sys.executable, "-W", "error", str(script), handle.name],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    ns: dict[str, Any] = {"start_actors": start_actors, "train": lambda obs: trained.append(obs.copy()),
                          "__name__": "__main__"}
    exec(python_block("shmbuf.create("), ns)  # noqa: S102  # the README's learner block, run as written
    assert len(trained) == 64 * 16
    assert all(1 <= len(obs) <= 64 for obs in trained) and any(len(obs) < 64 for obs in trained)  # episodes ended
    assert all((np.abs(obs[0]) <= 0.05).all() for obs in trained)  # each rollout starts at a reset observation
    for p in children:
        _, err = p.communicate(timeout=DEADLINE)
        assert p.returncode == 0 and "Traceback" not in err, f"actor exit code {p.returncode}; stderr:\n{err}"


def test_readme_single_item_timescale_rule(make_reader: Any) -> None:
    """What the README says of `episode`: capacity 1, one add writes the whole leaf, a second add
    raises TimescaleFull (an IndexError) until commit() or reset() clears it."""
    ns: dict[str, Any] = {}
    exec(python_block("shmbuf.create(").split("if __name__")[0], ns)  # noqa: S102  # the README's block: T and the example
    assert "one `add` writes the whole leaf" in README and "raises\n`TimescaleFull`" in README
    reader = make_reader(ns["example"], slots=2)
    with shmbuf.Writer(reader.handle, timeout=10) as writer:
        reader.poll()  # the reader lends its slots
        writer.add("episode", {"return": 1.0})
        with pytest.raises(shmbuf.TimescaleFull) as full:
            writer.add("episode", {"return": 2.0})
        assert isinstance(full.value, IndexError)
        writer.reset()
        writer.add("episode", {"return": 3.0})
        writer.commit()
        with reader.get(timeout=10) as rollout:
            assert rollout.data["episode"]["return"] == 3.0 and rollout.fill["episode"] == 1
        reader.poll()  # lends the released slot again
        writer.add("episode", {"return": 4.0})  # after commit(): a fresh slot, empty again
        writer.reset()


# -- workers ------------------------------------------------------------------

COLLECTOR_PRELUDE = '''\
import json

import numpy as np

batches = []


def train(w, data):  # the README leaves train to the reader: here it checks the batch and nudges the weights
    obs = data["step"]["obs"]
    assert obs.dtype == np.float32 and obs.shape[-1] == 4 and np.isfinite(obs).all()
    batches.append(int(np.prod(obs.shape[:-1])))
    return w + np.float32(0.01)

'''
COLLECTOR_EPILOGUE = '''

if __name__ == "__main__":
    print("FRAMES", json.dumps(batches))
'''


def test_readme_collector_script_runs(tmp_path: pathlib.Path) -> None:
    """The workers block as the whole script it says it is, with a `train` of ours in front, its actors started by
    each start method that changes what it does (tests.helpers.start_methods: workers starts them all, by forkserver
    whatever multiprocessing's default is, so one run). It takes tens of seconds on 2 cores, collecting the block's
    20,000 frames, mostly waiting."""
    pytest.importorskip("gymnasium")

    code = COLLECTOR_PRELUDE + python_block("from workers import Collector") + COLLECTOR_EPILOGUE

    def run(method: str, directory: pathlib.Path) -> subprocess.CompletedProcess:
        script = directory / "collect.py"
        script.write_text(code)
        return run_script(script, directory, start_method=method, timeout=2 * DEADLINE)

    for method, out in under_each_start_method(run, tmp_path, start_methods(code)).items():
        frames = json.loads(out.stdout.split("FRAMES", 1)[1])
        assert set(frames) == {1024} and sum(frames) >= 20_000, (method, frames)
        assert "collecting: 100%" in out.stderr, (method, out.stderr[-500:])  # progress=True: the bar, to the end


# -- prose --------------------------------------------------------------------


def test_readme_errors_section_matches_the_taxonomy() -> None:
    text = section("Errors")
    assert "Every error shmbuf raises on purpose is a `shmbuf.ShmbufError`" in text
    listed: set[str] = set()
    for names, bases in re.findall(r"^- (.*?) \(([\w ]+?)\):", text, re.M):
        for name in re.findall(r"`(\w+)`", names):
            cls = getattr(shmbuf, name)
            assert issubclass(cls, shmbuf.ShmbufError), name
            for base in re.findall(r"[A-Z]\w+", bases):
                assert issubclass(cls, getattr(builtins, base)), (name, base)
            listed.add(name)
    exported = {n for n in shmbuf.__all__ if isinstance(getattr(shmbuf, n), type)
                and issubclass(getattr(shmbuf, n), shmbuf.ShmbufError) and n != "ShmbufError"}
    assert listed == exported


def test_readme_says_where_make_puts_the_command_line() -> None:
    """`make` installs into .venv/, not on the PATH: the first screen says to type .venv/bin/shmbuf, and that is true."""
    first_screen = README.split("\n## ", 1)[0]
    assert "`.venv/bin/shmbuf ls`" in first_screen and "not on your PATH" in first_screen
    assert re.search(r"^VENV := \.venv$", (ROOT / "Makefile").read_text(), re.M)
    assert 'shmbuf = "shmbuf._cli:main"' in (ROOT / "pyproject.toml").read_text()
    assert (pathlib.Path(sys.prefix) / "bin" / "shmbuf").exists()  # what pip made in the env the tests run in


def _cli_lines() -> list[str]:
    """The arguments of every README shell line that runs the command line (`shmbuf ...` or `.venv/bin/shmbuf ...`)."""
    out = []
    for block in blocks("bash") + blocks("text"):
        for line in block.splitlines():
            m = re.match(r"^(?:\.venv/bin/)?shmbuf\s+([^#]*)", line.strip())
            if m:
                out.append(" ".join(m.group(1).split()))
    return out


# What ls and clean --dry-run must say of a pipeline this test holds open (other runs' objects may be listed too).
CLI_SAYS_OF_OURS = {
    "ls": "{name}  open, owner pid {pid} alive",
    "clean --dry-run": "kept {name}: owner pid {pid} is alive",
}


@pytest.mark.parametrize("args", sorted(CLI_RUN))
def test_readme_command_line_runs(args: str, make_reader: Any) -> None:
    assert args in _cli_lines(), f"the README no longer shows `shmbuf {args}`"
    ours = None if args.endswith("--help") else make_reader(small_example(), slots=3)
    exe = pathlib.Path(sys.prefix) / "bin" / "shmbuf"
    out = subprocess.run([str(exe), *args.split()], capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stderr
    if ours is None:
        assert out.stdout.startswith(f"usage: shmbuf {args.split()[0]} ")
    else:  # it finds the live pipeline, and says it is alive (so clean keeps it)
        assert CLI_SAYS_OF_OURS[args].format(name=ours.name, pid=os.getpid()) in out.stdout, out.stdout
        assert not out.stderr
    assert set(CLI_SAYS_OF_OURS) | {a for a in CLI_RUN if a.endswith("--help")} == CLI_RUN


def test_readme_shows_no_command_line_that_no_test_runs() -> None:
    lines = _cli_lines()
    assert CLI_RUN <= set(lines)
    for args in lines:
        assert args in CLI_RUN or args in CLI_NOT_RUN, f"README shows `shmbuf {args}`: run it in test_readme_command_line_runs"


# -- what a newcomer installs first ---------------------------------------------


def _imports(block: str) -> set[str]:
    """The top-level packages a block imports."""
    out = set()
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_readme_first_workers_script_needs_only_the_demo_extra() -> None:
    """The first workers script runs after `pip install -e ".[demo]"` (what `make demo` installs): it imports the
    core, workers and the demo extra's packages, nothing of another extra (torch is the `examples` extra's)."""
    block = python_block("from workers import Collector")
    pyproject = (ROOT / "pyproject.toml").read_text()
    demo = re.search(r"^demo = \[(.*)\]$", pyproject, re.M)
    assert demo, "pyproject.toml has no demo extra"
    demo_packages = {re.split(r"[<>=!\[ ]", d.strip('" '))[0] for d in demo.group(1).split(",")}
    assert _imports(block) <= {"numpy", "shmbuf", "workers"} | demo_packages, (_imports(block), demo_packages)
    assert 'pip install -e ".[demo]"' in README


def test_readme_first_screen_is_install_learner_actor_then_the_two_commands() -> None:
    """STYLE.md's first screen: what it is in two lines, install, a learner and an actor block, then `make demo` and
    `make test`, with no more than a line or two of prose between one and the next."""
    top = README.split("\n## ", 1)[0]
    parts = re.split(r"^```\w*\n.*?^```\n", top, flags=re.S | re.M)
    fenced = re.findall(r"^```(\w*)\n(.*?)^```\n", top, flags=re.S | re.M)
    kinds = [lang for lang, _ in fenced[:4]]
    assert kinds == ["bash", "python", "python", "bash"], kinds
    assert "pip install -e ." in fenced[0][1]
    assert "shmbuf.create(" in fenced[1][1] and "def actor(handle):" in fenced[2][1]
    assert [line.split()[:2] for line in fenced[3][1].splitlines()] == [["make", "demo"], ["make", "test"]]
    prose = [[line for line in part.splitlines() if line.strip()] for part in parts[:4]]
    assert prose[0][0] == "# shmbuf" and len(prose[0]) == 3, prose[0]  # the title, then two lines
    for between in prose[1:]:
        assert len(between) <= 3, between
