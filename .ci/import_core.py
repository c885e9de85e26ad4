"""Imports every public module of the installed packages, each in a fresh interpreter, with the core alone installed.

`make test-core` runs it in .venv-core, which has `pip install -e .` and the test runner but none of the extras. Each
public module (no component of its name starts with "_") is imported and every name of its ``__all__`` is looked up
(a package may import a name lazily), and then the distributions the import brought in are compared with the core's
dependencies: a module that imports an optional package at import time fails here with the package's name, even if
that package happens to be installed. `python -m shmbuf --help` is run too: the CLI is part of the core.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata as md
import json
import pkgutil
import re
import subprocess
import sys

PACKAGES = ("shmbuf", "workers")  # the top-level packages; their public sub-modules are found by walking them
TIMEOUT = 120.0

# Runs in the child: the distributions are judged by what the import added to sys.modules, not by what the
# interpreter had at start-up (site's .pth files import modules of their own).
CHILD = """
import json, sys
before = set(sys.modules)
import importlib
m = importlib.import_module({name!r})
for attr in getattr(m, "__all__", ()):
    getattr(m, attr)
print(json.dumps(sorted({{k.partition(".")[0] for k in set(sys.modules) - before}})))
"""


def public_modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        mod = __import__(pkg)
        out.append(pkg)
        for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                out.append(info.name)
    return sorted(out)


def _requirement_name(req: str) -> str | None:
    """The distribution a requirement names, or None if an extra's marker guards it."""
    spec, _, marker = req.partition(";")
    if "extra" in marker:
        return None
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return _norm(match.group(1)) if match else None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_distributions() -> set[str]:
    """shmbuf and its dependencies without extras, transitively (environment markers other than extras count as met)."""
    seen: set[str] = set()
    todo = ["shmbuf"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo.extend(n for n in map(_requirement_name, reqs) if n)
    return seen


def _import_in_child(name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD.format(name=name)], capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def main() -> int:
    allowed = core_distributions()
    dists_of = {mod: {_norm(d) for d in ds} for mod, ds in md.packages_distributions().items()}
    stdlib = sys.stdlib_module_names
    failures = []
    modules = public_modules()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the children's start-up is most of the time
        runs = list(pool.map(_import_in_child, modules))
    for name, run in zip(modules, runs):
        if run.returncode != 0:
            failures.append(f"import {name} failed:\n{run.stderr.strip()}")
            continue
        extra = []
        for top in json.loads(run.stdout.strip().splitlines()[-1]):
            if top in stdlib or top in PACKAGES:
                continue
            dists = dists_of.get(top)
            # A module of no installed distribution is the runtime's own (numpy's cython_runtime, __mp_main__).
            if dists and not dists & allowed:
                extra.append(f"{top} (from {', '.join(sorted(dists))})")
        if extra:
            failures.append(f"import {name} imported what the core does not depend on: {', '.join(extra)}")
    cli = subprocess.run([sys.executable, "-m", "shmbuf", "--help"], capture_output=True, text=True, timeout=TIMEOUT,
                         stdin=subprocess.DEVNULL)
    if cli.returncode != 0:
        failures.append(f"python -m shmbuf --help failed:\n{cli.stderr.strip()}")
    for f in failures:
        print(f"import_core: {f}", file=sys.stderr)
    print(f"import_core: {len(modules)} public modules and the CLI, core dependencies {sorted(allowed - {'shmbuf'})}: "
          + ("FAILED" if failures else "all import"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
