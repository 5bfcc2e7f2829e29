"""No import circles inside the package: the modules of every source folder import each other in floors.

The graph has one node per module of the installed package (``kvpress_phase`` and the sub-packages that
pyproject.toml's ``package-dir`` maps to ``kernels/``, ``evaluation/``, ``training/`` and ``cli/``) and an edge for
each import of one of them by another, read with :mod:`ast` (nothing is imported): at the top of a module or inside
a function (a lazy import closes a circle as surely as one at the top, only later), ``import a.b``, ``from a import
b`` and ``from . import b``, and ``importlib.import_module("...")`` with a constant name. Imports under ``if
TYPE_CHECKING:`` do not run and do not count. ``from X import Y`` is an edge to ``X.Y`` when that is a module, else to
``X``; a name a package hands out lazily from a ``_LAZY = {name: module}`` table (``from kvpress_phase import
PhaseAwarePress``) is an edge to the module that defines it. Importing a module also runs its parent packages'
``__init__``; those are not edges (a package importing its own submodules is no circle). Any strongly connected
component of more than one module is a circle, reported with one cycle through it and each edge's file and line.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Optional

import pytest
from test_import_layers import ROOT, package_dirs, source_files  # skipped with it before Python 3.11 (tomllib)


# ------------------------------------------------------------------------------------------------ the graph
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every import statement and constant ``import_module`` call under ``node``, not those of an ``if
    TYPE_CHECKING:`` body (its ``else`` runs and counts)."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.orelse:
            yield from _import_nodes(child)
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and (getattr(node.func, "attr", None) == "import_module"
               or getattr(node.func, "id", None) in ("import_module", "__import__"))):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _import_nodes(child)


def _lazy_table(tree: ast.Module) -> dict:
    """``{name: module}`` of a module-level ``_LAZY = {...}`` of string constants (the names a package imports only
    when they are first asked for), or ``{}``."""
    for node in tree.body:
        if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_LAZY"
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def package_modules(dirs: Optional[dict] = None) -> dict:
    """``{module name: path}`` of every module of the package's source folders."""
    dirs = dirs if dirs is not None else package_dirs()
    modules = {}
    for folder in sorted(set(dirs.values())):
        for path, module in source_files(folder, dirs):
            modules[module] = pathlib.Path(path)
    return modules


