"""Every python block of the README and docs/ runs in some test: a page with blocks that no test runs fails here.

The pages' own tests run their blocks and check what they print (tests/test_*_docs.py and the like); this one only
makes sure no page is left out, so that a new page cannot ship a block nobody runs.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNS = ("run_doc_block", "doc_blocks(", "python_block(")


def pages_with_blocks() -> list[pathlib.Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if re.search(r"^```python$", p.read_text(), re.M)]


def test_every_page_with_python_blocks_has_a_test_that_runs_them() -> None:
    tests = {p: p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != pathlib.Path(__file__).name}
    unrun = []
    for page in pages_with_blocks():
        name = page.name
        if not any(name in text and any(r in text for r in RUNS) for text in tests.values()):
            unrun.append(str(page.relative_to(ROOT)))
    assert not unrun, f"pages whose python blocks no test runs: {unrun}"


def test_the_check_sees_the_pages_it_should() -> None:
    found = {p.name for p in pages_with_blocks()}
    assert {"README.md", "inference.md", "multiagent.md"} <= found, found
