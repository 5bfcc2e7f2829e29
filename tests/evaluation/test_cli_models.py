"""The kvpress-phase command's models: a name the registry does not hold, a hub that cannot be reached, a folder that
is not a model, the default model recorded in the run, and a dtype the device runs slowly (one line each, exit 2 or a
warning)."""

from __future__ import annotations

import json
import os

import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation.config import EvalConfig


# ------------------------------------------------------------------------------------------------ model loading
def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvpress-phase: error:") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["eval", "train"])
def test_unknown_model_name_names_the_registered_models_without_asking_the_hub_offline(command, tmp_path, capsys,
                                                                                       monkeypatch):
    import huggingface_hub

    from kvpress_phase.builtin import BUILTIN_MODELS

    def asked(*args, **kwargs):
        raise AssertionError("the hub was asked while HF_HUB_OFFLINE is set")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", asked)
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "--model", "nosuchmodel", "--output-dir", str(tmp_path / "out")]) == 2
    err = _one_error_line(capsys)
    assert "'nosuchmodel'" in err and "registered model" in err and "HF_HUB_OFFLINE" in err
    assert all(name in err for name in BUILTIN_MODELS) and len(BUILTIN_MODELS) >= 3
    assert err.index("smollm2") < err.index("HF_HUB_OFFLINE")  # the registered names first, then the hub


def test_unknown_model_name_with_the_hub_unreachable_fails_fast(tmp_path, capsys, monkeypatch):
    import time

    from huggingface_hub import constants

    # online, with HF_ENDPOINT=http://127.0.0.1:9 (nothing listens on port 9) and an empty hub cache: what
    # huggingface_hub derives from those variables when it is imported
    endpoint = "http://127.0.0.1:9"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.monotonic()
    assert cli.main(["eval", "--model", "nosuchmodel", "--output-dir", str(tmp_path / "out")]) == 2
    assert time.monotonic() - start < 15  # one request, no retries (transformers retried for about 50 s)
    err = _one_error_line(capsys)
    assert "builtin, chunked, smollm2" in err and f"{endpoint} could not be reached" in err
    assert err.index("smollm2") < err.index(endpoint)


_REFUSED = """
import sys
from kvpress_phase.cli import main
code = main(sys.argv[1:])
print(" ".join(m for m in ("torch", "kvpress", "transformers") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize("command", [["eval"], ["eval", "--dry-run"], ["audit", "chunkkv"], ["train"],
                                     ["train-scorer"], ["calibrate-scorer"]])
def test_an_unknown_model_name_is_refused_first_in_a_fresh_process_naming_the_known_ones(command, tmp_path):
    """Each command run alone, as a user runs it: an unknown ``--model`` exits 2 with one line naming the registered
    models, before anything imports torch, kvpress or transformers (which took 5-7 s to be refused)."""
    import subprocess
    import sys

    from kvpress_phase.builtin import BUILTIN_MODELS

    args = [*command, "--model", "bogus"]
    args += ["--output-dir", str(tmp_path / "out")] if command[0] in ("eval", "audit", "train", "train-scorer") else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the hub is not asked: the message says so
    out = subprocess.run([sys.executable, "-c", _REFUSED, *args], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=120)
    err = [line for line in out.stderr.splitlines() if not line.startswith("kvpress-phase eval ")]  # audit's command
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("kvpress-phase: error: model 'bogus' cannot be loaded"), out.stderr
    assert all(name in err[0] for name in BUILTIN_MODELS) and "`kvpress-phase list`" in err[0]
    assert out.stdout.split() == []  # imported none of torch, kvpress, transformers
    assert not (tmp_path / "out").exists()


def test_the_installed_command_refuses_an_unknown_model_with_exit_code_2(tmp_path):
    import shutil
    import subprocess
    import sys

    from kvpress_phase.builtin import BUILTIN_MODELS

    script = shutil.which("kvpress-phase", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    command = [script] if script else [sys.executable, "-m", "kvpress_phase.cli"]
    out = subprocess.run([*command, "eval", "--model", "bogus"], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kvpress-phase: error: model 'bogus'") and len(out.stderr.splitlines()) == 1
    assert f"({', '.join(BUILTIN_MODELS)}; see `kvpress-phase list`)" in out.stderr


def test_hub_ids_the_hub_has_still_go_to_transformers(monkeypatch):
    import huggingface_hub

    from kvpress_phase.builtin import model_path

    asked = []
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, **kw: asked.append(url))
    assert model_path("some-org/some-model") == "some-org/some-model"
    assert len(asked) == 1 and "some-org/some-model" in asked[0] and asked[0].endswith("config.json")


@pytest.mark.parametrize("tokenizer_file", ["tokenizer.json", "tokenizer_config.json"])
def test_a_model_folder_with_a_malformed_tokenizer_is_refused_in_one_line(tokenizer_file, tmp_path, capsys):
    """transformers raises a KeyError for a tokenizer.json without its fields and an ImportError for a
    tokenizer_config.json that names no class: both are bad input, exit 2 in one line."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in [("config.json", "{}"), (tokenizer_file, "{}"), ("model.safetensors", "")]:
        (folder / name).write_text(text)
    assert cli.main(["eval", "--model", str(folder), "--output-dir", str(tmp_path / "out")]) == 2
    assert f"--model '{folder}' cannot be loaded: " in _one_error_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["eval", "train"])
