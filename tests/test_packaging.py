"""The wheel: licence, built-in models with their cards, nothing only a checkout needs, no setuptools warnings, the
notebooks extra's Jupyter front end; and the README's install line, which CI (.ci/run) runs as it stands.

The wheel is built from a copy of the sources (what pyproject.toml packages), so the working tree gets no build/
folder and no file left there by an earlier build can slip into it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "kvpress_phase", "evaluation", "training", "kernels", "cli"]
MODELS = ["builtin_model", "builtin_model_chunked"]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of CPU builds: a plain ``pip install torch`` from PyPI pulls the CUDA build and its ``nvidia-*``
packages; from this index ``torch==X`` resolves to ``X+cpu`` (a local version sorts above the plain one)."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(names in the wheel, the wheel's path, the build's output)."""
    pytest.importorskip("setuptools", minversion="77")  # the build backend pyproject.toml asks for (PEP 639 licence)
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


def test_the_wheel_names_its_project_urls(wheel):
    names, path, _ = wheel
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(path) as zf:
        meta = zf.read(metadata).decode().splitlines()
    urls = dict(line.split(": ", 1)[1].split(", ", 1) for line in meta if line.startswith("Project-URL: "))
    assert urls.get("kvpress", "").startswith("https://github.com/NVIDIA/kvpress")
    assert urls.get("Paper", "").startswith("https://arxiv.org/abs/")


@pytest.mark.parametrize("model", MODELS)
def test_each_built_in_model_ships_with_its_card(wheel, model):
    names, _, _ = wheel
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
                 "training_log.json"]:  # kvpress-phase eval reads the trained context length from training_log.json
        assert f"kvpress_phase/{model}/{name}" in names


@pytest.mark.parametrize("folder", ["smollm2", "qwen2_5_coder_0_5b"])
def test_each_shipped_scorer_ships_with_its_calibration(wheel, folder):
    names, _, _ = wheel  # thresholds.json: what threshold_budget and dms_kvzap read
    for name in ["config.json", "model.safetensors", "thresholds.json"]:
        assert f"kvpress_phase/scorers/{folder}/{name}" in names


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


def test_the_notebooks_extra_installs_the_jupyter_front_end(wheel):
    """`jupyter lab notebooks/` (README) and `jupyter nbconvert` need JupyterLab and nbconvert, not only a kernel."""
    _, path, _ = wheel
    with zipfile.ZipFile(path) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(metadata).decode().splitlines()
    extra = {line.split(":", 1)[1].split(";")[0].strip() for line in lines
             if line.startswith("Requires-Dist:") and 'extra == "notebooks"' in line}
    assert {"jupyterlab>=4", "nbconvert>=7", "nbclient>=0.10", "ipykernel>=6.29"} <= extra, extra


# --------------------------------------------------------------------------------------- the README's install line
def _install_commands() -> list[list[str]]:
    """The README's install commands as CI runs them (.ci/install_commands.py), split into arguments."""
    spec = importlib.util.spec_from_file_location("install_commands", os.path.join(ROOT, ".ci", "install_commands.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return [shlex.split(c) for c in module.install_commands(fh.read())]


def test_the_readme_installs_a_cpu_build_of_torch_first_then_the_package_with_its_extras():
    torch_first, package = _install_commands()
    assert torch_first[:2] == ["pip", "install"] and torch_first[2].startswith("torch==")
    # PyTorch's documented way to a CPU build; --index-url would also move every dependency off PyPI
    assert torch_first[3:] == ["--extra-index-url", CPU_INDEX]
    assert package == ["pip", "install", "-e", ".[dev,notebooks]"]


def test_ci_runs_the_readme_install_commands_and_nothing_else():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        script = [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    assert 'commands="$(python .ci/install_commands.py)"' in script
    assert 'eval "$command" </dev/null' in script
    assert not [line for line in script if re.search(r"\bpip\b", line)]  # no install of its own
    assert script[-1] == "python -m pytest"
    printed = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "install_commands.py")],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert [shlex.split(c) for c in printed] == _install_commands()
