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
    path.write_text("import torch\nfrom kvpress_phase.core.phase import phase_of\nfrom .arguments import csv_list\n"
                    "from .tasks import base\nfrom kvpress_phase.evaluation import tasks\n")
    assert layer_violations("evaluation", "training", dirs, files=[(path, "kvpress_phase.evaluation.fine")]) == []


# ------------------------------------------------------------------------------------------- the kernels' layer
# The presses (kvpress_phase/presses/) call the kernels and the package root leads to the presses, so the kernels
# sit below both: kernels/ may import, from this project, only itself and kvpress_phase/core/ (phase arithmetic and
# RoPE handling), and kvpress_phase/core/ only itself. Folders here are where the files are, subfolders included.
KERNEL_LAYERS = {"kernels": {"kernels", "kvpress_phase/core"}, "kvpress_phase/core": {"kvpress_phase/core"}}


def defining_folder(name: str, dirs: dict):
    """The folder, relative to the root, of the file that defines ``name`` (a module, or an attribute of one:
    ``kvpress_phase.core.phase.WindowLayout`` is defined in ``kvpress_phase/core/``; a package in its own folder), or None
    when it is not one of ours."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        folder = folder_of(module, dirs)
        if folder is None:
            return None
        package = max((p for p in dirs if module == p or module.startswith(p + ".")), key=len)
        path = ROOT.joinpath(folder, *module[len(package):].split(".")[1:])
        if (path / "__init__.py").is_file():
            return path.relative_to(ROOT).as_posix()
        if path.with_suffix(".py").is_file():
            return path.parent.relative_to(ROOT).as_posix()
    return None


def kernel_layer_violations(dirs: dict, files=None) -> list:
    """``"path:line imports module (folder/)"`` for each import, by a file of kernels/ or kvpress_phase/core/, of a
    module in a folder :data:`KERNEL_LAYERS` does not allow it (one per line and folder). ``files``: ``(path,
    module)`` pairs to check instead; a file's layer is that of its module's folder."""
    if files is None:
        files = [*source_files("kernels", dirs), *source_files("kvpress_phase", dirs)]
    found = []
    for path, module in files:
        path = pathlib.Path(path)
        allowed = KERNEL_LAYERS.get(defining_folder(module, dirs))
        if allowed is None:
            continue
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        seen = set()
        for line, name in imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            folder = defining_folder(name, dirs)
            if folder is not None and folder not in allowed and (line, folder) not in seen:
                seen.add((line, folder))
                found.append(f"{where}:{line} imports {name} ({folder}/)")
    return found


def test_the_kernels_import_nothing_from_the_package_root_or_the_presses():
    """No file in kernels/ imports the package root (``kvpress_phase.builtin``, ``kvpress_phase.model_cache``, ...) or the
    presses, and kvpress_phase/core/, which the kernels use, imports nothing else of ours."""
    dirs = package_dirs()
    assert defining_folder("kvpress_phase.kernels.naive", dirs) == "kernels"  # the mapping the rule relies on
    assert defining_folder("kvpress_phase.core.phase.WindowLayout", dirs) == "kvpress_phase/core"
    assert defining_folder("kvpress_phase.builtin", dirs) == "kvpress_phase"
    checked = {defining_folder(module, dirs) for _, module in source_files("kernels", dirs)}
    checked |= {defining_folder(module, dirs) for _, module in source_files("kvpress_phase", dirs)}
    assert set(KERNEL_LAYERS) <= checked, "no files found in kernels/ or kvpress_phase/core/"
    assert kernel_layer_violations(dirs) == []


@pytest.mark.parametrize("source,module,folder", [
    ("from kvpress_phase.builtin import quiet_loading\n", "kvpress_phase.kernels.offender", "kvpress_phase"),
    ("def f():\n    from kvpress_phase.model_cache import cache_root\n", "kvpress_phase.kernels.offender", "kvpress_phase"),
    ("from kvpress_phase import WindowLayout\n", "kvpress_phase.kernels.offender", "kvpress_phase"),
    ("from ..presses import base\n", "kvpress_phase.kernels.offender", "kvpress_phase/presses"),
    ("import kvpress_phase.presses.base\n", "kvpress_phase.kernels.offender", "kvpress_phase/presses"),
    ("from ..evaluation import runner\n", "kvpress_phase.kernels.offender", "evaluation"),
    ("from kvpress_phase.kernels import naive\n", "kvpress_phase.core.offender", "kernels"),
    ("from ..builtin import quiet_loading\n", "kvpress_phase.core.offender", "kvpress_phase"),
])
def test_the_kernel_rule_reports_an_import_from_above(source, module, folder, tmp_path):
    path = tmp_path / "offender.py"
    path.write_text(source)
    found = kernel_layer_violations(package_dirs(), files=[(path, module)])
    assert len(found) == 1 and "offender.py:" in found[0] and found[0].endswith(f"({folder}/)"), found


def test_the_kernel_rule_lets_the_kernels_import_themselves_and_core(tmp_path):
    path = tmp_path / "fine.py"
    path.write_text("import torch\nimport triton.language as tl\nfrom kvpress_phase.core.phase import WindowLayout\n"
                    "from kvpress_phase.core import rope\nfrom . import naive\nfrom .triton_common import row_offsets\n"
                    "from kvpress_phase.kernels import naive\n")
    assert kernel_layer_violations(package_dirs(), files=[(path, "kvpress_phase.kernels.fine")]) == []


def test_importing_the_kernels_loads_neither_the_presses_nor_kvpress():
    """What the layers buy at run time: ``import kvpress_phase.kernels`` works where kvpress is not installed."""
    import subprocess
    import sys

    code = ("import sys, kvpress_phase.kernels; print(' '.join(m for m in sys.modules if m.split('.')[0] in "
            "('kvpress', 'transformers') or m.startswith(('kvpress_phase.presses', 'kvpress_phase.evaluation', "
            "'kvpress_phase.training')) or m in ('kvpress_phase.builtin', 'kvpress_phase.model_cache')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == []
