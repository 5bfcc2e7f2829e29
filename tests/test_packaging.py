"""The wheel: licence, built-in models with their cards, nothing only a checkout needs, no setuptools warnings.

The wheel is built from a copy of the sources (what pyproject.toml packages), so the working tree gets no build/
folder and no file left there by an earlier build can slip into it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "kvpress_phase", "evaluation", "training", "kernels", "cli"]
MODELS = ["builtin_model", "builtin_model_chunked"]

pytest.importorskip("setuptools", minversion="77")  # the build backend pyproject.toml asks for (PEP 639 licence)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(names in the wheel, the wheel's path, the build's output)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif os.path.exists(path):  # a missing LICENSE fails the build, which the test reports
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp / "out"), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (path,) = (tmp / "out").glob("kvpress_phase-*.whl")
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
    return names, path, build.stdout + build.stderr


def test_the_licence_ships_and_is_declared(wheel):
    names, path, _ = wheel
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(path) as zf:
        text = zf.read(licence).decode()
        meta = zf.read(metadata).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "License-Expression: Apache-2.0" in meta.splitlines()


@pytest.mark.parametrize("model", MODELS)
def test_each_built_in_model_ships_with_its_card(wheel, model):
    names, _, _ = wheel
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
                 "training_log.json"]:  # kvpress-phase eval reads the trained context length from training_log.json
        assert f"kvpress_phase/{model}/{name}" in names


def test_files_only_a_checkout_reads_stay_out(wheel):
    names, _, _ = wheel
    assert not [n for n in names if n.endswith(".png")]  # loss curves: read by the repository's cards only


def test_setuptools_does_not_warn_about_the_configuration(wheel):
    _, _, output = wheel
    assert "absent from the `packages` configuration" not in output
    assert "SetuptoolsDeprecationWarning" not in output


def test_the_command_ships_and_is_the_console_script(wheel):
    names, path, _ = wheel
    assert {"kvpress_phase/cli/__init__.py", "kvpress_phase/cli/__main__.py"} <= names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(path) as zf:
        text = zf.read(entry_points).decode()
    assert "kvpress-phase = kvpress_phase.cli:main" in text.splitlines()
