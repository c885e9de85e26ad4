"""Every python block of docs/storage.md runs as written, as a script in a fresh interpreter (some start processes)."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import doc_blocks, run_doc_block

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


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_block_runs_and_prints_what_it_should(k: int, tmp_path: pathlib.Path) -> None:
    assert run_doc_block("storage.md", k, tmp_path) == PRINTS[k]
