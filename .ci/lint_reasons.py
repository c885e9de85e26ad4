"""Every lint exception carries its reason: a `# noqa` or `# type: ignore` with no words after it on its line fails.

`make lint` runs it over the same paths as ruff. The forms that pass:

    x = f()  # noqa: BLE001 - what the call raised is that node's failure
    import torch  # noqa: E402  (after the importorskip above)
    self._w = None  # type: ignore[assignment]  # closed: every later use checks _closed first

Ruff (PGH004, RUF100) and mypy (ignore-without-code, warn_unused_ignores) see to it that each names a rule that still
fires; this sees to the why.
"""

from __future__ import annotations

import pathlib
import re
import sys

DIRECTIVE = re.compile(r"#\s*(noqa(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(?:\[[^\]]*\])?)(.*)$")
REASON = re.compile(r"[A-Za-z]{2,}")


def bare(path: pathlib.Path) -> list[str]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = DIRECTIVE.search(line)
        if match and not REASON.search(match.group(2)):
            out.append(f"{path}:{number}: {match.group(1)} without a reason: {line.strip()}")
    return out


def main(roots: list[str]) -> int:
    files = [p for root in map(pathlib.Path, roots) for p in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    missing = [r for r in roots if not pathlib.Path(r).exists()]
    if missing:
        print(f"lint_reasons: no such file or directory: {missing}")
        return 2
    found = [b for p in files for b in bare(p)]
    for b in found:
        print(b)
    if found:
        print(f"lint_reasons: {len(found)} lint exceptions without a reason (say why after the directive, on its line)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
