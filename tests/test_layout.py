"""The layout's import rules: arrows point one way (kernels/ never imports the library, the recipes or the
benchmark; the library's core imports neither the recipes nor the benchmark) and no two files import
each other, directly or through others. Read from the source (every import, also inside functions),
so a lazy import that closes a circle is caught as well as a top-level one."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# installed package -> folder (pyproject's package-dir)
PACKAGES = {"linearize": ROOT / "linearize", "linearize.kernels": ROOT / "kernels",
            "linearize.recipes": ROOT / "recipes", "linearize.benchmarks": ROOT / "benchmarks"}
# the library modules that may reach the recipes and the benchmark: the command line only
CLI = {"linearize.cli"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (``from pkg import name`` counts as ``pkg.name`` when
    that is a module, else as ``pkg``)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in mods else known(base)
                    if target:
                        out.add(target)
        out.discard(name)
        graph[name] = out
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_circles_are_found():
    # the checker itself: a made-up circle through a lazy import is reported
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_arrows_point_one_way():
    graph = import_graph()
    tools = ("linearize.recipes", "linearize.benchmarks")
    wrong = []
    for name, targets in graph.items():
        for t in targets:
            if name.startswith("linearize.kernels") and not t.startswith("linearize.kernels"):
                wrong.append(f"{name} -> {t} (kernels import nothing from the library)")
            core = not name.startswith(("linearize.kernels", *tools)) and name not in CLI
            if core and t.startswith(tools):
                wrong.append(f"{name} -> {t} (the library's core never imports the recipes or the benchmark)")
            if name.startswith("linearize.recipes") and t.startswith("linearize.benchmarks"):
                wrong.append(f"{name} -> {t} (the recipes do not import the benchmark)")
    assert not wrong, "\n".join(wrong)


def test_import_linearize_loads_neither_recipes_nor_benchmark():
    code = ("import sys, linearize; print(sorted(m for m in sys.modules "
            "if m.startswith(('linearize.recipes', 'linearize.benchmarks'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
