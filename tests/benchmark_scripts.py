"""The benchmark scripts are files, not a package: the tests load them by path."""

from __future__ import annotations

import importlib.util
import os

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module, loaded afresh (a test that patches it leaves the next one a clean copy)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
