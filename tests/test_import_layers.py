"""The layers of the source folders: which folder may import which.

Every ``.py`` file of the package's source folders is parsed with :mod:`ast` (nothing is imported), its module
name and the folder of each module it imports are found through pyproject.toml's ``package-dir`` (the folders
``kvpress_phase/``, ``kernels/``, ``evaluation/``, ``training/`` and ``cli/`` all ship inside ``kvpress_phase``),
and an import against a layer is reported with its file and line. Imports inside functions, ``TYPE_CHECKING``
blocks and ``importlib.import_module("...")`` calls with a constant name all count.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[1]


def package_dirs() -> dict:
    """``{package: folder}`` of pyproject.toml's ``[tool.setuptools] package-dir``, e.g. ``{"kvpress_phase.training":
    "training", ...}``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def folder_of(module: str, dirs: dict):
    """The source folder holding ``module`` (the longest ``package-dir`` package it is in), or None when it is not
    one of ours (``torch``, ``kvpress``, ...)."""
    best = None
    for package in dirs:
        if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(best)):
            best = package
    return None if best is None else dirs[best]


def source_files(folder: str, dirs: dict):
    """``(path, module name)`` of every ``.py`` file in the source folder ``folder`` and its subfolders (a subfolder
    mapped to a package of its own belongs to that package's folder instead)."""
    packages = [p for p, d in dirs.items() if d == folder]
    assert packages, f"no package is mapped to {folder}/ in pyproject.toml"
    package = min(packages, key=len)
    base = ROOT / folder
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join([package] + parts)
        if folder_of(module, dirs) == folder:  # e.g. not a folder mapped elsewhere
            yield path, module


def imported_modules(source: str, module: str, is_package: bool):
    """``(line, absolute module name)`` of every import in ``source``, the text of ``module``. ``from X import Y``
    gives both X and X.Y (Y may be a submodule); relative imports are resolved against ``module``'s package."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise AssertionError(f"{module}: relative import beyond the top-level package (line {node.lineno})")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            yield node.lineno, target
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{target}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in
                   ("import_module", "__import__"))):
            yield node.lineno, node.args[0].value


def layer_violations(importer: str, forbidden: str, dirs: dict, files=None) -> list:
    """``"path:line imports module"`` for each import statement, by a file of the source folder ``importer``, of a
    module in the source folder ``forbidden`` (one per line). ``files``: ``(path, module)`` pairs to check instead of
    the folder's files."""
    found = []
    for path, module in (files if files is not None else source_files(importer, dirs)):
        path = pathlib.Path(path)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        seen = set()
        for line, name in imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if folder_of(name, dirs) == forbidden and line not in seen:
                seen.add(line)
                found.append(f"{where}:{line} imports {name}")
    return found


# ------------------------------------------------------------------------------------------------- the rules
def test_evaluation_does_not_import_training():
    """Training builds on evaluation (arguments, tasks, tokenizer, prompting, metrics, runner), so evaluation/ must
    not import training/: the ``kvpress-phase`` command, which composes both, lives above them in cli/."""
    dirs = package_dirs()
    assert folder_of("kvpress_phase.training.cli", dirs) == "training"  # the mapping the rule relies on
    assert list(source_files("evaluation", dirs)), "no files found in evaluation/"
    assert layer_violations("evaluation", "training", dirs) == []


def test_nothing_in_the_package_imports_the_command_line_entry_point():
    """cli/ (``kvpress_phase.cli``) composes the commands of evaluation/ and training/; a source folder importing it
    would close a circle through it."""
    dirs = package_dirs()
    assert folder_of("kvpress_phase.cli", dirs) == "cli"
    found = []
    for folder in sorted(set(dirs.values()) - {"cli"}):
        found += layer_violations(folder, "cli", dirs)
    assert found == []


# ------------------------------------------------------------------------------------------- the checker fails
@pytest.mark.parametrize("source", [
    "from kvpress_phase.training.cli import add_arguments\n",
    "def f():\n    import kvpress_phase.training.loop\n",
    "from kvpress_phase import training\n",
    "from ..training import cli\n",
    "import importlib\nimportlib.import_module('kvpress_phase.training.finetune')\n",
])
def test_the_rule_reports_an_import_of_training_from_evaluation(source, tmp_path):
    dirs = package_dirs()
    path = tmp_path / "offender.py"
    path.write_text(source)
    found = layer_violations("evaluation", "training", dirs, files=[(path, "kvpress_phase.evaluation.offender")])
    assert len(found) == 1 and "offender.py:" in found[0] and "kvpress_phase.training" in found[0]


def test_the_rule_lets_evaluation_import_its_own_and_shared_modules(tmp_path):
    dirs = package_dirs()
    path = tmp_path / "fine.py"
    path.write_text("import torch\nfrom kvpress_phase.phase import phase_of\nfrom .arguments import csv_list\n"
                    "from .tasks import base\nfrom kvpress_phase.evaluation import tasks\n")
    assert layer_violations("evaluation", "training", dirs, files=[(path, "kvpress_phase.evaluation.fine")]) == []
