"""Every python block of docs/storage.md runs as written, as a script in a fresh interpreter (some start processes)."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import START_METHODS, doc_blocks, run_doc_block

BLOCKS = doc_blocks("storage.md")


def test_the_page_has_its_three_examples() -> None:
    assert len(BLOCKS) == 3, "docs/storage.md: one example per part (rollout storage, rollout buffer, replay)"


# What each block prints: the figures follow from the data it writes (block 1 prints nothing: its asserts are its check).
PRINTS = {
    # 4 envs x 8 steps, one termination (env 1 at step 5); as rsl_rl counts, each env's last step closes a piece:
    # 8 | 6 + 2 | 8 | 8 = 32 steps in 5 pieces, 6.40 each; every reward is 1.0
    0: "mean episode length 6.40, mean reward 1.00\n",
    1: "",
    2: "640 640\n",  # 2 actors x 10 inserts x 32 rows, in a buffer of 1000
}


STARTS_PROCESSES = {2}  # the replay block's two actors; the others run in one process


@pytest.mark.parametrize("k", sorted(set(range(len(BLOCKS))) - STARTS_PROCESSES))
def test_block_runs_and_prints_what_it_should(k: int, tmp_path: pathlib.Path) -> None:
    assert run_doc_block("storage.md", k, tmp_path) == PRINTS[k]


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("k", sorted(STARTS_PROCESSES))
def test_block_that_starts_processes_runs_under_each_start_method(k: int, method: str, tmp_path: pathlib.Path) -> None:
    """Its actors are started with multiprocessing's default method, set here; under spawn and forkserver they import
    the block, whose guard keeps them from running the learner's part."""
    assert "mp.Process(" in BLOCKS[k] and 'if __name__ == "__main__":' in BLOCKS[k]
    assert run_doc_block("storage.md", k, tmp_path, start_method=method) == PRINTS[k]


def test_only_the_blocks_said_to_start_processes_do() -> None:
    """A block that starts processes is run under every start method: it must be in STARTS_PROCESSES."""
    for k, block in enumerate(BLOCKS):
        assert (k in STARTS_PROCESSES) == any(s in block for s in ("Process(", "Pool(", "Collector(")), k
