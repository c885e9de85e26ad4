"""Every python block of docs/inference.md runs as written."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import doc_blocks, run_doc_block

BLOCKS = doc_blocks("inference.md")


def test_the_page_has_its_blocks() -> None:
    assert len(BLOCKS) == 2


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_docs_block_runs(k: int, tmp_path: pathlib.Path) -> None:
    run_doc_block("inference.md", k, tmp_path)
