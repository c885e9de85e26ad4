"""docs/reliability.md cites a test for every guarantee: each test it names must exist, or the row guards nothing."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent

# `test_x.py::test_name`, or `…::test_name` for another test of the file named last on the same line.
CITED = re.compile(r"`(?:(?:tests/)?(test_\w+\.py)::|…::)(test_\w+)")


def cited_tests() -> list[tuple[int, str, str]]:
    out = []
    for n, line in enumerate((ROOT / "docs" / "reliability.md").read_text().splitlines(), 1):
        last = None
        for m in CITED.finditer(line):
            last = m.group(1) or last
            assert last, f"docs/reliability.md:{n}: '…::{m.group(2)}' follows no test file on its line"
            out.append((n, last, m.group(2)))
    return out


def test_every_test_the_reliability_page_cites_exists() -> None:
    cited = cited_tests()
    assert len(cited) > 60  # the page's tables, not a regex that matched nothing
    missing = []
    for n, file, name in cited:
        path = ROOT / "tests" / file
        # A cited name may be a test's full name or the start of a parametrised family's (test_soak_200_kills...).
        if not path.exists() or not re.search(rf"^(async )?def {re.escape(name)}", path.read_text(), re.M):
            missing.append(f"line {n}: {file}::{name}")
    assert not missing, "docs/reliability.md cites tests that do not exist:\n" + "\n".join(missing)
