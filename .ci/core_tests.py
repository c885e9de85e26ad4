"""The core job: the tests that need no extra, run with the core alone installed.

`make test-core` runs ``python .ci/core_tests.py [pytest args]`` in .venv-core (`pip install -e ".[core-test]"`: the
library's four dependencies and the test runner, none of the extras), so that a module that imports an optional
package where the core needs it fails there.

Which tests need an extra is read from their code, not kept by hand, so the selection cannot shrink silently:
- a test file that imports an optional module at its top (itself, or through a tests.* module it imports) is out;
- in the other files, a test is out if it imports one (`pytest.importorskip("x")` counts) in its own body, or in a
  function, fixture or constant it uses (followed through names, calls and fixture arguments, across tests.* and
  benchmarks.* modules), or runs one: a Python program in a string (a script it writes, a -c argument) or an
  examples/ script it names ("x.py", or a string that is the name of one);
- EXTRA_TESTS names, with the reason, the few tests whose need the code does not show (a docs page's block, a lazy
  import inside the library); an entry whose test no longer exists fails the job;
- everything else runs, and a test skipped because a module could not be imported fails the job.
The tests left out still run in `make test`, which installs every extra. The run prints how many were left out.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# The importable module of each package of pyproject's optional-dependencies, and of rsl-rl-lib, which `make test`
# installs beside them. check_optional_modules() keeps it complete.
OPTIONAL = {
    "gymnasium": "gymnasium", "tqdm": "tqdm", "id-echo": "echo", "torch": "torch", "matplotlib": "matplotlib",
    "faster-fifo": "faster_fifo", "torchrl": "torchrl", "tensordict": "tensordict", "ray": "ray",
    "rsl-rl-lib": "rsl_rl", "psutil": "psutil",
    "pettingzoo": "pettingzoo", "mpe2": "mpe2",
    # real Atari (the atari extra, the Atari example's tests, the training benchmark) and EnvPool (its C++ peer)
    "ale-py": "ale_py", "opencv-python-headless": "cv2", "envpool": "envpool",
    # RLlib's own requirements, in the bench extra for the multi-agent benchmark's RLlib baseline
    "pandas": "pandas", "tensorboardx": "tensorboardX", "requests": "requests", "pyarrow": "pyarrow", "fsspec": "fsspec",
    "pydantic": "pydantic", "dm-tree": "tree", "lz4": "lz4", "ormsgpack": "ormsgpack", "pyyaml": "yaml", "scipy": "scipy",
}
# The test runner (in `test` and in `core-test`): needed by every test, not an optional part of the library.
# pytest-xdist runs `make test` in parallel (the `test` extra only; the core job runs in one process).
RUNNER = {"pytest", "hypothesis", "pytest-timeout", "pytest-xdist"}
TOOLING_EXTRAS = {"core-test", "lint"}

# "file::test" (or "file::Class::test", or one parametrization: "file::test[id]") -> why it needs an extra, where its
# code does not import one.
EXTRA_TESTS: dict[str, str] = {
    "tests/test_public_api.py::test_workers_imports_ray_only_when_asked": "ray, through workers.RayCollector",
    "tests/test_public_api.py::test_the_ray_names_are_there_and_lazy": "ray, through workers.RayCollector and NodeOwner",
    "tests/test_public_api.py::test_moved_names_still_import_with_a_warning_naming_their_new_home[workers]":
        "ray, through workers.NodeOwner (moved to workers.lowlevel)",
    "tests/test_readme.py::test_readme_command_line_runs[bench --help]":
        "tqdm, through `shmbuf bench --help` (benchmarks/run.py)",
    "tests/test_inference_docs.py::test_the_collector_block_prints_its_batches_and_the_servers_batching":
        "gymnasium, in docs/inference.md's block",
    "tests/test_inference_docs.py::test_the_num_workers_block_prints_vector_rollouts_and_requests_of_four_envs":
        "gymnasium, in docs/inference.md's second block",
    "tests/test_inference_docs.py::test_the_tensordict_block_prints_torchrls_layout":
        "gymnasium and torchrl, in docs/inference.md's block",
    "tests/test_storage_files.py::test_docs_block_runs[0]": "gymnasium, in docs/storage.md's first block",
    "tests/test_storage_views.py::test_docs_block_runs[3]": "gymnasium and ale-py, in docs/views.md's Atari block",
    "tests/test_storage_files.py::test_docs_block_runs[1]": "gymnasium, in docs/storage.md's second block",
    **{f"tests/test_janitor.py::test_a_dead_owner_leaves_nothing_in_dev_shm[{kind}-{sig}]":
       "gymnasium, in the owner process's collector (tests.helpers_workers, imported there)"
       for kind in ("collector", "async_batched") for sig in ("SIGTERM", "SIGINT", "SIGKILL")},
    "tests/test_janitor.py::test_keep_on_crash_keeps_a_killed_owners_objects[collector]":
        "gymnasium, in the owner process's collector (tests.helpers_workers, imported there)",
    "tests/test_suite_parallel.py::test_a_leak_in_any_worker_fails_the_run_and_is_removed":
        "pytest-xdist, which runs `make test` in parallel (the test extra; the core job runs in one process)",
}


FIRST_PARTY = ("tests", "benchmarks", "examples")  # modules of the checkout a test may import, followed like tests'


def _path(module: str) -> pathlib.Path | None:
    """The file of a first-party module ("tests.helpers", "benchmarks.inference"), if it is one."""
    parts = module.split(".")
    if parts[0] not in FIRST_PARTY or len(parts) != 2:
        return None
    path = ROOT / parts[0] / f"{parts[1]}.py"
    return path if path.exists() else None


class _File:
    """One module's defs, what it imports from first-party modules, and its top-level optional imports."""

    def __init__(self, module: str, path: pathlib.Path) -> None:
        self.module = module
        self.tree = ast.parse(path.read_text(), str(path.relative_to(ROOT)))
        self.defs: dict[str, ast.AST] = {}  # module-level functions and classes; methods as "Class.method"
        self.aliases: dict[str, tuple[str, str]] = {}  # local name -> (first-party module, name there)
        self.modules: dict[str, str] = {}  # local name -> first-party module it names
        self.top_modules: set[str] = set()  # first-party modules imported at the top
        self.top_optional: set[str] = set()
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.defs[node.name] = node
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.defs[f"{node.name}.{item.name}"] = item
            else:
                if isinstance(node, (ast.Assign, ast.AnnAssign)):  # a constant the tests name: its scripts count
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            self.defs[t.id] = node.value if node.value is not None else node
                    self.top_optional |= _optional_in(node, strings=False)  # torch = pytest.importorskip("torch")
                    continue
                self.top_optional |= _optional_in(node)
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                        for a in sub.names:
                            if _path(f"{sub.module}.{a.name}"):  # from tests import helpers
                                self.modules[a.asname or a.name] = f"{sub.module}.{a.name}"
                                self.top_modules.add(f"{sub.module}.{a.name}")
                            elif _path(sub.module):  # from tests.helpers import f
                                self.aliases[a.asname or a.name] = (sub.module, a.name)
                                self.top_modules.add(sub.module)
                    elif isinstance(sub, ast.Import):
                        for a in sub.names:
                            if _path(a.name):
                                self.top_modules.add(a.name)
                                if a.asname:
                                    self.modules[a.asname] = a.name


