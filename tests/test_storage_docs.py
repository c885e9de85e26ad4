"""Every python block of docs/storage.md runs as written, as a script in a fresh interpreter (some start processes)."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import doc_blocks, run_doc_block

BLOCKS = doc_blocks("storage.md")


def test_the_page_has_its_three_examples() -> None:
    assert len(BLOCKS) == 3, "docs/storage.md: one example per part (rollout storage, rollout buffer, replay)"


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_block_runs(k: int, tmp_path: pathlib.Path) -> None:
    run_doc_block("storage.md", k, tmp_path)
