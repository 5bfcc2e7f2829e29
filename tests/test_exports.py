"""The packages' ``__all__``: every name resolves, the top level's press classes are the presses package's, and
whatever the source folders import from ``kvpress_phase.kernels`` the kernels package exports."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvpress_phase", "kvpress_phase.presses", "kvpress_phase.kernels")


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_resolves(name):
    module = importlib.import_module(name)
    missing = [attr for attr in module.__all__ if not hasattr(module, attr)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def test_top_level_presses_are_exported_by_the_presses_package():
    import kvpress_phase
    import kvpress_phase.presses

    from_presses = {attr for attr, where in kvpress_phase._LAZY.items() if where.startswith("kvpress_phase.presses.")}
    assert from_presses - set(kvpress_phase.presses.__all__) == set()


def test_names_imported_from_the_kernels_package_are_exported():
    import kvpress_phase.kernels

    imported = set()
    for folder in ("kvpress_phase", "evaluation", "training", "cli", "benchmarks", "studies"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "kvpress_phase.kernels":
                    imported |= {alias.name for alias in node.names}
    assert imported, "no module imports from kvpress_phase.kernels: the scan looks in the wrong folders"
    assert imported - set(kvpress_phase.kernels.__all__) == set()