def import_edges(modules: dict, sources: Optional[dict] = None) -> dict:
    """``{(importer, imported): [line, ...]}`` between the modules of ``modules`` (``{name: path}``). ``sources``:
    ``{name: text}`` read instead of the files (a module of ``modules`` or a new one)."""
    sources = dict(sources or {})
    trees = {}
    for module in set(modules) | set(sources):
        text = sources[module] if module in sources else modules[module].read_text(encoding="utf-8")
        trees[module] = ast.parse(text)
    known = set(trees)
    lazy = {module: _lazy_table(tree) for module, tree in trees.items()}

    def owner(name: str) -> Optional[str]:  # the longest module of ours that ``name`` is or is inside
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict = {}
    for module, tree in trees.items():
        path = modules.get(module)
        is_package = path is not None and path.name == "__init__.py" if module not in sources else False
        package = module if is_package else module.rpartition(".")[0]
        for node in _import_nodes(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module
                for alias in node.names:
                    if f"{source}.{alias.name}" in known:
                        targets.append(f"{source}.{alias.name}")
                    elif alias.name in lazy.get(source, {}):
                        targets.append(owner(lazy[source][alias.name]))
                    else:
                        targets.append(owner(source))
            else:
                targets = [owner(node.args[0].value)]
            for target in targets:
                if target is not None and target != module:
                    lines = edges.setdefault((module, target), [])
                    if node.lineno not in lines:
                        lines.append(node.lineno)
    return edges


def strongly_connected(nodes, edges: dict) -> list:
    """The strongly connected components of the graph (Tarjan's algorithm, iterative), each a sorted list."""
    successors: dict = {}
    for a, b in edges:
        successors.setdefault(a, []).append(b)
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(successors.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def a_cycle(component: list, edges: dict) -> list:
    """A shortest cycle through the first module of ``component`` (a strongly connected component), as the list of
    its modules, starting and ending with that one (breadth-first search inside the component)."""
    members, start = set(component), component[0]
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            if (node, start) in edges:
                path = [node]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            for a, b in sorted(edges):
                if a == node and b in members and b not in came_from:
                    came_from[b] = node
                    following.append(b)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def circles(modules: dict, edges: dict) -> list:
    """One line per import circle: ``a -> b (a.py:12) -> a (b.py:40)`` for each strongly connected component of
    more than one module."""
    out = []
    for component in strongly_connected(modules, edges):
        if len(component) < 2:
            continue
        cycle = a_cycle(component, edges)
        steps = [cycle[0]]
        for a, b in zip(cycle, cycle[1:]):
            path = modules.get(a)
            where = path.relative_to(ROOT).as_posix() if path is not None and path.is_relative_to(ROOT) else a
            steps.append(f"{b} ({where}:{','.join(map(str, edges[(a, b)]))})")
        out.append(" -> ".join(steps) + (f"; the circle holds {', '.join(component)}" if len(component) > 2 else ""))
    return out


# ------------------------------------------------------------------------------------------------- the rule
def test_the_package_has_no_import_circles():
    """Every module of the package sits on a floor: nothing it imports, directly or through others, imports it
    back (in evaluation/: tasks and stores at the bottom; registry, runner and replay above; commands and CLI on
    top)."""
    dirs = package_dirs()
    modules = package_modules(dirs)
    assert {"kvpress_phase", "kvpress_phase.evaluation.cli", "kvpress_phase.training.cli", "kvpress_phase.cli",
            "kvpress_phase.kernels", "kvpress_phase.presses.base"} <= set(modules)  # every folder was read
    found = circles(modules, import_edges(modules))
    assert not found, "import circles (move what both modules need into the lower one or a third):\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------- the checker fails
def _graph(sources: dict) -> tuple:
    modules = {name: pathlib.Path(f"/nowhere/{name.replace('.', '/')}.py") for name in sources}
    return modules, import_edges(modules, sources)


@pytest.mark.parametrize("a,b", [
    ("from .b import f\n", "from .a import g\n"),  # both at the top
    ("def run():\n    from . import b\n", "from .a import g\n"),  # a lazy import back
    ("def run():\n    from .b import f\n", "def run():\n    from kvpress_phase.evaluation.a import g\n"),  # both lazy
    ("import kvpress_phase.evaluation.b\n",
     "import importlib\nimportlib.import_module('kvpress_phase.evaluation.a')\n"),
    ("from kvpress_phase.evaluation import b\n", "class C:\n    def f(self):\n        from .a import g\n"),
])
def test_the_rule_reports_a_circle_of_two_modules(a, b):
    modules, edges = _graph({"kvpress_phase.evaluation.a": a, "kvpress_phase.evaluation.b": b})
    found = circles(modules, edges)
    assert len(found) == 1, found
    assert found[0].startswith("kvpress_phase.evaluation.a -> kvpress_phase.evaluation.b (")
    assert found[0].split(" -> ")[-1].startswith("kvpress_phase.evaluation.a (")


def test_the_rule_reports_a_circle_through_a_lazy_table():
    modules, edges = _graph({
        "kvpress_phase": "_LAZY = {'Press': 'kvpress_phase.presses.p'}\n",
        "kvpress_phase.presses.p": "from kvpress_phase.evaluation.r import REGISTRY\n",
        "kvpress_phase.evaluation.r": "def build():\n    from kvpress_phase import Press\n",
    })
    (found,) = circles(modules, edges)
    assert found.startswith("kvpress_phase.evaluation.r -> kvpress_phase.presses.p (kvpress_phase.evaluation.r:2)")
    assert ("kvpress_phase.evaluation.r", "kvpress_phase") not in edges


def test_the_rule_reports_a_circle_of_three_modules_naming_them_all():
    modules, edges = _graph({
        "kvpress_phase.evaluation.registry": "def build():\n    from .replay import Masks\n",
        "kvpress_phase.evaluation.replay": "from .presses import ATTENTIONS\n",
        "kvpress_phase.evaluation.presses": "from .registry import REGISTRY\nfrom .tasks import t\n",
        "kvpress_phase.evaluation.tasks": "",
    })
    (found,) = circles(modules, edges)
    assert found.startswith("kvpress_phase.evaluation.presses -> kvpress_phase.evaluation.registry (")
    assert found.endswith("; the circle holds kvpress_phase.evaluation.presses, kvpress_phase.evaluation.registry, "
                          "kvpress_phase.evaluation.replay")


def test_the_rule_ignores_type_checking_imports_and_parent_packages():
    modules, edges = _graph({
        "kvpress_phase.evaluation": "",
        "kvpress_phase.evaluation.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "kvpress_phase.evaluation.b": "from .a import f\nfrom kvpress_phase.evaluation.tasks import t\n",
        "kvpress_phase.evaluation.tasks": "from .base import t\n",
        "kvpress_phase.evaluation.tasks.base": "from kvpress_phase.evaluation.tasks.names import n\n",
        "kvpress_phase.evaluation.tasks.names": "import torch\nfrom kvpress import BasePress\n",
    })
    assert circles(modules, edges) == []
    assert ("kvpress_phase.evaluation.a", "kvpress_phase.evaluation.b") not in edges
    assert ("kvpress_phase.evaluation.tasks.base", "kvpress_phase.evaluation.tasks.names") in edges
    assert ("kvpress_phase.evaluation.tasks.base", "kvpress_phase.evaluation.tasks") not in edges


def test_the_rule_reports_what_the_else_of_type_checking_imports():
    modules, edges = _graph({
        "kvpress_phase.evaluation.a": "if TYPE_CHECKING:\n    pass\nelse:\n    from .b import B\n",
        "kvpress_phase.evaluation.b": "from .a import f\n",
    })
    assert len(circles(modules, edges)) == 1