def test_empty_or_incomplete_model_folder_names_what_is_missing(command, model_dir, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    os.mkdir("emptydir")
    assert cli.main([command, "--model", "./emptydir", "--output-dir", str(tmp_path / "out")]) == 2
    err = _one_error_line(capsys)
    assert "'./emptydir'" in err and "no config.json" in err and "no tokenizer files" in err and "no weights" in err
    incomplete = tmp_path / "incomplete"
    shutil.copytree(model_dir, incomplete, ignore=shutil.ignore_patterns("*.safetensors"))
    assert cli.main([command, "--model", str(incomplete), "--output-dir", str(tmp_path / "out")]) == 2
    err = _one_error_line(capsys)
    assert "no weights (*.safetensors or *.bin)" in err and "config.json" not in err and "tokenizer" not in err


def test_default_model_is_recorded_and_old_runs_without_it_resume(model_dir, tmp_path, capsys):
    from kvpress_phase.evaluation.store import RESULTS_DIR

    out = tmp_path / "run"
    args = ["eval", "--tasks", "niah_single", "--presses", "no_press", "--strides", "4", "--context-lengths", "64",
            "--samples", "1", "--no-diagnostics", "--device", "cpu", "--output-dir", str(out), "--no-progress",
            "--bootstrap", "100"]
    assert cli.main(args) == 0
    assert "warning" not in capsys.readouterr().err  # float32 on the CPU: nothing to say
    saved = json.loads((out / "config.json").read_text())
    assert saved["config"]["model"] == "builtin"
    # the config.json of the same run made before the default model was recorded
    old = {**saved["config"], "model": None}
    (out / "config.json").write_text(json.dumps({"config": old, "fingerprint": EvalConfig(**old).fingerprint()}))
    shard = out / RESULTS_DIR / "results-rank0.jsonl"
    rows = shard.read_text()
    assert cli.main(args) == 0  # resumed: nothing left to run
    assert shard.read_text() == rows
    # but another model does not resume that run
    assert cli.main(args + ["--model", model_dir]) == 2
    assert f"holds a run with no --model; this command has --model {model_dir} (" in capsys.readouterr().err


def test_slow_dtype_on_the_device_is_a_one_line_warning(model_dir, tmp_path, capsys):
    args = ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press", "--strides", "4",
            "--context-lengths", "64", "--samples", "1", "--no-diagnostics", "--device", "cpu", "--dtype", "bfloat16",
            "--output-dir", str(tmp_path / "run"), "--no-progress", "--bootstrap", "100"]
    assert cli.main(args) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("kvpress-phase: warning: --dtype bfloat16")
    assert "CPU" in warnings[0] and "float32" in warnings[0]


def test_dtype_warning_on_a_gpu_without_native_bfloat16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    from kvpress_phase.evaluation.commands import _dtype_warning as warning
    assert "bfloat16" in warning("bfloat16", "cuda:0") and "float16" in warning("float16", "cpu")
    assert warning("float16", "cuda") is None and warning("float32", "cpu") is None


def test_audit_is_the_eval_preset_it_prints(model_dir, tmp_path, capsys):
    """`kvpress-phase audit` runs the presses given beside no compression and ChunkedStridePress in both modes, under
    the prefix protocol with matched caches, at every phase of each chunk length, and prints the eval command it is."""
    out = tmp_path / "audit"
    code = cli.main(["audit", "chunk:scorer=keydiff,chunkkv", "--model", model_dir, "--chunk-lengths", "4",
                     "--compression-ratios", "0.5", "--tasks", "niah_single", "--context-lengths", "128",
                     "--samples", "1", "--output-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["protocol"] == "prefix" and config["matched_cache"] and config["strides"] == [4]
    assert config["presses"] == ["no_press", "chunk:scorer=keydiff", "chunkkv", "chunked_stride",
                                 "chunked_stride:mode=pool"]
    summary = json.loads((out / "summary.json").read_text())
    assert {r["press"] for r in summary} == set(config["presses"])
    assert all(len(r["per_phase"]) == 4 for r in summary)
    assert "kvpress-phase eval --protocol prefix --matched-cache" in err
    # the printed command is the run: rerunning it resumes the same output directory with nothing left to do
    command = [line for line in err.splitlines() if line.startswith("kvpress-phase eval")][0].split()[1:]
    assert cli.main(command) == 0