_READING: set[str] = set()  # modules being read: a script that names itself in a string is not read again


@functools.cache
def _file(module: str) -> _File | None:
    path = _path(module)
    if path is None or module in _READING:
        return None
    _READING.add(module)
    try:
        return _File(module, path)
    finally:
        _READING.discard(module)


def _optional_in(node: ast.AST, strings: bool = True) -> set[str]:
    """Optional modules an AST imports anywhere in it, or asks pytest.importorskip for, or runs in a string."""
    optional = set(OPTIONAL.values())
    found = set()
    for sub in ast.walk(node):
        names: list[str] = []
        if isinstance(sub, ast.Import):
            names = [a.name for a in sub.names]
        elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
            names = [sub.module]
        elif isinstance(sub, ast.Call) and getattr(sub.func, "attr", getattr(sub.func, "id", None)) == "importorskip":
            if sub.args and isinstance(sub.args[0], ast.Constant) and isinstance(sub.args[0].value, str):
                names = [sub.args[0].value]
            else:  # importorskip(name) over a loop of names: every optional module spelt in the statement counts
                names = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        elif strings and isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            found |= _optional_in_string(sub.value)
        found |= {n.partition(".")[0] for n in names} & optional
    return found


@functools.cache
def _optional_in_string(text: str) -> frozenset[str]:
    """What a string runs: a Python program in it (a script a test writes or passes to -c), or an examples/ script."""
    found: set[str] = set()
    if "import " in text:
        try:
            found |= _optional_in(ast.parse(text))
        except SyntaxError:
            pass
    named = re.findall(r"(\w+)\.py\b", text) + re.findall(r"\A\w+\Z", text)  # "x.py", or import_example("x")
    for script in named:
        if (ROOT / "examples" / f"{script}.py").exists():
            found |= file_needs(f"examples.{script}")
    return frozenset(found)


def file_needs(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """Optional modules a module imports at its top, itself or through the first-party modules it imports."""
    f = _file(name)
    if f is None or name in seen:
        return set()
    out = set(f.top_optional)
    for mod in f.top_modules:
        out |= file_needs(mod, seen | {name})
    return out


def def_needs(file: str, qualname: str) -> set[str]:
    """Optional modules a test or helper imports, with those of the functions and fixtures it names, transitively."""
    found: set[str] = set()
    todo = [(file, qualname)]
    seen: set[tuple[str, str]] = set()
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        f = _file(key[0])
        node = f.defs.get(key[1]) if f else None
        if f is None or node is None:
            continue
        found |= _optional_in(node)
        cls = key[1].split(".")[0] if "." in key[1] else None
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} if cls else set()
        for n in ast.walk(node):  # helpers.f(...) on a first-party module
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in f.modules:
                todo.append((f.modules[n.value.id], n.attr))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {a.arg for a in node.args.args + node.args.kwonlyargs}  # fixtures by argument name
        for n in names:
            if n in f.defs:
                todo.append((key[0], n))
            elif cls and f"{cls}.{n}" in f.defs:
                todo.append((key[0], f"{cls}.{n}"))
            elif n in f.aliases:
                todo.append(f.aliases[n])
    return found


