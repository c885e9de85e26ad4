"""Every python block of docs/storage.md runs as written, as a script in a fresh interpreter (some start processes)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "storage.md").read_text(), re.S)


def test_the_page_has_its_three_examples() -> None:
    assert len(BLOCKS) == 3, "docs/storage.md: one example per part (rollout storage, rollout buffer, replay)"


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_block_runs(k: int, tmp_path: pathlib.Path) -> None:
    script = tmp_path / f"storage_doc_{k}.py"
    script.write_text(BLOCKS[k])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=180,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, f"block {k} of docs/storage.md failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
