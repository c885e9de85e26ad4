"""The shape of the packages, as a reviewer counts it: modules and lines, import circles, the largest module and
class, public constructors' parameters, public names per tier.

    python .ci/structure.py            # the report
    python .ci/structure.py --check    # and fail on a module over 600 lines, a class over 400, or an import circle

Every import of one of the packages' modules is an edge of the graph: at module level, inside a function (a lazy
import that breaks a circle at run time still ties the two modules together), or under ``TYPE_CHECKING``; a package's
``__init__`` importing its own submodules (re-exports) is not. A circle is a strongly connected component of more
than one module. Lines are
physical lines. Run from the checkout's root; it reads the sources and imports nothing of them.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("shmbuf", "workers")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
# The public constructors a user reads, by the module that defines each.
CONSTRUCTORS = {
    "Collector": "workers",
    "AsyncBatchedCollector": "workers",
    "MultiAgentCollector": "workers",
    "RayCollector": "workers",
}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The known modules ``name`` imports, anywhere in it."""
    found: set[str] = set()
    package = name if name in {m for m in known if any(k.startswith(m + ".") for k in known)} else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    found.add(a.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                found.add(base)
                for a in child.names:
                    found.add(f"{base}.{a.name}")
            visit(child)

    visit(tree)
    out = set()
    for f in found:
        while f and f not in known:
            f = f.rpartition(".")[0]
        if f and f != name:
            out.add(f)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _package_edge(src: str, dst: str) -> bool:
    """A package's ``__init__`` importing its own submodules is how it re-exports them, not a circle's edge."""
    return dst.startswith(src + ".")


def report(root: Path) -> tuple[list[str], list[str]]:
    mods = modules(root)
    known = set(mods)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    graph = {m: {d for d in imports(m, t, known) if not _package_edge(m, d)} for m, t in trees.items()}
    out: list[str] = []
    problems: list[str] = []
    for pkg in PACKAGES:
        ms = [m for m in mods if m == pkg or m.startswith(pkg + ".")]
        out.append(f"{pkg}: {len(ms)} modules, {sum(lines[m] for m in ms):,} lines")
    big = sorted(lines.items(), key=lambda kv: -kv[1])[:5]
    out.append("largest modules: " + ", ".join(f"{m} {n}" for m, n in big))
    classes = []
    for m, t in trees.items():
        for node in ast.walk(t):
            if isinstance(node, ast.ClassDef):
                classes.append(((node.end_lineno or node.lineno) - node.lineno + 1, f"{m}.{node.name}"))
    classes.sort(reverse=True)
    out.append("largest classes: " + ", ".join(f"{c} {n}" for n, c in classes[:5]))
    found = circles(graph)
    out.append(f"import circles: {len(found)}")
    for c in found:
        out.append("  " + " <-> ".join(c))
    for name, pkg in CONSTRUCTORS.items():
        for m, t in trees.items():
            if not m.startswith(pkg):
                continue
            for node in ast.walk(t):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
                    if init is not None:
                        a = init.args
                        n = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
                        out.append(f"{name}.__init__: {n} parameters{' + **kwargs' if a.kwarg else ''} ({m})")
    for m in ("shmbuf", "shmbuf.lowlevel", "shmbuf.layout", "shmbuf.storage", "shmbuf.storage.lowlevel", "workers",
              "workers.lowlevel"):
        if m in trees:
            names = _all(trees[m])
            out.append(f"public names, {m}: {len(names)}")
    for m, n in lines.items():
        if n > MAX_MODULE_LINES:
            problems.append(f"{mods[m]}: {n} lines (at most {MAX_MODULE_LINES})")
    for n, c in classes:
        if n > MAX_CLASS_LINES:
            problems.append(f"class {c}: {n} lines (at most {MAX_CLASS_LINES})")
    for c in found:
        problems.append("import circle: " + " <-> ".join(c))
    return out, problems


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return []
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail on an over-long module or class, or an import circle")
    ap.add_argument("--root", default=".", help="the checkout (default: here)")
    args = ap.parse_args()
    out, problems = report(Path(args.root))
    print("\n".join(out))
    if args.check and problems:
        print("\n".join(["", "structure check failed:"] + problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
