"""What a user reads names the systems shmbuf learns from by their names, and nothing a user cannot open.

The project was built against numbered reference documents and numbered issues; neither is part of the repository,
so a three-digit document number standing for a system, an issue number standing for an aim, or a path into the
folder those documents live in means nothing to a user. They read: InstaDeep echo, TorchRL, rsl_rl and its
legged-robot forks, RLlib, embodichain; the aim or the figure itself; files of this repository. (The patterns,
with examples of what they catch and what they spare, are below.)

Scanned: README.md, CHANGELOG.md, the Makefile, every page under docs/, benchmarks/README.md, the results pages
those pages name (the current ones), the strings and comments of every module of shmbuf/, workers/, benchmarks/
and examples/ (docstrings, error messages, printed and written text), and the module docstring of each test file
a page cites (a reader following the citation reads it first), this one included.
"""

from __future__ import annotations

import ast
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent

# An issue number: "issue 21", "Issue 18 item 3", "issues 21 and 22", "issue #21".
ISSUE = re.compile(r"\bissues?\s*#?\d+", re.I)
# A reference document's number used as a system's name: "002", "002's", "002 / rsl_rl", "(004)", "003-style", and
# "002s" (an apostrophe dropped, as in a heading's anchor "#names-002s-rollout_files").
# Allowed: the digits inside a longer number or word, i.e. preceded by a letter, digit, "_", "." or "," (0000, 2002,
# 0x002, v003, 10,000, 1,001, 0.001) or by "<digit> " (a thousands space: 240 000), or followed by a letter, digit,
# "_" or by "." / "," and a digit (004_x, 002.5, 003,5). Dates (2026-11-21) and versions (0.2.1) have no 00x run.
REF_NUMBER = re.compile(r"(?<![\w.,])(?<!\d )00[0-4](?:s\b)?(?!\w|[.,]\d)")
# A reference document's file name (000_4f8b6edf590d0ed1.txt, or 004_* as a glob).
REF_FILE = re.compile(r"\b00[0-4]_(?:\*|[0-9a-f]{16})")
# A path outside the repository.
OUTSIDE = re.compile(r"shared/reference|\.\./shared\b|/work/shared\b")
PATTERNS = {"an issue number": ISSUE, "a reference number as a name": REF_NUMBER, "a reference file": REF_FILE,
            "a path outside the repository": OUTSIDE}

PAGES = ("README.md", "CHANGELOG.md", "Makefile", "benchmarks/README.md")
PACKAGES = ("shmbuf", "workers", "benchmarks", "examples")


def pages() -> list[pathlib.Path]:
    return [ROOT / p for p in PAGES] + sorted((ROOT / "docs").rglob("*.md"))


def cited(pattern: str) -> set[pathlib.Path]:
    """Files of the repository that a page names by a path matching ``pattern`` (a link or a mention); a name that
    ends in ``.{json,md,png}`` or ``.*`` names its ``.md``."""
    out = set()
    for page in pages():
        for m in re.finditer(pattern, page.read_text()):
            name = re.sub(r"\.(\{[\w,]*\}|\*)$", ".md", m.group(0))
            for base in (ROOT, page.parent):
                path = (base / name).resolve()
                if path.is_file() and ROOT in path.parents:
                    out.add(path)
    return out


def current_results_pages() -> list[pathlib.Path]:
    return sorted(cited(r"(?:[\w./-]*/)?results/[\w.-]+?\.(?:md|\{[\w,]*\}|\*)"))


def cited_tests() -> list[pathlib.Path]:
    return sorted(cited(r"tests/test_\w+\.py"))


def python_text(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every string (docstrings, messages, f-string parts) and comment of a module."""
    out = []
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
                out.append((tok.start[0], tok.string))
    return out


def module_docstring(path: pathlib.Path) -> list[tuple[int, str]]:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return [(1, doc)] if doc else []


def texts() -> list[tuple[pathlib.Path, list[tuple[int, str]]]]:
    """Every text the module's docstring lists, as ``(file, [(line, text), ...])``."""
    out = [(p, list(enumerate(p.read_text().splitlines(), 1))) for p in pages() + current_results_pages()]
    for package in PACKAGES:
        out += [(p, python_text(p)) for p in sorted((ROOT / package).rglob("*.py"))]
    out += [(p, module_docstring(p)) for p in cited_tests()]
    return out


def findings(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r} in {text.strip()[:160]!r}"
            for what, pattern in PATTERNS.items() for m in pattern.finditer(text)]


def test_user_text_names_systems_aims_and_files_a_user_can_find() -> None:
    found = []
    for path, lines in texts():
        for line, text in lines:
            found += [f"{path.relative_to(ROOT)}:{line}: {f}" for f in findings(text)]
    assert not found, f"{len(found)} places name what a user cannot look up:\n" + "\n".join(found[:80])


def test_the_scan_covers_what_it_says() -> None:
    """The scan reads the pages, the linked results pages, the packages' strings and comments and the cited tests."""
    scanned = {p.relative_to(ROOT).as_posix() for p, _ in texts()}
    assert {"README.md", "CHANGELOG.md", "Makefile", "docs/from-rsl_rl.md", "docs/design/actor.md",
            "benchmarks/README.md", "shmbuf/storage/_pickled.py", "workers/_inference.py", "benchmarks/actor_loop.py",
            "benchmarks/results/2026-11-21-vm.md", "tests/test_from_rsl_rl.py"} <= scanned, scanned
    strings = " ".join(t for _, t in python_text(ROOT / "benchmarks" / "actor_loop.py"))
    assert "ActorLoop" in strings  # the printed text is read, not only the code


def test_the_patterns_catch_the_names_and_spare_ordinary_numbers() -> None:
    caught = ["002's fork", "as 002 does", "(004)", "002 / rsl_rl", "002-style", "a 003 view", "000 = echo",
              "Issue 21 aimed at 1.7x", "(issue 23)", "issues 21 and 22", "issue #8",
              "shared/reference/004_*", "../shared/DESIGN.md", "see 000_4f8b6edf590d0ed1.txt",
              "files.md#names-002s-rollout_files"]
    spared = ["port 0000", "0x002", "0.001 s", "10,000 steps", "1,001 (8/call)", "240 000 env steps", "2026-11-21",
              "version 0.2.1", "v003", "LOCAL_SLICE = 0.002", "issue's", "an issue with it", "ray-project/ray#43434",
              "1e-3", "2002", "the 0004th", "0002s", "test_002s_constructor"]
    assert [t for t in caught if not findings(t)] == []
    assert {t: findings(t) for t in spared if findings(t)} == {}