def check_optional_modules() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10 has no tomllib: the check is skipped, the selection is not
        return []
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    problems = []
    for extra, reqs in extras.items():
        if extra in TOOLING_EXTRAS:
            continue
        for req in reqs:
            name = req.split(";")[0].split("[")[0]
            for sep in "<>=!~ ":
                name = name.split(sep)[0]
            if name.lower() not in OPTIONAL and name.lower() not in RUNNER:
                problems.append(f"pyproject's extra {extra!r} has {name!r}, which OPTIONAL in .ci/core_tests.py does not "
                                "map to its module: add it there")
    return problems


def select() -> tuple[list[str], dict[str, set[str]], dict[str, set[str]], list[str]]:
    """(core test files, files left out -> modules, tests left out -> modules (by "file::qualname"), problems)."""
    problems = check_optional_modules()
    core, files_out, tests_out = [], {}, {}
    for path in sorted(TESTS.glob("test_*.py")):
        name = f"tests.{path.stem}"
        if need := file_needs(name):
            files_out[f"tests/{path.name}"] = need
            continue
        core.append(f"tests/{path.name}")
        f = _file(name)
        assert f is not None
        for qual in f.defs:
            last = qual.rsplit(".", 1)[-1]
            if last.startswith("test") and ("." not in qual or qual.split(".")[0].startswith("Test")):
                if need := def_needs(name, qual):
                    tests_out[f"tests/{path.name}::{qual.replace('.', '::')}"] = need
    for node_id, why in EXTRA_TESTS.items():
        file, _, qual = node_id.split("[")[0].partition("::")
        f = _file(f"tests.{pathlib.Path(file).stem}")
        if f is None or qual.replace("::", ".") not in f.defs:
            problems.append(f"EXTRA_TESTS names {node_id}, which does not exist: rename or remove the entry")
        tests_out.setdefault(node_id, set()).add(f"({why})")
    return core, files_out, tests_out, problems


class CoreJob:
    """Deselects the tests that need an extra, and fails the job on a test skipped for a missing module."""

    def __init__(self, tests_out: set[str]) -> None:
        self.tests_out = tests_out  # node ids, or a parametrised test's id without its parameters
        self.hidden: list[str] = []

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        keep, drop = [], []
        for item in items:
            out = item.nodeid in self.tests_out or item.nodeid.split("[")[0] in self.tests_out
            (drop if out else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def _check(self, report: Any) -> None:
        if report.skipped:
            reason = str(report.longrepr)
            if "could not import" in reason or "No module named" in reason:
                self.hidden.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report: Any) -> None:
        self._check(report)

    def pytest_collectreport(self, report: Any) -> None:
        self._check(report)


# The job runs in pytest-xdist workers (`-n`): each worker collects, so each deselects. A worker loads this module as
# a plugin (`-p core_tests`, found through PYTHONPATH) and takes the selection from OUT_ENV; the controller's instance
# sees every test's report, so a skip for a missing module is caught there.
OUT_ENV = "SHMBUF_CORE_TESTS_OUT"
job: CoreJob | None = None


def pytest_configure(config: Any) -> None:
    global job
    if OUT_ENV in os.environ and not config.pluginmanager.has_plugin("core-job"):
        job = CoreJob(set(json.loads(os.environ[OUT_ENV])))
        config.pluginmanager.register(job, "core-job")


def main(argv: list[str]) -> int:
    core, files_out, tests_out, problems = select()
    for p in problems:
        print(f"core_tests: {p}", file=sys.stderr)
    if problems:
        return 1
    if "--list" in argv:
        for file, need in {**files_out, **tests_out}.items():
            print(f"out: {file}: {', '.join(sorted(need))}")
        return 0
    # as `python -m pytest` from the checkout would (tests import tests.helpers), and this module as a plugin
    for path in (str(ROOT), str(ROOT / ".ci")):
        sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / ".ci"), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ[OUT_ENV] = json.dumps(sorted(tests_out))
    import pytest

    code = pytest.main([*argv, "-p", "core_tests", *core])
    import core_tests  # the plugin's instance (this file runs as __main__: another module object)

    ran = core_tests.job
    print(f"core_tests: {len(core)} test files ran; left out for their extras (they run in `make test`): "
          f"{len(files_out)} files, and {len(tests_out)} test functions of the files that ran; "
          "`python .ci/core_tests.py --list` names them")
    if ran is not None and ran.hidden:
        print("core_tests: skipped for a missing module (a core test must not need an extra):", file=sys.stderr)
        for h in ran.hidden:
            print(f"  {h}", file=sys.stderr)
        return 1
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
