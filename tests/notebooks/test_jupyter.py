"""The notebooks extra brings a Jupyter front end: `jupyter lab notebooks/` (README) and `jupyter nbconvert` run.

Not skipped when Jupyter is missing: the test suite runs after `pip install -e ".[dev,notebooks]"` (README, CI),
which installs it, so a missing front end is a packaging failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def _jupyter() -> str:
    """The `jupyter` command of this Python's environment (its scripts folder first, then PATH)."""
    here = os.path.dirname(sys.executable)
    found = shutil.which("jupyter", path=here) or shutil.which("jupyter")
    assert found, 'no `jupyter` command: install the notebooks extra (pip install -e ".[dev,notebooks]")'
    return found


@pytest.mark.parametrize("subcommand", ["nbconvert", "lab"])
def test_the_jupyter_front_end_runs(subcommand):
    run = subprocess.run([_jupyter(), subcommand, "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    major = int(run.stdout.strip().splitlines()[-1].split(".")[0])
    assert major >= {"nbconvert": 7, "lab": 4}[subcommand], run.stdout
